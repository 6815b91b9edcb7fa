package api_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/jointoken"
	"github.com/a73x/eitri/wire/release"
)

// releaseEnv is a control plane that takes builds signed by key, on a test
// clock, with a rollout loop quick enough to watch.
func releaseEnv(t *testing.T, key release.PublicKey) (*env, *clock) {
	t.Helper()
	c := &clock{now: time.Now().UTC()}
	dir := t.TempDir()
	s, err := server.New(context.Background(), server.Config{DataDir: dir, Plaintext: true, DeleteGrace: time.Hour, Now: c.Now,
		ReleaseKey: key, Version: "v1.4.0", StuckAfter: 5 * time.Minute, RolloutTick: 20 * time.Millisecond})
	require.NoError(t, err)
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(func() { ts.Close(); s.Close() })
	return &env{t: t, srv: s, url: ts.URL, http: ts.Client(), admin: s.AdminToken, dir: dir}, c
}

func (e *env) releases(tok string) eitriv1connect.ReleaseServiceClient {
	return eitriv1connect.NewReleaseServiceClient(e.http, e.url, bearer(tok))
}

// build is a signed fake agent build.
type build struct {
	data []byte
	sig  release.Signature
}

func signed(t *testing.T, priv release.PrivateKey, version, content string) build {
	t.Helper()
	data := bytes.Repeat([]byte(content), 3000) // several upload chunks' worth of small ones
	d, err := release.Sum(bytes.NewReader(data))
	require.NoError(t, err)
	sig, err := release.Sign(priv, release.Build{Version: version, OS: "linux", Arch: "amd64", SHA256: d.SHA256, Size: d.Size})
	require.NoError(t, err)
	return build{data: data, sig: sig}
}

func (e *env) upload(tok string, b build) (*eitriv1.Release, error) {
	st := e.releases(tok).UploadRelease(context.Background())
	if err := st.Send(&eitriv1.UploadReleaseRequest{Part: &eitriv1.UploadReleaseRequest_Signature{Signature: b.sig.Marshal()}}); err != nil {
		_, err := st.CloseAndReceive()
		return nil, err
	}
	for chunk := range chunks(b.data, 4096) {
		if err := st.Send(&eitriv1.UploadReleaseRequest{Part: &eitriv1.UploadReleaseRequest_Chunk{Chunk: chunk}}); err != nil {
			break
		}
	}
	resp, err := st.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetRelease(), nil
}

func chunks(b []byte, n int) func(func([]byte) bool) {
	return func(yield func([]byte) bool) {
		for len(b) > 0 {
			k := min(n, len(b))
			if !yield(b[:k]) {
				return
			}
			b = b[k:]
		}
	}
}

func hello(version string) *eitriv1.Hello {
	return &eitriv1.Hello{AgentVersion: version, Address: "192.0.2.10", Accelerator: "tcg", Os: "linux", Arch: "amd64"}
}

