package api_test

// Each test here replays an attack on the console's credentials (its
// cookie, token and session lifetimes, login CSRF) against the real server
// over real HTTP and asserts that it fails.

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
)

// headers sets h on every request, unary or streaming: how a browser (or a
// replayed capture of one) presents its cookie and fetch metadata.
type headers http.Header

func (h headers) set(dst http.Header) {
	for k, vs := range h {
		dst[k] = vs
	}
}

func (h headers) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		h.set(req.Header())
		return next(ctx, req)
	}
}

func (h headers) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		c := next(ctx, spec)
		h.set(c.RequestHeader())
		return c
	}
}

func (headers) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// asConsole presents cookie the way the console's own page does.
func asConsole(c *http.Cookie) connect.ClientOption {
	return connect.WithInterceptors(headers{"Cookie": {c.Name + "=" + c.Value}, "Sec-Fetch-Site": {"same-origin"}})
}

// login posts token to /auth/login as the console does and returns the
// response (body closed).
func (e *env) login(token string, hdr http.Header) *http.Response {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, e.url+"/auth/login", strings.NewReader(`{"token":"`+token+`"}`))
	req.Header.Set("Content-Type", "application/json")
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	resp, err := e.http.Do(req)
	require.NoError(e.t, err)
	resp.Body.Close()
	return resp
}

// session logs in with token and returns the session cookie.
func (e *env) session(token string) *http.Cookie {
	e.t.Helper()
	resp := e.login(token, nil)
	require.Equal(e.t, http.StatusNoContent, resp.StatusCode)
	for _, c := range resp.Cookies() {
		if c.Name == "__Host-eitri_session" {
			return c
		}
	}
	e.t.Fatalf("no session cookie in %v", resp.Header["Set-Cookie"])
	return nil
}

// userToken mints a token for user (created if new) and returns its secret
// and id.
func (e *env) userToken(user string, ttl time.Duration) (string, string) {
	e.t.Helper()
	req := &eitriv1.CreateTokenRequest{Name: user + "-token", UserName: user}
	if ttl > 0 {
		req.Ttl = durationpb.New(ttl)
	}
	r, err := e.tokens(e.admin).CreateToken(context.Background(), connect.NewRequest(req))
	require.NoError(e.t, err)
	return r.Msg.Secret, r.Msg.Token.Id
}

func listVMs(e *env, opt connect.ClientOption) error {
	_, err := eitriv1connect.NewVMServiceClient(e.http, e.url, opt).ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
	return err
}

// A tenant's page published on the console's host receives the console's
// cookie (cookies do not separate ports), and its script can read what it
// receives; replayed as a bearer token, the cookie must be worth nothing.
func TestSessionCookieReplayedAsBearerIsUnauthenticated(t *testing.T) {
	e := newEnv(t)
	cookie := e.session(e.admin)
	require.NoError(t, listVMs(e, asConsole(cookie)), "the cookie works from the console")

	err := listVMs(e, bearer(cookie.Value))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))
	assert.Contains(t, err.Error(), "not a bearer token")

	st, err := e.vms(cookie.Value).WatchVMs(context.Background(), connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	assert.False(t, st.Receive(), "no stream for a session as bearer")
	assert.Equal(t, connect.CodeUnauthenticated, code(st.Err()))

	// The prefix is only a shortcut: a session secret renamed to look like
	// a PAT is still refused by its stored kind.
	renamed := "eitri_pat_" + strings.TrimPrefix(cookie.Value, "eitri_ses_")
	assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, bearer(renamed))))

	// MCP takes bearer tokens only, and not this one.
	req, _ := http.NewRequest(http.MethodPost, e.url+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/list"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+cookie.Value)
	resp, err := e.http.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode)

	// Nor can a session buy a fresh session at /auth/login.
	assert.Equal(t, http.StatusUnauthorized, e.login(cookie.Value, nil).StatusCode)
}

