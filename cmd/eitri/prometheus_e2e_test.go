package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/metrics/promtest"
	"github.com/a73x/eitri/wire/connclient"
)

// prometheusSeesTheGuest runs a real Prometheus against the dev instance in
// dir, whose guest vmID is ready (it shares another test's guest: one more
// boot under TCG would cost more than everything here). Through PromQL it
// sees the guest's CPU seconds grow, and the bytes of a TCP and a UDP port
// published on the guest match what went through them.
func prometheusSeesTheGuest(t *testing.T, dir, vmID string) {
	tok, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	token := strings.TrimSpace(string(tok))
	base := "http://127.0.0.1:18080"
	target, err := url.Parse(base)
	require.NoError(t, err)
	prom := promtest.Start(t, target, token, time.Second)
	ctx := context.Background()

	// The agent samples every second (dev runs with --usage-every 1s): the first value, then a later, larger one.
	cpu := fmt.Sprintf(`eitri_vm_cpu_seconds_total{vm=%q}`, vmID)
	var first float64
	require.Eventually(t, func() bool {
		v, ok := prom.Query(cpu)
		first = v
		return ok && v > 0
	}, time.Minute, 250*time.Millisecond, "prometheus never saw the guest's CPU seconds; its log:\n%s", prom)
	require.Eventually(t, func() bool { v, ok := prom.Query(cpu); return ok && v > first }, time.Minute, 250*time.Millisecond,
		"the guest's CPU seconds never grew past %v; prometheus' log:\n%s", first, prom)

	exps := eitriv1connect.NewExposureServiceClient(connclient.HTTPClient(""), base, connect.WithInterceptors(connclient.Bearer(token)))
	publish := func(protocol string, guestPort uint32) *eitriv1.Exposure {
		x, err := exps.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{
			VmId: vmID, GuestPort: guestPort, Protocol: protocol, Scope: "local"}))
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			l, err := exps.ListExposures(ctx, connect.NewRequest(&eitriv1.ListExposuresRequest{VmId: vmID}))
			if err != nil {
				return false
			}
			for _, e := range l.Msg.Exposures {
				if e.Id == x.Msg.Exposure.Id {
					return e.State == "active"
				}
			}
			return false
		}, 30*time.Second, 100*time.Millisecond, "the host binds the %s port", protocol)
		return x.Msg.Exposure
	}
	web, echo := publish("tcp", 80), publish("udp", 7)
	addr := func(x *eitriv1.Exposure) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(int(x.HostPort))) }

	// TCP: whole HTTP/1.0 exchanges, so every byte each way is known: what
	// was written, and what was read up to the guest's close.
	var webIn, webOut int
	for i := range 3 {
		c, err := net.DialTimeout("tcp", addr(web), 5*time.Second)
		require.NoError(t, err)
		require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
		req := fmt.Sprintf("GET /?n=%d HTTP/1.0\r\nHost: guest\r\n\r\n", i)
		_, err = io.WriteString(c, req)
		require.NoError(t, err)
		resp, err := io.ReadAll(c)
		c.Close()
		require.NoError(t, err)
		require.Contains(t, string(resp), "hostname=", "the guest's page")
		webIn, webOut = webIn+len(req), webOut+len(resp)
	}
	// UDP: payloads only, no headers; the guest echoes each one back.
	var echoIn int
	uc, err := net.Dial("udp", addr(echo))
	require.NoError(t, err)
	defer uc.Close()
	for _, size := range []int{1, 512, 1400, 8000} {
		msg := bytes.Repeat([]byte{'e'}, size)
		require.NoError(t, uc.SetDeadline(time.Now().Add(5*time.Second)))
		_, err := uc.Write(msg)
		require.NoError(t, err)
		buf := make([]byte, 65536)
		n, err := uc.Read(buf)
		require.NoError(t, err, "the guest echoes %d bytes", size)
		require.Equal(t, size, n)
		echoIn += size
	}

	bytesOf := func(x *eitriv1.Exposure, direction string) string {
		return fmt.Sprintf(`eitri_published_port_bytes_total{exposure=%q,direction=%q}`, x.Id, direction)
	}
	want := map[string]int{
		bytesOf(web, "in"): webIn, bytesOf(web, "out"): webOut,
		bytesOf(echo, "in"): echoIn, bytesOf(echo, "out"): echoIn,
	}
	got := map[string]float64{}
	require.Eventually(t, func() bool {
		all := true
		for q, n := range want {
			v, ok := prom.Query(q)
			got[q] = v
			all = all && ok && v == float64(n)
		}
		return all
	}, time.Minute, 250*time.Millisecond, "prometheus' view of the ports' bytes %v, want %v; its log:\n%s", got, want, prom)
	for _, x := range []*eitriv1.Exposure{web, echo} {
		v, ok := prom.Query(fmt.Sprintf(`eitri_published_port_dropped_total{exposure=%q,protocol=%q,vm=%q}`, x.Id, x.Protocol, vmID))
		assert.True(t, ok, "the %s port's labels", x.Protocol)
		assert.Zero(t, v, "the %s port dropped nothing", x.Protocol)
	}
	t.Logf("through prometheus: cpu %v s then more; tcp %d in / %d out; udp %d each way", first, webIn, webOut, echoIn)

	for _, x := range []*eitriv1.Exposure{web, echo} {
		_, err := exps.DeleteExposure(ctx, connect.NewRequest(&eitriv1.DeleteExposureRequest{Id: x.Id}))
		require.NoError(t, err)
	}
}
