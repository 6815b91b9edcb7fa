package api_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func (e *env) host(id string) *eitriv1.Host {
	e.t.Helper()
	h, err := e.hosts(e.admin).GetHost(context.Background(), connect.NewRequest(&eitriv1.GetHostRequest{Id: id}))
	require.NoError(e.t, err)
	return h.Msg.Host
}

func (a *agent) endedWith(t *testing.T) error {
	t.Helper()
	select {
	case err := <-a.ended:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("the stream is still open")
		return nil
	}
}

func TestASecondAgentWithTheSameIdentityIsRefusedAndTheFirstKept(t *testing.T) {
	e := newEnv(t)
	id, cred := e.enroll("h1")
	first := e.connectWith(id, cred, big(), &eitriv1.Hello{AgentVersion: "test", Accelerator: "tcg", InstanceId: "first"})
	assert.Empty(t, e.host(id).GetConditions(), "one agent: nothing wrong")

	// A cloned disk: same credential, another process.
	clone := e.open(id, cred, &eitriv1.Hello{AgentVersion: "test", Accelerator: "tcg", InstanceId: "clone"})
	err := clone.endedWith(t)
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", err)
	assert.Contains(t, err.Error(), "already has an agent connected")
	assert.Contains(t, err.Error(), "new join token", "the refusal says what to do")

	h := e.host(id)
	assert.True(t, h.GetConnected())
	require.Len(t, h.GetConditions(), 1)
	assert.Equal(t, "duplicate_agent", h.GetConditions()[0].GetType())
	assert.NotEmpty(t, h.GetConditions()[0].GetMessage())
	assert.NotNil(t, h.GetConditions()[0].GetSince())

	// The first agent's stream is untouched and still applies reports.
	first.report(t, &eitriv1.ActualStateReport{Capacity: &eitriv1.Capacity{Vcpus: 4, MemMb: 4096, DiskGb: 50}})
	require.Eventually(t, func() bool { return e.host(id).GetCapacity().GetVcpus() == 4 }, 5*time.Second, 10*time.Millisecond)
	select {
	case err := <-first.ended:
		t.Fatalf("the first agent's stream ended: %v", err)
	default:
	}
}

func TestAReconnectOfTheSameAgentReplacesItsOldStream(t *testing.T) {
	e := newEnv(t)
	id, cred := e.enroll("h1")
	old := e.connectWith(id, cred, big(), &eitriv1.Hello{AgentVersion: "test", InstanceId: "same"})
	// The agent lost its connection without the server noticing yet, and
	// dials again: the new stream wins and nothing is flagged.
	e.connectWith(id, cred, big(), &eitriv1.Hello{AgentVersion: "test", InstanceId: "same"})
	assert.Equal(t, connect.CodeAborted, connect.CodeOf(old.endedWith(t)))
	h := e.host(id)
	assert.True(t, h.GetConnected())
	assert.Empty(t, h.GetConditions())
}

func TestTheHostSaysWhichAcceleratorAndWhyEvenAfterItLeaves(t *testing.T) {
	e := newEnv(t)
	id, cred := e.enroll("h1")
	a := e.connectWith(id, cred, big(), &eitriv1.Hello{AgentVersion: "test", InstanceId: "i",
		Accelerator: "kvm", AcceleratorReason: "kvm works with -cpu host"})
	h := e.host(id)
	assert.Equal(t, "kvm", h.GetAccelerator())
	assert.Equal(t, "kvm works with -cpu host", h.GetAcceleratorReason())

	// A VM's QEMU died of a KVM error; the agent re-probed and says so in
	// its reports.
	const why = "kvm unusable: KVM internal error (emulation failure); running under tcg"
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Accelerator: "tcg", AcceleratorReason: why})
	require.Eventually(t, func() bool { return e.host(id).GetAccelerator() == "tcg" }, 5*time.Second, 10*time.Millisecond)
	assert.Equal(t, why, e.host(id).GetAcceleratorReason())

	require.NoError(t, a.stream.CloseRequest())
	require.Eventually(t, func() bool { return !e.host(id).GetConnected() }, 5*time.Second, 10*time.Millisecond)
	h = e.host(id)
	assert.Equal(t, "tcg", h.GetAccelerator(), "the last word survives the disconnect")
	assert.Equal(t, why, h.GetAcceleratorReason())
}
