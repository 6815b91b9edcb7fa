package main

import (
	"context"
	"errors"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDevListensOnLoopbackOnly(t *testing.T) {
	names := map[string][]netip.Addr{
		"localhost":  {netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1")},
		"dev.test":   {netip.MustParseAddr("127.0.0.2")},
		"mixed.test": {netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("192.0.2.7")},
		"lan.test":   {netip.MustParseAddr("192.0.2.7")},
	}
	lookup := func(_ context.Context, host string) ([]netip.Addr, error) {
		if a, ok := names[host]; ok {
			return a, nil
		}
		return nil, errors.New("no such host")
	}
	for _, c := range []struct {
		listen string
		want   string // bound address, or "" when refused
	}{
		{"127.0.0.1:8080", "127.0.0.1:8080"},
		{"127.1.2.3:0", "127.1.2.3:0"},
		{"[::1]:8080", "[::1]:8080"},
		{"[::ffff:127.0.0.1]:8080", "127.0.0.1:8080"},
		{"localhost:8080", "127.0.0.1:8080"},
		{"dev.test:9", "127.0.0.2:9"},
		{":8080", ""},
		{"0.0.0.0:8080", ""},
		{"[::]:8080", ""},
		{"192.0.2.7:8080", ""},
		{"[::ffff:192.0.2.7]:8080", ""},
		{"lan.test:8080", ""},
		{"mixed.test:8080", ""},
		{"nowhere.test:8080", ""},
		{"127.0.0.1", ""},
		{"127.0.0.1:http", ""},
		{"127.0.0.1:70000", ""},
	} {
		t.Run(c.listen, func(t *testing.T) {
			got, err := loopbackAddr(context.Background(), c.listen, lookup)
			if c.want == "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "--listen")
				assert.Contains(t, err.Error(), "loopback")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.want, got.String())
		})
	}
}
