package store

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/wire/vmstate"
)

// t0 is a fixed UTC instant with nanoseconds, to prove exact round trips.
var t0 = time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC)

// openStore opens a SQLite store (eachEngine runs a test on both engines).
func openStore(t testing.TB) (*Store, string) {
	t.Helper()
	return engines[0].open(t)
}

func hashOf(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:]
}

func ptr(t time.Time) *time.Time { return &t }

// fixture creates users u1, u2 and hosts h1, h2.
func fixture(t testing.TB, s *Store) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, s.CreateUser(ctx, User{ID: "u1", Name: "alice", Admin: true, CreatedAt: t0}))
	require.NoError(t, s.CreateUser(ctx, User{ID: "u2", Name: "bob", CreatedAt: t0}))
	require.NoError(t, s.CreateHost(ctx, Host{ID: "h1", Name: "beta", CredentialHash: hashOf("h1"), CreatedAt: t0}))
	require.NoError(t, s.CreateHost(ctx, Host{ID: "h2", Name: "alpha", CredentialHash: hashOf("h2"), CreatedAt: t0}))
}

// mustCreateVM creates vm, holding CreateVM to its word: what it returns
// is the row as stored.
func mustCreateVM(t testing.TB, s *Store, vm VM) VM {
	t.Helper()
	ctx := context.Background()
	got, err := s.CreateVM(ctx, vm)
	require.NoError(t, err)
	stored, err := s.GetVM(ctx, vm.ID)
	require.NoError(t, err)
	require.Equal(t, stored, got, "CreateVM returns the row as stored")
	return got
}

func testVM(id, owner, host, name string, created time.Time) VM {
	return VM{
		ID: id, OwnerID: owner, HostID: host, Name: name,
		ImageURL: "https://images.example/debian.qcow2", ImageSHA256: "ab12",
		VCPUs: 2, MemMB: 1024, DiskGB: 10, PowerState: vmstate.PowerRunning,
		SSHAuthorizedKey: "ssh-ed25519 AAAA user", CreatedAt: created, UpdatedAt: created,
	}
}

func TestPragmas(t *testing.T) {
	s, _ := openStore(t)
	ctx := context.Background()
	var mode string
	require.NoError(t, s.db.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode))
	assert.Equal(t, "wal", mode)
	var fk, busy int
	require.NoError(t, s.db.QueryRowContext(ctx, `PRAGMA foreign_keys`).Scan(&fk))
	assert.Equal(t, 1, fk)
	require.NoError(t, s.db.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
	assert.Equal(t, int(busyTimeout.Milliseconds()), busy)
	var sync int
	require.NoError(t, s.db.QueryRowContext(ctx, `PRAGMA synchronous`).Scan(&sync))
	assert.Equal(t, 2, sync, "FULL: an acknowledged commit survives an OS crash")
}

func TestOpenRejectsBadPath(t *testing.T) {
	for _, p := range []string{"", ":memory:", "/tmp/x?mode=ro"} {
		_, err := Open(context.Background(), p)
		assert.Error(t, err, p)
	}
}

func TestUsers(t *testing.T) { eachEngine(t, testUsers) }

func testUsers(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()

	n, err := s.CountUsers(ctx)
	require.NoError(t, err)
	assert.Zero(t, n)

	fixture(t, s)
	n, err = s.CountUsers(ctx)
	require.NoError(t, err)
	assert.Equal(t, 2, n)

	err = s.CreateUser(ctx, User{ID: "u3", Name: "alice"})
	require.ErrorIs(t, err, ErrConflict)
	assert.Contains(t, err.Error(), `"alice"`)

	u, err := s.UserByID(ctx, "u2")
	require.NoError(t, err)
	assert.Equal(t, User{ID: "u2", Name: "bob", CreatedAt: t0}, u)

	_, err = s.UserByID(ctx, "nope")
	assert.ErrorIs(t, err, ErrNotFound)
	_, err = s.UserByName(ctx, "nope")
	assert.ErrorIs(t, err, ErrNotFound)

	// A zero creation time is filled in, in UTC.
	require.NoError(t, s.CreateUser(ctx, User{ID: "u3", Name: "carol"}))
	u, err = s.UserByID(ctx, "u3")
	require.NoError(t, err)
	assert.WithinDuration(t, time.Now(), u.CreatedAt, time.Minute)
	assert.Equal(t, time.UTC, u.CreatedAt.Location())
}

