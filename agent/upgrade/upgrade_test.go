package upgrade_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/upgrade"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/release"
)

// script is a stand-in agent build: it says its version and does nothing
// else. Padding makes it big enough to be fetched in several reads.
func script(version string) []byte {
	return []byte("#!/bin/sh\n[ \"$1\" = version ] && echo \"eitri version " + version + "\"\nexit 0\n# " +
		strings.Repeat("x", 300<<10) + "\n")
}

// buildServer serves one build at /releases/<sha>, to the host credential
// only, answering ranges; cut, when set, ends the first full response
// halfway.
type buildServer struct {
	*httptest.Server
	mu       sync.Mutex
	requests []string // each request's Range header
}

func serve(t *testing.T, data []byte, cut bool) *buildServer {
	t.Helper()
	bs := &buildServer{}
	first := true
	bs.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer host-cred" {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		bs.mu.Lock()
		bs.requests = append(bs.requests, r.Header.Get("Range"))
		cutNow := cut && first
		first = false
		bs.mu.Unlock()
		if cutNow {
			w.Header().Set("Content-Length", strconv.Itoa(len(data)))
			_, _ = w.Write(data[:len(data)/2])
			panic(http.ErrAbortHandler)
		}
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	t.Cleanup(bs.Close)
	return bs
}

func (bs *buildServer) seen() []string {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return append([]string(nil), bs.requests...)
}

type host struct {
	dir, exe string
	u        *upgrade.Upgrader
}

// newHost is an agent running "v1.3.0" from exe, trusting key.
func newHost(t *testing.T, key release.PublicKey, url string) *host {
	t.Helper()
	return newHostWith(t, key, http.DefaultClient, url)
}

// newHostWith is newHost fetching through client.
func newHostWith(t *testing.T, key release.PublicKey, client *http.Client, url string) *host {
	t.Helper()
	dir := t.TempDir()
	exe := filepath.Join(dir, "bin", "eitri")
	require.NoError(t, os.MkdirAll(filepath.Dir(exe), 0o755))
	require.NoError(t, os.WriteFile(exe, script("v1.3.0"), 0o755))
	u, err := upgrade.New(upgrade.Config{Dir: filepath.Join(dir, "upgrade"), Exe: exe, Version: "v1.3.0", Key: key,
		Client: client, BaseURL: func() string { return url }, Credential: "host-cred", RetryWait: time.Millisecond})
	require.NoError(t, err)
	return &host{dir: dir, exe: exe, u: u}
}

func offer(t *testing.T, priv release.PrivateKey, version string, data []byte) *eitriv1.AgentUpgrade {
	t.Helper()
	d, err := release.Sum(bytes.NewReader(data))
	require.NoError(t, err)
	sig, err := release.Sign(priv, release.Build{Version: version, OS: runtime.GOOS, Arch: runtime.GOARCH, SHA256: d.SHA256, Size: d.Size})
	require.NoError(t, err)
	return &eitriv1.AgentUpgrade{Version: version, Url: "/releases/" + d.SHA256, Sha256: d.SHA256, Os: runtime.GOOS, Arch: runtime.GOARCH,
		Size: d.Size, Signature: sig.Sig, KeyId: sig.KeyID, RolloutId: "ro-1", Attempt: 1}
}

// take offers o and runs the upgrader until it restarts or settles failed.
func (h *host) take(t *testing.T, o *eitriv1.AgentUpgrade) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- h.u.Run(ctx) }()
	h.u.Offer(o)
	for {
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Millisecond):
			if h.u.Status().GetStep() == upgrade.StepFailed {
				cancel()
				<-done
				return nil
			}
		}
	}
}

func TestAVerifiedBuildIsSwappedInKeepingThePreviousOne(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	bs := serve(t, build, false)
	h := newHost(t, pub, bs.URL)

	err = h.take(t, offer(t, priv, "v1.4.0", build))
	var r *upgrade.Restart
	require.ErrorAs(t, err, &r, "status: %v", h.u.Status())
	assert.Equal(t, h.exe, r.Exe)
	got, _ := os.ReadFile(h.exe)
	assert.Equal(t, build, got, "the new build is in place")
	prev, _ := os.ReadFile(filepath.Join(h.dir, "upgrade", "eitri.previous"))
	assert.Equal(t, script("v1.3.0"), prev, "the previous build is kept")
	assert.FileExists(t, filepath.Join(h.dir, "upgrade", upgrade.TrialFile), "the restart is on trial")
	assert.Equal(t, upgrade.StepRestarting, h.u.Status().GetStep())
}

