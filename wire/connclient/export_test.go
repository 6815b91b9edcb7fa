package connclient

import "time"

// SetReplicaTimeouts shortens the per-replica bounds for a test.
func SetReplicaTimeouts(dial, handshake time.Duration) (restore func()) {
	d, h := replicaDialTimeout, replicaHandshakeTimeout
	replicaDialTimeout, replicaHandshakeTimeout = dial, handshake
	return func() { replicaDialTimeout, replicaHandshakeTimeout = d, h }
}
