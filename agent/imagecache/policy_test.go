package imagecache

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/permanent"
)

var loopbackPrefixes = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}

// loopbackCache is New with loopback allowed, as an operator would with
// --image-allow: the tests' image servers are httptest servers on 127.0.0.1.
func loopbackCache(dir string, opts ...Option) *Cache {
	return New(dir, append([]Option{WithDialPolicy(AddressPolicy{Allow: loopbackPrefixes})}, opts...)...)
}

const hint = "an operator can allow it with --image-allow"

// acceptCounter is a TCP listener that counts the connections it gets and
// answers each with an HTTP response holding secret, so a test can tell
// both whether anything connected and whether what it said leaked.
type acceptCounter struct {
	net.Listener
	n atomic.Int64
}

func listenCounting(t *testing.T, addr, secret string) *acceptCounter {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	a := &acceptCounter{Listener: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			a.n.Add(1)
			go func() {
				defer c.Close()
				_, _ = bufio.NewReader(c).ReadString('\n')
				body := "instance-id: " + secret
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			}()
		}
	}()
	return a
}

func (a *acceptCounter) port() string {
	_, p, _ := net.SplitHostPort(a.Addr().String())
	return p
}

// requireRefused asserts err is the policy's refusal of addr for why, that
// it is permanent, and that it quotes nothing a server said.
func requireRefused(t *testing.T, err error, addr, why string) {
	t.Helper()
	require.Error(t, err)
	refused, ok := errors.AsType[*RefusedAddressError](err)
	require.True(t, ok, "want a refusal, got %v", err)
	assert.Equal(t, addr, refused.Addr.String())
	assert.Contains(t, err.Error(), "image_url: ")
	assert.Contains(t, err.Error(), " is not allowed for image downloads ("+why)
	assert.True(t, permanent.Is(err), "a refusal is permanent: %v", err)
	assert.NotContains(t, err.Error(), "SECRET")
	assert.NotContains(t, err.Error(), "instance-id")
}

// The attack: image_url pointing at the agent's own loopback (an admin
// socket, the control plane in dev mode). A real server listens there; the
// refusal happens before connect, so it never sees a connection.
func TestSSRFLoopbackImageURLRefusedBeforeConnecting(t *testing.T) {
	for _, addr := range []string{"127.0.0.1:0", "[::1]:0"} {
		t.Run(addr, func(t *testing.T) {
			probe, err := net.Listen("tcp", addr)
			if err != nil {
				t.Skipf("no %s here: %v", addr, err)
			}
			probe.Close()
			srv := listenCounting(t, addr, "SECRET-loopback")
			dir := t.TempDir()
			c := New(dir, WithDialPolicy(AddressPolicy{Hint: hint}))
			_, err = c.Ensure(context.Background(), "http://"+srv.Addr().String()+"/latest/meta-data", digest([]byte("x")), nil)
			host, _, _ := net.SplitHostPort(srv.Addr().String())
			requireRefused(t, err, host, "loopback")
			assert.Equal(t, "image_url: address "+host+" is not allowed for image downloads (loopback); "+hint, err.Error())
			assert.Zero(t, srv.n.Load(), "the loopback server was never connected to")
			assert.Empty(t, dirNames(t, dir))
		})
	}
}

// The attack: literal private, metadata and special addresses, in every
// spelling (IPv4-mapped, NAT64, 6to4, 0.0.0.0 which Linux connects to
// loopback). The Control hook refuses them before connect, so no packet
// leaves this machine.
func TestSSRFLiteralNonPublicImageURLsRefusedAtDial(t *testing.T) {
	cases := []struct{ url, addr, why string }{
		{"http://169.254.169.254/latest/meta-data/", "169.254.169.254", "link-local"},
		{"http://10.1.2.3/img", "10.1.2.3", "private"},
		{"http://172.16.5.4:8080/img", "172.16.5.4", "private"},
		{"http://192.168.1.1/img", "192.168.1.1", "private"},
		{"http://100.64.0.1/img", "100.64.0.1", "shared address space (carrier-grade NAT)"},
		{"http://0.0.0.0:22/img", "0.0.0.0", "unspecified"},
		{"http://[::]:22/img", "::", "unspecified"},
		{"https://127.0.0.1/img", "127.0.0.1", "loopback"},
		{"http://[::ffff:127.0.0.1]/img", "127.0.0.1", "loopback"},
		{"http://[::ffff:169.254.169.254]/img", "169.254.169.254", "link-local"},
		{"http://[64:ff9b::a9fe:a9fe]/img", "64:ff9b::a9fe:a9fe", "link-local, via NAT64"},
		{"http://[2002:a9fe:a9fe::]/img", "2002:a9fe:a9fe::", "link-local, via 6to4"},
		{"http://[fd00:ec2::254]/img", "fd00:ec2::254", "unique local"},
		{"http://[fe80::1]/img", "fe80::1", "link-local"},
		{"http://224.0.0.1/img", "224.0.0.1", "multicast"},
	}
	for _, tc := range cases {
		t.Run(tc.url, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			dir := t.TempDir()
			_, err := New(dir, WithDialPolicy(AddressPolicy{Hint: hint})).Ensure(ctx, tc.url, digest([]byte("x")), nil)
			requireRefused(t, err, tc.addr, tc.why)
			assert.Empty(t, dirNames(t, dir))
		})
	}
}

