//go:build console

package frontend

import (
	"embed"
	"io/fs"
	"net/http"
	"strings"
)

//go:embed all:build
var build embed.FS

// Handler serves the built console: files as they are, and index.html for
// every other path so client-side routes survive a reload.
func Handler() http.Handler {
	root, err := fs.Sub(build, "build")
	if err != nil {
		panic(err)
	}
	files := http.FileServerFS(root)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := fs.Stat(root, trim(r.URL.Path)); err != nil {
			r = r.Clone(r.Context())
			r.URL.Path = "/"
		}
		// Hashed assets never change; the page that names them must be
		// re-checked so a new build is picked up.
		if strings.HasPrefix(r.URL.Path, "/_app/immutable/") {
			w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
		} else {
			w.Header().Set("Cache-Control", "no-cache")
		}
		files.ServeHTTP(w, r)
	})
}

func trim(p string) string {
	if p == "/" || p == "" {
		return "index.html"
	}
	return p[1:]
}