func TestOnlyAnAdminUploadsAndOnlyABuildTheReleaseKeySigned(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	_, foreign, err := release.GenerateKey()
	require.NoError(t, err)
	e, _ := releaseEnv(t, pub)
	good := signed(t, priv, "v1.4.0", "eitri v1.4.0 ")

	bob, _ := e.userToken("bob", 0)
	_, err = e.upload(bob, good)
	assert.Equal(t, connect.CodePermissionDenied, code(err), "a user who is not an admin sends no build")

	_, err = e.upload(e.admin, signed(t, foreign, "v1.4.0", "eitri v1.4.0 "))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.Contains(t, err.Error(), foreign.Public().ID(), "says who signed it")

	tampered := good
	tampered.data = append([]byte(nil), good.data...)
	tampered.data[100] ^= 1
	_, err = e.upload(e.admin, tampered)
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.Contains(t, err.Error(), "sha256")

	rel, err := e.upload(e.admin, good)
	require.NoError(t, err)
	assert.Equal(t, "v1.4.0", rel.GetVersion())
	assert.Equal(t, "linux", rel.GetOs())
	assert.Equal(t, "amd64", rel.GetArch())
	assert.Equal(t, int64(len(good.data)), rel.GetSize())
	assert.Equal(t, good.sig.SHA256, rel.GetSha256())
	assert.Equal(t, pub.ID(), rel.GetSigner())

	list, err := e.releases(bob).ListReleases(context.Background(), connect.NewRequest(&eitriv1.ListReleasesRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.GetReleases(), 1, "every user may read the list")

	_, err = e.upload(e.admin, good)
	assert.Equal(t, connect.CodeAlreadyExists, code(err))
}

func TestAControlPlaneWithoutAReleaseKeyTakesNoBuild(t *testing.T) {
	_, priv, err := release.GenerateKey()
	require.NoError(t, err)
	e := newEnv(t)
	_, err = e.upload(e.admin, signed(t, priv, "v1.4.0", "x"))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
}

func TestTheJoinTokenCarriesTheReleaseKey(t *testing.T) {
	pub, _, err := release.GenerateKey()
	require.NoError(t, err)
	e, _ := releaseEnv(t, pub)
	jt, err := e.hosts(e.admin).CreateJoinToken(context.Background(), connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.NoError(t, err)
	tok, err := jointoken.Decode(jt.Msg.GetToken())
	require.NoError(t, err)
	key, err := release.ParsePublicKey(tok.GetReleaseKey())
	require.NoError(t, err)
	assert.True(t, key.Equal(pub))
}

// upgradeFleet is n connected hosts on v1.3.0 and a v1.4.0 build.
func upgradeFleet(t *testing.T, n int) (*env, *clock, []*agent, []string, build) {
	t.Helper()
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	e, c := releaseEnv(t, pub)
	b := signed(t, priv, "v1.4.0", "eitri v1.4.0 ")
	_, err = e.upload(e.admin, b)
	require.NoError(t, err)
	var agents []*agent
	var creds []string
	for i := range n {
		id, cred := e.enroll(string(rune('a' + i)))
		agents = append(agents, e.connectWith(id, cred, big(), hello("v1.3.0")))
		creds = append(creds, cred)
	}
	return e, c, agents, creds, b
}

func (e *env) startRollout(r *eitriv1.StartRolloutRequest) (*eitriv1.Rollout, error) {
	resp, err := e.releases(e.admin).StartRollout(context.Background(), connect.NewRequest(r))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetRollout(), nil
}

func (e *env) rollout(id string) *eitriv1.Rollout {
	e.t.Helper()
	resp, err := e.releases(e.admin).GetRollout(context.Background(), connect.NewRequest(&eitriv1.GetRolloutRequest{Id: id}))
	require.NoError(e.t, err)
	return resp.Msg.GetRollout()
}

func offered(s *eitriv1.DesiredStateSnapshot) bool { return s.GetAgentUpgrade() != nil }

// noOfferYet drains what a stream has been sent and says whether any of it
// offered an upgrade.
func (a *agent) offeredSoFar() bool {
	for {
		select {
		case s := <-a.snaps:
			if offered(s) {
				return true
			}
		default:
			return false
		}
	}
}

func (e *env) waitRollout(id string, cond func(*eitriv1.Rollout) bool, why string) *eitriv1.Rollout {
	e.t.Helper()
	var ro *eitriv1.Rollout
	require.Eventually(e.t, func() bool { ro = e.rollout(id); return cond(ro) }, 5*time.Second, 10*time.Millisecond, why)
	return ro
}

func hostState(ro *eitriv1.Rollout, hostID string) string {
	for _, h := range ro.GetHosts() {
		if h.GetHostId() == hostID {
			return h.GetState()
		}
	}
	return ""
}

func TestARolloutOffersTheCanaryFirstThenWavesOfAtMostMaxUnavailable(t *testing.T) {
	e, _, agents, creds, b := upgradeFleet(t, 4)
	ro, err := e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.4.0", All: true, MaxUnavailable: 2})
	require.NoError(t, err)
	assert.Equal(t, "canary", ro.GetState())
	canary := ro.GetHosts()[0].GetHostId()

	var ca *agent
	for _, a := range agents {
		if a.hostID == canary {
			ca = a
		}
	}
	offer := ca.nextWhere(t, offered, "the canary is offered the build").GetAgentUpgrade()
	assert.Equal(t, "v1.4.0", offer.GetVersion())
	assert.Equal(t, b.sig.SHA256, offer.GetSha256())
	assert.Equal(t, b.sig.Sig, offer.GetSignature(), "the agent checks the signature itself")
	assert.Equal(t, "/releases/"+b.sig.SHA256, offer.GetUrl())
	assert.Equal(t, uint64(1), offer.GetAttempt())
	for _, a := range agents {
		if a != ca {
			assert.False(t, a.offeredSoFar(), "no other host is offered anything while the canary runs")
		}
	}

	// The host fetches the build with its own credential, and may resume.
	var cred string
	for i, a := range agents {
		if a == ca {
			cred = creds[i]
		}
	}
	req, _ := http.NewRequest(http.MethodGet, e.url+offer.GetUrl(), nil)
	req.Header.Set("Authorization", "Bearer "+cred)
	req.Header.Set("Range", "bytes=100-")
	resp, err := e.http.Do(req)
	require.NoError(t, err)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusPartialContent, resp.StatusCode)
	assert.Equal(t, b.data[100:], got)
	anon, err := e.http.Get(e.url + offer.GetUrl())
	require.NoError(t, err)
	anon.Body.Close()
	assert.Equal(t, http.StatusUnauthorized, anon.StatusCode, "only hosts fetch builds")

	// The canary says where it is, then comes back as the new version.
	ca.report(t, &eitriv1.ActualStateReport{Capacity: big(), Upgrade: &eitriv1.AgentUpgradeStatus{TargetVersion: "v1.4.0", Step: "downloading",
		Detail: "downloading agent v1.4.0 12/40 MiB", RolloutId: ro.GetId(), Attempt: 1}})
	require.Eventually(t, func() bool {
		return e.host(canary).GetUpgrade().GetDetail() == "downloading agent v1.4.0 12/40 MiB"
	}, 5*time.Second, 10*time.Millisecond, "the host's narration is on its row")
	assert.Equal(t, "downloading", e.host(canary).GetUpgrade().GetStep())

	e.connectWith(canary, cred, big(), hello("v1.4.0"))
	ro = e.waitRollout(ro.GetId(), func(r *eitriv1.Rollout) bool { return r.GetState() == "rolling" }, "the canary's success opens the waves")
	upgrading := 0
	for _, h := range ro.GetHosts() {
		if h.GetState() == "upgrading" {
			upgrading++
		}
	}
	assert.Equal(t, 2, upgrading, "a wave is at most max_unavailable hosts")

	// Everyone comes back on the new version: the rollout is done.
	for i, a := range agents {
		if a != ca {
			e.connectWith(a.hostID, creds[i], big(), hello("v1.4.0"))
		}
	}
	ro = e.waitRollout(ro.GetId(), func(r *eitriv1.Rollout) bool { return r.GetState() == "done" }, "every host upgraded")
	for _, h := range ro.GetHosts() {
		assert.Equal(t, "done", h.GetState())
		assert.Equal(t, "v1.3.0", h.GetFromVersion())
	}
}

func TestTheFirstFailureHaltsTheRolloutAndResumeOffersItAgain(t *testing.T) {
	e, _, agents, creds, _ := upgradeFleet(t, 2)
	ro, err := e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.4.0", All: true})
	require.NoError(t, err)
	canary := ro.GetHosts()[0].GetHostId()
	var ca, other *agent
	var caCred string
	for i, a := range agents {
		if a.hostID == canary {
			ca, caCred = a, creds[i]
		} else {
			other = a
		}
	}
	ca.nextWhere(t, offered, "the canary is offered the build")

	// The new build crashed at start; the host rolled itself back and says so.
	back := e.connectWith(canary, caCred, big(), hello("v1.3.0"))
	back.report(t, &eitriv1.ActualStateReport{Capacity: big(), Upgrade: &eitriv1.AgentUpgradeStatus{TargetVersion: "v1.4.0", Step: "failed",
		Error: "agent v1.4.0 exited at start (exit status 3); back on v1.3.0", RolloutId: ro.GetId(), Attempt: 1}})
	ro = e.waitRollout(ro.GetId(), func(r *eitriv1.Rollout) bool { return r.GetState() == "halted" }, "a failure halts the rollout")
	assert.Contains(t, ro.GetReason(), "exited at start")
	assert.Equal(t, "failed", hostState(ro, canary))
	assert.Equal(t, "pending", hostState(ro, other.hostID), "the second host is untouched")
	assert.False(t, other.offeredSoFar())
	h := e.host(canary)
	assert.Equal(t, "failed", h.GetUpgrade().GetStep())
	assert.Contains(t, h.GetUpgrade().GetError(), "exited at start", "the host row says what failed")

	// Resuming is a new attempt at the canary.
	_, err = e.releases(e.admin).ResumeRollout(context.Background(), connect.NewRequest(&eitriv1.ResumeRolloutRequest{Id: ro.GetId()}))
	require.NoError(t, err)
	offer := back.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return s.GetAgentUpgrade().GetAttempt() == 2 }, "offered again")
	assert.Equal(t, "v1.4.0", offer.GetAgentUpgrade().GetVersion())
}

