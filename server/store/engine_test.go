package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server/store/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// engine is a database engine the store runs on, for tests.
type engine struct {
	name string
	// fresh returns what Open takes for a new, empty database.
	fresh func(t testing.TB) string
	// clone copies the closed database db, as a backup would.
	clone func(t testing.TB, db string) string
}

var engines = []engine{
	{name: "sqlite", fresh: func(t testing.TB) string { return filepath.Join(t.TempDir(), "eitri.db") }, clone: copyFile},
	{name: "postgres", fresh: pgtest.DSN, clone: pgtest.Clone},
}

func copyFile(t testing.TB, path string) string {
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	backup := filepath.Join(t.TempDir(), "backup.db")
	require.NoError(t, os.WriteFile(backup, b, 0o600))
	return backup
}

// eachEngine runs test once per engine, as subtests named after it.
func eachEngine(t *testing.T, test func(t *testing.T, e engine)) {
	for _, e := range engines {
		t.Run(e.name, func(t *testing.T) { test(t, e) })
	}
}

// open opens a store on a new database, closed when t ends, and says what
// Open took, to open it again.
func (e engine) open(t testing.TB) (*Store, string) {
	t.Helper()
	db := e.fresh(t)
	s, err := Open(context.Background(), db)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s, db
}

func TestBothEnginesHaveTheSameMigrations(t *testing.T) {
	lite, err := loadMigrations(sqliteMigrations)
	require.NoError(t, err)
	pg, err := loadMigrations(postgresMigrations)
	require.NoError(t, err)
	names := func(ms []migration) []string {
		var out []string
		for _, m := range ms {
			out = append(out, m.name)
		}
		return out
	}
	require.NotEmpty(t, lite)
	assert.Equal(t, names(lite), names(pg),
		"every migration in migrations/ needs its PostgreSQL dialect in migrations/postgres/ under the same name, and no other")
}

func TestAStoreRefusesADatabaseWhoseSchemaIsNewerThanItKnows(t *testing.T) {
	eachEngine(t, func(t *testing.T, e engine) {
		ctx := context.Background()
		s, db := e.open(t)
		ms, err := loadMigrations(sqliteMigrations)
		require.NoError(t, err)
		known := ms[len(ms)-1].version
		_, err = s.db.ExecContext(ctx, `INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, 0)`,
			known+2, fmt.Sprintf("%04d_from_the_future.sql", known+2))
		require.NoError(t, err)
		require.NoError(t, s.Close())

		_, err = Open(ctx, db)
		var tooNew *SchemaTooNewError
		require.ErrorAs(t, err, &tooNew)
		assert.Equal(t, SchemaTooNewError{At: known + 2, Known: known}, *tooNew)
		assert.Contains(t, err.Error(), fmt.Sprintf("database schema is at version %d; this eitri knows up to %d: upgrade eitri", known+2, known))
	})
}

func TestMigrationsIdempotentAndDataSurvivesReopen(t *testing.T) {
	eachEngine(t, testMigrationsIdempotent)
}

