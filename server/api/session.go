package api

import (
	"encoding/json"
	"errors"
	"mime"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
)

// MountSession adds the console's login: a pasted token becomes an
// HttpOnly, SameSite=Strict session cookie (so scripts in the page never
// hold a credential), and logout ends it. Every /auth/ route refuses a
// request a browser sent from another origin (see sameOrigin).
func MountSession(r chi.Router, f *fleet.Fleet) {
	r.Route("/auth", func(r chi.Router) {
		r.Use(sameOrigin)
		r.Post("/login", func(w http.ResponseWriter, req *http.Request) { login(f, w, req) })
		r.Post("/logout", func(w http.ResponseWriter, req *http.Request) {
			if p, err := resolve(f, req); err == nil {
				_ = f.Logout(auth.WithPrincipal(req.Context(), p))
			}
			http.SetCookie(w, sessionCookie(req, "", time.Time{}))
			w.WriteHeader(http.StatusNoContent)
		})
		r.Get("/me", func(w http.ResponseWriter, req *http.Request) {
			p, err := resolve(f, req)
			if err != nil {
				jsonError(w, http.StatusUnauthorized, "not logged in")
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{"name": p.Name, "admin": p.Admin})
		})
	})
}

func login(f *fleet.Fleet, w http.ResponseWriter, req *http.Request) {
	// JSON only: a form or text/plain body is what a cross-site page can
	// send without a preflight, so refusing it closes login CSRF even for a
	// browser that sends no Origin.
	if mt, _, err := mime.ParseMediaType(req.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		jsonError(w, http.StatusUnsupportedMediaType, "send the token as JSON (Content-Type: application/json)")
		return
	}
	var body struct {
		Token string `json:"token"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, 4096)).Decode(&body); err != nil || body.Token == "" {
		jsonError(w, http.StatusBadRequest, "token: required")
		return
	}
	secret, exp, err := f.Login(req.Context(), body.Token)
	if err != nil {
		if fleet.KindOf(err) == fleet.Unauthenticated {
			jsonError(w, http.StatusUnauthorized, err.Error())
			return
		}
		jsonError(w, http.StatusInternalServerError, "internal error")
		return
	}
	http.SetCookie(w, sessionCookie(req, secret, exp))
	w.WriteHeader(http.StatusNoContent)
}

// sessionCookie is the console's cookie for req's scheme: __Host- and Secure
// over TLS, a plain name on plain HTTP (see auth.SessionCookie). A zero exp
// clears it.
func sessionCookie(req *http.Request, secret string, exp time.Time) *http.Cookie {
	c := &http.Cookie{
		Name: auth.SessionCookieName(req.TLS != nil), Value: secret, Path: "/",
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: req.TLS != nil,
	}
	if exp.IsZero() {
		c.MaxAge = -1
	} else {
		c.Expires = exp
	}
	return c
}

// sameOrigin refuses a request whose Origin is not this server's own
// (scheme and Host of the request). A request with no Origin passes: every
// browser sends Origin on a cross-origin request and on any POST, so its
// absence means a non-browser client (curl, a script), which holds no
// ambient cookie to abuse. "null" (a sandboxed or opaque origin) is foreign.
func sameOrigin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		origin := req.Header.Get("Origin")
		scheme := "http"
		if req.TLS != nil {
			scheme = "https"
		}
		if origin != "" && origin != scheme+"://"+req.Host {
			jsonError(w, http.StatusForbidden, "cross-origin request refused: sign in from the console's own page")
			return
		}
		next.ServeHTTP(w, req)
	})
}

// resolve finds the console session of req: its cookie only, never a bearer
// token.
func resolve(f *fleet.Fleet, req *http.Request) (auth.Principal, error) {
	secret := auth.SessionSecret(req)
	if secret == "" {
		return auth.Principal{}, errors.New("no session")
	}
	return f.ResolveSession(req.Context(), secret)
}

func jsonError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"message": msg})
}