func TestPauseStartsNoMoreAndAbortWithdrawsTheOffer(t *testing.T) {
	e, _, agents, creds, _ := upgradeFleet(t, 2)
	ro, err := e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.4.0", All: true})
	require.NoError(t, err)
	canary := ro.GetHosts()[0].GetHostId()
	var ca, other *agent
	var caCred string
	for i, a := range agents {
		if a.hostID == canary {
			ca, caCred = a, creds[i]
		} else {
			other = a
		}
	}
	ca.nextWhere(t, offered, "the canary is offered the build")
	rel := e.releases(e.admin)
	_, err = rel.PauseRollout(context.Background(), connect.NewRequest(&eitriv1.PauseRolloutRequest{Id: ro.GetId()}))
	require.NoError(t, err)
	e.connectWith(canary, caCred, big(), hello("v1.4.0"))
	ro = e.waitRollout(ro.GetId(), func(r *eitriv1.Rollout) bool { return hostState(r, canary) == "done" }, "the canary finishes")
	assert.Equal(t, "paused", ro.GetState())
	assert.Equal(t, "pending", hostState(ro, other.hostID), "a paused rollout starts no host")

	_, err = rel.ResumeRollout(context.Background(), connect.NewRequest(&eitriv1.ResumeRolloutRequest{Id: ro.GetId()}))
	require.NoError(t, err)
	other.nextWhere(t, offered, "resumed, the next host is offered")
	aborted, err := rel.AbortRollout(context.Background(), connect.NewRequest(&eitriv1.AbortRolloutRequest{Id: ro.GetId()}))
	require.NoError(t, err)
	assert.Equal(t, "aborted", aborted.Msg.GetRollout().GetState())
	other.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return !offered(s) }, "the abort withdraws the offer")

	_, err = rel.AbortRollout(context.Background(), connect.NewRequest(&eitriv1.AbortRolloutRequest{Id: ro.GetId()}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
}

func TestADowngradeIsRefusedUnlessAskedFor(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	e, _ := releaseEnv(t, pub)
	_, err = e.upload(e.admin, signed(t, priv, "v1.2.0", "old"))
	require.NoError(t, err)
	id, cred := e.enroll("a")
	e.connectWith(id, cred, big(), hello("v1.3.0"))

	_, err = e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.2.0", HostIds: []string{id}})
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "downgrade")
	ro, err := e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.2.0", HostIds: []string{id}, AllowDowngrade: true})
	require.NoError(t, err)
	assert.Equal(t, "canary", ro.GetState())

	_, err = e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.2.0", HostIds: []string{id}, AllowDowngrade: true})
	assert.Equal(t, connect.CodeAlreadyExists, code(err), "one rollout at a time")
}

