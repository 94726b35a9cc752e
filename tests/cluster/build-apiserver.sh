#!/usr/bin/env bash
# Build kube-apiserver once per machine from Debian bookworm's `kubernetes` source package, and install etcd.
#
# No reachable registry ships a kube-apiserver binary, but Debian's source package carries the whole v1.20.2
# tree with vendor/, which builds offline with Debian's Go 1.19 (recipe and timings: shared notes,
# real-apiserver.md; the steps are shared with the other commands' builds in kube-build.sh). The binary is cached
# outside the repository so fresh clones and CI runs on the same machine reuse it; the build takes about
# 7 minutes on 2 cores and needs about 4 GB of disk.
#
# Prints the path of the cached binary on its last line.
set -euo pipefail

# shellcheck source=kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/kube-build.sh"
BIN=$(kube_bin kube-apiserver)

log() { echo "build-apiserver: $*" >&2; }

apt_ensure etcd-server

if kube_cached "$BIN"; then
    echo "$BIN"
    exit 0
fi

log "no cached $BIN: building (about 7 minutes on 2 cores)"
kube_build cmd/kube-apiserver
echo "$BIN"
