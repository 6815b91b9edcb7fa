package state

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPublishedPortsSurviveAReopen(t *testing.T) {
	s := open(t)
	_, ok, err := s.LoadExposures()
	require.NoError(t, err)
	assert.False(t, ok, "a fresh store has never been told of any port")

	want := []Exposure{
		{ID: "x1", VMID: "vm-1", Protocol: "tcp", Scope: "lan", HostPort: 30080, GuestPort: 80, MaxSessions: 64},
		{ID: "x2", VMID: "vm-2", Protocol: "udp", Scope: "local", HostPort: 30053, GuestPort: 53},
	}
	require.NoError(t, s.SaveExposures(want))

	s2, err := Open(s.Dir())
	require.NoError(t, err)
	got, ok, err := s2.LoadExposures()
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, want, got)
	assert.Empty(t, tempFiles(t, s2))
}

func TestAnEmptySnapshotLeavesNoPortsRatherThanTheOldOnes(t *testing.T) {
	s := open(t)
	require.NoError(t, s.SaveExposures([]Exposure{{ID: "x1", VMID: "vm-1", Protocol: "tcp", Scope: "lan", HostPort: 30080, GuestPort: 80}}))
	require.NoError(t, s.SaveExposures(nil))
	got, ok, err := s.LoadExposures()
	require.NoError(t, err)
	assert.True(t, ok, "told of no ports is not the same as never told")
	assert.Empty(t, got)
}

func TestADamagedPortsFileIsAnErrorNotNoPorts(t *testing.T) {
	for name, body := range map[string]string{
		"truncated":    `{"Exposures":[{"ID":"x1"`,
		"bad protocol": `{"Exposures":[{"ID":"x1","VMID":"vm-1","Protocol":"sctp","Scope":"lan","HostPort":1,"GuestPort":1}]}`,
		"vm id path":   `{"Exposures":[{"ID":"x1","VMID":"../etc","Protocol":"tcp","Scope":"lan","HostPort":1,"GuestPort":1}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			require.NoError(t, os.WriteFile(filepath.Join(s.Dir(), exposuresFile), []byte(body), 0o600))
			_, ok, err := s.LoadExposures()
			require.Error(t, err)
			assert.Contains(t, err.Error(), "corrupt record")
			assert.False(t, ok)
		})
	}
}

func TestAPortThatCouldNotBeServedIsNotSaved(t *testing.T) {
	s := open(t)
	require.NoError(t, s.SaveExposures([]Exposure{{ID: "x1", VMID: "vm-1", Protocol: "tcp", Scope: "lan", HostPort: 30080, GuestPort: 80}}))
	err := s.SaveExposures([]Exposure{{ID: "x2", VMID: "vm-1", Protocol: "tcp", Scope: "lan", HostPort: 0, GuestPort: 80}})
	require.Error(t, err)
	got, _, err := s.LoadExposures()
	require.NoError(t, err)
	require.Len(t, got, 1, "a refused save leaves the last good set")
	assert.Equal(t, "x1", got[0].ID)
}