func TestTokens(t *testing.T) { eachEngine(t, testTokens) }

func testTokens(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)

	pat1 := Token{ID: "t1", UserID: "u1", Name: "laptop", Kind: TokenKindPAT, Hash: hashOf("s1"), CreatedAt: t0, ExpiresAt: ptr(t0.Add(time.Hour))}
	pat2 := Token{ID: "t2", UserID: "u1", Name: "ci", Kind: TokenKindPAT, Hash: hashOf("s2"), CreatedAt: t0.Add(time.Second)}
	pat3 := Token{ID: "t3", UserID: "u2", Name: "bob's", Kind: TokenKindPAT, Hash: hashOf("s3"), CreatedAt: t0.Add(2 * time.Second)}
	sess := Token{ID: "t4", UserID: "u1", Name: "console", Kind: TokenKindSession, Hash: hashOf("s4"), CreatedAt: t0.Add(3 * time.Second), ParentID: "t1"}
	for _, tok := range []Token{pat1, pat2, pat3, sess} {
		require.NoError(t, s.CreateToken(ctx, tok))
	}

	err := s.CreateToken(ctx, Token{ID: "t5", UserID: "u1", Kind: TokenKindPAT, Hash: hashOf("s1")})
	assert.ErrorIs(t, err, ErrConflict, "hash is unique")
	err = s.CreateToken(ctx, Token{ID: "t5", UserID: "ghost", Kind: TokenKindPAT, Hash: hashOf("s5")})
	assert.ErrorIs(t, err, ErrNotFound, "owner must exist")
	err = s.CreateToken(ctx, Token{ID: "t5", UserID: "u1", Kind: "api", Hash: hashOf("s5")})
	assert.Error(t, err)

	tok, u, err := s.TokenByHash(ctx, hashOf("s1"))
	require.NoError(t, err)
	assert.Equal(t, pat1, tok)
	assert.Equal(t, "alice", u.Name)
	assert.True(t, u.Admin)
	_, _, err = s.TokenByHash(ctx, hashOf("unknown"))
	assert.ErrorIs(t, err, ErrNotFound)

	require.NoError(t, s.TouchToken(ctx, "t1", t0.Add(time.Minute)))
	tok, _, err = s.TokenByHash(ctx, hashOf("s1"))
	require.NoError(t, err)
	require.NotNil(t, tok.LastUsedAt)
	assert.Equal(t, t0.Add(time.Minute), *tok.LastUsedAt)
	assert.ErrorIs(t, s.TouchToken(ctx, "nope", t0), ErrNotFound)

	ids := func(ts []Token) []string {
		var out []string
		for _, t := range ts {
			out = append(out, t.ID)
		}
		return out
	}
	all, err := s.ListTokens(ctx, "")
	require.NoError(t, err)
	assert.Equal(t, []string{"t3", "t2", "t1"}, ids(all), "PATs only, newest first")
	mine, err := s.ListTokens(ctx, "u1")
	require.NoError(t, err)
	assert.Equal(t, []string{"t2", "t1"}, ids(mine))

	assert.ErrorIs(t, s.RevokeToken(ctx, "t3", "u1"), ErrNotFound, "not u1's token")
	assert.ErrorIs(t, s.RevokeToken(ctx, "nope", ""), ErrNotFound)
	require.NoError(t, s.RevokeToken(ctx, "t1", "u1"))
	require.NoError(t, s.RevokeToken(ctx, "t3", ""), "admin revokes any")
	_, _, err = s.TokenByHash(ctx, hashOf("s1"))
	assert.ErrorIs(t, err, ErrNotFound)
	all, err = s.ListTokens(ctx, "")
	require.NoError(t, err)
	assert.Equal(t, []string{"t2"}, ids(all))
}