// dnsServer is a tiny DNS responder on loopback for a custom resolver: the
// tests need names that resolve to addresses of their choosing.
type dnsServer struct {
	mu      sync.Mutex
	answer  func(name string, qtype uint16, n int) []netip.Addr
	queries map[string]int
	addr    string
}

func startDNS(t *testing.T, answer func(name string, qtype uint16, n int) []netip.Addr) (*dnsServer, *net.Resolver) {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	d := &dnsServer{answer: answer, queries: map[string]int{}, addr: pc.LocalAddr().String()}
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if resp := d.reply(buf[:n]); resp != nil {
				_, _ = pc.WriteTo(resp, from)
			}
		}
	}()
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		if network != "udp" && network != "udp4" {
			return nil, fmt.Errorf("test DNS serves udp only, not %s", network)
		}
		var dl net.Dialer
		return dl.DialContext(ctx, "udp", d.addr)
	}}
	return d, r
}

func (d *dnsServer) reply(q []byte) []byte {
	if len(q) < 12 {
		return nil
	}
	// One question: labels, then type and class.
	i := 12
	var labels []string
	for i < len(q) && q[i] != 0 {
		l := int(q[i])
		if i+1+l > len(q) {
			return nil
		}
		labels = append(labels, string(q[i+1:i+1+l]))
		i += 1 + l
	}
	if i+5 > len(q) {
		return nil
	}
	question := q[12 : i+5]
	qtype := binary.BigEndian.Uint16(q[i+1:])
	name := strings.ToLower(strings.Join(labels, "."))
	d.mu.Lock()
	key := name + "/" + strconv.Itoa(int(qtype))
	d.queries[key]++
	addrs := d.answer(name, qtype, d.queries[key])
	d.mu.Unlock()

	out := append([]byte{}, q[0], q[1], 0x81, 0x80, 0, 1, 0, 0, 0, 0, 0, 0)
	if addrs == nil {
		out[3] = 0x83 // NXDOMAIN
	}
	out = append(out, question...)
	var count uint16
	for _, a := range addrs {
		if (qtype == 1) != a.Is4() {
			continue
		}
		out = append(out, 0xc0, 12) // the question's name
		out = binary.BigEndian.AppendUint16(out, qtype)
		out = append(out, 0, 1, 0, 0, 0, 0) // class IN, TTL 0
		b := a.AsSlice()
		out = binary.BigEndian.AppendUint16(out, uint16(len(b)))
		out = append(out, b...)
		count++
	}
	binary.BigEndian.PutUint16(out[6:], count)
	return out
}

