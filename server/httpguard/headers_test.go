package httpguard

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestConsolePolicyAllowsExactlyThePagesInlineScripts(t *testing.T) {
	page := []byte(`<html><head><script src="/a.js"></script><SCRIPT type="module">boot()</SCRIPT></head>` +
		`<body><div style="display: contents"><script>boot()</script><script>more()</script></div></body></html>`)
	policy := ConsolePolicy(page)
	assert.Contains(t, policy, "script-src 'self' "+hashSource([]byte("boot()"))+" "+hashSource([]byte("more()"))+";",
		"each inline script once; the src one is 'self'")
	assert.Contains(t, policy, "style-src 'self';")
	assert.Contains(t, policy, "frame-ancestors 'none'")
	assert.NotContains(t, policy, "script-src 'unsafe-inline'")
	assert.NotContains(t, policy, "unsafe-eval")

	bare := ConsolePolicy([]byte("<p>The console is not built.</p>"))
	assert.Contains(t, bare, "script-src 'self';")
}