// The page at a tenant's port is same-site with the console (ports do not
// separate sites) but not same-origin; its requests carry the cookie, and a
// tenant must not act as whoever is signed in to the console.
func TestSessionCookieSentFromATenantsPortIsIgnored(t *testing.T) {
	e := newEnv(t)
	cookie := e.session(e.admin)
	for _, site := range []string{"same-site", "cross-site"} {
		opt := connect.WithInterceptors(headers{"Cookie": {cookie.Name + "=" + cookie.Value}, "Sec-Fetch-Site": {site}})
		assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, opt)), site)
	}
}

func TestSessionCookieIsHostPrefixedSecureHttpOnlyStrictUnderTLS(t *testing.T) {
	e := newEnv(t)
	resp := e.login(e.admin, nil)
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	require.Len(t, resp.Cookies(), 1)
	c := resp.Cookies()[0]
	assert.Equal(t, "__Host-eitri_session", c.Name)
	assert.True(t, c.Secure)
	assert.True(t, c.HttpOnly)
	assert.Equal(t, http.SameSiteStrictMode, c.SameSite)
	assert.Equal(t, "/", c.Path, "__Host- requires Path=/")
	assert.Empty(t, c.Domain, "__Host- requires no Domain")

	// A cookie tossed under the plain name (say, by a plain-HTTP page on the
	// same host) is not read over TLS.
	tossed := &http.Cookie{Name: "eitri_session", Value: c.Value}
	assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, asConsole(tossed))))
}

// Plain HTTP (dev mode, loopback only) cannot carry __Host- or Secure: a
// browser drops such a cookie from an http:// origin.
func TestSessionCookieOnPlainHTTPKeepsAPlainName(t *testing.T) {
	s, err := server.New(context.Background(), server.Config{DataDir: t.TempDir(), Plaintext: true})
	require.NoError(t, err)
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() { ts.Close(); s.Close() })
	e := &env{t: t, srv: s, url: ts.URL, http: ts.Client(), admin: s.AdminToken}
	resp := e.login(e.admin, nil)
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	require.Len(t, resp.Cookies(), 1)
	c := resp.Cookies()[0]
	assert.Equal(t, "eitri_session", c.Name)
	assert.False(t, c.Secure)
	assert.True(t, c.HttpOnly)
	assert.Equal(t, http.SameSiteStrictMode, c.SameSite)
	require.NoError(t, listVMs(e, asConsole(c)))
}

// A token can mint tokens; if a child could outlive its parent, whoever
// holds a short-lived token could turn it into one that never expires.
func TestShortLivedTokenCannotMintALongerLivedOne(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	short, _ := e.userToken("alice", 5*time.Second)
	parent := expiryOf(t, e, short)

	for _, ttl := range []*durationpb.Duration{nil, durationpb.New(365 * 24 * time.Hour)} {
		r, err := e.tokens(short).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "child", Ttl: ttl}))
		require.NoError(t, err)
		require.NotNil(t, r.Msg.Token.ExpiresAt, "ttl %v: the child must expire", ttl)
		assert.Equal(t, parent, r.Msg.Token.ExpiresAt.AsTime(), "ttl %v: cut to the parent's expiry", ttl)
	}
	// A shorter ttl is kept as asked.
	r, err := e.tokens(short).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "brief", Ttl: durationpb.New(time.Second)}))
	require.NoError(t, err)
	assert.True(t, r.Msg.Token.ExpiresAt.AsTime().Before(parent))

	// Through the console, the session's token is the bound (not the
	// session's own, shorter, life).
	cookie := e.session(short)
	tc := eitriv1connect.NewTokenServiceClient(e.http, e.url, asConsole(cookie))
	r, err = tc.CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "from-console"}))
	require.NoError(t, err)
	require.NotNil(t, r.Msg.Token.ExpiresAt)
	assert.Equal(t, parent, r.Msg.Token.ExpiresAt.AsTime())
}

