package httpguard

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestConsolePolicyAllowsExactlyThePagesInlineCode(t *testing.T) {
	page := []byte(`<html><head><script src="/a.js"></script><SCRIPT type="module">boot()</SCRIPT></head>` +
		`<body><div style="display: contents"><p style='color: red'>x</p><p style="a &amp; b"></p></div></body></html>`)
	policy := ConsolePolicy(page)
	assert.Contains(t, policy, "script-src 'self' "+hashSource([]byte("boot()"))+";", "the inline script only; the src one is 'self'")
	assert.Contains(t, policy, "style-src 'self' 'unsafe-hashes' "+hashSource([]byte("display: contents"))+" "+
		hashSource([]byte("color: red"))+" "+hashSource([]byte("a & b"))+";", "style attributes as the browser decodes them")
	assert.Contains(t, policy, "frame-ancestors 'none'")
	assert.NotContains(t, policy, "unsafe-inline")

	bare := ConsolePolicy([]byte("<p>The console is not built.</p>"))
	assert.Contains(t, bare, "script-src 'self';")
	assert.Contains(t, bare, "style-src 'self';")
}
