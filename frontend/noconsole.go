//go:build !console

// Package frontend embeds the built web console (build tag "console", set by
// `make build` once `npm run build` has produced frontend/build). Without the
// tag the binary still builds from a fresh clone and serves a page saying how
// to get the console.
package frontend

import "net/http"

// Handler is nil when the console is not built into this binary.
func Handler() http.Handler { return nil }
