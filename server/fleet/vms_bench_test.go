package fleet

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/vmstate"
)

// BenchmarkSetPower is one durable change to a VM end to end on SQLite:
// the row written, its event recorded, and the row published to a watcher.
func BenchmarkSetPower(b *testing.B) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(b.TempDir(), "eitri.db"))
	require.NoError(b, err)
	b.Cleanup(func() { st.Close() })
	require.NoError(b, st.CreateUser(ctx, store.User{ID: "u1", Name: "alice"}))
	_, err = st.CreateVM(ctx, store.VM{ID: "vm-1", OwnerID: "u1", Name: "web", PowerState: vmstate.PowerStopped})
	require.NoError(b, err)
	f := New(Config{}, st)
	w := f.VMs.Subscribe(nil)
	defer w.Close()
	ctx = auth.WithPrincipal(ctx, auth.Principal{UserID: "u1", Name: "alice"})
	power := []string{vmstate.PowerStopped, vmstate.PowerRunning} // the VM starts stopped: each call changes it
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		if _, err := f.SetPower(ctx, "vm-1", power[i%2]); err != nil {
			b.Fatal(err)
		}
		evs, err := w.Next(ctx)
		if err != nil || len(evs) != 1 || evs[0].Obj.GetPowerState() != power[i%2] {
			b.Fatal("the watcher did not hear the change", evs, err)
		}
	}
}