func testMigrationsIdempotent(t *testing.T, e engine) {
	ctx := context.Background()
	db := e.fresh(t)
	s, err := Open(ctx, db)
	require.NoError(t, err)
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	require.NoError(t, s.Close())

	for range 2 {
		s, err = Open(ctx, db)
		require.NoError(t, err)
		var n int
		require.NoError(t, s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM schema_migrations`).Scan(&n))
		ms, err := loadMigrations(sqliteMigrations)
		require.NoError(t, err)
		assert.Equal(t, len(ms), n, "each migration recorded exactly once")

		u, err := s.UserByName(ctx, "alice")
		require.NoError(t, err)
		assert.Equal(t, User{ID: "u1", Name: "alice", Admin: true, CreatedAt: t0}, u)
		vm, err := s.GetVM(ctx, "v1")
		require.NoError(t, err)
		want := testVM("v1", "u1", "h1", "web", t0)
		assert.NotZero(t, vm.DesiredGen, "a created VM has a desired version")
		want.DesiredGen = vm.DesiredGen
		assert.Equal(t, want, vm)
		require.NoError(t, s.Close())
	}
}

func TestReplicasStartingTogetherMigrateOnceAndShareOneLineage(t *testing.T) {
	eachEngine(t, func(t *testing.T, e engine) {
		ctx := context.Background()
		db := e.fresh(t)
		const n = 4
		stores := make([]*Store, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { stores[i], errs[i] = Open(ctx, db) })
		}
		wg.Wait()
		var ids []string
		for i := range n {
			require.NoError(t, errs[i])
			defer stores[i].Close()
			l, err := stores[i].Lineage(ctx)
			require.NoError(t, err)
			ids = append(ids, l.ID)
		}
		for _, id := range ids {
			assert.Equal(t, ids[0], id, "one identity, made by whichever replica came first")
		}
		var applied int
		require.NoError(t, stores[0].db.QueryRowContext(ctx, `SELECT COUNT(*) FROM schema_migrations`).Scan(&applied))
		ms, err := loadMigrations(sqliteMigrations)
		require.NoError(t, err)
		assert.Equal(t, len(ms), applied)
	})
}

var errQuota = errors.New("quota: vms")

// Two Stores on one database stand in for two replicas (two processes, two
// connection pools): a quota check that reads the owner's VMs and a create
// that adds one must be one step, or both take the last slot.
func TestTwoReplicasRacingForTheLastVMAQuotaAllowsLetExactlyOneWin(t *testing.T) {
	eachEngine(t, func(t *testing.T, e engine) {
		ctx := context.Background()
		a, db := e.open(t)
		fixture(t, a)
		b, err := Open(ctx, db)
		require.NoError(t, err)
		defer b.Close()

		admit := func(ctx context.Context, r Reader) error {
			own, err := r.UserQuota(ctx, "u2")
			if err != nil {
				return err
			}
			vms, err := r.ListVMs(ctx, "u2")
			if err != nil {
				return err
			}
			if own.VMs == nil || int64(len(vms)) >= *own.VMs {
				return errQuota
			}
			return nil
		}
		start := time.Now()
		for round := range 50 {
			// Room for exactly one more VM.
			_, err := a.UpdateUserQuota(ctx, "u2", func(l *Limits) { n := int64(round + 1); l.VMs = &n })
			require.NoError(t, err)
			var wg sync.WaitGroup
			errs := make([]error, 2)
			go1 := make(chan struct{})
			for i, s := range []*Store{a, b} {
				wg.Go(func() {
					<-go1
					id := fmt.Sprintf("v%d-%d", round, i)
					_, errs[i] = s.CreateVMAdmitted(ctx, testVM(id, "u2", "h1", id, t0), admit)
				})
			}
			close(go1)
			wg.Wait()
			won, refused := 0, 0
			for _, err := range errs {
				switch {
				case err == nil:
					won++
				case errors.Is(err, errQuota):
					refused++
				default:
					t.Fatalf("round %d: unexpected error: %v", round, err)
				}
			}
			require.Equal(t, 1, won, "round %d: exactly one replica gets the last slot", round)
			require.Equal(t, 1, refused, "round %d", round)
			vms, err := b.ListVMs(ctx, "u2")
			require.NoError(t, err)
			require.Len(t, vms, round+1)
		}
		t.Logf("50 races in %v", time.Since(start))
	})
}

// Text compares and sorts by bytes on both engines, whatever collation a
// PostgreSQL database defaults to, so lists come out in one order.
func TestTextSortsByBytesOnBothEngines(t *testing.T) {
	eachEngine(t, func(t *testing.T, e engine) {
		ctx := context.Background()
		s, _ := e.open(t)
		for i, name := range []string{"beta", "Zeta", "alpha", "_x", "Alpha"} {
			require.NoError(t, s.CreateHost(ctx, Host{ID: fmt.Sprint("h", i), Name: name, CredentialHash: hashOf(name), CreatedAt: t0}))
		}
		hosts, err := s.ListHosts(ctx)
		require.NoError(t, err)
		var names []string
		for _, h := range hosts {
			names = append(names, h.Name)
		}
		assert.Equal(t, []string{"Alpha", "Zeta", "_x", "alpha", "beta"}, names)
	})
}

func TestIsPostgresTellsURLsFromPaths(t *testing.T) {
	for db, want := range map[string]bool{
		"postgres://eitri@db/eitri?sslmode=verify-full": true,
		"postgresql://db/eitri":                         true,
		"POSTGRES://db/eitri":                           true,
		"/var/lib/eitri/eitri.db":                       false,
		"postgres.db":                                   false,
		"sqlite://x":                                    false,
	} {
		assert.Equal(t, want, IsPostgres(db), db)
	}
}

func TestRedactNeverShowsAPassword(t *testing.T) {
	for _, db := range []string{
		"postgres://eitri:s3cret@db.example:5432/eitri?sslmode=verify-full",
		"postgresql://db/eitri?user=eitri&password=s3cret",
		"postgres://eitri:s3cret@db/%zz",
	} {
		shown := Redact(db)
		assert.NotContains(t, shown, "s3cret", db)
		assert.True(t, strings.HasPrefix(shown, "postgres"), shown)
	}
	assert.Equal(t, "postgres://eitri:xxxxx@db/eitri", Redact("postgres://eitri:pw@db/eitri"))
	assert.Equal(t, "/var/lib/eitri/eitri.db", Redact("/var/lib/eitri/eitri.db"))
}

func TestOpenRefusesABadPostgresURLWithoutShowingItsPassword(t *testing.T) {
	_, err := Open(context.Background(), "postgres://eitri:s3cret@db:notaport/eitri")
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "s3cret")
}
