package store

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server/store/pgtest"
	"github.com/a73x/eitri/wire/vmstate"
)

// schemaTables returns each table of the store's schema with its columns.
func schemaTables(t *testing.T, s *Store) map[string][]string {
	t.Helper()
	ctx := context.Background()
	q := `SELECT m.name, p.name FROM sqlite_master m JOIN pragma_table_info(m.name) p
		WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%'`
	if s.pg {
		q = `SELECT table_name, column_name FROM information_schema.columns
			WHERE table_schema = current_schema()`
	}
	rows, err := s.db.QueryContext(ctx, q)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string][]string{}
	for rows.Next() {
		var table, col string
		require.NoError(t, rows.Scan(&table, &col))
		out[table] = append(out[table], col)
	}
	require.NoError(t, rows.Err())
	for _, cols := range out {
		sort.Strings(cols)
	}
	return out
}

// When a migration adds a table or a column, this fails until copy.go says
// whether and how migrate-db carries it.
func TestTheCopyKnowsEveryTableAndColumnOfBothSchemas(t *testing.T) {
	eachEngine(t, func(t *testing.T, e engine) {
		s, _ := e.open(t)
		schema := schemaTables(t, s)
		known := map[string]bool{}
		for _, ct := range copyTables {
			require.False(t, known[ct.name], "%s listed twice", ct.name)
			known[ct.name] = true
			_, skipped := notCopied[ct.name]
			assert.False(t, skipped, "%s is both copied and left behind", ct.name)
			cols, ok := schema[ct.name]
			if !assert.True(t, ok, "the copy lists table %s, which the schema does not have", ct.name) {
				continue
			}
			want := append([]string(nil), ct.cols...)
			sort.Strings(want)
			assert.Equal(t, cols, want, "table %s: the copy's columns (copyTables in copy.go) are not the schema's", ct.name)
		}
		for name := range notCopied {
			_, ok := schema[name]
			assert.True(t, ok, "the copy leaves behind table %s, which the schema does not have", name)
			known[name] = true
		}
		for name := range schema {
			assert.True(t, known[name], "table %s is in the schema but copy.go neither copies it (copyTables) nor says why not (notCopied)", name)
		}
	})
}

