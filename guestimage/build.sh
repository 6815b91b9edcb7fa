#!/usr/bin/env bash
# Builds eitri's test guest: a raw disk (MBR + one bootable FAT partition
# holding syslinux, Debian's kernel and an initramfs whose /init is
# guestinit) and, when qemu-img exists, a compressed qcow2 of it.
#
#   guestimage/build.sh OUTDIR
#
# Prints the raw image's sha256 on stdout (progress goes to stderr). A second
# run with the same inputs (this script, guestinit's sources, the kernel,
# busybox and syslinux package versions) does nothing but print it again.
#
# Needs (Debian): busybox-static syslinux syslinux-common mtools dosfstools
# fdisk cpio kmod, Go, and apt sources that carry linux-image-amd64.
# The kernel package is downloaded and unpacked, never installed.
set -euo pipefail

if [[ $# -ne 1 ]]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
outdir=$(cd "$1" && pwd)
raw="$outdir/eitri-guest.raw"
qcow="$outdir/eitri-guest.qcow2"
stampfile="$outdir/eitri-guest.stamp"

log() { echo "build.sh: $*" >&2; }
need() {
	local c
	for c in "$@"; do
		command -v "$c" >/dev/null || { log "missing $c"; exit 1; }
	done
}
need apt-cache apt-get dpkg-query dpkg-deb depmod sfdisk mkfs.vfat syslinux mcopy cpio gzip go sha256sum flock

busybox_bin=/bin/busybox
mbr_bin=/usr/lib/syslinux/mbr/mbr.bin
[[ -x $busybox_bin ]] || { log "no $busybox_bin (install busybox-static)"; exit 1; }
[[ -f $mbr_bin ]] || { log "no $mbr_bin (install syslinux-common)"; exit 1; }
# The initramfs has no libc: a dynamic busybox would not start.
if ldd "$busybox_bin" >/dev/null 2>&1; then
	log "$busybox_bin is dynamically linked (install busybox-static)"
	exit 1
fi

# The kernel flavour linux-image-amd64 points at, unless pinned by the caller.
kpkg=${EITRI_KERNEL_PACKAGE:-$(apt-cache depends linux-image-amd64 2>/dev/null |
	awk '/Depends: linux-image-[0-9]/ { print $2; exit }')}
[[ -n $kpkg ]] || { log "cannot find the kernel linux-image-amd64 depends on (apt-get update?)"; exit 1; }
kver=${kpkg#linux-image-}
kpkgver=$(apt-cache policy "$kpkg" | awk '/Candidate:/ { print $2 }')

# One build per OUTDIR at a time: parallel test packages may all ask for it.
exec 9>"$outdir/.lock"
flock 9

stamp=$(
	{
		sha256sum "$here/build.sh"
		(cd "$here/guestinit" && find . -type f -name '*.go' ! -name '*_test.go' | LC_ALL=C sort | xargs sha256sum)
		# The module versions guestinit links (x/sys...), not all of go.sum.
		(cd "$here/guestinit" && go list -deps -f '{{with .Module}}{{.Path}}@{{.Version}}{{end}}' . | LC_ALL=C sort -u)
		echo "kernel $kpkg $kpkgver"
		echo "busybox $(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null || sha256sum <"$busybox_bin")"
		echo "syslinux $(dpkg-query -W -f='${Version}' syslinux 2>/dev/null || true)"
		go version
	} | sha256sum | cut -d' ' -f1
)

if [[ -f $raw && -f $raw.sha256 && -f $stampfile && $(cat "$stampfile") == "$stamp" ]]; then
	log "up to date ($kpkg)"
	cut -d' ' -f1 "$raw.sha256"
	exit 0
fi
rm -f "$stampfile"

work=$(mktemp -d "${TMPDIR:-/tmp}/eitri-guest.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Everything copied into the image gets one fixed timestamp, so rebuilding the
# same inputs gives the same bytes.
epoch=${SOURCE_DATE_EPOCH:-1700000000}
# mtools (and so syslinux --install, which drives it) stamps new FAT entries
# with this instead of the clock.
export SOURCE_DATE_EPOCH=$epoch

# The kernel package is ~70 MB: keep it beside the outputs so a rebuild for a
# changed init does not fetch it again.
debcache="$outdir/.cache"
mkdir -p "$debcache"
deb=$(ls "$debcache/${kpkg}_${kpkgver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true)
if [[ -z $deb ]]; then
	log "downloading $kpkg $kpkgver"
	rm -f "$debcache"/*.deb
	(cd "$debcache" && apt-get download "$kpkg=$kpkgver" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
	deb=$(ls "$debcache/${kpkg}_"*.deb 2>/dev/null | head -n1 || true)
	[[ -n $deb ]] || { log "apt-get download $kpkg failed"; exit 1; }
fi
log "kernel $(basename "$deb")"
dpkg-deb -x "$deb" "$work/kroot"
moddir="$work/kroot/lib/modules/$kver"
# The package ships no modules.dep (postinst runs depmod); make one here.
depmod -b "$work/kroot" "$kver"

# Drivers the guest needs, resolved to files with their dependencies first:
# virtio disks and NIC, iso9660 for the seed, SATA CD-ROM for a seed attached
# as a cdrom, and the ACPI button plus evdev so the power button reaches init.
wanted=(virtio_pci virtio_blk virtio_net isofs ahci sr_mod button evdev)
declare -A deps=() done=()
order=()
while IFS= read -r line; do
	mod=${line%%:*}
	name=${mod##*/}
	name=${name%%.ko*}
	deps[$name]="$mod:${line#*:}"
done <"$moddir/modules.dep"
resolve() {
	local name=$1 entry path d dn
	[[ -n ${done[$name]:-} ]] && return 0
	entry=${deps[$name]:-}
	if [[ -z $entry ]]; then
		if grep -q "/$name\.ko" "$moddir/modules.builtin"; then
			done[$name]=builtin
			return 0
		fi
		log "kernel $kver has no module $name"
		exit 1
	fi
	path=${entry%%:*}
	for d in ${entry#*:}; do
		dn=${d##*/}
		resolve "${dn%%.ko*}"
	done
	done[$name]=1
	order+=("$path")
}
for m in "${wanted[@]}"; do resolve "$m"; done

root="$work/initramfs"
mkdir -p "$root"/{bin,dev,etc,proc,sys,run,tmp,lib/modules}
for p in "${order[@]}"; do
	dst="$root/lib/modules/$(basename "$p")"
	case $p in
	*.ko) cp "$moddir/$p" "$dst" ;;
	*.ko.xz) xz -dc "$moddir/$p" >"${dst%.xz}" ;;
	*.ko.zst) zstd -qdc "$moddir/$p" >"${dst%.zst}" ;;
	*) log "unknown module format $p"; exit 1 ;;
	esac
done
for p in "${order[@]}"; do b=${p##*/}; echo "${b%.ko*}.ko"; done >"$root/lib/modules/order"
log "modules: $(tr '\n' ' ' <"$root/lib/modules/order")"

cp "$busybox_bin" "$root/bin/busybox"
for a in sh ip udhcpc ls cat mount umount dmesg ps; do ln -s busybox "$root/bin/$a"; done

cat >"$root/etc/udhcpc.script" <<'SCRIPT'
#!/bin/sh
# busybox udhcpc hook: apply the lease to $interface.
case "$1" in
deconfig)
	ip -4 addr flush dev "$interface"
	ip link set "$interface" up
	;;
bound|renew)
	ip addr replace "$ip/${mask:-24}" ${broadcast:+broadcast "$broadcast"} dev "$interface"
	for r in $router; do
		ip route replace default via "$r" dev "$interface"
		break
	done
	: >/etc/resolv.conf
	for d in $dns; do echo "nameserver $d" >>/etc/resolv.conf; done
	;;
esac
exit 0
SCRIPT
chmod 0755 "$root/etc/udhcpc.script"
echo "root:x:0:0:root:/:/bin/sh" >"$root/etc/passwd"

log "building guestinit"
(cd "$here/guestinit" && CGO_ENABLED=0 GOOS=linux GOARCH=amd64 \
	go build -trimpath -ldflags='-s -w -buildid=' -o "$root/init" .)

find "$root" -exec touch -h -d "@$epoch" {} +
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
	cpio --quiet -o -H newc -R 0:0 --reproducible) | gzip -9 -n >"$work/initrd.img"
