#!/usr/bin/env bash
# Build upstream kube-proxy v1.20.2 once per machine, from the same Debian source package and with the same
# recipe as the lab's kube-apiserver (tests/cluster/kube-build.sh), cached as ~/.cache/pyproxy/kube-proxy-v1.20.2
# ($PYPROXY_CACHE overrides the folder). It is the benchmarks' upstream reference.
#
# Prints the path of the cached binary on its last line.
set -euo pipefail

# shellcheck source=../tests/cluster/kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/cluster/kube-build.sh"
BIN=$(kube_bin kube-proxy)

log() { echo "build-kube-proxy: $*" >&2; }

if kube_cached "$BIN"; then
    echo "$BIN"
    exit 0
fi

log "no cached $BIN: building (about 4 minutes on 2 cores)"
kube_build cmd/kube-proxy
echo "$BIN"