// expiryOf reads the expiry of the token secret belongs to, as its owner
// lists it.
func expiryOf(t *testing.T, e *env, secret string) time.Time {
	t.Helper()
	l, err := e.tokens(secret).ListTokens(context.Background(), connect.NewRequest(&eitriv1.ListTokensRequest{}))
	require.NoError(t, err)
	require.Len(t, l.Msg.Tokens, 1)
	require.NotNil(t, l.Msg.Tokens[0].ExpiresAt)
	return l.Msg.Tokens[0].ExpiresAt.AsTime()
}

// Signing in turns a token into a session; a session that outlived its token
// would stretch a short-lived token past the life it was given.
func TestLoginSessionNeverOutlivesItsToken(t *testing.T) {
	e := newEnv(t)
	short, _ := e.userToken("alice", time.Hour)
	exp := expiryOf(t, e, short)
	resp := e.login(short, nil)
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	c := resp.Cookies()[0]
	assert.False(t, c.Expires.After(exp), "cookie expires %v, token %v", c.Expires, exp)

	l, err := e.tokens(short).ListSessions(context.Background(), connect.NewRequest(&eitriv1.ListSessionsRequest{}))
	require.NoError(t, err)
	require.Len(t, l.Msg.Sessions, 1)
	assert.Equal(t, exp, l.Msg.Sessions[0].ExpiresAt.AsTime())
}

// whoAmI asks /auth/me as the console's page does, with cookie if not nil,
// and returns the status and the body.
func (e *env) whoAmI(cookie *http.Cookie) (int, string) {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, e.url+"/auth/me", nil)
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	if cookie != nil {
		req.AddCookie(cookie)
	}
	resp, err := e.http.Do(req)
	require.NoError(e.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(e.t, err)
	assert.Equal(e.t, "no-store", resp.Header.Get("Cache-Control"), "the answer is this browser's alone")
	return resp.StatusCode, string(b)
}

// The console asks /auth/me on every visit, and a browser logs every error
// status in its console: a signed-out visitor (no cookie, or one whose
// session has ended) gets an answer that says so and nothing more, not an
// error.
func TestMeAnswersASignedOutVisitorWithoutAnError(t *testing.T) {
	e := newEnv(t)
	signedOut := `{"signedIn":false}`
	status, body := e.whoAmI(nil)
	assert.Equal(t, http.StatusOK, status)
	assert.JSONEq(t, signedOut, body)

	cookie := e.session(e.admin)
	status, body = e.whoAmI(cookie)
	assert.Equal(t, http.StatusOK, status)
	assert.JSONEq(t, `{"signedIn":true,"name":"admin","admin":true}`, body)

	made := *cookie
	made.Value = "eitri_ses_" + strings.Repeat("x", 40)
	status, body = e.whoAmI(&made)
	assert.Equal(t, http.StatusOK, status)
	assert.JSONEq(t, signedOut, body, "a session nobody issued is no session")

	resp, err := e.http.Do(func() *http.Request {
		req, _ := http.NewRequest(http.MethodPost, e.url+"/auth/logout", nil)
		req.AddCookie(cookie)
		return req
	}())
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	status, body = e.whoAmI(cookie)
	assert.Equal(t, http.StatusOK, status)
	assert.JSONEq(t, signedOut, body, "an ended session is no session")
}

// Revoking a token is how its owner takes back a leaked one: the console
// sessions it opened, and their streams, must end with it.
func TestSessionDiesWithItsToken(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	secret, id := e.userToken("alice", 0)
	cookie := e.session(secret)
	require.NoError(t, listVMs(e, asConsole(cookie)))
	watch := openWatch(t, e, asConsole(cookie))

	_, err := e.tokens(e.admin).RevokeToken(ctx, connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: id}))
	require.NoError(t, err)
	assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, asConsole(cookie))))
	watch.endsWithin(t, time.Second)

	l, err := e.tokens(e.admin).ListSessions(ctx, connect.NewRequest(&eitriv1.ListSessionsRequest{}))
	require.NoError(t, err)
	assert.Empty(t, l.Msg.Sessions, "the session went with its token")
}

