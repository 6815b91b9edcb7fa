package httpguard

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"regexp"
	"slices"
	"strings"
)

// apiPolicy is the Content-Security-Policy of everything that is not the
// console: nothing the API returns is a page, so a browser made to render
// one runs nothing and frames nothing.
const apiPolicy = "default-src 'none'; frame-ancestors 'none'"

// setBaseHeaders marks every response: no framing (clickjacking), no
// content-type guessing (a JSON error rendered as HTML), no Referer with a
// path to other sites.
func setBaseHeaders(h http.Header) {
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Content-Security-Policy", apiPolicy)
}

// Console serves the console behind a strict Content-Security-Policy: scripts
// only from its own origin plus exactly the inline scripts its page carries,
// allowed by hash; stylesheets only from its own origin. The console is a
// single-page app (every path serves the same index.html), so the policy is
// worked out once, from the page console serves at "/".
func Console(console http.Handler) http.Handler {
	policy := ConsolePolicy(page(console))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", policy)
		console.ServeHTTP(w, r)
	})
}

// ConsolePolicy is the policy for a page: SvelteKit's static build boots
// from one inline script, which gets its sha256; no other inline script
// runs. Style attributes are allowed: SvelteKit's runtime writes them
// (its route announcer, the wrapper div), they cannot run code, and with
// img-src and font-src 'self' a style cannot send anything elsewhere.
func ConsolePolicy(page []byte) string {
	return strings.Join([]string{
		"default-src 'none'",
		strings.Join(append([]string{"script-src 'self'"}, inlineScriptHashes(page)...), " "),
		"style-src 'self'",
		"style-src-attr 'unsafe-inline'",
		"img-src 'self' data:",
		"font-src 'self'",
		"connect-src 'self'",
		"manifest-src 'self'",
		"base-uri 'none'",
		"form-action 'self'",
		"frame-ancestors 'none'",
	}, "; ")
}

var (
	scriptTag = regexp.MustCompile(`(?is)<script\b([^>]*)>(.*?)</script\s*>`)
	srcAttr   = regexp.MustCompile(`(?i)\ssrc\s*=`)
)

// inlineScriptHashes returns the CSP hash sources of page's inline scripts,
// over their text as written (a script is raw text in HTML: no entities).
func inlineScriptHashes(page []byte) []string {
	var hashes []string
	for _, m := range scriptTag.FindAllSubmatch(page, -1) {
		if srcAttr.Match(m[1]) {
			continue
		}
		if h := hashSource(m[2]); !slices.Contains(hashes, h) {
			hashes = append(hashes, h)
		}
	}
	return hashes
}

func hashSource(b []byte) string {
	sum := sha256.Sum256(b)
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}

// page fetches "/" from h in memory.
func page(h http.Handler) []byte {
	req, _ := http.NewRequest(http.MethodGet, "/", nil)
	w := &recorder{header: http.Header{}}
	h.ServeHTTP(w, req)
	if w.status != 0 && w.status != http.StatusOK && w.status != http.StatusNotFound {
		return nil
	}
	return w.body.Bytes()
}

type recorder struct {
	header http.Header
	body   bytes.Buffer
	status int
}

func (r *recorder) Header() http.Header { return r.header }
func (r *recorder) WriteHeader(status int) {
	if r.status == 0 {
		r.status = status
	}
}
func (r *recorder) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(b)
}
