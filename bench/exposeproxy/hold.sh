#!/usr/bin/env bash
# Hold many TCP connections through one published port while new ones keep
# arriving: HELD connections (default 20,000) to an echo behind the proxy,
# then RATE new connections a second (default 1,000) for DUR (default 60s)
# beside them, every one proven end to end. Reports the proxy's memory and
# descriptors per held connection, any connection refused or lost, and whether
# its descriptors and goroutines return to where they started once all close.
#
#   bench/exposeproxy/hold.sh
#   HELD=2000 DUR=10s bench/exposeproxy/hold.sh
#   DOCKER_PROXY=/path/to/docker-proxy bench/exposeproxy/hold.sh   # the same load on docker-proxy
#
# Runs in a network namespace of its own (root; unshare -n): its own loopback,
# ephemeral port range and descriptor limits, so the 100,000-odd sockets and
# TIME_WAIT entries neither disturb the host nor depend on its settings. The
# guest is a loopback echo, not a VM: what is measured is the proxy's cost per
# connection, and a TCG guest's kernel would be the bottleneck long before it.
set -euo pipefail

HELD=${HELD:-20000}
RATE=${RATE:-1000}
DUR=${DUR:-60s}
CAP=${CAP:-$((HELD + 2 * RATE))}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

if [[ -z ${HOLD_IN_NETNS:-} ]]; then
	bin=$(mktemp -d)/exposeproxy-bench
	(cd "$root" && go build -o "$bin" ./bench/exposeproxy)
	trap 'rm -rf "$(dirname "$bin")"' EXIT
	HOLD_IN_NETNS=1 BIN=$bin unshare -n "$0" "$@"
	exit
fi

ip link set lo up
# The proxy closes first toward the guest when a client leaves, so each churned
# connection leaves a TIME_WAIT entry on the proxy's side of (proxy, guest
# ip:port) for 60s, in the same ephemeral port space the held connections use.
# tcp_tw_reuse=2 (the kernel default) reuses them on loopback only; toward a
# real guest on a bridge set TW_REUSE=0 PORTS="32768 60999" to see that wall:
# held + 60s x rate must fit in the port range.
sysctl -qw net.ipv4.ip_local_port_range="${PORTS:-1024 65535}"
sysctl -qw net.ipv4.tcp_tw_reuse="${TW_REUSE:-2}"
sysctl -qw net.core.somaxconn=4096
echo "ports $(sysctl -n net.ipv4.ip_local_port_range | tr '\t' -), tcp_tw_reuse $(sysctl -n net.ipv4.tcp_tw_reuse)"
# As many descriptors as this process may have; raising the hard limit needs
# CAP_SYS_RESOURCE, which a container may not grant.
ulimit -n "$(cat /proc/sys/fs/nr_open)" 2>/dev/null || ulimit -n "$(ulimit -Hn)"
need=$((2 * HELD + RATE + 100)) # two per held connection, and the churn in flight
echo "RLIMIT_NOFILE: $(ulimit -n) (the proxy needs about $need)"
if (($(ulimit -n) < need)); then
	echo "warning: too few descriptors for $HELD held connections; expect refusals past $((($(ulimit -n) - RATE - 100) / 2))" >&2
fi

pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
}
trap cleanup EXIT

L=127.0.0.1
# Ports below the ephemeral range, so no client or guest-side socket of an
# earlier run can be sitting on them.
ECHO=700 PROXY=800 STATS=801 DPROXY=810
log=$(mktemp)
"$BIN" echo -listen $L:$ECHO & pids+=($!)
"$BIN" proxy -proto tcp -listen $L:$PROXY -to $L:$ECHO -cap "$CAP" -stats $L:$STATS 2>"$log" & proxy=$!
pids+=($proxy)
sleep 1

echo "== eitri exposeproxy: cap $CAP, $HELD held, $RATE/s for $DUR  (uptime:$(uptime | sed 's/.*load/ load/'))"
"$BIN" hold -to $L:$PROXY -stats $L:$STATS -pid $proxy -held "$HELD" -rate "$RATE" -dur "$DUR"
kill $proxy
wait $proxy 2>/dev/null || true
echo "proxy log: $(wc -l <"$log") lines, $(grep -c 'out of file descriptors' "$log") about running out of descriptors; last: $(tail -1 "$log")"
rm -f "$log"

if [[ -n ${DOCKER_PROXY:-} ]]; then
	# docker-proxy reports "0" (ready) or "1" and the error on descriptor 3.
	ready=$(mktemp)
	"$DOCKER_PROXY" -proto tcp -host-ip $L -host-port $DPROXY -container-ip $L -container-port $ECHO 3>"$ready" &
	dp=$!
	pids+=($dp)
	sleep 1
	echo "== docker-proxy ($DOCKER_PROXY): $HELD held, $RATE/s for $DUR  (uptime:$(uptime | sed 's/.*load/ load/'))"
	[[ $(head -c1 "$ready") == 0 ]] || { echo "docker-proxy did not start: $(cat "$ready")" >&2; exit 1; }
	"$BIN" hold -to $L:$DPROXY -pid $dp -held "$HELD" -rate "$RATE" -dur "$DUR" || true
	kill -0 $dp 2>/dev/null || echo "docker-proxy has exited"
	rm -f "$ready"
fi