// A user ends a session they left open somewhere (or do not recognise) by
// listing their own; nobody may list or end another user's.
func TestUsersListAndEndOnlyTheirOwnSessions(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	alice, aliceTok := e.userToken("alice", 0)
	bob, _ := e.userToken("bob", 0)
	aliceLaptop, alicePhone, bobs := e.session(alice), e.session(alice), e.session(bob)

	aliceSessions := eitriv1connect.NewTokenServiceClient(e.http, e.url, asConsole(aliceLaptop))
	l, err := aliceSessions.ListSessions(ctx, connect.NewRequest(&eitriv1.ListSessionsRequest{}))
	require.NoError(t, err)
	require.Len(t, l.Msg.Sessions, 2, "alice sees her two sessions and not bob's")
	var current, other *eitriv1.Session
	for _, s := range l.Msg.Sessions {
		assert.Equal(t, "alice", s.UserName)
		assert.Equal(t, aliceTok, s.TokenId)
		assert.Equal(t, "alice-token", s.TokenName)
		if s.Current {
			current = s
		} else {
			other = s
		}
	}
	require.NotNil(t, current, "the calling session is marked")
	require.NotNil(t, other)

	all, err := e.tokens(e.admin).ListSessions(ctx, connect.NewRequest(&eitriv1.ListSessionsRequest{}))
	require.NoError(t, err)
	require.Len(t, all.Msg.Sessions, 3, "an admin sees everyone's")
	var bobsID string
	for _, s := range all.Msg.Sessions {
		if s.UserName == "bob" {
			bobsID = s.Id
		}
	}

	// Alice cannot end bob's session, nor learn that it exists.
	_, err = aliceSessions.RevokeSession(ctx, connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: bobsID}))
	assert.Equal(t, connect.CodeNotFound, code(err))
	_, err = e.tokens(alice).RevokeSession(ctx, connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: bobsID}))
	assert.Equal(t, connect.CodeNotFound, code(err))
	require.NoError(t, listVMs(e, asConsole(bobs)), "bob's session survives")
	// A session id is not a token id.
	_, err = e.tokens(alice).RevokeToken(ctx, connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: other.Id}))
	assert.Equal(t, connect.CodeNotFound, code(err))

	// Alice ends her phone's session from her laptop; the phone's stream
	// closes and the laptop stays signed in.
	watch := openWatch(t, e, asConsole(alicePhone))
	_, err = aliceSessions.RevokeSession(ctx, connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: other.Id}))
	require.NoError(t, err)
	watch.endsWithin(t, time.Second)
	assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, asConsole(alicePhone))))
	require.NoError(t, listVMs(e, asConsole(aliceLaptop)))

	// An admin may end anyone's.
	_, err = e.tokens(e.admin).RevokeSession(ctx, connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: bobsID}))
	require.NoError(t, err)
	assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, asConsole(bobs))))
}

// openStream is one open Watch* stream, read in the background.
type openStream struct {
	ended chan error
}

func (s openStream) endsWithin(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case err := <-s.ended:
		assert.Equal(t, connect.CodeUnauthenticated, code(err), "the stream says why it ended: %v", err)
	case <-time.After(d):
		t.Fatalf("the stream is still open %v after its credential went", d)
	}
}

// watchStream opens a stream, waits for its first message and keeps reading.
func watchStream[T any](t *testing.T, st *connect.ServerStreamForClient[T], err error) openStream {
	t.Helper()
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	require.True(t, st.Receive(), "first message: %v", st.Err())
	s := openStream{ended: make(chan error, 1)}
	go func() {
		for st.Receive() {
		}
		s.ended <- st.Err()
	}()
	return s
}

