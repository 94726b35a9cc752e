#!/usr/bin/env bash
# Build every Kubernetes v1.20.2 command a real cluster of the lab runs: the control plane's kube-apiserver,
# kube-controller-manager (EndpointSlices from the real EndpointSlice controller) and kube-scheduler; the nodes'
# kubelet and kube-proxy (the upstream reference); and kubectl. All come from Debian bookworm's `kubernetes`
# source package (tests/cluster/kube-build.sh) and are cached as ~/.cache/pyproxy/<command>-v1.20.2
# ($PYPROXY_CACHE overrides the folder); only the missing ones are built, all from one unpack and one make.
# kubectl is built rather than taken from Debian's kubernetes-client (the same 1.20.2 source): that package
# conflicts with other kubectl packages a machine may carry (this one has Google Cloud SDK's, 1.32), and a
# cached binary copies into the lab's nodes as is. Every binary is static (CGO_ENABLED=0).
#
# Prints the path of each cached binary, one a line.
set -euo pipefail

# shellcheck source=kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/kube-build.sh"

log() { echo "build-kube-binaries: $*" >&2; }

CMDS=(cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kube-proxy cmd/kubectl)

apt_ensure etcd-server

start=$(date +%s)
kube_build "${CMDS[@]}"
log "all cached ($(($(date +%s) - start)) s)"
for c in "${CMDS[@]}"; do
    kube_bin "$c"
done
