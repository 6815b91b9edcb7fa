package consolerelay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// GuestAddr is a VM's address on its host's bridge, only while its guest
// runs (the exposure proxy's lookup).
type GuestAddr func(vmID string) (netip.Addr, bool)

const (
	// tunnelChunk is the most one Tunnel frame carries (the control plane
	// refuses more).
	tunnelChunk = 32 << 10
	// dialGuest bounds the connect to the guest.
	dialGuest = 10 * time.Second
)

// tunnelSender is the sending half of a Tunnel stream.
type tunnelSender interface {
	Send(*eitriv1.TunnelRequest) error
}

func (r *relay) refuseTunnel(ctx context.Context, c *eitriv1.CallsResponse, code, why string) {
	st := r.api(c).Tunnel(ctx)
	if err := st.Send(&eitriv1.TunnelRequest{CallId: c.GetId()}); err != nil {
		return
	}
	_ = st.Send(&eitriv1.TunnelRequest{ErrorCode: code, Error: why})
	_ = st.CloseRequest()
	_, _ = st.Receive()
	_ = st.CloseResponse()
}

// tunnel answers one tunnel call: it connects to the guest's port (the
// VM's own address, only while it runs) and carries bytes both ways until
// the control plane ends the stream. Half-closes pass through: the guest's
// EOF is sent as eof, the control plane's eof shuts the guest connection
// for writing. One frame is in flight each way, so a side that stops
// reading stops the other side's reads (TCP and HTTP/2 windows push back).
func (r *relay) tunnel(ctx context.Context, c *eitriv1.CallsResponse) {
	callID, call := c.GetId(), c.GetTunnel()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	conn, code, why := r.dialGuest(ctx, call)
	if conn == nil {
		r.refuseTunnel(ctx, c, code, why)
		return
	}
	st := r.api(c).Tunnel(ctx)
	defer func() { _ = st.CloseResponse() }()
	if err := st.Send(&eitriv1.TunnelRequest{CallId: callID}); err != nil {
		conn.Close()
		r.log.Debug("cannot answer a tunnel call", "call", callID, "err", err)
		return
	}
	if err := st.Send(&eitriv1.TunnelRequest{Connected: true}); err != nil {
		conn.Close()
		return
	}
	// Only this goroutine sends on st from here; the loop below receives.
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		// When the guest side is done, the stream stays up until the
		// control plane ends it (its caller may still be sending).
		if err := guestToStream(conn, st); err != nil {
			r.log.Debug("tunnel from the guest ended", "call", callID, "err", err)
		}
	}()
	broken := false
	for {
		m, err := st.Receive()
		if err != nil {
			break // the control plane ended the tunnel
		}
		if len(m.GetData()) > 0 && !broken {
			if _, err := conn.Write(m.GetData()); err != nil {
				// Closing it fails the read above, which says so.
				broken = true
				conn.Close()
			}
		}
		if m.GetEof() && !broken {
			if cw, ok := conn.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			}
		}
	}
	conn.Close()
	cancel()
	<-sent
	_ = st.CloseRequest()
}

// dialGuest connects to the call's port of its VM's guest, or says why
// not (an error code and a sentence).
func (r *relay) dialGuest(ctx context.Context, call *eitriv1.TunnelCall) (net.Conn, string, string) {
	port := call.GetPort()
	if port == 0 || port > 65535 {
		return nil, "failed_precondition", fmt.Sprintf("port %d is not a TCP port", port)
	}
	if r.guests == nil {
		return nil, "unavailable", "this host does not carry tunnels"
	}
	ip, ok := r.guests(call.GetVmId())
	if !ok {
		return nil, "failed_precondition", fmt.Sprintf("vm %s is not running on this host, or has no address yet", call.GetVmId())
	}
	d := net.Dialer{Timeout: dialGuest}
	to := netip.AddrPortFrom(ip, uint16(port))
	conn, err := d.DialContext(ctx, "tcp", to.String())
	if err != nil {
		return nil, "failed_precondition", fmt.Sprintf("the guest does not take connections on port %d (%s)", port, dialReason(err))
	}
	return conn, "", ""
}

// dialReason is why a dial failed, without the addresses (the caller knows
// them).
func dialReason(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err.Error()
	}
	return err.Error()
}

// guestToStream sends what the guest writes until it half-closes (then
// eof, and nil) or the connection fails.
func guestToStream(conn net.Conn, st tunnelSender) error {
	buf := make([]byte, tunnelChunk)
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			// Send encodes the frame before it returns, so buf is free again.
			if serr := st.Send(&eitriv1.TunnelRequest{Data: buf[:n]}); serr != nil {
				return serr
			}
		}
		if errors.Is(err, io.EOF) {
			return st.Send(&eitriv1.TunnelRequest{Eof: true})
		}
		if err != nil {
			_ = st.Send(&eitriv1.TunnelRequest{ErrorCode: "unavailable", Error: "the guest connection failed: " + dialReason(err)})
			return err
		}
	}
}