func TestAVersionWithNoBuildForAHostsPlatformIsRefused(t *testing.T) {
	e, _, agents, _, _ := upgradeFleet(t, 1)
	_, err := e.startRollout(&eitriv1.StartRolloutRequest{Version: "v9.0.0", HostIds: []string{agents[0].hostID}})
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "eitri release upload")
}

func TestAHostThatNeverTakesTheOfferShowsStuckAndAnOfflineOneOffline(t *testing.T) {
	e, clk, agents, creds, _ := upgradeFleet(t, 2)
	ro, err := e.startRollout(&eitriv1.StartRolloutRequest{Version: "v1.4.0", All: true, MaxUnavailable: 2})
	require.NoError(t, err)
	canary := ro.GetHosts()[0].GetHostId()
	assert.True(t, e.host(canary).GetAgentUpdateAvailable(), "a newer build is held for its platform")
	assert.Equal(t, "linux/amd64", e.host(canary).GetPlatform())
	assert.Equal(t, "offered", e.host(canary).GetUpgrade().GetStep())
	assert.False(t, e.host(canary).GetUpgrade().GetStuck(), "not before the bound")

	clk.Advance(6 * time.Minute)
	var h *eitriv1.Host
	require.Eventually(t, func() bool { h = e.host(canary); return h.GetUpgrade().GetStuck() }, 5*time.Second, 10*time.Millisecond)
	var msg string
	for _, c := range h.GetConditions() {
		if c.GetType() == "upgrade_stuck" {
			msg = c.GetMessage()
		}
	}
	assert.Equal(t, "stuck: offered v1.4.0 6 min ago, still on v1.3.0", msg)

	// The same host gone offline is offline, not stuck.
	for i, a := range agents {
		if a.hostID == canary {
			_ = a.stream.CloseRequest()
			_ = creds[i]
		}
	}
	require.Eventually(t, func() bool { return !e.host(canary).GetConnected() }, 5*time.Second, 10*time.Millisecond)
	h = e.host(canary)
	assert.False(t, h.GetUpgrade().GetStuck())
	for _, c := range h.GetConditions() {
		assert.NotEqual(t, "upgrade_stuck", c.GetType())
	}
}

func TestAnAgentOneVersionBehindIsShownSupportedAndTwoBehindNot(t *testing.T) {
	pub, _, err := release.GenerateKey()
	require.NoError(t, err)
	e, _ := releaseEnv(t, pub) // the control plane is v1.4.0
	a, acred := e.enroll("a")
	b, bcred := e.enroll("b")
	c, ccred := e.enroll("c")
	e.connectWith(a, acred, big(), hello("v1.3.2"))
	e.connectWith(b, bcred, big(), hello("v1.2.0"))
	e.connectWith(c, ccred, big(), hello("v1.4.0"))
	skew := func(id string) string {
		for _, c := range e.host(id).GetConditions() {
			if c.GetType() == "version_skew" {
				return c.GetMessage()
			}
		}
		return ""
	}
	assert.Contains(t, skew(a), "one version behind the control plane (v1.4.0), which is supported")
	assert.Contains(t, skew(b), "not supported")
	assert.Empty(t, skew(c))
}
