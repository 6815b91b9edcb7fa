#!/usr/bin/env bash
# compare.sh: how much a VM created through eitri's API costs over booting
# the same guest image with QEMU by hand, measured in one run.
#
#   sudo bench/create/compare.sh            # N=3 of each (env N=5 for more)
#
# Everything runs inside a network namespace this script creates and removes:
# `eitri dev` (control plane + local agent with its bridge, taps and DHCP) and
# the hand-run QEMUs. Measured, interleaved (API run, hand run, API run, ...)
# so load drift hits both sides alike, one VM alive at a time:
#
#   API -> QEMU start  from just before the CreateVM POST until the VM's
#                      qemu.pid exists and names a live process (10 ms poll)
#   API -> ready       from just before the POST until GetVM says lifecycle
#                      "ready" with an address (50 ms poll)
#   API -> READY line  from just before the POST until the guest prints
#                      EITRI-GUEST-READY on its serial log (diagnostic: the
#                      gap to "API -> ready" is the agent's and control
#                      plane's latency in noticing and reporting the address)
#   hand -> READY line from exec of qemu-system-x86_64 (same arguments as the
#                      agent's, user-mode networking for DHCP) until the same
#                      line appears on its serial log (10 ms poll)
#
# The image cache is warmed by one untimed API create first.
set -euo pipefail