// The attack: a name the attacker controls that resolves to the metadata
// service, a LAN address or loopback. The check is on the address dialed,
// after resolution, so a name is no way around it.
func TestSSRFNameResolvingToNonPublicAddressRefused(t *testing.T) {
	target := listenCounting(t, "127.0.0.1:0", "SECRET-by-name")
	_, resolver := startDNS(t, func(name string, qtype uint16, _ int) []netip.Addr {
		switch name {
		case "metadata.attacker.test":
			return []netip.Addr{netip.MustParseAddr("169.254.169.254")}
		case "lan.attacker.test":
			return []netip.Addr{netip.MustParseAddr("10.0.0.7"), netip.MustParseAddr("fd00::7")}
		case "loopback.attacker.test":
			return []netip.Addr{netip.MustParseAddr("127.0.0.1")}
		case "mapped.attacker.test":
			return []netip.Addr{netip.MustParseAddr("::ffff:127.0.0.1")}
		}
		return nil
	})
	cases := []struct{ host, addr, why string }{
		{"metadata.attacker.test", "169.254.169.254", "link-local"},
		{"lan.attacker.test", "", "unique local"}, // whichever family is dialed first
		{"loopback.attacker.test", "127.0.0.1", "loopback"},
		{"mapped.attacker.test", "127.0.0.1", "loopback"},
	}
	for _, tc := range cases {
		t.Run(tc.host, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c := New(t.TempDir(), WithDialPolicy(AddressPolicy{Hint: hint}))
			c.resolver = resolver
			_, err := c.Ensure(ctx, "http://"+tc.host+":"+target.port()+"/img", digest([]byte("x")), nil)
			require.Error(t, err)
			refused, ok := errors.AsType[*RefusedAddressError](err)
			require.True(t, ok, "want a refusal, got %v", err)
			if tc.addr == "" {
				assert.Contains(t, []string{"10.0.0.7", "fd00::7"}, refused.Addr.String())
				return
			}
			requireRefused(t, err, tc.addr, tc.why)
		})
	}
	assert.Zero(t, target.n.Load(), "nothing connected to the loopback server")
}

// The attack: DNS rebinding. The name first resolves to an address the
// policy allows, the server there redirects to the same name, and the second
// lookup answers with an address it does not. The check runs at every
// connect, so the second dial is refused.
func TestSSRFDNSRebindingAcrossRedirectRefusedAtSecondDial(t *testing.T) {
	inside := listenCounting(t, "127.0.0.2:0", "SECRET-rebound")
	var hits atomic.Int64
	outside := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Redirect(w, r, "/again", http.StatusFound)
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:"+inside.port())
	if err != nil {
		t.Skipf("127.0.0.1:%s is taken: %v", inside.port(), err)
	}
	outside.Listener.Close()
	outside.Listener = ln
	outside.Start()
	t.Cleanup(outside.Close)
	_, resolver := startDNS(t, func(name string, qtype uint16, n int) []netip.Addr {
		if name != "rebind.attacker.test" {
			return nil
		}
		if n == 1 {
			return []netip.Addr{netip.MustParseAddr("127.0.0.1")}
		}
		return []netip.Addr{netip.MustParseAddr("127.0.0.2")}
	})
	// The operator allowed 127.0.0.1 only (think: their mirror).
	c := New(t.TempDir(), WithDialPolicy(AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Hint: hint}))
	c.resolver = resolver
	_, err = c.Ensure(context.Background(), "http://rebind.attacker.test:"+inside.port()+"/img", digest([]byte("x")), nil)
	requireRefused(t, err, "127.0.0.2", "loopback")
	assert.Contains(t, err.Error(), "redirect 1 leads to address 127.0.0.2")
	assert.Equal(t, int64(1), hits.Load(), "the allowed server was asked once")
	assert.Zero(t, inside.n.Load(), "the rebound address was never connected to")
}

// The attack: an allowed server (here the operator allowed 127.0.0.1)
// redirects to a refused one: the metadata service, or another loopback
// address. The second dial is refused, and the error names neither the
// Location nor anything the first server sent.
func TestSSRFRedirectFromAllowedToRefusedAddressRefusedAtSecondDial(t *testing.T) {
	inside := listenCounting(t, "127.0.0.2:0", "SECRET-inside")
	for _, tc := range []struct{ location, addr, why string }{
		{"http://" + inside.Addr().String() + "/SECRET-path", "127.0.0.2", "loopback"},
		{"http://169.254.169.254/latest/meta-data/iam/SECRET", "169.254.169.254", "link-local"},
		{"http://[::ffff:10.0.0.1]/SECRET", "10.0.0.1", "private"},
	} {
		t.Run(tc.addr, func(t *testing.T) {
			outside := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Location", tc.location)
				w.WriteHeader(http.StatusMovedPermanently)
				fmt.Fprint(w, "SECRET-redirect-body")
			}))
			t.Cleanup(outside.Close)
			dir := t.TempDir()
			c := New(dir, WithDialPolicy(AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Hint: hint}))
			_, err := c.Ensure(context.Background(), outside.URL+"/img", digest([]byte("x")), nil)
			requireRefused(t, err, tc.addr, tc.why)
			assert.Equal(t, "image_url: redirect 1 leads to address "+tc.addr+", which is not allowed for image downloads ("+tc.why+"); "+hint, err.Error())
			assert.Empty(t, dirNames(t, dir))
		})
	}
	assert.Zero(t, inside.n.Load())
}

