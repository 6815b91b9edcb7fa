//go:build linux

package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// startServers binds both listeners before returning, then serves in the
// background.
func startServers(id identity) error {
	ln, err := net.Listen("tcp", httpAddr)
	if err != nil {
		return fmt.Errorf("listen http: %w", err)
	}
	body := fmt.Sprintf("hostname=%s instance-id=%s\n", id.Hostname, id.InstanceID)
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			fmt.Fprint(w, body)
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
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
	return nil
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
