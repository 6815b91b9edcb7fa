package main

import (
	"bytes"
	"context"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/cmd/eitri/cli"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/store/pgtest"
	"github.com/a73x/eitri/wire/connclient"
)

// migrateDB runs eitri server migrate-db as typed, and returns what it
// printed on stdout and stderr.
func migrateDB(args ...string) (string, error) {
	var out bytes.Buffer
	err := execute(context.Background(), append([]string{"server", "migrate-db"}, args...),
		cli.IO{In: strings.NewReader(""), Out: &out, Err: &out})
	return out.String(), err
}

// A fleet on SQLite moves to PostgreSQL: the control plane comes back on
// the same address, presenting the certificate the agent pinned, with the
// same admin token, VM and SSH CAs, and the agent (the real reconcile
// engine, with its fencing, over a fake hypervisor) reconnects by itself
// and takes the new control plane's word: no refusal, no quarantine, and a
// stop sent through it reaches the guest.
func TestMigrateDBMovesASQLiteFleetToPostgreSQLAndTheAgentFollows(t *testing.T) {
	db := pgtest.DSN(t)
	dir := t.TempDir()
	cp := startControlPlane(t, dir, "127.0.0.1:0")
	admin := cp.admin()
	id := cp.enroll(admin)

	eng, hv := engineOverGuests(t)
	agent := quickAgent(id, measured{eng}, "agent-1")
	agent.Hello = func() *eitriv1.Hello {
		cpID, epoch, gen := eng.Lineage()
		return &eitriv1.Hello{AgentVersion: "test", InstanceId: "agent-1", ControlPlaneId: cpID, AppliedEpoch: epoch, AppliedGeneration: gen}
	}
	agentCtx, stopAgent := context.WithCancel(context.Background())
	agentDone := startAgentStream(agentCtx, agent)
	defer func() { stopAgent(); <-agentDone }()
	require.Eventually(t, func() bool {
		h, err := cp.srv.Fleet.GetHost(admin, id.HostID)
		return err == nil && h.Connected && h.Capacity != nil
	}, 10*time.Second, 10*time.Millisecond)
	vm, err := cp.srv.Fleet.CreateVM(admin, &eitriv1.CreateVMRequest{
		Name: "web-1", ImageUrl: "http://x/y.raw", ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Vcpus: 1, MemMb: 256, DiskGb: 1,
	})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return hv.isRunning(vm.Id) }, 10*time.Second, 10*time.Millisecond, "the VM boots")
	_, err = cp.srv.Fleet.RotateSSHCA(admin, "user") // so there is a previous key to carry too
	require.NoError(t, err)
	keys, err := cp.srv.Fleet.SSHCAKeys(admin)
	require.NoError(t, err)
	cpID, _, applied := eng.Lineage()
	require.NotEmpty(t, cpID)
	fingerprint, addr := cp.srv.Fingerprint, cp.addr

	// The password (ignored by the test server's trust authentication)
	// must never be printed.
	to := db + "&password=s3cret"
	out, err := migrateDB("--from", dir, "--to", to)
	require.ErrorContains(t, err, "stop it first", "refused while the control plane still has its database open")
	assert.NotContains(t, out+err.Error(), "s3cret")

	cp.stop()
	start := time.Now()
	out, err = migrateDB("--from", dir, "--to", to)
	require.NoError(t, err, out)
	t.Logf("migrate-db took %v:\n%s", time.Since(start), out)
	assert.NotContains(t, out, "s3cret")
	assert.Regexp(t, regexp.MustCompile(`(?m)^  vms +1$`), out)
	assert.Regexp(t, regexp.MustCompile(`(?m)^  hosts +1$`), out)
	assert.Regexp(t, regexp.MustCompile(`(?m)^  secrets +9$`), out, "the TLS material and both SSH CAs, with the user CA's previous key")
	assert.Contains(t, out, "Keep the old control plane stopped")
	assert.Contains(t, out, "eitri server --data-dir "+dir)

	out, err = migrateDB("--from", dir, "--to", to)
	require.ErrorContains(t, err, "not empty", "a second run changes nothing")
	assert.NotContains(t, out+err.Error(), "s3cret")

	// Back on the same address, on PostgreSQL, with a fresh data dir.
	cp2 := startControlPlaneWith(t, addr, server.Config{DataDir: t.TempDir(), DB: db})
	assert.Equal(t, fingerprint, cp2.srv.Fingerprint, "the certificate the agent pinned")
	assert.Empty(t, cp2.srv.AdminToken, "no second first admin")
	p, err := cp2.srv.Fleet.Resolve(context.Background(), tokenIn(t, dir))
	require.NoError(t, err, "the old admin token works")
	admin2 := auth.WithPrincipal(context.Background(), p)
	got, err := cp2.srv.Fleet.GetVM(admin2, vm.Id)
	require.NoError(t, err)
	assert.Equal(t, "web-1", got.Name)
	keys2, err := cp2.srv.Fleet.SSHCAKeys(admin2)
	require.NoError(t, err)
	assert.Equal(t, keys.GetUserCaKeys(), keys2.GetUserCaKeys(), "the user CA, and the one it rotated from")
	assert.Equal(t, keys.GetHostCaKeys(), keys2.GetHostCaKeys())

	require.Eventually(t, func() bool {
		h, err := cp2.srv.Fleet.GetHost(admin2, id.HostID)
		return err == nil && h.Connected && h.Capacity != nil
	}, 20*time.Second, 20*time.Millisecond, "the agent reconnects by itself")
	_, err = cp2.srv.Fleet.SetPower(admin2, vm.Id, "stopped")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return !hv.isRunning(vm.Id) }, 10*time.Second, 10*time.Millisecond,
		"the stop sent by the control plane on PostgreSQL is applied")
	cpID2, _, applied2 := eng.Lineage()
	assert.Equal(t, cpID, cpID2, "the agent holds the same control plane identity")
	assert.Greater(t, applied2, applied)
	rep := eng.Report()
	assert.Nil(t, rep.GetSnapshotRefused())
	assert.Empty(t, rep.GetQuarantined())
	require.Eventually(t, func() bool {
		v, err := cp2.srv.Fleet.GetVM(admin2, vm.Id)
		return err == nil && v.Lifecycle == "stopped"
	}, 10*time.Second, 10*time.Millisecond)
	h, err := cp2.srv.Fleet.GetHost(admin2, id.HostID)
	require.NoError(t, err)
	assert.Empty(t, h.Conditions, "no fencing refusal, no orphans")
}

