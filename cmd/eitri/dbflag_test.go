package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestServerRefusesADBThatIsNotAPostgresURLWithoutEchoingIt(t *testing.T) {
	for _, viaEnv := range []bool{false, true} {
		f := serverFlags{cpFlags: cpFlags{listen: "127.0.0.1:0", dataDir: t.TempDir(), level: "error"}}
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
