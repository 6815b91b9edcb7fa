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
		r.Get("/me", func(w http.ResponseWriter, req *http.Request) { me(f, w, req) })
	})
}

// whoAmI is /auth/me's answer. Signed out, it is all a caller learns.
type whoAmI struct {
	SignedIn bool   `json:"signedIn"`
	Name     string `json:"name,omitempty"`
	Admin    bool   `json:"admin,omitempty"`
}

// me says who the browser's session acts for, or that it has none. Signed
// out is an answer, not an error status: the console asks on every visit,
// and a browser logs every error status in its console, so each signed-out
// visit would log one. A store failure is still an error: the answer would
// otherwise send a signed-in user to the login page.
func me(f *fleet.Fleet, w http.ResponseWriter, req *http.Request) {
	var who whoAmI
	p, err := resolve(f, req)
	switch {
	case errors.Is(err, errNoSession), errors.Is(err, auth.ErrBadCredential):
	case err != nil:
		jsonError(w, http.StatusInternalServerError, "internal error")
		return
	default:
		who = whoAmI{SignedIn: true, Name: p.Name, Admin: p.Admin}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(who)
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

// errNoSession: the request carries no console session cookie (or did not
// come from the console's own pages).
var errNoSession = errors.New("no session")

// resolve finds the console session of req: its cookie only, never a bearer
// token.
func resolve(f *fleet.Fleet, req *http.Request) (auth.Principal, error) {
	secret := auth.SessionSecret(req)
	if secret == "" {
		return auth.Principal{}, errNoSession
	}
	return f.ResolveSession(req.Context(), secret)
}

func jsonError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"message": msg})
}
