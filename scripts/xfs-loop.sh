#!/usr/bin/env bash
# Loop-mounted test filesystems for the volume tests and benchmarks.
#
#   scripts/xfs-loop.sh up DIR            sparse image + mkfs.xfs -m reflink=1,
#                                         loop device, mounted at DIR; prints DIR
#   scripts/xfs-loop.sh up-noreflink DIR  tmpfs mounted at DIR (cannot reflink);
#                                         prints DIR
#   scripts/xfs-loop.sh down DIR          unmount DIR (also after its XFS was
#                                         shut down), detach its loop device,
#                                         remove its image; says what it did
#
# Idempotent: `up` on a DIR that is already an XFS mount with reflink prints
# DIR and succeeds; `down` on a DIR that is not mounted succeeds.
# Environment: XFS_LOOP_SIZE (default 24G; the image is sparse),
#              XFS_LOOP_IMAGE_DIR (default /var/tmp).
set -euo pipefail

SIZE="${XFS_LOOP_SIZE:-24G}"
IMAGE_DIR="${XFS_LOOP_IMAGE_DIR:-/var/tmp}"

die() {
	echo "xfs-loop: $*" >&2
	exit 1
}

usage() {
	echo "usage: $0 {up|up-noreflink|down} DIR" >&2
	exit 2
}

# The image of DIR: one per mount point, named after its absolute path.
image_for() {
	local key
	key="$(printf '%s' "$1" | sed 's#[^A-Za-z0-9]#_#g')"
	echo "$IMAGE_DIR/pagefork-xfs${key}.img"
}

need_root() {
	[ "$(id -u)" -eq 0 ] || die "must run as root (mount and losetup need it)"
}

ensure_xfsprogs() {
	if command -v mkfs.xfs >/dev/null 2>&1; then
		return
	fi
	echo "xfs-loop: mkfs.xfs missing, installing xfsprogs" >&2
	command -v apt-get >/dev/null 2>&1 || die "mkfs.xfs missing and no apt-get; install xfsprogs"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xfsprogs >&2 ||
		die "apt-get install xfsprogs failed"
	command -v mkfs.xfs >/dev/null 2>&1 || die "xfsprogs installed but mkfs.xfs not found"
}

fstype_of() {
	findmnt -n -o FSTYPE --mountpoint "$1" 2>/dev/null || true
}

cmd_up() {
	local dir="$1"
	need_root
	mkdir -p "$dir" || die "cannot create $dir"
	dir="$(cd "$dir" && pwd -P)"
	case "$(fstype_of "$dir")" in
	xfs)
		if xfs_info "$dir" 2>/dev/null | grep -q 'reflink=1'; then
			echo "$dir"
			return
		fi
		die "$dir is already an XFS mount without reflink; run '$0 down $dir' first"
		;;
	"") ;;
	*) die "$dir is already a $(fstype_of "$dir") mount; run '$0 down $dir' first" ;;
	esac
	ensure_xfsprogs
	grep -qw xfs /proc/filesystems || modprobe xfs 2>/dev/null || true
	grep -qw xfs /proc/filesystems || die "the kernel has no XFS support (modprobe xfs failed)"

	local img loopdev
	img="$(image_for "$dir")"
	mkdir -p "$IMAGE_DIR" || die "cannot create $IMAGE_DIR"
	rm -f "$img"
	truncate -s "$SIZE" "$img" || die "cannot create sparse image $img"
	mkfs.xfs -q -f -m reflink=1 "$img" >&2 || die "mkfs.xfs -m reflink=1 failed on $img"
	loopdev="$(losetup --find --show "$img")" || die "losetup failed (are loop devices available?)"
	# Direct I/O to the backing file: XFS's data is cached once, as on a
	# disk. Buffered, a second copy of every write sat dirty in the backing
	# file's page cache until the host's dirty limits throttled writers at
	# moments no benchmark chose (the same 1 GiB save took 0.5 s or 2.8 s).
	# Best effort: a backing filesystem without O_DIRECT keeps the default.
	losetup --direct-io=on "$loopdev" 2>/dev/null ||
		echo "xfs-loop: $loopdev stays buffered (no direct I/O on $IMAGE_DIR)" >&2
	if ! mount -t xfs "$loopdev" "$dir"; then
		losetup -d "$loopdev" || true
		die "mounting $loopdev at $dir failed"
	fi
	echo "$dir"
}

