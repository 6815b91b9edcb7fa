package fleet

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestLifecycleIsDerivedFromTheRowAndTheLiveReport(t *testing.T) {
	row := func(phase, power string) *eitriv1.ActualVM { return &eitriv1.ActualVM{Phase: phase, Power: power} }
	cases := []struct {
		name      string
		deleted   bool
		status    string
		row       *eitriv1.ActualVM
		reporting bool
		want      string
	}{
		{"deleted wins over anything live", true, "ready", row("ready", "running"), true, "deleting"},
		{"never reported", false, "pending", nil, false, "pending"},
		{"host connected, not picked up yet", false, "pending", nil, true, "pending"},
		{"host silent about a VM it ran", false, "ready", nil, false, "unknown"},
		{"creating", false, "pending", row("creating", "stopped"), true, "creating"},
		{"ready and running", false, "creating", row("ready", "running"), true, "ready"},
		{"ready phase but powered off", false, "ready", row("ready", "stopped"), true, "stopped"},
		{"stopped", false, "ready", row("stopped", "stopped"), true, "stopped"},
		{"failed", false, "creating", row("failed", "stopped"), true, "failed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, Lifecycle(c.deleted, c.status, c.row, c.reporting))
		})
	}
}

func TestJoinTokensRoundTripAndRejectDamage(t *testing.T) {
	tok := &eitriv1.JoinToken{Url: "https://cp:7443", CertFingerprint: "ab", Secret: "s3cret"}
	got, err := DecodeJoinToken(EncodeJoinToken(tok))
	assert.NoError(t, err)
	assert.True(t, proto.Equal(tok, got))
	for _, bad := range []string{"", "eitri_join_", "eitri_join_!!!", "eitri_pat_abc", EncodeJoinToken(tok)[:20]} {
		_, err := DecodeJoinToken(bad)
		assert.Error(t, err, bad)
	}
}