// fillEverything writes one of everything a control plane keeps into s.
func fillEverything(t *testing.T, s *Store) {
	t.Helper()
	ctx := context.Background()
	fixture(t, s)
	require.NoError(t, s.UpdateHostHello(ctx, "h1", HostHello{AgentVersion: "1.2.3", Address: "10.0.0.1", Accelerator: "kvm", AcceleratorReason: "a probe boot worked"}, t0.Add(time.Second)))

	// Tokens: a PAT used once, one expiring, a console session opened by
	// the first.
	require.NoError(t, s.CreateToken(ctx, Token{ID: "t1", UserID: "u1", Name: "laptop", Kind: TokenKindPAT, Hash: hashOf("t1"), CreatedAt: t0}))
	require.NoError(t, s.TouchToken(ctx, "t1", t0.Add(3*time.Second)))
	require.NoError(t, s.CreateToken(ctx, Token{ID: "t2", UserID: "u2", Name: "ci", Kind: TokenKindPAT, Hash: hashOf("t2"), CreatedAt: t0, ExpiresAt: ptr(t0.Add(time.Hour))}))
	require.NoError(t, s.CreateToken(ctx, Token{ID: "s1", UserID: "u1", Name: "console", Kind: TokenKindSession, Hash: hashOf("s1"),
		CreatedAt: t0.Add(time.Minute), ExpiresAt: ptr(t0.Add(2 * time.Hour)), ParentID: "t1"}))

	// Join tokens: one unused, one spent on enrolling h3.
	require.NoError(t, s.CreateJoinToken(ctx, JoinToken{ID: "j1", Hash: hashOf("j1"), CreatedBy: "u1", CreatedAt: t0, ExpiresAt: t0.Add(time.Hour)}))
	require.NoError(t, s.CreateJoinToken(ctx, JoinToken{ID: "j2", Hash: hashOf("j2"), CreatedBy: "u1", CreatedAt: t0, ExpiresAt: t0.Add(time.Hour)}))
	require.NoError(t, s.ConsumeJoinToken(ctx, hashOf("j2"), t0.Add(time.Minute), Host{ID: "h3", Name: "gamma", CredentialHash: hashOf("h3")}))

	// VMs: one running and reporting, one not placed, one deleted and
	// waiting to be destroyed, one deleted outright (its events go too,
	// leaving a gap in the ids).
	v1 := testVM("v1", "u1", "h1", "web", t0)
	v1.UserCAKeys = []string{"ssh-ed25519 AAAAnew eitri-user-ca", "ssh-ed25519 AAAAold eitri-user-ca"}
	v1.ImageName, v1.ImageVersion, v1.Readiness = "debian-12", 2, "address"
	mustCreateVM(t, s, v1)
	_, _, err := s.UpdateVM(ctx, "v1", func(vm *VM) error {
		vm.Status, vm.AssignedIP, vm.SSHHostPubkey, vm.Retry, vm.ExitsSeen = "running", "10.77.0.9", "ssh-ed25519 HOST", 2, 1
		return nil
	})
	require.NoError(t, err)
	v2 := testVM("v2", "u2", "", "unplaced", t0.Add(time.Second))
	v2.PowerState = vmstate.PowerStopped
	mustCreateVM(t, s, v2)
	mustCreateVM(t, s, testVM("v3", "u2", "h2", "gone", t0.Add(2*time.Second)))
	_, _, err = s.UpdateVM(ctx, "v3", func(vm *VM) error {
		vm.DeletedAt, vm.DestroyAt, vm.LastError = ptr(t0.Add(time.Hour)), ptr(t0.Add(25*time.Hour)), "deleted by bob"
		return nil
	})
	require.NoError(t, err)
	mustCreateVM(t, s, testVM("v4", "u2", "h2", "brief", t0))

	require.NoError(t, s.CreateExposure(ctx, testExposure("e1", "v1", "h1", 80, 30080, "tcp", t0)))
	udp := testExposure("e2", "v1", "h1", 53, 30053, "udp", t0.Add(time.Second))
	udp.Scope, udp.MaxSessions = "local", 0
	require.NoError(t, s.CreateExposure(ctx, udp))

	for i, kind := range []string{"created", "booting", "ready"} {
		require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v1", At: t0.Add(time.Duration(i) * time.Second), Kind: kind, Message: "step " + kind}))
		require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v4", At: t0, Kind: kind}))
	}
	require.NoError(t, s.DeleteVM(ctx, "v4"))
	require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v3", At: t0.Add(time.Hour), Kind: "deleted", Message: ""}))

	// Quotas: some limits set, the rest following the default.
	n5, n0 := int64(5), int64(0)
	_, err = s.UpdateQuotaDefaults(ctx, func(l *Limits) { l.VMs, l.Exposures = &n5, &n0 })
	require.NoError(t, err)
	_, err = s.UpdateUserQuota(ctx, "u2", func(l *Limits) { l.VCPUs = &n5 })
	require.NoError(t, err)

	// The lineage, past its first epoch.
	for range 3 {
		_, err := s.NextGeneration(ctx)
		require.NoError(t, err)
	}
	l, err := s.Lineage(ctx)
	require.NoError(t, err)
	_, _, err = s.FenceForward(ctx, l.Epoch+1, l.Generation+10)
	require.NoError(t, err)

	// A build, a rollout, and a host's word on its upgrade.
	require.NoError(t, s.UpdateHostHello(ctx, "h1", HostHello{AgentVersion: "v1.3", OS: "linux", Arch: "amd64"}, t0))
	require.NoError(t, s.SetHostUpgrade(ctx, "h1", HostUpgrade{Target: "v1.4", Step: "failed", Error: "no", RolloutID: "r1", Attempt: 1, Since: t0}))
	require.NoError(t, s.CreateRelease(ctx, Release{SHA256: "cc", Version: "v1.4", OS: "linux", Arch: "amd64", Size: 4, KeyID: "k",
		Signature: []byte("sig"), UploadedBy: "u1", UploadedAt: t0}, []byte{0, 1, 2, 0xff}))
	require.NoError(t, s.CreateRollout(ctx, Rollout{ID: "r1", Version: "v1.4", State: RolloutHalted, Reason: "h1 failed", MaxUnavailable: 1,
		Hosts:     []RolloutHost{{HostID: "h1", HostName: "beta", State: HostFailed, Error: "no", StartedAt: ptr(t0), Attempt: 1}},
		CreatedBy: "u1", CreatedAt: t0}))

	// A catalogue entry with two versions, its keyring in bytes no text
	// column would keep.
	require.NoError(t, s.CreateImage(ctx, Image{Name: "debian-12", OS: "debian", MinDiskGB: 2, Readiness: "ssh", URL: "https://example.org/a",
		SumsURL: "https://example.org/SHA512SUMS", Keyring: []byte{0, 1, 0xff}, CreatedAt: t0},
		ImageVersion{URL: "https://example.org/a", SHA256: "aa", SHA512: "bb", Signer: "FP", VerifiedAt: ptr(t0), AddedBy: "u1"}))
	_, _, err = s.AdvanceImage(ctx, "debian-12", ImageVersion{URL: "https://example.org/b", SHA256: "cc", AddedBy: "u1"}, 5)
	require.NoError(t, err)
	require.NoError(t, s.AddImagePulls(ctx, "debian-12", []string{"h1", "h2"}))
}

