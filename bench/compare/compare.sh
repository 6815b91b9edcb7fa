#!/usr/bin/env bash
# compare.sh: the hot paths of two builds, measured alternately in one run
# on one machine, so that load drift hits both alike (issue 37).
#
#   make bench-compare BASE=9535edb          # a commit, a tag, a branch
#   make bench-compare                       # BASE=HEAD: the work tree's change
#   ROUNDS=5 ONLY=fanout,ports make bench-compare BASE=main
#
# BASE is checked out into a temporary worktree; both it and the work tree
# (with its uncommitted changes) are built the same way. Each round runs
# every benchmark once on each build, the order flipping each round (ABBA).
# What is measured, by the build's own code:
#
#   fanout   bench/scale against each build's `eitri server` on SQLite:
#            HOSTS x VMS simulated agents on the real Sync protocol and
#            WATCHERS watch streams; report→watcher p50/p99, control-plane
#            cores, RSS and CPU per change, delivered share; CreateVM
#            (ms per VM over HOSTS x VMS creates) and the watchers' opening.
#   report   the same with one watcher and every host narrating every
#            250 ms: the report path, CPU per change with no fan-out.
#   ports    each build's published-port forwarder (bench/exposeproxy):
#            TCP Mbit/s with 1 and 8 streams, UDP answered datagrams/s.
#   download each build's image cache (bench/imagecache/icbench): download
#            and verify a SIZE_MIB image from loopback, ms per image.
#   micro    the go test benchmarks both trees have (watch, api fan-out,
#            store, reconcile), -count MICRO_COUNT per round.
#
# The harnesses that load and measure (bench/scale, the load generators,
# the HTTP server) are the work tree's, the same for both builds. Results
# are in Go's benchmark format in $OUT/{base,head}.txt; at the end benchstat
# prints both, and a table of head/base ratios per unit: the median of the
# per-round ratios, with their lowest and highest. Below 1 is better for
# every unit but Mbit/s, pps and delivered-%.
set -euo pipefail

BASE=${BASE:-HEAD}
ROUNDS=${ROUNDS:-3}
ONLY=${ONLY:-fanout,report,ports,download,micro}
HOSTS=${HOSTS:-200}
VMS=${VMS:-20}
WATCHERS=${WATCHERS:-300}
FOR=${FOR:-20s}
WARMUP=${WARMUP:-20s}
DUR=${DUR:-3s}
SIZE_MIB=${SIZE_MIB:-256}
MICRO_COUNT=${MICRO_COUNT:-2}
BENCHSTAT=${BENCHSTAT:-golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }
want() { [[ ",$ONLY," == *",$1,"* ]]; }

base_rev=$(git -C "$repo" rev-parse --verify "$BASE^{commit}") || die "BASE=$BASE is not a commit"
work=$(mktemp -d /tmp/eitri-bench-compare.XXXXXX)
OUT=${OUT:-$work/out}
mkdir -p "$OUT"
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	git -C "$repo" worktree remove --force "$work/base-src" 2>/dev/null || true
	rm -rf "$work/base" "$work/head" "$work/srv" "$work/cache"
}
trap cleanup EXIT

log "base $BASE = ${base_rev:0:12}; head = the work tree at $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD || echo ' + changes')"
git -C "$repo" worktree add --detach "$work/base-src" "$base_rev" >/dev/null 2>&1 || die "git worktree add $base_rev"

# micro: package and benchmark pattern; a tree without the package or the
# benchmark simply has no line for it.
MICRO=(
	"server/watch:^BenchmarkPublish100Watchers$"
	"server/api:^BenchmarkFanOut100Watchers$"
	"server/store:^Benchmark(UpdateVM|CreateVM|ListVMs1000)$"
	"agent/reconcile:^BenchmarkApplyFillSteadyState$"
)

# build SRC OUT: the binaries each build is measured with.
build() {
	local src=$1 out=$2 m pkg
	mkdir -p "$out"
	(cd "$src" && go build -o "$out/eitri" ./cmd/eitri)
	(cd "$src" && go build -o "$out/exposeproxy-bench" ./bench/exposeproxy)
	(cd "$src" && go build -o "$out/icbench" ./bench/imagecache/icbench)
	if want micro; then
		for m in "${MICRO[@]}"; do
			pkg=${m%%:*}
			[[ -d $src/$pkg ]] || continue
			(cd "$src" && go test -c -o "$out/${pkg//\//_}.test" "./$pkg") >/dev/null
		done
	fi
}
log "building base"
build "$work/base-src" "$work/base"
log "building head"
build "$repo" "$work/head"
(cd "$repo" && go build -o "$work/scale" ./bench/scale)
tools=$work/head # the load side, the same for both

