#!/usr/bin/env bash
# Install what building and testing pagefork needs on a fresh Debian machine:
# libclang (userfaultfd-sys runs bindgen at build time), xfsprogs (the
# reflink volume tests use a loop-mounted XFS), prometheus (its promtool
# checks /metrics), qemu-utils (qemu-img and qemu-io: the oracle of the qcow2
# tests), tmux (a real terminal for the `uffdctl top` test), Ceph
# (ceph-mon, ceph-mgr, ceph-osd, radosgw: the S3 store scripts/ceph.sh
# boots for the remote-snapshot tests) with s3cmd, and schemathesis from PyPI
# in a venv (the API-schema test; PAGEFORK_VENV, default
# /var/tmp/pagefork-venv). Idempotent; root needed only when a Debian
# package is missing.
set -euo pipefail

missing=()
dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
command -v mkfs.xfs >/dev/null 2>&1 || missing+=(xfsprogs)
command -v losetup >/dev/null 2>&1 || missing+=(mount)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus) # promtool checks /metrics
command -v qemu-img >/dev/null 2>&1 && command -v qemu-io >/dev/null 2>&1 || missing+=(qemu-utils) # qcow2 differential tests
command -v tmux >/dev/null 2>&1 || missing+=(tmux)             # the terminal of the `uffdctl top` test
command -v curl >/dev/null 2>&1 || missing+=(curl)             # scripts/ceph.sh waits on RGW with it
for tool in ceph-mon ceph-mgr ceph-osd radosgw s3cmd; do        # scripts/ceph.sh: the S3 store
	command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done

if [ "${#missing[@]}" -gt 0 ]; then
	echo "setup: installing ${missing[*]}" >&2
	if [ "$(id -u)" -ne 0 ]; then
		echo "setup: need root to install ${missing[*]} (run as root or install them yourself)" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq "${missing[@]}" >/dev/null
fi

VENV="${PAGEFORK_VENV:-/var/tmp/pagefork-venv}"
SCHEMATHESIS_VERSION=4.32.5
if ! "$VENV/bin/schemathesis" --version 2>/dev/null | grep -q "$SCHEMATHESIS_VERSION"; then
	echo "setup: installing schemathesis $SCHEMATHESIS_VERSION into $VENV" >&2
	if ! python3 -m venv "$VENV" 2>/dev/null; then
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
		python3 -m venv "$VENV"
	fi
	"$VENV/bin/pip" install -q --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

# 2 MiB huge pages for hugepage guest RAM (`--hugepages`, the hugepage
# tests): raise the reservation to PAGEFORK_HUGEPAGES_RESERVE, never lower it.
HUGEPAGES_WANT="${PAGEFORK_HUGEPAGES_RESERVE:-1024}"
HUGEPAGES_NOW="$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)"
if [ "$HUGEPAGES_NOW" -lt "$HUGEPAGES_WANT" ]; then
	if [ "$(id -u)" -eq 0 ]; then
		echo "$HUGEPAGES_WANT" >/proc/sys/vm/nr_hugepages || true
		echo "setup: $(cat /proc/sys/vm/nr_hugepages) huge pages of 2 MiB reserved (wanted $HUGEPAGES_WANT)" >&2
	else
		echo "setup: only $HUGEPAGES_NOW huge pages reserved; as root: echo $HUGEPAGES_WANT > /proc/sys/vm/nr_hugepages" >&2
	fi
fi

command -v cargo >/dev/null 2>&1 || {
	echo "setup: cargo not found; install a Rust toolchain (rustup) first" >&2
	exit 1
}
echo "setup: ok" >&2
