#!/usr/bin/env bash
# Install what building and testing pagefork needs on a fresh Debian machine:
# libclang (userfaultfd-sys runs bindgen at build time) and xfsprogs (the
# reflink volume tests use a loop-mounted XFS). Idempotent; root needed only
# when something is missing.
set -euo pipefail

missing=()
dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
command -v mkfs.xfs >/dev/null 2>&1 || missing+=(xfsprogs)
command -v losetup >/dev/null 2>&1 || missing+=(mount)

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

command -v cargo >/dev/null 2>&1 || {
	echo "setup: cargo not found; install a Rust toolchain (rustup) first" >&2
	exit 1
}
echo "setup: ok" >&2
