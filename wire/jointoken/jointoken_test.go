package jointoken_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/jointoken"
)

func TestRoundTripForgivesSurroundingSpace(t *testing.T) {
	tok := &eitriv1.JoinToken{Url: "https://cp:7443", CertFingerprint: "ab", Secret: "s3cret"}
	got, err := jointoken.Decode("  " + jointoken.Encode(tok) + "\n")
	require.NoError(t, err)
	assert.True(t, proto.Equal(tok, got))
}

func TestDecodeRefusesWhatNoSideCanUse(t *testing.T) {
	good := jointoken.Encode(&eitriv1.JoinToken{Url: "https://cp:7443", Secret: "s"})
	for name, s := range map[string]string{
		"empty":          "",
		"prefix only":    jointoken.Prefix,
		"not base64":     jointoken.Prefix + "!!!",
		"another secret": "eitri_pat_abc",
		"truncated":      good[:len(jointoken.Prefix)+3],
		"no secret":      jointoken.Encode(&eitriv1.JoinToken{Url: "https://cp:7443"}),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := jointoken.Decode(s)
			assert.Error(t, err)
		})
	}
}

func TestATokenWithoutURLCanBeSpentButNotDialed(t *testing.T) {
	tok, err := jointoken.Decode(jointoken.Encode(&eitriv1.JoinToken{Secret: "s"}))
	require.NoError(t, err, "the control plane spends it by its secret")
	assert.Error(t, jointoken.Dialable(tok), "an agent has nowhere to send it")
	assert.NoError(t, jointoken.Dialable(&eitriv1.JoinToken{Url: "https://cp:7443", Secret: "s"}))
}

func TestURLsNamesEveryReplicaAndFallsBackToTheOneURL(t *testing.T) {
	assert.Equal(t, []string{"https://a:7443", "https://b:7443"},
		jointoken.URLs(&eitriv1.JoinToken{Url: "https://a:7443", Urls: []string{"https://a:7443", "https://b:7443"}}))
	assert.Equal(t, []string{"https://a:7443"}, jointoken.URLs(&eitriv1.JoinToken{Url: "https://a:7443"}),
		"a token from a control plane that knew one URL")
	assert.Empty(t, jointoken.URLs(&eitriv1.JoinToken{Secret: "s"}))
}