func TestHosts(t *testing.T) { eachEngine(t, testHosts) }

func testHosts(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)

	hosts, err := s.ListHosts(ctx)
	require.NoError(t, err)
	require.Len(t, hosts, 2)
	assert.Equal(t, []string{"alpha", "beta"}, []string{hosts[0].Name, hosts[1].Name}, "ordered by name")

	seen := t0.Add(time.Minute)
	require.NoError(t, s.UpdateHostHello(ctx, "h1", HostHello{AgentVersion: "v1.2.3", Address: "10.0.0.5", Accelerator: "kvm", AcceleratorReason: "kvm works with -cpu host"}, seen))
	h, err := s.HostByCredentialHash(ctx, hashOf("h1"))
	require.NoError(t, err)
	assert.Equal(t, Host{ID: "h1", Name: "beta", CredentialHash: hashOf("h1"), AgentVersion: "v1.2.3",
		Address: "10.0.0.5", Accelerator: "kvm", AcceleratorReason: "kvm works with -cpu host", CreatedAt: t0, LastSeenAt: &seen}, h)

	require.NoError(t, s.UpdateHostAccelerator(ctx, "h1", "tcg", "kvm unusable: KVM internal error; running under tcg"))
	h, err = s.HostByID(ctx, "h1")
	require.NoError(t, err)
	assert.Equal(t, "tcg", h.Accelerator)
	assert.Equal(t, "kvm unusable: KVM internal error; running under tcg", h.AcceleratorReason)
	assert.Equal(t, "v1.2.3", h.AgentVersion, "a re-probe keeps the rest of the hello")

	later := seen.Add(time.Second)
	require.NoError(t, s.TouchHost(ctx, "h1", later))
	h, err = s.HostByID(ctx, "h1")
	require.NoError(t, err)
	assert.Equal(t, later, *h.LastSeenAt)
	assert.Equal(t, "v1.2.3", h.AgentVersion, "touch keeps the hello")

	_, err = s.HostByID(ctx, "nope")
	assert.ErrorIs(t, err, ErrNotFound)
	_, err = s.HostByCredentialHash(ctx, hashOf("nope"))
	assert.ErrorIs(t, err, ErrNotFound)
	assert.ErrorIs(t, s.UpdateHostHello(ctx, "nope", HostHello{}, t0), ErrNotFound)
	assert.ErrorIs(t, s.UpdateHostAccelerator(ctx, "nope", "tcg", ""), ErrNotFound)
	assert.ErrorIs(t, s.TouchHost(ctx, "nope", t0), ErrNotFound)
	assert.ErrorIs(t, s.DeleteHost(ctx, "nope"), ErrNotFound)
	assert.ErrorIs(t, s.CreateHost(ctx, Host{ID: "h3", CredentialHash: hashOf("h1")}), ErrConflict)
}

func TestDeleteHostRefusedWhileVMsRemain(t *testing.T) {
	eachEngine(t, testDeleteHostRefusedWhileVMsRemain)
}

func testDeleteHostRefusedWhileVMsRemain(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	// Soft-deleted VMs still hold the host.
	_, _, err := s.UpdateVM(ctx, "v1", func(vm *VM) error { vm.DeletedAt = ptr(t0); return nil })
	require.NoError(t, err)

	err = s.DeleteHost(ctx, "h1")
	require.ErrorIs(t, err, ErrConflict)
	assert.Contains(t, err.Error(), "h1")
	_, err = s.HostByID(ctx, "h1")
	require.NoError(t, err, "host kept")

	require.NoError(t, s.DeleteVM(ctx, "v1"))
	require.NoError(t, s.DeleteHost(ctx, "h1"))
	_, err = s.HostByID(ctx, "h1")
	assert.ErrorIs(t, err, ErrNotFound)
}

func TestConsumeJoinToken(t *testing.T) { eachEngine(t, testConsumeJoinToken) }

