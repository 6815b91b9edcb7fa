package server

import (
	"bytes"
	"context"
	"log/slog"
	"net/url"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server/store/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// Two control planes on one PostgreSQL, each with its own data dir, are
// one fleet: the first makes the admin, the second finds it. Neither logs
// the database's password.
func TestControlPlanesSharingAPostgreSQLBootstrapOnceAndNeverLogItsPassword(t *testing.T) {
	ctx := context.Background()
	u, err := url.Parse(pgtest.DSN(t))
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), "s3cret") // the test server trusts any
	db := u.String()

	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	first, err := New(ctx, Config{DataDir: t.TempDir(), DB: db, Plaintext: true, Log: log})
	require.NoError(t, err)
	defer first.Close()
	second, err := New(ctx, Config{DataDir: t.TempDir(), DB: db, Plaintext: true, Log: log})
	require.NoError(t, err)
	defer second.Close()

	assert.NotEmpty(t, first.AdminToken, "the first start makes the admin")
	assert.Empty(t, second.AdminToken, "the second finds it in the shared database")
	n, err := second.Store.CountUsers(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Contains(t, logs.String(), "postgres://")
	assert.NotContains(t, logs.String(), "s3cret")
}