// The attack: an endless redirect chain holding a create. Redirects are
// capped.
func TestSSRFRedirectChainCapped(t *testing.T) {
	var hits atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		http.Redirect(w, r, fmt.Sprintf("/hop-%d-SECRET", n), http.StatusTemporaryRedirect)
	}))
	t.Cleanup(ts.Close)
	_, err := loopbackCache(t.TempDir()).Ensure(context.Background(), ts.URL+"/img", digest([]byte("x")), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), fmt.Sprintf("more than %d redirects", maxRedirects))
	assert.NotContains(t, err.Error(), "SECRET")
	assert.True(t, permanent.Is(err))
	assert.Equal(t, int64(maxRedirects+1), hits.Load())
}

// An operator's own mirror on a private network is admitted by --image-allow
// (here loopback stands in for it), redirects within it included, and only
// the prefixes named.
func TestSSRFImageAllowAdmitsOperatorCIDR(t *testing.T) {
	body := testImage(100_000)
	sum := digest(body)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/img" {
			http.Redirect(w, r, "/blobs/"+sum, http.StatusFound)
			return
		}
		w.Write(body)
	}))
	t.Cleanup(ts.Close)
	for _, allow := range []string{"127.0.0.0/8", "127.0.0.1/32", "::ffff:127.0.0.1/128"} {
		t.Run(allow, func(t *testing.T) {
			c := New(t.TempDir(), WithDialPolicy(AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix(allow)}}))
			p, err := c.Ensure(context.Background(), ts.URL+"/img", sum, nil)
			require.NoError(t, err)
			assert.FileExists(t, p)
		})
	}
	c := New(t.TempDir(), WithDialPolicy(AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}}))
	_, err := c.Ensure(context.Background(), ts.URL+"/img", sum, nil)
	requireRefused(t, err, "127.0.0.1", "loopback")
}

// The attack: learning what answered at an allowed address from last_error:
// the reason phrase of the status line, the body, a non-HTTP banner, a
// redirect's Location. Errors carry the status code and our own words only.
func TestSSRFErrorsEchoNothingTheServerSent(t *testing.T) {
	raw := func(reply string) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() {
					defer c.Close()
					_, _ = bufio.NewReader(c).ReadString('\n')
					fmt.Fprint(c, reply)
				}()
			}
		}()
		return "http://" + ln.Addr().String() + "/img"
	}
	cases := []struct{ name, url, want string }{
		{"reason phrase and body", raw("HTTP/1.1 404 SECRET-reason\r\nContent-Length: 11\r\n\r\nSECRET-body"), ": 404 Not Found"},
		{"server error body", raw("HTTP/1.1 500 SECRET\r\nX-Secret: SECRET-header\r\nContent-Length: 11\r\n\r\nSECRET-body"), ": 500 Internal Server Error"},
		{"unknown status", raw("HTTP/1.1 599 SECRET\r\nContent-Length: 0\r\n\r\n"), ": HTTP status 599"},
		{"ssh banner", raw("SSH-2.0-OpenSSH_SECRET\r\n"), "not a valid HTTP response"},
		{"redis reply", raw("-ERR SECRET unknown command 'GET'\r\n"), "not a valid HTTP response"},
		{"bad header", raw("HTTP/1.1 200 OK\r\nSECRET header line without colon\r\n\r\n"), "not a valid HTTP response"},
		{"redirect without location", raw("HTTP/1.1 302 SECRET\r\nContent-Length: 0\r\n\r\n"), "redirect 1 does not lead to an http or https URL"},
		{"redirect to another scheme", raw("HTTP/1.1 302 Found\r\nLocation: gopher://SECRET/\r\nContent-Length: 0\r\n\r\n"), "redirect 1 does not lead to an http or https URL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := loopbackCache(t.TempDir()).Ensure(context.Background(), tc.url, digest([]byte("x")), nil)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
			assert.NotContains(t, err.Error(), "SECRET")
			assert.NotContains(t, err.Error(), "OpenSSH")
		})
	}
}