cmd_up_noreflink() {
	local dir="$1"
	need_root
	mkdir -p "$dir" || die "cannot create $dir"
	dir="$(cd "$dir" && pwd -P)"
	case "$(fstype_of "$dir")" in
	tmpfs)
		echo "$dir"
		return
		;;
	"") ;;
	*) die "$dir is already a $(fstype_of "$dir") mount; run '$0 down $dir' first" ;;
	esac
	mount -t tmpfs -o size=64m tmpfs "$dir" || die "mounting tmpfs at $dir failed"
	echo "$dir"
}

# DIR as an absolute path with its parent's symlinks resolved, without
# touching DIR itself: the root of a shut-down XFS answers EIO to every
# stat (so `[ -d DIR ]` and `cd DIR` fail), and `down` must still work.
mount_path() {
	local dir="$1" parent base
	case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
	while [ "${#dir}" -gt 1 ] && [ "${dir%/}" != "$dir" ]; do
		dir="${dir%/}"
	done
	if [ -L "$dir" ]; then
		# A link to the mount point: resolve it (readlink does not stat
		# the target's root).
		dir="$(readlink -f "$dir")" || die "cannot resolve $1"
	fi
	parent="$(dirname "$dir")"
	base="$(basename "$dir")"
	if parent="$(cd "$parent" 2>/dev/null && pwd -P)"; then
		dir="${parent%/}/$base"
	fi
	echo "$dir"
}

# Wait until no loop device is bound to image $1. Detaching a device that
# something still has open (udev probing it right after the unmount) only
# marks it to go when the last user closes it.
wait_detached() {
	local i
	for i in $(seq 100); do
		[ -n "$(losetup -j "$1" -O NAME -n 2>/dev/null)" ] || return 0
		sleep 0.1
	done
	return 1
}

cmd_down() {
	local dir img
	need_root
	dir="$(mount_path "$1")"
	img="$(image_for "$dir")"
	local src fstype
	fstype="$(fstype_of "$dir")"
	if [ -n "$fstype" ]; then
		src="$(findmnt -n -o SOURCE --mountpoint "$dir")"
		if ! stat "$dir" >/dev/null 2>&1; then
			echo "xfs-loop: $dir cannot be read (a shut-down or failing filesystem); unmounting it anyway"
		fi
		umount "$dir" || die "cannot unmount $dir (busy? see 'fuser -m $dir')"
		echo "xfs-loop: unmounted $dir"
		case "$src" in
		/dev/loop*)
			losetup -d "$src" 2>/dev/null || true
			;;
		esac
	elif [ ! -e "$dir" ]; then
		return 0
	fi
	# Detach any loop device still bound to our image, then drop the image.
	local dev
	if [ -e "$img" ]; then
		for dev in $(losetup -j "$img" -O NAME -n 2>/dev/null); do
			losetup -d "$dev" || die "cannot detach $dev from $img"
		done
		wait_detached "$img" || die "the loop device of $img is still busy after 10 s"
		case "${src:-}" in
		/dev/loop*) echo "xfs-loop: detached $src" ;;
		esac
		rm -f "$img"
		echo "xfs-loop: removed $img"
	fi
}

[ $# -eq 2 ] || usage
case "$1" in
up) cmd_up "$2" ;;
up-noreflink) cmd_up_noreflink "$2" ;;
down) cmd_down "$2" ;;
*) usage ;;
esac