// readCase reads one table's rows back through the Store's API.
type readCase struct {
	table string
	read  func(ctx context.Context, s *Store) (any, error)
}

func readAll(reads ...func(ctx context.Context, s *Store) (any, error)) func(ctx context.Context, s *Store) (any, error) {
	return func(ctx context.Context, s *Store) (any, error) {
		var out []any
		for _, r := range reads {
			v, err := r(ctx, s)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return out, nil
	}
}

var everyTableRead = []readCase{
	{"users", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.UserByID(ctx, "u1") },
		func(ctx context.Context, s *Store) (any, error) { return s.UserByName(ctx, "bob") },
		func(ctx context.Context, s *Store) (any, error) { return s.CountUsers(ctx) },
	)},
	{"tokens", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.ListTokens(ctx, "") },
		func(ctx context.Context, s *Store) (any, error) { return s.ListSessions(ctx, "") },
		func(ctx context.Context, s *Store) (any, error) {
			tok, u, err := s.TokenByHash(ctx, hashOf("s1"))
			return []any{tok, u}, err
		},
	)},
	{"hosts", func(ctx context.Context, s *Store) (any, error) { return s.ListHosts(ctx) }},
	{"join_tokens", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.JoinTokenByHash(ctx, hashOf("j1")) },
		func(ctx context.Context, s *Store) (any, error) { return s.JoinTokenByHash(ctx, hashOf("j2")) },
	)},
	{"vms", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.ListVMs(ctx, "") },
		func(ctx context.Context, s *Store) (any, error) { return s.ListVMsByHost(ctx, "h2") },
	)},
	{"exposures", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.ListExposures(ctx, "v1") },
		func(ctx context.Context, s *Store) (any, error) { return s.UsedHostPorts(ctx, "h1", "udp") },
	)},
	{"vm_events", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.ListVMEvents(ctx, "v1") },
		func(ctx context.Context, s *Store) (any, error) { return s.ListVMEvents(ctx, "v3") },
	)},
	{"quota_defaults", func(ctx context.Context, s *Store) (any, error) { return s.QuotaDefaults(ctx) }},
	{"user_quotas", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.UserQuota(ctx, "u2") },
		func(ctx context.Context, s *Store) (any, error) {
			_, err := s.UserQuota(ctx, "u1")
			return fmt.Sprint(err), nil // none set: the same not-found on both
		},
	)},
	{"control_plane", func(ctx context.Context, s *Store) (any, error) { return s.Lineage(ctx) }},
	{"releases", readAll(
		func(ctx context.Context, s *Store) (any, error) { return s.ListReleases(ctx) },
		func(ctx context.Context, s *Store) (any, error) { return s.ReleaseData(ctx, "cc") },
	)},
	{"rollouts", func(ctx context.Context, s *Store) (any, error) { return s.ListRollouts(ctx) }},
	{"images", func(ctx context.Context, s *Store) (any, error) { return s.ListImages(ctx) }},
	{"image_versions", func(ctx context.Context, s *Store) (any, error) { return s.Image(ctx, "debian-12") }},
	{"image_pulls", func(ctx context.Context, s *Store) (any, error) { return s.ImagePullHosts(ctx, "debian-12") }},
}