// The files migrate-db carries are the ones replicas share: a replica
// that has made and rotated everything holds exactly those names.
func TestMigrateDBCarriesEveryFileReplicasShare(t *testing.T) {
	db := pgtest.DSN(t)
	srv, err := server.New(context.Background(), server.Config{DataDir: t.TempDir(), DB: db, PublicURL: "https://127.0.0.1:7443"})
	require.NoError(t, err)
	defer srv.Close()
	p, err := srv.Fleet.Resolve(context.Background(), srv.AdminToken)
	require.NoError(t, err)
	admin := auth.WithPrincipal(context.Background(), p)
	for _, which := range []string{"user", "host"} {
		_, err := srv.Fleet.RotateSSHCA(admin, which)
		require.NoError(t, err)
	}
	secrets, err := srv.Store.Secrets(context.Background())
	require.NoError(t, err)
	var names []string
	for name := range secrets {
		names = append(names, name)
	}
	slices.Sort(names)
	assert.Equal(t, slices.Sorted(maps.Keys(store.SecretFiles)), names,
		"a replica shares exactly the files store.SecretFiles names")
}

func TestMigrateDBRefusesWhatItCannotCopyWithoutEchoingAPassword(t *testing.T) {
	t.Setenv("EITRI_DB", "")
	dir := t.TempDir()
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"--to", "postgres://db/eitri"}, "--from"},
		{[]string{"--from", dir}, "--to"},
		{[]string{"--from", dir, "--to", "postgress://eitri:s3cret@db/eitri"}, "postgres://"},
		{[]string{"--from", "postgres://eitri:s3cret@old/eitri", "--to", "postgres://db/eitri"}, "copies from SQLite"},
	} {
		_, err := migrateDB(c.args...)
		var ue cli.UsageError
		require.ErrorAs(t, err, &ue, "%v", c.args)
		assert.Contains(t, err.Error(), c.says)
		assert.NotContains(t, err.Error(), "s3cret")
	}
	_, err := migrateDB("--from", dir, "--to", "postgres://127.0.0.1:1/eitri")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "eitri.db", "a data dir without a database is refused before the target is opened")
	assert.NoFileExists(t, filepath.Join(dir, "eitri.db"), "and no empty database is made there")
}

