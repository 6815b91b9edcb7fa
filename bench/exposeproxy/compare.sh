#!/usr/bin/env bash
# Compare the exposeproxy forwarder with a direct connection and with socat, on
# loopback: TCP throughput (1 and 8 streams) and the forwarder's CPU seconds per
# GB carried in those runs, short-connection rate, UDP request/response rate and
# loss, and memory for 1,000 idle exposures.
#
#   bench/exposeproxy/compare.sh            # DUR=3s by default
#   DUR=10s bench/exposeproxy/compare.sh
#
# Needs socat (apt-get install -y socat). Everything listens on 127.0.0.1.
set -euo pipefail

DUR=${DUR:-3s}
BASE=${BASE:-23000}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=$(mktemp -d)/exposeproxy-bench
command -v socat >/dev/null || { echo "socat not installed (apt-get install -y socat)" >&2; exit 1; }
(cd "$root" && go build -o "$bin" ./bench/exposeproxy)

pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$(dirname "$bin")"
}
trap cleanup EXIT

bg() { "$@" & pids+=($!); }

SINK=$((BASE + 1)) ECHO=$((BASE + 2)) UECHO=$((BASE + 3))
P_SINK=$((BASE + 11)) P_ECHO=$((BASE + 12)) P_UDP=$((BASE + 13))
S_SINK=$((BASE + 21)) S_ECHO=$((BASE + 22)) S_UDP=$((BASE + 23))
L=127.0.0.1

bg "$bin" sink -listen $L:$SINK
bg "$bin" echo -listen $L:$ECHO
bg "$bin" udpecho -listen $L:$UECHO
bg "$bin" proxy -proto tcp -listen $L:$P_SINK -to $L:$SINK
proxy_sink=$!
bg "$bin" proxy -proto tcp -listen $L:$P_ECHO -to $L:$ECHO
bg "$bin" proxy -proto udp -listen $L:$P_UDP -to $L:$UECHO
bg socat TCP4-LISTEN:$S_SINK,bind=$L,fork,reuseaddr,backlog=1024 TCP4:$L:$SINK
socat_sink=$!
bg socat TCP4-LISTEN:$S_ECHO,bind=$L,fork,reuseaddr,backlog=1024 TCP4:$L:$ECHO
bg socat -T 10 UDP4-LISTEN:$S_UDP,bind=$L,fork,reuseaddr UDP4:$L:$UECHO
sleep 1

val() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

printf '%-28s %12s %12s %12s %10s %10s\n' test direct proxy socat proxy/dir proxy/socat
row() { # name unit direct proxy socat
	printf '%-28s %12s %12s %12s %10s %10s\n' "$1" "$3" "$4" "$5" "$(ratio "$4" "$3")" "$(ratio "$4" "$5")"
}

# CPU of a forwarder in clock ticks: its own utime+stime plus cutime+cstime of
# reaped children. The proxy is a separate process with no children; socat
# forks one child per connection and reaps it, so the children's time lands in
# the parent's cutime/cstime once they have exited (see settle).
HZ=$(getconf CLK_TCK)
ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{ print $12 + $13 + $14 + $15 }'; }
settle() { # wait (up to 2s) until pid has no live or unreaped children
	for _ in $(seq 40); do
		[[ -z "$(cat /proc/"$1"/task/*/children 2>/dev/null | tr -d ' ')" ]] && return
		sleep 0.05
	done
	echo "warning: pid $1 still has children; CPU s/GB undercounts" >&2
}
# Run tcpsend through the forwarder with pid $1; prints "mbps cpu_s_per_GB".
through() {
	local pid=$1 t0 t1 out
	shift
	settle "$pid"
	t0=$(ticks "$pid")
	out=$("$bin" tcpsend "$@")
	settle "$pid"
	t1=$(ticks "$pid")
	awk -v m="$(val mbps <<<"$out")" -v b="$(val bytes <<<"$out")" -v t=$((t1 - t0)) -v hz="$HZ" \
		'BEGIN { printf "%s %s\n", m, (b > 0 ? sprintf("%.3f", t / hz / (b / 1e9)) : "n/a") }'
}

