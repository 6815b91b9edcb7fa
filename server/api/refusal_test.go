package api_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
)

// refusedWithin bounds how long a refused request's connection may stay
// open: far below the idle timeout (30 s) and the body timeout (10 s) that
// would otherwise end it, and above net/http's half-second linger after
// the answer.
const refusedWithin = 5 * time.Second

// A POST refused from its headers (no credentials) must not hold its
// connection while its declared body trickles in, a byte every 5 s:
// net/http reads on after the answer to find the body's end, so anyone
// could hold connections at no cost. The connection is closed with the
// answer.
func TestARequestRefusedFromItsHeadersClosesItsConnection(t *testing.T) {
	s := serve(t, server.Config{})
	for _, c := range []struct {
		name, path, auth string
		status           string
	}{
		{"an RPC without credentials", eitriv1connect.VMServiceCreateVMProcedure, "", "401 Unauthorized"},
		{"an RPC with a token nobody issued", eitriv1connect.VMServiceCreateVMProcedure, "Bearer eitri_nope", "401 Unauthorized"},
		{"an RPC whose declared body is over the limit", eitriv1connect.VMServiceCreateVMProcedure, "Bearer " + s.admin, "429 Too Many Requests"}, // Connect's resource_exhausted
		{"MCP without a token", "/mcp", "", "401 Unauthorized"},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", s.addr)
			require.NoError(t, err)
			defer conn.Close()
			hdr := ""
			if c.auth != "" {
				hdr = "Authorization: " + c.auth + "\r\n"
			}
			// The headers and the first byte of a body that never comes.
			_, err = fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: 100000\r\n\r\n{", c.path, hdr)
			require.NoError(t, err)

			require.NoError(t, conn.SetReadDeadline(time.Now().Add(refusedWithin)))
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			require.NoError(t, err, "the answer comes at once")
			assert.Equal(t, c.status, resp.Status)
			assert.True(t, resp.Close, "the answer says the connection closes")
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			_, err = br.ReadByte()
			assert.ErrorIs(t, err, io.EOF, "the server closes the connection rather than wait for the body")
			assert.False(t, errors.Is(err, os.ErrDeadlineExceeded), "still open after %s", refusedWithin)
		})
	}

	t.Run("over HTTP/2 the refused stream is reset and the body no longer asked for", func(t *testing.T) {
		pr, pw := io.Pipe()
		defer pw.Close()
		ctx, cancel := context.WithTimeout(context.Background(), refusedWithin)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url+eitriv1connect.VMServiceCreateVMProcedure, pr)
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.ContentLength = 100000
		go func() { _, _ = pw.Write([]byte("{")) }()
		resp, err := s.http.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, 2, resp.ProtoMajor)
		assert.Equal(t, http.StatusUnauthorized, resp.StatusCode)
		_, _ = io.Copy(io.Discard, resp.Body)
		// The transport stops reading the body once the server has reset
		// the stream: a write to it fails instead of waiting to be sent.
		wrote := make(chan error, 1)
		go func() {
			var err error
			for err == nil {
				_, err = pw.Write([]byte(" "))
			}
			wrote <- err
		}()
		select {
		case err := <-wrote:
			assert.ErrorIs(t, err, io.ErrClosedPipe)
		case <-ctx.Done():
			t.Fatalf("the refused stream still takes its body after %s", refusedWithin)
		}
		assert.False(t, strings.Contains(resp.Header.Get("Connection"), "close"), "HTTP/2 keeps the connection for other streams")
	})
}