cp "$work/kroot/boot/vmlinuz-$kver" "$work/vmlinuz"

cat >"$work/syslinux.cfg" <<'CFG'
DEFAULT eitri
PROMPT 0
TIMEOUT 0
LABEL eitri
  LINUX /vmlinuz
  INITRD /initrd.img
  APPEND console=ttyS0 quiet panic=1
CFG
touch -d "@$epoch" "$work/vmlinuz" "$work/initrd.img" "$work/syslinux.cfg"

# One FAT partition starting at 1 MiB, sized to its payload plus room for
# the filesystem and syslinux.
payload=$(($(stat -c %s "$work/vmlinuz") + $(stat -c %s "$work/initrd.img")))
part_mib=$((payload / 1048576 + 4))
part_sectors=$((part_mib * 2048))
disk_sectors=$((2048 + part_sectors))

log "partition ${part_mib} MiB"
part="$work/part.img"
truncate -s $((part_sectors * 512)) "$part"
mkfs.vfat -n EITRI -i 0e17a100 --invariant "$part" >/dev/null 2>&1 ||
	mkfs.vfat -n EITRI -i 0e17a100 "$part" >/dev/null
syslinux --install "$part"
export MTOOLS_SKIP_CHECK=1
mcopy -m -i "$part" "$work/vmlinuz" "$work/initrd.img" "$work/syslinux.cfg" ::/

# Assembled beside the output, so the final rename is atomic.
disk="$outdir/.eitri-guest.raw.tmp"
trap 'rm -rf "$work" "$disk" "$qcow.tmp"' EXIT
truncate -s $((disk_sectors * 512)) "$disk"
printf 'label: dos\nlabel-id: 0x0e17a100\n2048,%d,c,*\n' "$part_sectors" | sfdisk --quiet "$disk" >/dev/null
dd if="$mbr_bin" of="$disk" bs=440 count=1 conv=notrunc status=none
dd if="$part" of="$disk" bs=1M seek=1 conv=notrunc status=none

mv -f "$disk" "$raw"
(cd "$outdir" && sha256sum "$(basename "$raw")" >"$raw.sha256")
if command -v qemu-img >/dev/null; then
	qemu-img convert -c -O qcow2 -f raw "$raw" "$qcow.tmp"
	mv -f "$qcow.tmp" "$qcow"
	(cd "$outdir" && sha256sum "$(basename "$qcow")" >"$qcow.sha256")
else
	rm -f "$qcow" "$qcow.sha256"
	log "qemu-img not found; no qcow2"
fi
echo "$stamp" >"$stampfile"

log "raw $(stat -c %s "$raw") bytes$([[ -f $qcow ]] && echo ", qcow2 $(stat -c %s "$qcow") bytes")"
cut -d' ' -f1 "$raw.sha256"