N=${N:-3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
GUEST_DIR=${GUEST_DIR:-/tmp/gout}
PORT=18090
BRIDGE=eitribench0
SUBNET=10.88.0.1/24
API=http://127.0.0.1:$PORT

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------- outside --
if [[ -z ${EITRI_BENCH_NS:-} ]]; then
	[[ $(id -u) == 0 ]] || die "needs root (network namespace, bridge, taps)"
	for b in ip qemu-system-x86_64 qemu-img curl jq go; do
		command -v "$b" >/dev/null || die "$b not installed"
	done
	[[ -f $GUEST_DIR/eitri-guest.raw ]] || die "no test guest in $GUEST_DIR: run guestimage/build.sh $GUEST_DIR"

	WORK=$(mktemp -d /tmp/eitri-bench-create.XXXXXX)
	NS=eitri-bench-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')
	cleanup() {
		local rc=$?
		# QEMU daemonizes and so outlives everything we started: end what
		# is left in the namespace, by pid, before removing it.
		if ip netns list | grep -qw "$NS"; then
			local pids
			pids=$(ip netns pids "$NS" 2>/dev/null || true)
			for p in $pids; do kill -KILL "$p" 2>/dev/null || true; done
			ip netns del "$NS" 2>/dev/null || true
		fi
		if [[ -z ${KEEP:-} ]]; then rm -rf "$WORK"; else log "kept $WORK"; fi
		exit $rc
	}
	trap cleanup EXIT INT TERM

	log "building eitri and the seed"
	(cd "$repo" && go build -o "$WORK/eitri" ./cmd/eitri)
	(cd "$repo" && go run ./guestimage/mkseed -out "$WORK/seed.iso" -hostname h -instance-id i)

	ip netns add "$NS"
	ip netns exec "$NS" ip link set lo up
	EITRI_BENCH_NS=$NS WORK=$WORK N=$N GUEST_DIR=$GUEST_DIR \
		ip netns exec "$NS" "$0"
	exit 0
fi

# ----------------------------------------------------------------- inside --
: "${WORK:?}"
DATA=$WORK/data
mkdir -p "$DATA"

now() { local t=$EPOCHREALTIME; NOW=$(( ${t/[.,]/} / 1000 )); } # ms

dev_pid=
stop_dev() {
	if [[ -n $dev_pid ]]; then
		kill -TERM "$dev_pid" 2>/dev/null || true
		for _ in $(seq 100); do kill -0 "$dev_pid" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$dev_pid" 2>/dev/null || true
	fi
}
trap stop_dev EXIT

log "starting eitri dev in namespace $EITRI_BENCH_NS"
"$WORK/eitri" dev --listen 127.0.0.1:$PORT --data-dir "$DATA" --bridge $BRIDGE --subnet $SUBNET \
	--guest-image "$GUEST_DIR" --delete-grace 1s --log-level debug >"$WORK/dev.log" 2>&1 &
dev_pid=$!

for _ in $(seq 300); do
	curl -fs -o /dev/null "$API/healthz" && break
	kill -0 "$dev_pid" 2>/dev/null || { cat "$WORK/dev.log" >&2; die "eitri dev exited"; }
	sleep 0.1
done
TOK=$(<"$DATA/control/admin.token")

rpc() { # rpc Service/Method JSON
	curl -fsS -X POST "$API/eitri.v1.$1" -H "Authorization: Bearer $TOK" \
		-H 'Content-Type: application/json' -d "$2"
}

for i in $(seq 300); do
	n=$(rpc HostService/ListHosts '{}' | jq '[.hosts[]? | select(.capacity != null)] | length' || echo 0)
	[[ $n == 1 ]] && break
	(( i < 300 )) || die "the local agent never enrolled"
	sleep 0.1
done

img=$(curl -fsS "$API/guest-image.json")
IMG_URL=$(jq -r .url <<<"$img")
IMG_SHA=$(jq -r .sha256 <<<"$img")
log "guest image $IMG_URL"

VMS=$DATA/agent/vms
T0_ABS=() IDS=()

# create_body NAME: the CreateVM request, built before the clock starts.
create_body() {
	jq -nc --arg n "$1" --arg u "$IMG_URL" --arg s "$IMG_SHA" \
		'{name:$n,image_url:$u,image_sha256:$s,vcpus:1,mem_mb:256,disk_gb:1}'
}

# create BODY: sets VM_ID. Only curl runs between the clock and the
# response: the id is cut out in bash, not by another process.
create() {
	local resp re='"id":[[:space:]]*"([^"]+)"'
	resp=$(rpc VMService/CreateVM "$1")
	[[ $resp =~ $re ]] || die "CreateVM returned no id: $resp"
	VM_ID=${BASH_REMATCH[1]}
}

# vm_ready ID: lifecycle ready with an address (either JSON spelling).
vm_ready() {
	rpc VMService/GetVM "{\"id\":\"$1\"}" |
		jq -e '.vm.lifecycle == "ready" and ((.vm.assignedIp // .vm.assigned_ip // "") != "")' >/dev/null
}

ready_line() { [[ -f $1 ]] && grep -qa EITRI-GUEST-READY "$1"; }

pid_alive() { # pid_alive PIDFILE
	local p
	[[ -s $1 ]] || return 1
	read -r p <"$1" || true
	[[ -n $p ]] && kill -0 "$p" 2>/dev/null
}

delete_vm() {
	local id=$1 pf=$VMS/$1/qemu.pid p=
	if [[ -s $pf ]]; then read -r p <"$pf" || true; fi
	rpc VMService/DeleteVM "{\"id\":\"$id\"}" >/dev/null
	# Wait for the agent to stop the guest, so the next run has the CPUs.
	for _ in $(seq 400); do
		[[ -z $p ]] || ! kill -0 "$p" 2>/dev/null && return 0
		sleep 0.05
	done
	log "vm $id still running 20s after DeleteVM; killing its qemu"
	kill -KILL "$p" 2>/dev/null || true
}

# api_run NAME: sets T_QEMU, T_LINE, T_READY (ms since the POST).
api_run() {
	local t0 pf serial deadline body
	body=$(create_body "$1")
	now; t0=$NOW
	create "$body"
	now; T_POST=$(( NOW - t0 ))
	pf=$VMS/$VM_ID/qemu.pid serial=$VMS/$VM_ID/serial.log
	deadline=$(( t0 + 180000 ))
	T_QEMU= T_LINE= T_READY=
	while ! pid_alive "$pf"; do
		now; (( NOW < deadline )) || die "vm $VM_ID: no QEMU after 180s"
		sleep 0.01
	done
	now; T_QEMU=$(( NOW - t0 ))
	while :; do
		if [[ -z $T_LINE ]] && ready_line "$serial"; then now; T_LINE=$(( NOW - t0 )); fi
		if vm_ready "$VM_ID"; then now; T_READY=$(( NOW - t0 )); break; fi
		(( NOW < deadline )) || die "vm $VM_ID: not ready after 180s"
		sleep 0.05
	done
	# The agent sees the DHCP ACK before the guest has applied the address
	# and printed its line, so "ready" can come first: keep watching.
	until [[ -n $T_LINE ]]; do
		if ready_line "$serial"; then now; T_LINE=$(( NOW - t0 )); fi
		(( NOW < deadline )) || die "vm $VM_ID: no READY line after 180s"
		sleep 0.01; now
	done
	T0_ABS+=("$t0") IDS+=("$VM_ID")
	delete_vm "$VM_ID"
}

# The agent's QEMU command line (agent/qemu/backend.go args) with user-mode
# networking, whose built-in DHCP stands in for the agent's bridge and DHCP.
hand_run() { # hand_run K: sets T_HAND
	local d=$WORK/hand$1 t0 deadline p
	mkdir -p "$d"
	qemu-img create -q -f qcow2 -F raw -b "$BASE" "$d/root.qcow2" $((1 << 30))
	now; t0=$NOW
	qemu-system-x86_64 \
		-name guest=hand$1 -machine q35,accel=tcg -cpu max -smp 1 -m 256M \
		-nodefaults -no-user-config -display none -rtc base=utc \
		-chardev "file,id=serial0,path=$d/serial.log" -serial chardev:serial0 \
		-chardev "socket,id=qmp,path=$d/qmp.sock,server=on,wait=off" -mon chardev=qmp,mode=control \
		-pidfile "$d/qemu.pid" -daemonize \
		-drive "if=none,id=root,format=qcow2,discard=unmap,file=$d/root.qcow2" \
		-device virtio-blk-pci,drive=root,bootindex=1 \
		-drive "if=none,id=seed,format=raw,readonly=on,file=$WORK/seed.iso" \
		-device virtio-blk-pci,drive=seed \
		-device virtio-rng-pci \
		-netdev user,id=net0 -device virtio-net-pci,netdev=net0,mac=$(printf 52:54:00:12:34:%02x "$1") &
	local launcher=$!
	deadline=$(( t0 + 180000 ))
	until pid_alive "$d/qemu.pid"; do
		now; (( NOW < deadline )) || die "hand-run qemu $1: no pid after 180s"
		sleep 0.01
	done
	now; T_HSTART=$(( NOW - t0 ))
	until ready_line "$d/serial.log"; do
		now; (( NOW < deadline )) || die "hand-run qemu $1: no READY line after 180s"
		sleep 0.01
	done
	now; T_HAND=$(( NOW - t0 ))
	wait "$launcher" || true
	read -r p <"$d/qemu.pid" || true
	[[ -n $p ]] && kill -KILL "$p" 2>/dev/null || true
	for _ in $(seq 100); do [[ -n $p ]] && kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
}

log "warming the image cache with one untimed create"
api_run warm
log "warm-up: QEMU start ${T_QEMU} ms, ready ${T_READY} ms"
BASE=$(ls "$DATA"/agent/images/*.raw | head -n1)
[[ -f $BASE ]] || die "no cached raw image under $DATA/agent/images"

post_ms=() qemu_ms=() line_ms=() ready_ms=() hand_ms=() hstart_ms=()
for k in $(seq "$N"); do
	api_run "b$k"
	post_ms+=("$T_POST") qemu_ms+=("$T_QEMU") line_ms+=("$T_LINE") ready_ms+=("$T_READY")
	log "api  #$k: POST returned $T_POST ms, QEMU start $T_QEMU ms, READY line $T_LINE ms, GetVM ready $T_READY ms"
	hand_run "$k"
	hand_ms+=("$T_HAND") hstart_ms+=("$T_HSTART")
	log "hand #$k: QEMU start $T_HSTART ms, READY line $T_HAND ms"
done

median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
mp=$(median "${post_ms[@]}") mhs=$(median "${hstart_ms[@]}") mq=$(median "${qemu_ms[@]}") ml=$(median "${line_ms[@]}") mr=$(median "${ready_ms[@]}") mh=$(median "${hand_ms[@]}")
gaps=(); for k in "${!ready_ms[@]}"; do gaps+=($(( ready_ms[k] - line_ms[k] ))); done
mg=$(median "${gaps[@]}")
ratio=$(awk -v a="$mr" -v b="$mh" 'BEGIN {printf "%.3f", a/b}')
pass() { if awk "BEGIN {exit !($1)}"; then echo ok; else echo MISS; fi; }

echo
echo "eitri create vs hand-run QEMU (N=$N, accel=tcg, 1 vCPU, 256 MiB, cached image)"
printf '%-36s %-24s %10s\n' "measure" "runs (ms)" "median ms"
printf '%-36s %-24s %10s\n' "API call -> CreateVM response" "${post_ms[*]}" "$mp"
printf '%-36s %-24s %10s\n' "API call -> QEMU start" "${qemu_ms[*]}" "$mq"
printf '%-36s %-24s %10s\n' "API call -> guest READY line" "${line_ms[*]}" "$ml"
printf '%-36s %-24s %10s\n' "API call -> GetVM ready + address" "${ready_ms[*]}" "$mr"
printf '%-36s %-24s %10s\n' "  READY line -> GetVM ready (gap)" "${gaps[*]}" "$mg"
printf '%-36s %-24s %10s\n' "hand QEMU exec -> QEMU pid alive" "${hstart_ms[*]}" "$mhs"
printf '%-36s %-24s %10s\n' "hand QEMU exec -> READY line" "${hand_ms[*]}" "$mh"
echo
echo "API -> QEMU start median:  $mq ms   (target < 300 ms: $(pass "$mq < 300"))"
echo "ratio (API -> ready) / (hand -> READY line): $ratio   (target <= 1.1: $(pass "$ratio <= 1.1"))"

# Where the last create's time went, from the agent's and control plane's
# log (debug level), in ms since just before its CreateVM POST.
last=$(( ${#IDS[@]} - 1 ))
echo
echo "timeline of the last create (${IDS[last]}), ms after the POST:"
grep -a -- "${IDS[last]}" "$WORK/dev.log" | grep -av 'msg="dhcp: \(received\|replied\)"' | while IFS= read -r l; do
	ts=${l#time=}; ts=${ts%% *}
	ms=$(date -d "$ts" +%s%3N 2>/dev/null) || continue
	msg=${l#*msg=}
	printf '%8d  %s\n' $(( ms - T0_ABS[last] )) "${msg:0:110}"
done | head -n 40
