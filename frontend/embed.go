//go:build console

package frontend

import (
	"embed"
	"io/fs"
	"net/http"
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
		files.ServeHTTP(w, r)
	})
}

func trim(p string) string {
	if p == "/" || p == "" {
		return "index.html"
	}
	return p[1:]
}