func testConsumeJoinToken(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	exp := t0.Add(time.Hour)
	require.NoError(t, s.CreateJoinToken(ctx, JoinToken{ID: "j1", Hash: hashOf("j1"), CreatedBy: "u1", CreatedAt: t0, ExpiresAt: exp}))
	require.NoError(t, s.CreateJoinToken(ctx, JoinToken{ID: "j2", Hash: hashOf("j2"), CreatedBy: "u1", CreatedAt: t0, ExpiresAt: exp}))
	assert.ErrorIs(t, s.CreateJoinToken(ctx, JoinToken{ID: "j3", Hash: hashOf("j1"), ExpiresAt: exp}), ErrConflict)

	newHost := func(id string) Host { return Host{ID: id, Name: id, CredentialHash: hashOf("cred-" + id)} }

	// Expired at exactly ExpiresAt, and nothing written.
	err := s.ConsumeJoinToken(ctx, hashOf("j1"), exp, newHost("hx"))
	require.ErrorIs(t, err, ErrJoinTokenExpired)
	_, err = s.HostByID(ctx, "hx")
	assert.ErrorIs(t, err, ErrNotFound)

	assert.ErrorIs(t, s.ConsumeJoinToken(ctx, hashOf("unknown"), t0, newHost("hx")), ErrNotFound)

	// A credential clash aborts without spending the token.
	clash := Host{ID: "hx", Name: "hx", CredentialHash: hashOf("h1")}
	require.ErrorIs(t, s.ConsumeJoinToken(ctx, hashOf("j1"), t0, clash), ErrConflict)
	jt, err := s.JoinTokenByHash(ctx, hashOf("j1"))
	require.NoError(t, err)
	assert.Nil(t, jt.UsedAt)

	now := t0.Add(time.Minute)
	require.NoError(t, s.ConsumeJoinToken(ctx, hashOf("j1"), now, newHost("h3")))
	h, err := s.HostByID(ctx, "h3")
	require.NoError(t, err)
	assert.Equal(t, now, h.CreatedAt)
	jt, err = s.JoinTokenByHash(ctx, hashOf("j1"))
	require.NoError(t, err)
	assert.Equal(t, JoinToken{ID: "j1", Hash: hashOf("j1"), CreatedBy: "u1", CreatedAt: t0, ExpiresAt: exp, UsedAt: &now, HostID: "h3"}, jt)

	err = s.ConsumeJoinToken(ctx, hashOf("j1"), now, newHost("h4"))
	require.ErrorIs(t, err, ErrJoinTokenUsed)
	_, err = s.HostByID(ctx, "h4")
	assert.ErrorIs(t, err, ErrNotFound)

	// The token outlives the host it enrolled.
	require.NoError(t, s.DeleteHost(ctx, "h3"))
	jt, err = s.JoinTokenByHash(ctx, hashOf("j1"))
	require.NoError(t, err)
	assert.Empty(t, jt.HostID)
	assert.NotNil(t, jt.UsedAt)
}

func TestConsumeJoinTokenSingleUseUnderConcurrency(t *testing.T) {
	eachEngine(t, testConsumeJoinTokenSingleUseUnderConcurrency)
}

func testConsumeJoinTokenSingleUseUnderConcurrency(t *testing.T, e engine) {
	s, path := e.open(t)
	ctx := context.Background()
	require.NoError(t, s.CreateJoinToken(ctx, JoinToken{ID: "j1", Hash: hashOf("j1"), CreatedAt: t0, ExpiresAt: t0.Add(time.Hour)}))
	// A second Store on the same file stands in for a second process: its
	// writers are not queued behind ours, so SQLite's own locking (and the
	// used_at guard) must keep the token single-use.
	other, err := Open(ctx, path)
	require.NoError(t, err)
	defer other.Close()
	stores := []*Store{s, other}

	const n = 20
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			id := fmt.Sprintf("host-%d", i)
			errs[i] = stores[i%2].ConsumeJoinToken(ctx, hashOf("j1"), t0, Host{ID: id, Name: id, CredentialHash: hashOf(id)})
		})
	}
	close(start)
	wg.Wait()

	var ok, used int
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case errors.Is(err, ErrJoinTokenUsed):
			used++
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	assert.Equal(t, 1, ok)
	assert.Equal(t, n-1, used)
	hosts, err := s.ListHosts(ctx)
	require.NoError(t, err)
	assert.Len(t, hosts, 1, "only the winner's host exists")
}