// filledSource makes a SQLite database holding one of everything, closed,
// and returns its path.
func filledSource(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "eitri.db")
	s, err := Open(context.Background(), path)
	require.NoError(t, err)
	fillEverything(t, s)
	require.NoError(t, s.Close())
	return path
}

// openTarget opens a store on a new, empty PostgreSQL database.
func openTarget(t *testing.T) (*Store, string) {
	t.Helper()
	dsn := pgtest.DSN(t)
	s, err := Open(context.Background(), dsn)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s, dsn
}

var testSecrets = map[string][]byte{
	"tls/ca.crt":  []byte("-----BEGIN CERTIFICATE-----\nCA\n"),
	"tls/ca.key":  {0, 1, 2, 0xff},
	"ssh/user_ca": []byte("user CA key"),
}

func TestACopyToPostgreSQLReadsBackIdenticallyThroughTheStore(t *testing.T) {
	ctx := context.Background()
	from, err := OpenSource(ctx, filledSource(t))
	require.NoError(t, err)
	defer from.Close()
	to, _ := openTarget(t)
	fresh, err := to.Lineage(ctx)
	require.NoError(t, err)

	start := time.Now()
	copied, err := Copy(ctx, from, to, testSecrets)
	require.NoError(t, err)
	t.Logf("copied in %v: %v", time.Since(start), copied)

	want := map[string]int64{"users": 2, "tokens": 3, "hosts": 3, "join_tokens": 2, "vms": 3, "exposures": 2,
		"vm_events": 4, "quota_defaults": 1, "user_quotas": 1, "control_plane": 1, "secrets": int64(len(testSecrets)),
		"releases": 1, "rollouts": 1, "images": 1, "image_versions": 2, "image_pulls": 2}
	got := map[string]int64{}
	for _, c := range copied {
		got[c.Table] = c.Rows
	}
	assert.Equal(t, want, got)

	covered := map[string]bool{"secrets": true} // compared below
	for _, rc := range everyTableRead {
		covered[rc.table] = true
		t.Run(rc.table, func(t *testing.T) {
			before, err := rc.read(ctx, from)
			require.NoError(t, err)
			after, err := rc.read(ctx, to)
			require.NoError(t, err)
			assert.Equal(t, before, after)
			assert.NotEmpty(t, before)
		})
	}
	for _, ct := range copyTables {
		assert.True(t, covered[ct.name], "table %s is copied but never read back here", ct.name)
	}
	secrets, err := to.Secrets(ctx)
	require.NoError(t, err)
	assert.Equal(t, testSecrets, secrets)

	l, err := to.Lineage(ctx)
	require.NoError(t, err)
	assert.NotEqual(t, fresh.ID, l.ID, "the target's own lineage gave way to the source's")
	assert.Greater(t, l.Epoch, uint64(1), "the source's epoch, past the first")

	// The target goes on from where the source was: a new event is
	// numbered past the copied ones, the counter rises from the copied one.
	var maxID int64
	require.NoError(t, from.db.QueryRowContext(ctx, `SELECT max(id) FROM vm_events`).Scan(&maxID))
	require.NoError(t, to.AddVMEvent(ctx, VMEvent{VMID: "v1", At: t0.Add(time.Hour), Kind: "stopped"}))
	evs, err := to.ListVMEvents(ctx, "v1")
	require.NoError(t, err)
	assert.Equal(t, maxID+1, evs[len(evs)-1].ID, "numbered past every copied id, whichever VM's")
	next, err := to.NextGeneration(ctx)
	require.NoError(t, err)
	assert.Equal(t, l.Generation+1, next.Generation)
	assert.Equal(t, l.ID, next.ID)

	oldest, newest, err := to.ChangeBounds(ctx)
	require.NoError(t, err)
	assert.Equal(t, [2]int64{0, 0}, [2]int64{oldest, newest}, "the copy's own inserts are no change anybody follows")
}

