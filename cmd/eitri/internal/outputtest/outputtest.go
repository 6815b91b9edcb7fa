// Package outputtest holds checks on what eitri's client commands print,
// shared by the commands' own tests and the end-to-end tests that run them
// against a real control plane.
package outputtest

import (
	"bytes"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
)

var (
	stamped = regexp.MustCompile(`^\d\d:\d\d:\d\d (.*)$`)
	ansi    = regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]`)
)

// LinesInOrder checks that each of want is in a line of text, in order, each
// line after a time of day (a wait's narration).
func LinesInOrder(t *testing.T, text string, want []string) {
	t.Helper()
	var got []string
	for _, l := range strings.Split(text, "\n") {
		if m := stamped.FindStringSubmatch(strings.TrimSpace(StripANSI(l))); m != nil {
			got = append(got, m[1])
		}
	}
	i := 0
	for _, g := range got {
		if i < len(want) && strings.Contains(g, want[i]) {
			i++
		}
	}
	assert.Equal(t, len(want), i, "step lines in order: want %q, got %q", want, got)
}

// StripANSI is s without terminal escapes (a progress bar's drawing).
func StripANSI(s string) string {
	return ansi.ReplaceAllString(s, "")
}

// Buffer is a buffer a command writes to while the test reads it.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