func TestVMNamesUniquePerOwner(t *testing.T) { eachEngine(t, testVMNamesUniquePerOwner) }

func testVMNamesUniquePerOwner(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)

	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	_, err := s.CreateVM(ctx, testVM("v2", "u2", "h1", "web", t0))
	require.NoError(t, err, "another owner may reuse the name")

	_, err = s.CreateVM(ctx, testVM("v3", "u1", "h2", "web", t0))
	require.ErrorIs(t, err, ErrConflict)
	assert.Contains(t, err.Error(), `"web"`)

	_, err = s.CreateVM(ctx, testVM("v1", "u1", "h1", "other", t0))
	assert.ErrorIs(t, err, ErrConflict, "id reuse")

	// Renaming onto a taken name conflicts too, and writes nothing.
	mustCreateVM(t, s, testVM("v4", "u1", "h1", "db", t0))
	_, _, err = s.UpdateVM(ctx, "v4", func(vm *VM) error { vm.Name = "web"; return nil })
	require.ErrorIs(t, err, ErrConflict)
	vm, err := s.GetVM(ctx, "v4")
	require.NoError(t, err)
	assert.Equal(t, "db", vm.Name)
}

func TestCreateVMErrors(t *testing.T) { eachEngine(t, testCreateVMErrors) }

func testCreateVMErrors(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	cases := []struct {
		name string
		vm   VM
		is   error
	}{
		{"unknown owner", testVM("v1", "ghost", "h1", "a", t0), ErrNotFound},
		{"unknown host", testVM("v1", "u1", "ghost", "a", t0), ErrNotFound},
		{"bad power", func() VM { v := testVM("v1", "u1", "h1", "a", t0); v.PowerState = "paused"; return v }(), nil},
		{"no name", testVM("v1", "u1", "h1", "", t0), nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.CreateVM(ctx, tc.vm)
			require.Error(t, err)
			if tc.is != nil {
				assert.ErrorIs(t, err, tc.is)
			}
		})
	}
	vms, err := s.ListVMs(ctx, "")
	require.NoError(t, err)
	assert.Empty(t, vms)

	// An unplaced VM has no host.
	mustCreateVM(t, s, testVM("v9", "u1", "", "pending", t0))
	vm, err := s.GetVM(ctx, "v9")
	require.NoError(t, err)
	assert.Empty(t, vm.HostID)
	_, err = s.GetVM(ctx, "nope")
	assert.ErrorIs(t, err, ErrNotFound)
}

func TestListVMs(t *testing.T) { eachEngine(t, testListVMs) }

func testListVMs(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	// Created out of order; v-b and v-a share a creation time (id breaks ties).
	mustCreateVM(t, s, testVM("v-c", "u1", "h1", "c", t0.Add(2*time.Second)))
	mustCreateVM(t, s, testVM("v-b", "u2", "h2", "b", t0))
	mustCreateVM(t, s, testVM("v-a", "u1", "h1", "a", t0))

	ids := func(vms []VM) []string {
		var out []string
		for _, v := range vms {
			out = append(out, v.ID)
		}
		return out
	}
	all, err := s.ListVMs(ctx, "")
	require.NoError(t, err)
	assert.Equal(t, []string{"v-a", "v-b", "v-c"}, ids(all))
	mine, err := s.ListVMs(ctx, "u1")
	require.NoError(t, err)
	assert.Equal(t, []string{"v-a", "v-c"}, ids(mine))
	onH2, err := s.ListVMsByHost(ctx, "h2")
	require.NoError(t, err)
	assert.Equal(t, []string{"v-b"}, ids(onH2))
	none, err := s.ListVMs(ctx, "nobody")
	require.NoError(t, err)
	assert.Empty(t, none)
}