func openWatch(t *testing.T, e *env, opt connect.ClientOption) openStream {
	st, err := eitriv1connect.NewVMServiceClient(e.http, e.url, opt).WatchVMs(context.Background(), connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	return watchStream(t, st, err)
}

// A stream is authorized once, when it opens; revoking its token must still
// stop what it delivers, within a second, and leave other tokens' streams
// alone.
func TestRevokedTokensWatchStreamsCloseWithinASecond(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	r, err := e.tokens(e.admin).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "ops"}))
	require.NoError(t, err)
	ops := r.Msg.Secret
	vms, err := e.vms(ops).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	streams := []openStream{watchStream(t, vms, err)}
	hosts, err := e.hosts(ops).WatchHosts(ctx, connect.NewRequest(&eitriv1.WatchHostsRequest{}))
	streams = append(streams, watchStream(t, hosts, err))
	exps, err := e.exposures(ops).WatchExposures(ctx, connect.NewRequest(&eitriv1.WatchExposuresRequest{}))
	streams = append(streams, watchStream(t, exps, err))
	// Someone else's stream is untouched.
	bystander := openWatch(t, e, bearer(e.admin))

	_, err = e.tokens(e.admin).RevokeToken(ctx, connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: r.Msg.Token.Id}))
	require.NoError(t, err)
	for _, s := range streams {
		s.endsWithin(t, time.Second)
	}
	select {
	case err := <-bystander.ended:
		t.Fatalf("another token's stream ended: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
}

// Likewise an open stream ends when its token expires, rather than
// delivering for as long as its connection lasts.
func TestWatchStreamEndsWhenItsTokenExpires(t *testing.T) {
	e := newEnv(t)
	secret, _ := e.userToken("alice", 2*time.Second)
	s := openWatch(t, e, bearer(secret))
	exp := expiryOf(t, e, secret)
	s.endsWithin(t, time.Until(exp)+time.Second)
}

// Login CSRF: a foreign page that could post to /auth/login (text/plain
// needs no preflight) would sign the victim's browser in as the attacker, and
// what the victim then does lands in the attacker's account.
func TestLoginCSRFWithTextPlainOrAForeignOriginIsRefused(t *testing.T) {
	e := newEnv(t)
	post := func(path, contentType, body string, hdr http.Header) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, e.url+path, strings.NewReader(body))
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		for k, vs := range hdr {
			req.Header[k] = vs
		}
		resp, err := e.http.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	body := `{"token":"` + e.admin + `"}`
	for _, ct := range []string{"text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""} {
		resp := post("/auth/login", ct, body, nil)
		assert.Equal(t, http.StatusUnsupportedMediaType, resp.StatusCode, "content type %q", ct)
		assert.Empty(t, resp.Cookies(), "content type %q", ct)
	}

	host := strings.TrimPrefix(e.url, "https://")
	for _, origin := range []string{"https://evil.example", "null", "http://" + host, "https://" + strings.Split(host, ":")[0] + ":30080"} {
		resp := e.login(e.admin, http.Header{"Origin": {origin}})
		assert.Equal(t, http.StatusForbidden, resp.StatusCode, "origin %q", origin)
		assert.Empty(t, resp.Cookies(), "origin %q", origin)
	}

	// The console's own origin, and a client that sends none, sign in.
	assert.Equal(t, http.StatusNoContent, e.login(e.admin, http.Header{"Origin": {e.url}}).StatusCode)
	assert.Equal(t, http.StatusNoContent, e.login(e.admin, nil).StatusCode)
	assert.Equal(t, http.StatusNoContent, post("/auth/login", "application/json; charset=utf-8", body, nil).StatusCode)

	// Logout and /auth/me are guarded too: a foreign page cannot sign the
	// console out.
	cookie := e.session(e.admin)
	withCookie := http.Header{"Cookie": {cookie.Name + "=" + cookie.Value}}
	foreign := http.Header{"Cookie": withCookie["Cookie"], "Origin": {"https://evil.example"}}
	assert.Equal(t, http.StatusForbidden, post("/auth/logout", "", "", foreign).StatusCode)
	require.NoError(t, listVMs(e, asConsole(cookie)), "still signed in")
	assert.Equal(t, http.StatusNoContent, post("/auth/logout", "", "", withCookie).StatusCode)
	assert.Equal(t, connect.CodeUnauthenticated, code(listVMs(e, asConsole(cookie))))
}
