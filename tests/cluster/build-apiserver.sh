#!/usr/bin/env bash
# Build the control plane `make test` runs (kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2)
# once per machine from Debian bookworm's `kubernetes` source package, and install etcd.
#
# No reachable registry ships these binaries, but Debian's source package carries the whole v1.20.2 tree with
# vendor/, which builds offline with Debian's Go 1.19 (recipe and timings: shared notes, real-apiserver.md; the
# steps are shared with the other commands' builds in kube-build.sh). The three come from one unpack and one make
# (the unpack, code generation and shared packages are most of the cost; kube-apiserver alone took about 7
# minutes on 2 cores) and are cached outside the repository so fresh clones and CI runs on the same machine reuse
# them; the build needs about 4 GB of disk. `make kube-binaries` adds the nodes' kubelet, kube-proxy and kubectl.
#
# Prints the path of each cached binary, one a line.
set -euo pipefail

# shellcheck source=kube-build.sh
. "$(dirname "${BASH_SOURCE[0]}")/kube-build.sh"

log() { echo "build-apiserver: $*" >&2; }

CMDS=(cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler)

apt_ensure etcd-server
kube_build "${CMDS[@]}"
for c in "${CMDS[@]}"; do
    kube_bin "$c"
done
