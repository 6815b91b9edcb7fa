package main

import (
	"encoding/base64"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/syncclient"
)

func reencode(t *testing.T, tok syncclient.JoinToken) string {
	t.Helper()
	b, err := json.Marshal(tok)
	require.NoError(t, err)
	return "eitri_join_" + base64.RawURLEncoding.EncodeToString(b)
}
