package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestServerRefusesADBThatIsNotAPostgresURLWithoutEchoingIt(t *testing.T) {
	for _, viaEnv := range []bool{false, true} {
		f := serverFlags{cpFlags: cpFlags{listen: "127.0.0.1:0", dataDir: t.TempDir(), level: "error", stuckAfter: time.Minute}}
		const db = "postgress://eitri:s3cret@db/eitri"
		if viaEnv {
			t.Setenv("EITRI_DB", db)
		} else {
			f.db = db
		}
		err := runServer(context.Background(), f)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "postgres://")
		assert.NotContains(t, err.Error(), "s3cret")
	}
}

func TestControlPlaneRefusesAnUpgradeStuckBoundThatIsNotPositive(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Second} {
		f := serverFlags{cpFlags: cpFlags{listen: "127.0.0.1:0", dataDir: t.TempDir(), level: "error", stuckAfter: d}}
		err := runServer(context.Background(), f)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "--upgrade-stuck-after")
		err = runDev(context.Background(), devFlags{cpFlags: f.cpFlags})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "--upgrade-stuck-after")
	}
}
