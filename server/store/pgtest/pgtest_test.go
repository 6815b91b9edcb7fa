package pgtest

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

func count(t *testing.T, dsn string) int {
	db, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	defer db.Close()
	var n int
	require.NoError(t, db.QueryRowContext(context.Background(), `SELECT COUNT(*) FROM information_schema.tables WHERE table_name = 'mark'`).Scan(&n))
	return n
}

func TestEachDSNIsAFreshDatabaseAndACloneCopiesOne(t *testing.T) {
	a, b := DSN(t), DSN(t)
	db, err := sql.Open("pgx", a)
	require.NoError(t, err)
	_, err = db.ExecContext(context.Background(), `CREATE TABLE mark (x INT)`)
	require.NoError(t, err)
	require.NoError(t, db.Close())

	assert.Equal(t, 1, count(t, a))
	assert.Equal(t, 0, count(t, b), "another test's database is untouched")
	assert.Equal(t, 1, count(t, Clone(t, a)))
}

func TestTheServerTradesDurabilityForSpeed(t *testing.T) {
	db, err := sql.Open("pgx", DSN(t))
	require.NoError(t, err)
	defer db.Close()
	var v string
	require.NoError(t, db.QueryRowContext(context.Background(), `SHOW fsync`).Scan(&v))
	assert.Equal(t, "off", v, "a test's data dies with it")
}

func TestARestartedServerKeepsItsDataAndSocket(t *testing.T) {
	srv, err := Start()
	if errors.Is(err, ErrNoPostgres) {
		t.Skipf("PostgreSQL is not installed: %s", InstallHint)
	}
	require.NoError(t, err)
	defer srv.Stop()
	name, err := srv.CreateDatabase(context.Background(), "")
	require.NoError(t, err)
	db, err := sql.Open("pgx", srv.DSN(name))
	require.NoError(t, err)
	defer db.Close()
	_, err = db.ExecContext(context.Background(), `CREATE TABLE mark (x INT); INSERT INTO mark VALUES (7)`)
	require.NoError(t, err)

	require.NoError(t, srv.Restart())
	var x int
	require.Eventually(t, func() bool {
		return db.QueryRowContext(context.Background(), `SELECT x FROM mark`).Scan(&x) == nil
	}, 10*time.Second, 50*time.Millisecond, "the pool reconnects to the restarted server")
	assert.Equal(t, 7, x, "what was committed before the restart is kept")
}