func TestUpdateVM(t *testing.T) { eachEngine(t, testUpdateVM) }

func testUpdateVM(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	orig := testVM("v1", "u1", "h1", "web", t0)
	mustCreateVM(t, s, orig)
	created, err := s.GetVM(ctx, "v1")
	require.NoError(t, err)
	orig.DesiredGen = created.DesiredGen

	t.Run("no change writes nothing", func(t *testing.T) {
		for _, fn := range []func(*VM) error{
			func(*VM) error { return nil },
			func(vm *VM) error { vm.PowerState = vmstate.PowerRunning; return nil },
			// The same instant in another zone is no change.
			func(vm *VM) error { vm.CreatedAt = t0.In(time.FixedZone("x", 3600)); return nil },
		} {
			vm, changed, err := s.UpdateVM(ctx, "v1", fn)
			require.NoError(t, err)
			assert.False(t, changed)
			assert.Equal(t, orig, vm)
		}
		got, err := s.GetVM(ctx, "v1")
		require.NoError(t, err)
		assert.Equal(t, t0, got.UpdatedAt, "updated_at untouched")
	})

	t.Run("change is written", func(t *testing.T) {
		destroy := t0.Add(24 * time.Hour)
		vm, changed, err := s.UpdateVM(ctx, "v1", func(vm *VM) error {
			vm.PowerState = vmstate.PowerStopped
			vm.Status = "stopped"
			vm.AssignedIP = "10.77.0.5"
			vm.DestroyAt = &destroy
			return nil
		})
		require.NoError(t, err)
		assert.True(t, changed)
		assert.True(t, vm.UpdatedAt.After(t0))
		got, err := s.GetVM(ctx, "v1")
		require.NoError(t, err)
		assert.Equal(t, vm, got)
		assert.Equal(t, vmstate.PowerStopped, got.PowerState)
		assert.Equal(t, "10.77.0.5", got.AssignedIP)
		assert.Equal(t, destroy, *got.DestroyAt)

		// Clearing a pointer field is a change.
		vm, changed, err = s.UpdateVM(ctx, "v1", func(vm *VM) error { vm.DestroyAt = nil; return nil })
		require.NoError(t, err)
		assert.True(t, changed)
		assert.Nil(t, vm.DestroyAt)
	})

	t.Run("fn error aborts", func(t *testing.T) {
		before, err := s.GetVM(ctx, "v1")
		require.NoError(t, err)
		boom := errors.New("boom")
		_, changed, err := s.UpdateVM(ctx, "v1", func(vm *VM) error { vm.Name = "other"; return boom })
		require.ErrorIs(t, err, boom)
		assert.False(t, changed)
		after, err := s.GetVM(ctx, "v1")
		require.NoError(t, err)
		assert.Equal(t, before, after)
	})

	t.Run("invalid results are refused", func(t *testing.T) {
		for _, fn := range []func(*VM) error{
			func(vm *VM) error { vm.ID = "v2"; return nil },
			func(vm *VM) error { vm.PowerState = "paused"; return nil },
			func(vm *VM) error { vm.HostID = "ghost"; return nil },
		} {
			_, _, err := s.UpdateVM(ctx, "v1", fn)
			assert.Error(t, err)
		}
	})

	t.Run("unknown vm", func(t *testing.T) {
		called := false
		_, _, err := s.UpdateVM(ctx, "nope", func(*VM) error { called = true; return nil })
		assert.ErrorIs(t, err, ErrNotFound)
		assert.False(t, called)
	})
}

func testExposure(id, vm, host string, guest, hostPort uint16, proto string, created time.Time) Exposure {
	return Exposure{ID: id, VMID: vm, HostID: host, GuestPort: guest, HostPort: hostPort,
		Protocol: proto, Scope: "lan", MaxSessions: 64, CreatedAt: created}
}