func TestADownloadCutOffResumesWhereItStopped(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	bs := serve(t, build, true)
	h := newHost(t, pub, bs.URL)

	var r *upgrade.Restart
	require.ErrorAs(t, h.take(t, offer(t, priv, "v1.4.0", build)), &r, "status: %v", h.u.Status())
	seen := bs.seen()
	require.Len(t, seen, 2)
	assert.Empty(t, seen[0])
	assert.Equal(t, fmt.Sprintf("bytes=%d-", len(build)/2), seen[1], "the second request asks only for the rest")
}

// refused checks that an offer failed with why in its error and that
// nothing was swapped.
func refused(t *testing.T, h *host, why string) {
	t.Helper()
	st := h.u.Status()
	assert.Equal(t, upgrade.StepFailed, st.GetStep())
	assert.Contains(t, st.GetError(), why)
	got, _ := os.ReadFile(h.exe)
	assert.Equal(t, script("v1.3.0"), got, "the running build stays in place")
	assert.NoFileExists(t, filepath.Join(h.dir, "upgrade", upgrade.TrialFile))
}

func TestABuildWithOneByteChangedIsRefusedBeforeAnythingIsSwapped(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	o := offer(t, priv, "v1.4.0", build)
	tampered := append([]byte(nil), build...)
	tampered[len(tampered)-10] ^= 1
	h := newHost(t, pub, serve(t, tampered, false).URL)

	require.NoError(t, h.take(t, o))
	refused(t, h, "sha256")
	assert.Contains(t, h.u.Status().GetError(), "refused")
}

func TestABuildSignedByAnotherKeyIsRefusedWithoutADownload(t *testing.T) {
	pub, _, err := release.GenerateKey()
	require.NoError(t, err)
	_, other, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	bs := serve(t, build, false)
	h := newHost(t, pub, bs.URL)

	require.NoError(t, h.take(t, offer(t, other, "v1.4.0", build)))
	refused(t, h, other.Public().ID())
	assert.Empty(t, bs.seen(), "nothing is fetched for a signature this host cannot trust")
}

func TestABuildThatDoesNotSayItsVersionIsRefused(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.5.0") // signed as v1.4.0, but says otherwise
	h := newHost(t, pub, serve(t, build, false).URL)

	require.NoError(t, h.take(t, offer(t, priv, "v1.4.0", build)))
	refused(t, h, `says "eitri version v1.5.0"`)
}

func TestABuildWhoseVersionHangsIsRefusedAtTheProbeBoundEvenWithChildrenHoldingItsOutput(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	// The child sleep keeps the build's stdout open after the shell is
	// killed at the bound.
	build := []byte("#!/bin/sh\nsleep 600\n")
	url := serve(t, build, false).URL
	h := newHost(t, pub, url)
	h.u, err = upgrade.New(upgrade.Config{Dir: filepath.Join(h.dir, "upgrade"), Exe: h.exe, Version: "v1.3.0", Key: pub,
		Client: http.DefaultClient, BaseURL: func() string { return url }, Credential: "host-cred",
		RetryWait: time.Millisecond, ProbeTimeout: 200 * time.Millisecond})
	require.NoError(t, err)

	require.NoError(t, h.take(t, offer(t, priv, "v1.4.0", build)), "the offer settles (failed) well before take gives up")
	refused(t, h, "does not run here")
}

func TestAFailedOfferIsNotTakenAgainButALaterAttemptIs(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	tampered := append([]byte(nil), build...)
	tampered[len(tampered)-10] ^= 1
	bs := serve(t, tampered, false)
	h := newHost(t, pub, bs.URL)
	o := offer(t, priv, "v1.4.0", build)
	require.NoError(t, h.take(t, o))
	n := len(bs.seen())

	// The same offer again, as every snapshot repeats it: not fetched.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.u.Run(ctx) }()
	h.u.Offer(o)
	time.Sleep(50 * time.Millisecond) // a taken offer would have fetched by now
	cancel()
	<-done
	assert.Len(t, bs.seen(), n)

	o.Attempt = 2
	require.NoError(t, h.take(t, o))
	assert.Greater(t, len(bs.seen()), n, "a new attempt is taken")
}

