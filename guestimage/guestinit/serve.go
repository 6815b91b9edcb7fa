//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"
)

// maxBurnSeconds bounds /burn, so a stray request cannot pin the guest.
const maxBurnSeconds = 30

// startServers binds both listeners before returning, then serves in the
// background.
func startServers(id identity) error {
	ln, err := net.Listen("tcp", httpAddr)
	if err != nil {
		return fmt.Errorf("listen http: %w", err)
	}
	body := fmt.Sprintf("hostname=%s instance-id=%s\n", id.Hostname, id.InstanceID)
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprint(w, body)
	})
	mux.HandleFunc("/resolve", resolve)
	mux.HandleFunc("/burn", burn)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Error("http server", "err", err)
		}
	}()

	pc, err := net.ListenPacket("udp", echoAddr)
	if err != nil {
		return fmt.Errorf("listen udp echo: %w", err)
	}
	go echo(pc)

	sl, err := net.Listen("tcp", sshAddr)
	if err != nil {
		return fmt.Errorf("listen ssh: %w", err)
	}
	go greet(sl)
	return nil
}

// resolve looks a name up with the guest's own resolver (the one DHCP
// announced, in /etc/resolv.conf) and answers its addresses, one a line.
func resolve(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("name")
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupHost(ctx, name)
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err != nil {
		w.WriteHeader(http.StatusBadGateway)
		fmt.Fprintln(w, err)
		return
	}
	for _, a := range addrs {
		fmt.Fprintln(w, a)
	}
}

// burn keeps every CPU of the guest busy for ?seconds= (1 to
// maxBurnSeconds), then answers: the host's usage samples of a guest are
// tested against a load the test turns on and off.
func burn(w http.ResponseWriter, r *http.Request) {
	secs, err := strconv.Atoi(r.URL.Query().Get("seconds"))
	if err != nil || secs < 1 || secs > maxBurnSeconds {
		http.Error(w, fmt.Sprintf("seconds: a whole number from 1 to %d", maxBurnSeconds), http.StatusBadRequest)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(secs)*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for range runtime.NumCPU() {
		wg.Go(func() {
			for ctx.Err() == nil {
			}
		})
	}
	wg.Wait()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "burned %d cpus for %ds\n", runtime.NumCPU(), secs)
}

// greet stands in for sshd: it sends an SSH identification line and hangs
// up, which is all a readiness probe of port 22 looks for.
func greet(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			slog.Error("ssh greeter", "err", err)
			return
		}
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c, "SSH-2.0-eitri-guest\r\n")
		c.Close()
	}
}

// phoneHome posts to the seed's phone-home URL, as the seed's unit does once
// cloud-init has finished, retrying while the host's endpoint cannot be reached.
func phoneHome(ctx context.Context, id identity) {
	client := &http.Client{Timeout: 5 * time.Second}
	form := url.Values{"instance_id": {id.InstanceID}, "hostname": {id.Hostname}}
	for attempt := 1; attempt <= 30; attempt++ {
		resp, err := client.PostForm(id.PhoneHomeURL, form)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				fmt.Fprintf(os.Stdout, "EITRI-GUEST-PHONED-HOME attempt=%d\n", attempt)
				return
			}
			err = fmt.Errorf("status %s", resp.Status)
		}
		slog.Warn("phone home", "attempt", attempt, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

// echo answers every datagram with itself (RFC 862).
func echo(pc net.PacketConn) {
	buf := make([]byte, 65535)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			slog.Error("udp echo", "err", err)
			return
		}
		if _, err := pc.WriteTo(buf[:n], from); err != nil {
			slog.Warn("udp echo reply", "to", from, "err", err)
		}
	}
}