func TestExposures(t *testing.T) { eachEngine(t, testExposures) }

func testExposures(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	mustCreateVM(t, s, testVM("v2", "u1", "h1", "db", t0))
	mustCreateVM(t, s, testVM("v3", "u1", "h2", "cache", t0))

	e1 := testExposure("x-1", "v1", "h1", 80, 30080, "tcp", t0)
	require.NoError(t, s.CreateExposure(ctx, e1))
	got, err := s.GetExposure(ctx, "x-1")
	require.NoError(t, err)
	assert.Equal(t, e1, got)

	// Same port, other protocol or other host: fine.
	require.NoError(t, s.CreateExposure(ctx, testExposure("x-2", "v2", "h1", 53, 30080, "udp", t0.Add(time.Second))))
	require.NoError(t, s.CreateExposure(ctx, testExposure("x-3", "v3", "h2", 80, 30080, "tcp", t0.Add(2*time.Second))))

	t.Run("port conflict names the holder and writes nothing", func(t *testing.T) {
		err := s.CreateExposure(ctx, testExposure("x-4", "v2", "h1", 8080, 30080, "tcp", t0))
		require.ErrorIs(t, err, ErrConflict)
		var held *PortHeldError
		require.ErrorAs(t, err, &held)
		assert.Equal(t, "x-1", held.ExposureID)
		assert.Equal(t, "conflict: host port 30080/tcp on host h1 is held by exposure x-1", err.Error())
		_, err = s.GetExposure(ctx, "x-4")
		assert.ErrorIs(t, err, ErrNotFound)
	})

	t.Run("create errors", func(t *testing.T) {
		err := s.CreateExposure(ctx, testExposure("x-1", "v2", "h1", 22, 30022, "tcp", t0))
		assert.ErrorIs(t, err, ErrConflict, "id reuse")
		err = s.CreateExposure(ctx, testExposure("x-5", "ghost", "h1", 22, 30022, "tcp", t0))
		assert.ErrorIs(t, err, ErrNotFound)
		err = s.CreateExposure(ctx, testExposure("x-5", "v1", "h1", 22, 30022, "sctp", t0))
		assert.Error(t, err)
		err = s.CreateExposure(ctx, testExposure("x-5", "v1", "h1", 22, 0, "tcp", t0))
		assert.Error(t, err)
	})

	ids := func(es []Exposure) []string {
		var out []string
		for _, e := range es {
			out = append(out, e.ID)
		}
		return out
	}
	all, err := s.ListExposures(ctx, "")
	require.NoError(t, err)
	assert.Equal(t, []string{"x-1", "x-2", "x-3"}, ids(all))
	forV2, err := s.ListExposures(ctx, "v2")
	require.NoError(t, err)
	assert.Equal(t, []string{"x-2"}, ids(forV2))
	onH1, err := s.ListExposuresByHost(ctx, "h1")
	require.NoError(t, err)
	assert.Equal(t, []string{"x-1", "x-2"}, ids(onH1))

	used, err := s.UsedHostPorts(ctx, "h1", "tcp")
	require.NoError(t, err)
	assert.Equal(t, map[uint16]bool{30080: true}, used)
	used, err = s.UsedHostPorts(ctx, "h2", "udp")
	require.NoError(t, err)
	assert.Empty(t, used)

	require.NoError(t, s.DeleteExposure(ctx, "x-1"))
	assert.ErrorIs(t, s.DeleteExposure(ctx, "x-1"), ErrNotFound)
	_, err = s.GetExposure(ctx, "x-1")
	assert.ErrorIs(t, err, ErrNotFound)
	// The freed port can be taken again.
	require.NoError(t, s.CreateExposure(ctx, testExposure("x-6", "v2", "h1", 8080, 30080, "tcp", t0)))
}

func TestVMEventsAndCascadeOnDeleteVM(t *testing.T) { eachEngine(t, testVMEventsAndCascadeOnDeleteVM) }