// dump reads every copied table's rows as they are, for comparing a
// database before and after.
func dump(t *testing.T, s *Store) map[string][][]any {
	t.Helper()
	out := map[string][][]any{}
	for _, ct := range append(copyTables, copyTable{name: "changes", cols: []string{"rev"}, order: "rev"}) {
		rows, err := s.db.QueryContext(context.Background(), `SELECT * FROM `+ct.name+` ORDER BY `+ct.order)
		require.NoError(t, err)
		cols, err := rows.Columns()
		require.NoError(t, err)
		for rows.Next() {
			vals := make([]any, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			require.NoError(t, rows.Scan(ptrs...))
			out[ct.name] = append(out[ct.name], vals)
		}
		require.NoError(t, rows.Err())
		rows.Close()
	}
	return out
}

func TestASecondCopyIntoTheSameTargetIsRefusedAndChangesNothing(t *testing.T) {
	ctx := context.Background()
	from, err := OpenSource(ctx, filledSource(t))
	require.NoError(t, err)
	defer from.Close()
	to, _ := openTarget(t)
	_, err = Copy(ctx, from, to, testSecrets)
	require.NoError(t, err)
	require.NoError(t, to.AddVMEvent(ctx, VMEvent{VMID: "v1", Kind: "after the copy"}))
	before := dump(t, to)

	_, err = Copy(ctx, from, to, map[string][]byte{"tls/ca.crt": []byte("another CA")})
	require.ErrorIs(t, err, ErrTargetNotEmpty)
	assert.Contains(t, err.Error(), "2 in users")
	assert.Equal(t, before, dump(t, to), "nothing was written")
}

func TestACopyIntoADatabaseAReplicaHasStartedOnIsRefused(t *testing.T) {
	ctx := context.Background()
	from, err := OpenSource(ctx, filledSource(t))
	require.NoError(t, err)
	defer from.Close()
	to, _ := openTarget(t)
	// What a replica's first start writes: the shared secrets, an admin.
	require.NoError(t, to.PutSecrets(ctx, map[string][]byte{"tls/ca.crt": []byte("its own CA")}))
	require.NoError(t, to.CreateUser(ctx, User{ID: "u_admin", Name: "admin", Admin: true, CreatedAt: t0}))
	before := dump(t, to)
	_, err = Copy(ctx, from, to, testSecrets)
	require.ErrorIs(t, err, ErrTargetNotEmpty)
	assert.Equal(t, before, dump(t, to))
}

func TestOpenSourceRefusesADatabaseAControlPlaneStillHasOpen(t *testing.T) {
	ctx := context.Background()
	path := filledSource(t)
	running, err := Open(ctx, path)
	require.NoError(t, err)
	_, err = OpenSource(ctx, path)
	require.ErrorIs(t, err, ErrSourceInUse)
	assert.Contains(t, err.Error(), "stop it first")
	require.NoError(t, running.Close())

	src, err := OpenSource(ctx, path)
	require.NoError(t, err, "free once the control plane is stopped")
	require.NoError(t, src.Close())
}

func TestOpenSourceRefusesAnotherSchemaVersionAndLeavesTheDatabaseAsItIs(t *testing.T) {
	ms, err := loadMigrations(sqliteMigrations)
	require.NoError(t, err)
	latest := ms[len(ms)-1].version
	for _, c := range []struct {
		name, change string
		at           int
		says         string
	}{
		{"older", fmt.Sprintf(`DELETE FROM schema_migrations WHERE version = %d`, latest), latest - 1,
			"start the old control plane once with this eitri"},
		{"newer", fmt.Sprintf(`INSERT INTO schema_migrations (version, name, applied_at) VALUES (%d, 'x.sql', 0)`, latest+1), latest + 1,
			"newer than this eitri's"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			path := filledSource(t)
			db, err := sql.Open("sqlite", path)
			require.NoError(t, err)
			_, err = db.ExecContext(ctx, c.change)
			require.NoError(t, err)
			require.NoError(t, db.Close())
			for range 2 { // the first refusal migrated nothing
				_, err = OpenSource(ctx, path)
				var se *SourceSchemaError
				require.ErrorAs(t, err, &se)
				assert.Equal(t, SourceSchemaError{At: c.at, Want: latest}, *se)
				assert.Contains(t, err.Error(), c.says)
			}
		})
	}
}

func TestOpenSourceRefusesAMissingDatabaseWithoutMakingOne(t *testing.T) {
	path := filepath.Join(t.TempDir(), "eitri.db")
	_, err := OpenSource(context.Background(), path)
	require.Error(t, err)
	assert.NoFileExists(t, path)
}