func TestAHostWithoutAReleaseKeyRefusesEveryOffer(t *testing.T) {
	_, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	h := newHost(t, release.PublicKey{}, serve(t, build, false).URL)
	require.NoError(t, h.take(t, offer(t, priv, "v1.4.0", build)))
	refused(t, h, "trusts no release key")
}

func TestTheNewBuildCommitsOnceItReconnected(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "eitri")
	require.NoError(t, upgrade.WriteTrial(dir, "v1.4.0", "v1.3.0", exe, exe+".previous", os.Getpid(), time.Minute, nil))
	u, err := upgrade.New(upgrade.Config{Dir: dir, Exe: exe, Version: "v1.4.0"})
	require.NoError(t, err)
	assert.Equal(t, upgrade.StepRestarting, u.Status().GetStep())

	u.Healthy()
	st := u.Status()
	assert.Equal(t, upgrade.StepDone, st.GetStep())
	assert.Equal(t, "reconnected as v1.4.0", st.GetDetail())
	// The guard stands down on the record it reads.
	require.NoError(t, upgrade.RunGuard(dir))

	again, err := upgrade.New(upgrade.Config{Dir: dir, Exe: exe, Version: "v1.4.0"})
	require.NoError(t, err)
	assert.Equal(t, upgrade.StepDone, again.Status().GetStep(), "a later start still says how the last upgrade ended")
}

// guarded is a trial of a new build at exe whose agent is pid, with the
// previous build kept; the agent runs under a service manager so the guard
// restarts nothing itself.
func guarded(t *testing.T, pid int, bound time.Duration) (dir, exe string) {
	t.Helper()
	dir = t.TempDir()
	exe = filepath.Join(dir, "eitri")
	require.NoError(t, os.WriteFile(exe, script("v1.4.0"), 0o755))
	require.NoError(t, os.WriteFile(exe+".previous", script("v1.3.0"), 0o755))
	require.NoError(t, upgrade.WriteTrial(dir, "v1.4.0", "v1.3.0", exe, exe+".previous", pid, bound, []string{"INVOCATION_ID=x"}))
	return dir, exe
}

func rolledBack(t *testing.T, dir, exe, why string) {
	t.Helper()
	got, _ := os.ReadFile(exe)
	assert.Equal(t, script("v1.3.0"), got, "the previous build is back in place")
	assert.NoFileExists(t, filepath.Join(dir, upgrade.TrialFile))
	u, err := upgrade.New(upgrade.Config{Dir: dir, Exe: exe, Version: "v1.3.0"})
	require.NoError(t, err)
	st := u.Status()
	assert.Equal(t, upgrade.StepFailed, st.GetStep())
	assert.Contains(t, st.GetError(), why)
	assert.Contains(t, st.GetError(), "rolled back to v1.3.0")
}

func TestANewBuildThatExitsAtStartIsRolledBackByTheGuard(t *testing.T) {
	dead := exec.Command("true")
	require.NoError(t, dead.Run())
	dir, exe := guarded(t, dead.Process.Pid, time.Minute)
	require.NoError(t, upgrade.RunGuard(dir))
	rolledBack(t, dir, exe, "agent v1.4.0 exited before it reconnected")
}

func TestANewBuildThatNeverReconnectsIsStoppedAndRolledBack(t *testing.T) {
	hung := exec.Command("sleep", "60")
	require.NoError(t, hung.Start())
	exited := make(chan error, 1)
	go func() { exited <- hung.Wait() }()
	dir, exe := guarded(t, hung.Process.Pid, 200*time.Millisecond)
	require.NoError(t, upgrade.RunGuard(dir))
	select {
	case err := <-exited:
		var ee *exec.ExitError
		assert.True(t, errors.As(err, &ee), "the hung agent was stopped")
	case <-time.After(5 * time.Second):
		t.Fatal("the hung agent is still running")
	}
	rolledBack(t, dir, exe, "did not reconnect and report within")
}

func TestTheDownloadSaysHowFarItIs(t *testing.T) {
	assert.Equal(t, "downloading agent v1.4 12/40 MiB", upgrade.DownloadDetail("v1.4", 12<<20, 40<<20))
}
