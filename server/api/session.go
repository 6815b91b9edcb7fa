package api

import (
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
)

// MountSession adds the console's login: a pasted token becomes an
// HttpOnly, SameSite=Strict session cookie (so scripts in the page never
// hold a credential), and logout revokes it.
func MountSession(r chi.Router, f *fleet.Fleet) {
	r.Post("/auth/login", func(w http.ResponseWriter, req *http.Request) {
		var body struct {
			Token string `json:"token"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, 4096)).Decode(&body); err != nil || body.Token == "" {
			jsonError(w, http.StatusBadRequest, "token: required")
			return
		}
		secret, _, err := f.Login(req.Context(), body.Token)
		if err != nil {
			if fleet.KindOf(err) == fleet.Unauthenticated {
				jsonError(w, http.StatusUnauthorized, err.Error())
				return
			}
			jsonError(w, http.StatusInternalServerError, "internal error")
			return
		}
		http.SetCookie(w, &http.Cookie{
			Name: auth.SessionCookie, Value: secret, Path: "/", HttpOnly: true,
			SameSite: http.SameSiteStrictMode, Secure: req.TLS != nil,
			Expires: time.Now().Add(fleet.SessionTTL),
		})
		w.WriteHeader(http.StatusNoContent)
	})
	r.Post("/auth/logout", func(w http.ResponseWriter, req *http.Request) {
		if p, err := resolve(f, req); err == nil {
			_ = f.Logout(auth.WithPrincipal(req.Context(), p))
		}
		http.SetCookie(w, &http.Cookie{Name: auth.SessionCookie, Value: "", Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode, MaxAge: -1})
		w.WriteHeader(http.StatusNoContent)
	})
	r.Get("/auth/me", func(w http.ResponseWriter, req *http.Request) {
		p, err := resolve(f, req)
		if err != nil {
			jsonError(w, http.StatusUnauthorized, "not logged in")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"name": p.Name, "admin": p.Admin})
	})
}

func resolve(f *fleet.Fleet, req *http.Request) (auth.Principal, error) {
	secret := auth.Secret(req.Header)
	if secret == "" {
		return auth.Principal{}, errors.New("no credentials")
	}
	return f.Resolve(req.Context(), secret)
}

func jsonError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"message": msg})
}
