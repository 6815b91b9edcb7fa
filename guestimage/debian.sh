#!/usr/bin/env bash
# Builds a small Debian bookworm cloud-style disk image from Debian packages:
# the cloud kernel, systemd, cloud-init, OpenSSH, ifupdown + dhclient (what
# cloud-init's network renderer drives on Debian), sudo and growpart. It is
# the "real cloud image" eitri's tests boot (issue 12): cloud-init reads
# eitri's NoCloud seed like it would on any stock image.
#
#   guestimage/debian.sh OUTDIR
#
# Writes OUTDIR/eitri-debian.raw (+ .sha256) and prints its sha256 on stdout
# (progress goes to stderr). A second run with the same inputs (this script
# and the candidate versions of the packages it names) does nothing but print
# it again.
#
# Layout: MBR with syslinux; partition 1 is a small FAT holding the kernel,
# initrd and syslinux.cfg; partition 2, the last, is the ext4 root, so
# cloud-init's growpart can grow it to the VM's disk. Nothing is mounted and
# no loop device is used (mkfs.ext4 -d fills the root filesystem, mtools the
# FAT), so it builds on any Debian machine as root (mmdebstrap's chroot mode).
# The kernel in the FAT partition is the one the image was built with: an
# in-guest kernel upgrade does not change what boots.
#
# Needs (Debian): mmdebstrap syslinux syslinux-common mtools dosfstools fdisk
# e2fsprogs, and apt sources that carry bookworm.
set -euo pipefail