// The case with a real guest: a SQLite fleet whose host (a real
// agent, in a network namespace) runs a real QEMU guest moves to
// PostgreSQL. The guest is never stopped: the same QEMU process, still
// ready, under the control plane on PostgreSQL, which the old token still
// opens over the pinned certificate.
func TestMigrateDBMovesAFleetWithARunningGuestWithoutStoppingIt(t *testing.T) {
	if !inNetns(t) {
		return
	}
	db := pgtest.DSN(t)
	// Short: QEMU's QMP socket path under it must fit in 107 bytes.
	dir, err := os.MkdirTemp("", "eitri-mig-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	controlDir, agentDir := filepath.Join(dir, "control"), filepath.Join(dir, "agent")
	imgURL, imgSum := slowImage(t, os.Getenv("EITRI_GUEST_IMAGE"))

	cp := startControlPlane(t, controlDir, "127.0.0.1:0")
	jt, err := cp.srv.Fleet.CreateJoinToken(cp.admin(), time.Minute)
	require.NoError(t, err)
	agentCtx, stopAgent := context.WithCancel(context.Background())
	agentDone := make(chan error, 1)
	go func() {
		agentDone <- execute(agentCtx, []string{"agent", "--data-dir", agentDir, "--join", jt.Token, "--name", "h1",
			"--bridge", "eitrimig0", "--subnet", "10.81.0.1/24", "--vm-timeout", "3m", "--log-level", "warn",
			"--image-allow", "127.0.0.1/32"}, cli.IO{In: strings.NewReader(""), Out: io.Discard, Err: os.Stderr})
	}()
	var pid int
	t.Cleanup(func() {
		stopAgent()
		select {
		case <-agentDone:
		case <-time.After(time.Minute):
			t.Error("the agent did not stop")
		}
		if pid != 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL) // QEMU outlives its agent by design
		}
	})
	var hostID string
	require.Eventually(t, func() bool {
		hosts, err := cp.srv.Fleet.ListHosts(cp.admin())
		if err != nil || len(hosts) != 1 {
			return false
		}
		hostID = hosts[0].Id
		return hosts[0].Connected && hosts[0].Capacity != nil
	}, 90*time.Second, 100*time.Millisecond, "the agent enrolls and reports its capacity (after proving its accelerator)")
	vm, err := cp.srv.Fleet.CreateVM(cp.admin(), &eitriv1.CreateVMRequest{Name: "web-1", ImageUrl: imgURL, ImageSha256: imgSum, Vcpus: 1, MemMb: 256, DiskGb: 1})
	require.NoError(t, err)
	var ip string
	require.Eventually(t, func() bool {
		v, err := cp.srv.Fleet.GetVM(cp.admin(), vm.Id)
		if err == nil && v.Lifecycle == "failed" {
			t.Fatalf("the VM failed: %s", v.LastError)
		}
		ip = v.GetAssignedIp()
		return err == nil && v.Lifecycle == "ready"
	}, 4*time.Minute, 200*time.Millisecond, "the guest boots")
	pid = qemuPID(t, agentDir, vm.Id)
	fp, addr, token := cp.srv.Fingerprint, cp.addr, tokenIn(t, controlDir)

	cp.stop()
	out, err := migrateDB("--from", controlDir, "--to", db)
	require.NoError(t, err, out)
	cp2 := startControlPlaneWith(t, addr, server.Config{DataDir: t.TempDir(), DB: db})

	// Through the API, as a client would: pinned certificate, old token.
	hc := connclient.HTTPClient(fp)
	url := "https://" + addr
	bearer := connect.WithInterceptors(connclient.Bearer(token))
	vms := eitriv1connect.NewVMServiceClient(hc, url, bearer)
	hosts := eitriv1connect.NewHostServiceClient(hc, url, bearer)
	require.Eventually(t, func() bool {
		h, err := hosts.GetHost(context.Background(), connect.NewRequest(&eitriv1.GetHostRequest{Id: hostID}))
		if err != nil || !h.Msg.Host.Connected {
			return false
		}
		r, err := vms.GetVM(context.Background(), connect.NewRequest(&eitriv1.GetVMRequest{Id: vm.Id}))
		return err == nil && r.Msg.Vm.Lifecycle == "ready" && r.Msg.Vm.AssignedIp == ip
	}, time.Minute, 200*time.Millisecond, "the agent is back, and reports the guest ready where it was")
	assert.Equal(t, pid, qemuPID(t, agentDir, vm.Id), "the same QEMU: the guest was never stopped")
	assert.True(t, alive(pid))
	h, err := hosts.GetHost(context.Background(), connect.NewRequest(&eitriv1.GetHostRequest{Id: hostID}))
	require.NoError(t, err)
	assert.Empty(t, h.Msg.Host.Conditions, "no fencing refusal, no orphans")
	assert.Empty(t, cp2.srv.AdminToken)
}