// The attack: HTTP_PROXY in the agent's environment would send image
// requests to the proxy, which then fetches whatever it is asked for, and the
// policy would judge the proxy's address instead of the image's.
func TestSSRFProxyFromEnvironmentNotUsed(t *testing.T) {
	var proxied atomic.Int64
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proxied.Add(1)
		http.Error(w, "proxied", http.StatusBadGateway)
	}))
	t.Cleanup(proxy.Close)
	t.Setenv("HTTP_PROXY", proxy.URL)
	t.Setenv("HTTPS_PROXY", proxy.URL)
	t.Setenv("NO_PROXY", "")
	body := testImage(10_000)
	ts, sum := serve(t, body)
	// A name, not 127.0.0.1: Go never proxies loopback literals anyway.
	_, resolver := startDNS(t, func(name string, qtype uint16, _ int) []netip.Addr {
		if name == "mirror.example.test" {
			return []netip.Addr{netip.MustParseAddr("127.0.0.1")}
		}
		return nil
	})
	c := loopbackCache(t.TempDir())
	c.resolver = resolver
	_, port, _ := net.SplitHostPort(ts.Listener.Addr().String())
	_, err := c.Ensure(context.Background(), "http://mirror.example.test:"+port+"/img", sum, nil)
	require.NoError(t, err)
	assert.Zero(t, proxied.Load())
	assert.Equal(t, int64(1), ts.hits.Load())
}

// The attack: an image server that trickles a byte every so often holds a
// host's create slot until the pass times out (45 minutes in the report).
// Less than the minimum per stall window ends the download as stalled;
// the few bytes that came are kept for a resume, nothing else.
func TestSlowlorisImageTrickleFailsAsStalled(t *testing.T) {
	body := testImage(100_000)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		for i := range body {
			if _, err := w.Write(body[i : i+1]); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-time.After(20 * time.Millisecond):
			case <-r.Context().Done():
				return
			}
		}
	}))
	t.Cleanup(ts.Close)
	dir := t.TempDir()
	start := time.Now()
	_, err := loopbackCache(dir, WithStallTimeout(300*time.Millisecond), WithMinProgress(4<<10)).
		Ensure(context.Background(), ts.URL+"/img", digest(body), nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, errStalled)
	assert.Regexp(t, `image download stalled: \d+ bytes in 300ms, under the minimum of 4 KiB per 300ms \(after \d+ bytes\)`, err.Error())
	assert.False(t, permanent.Is(err), "a stall may be the network's fault: the retry budget decides")
	assert.Less(t, time.Since(start), 3*time.Second)
	sum := digest(body)
	assert.Equal(t, []string{sum + ".download.part", sum + ".download.resume"}, dirNames(t, dir), "no temp files left")
}

// The attack: a server that accepts and then never sends its headers (or
// drips them, or redirects slowly). Connecting, redirects and headers share
// the first stall window.
func TestSlowlorisImageHeadersWithheldFailsAsStalled(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}))
	t.Cleanup(ts.Close)
	dir := t.TempDir()
	_, err := loopbackCache(dir, WithStallTimeout(300*time.Millisecond)).Ensure(context.Background(), ts.URL+"/img", digest([]byte("x")), nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, errStalled)
	assert.Equal(t, "GET "+ts.URL+"/img: image download stalled: no response within 300ms", err.Error())
	assert.Empty(t, dirNames(t, dir))
}

// The attack: headers, then silence.
func TestSlowlorisImageBodyWithheldFailsAsStalled(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	t.Cleanup(ts.Close)
	dir := t.TempDir()
	_, err := loopbackCache(dir, WithStallTimeout(300*time.Millisecond)).Ensure(context.Background(), ts.URL+"/img", digest([]byte("x")), nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, errStalled)
	assert.Equal(t, "GET "+ts.URL+"/img: image download stalled: no data for 300ms (after 0 bytes)", err.Error())
	assert.Empty(t, dirNames(t, dir), "no temp files left")
}

// A slow but steady download, above the minimum in every window, completes
// however long it takes in total.
func TestSlowSteadyImageDownloadCompletes(t *testing.T) {
	body := testImage(64 << 10)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		for off := 0; off < len(body); off += 4 << 10 {
			w.Write(body[off:min(off+4<<10, len(body))])
			w.(http.Flusher).Flush()
			time.Sleep(40 * time.Millisecond)
		}
	}))
	t.Cleanup(ts.Close)
	start := time.Now()
	p, err := loopbackCache(t.TempDir(), WithStallTimeout(300*time.Millisecond), WithMinProgress(8<<10)).
		Ensure(context.Background(), ts.URL+"/img", digest(body), nil)
	require.NoError(t, err)
	assert.FileExists(t, p)
	assert.Greater(t, time.Since(start), 300*time.Millisecond, "longer in total than one window")
}