if [[ $# -ne 1 ]]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
outdir=$(cd "$1" && pwd)
raw="$outdir/eitri-debian.raw"
stampfile="$outdir/eitri-debian.stamp"

log() { echo "debian.sh: $*" >&2; }
need() {
	local c
	for c in "$@"; do
		command -v "$c" >/dev/null || { log "missing $c"; exit 1; }
	done
}
need mmdebstrap apt-cache sfdisk mkfs.vfat mkfs.ext4 syslinux mcopy sha256sum flock du
if [[ $(id -u) != 0 ]]; then
	log "needs root (mmdebstrap installs into a chroot)"
	exit 1
fi

suite=bookworm
mirror=${EITRI_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${EITRI_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
mbr_bin=/usr/lib/syslinux/mbr/mbr.bin
[[ -f $mbr_bin ]] || { log "no $mbr_bin (install syslinux-common)"; exit 1; }

# What the guest runs. cloud-init on Debian renders its network config for
# ifupdown; isc-dhcp-client writes the lease's resolvers to resolv.conf.
packages=(
	linux-image-cloud-amd64 systemd-sysv udev dbus libpam-systemd
	cloud-init cloud-guest-utils openssh-server sudo
	ifupdown isc-dhcp-client iproute2 netbase procps
)

# The stamp covers this script and the versions the host's apt would install
# for the named packages and the kernel the metapackage points at (so the
# host's apt lists, like build.sh's, must track bookworm with its updates and
# security suites, as a bookworm machine's do). Dependencies' versions move
# with these in a stable suite; a point release or security update changes
# the kernel or openssh, which rebuilds.
kpkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
	awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
[[ -n $kpkg ]] || { log "cannot find the kernel linux-image-cloud-amd64 depends on (apt-get update?)"; exit 1; }
# One apt-cache call: each loads the whole package cache (seconds).
versions=$(apt-cache policy "${packages[@]}" "$kpkg" |
	awk '/^[^ ].*:$/ { p = substr($0, 1, length($0) - 1) } /^  Candidate:/ { print p, $2 }' | LC_ALL=C sort)

# One build per OUTDIR at a time.
exec 9>"$outdir/.lock-debian"
flock 9

stamp=$(
	{
		sha256sum "$here/debian.sh"
		echo "$suite $mirror $security"
		echo "$versions"
	} | sha256sum | cut -d' ' -f1
)
if [[ -f $raw && -f $raw.sha256 && -f $stampfile && $(cat "$stampfile") == "$stamp" ]]; then
	log "up to date ($kpkg)"
	cut -d' ' -f1 "$raw.sha256"
	exit 0
fi
rm -f "$stampfile"

start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/eitri-debian.XXXXXX")
disk="$outdir/.eitri-debian.raw.tmp"
trap 'rm -rf "$work" "$disk"' EXIT
# apt downloads as _apt, which must reach the chroot under it.
chmod 0755 "$work"
root="$work/root"

epoch=${SOURCE_DATE_EPOCH:-1700000000}
export SOURCE_DATE_EPOCH=$epoch
# Fixed filesystem identities and timestamps where this script chooses them.
# The image is not bit-for-bit reproducible (maintainer scripts, the initrd):
# the stamp, not the image's hash, says whether to rebuild.
root_uuid=5e1f0c2a-7d3b-4c1e-9a6f-0e17a1000002
label=eitri-root

log "mmdebstrap $suite ($kpkg)"
# No documentation, man pages or translations: a third of a minimal system.
# The hooks: root by label; no host keys (cloud-init installs the seed's);
# a system locale, C.UTF-8, which glibc has built in: with none, cloud-init
# sets en_US.UTF-8, whose generation Debian's locale-gen skips (it takes no
# arguments), and warns that update-locale failed.
mmdebstrap --variant=apt --mode=root --format=directory \
	--include="$(
		IFS=,
		echo "${packages[*]}"
	)" \
	--dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/info/*' \
	--dpkgopt='path-exclude=/usr/share/doc/*' \
	--dpkgopt='path-include=/usr/share/doc/*/copyright' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	--dpkgopt='path-include=/usr/share/locale/locale.alias' \
	--dpkgopt='path-exclude=/usr/share/lintian/*' \
	--customize-hook='echo "LABEL='"$label"' / ext4 rw,discard,errors=remount-ro 0 1" >"$1/etc/fstab"' \
	--customize-hook='echo localhost >"$1/etc/hostname"' \
	--customize-hook='rm -f "$1"/etc/ssh/ssh_host_*' \
	--customize-hook='echo LANG=C.UTF-8 >"$1/etc/default/locale"' \
	--customize-hook='printf "%s\n" "# eitri: the seed is always NoCloud; probing other sources only slows boot" "datasource_list: [ NoCloud, None ]" >"$1/etc/cloud/cloud.cfg.d/90-eitri.cfg"' \
	--customize-hook='rm -rf "$1"/var/log/*.log "$1"/var/log/apt/* "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old' \
	"$suite" "$root" \
	"deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main" >&2

installed=$(chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' "${packages[@]}" "$kpkg" 2>/dev/null | LC_ALL=C sort || true)
if [[ $installed != "$versions" ]]; then
	log "the image got other versions than the host's apt lists name (apt-get update?):"
	diff <(echo "$versions") <(echo "$installed") >&2 || true
fi
kvers=("$root"/boot/vmlinuz-*)
[[ ${#kvers[@]} == 1 && -f ${kvers[0]} ]] || { log "want one kernel in the image, found: ${kvers[*]}"; exit 1; }
kver=${kvers[0]#"$root"/boot/vmlinuz-}
[[ -f $root/boot/initrd.img-$kver ]] || { log "no initrd for $kver in the image"; exit 1; }
cp "$root/boot/vmlinuz-$kver" "$work/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$work/initrd.img"
# A fresh machine-id per guest (systemd makes one at first boot).
: >"$root/etc/machine-id"

cat >"$work/syslinux.cfg" <<CFG
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
  LINUX /vmlinuz
  INITRD /initrd.img
  APPEND root=LABEL=$label ro console=ttyS0
CFG
touch -d "@$epoch" "$work/vmlinuz" "$work/initrd.img" "$work/syslinux.cfg"

# Partition 1: FAT with syslinux, sized to its payload plus slack.
payload=$(($(stat -c %s "$work/vmlinuz") + $(stat -c %s "$work/initrd.img")))
boot_mib=$((payload / 1048576 + 8))
boot="$work/boot.img"
truncate -s $((boot_mib << 20)) "$boot"
mkfs.vfat -n EITRIBOOT -i 0e17a101 --invariant "$boot" >/dev/null 2>&1 ||
	mkfs.vfat -n EITRIBOOT -i 0e17a101 "$boot" >/dev/null
syslinux --install "$boot"
export MTOOLS_SKIP_CHECK=1
mcopy -m -i "$boot" "$work/vmlinuz" "$work/initrd.img" "$work/syslinux.cfg" ::/

# Partition 2: the root filesystem, its content plus a quarter and 128 MiB
# free so first boot (logs, host keys, apt) has room before growpart runs.
used_mib=$(($(du -s -B1M --apparent-size "$root" | cut -f1)))
root_mib=$((used_mib + used_mib / 4 + 128))
rootimg="$work/root.img"
truncate -s $((root_mib << 20)) "$rootimg"
find "$root" -exec touch -h -d "@$epoch" {} + 2>/dev/null || true
E2FSPROGS_FAKE_TIME=$epoch mkfs.ext4 -q -L "$label" -U "$root_uuid" \
	-E "hash_seed=$root_uuid,lazy_itable_init=0" -d "$root" "$rootimg"

log "boot ${boot_mib} MiB, root ${root_mib} MiB (${used_mib} MiB used)"
truncate -s $(((1 + boot_mib + root_mib) << 20)) "$disk"
printf 'label: dos\nlabel-id: 0x0e17a101\n2048,%d,c,*\n%d,%d,83\n' \
	$((boot_mib * 2048)) $(((1 + boot_mib) * 2048)) $((root_mib * 2048)) | sfdisk --quiet "$disk" >/dev/null
dd if="$mbr_bin" of="$disk" bs=440 count=1 conv=notrunc status=none
dd if="$boot" of="$disk" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$rootimg" of="$disk" bs=1M seek=$((1 + boot_mib)) conv=notrunc,sparse status=none

mv -f "$disk" "$raw"
(cd "$outdir" && sha256sum "$(basename "$raw")" >"$raw.sha256")
echo "$stamp" >"$stampfile"
echo "$installed" >"$outdir/eitri-debian.packages"

log "raw $(stat -c %s "$raw") bytes ($(du -B1M "$raw" | cut -f1) MiB allocated), built in $(($(date +%s) - start)) s"
cut -d' ' -f1 "$raw.sha256"
