package httpguard

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"html"
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
// and styles only from its own origin, plus exactly the inline script and
// style attributes its page carries, allowed by hash. The console is a
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
// from one inline script (and wraps the app in a div with a style
// attribute); each gets its sha256 and nothing else inline runs.
func ConsolePolicy(page []byte) string {
	scripts, styles := inlineHashes(page)
	return strings.Join([]string{
		"default-src 'none'",
		strings.Join(append([]string{"script-src 'self'"}, scripts...), " "),
		strings.Join(append([]string{"style-src 'self'"}, styleAttrSources(styles)...), " "),
		"img-src 'self' data:",
		"font-src 'self'",
		"connect-src 'self'",
		"manifest-src 'self'",
		"base-uri 'none'",
		"form-action 'self'",
		"frame-ancestors 'none'",
	}, "; ")
}

// styleAttrSources allows style attributes by hash, which CSP3 permits only
// with 'unsafe-hashes' (it still allows only those exact attributes).
func styleAttrSources(hashes []string) []string {
	if len(hashes) == 0 {
		return nil
	}
	return append([]string{"'unsafe-hashes'"}, hashes...)
}

var (
	scriptTag = regexp.MustCompile(`(?is)<script\b([^>]*)>(.*?)</script\s*>`)
	srcAttr   = regexp.MustCompile(`(?i)\ssrc\s*=`)
	styleAttr = regexp.MustCompile(`(?i)\sstyle\s*=\s*(?:"([^"]*)"|'([^']*)')`)
)

// inlineHashes returns the CSP hash sources of page's inline scripts (their
// text as written: script is raw text in HTML) and of its style attributes
// (their values as the browser decodes them).
func inlineHashes(page []byte) (scripts, styles []string) {
	for _, m := range scriptTag.FindAllSubmatch(page, -1) {
		if srcAttr.Match(m[1]) {
			continue
		}
		scripts = appendUnique(scripts, hashSource(m[2]))
	}
	for _, m := range styleAttr.FindAllSubmatch(page, -1) {
		v := m[1]
		if v == nil {
			v = m[2]
		}
		styles = appendUnique(styles, hashSource([]byte(html.UnescapeString(string(v)))))
	}
	return scripts, styles
}

func hashSource(b []byte) string {
	sum := sha256.Sum256(b)
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}

func appendUnique(list []string, s string) []string {
	if slices.Contains(list, s) {
		return list
	}
	return append(list, s)
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
