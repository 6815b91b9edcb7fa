package store

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A kept statement is the same statement on its next use: every case reads
// what it wrote, whatever the connection kept from the cases before it.
func TestKeptStatementsAnswerLikeNewOnes(t *testing.T) {
	ctx := context.Background()
	db, err := openSQLiteDB(filepath.Join(t.TempDir(), "kept.db"))
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1) // one connection: every case meets what the others kept
	_, err = db.ExecContext(ctx, `CREATE TABLE kv (k INTEGER PRIMARY KEY, v TEXT NOT NULL)`)
	require.NoError(t, err)
	for i := range 5 {
		_, err := db.ExecContext(ctx, `INSERT INTO kv (k, v) VALUES ($1, $2)`, i, fmt.Sprint("v", i))
		require.NoError(t, err)
	}
	count := func(q queryer) int {
		var n int
		require.NoError(t, q.QueryRowContext(ctx, `SELECT count(*) FROM kv`).Scan(&n))
		return n
	}

	t.Run("the same query twice, the second with other arguments", func(t *testing.T) {
		var a, b string
		require.NoError(t, db.QueryRowContext(ctx, `SELECT v FROM kv WHERE k = $1`, 1).Scan(&a))
		require.NoError(t, db.QueryRowContext(ctx, `SELECT v FROM kv WHERE k = $1`, 3).Scan(&b))
		assert.Equal(t, "v1", a)
		assert.Equal(t, "v3", b)
	})
	t.Run("the same query while its rows are still being read", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer tx.Rollback()
		rows, err := tx.QueryContext(ctx, `SELECT k FROM kv WHERE k >= $1 ORDER BY k`, 0)
		require.NoError(t, err)
		var outer, inner []int
		for rows.Next() {
			var k int
			require.NoError(t, rows.Scan(&k))
			outer = append(outer, k)
			// The same text again inside the loop: it must not reset the
			// statement the loop reads.
			in, err := tx.QueryContext(ctx, `SELECT k FROM kv WHERE k >= $1 ORDER BY k`, 4)
			require.NoError(t, err)
			for in.Next() {
				var j int
				require.NoError(t, in.Scan(&j))
				inner = append(inner, j)
			}
			require.NoError(t, in.Close())
		}
		require.NoError(t, rows.Err())
		require.NoError(t, rows.Close())
		assert.Equal(t, []int{0, 1, 2, 3, 4}, outer)
		assert.Equal(t, []int{4, 4, 4, 4, 4}, inner)
	})
	t.Run("writes in a rolled-back transaction are gone, in a committed one kept", func(t *testing.T) {
		for _, commit := range []bool{false, true} {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, `INSERT INTO kv (k, v) VALUES ($1, $2)`, 10, "ten")
			require.NoError(t, err)
			assert.Equal(t, 6, count(tx))
			if commit {
				require.NoError(t, tx.Commit())
			} else {
				require.NoError(t, tx.Rollback())
			}
		}
		assert.Equal(t, 6, count(db))
	})
	t.Run("a failing statement fails again, then the connection goes on", func(t *testing.T) {
		for range 2 {
			_, err := db.ExecContext(ctx, `INSERT INTO kv (k, v) VALUES ($1, $2)`, 1, "dup")
			require.Error(t, err, "the primary key is taken")
		}
		assert.Equal(t, 6, count(db))
	})
	t.Run("more texts than a connection keeps", func(t *testing.T) {
		for i := range stmtsPerConn + 10 {
			var v string
			q := fmt.Sprintf(`SELECT v FROM kv WHERE k = $1 AND %d = %d`, i, i)
			require.NoError(t, db.QueryRowContext(ctx, q, 2).Scan(&v))
			require.Equal(t, "v2", v)
		}
	})
	t.Run("a script of several statements runs whole", func(t *testing.T) {
		for i := range 2 {
			_, err := db.ExecContext(ctx, fmt.Sprintf(`INSERT INTO kv (k, v) VALUES (%d, 'a'); INSERT INTO kv (k, v) VALUES (%d, 'b');`, 100+2*i, 101+2*i))
			require.NoError(t, err)
		}
		assert.Equal(t, 10, count(db))
	})
	t.Run("a kept statement after the schema changed", func(t *testing.T) {
		var v string
		require.NoError(t, db.QueryRowContext(ctx, `SELECT * FROM kv WHERE k = $1`, 1).Scan(new(int), &v))
		_, err := db.ExecContext(ctx, `ALTER TABLE kv ADD COLUMN w TEXT NOT NULL DEFAULT 'w'`)
		require.NoError(t, err)
		var k int
		var w string
		require.NoError(t, db.QueryRowContext(ctx, `SELECT * FROM kv WHERE k = $1`, 1).Scan(&k, &v, &w))
		assert.Equal(t, []any{1, "v1", "w"}, []any{k, v, w})
	})
}

// The store's connections are the keeping kind.
func TestSQLiteStoreKeepsStatements(t *testing.T) {
	s, _ := openStore(t)
	conn, err := s.db.Conn(context.Background())
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.Raw(func(dc any) error {
		_, ok := dc.(*cachingConn)
		assert.True(t, ok, "a SQLite store connection is %T", dc)
		return nil
	}))
}