# Benchmarks append to $OUT/$who.txt in Go's benchmark format.
fanout() { # who
	"$work/scale" -bin "$work/$1/eitri" -hosts "$HOSTS" -vms "$VMS" -watchers "$WATCHERS" \
		-for "$FOR" -warmup "$WARMUP" -floor=false -benchfmt "$OUT/$1.txt" >>"$OUT/$1.log" 2>&1 ||
		die "fanout ($1) failed: see $OUT/$1.log"
}
report() { # who: the report path, one watcher, four times the rate
	"$work/scale" -bin "$work/$1/eitri" -hosts "$HOSTS" -vms 5 -watchers 4 -every 250ms \
		-for 10s -warmup 10s -floor=false -benchfmt "$OUT/$1.report.tmp" >>"$OUT/$1.log" 2>&1 ||
		die "report ($1) failed: see $OUT/$1.log"
	# Only its fan-out line, named for what it measures.
	sed -n 's/^BenchmarkScaleFanOut\//BenchmarkScaleReportPath\//p' "$OUT/$1.report.tmp" >>"$OUT/$1.txt"
	rm -f "$OUT/$1.report.tmp"
}
val() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; }
port=24000
ports() { # who
	local p=$((port += 10)) proxy_pids=() mbps pps s
	"$work/$1/exposeproxy-bench" proxy -proto tcp -listen 127.0.0.1:$((p + 1)) -to 127.0.0.1:$SINK >>"$OUT/$1.log" 2>&1 & proxy_pids+=($!)
	"$work/$1/exposeproxy-bench" proxy -proto udp -listen 127.0.0.1:$((p + 2)) -to 127.0.0.1:$UECHO >>"$OUT/$1.log" 2>&1 & proxy_pids+=($!)
	sleep 0.5
	for s in 1 8; do
		mbps=$("$tools/exposeproxy-bench" tcpsend -to 127.0.0.1:$((p + 1)) -streams $s -dur "$DUR" | val mbps)
		echo "BenchmarkPublishedPortTCP/streams=$s 1 $mbps Mbit/s" >>"$OUT/$1.txt"
	done
	pps=$("$tools/exposeproxy-bench" udpload -to 127.0.0.1:$((p + 2)) -streams 4 -dur "$DUR" | val pps)
	echo "BenchmarkPublishedPortUDP/clients=4 1 $pps pps" >>"$OUT/$1.txt"
	kill "${proxy_pids[@]}" 2>/dev/null || true
	wait "${proxy_pids[@]}" 2>/dev/null || true
}
download() { # who
	local s
	rm -rf "$work/cache"
	sync
	s=$("$work/$1/icbench" fetch -dir "$work/cache" -url "$URL" -sha "$SHA") || die "download ($1) failed"
	awk -v s="$s" -v n="$SIZE_MIB" 'BEGIN { printf "BenchmarkDownloadVerify/size=%dMiB 1 %.1f ms/op\n", n, s * 1000 }' >>"$OUT/$1.txt"
}
micro() { # who
	local m pkg pat bin src
	src=$repo
	[[ $1 == base ]] && src=$work/base-src
	for m in "${MICRO[@]}"; do
		pkg=${m%%:*} pat=${m#*:} bin=$work/$1/${pkg//\//_}.test
		[[ -x $bin ]] || continue
		(cd "$src/$pkg" && "$bin" -test.run '^$' -test.bench "$pat" -test.benchmem -test.count "$MICRO_COUNT") |
			grep '^Benchmark' >>"$OUT/$1.txt" || true
	done
}

# What the port and download rounds need, started once and shared.
if want ports; then
	SINK=24001 UECHO=24002
	"$tools/exposeproxy-bench" sink -listen 127.0.0.1:$SINK & pids+=($!)
	"$tools/exposeproxy-bench" udpecho -listen 127.0.0.1:$UECHO & pids+=($!)
fi
if want download; then
	mkdir -p "$work/srv"
	q=$((SIZE_MIB / 4))
	{ # disk-like: a quarter random, half text, a quarter zeros
		head -c "$((q << 20))" /dev/urandom
		head -c "$((2 * q << 20))" < <(yes "eitri boots a tiny guest; a line of log text")
		head -c "$(((SIZE_MIB - 3 * q) << 20))" /dev/zero
	} >"$work/srv/disk.raw"
	SHA=$(sha256sum "$work/srv/disk.raw" | cut -d' ' -f1)
	"$tools/icbench" serve -dir "$work/srv" >"$work/url" & pids+=($!)
	for _ in $(seq 50); do [[ -s $work/url ]] && break; sleep 0.1; done
	URL="$(cat "$work/url")/disk.raw"
fi

for r in $(seq "$ROUNDS"); do
	order=(base head)
	((r % 2 == 0)) && order=(head base)
	for b in fanout report ports download micro; do
		want "$b" || continue
		for who in "${order[@]}"; do
			log "round $r/$ROUNDS: $b, $who"
			"$b" "$who"
		done
	done
done

log "results in $OUT"
(cd "$OUT" && GOFLAGS=-mod=mod go run "$BENCHSTAT" base=base.txt head=head.txt) || log "benchstat unavailable; the ratios follow"
echo
echo "head/base per round: median ratio [lowest, highest] (n rounds)"
awk -f "$here/ratios.awk" "$OUT/base.txt" "$OUT/head.txt"