cpu_rows=()
for s in 1 8; do
	d=$("$bin" tcpsend -to $L:$SINK -streams $s -dur "$DUR" | val mbps)
	pr=$(through "$proxy_sink" -to $L:$P_SINK -streams $s -dur "$DUR")
	sr=$(through "$socat_sink" -to $L:$S_SINK -streams $s -dur "$DUR")
	read -r p pc <<<"$pr"
	read -r o oc <<<"$sr"
	row "tcp Mbit/s, $s stream(s)" mbps "$d" "$p" "$o"
	cpu_rows+=("CPU s/GB, $s stream(s)|$pc|$oc")
done
# Lower is better here: proxy/socat < 1 means the proxy spends less CPU per byte.
for r in "${cpu_rows[@]}"; do
	IFS='|' read -r name pc oc <<<"$r"
	printf '%-28s %12s %12s %12s %10s %10s\n' "$name" - "$pc" "$oc" - "$(ratio "$pc" "$oc")"
done

d=$("$bin" connrate -to $L:$ECHO -streams 4 -dur "$DUR" | val cps)
p=$("$bin" connrate -to $L:$P_ECHO -streams 4 -dur "$DUR" | val cps)
o=$("$bin" connrate -to $L:$S_ECHO -streams 4 -dur "$DUR" | val cps)
row "tcp short conns/s" cps "$d" "$p" "$o"

for c in 1 4; do
	dl=$("$bin" udpload -to $L:$UECHO -streams $c -dur "$DUR")
	pl=$("$bin" udpload -to $L:$P_UDP -streams $c -dur "$DUR")
	ol=$("$bin" udpload -to $L:$S_UDP -streams $c -dur "$DUR")
	row "udp answered pps, $c client(s)" pps "$(val pps <<<"$dl")" "$(val pps <<<"$pl")" "$(val pps <<<"$ol")"
	printf '%-28s %12s %12s %12s\n' "udp loss %, $c client(s)" "$(val loss_pct <<<"$dl")" "$(val loss_pct <<<"$pl")" "$(val loss_pct <<<"$ol")"
done

# Memory: PSS of a process holding N idle exposures minus one holding none,
# against socat, which needs one process per published port (sampled at 100
# and scaled to 1000).
pss() { awk '/^Pss:/ { s += $2 } END { print s + 0 }' "/proc/$1/smaps_rollup" 2>/dev/null || echo 0; }
hold() { # n -> PSS in kB
	local f pid
	f=$(mktemp)
	"$bin" idle -n "$1" >"$f" & pid=$!
	for _ in $(seq 100); do grep -q ready "$f" && break; sleep 0.1; done
	pss $pid
	kill $pid; wait $pid 2>/dev/null || true
	rm -f "$f"
}
base=$(hold 0)
full=$(hold 1000)
proxy_mib=$(awk -v a="$full" -v b="$base" 'BEGIN { printf "%.1f", (a - b) / 1024 }')

spids=()
for i in $(seq 0 99); do
	port=$((BASE + 100 + i))
	if ((i % 2)); then
		socat UDP4-LISTEN:$port,bind=$L,fork,reuseaddr UDP4:$L:9 & spids+=($!)
	else
		socat TCP4-LISTEN:$port,bind=$L,fork,reuseaddr TCP4:$L:9 & spids+=($!)
	fi
done
sleep 1
total=0
for p in "${spids[@]}"; do total=$((total + $(pss "$p"))); done
for p in "${spids[@]}"; do kill "$p" 2>/dev/null || true; done
socat_mib=$(awk -v t="$total" 'BEGIN { printf "%.1f", t * 10 / 1024 }')
printf '%-28s %12s %12s %12s %10s %10s\n' "MiB per 1000 idle (PSS)" - "$proxy_mib" "$socat_mib" - "$(ratio "$proxy_mib" "$socat_mib")"
