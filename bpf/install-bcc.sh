#!/bin/bash
# `make install-bcc`: what --bpf-loader=bcc needs (pyproxy/dataplane/bpf/bcc.py), apart from `make install`:
#  - BCC: Debian's python3-bpfcc (and its libbpfcc, libbcc.so.0, which pyproxy calls; PyPI's `bcc` is another thing);
#  - a kernel headers tree for BCC to compile against. This kernel has none of its own, so Debian's newest
#    linux-headers-6.1.0-N-common and -N-<arch> are unpacked (not installed: their packages pull in gcc and kbuild,
#    which BCC does not use) and merged into one tree at $DEST, where bcc.py looks unless BCC_KERNEL_SOURCE says
#    otherwise. The programs use only uapi types, so headers older than the running kernel serve.
# Idempotent: returns at once when both are there.
set -euo pipefail

DEST=${PYPROXY_BCC_HEADERS:-/usr/local/lib/pyproxy/linux-headers}

apt_ready() {
	[ -n "$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ && $2 != "(none)"')" ] || apt-get update -qq
}

if [ ! -e "/usr/lib/$(uname -m)-linux-gnu/libbcc.so.0" ]; then
	apt_ready python3-bpfcc
	echo "installing Debian's python3-bpfcc (BCC)"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-bpfcc
fi

if [ ! -e "$DEST/include/generated/autoconf.h" ]; then
	arch=$(dpkg --print-architecture)
	apt_ready "linux-headers-$arch"
	# The metapackage names the current ABI's package: linux-headers-6.1.0-N-amd64 (and -common beside it).
	flavour=$(apt-cache depends "linux-headers-$arch" | awk '/Depends: linux-headers-/ {print $2; exit}')
	common=${flavour%-"$arch"}-common
	echo "unpacking $common and $flavour into $DEST"
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	(cd "$tmp" && apt-get download -q "$common" "$flavour" && for deb in ./*.deb; do dpkg -x "$deb" root; done)
	mkdir -p "$tmp/tree" "$(dirname "$DEST")"
	cp -a "$tmp/root/usr/src/$common/." "$tmp/tree/"
	# The flavour's own files (generated headers, .config) over the common tree, as its symlinks would join them.
	cp -a --remove-destination "$tmp/root/usr/src/$flavour/." "$tmp/tree/"
	rm -f "$tmp/tree/scripts" "$tmp/tree/tools"   # links into linux-kbuild, not installed: BCC needs neither
	rm -rf "$DEST"
	mv "$tmp/tree" "$DEST"
fi