func testVMEventsAndCascadeOnDeleteVM(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx := context.Background()
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	mustCreateVM(t, s, testVM("v2", "u1", "h1", "db", t0))
	require.NoError(t, s.CreateExposure(ctx, testExposure("x-1", "v1", "h1", 80, 30080, "tcp", t0)))
	require.NoError(t, s.CreateExposure(ctx, testExposure("x-2", "v2", "h1", 80, 30081, "tcp", t0)))

	require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v1", At: t0.Add(time.Second), Kind: "started", Message: "booted"}))
	require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v1", At: t0, Kind: "created"}))
	require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v2", At: t0, Kind: "created"}))
	assert.ErrorIs(t, s.AddVMEvent(ctx, VMEvent{VMID: "ghost", At: t0, Kind: "created"}), ErrNotFound)

	evs, err := s.ListVMEvents(ctx, "v1")
	require.NoError(t, err)
	require.Len(t, evs, 2)
	assert.Equal(t, "created", evs[0].Kind, "oldest first")
	assert.Equal(t, t0, evs[0].At)
	assert.Equal(t, VMEvent{ID: evs[1].ID, VMID: "v1", At: t0.Add(time.Second), Kind: "started", Message: "booted"}, evs[1])
	assert.NotZero(t, evs[1].ID)

	require.NoError(t, s.DeleteVM(ctx, "v1"))
	assert.ErrorIs(t, s.DeleteVM(ctx, "v1"), ErrNotFound)
	_, err = s.GetVM(ctx, "v1")
	assert.ErrorIs(t, err, ErrNotFound)
	evs, err = s.ListVMEvents(ctx, "v1")
	require.NoError(t, err)
	assert.Empty(t, evs)
	_, err = s.GetExposure(ctx, "x-1")
	assert.ErrorIs(t, err, ErrNotFound)

	// The other VM's rows are untouched.
	evs, err = s.ListVMEvents(ctx, "v2")
	require.NoError(t, err)
	assert.Len(t, evs, 1)
	_, err = s.GetExposure(ctx, "x-2")
	assert.NoError(t, err)

	// The name is free again once the row is gone.
	mustCreateVM(t, s, testVM("v3", "u1", "h1", "web", t0))
}

func TestWriteHonoursContext(t *testing.T) { eachEngine(t, testWriteHonoursContext) }

func testWriteHonoursContext(t *testing.T, e engine) {
	s, _ := e.open(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := s.CreateUser(ctx, User{ID: "u1", Name: "alice"})
	require.ErrorIs(t, err, context.Canceled)
	n, err := s.CountUsers(context.Background())
	require.NoError(t, err)
	assert.Zero(t, n)
}

func benchStore(b testing.TB, n int) *Store {
	s, _ := openStore(b)
	fixture(b, s)
	for i := range n {
		mustCreateVM(b, s, testVM(fmt.Sprintf("v%04d", i), "u1", "h1", fmt.Sprintf("vm-%d", i), t0.Add(time.Duration(i))))
	}
	return s
}

func BenchmarkListVMs1000(b *testing.B) {
	s := benchStore(b, 1000)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		vms, err := s.ListVMs(ctx, "")
		if err != nil || len(vms) != 1000 {
			b.Fatal(len(vms), err)
		}
	}
}

func BenchmarkUpdateVM(b *testing.B) {
	s := benchStore(b, 1000)
	ctx := context.Background()
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		_, changed, err := s.UpdateVM(ctx, "v0500", func(vm *VM) error { vm.Status = fmt.Sprint("status ", i); return nil })
		if err != nil || !changed {
			b.Fatal(changed, err)
		}
	}
}

func BenchmarkCreateVM(b *testing.B) {
	s := benchStore(b, 1000)
	ctx := context.Background()
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		if _, err := s.CreateVM(ctx, testVM(fmt.Sprintf("b%06d", i), "u1", "h1", fmt.Sprintf("bench-%d", i), t0)); err != nil {
			b.Fatal(err)
		}
	}
}
