package main

import (
	"io"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A console session opened elsewhere shows up in `eitri token sessions` and
// `eitri token end-session` signs it out.
func TestTheCLIListsAndEndsConsoleSessions(t *testing.T) {
	eitri := cliOnServer(t)
	url := os.Getenv("EITRI_URL")
	resp, err := http.Post(url+"/auth/login", "application/json", strings.NewReader(`{"token":"`+os.Getenv("EITRI_TOKEN")+`"}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	cookie := resp.Cookies()[0]

	out, err := eitri("token", "sessions")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, out)
	assert.Contains(t, lines[1], "bootstrap", "names the token the session acts for")
	id := strings.Fields(lines[1])[0]

	out, err = eitri("token", "end-session", id)
	require.NoError(t, err)
	assert.Contains(t, out, "ended "+id)

	req, _ := http.NewRequest(http.MethodGet, url+"/auth/me", nil)
	req.AddCookie(cookie)
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	me, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.JSONEq(t, `{"signedIn":false}`, string(me), "the ended session is signed out")

	out, err = eitri("token", "sessions", "-o", "json")
	require.NoError(t, err)
	assert.JSONEq(t, `{"sessions":[]}`, out)

	_, err = eitri("token", "end-session", id)
	assert.ErrorContains(t, err, "not found")
}
