#!/bin/bash
# Upstream kube-proxy v1.20.2's image for the lab's reference run (vagrant/manifests/kube-proxy.yaml): pyproxy's
# own base layer (deploy/build-image.sh: Debian bookworm with iptables, ipset, conntrack, kmod) plus the static
# binary `make kube-proxy` builds from Debian's source. Upstream's image is Debian-based too and carries the same
# tools; the binary is the one the benchmarks measure. No registry: an OCI archive for `ctr images import`.
# Prints the archive's path; rebuilt only when the base or the binary is newer.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "kube-proxy-image: $*" >&2; }
# shellcheck source=deploy/oci.sh
. "$REPO/deploy/oci.sh"
CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}
TAG=v1.20.2
BIN=$CACHE/kube-proxy-$TAG
OUT=$CACHE/vagrant/kube-proxy-$TAG.oci.tar
mapfile -t bases < <(find "$CACHE/image" -maxdepth 1 -name 'base-*' -type d)
[ ${#bases[@]} = 1 ] || { log "want exactly one pyproxy base in $CACHE/image (make image), found ${#bases[@]}"; exit 1; }
BASE=${bases[0]}
[ -x "$BIN" ] || { log "$BIN is missing: make kube-proxy"; exit 1; }
if [ -s "$OUT" ] && [ "$OUT" -nt "$BIN" ] && [ "$OUT" -nt "$BASE/index.json" ]; then echo "$OUT"; exit 0; fi
oci_require_tools
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -a "$BASE" "$WORK/oci"
umoci tag --image "$WORK/oci:base" "$TAG"
umoci rm --image "$WORK/oci:base"
install -D -m 0755 "$BIN" "$WORK/layer/usr/local/bin/kube-proxy"
oci_layer_tar "$WORK/layer" "$WORK/layer.tar"
umoci raw add-layer --image "$WORK/oci:$TAG" "$WORK/layer.tar"
umoci config --image "$WORK/oci:$TAG" --config.entrypoint=/usr/local/bin/kube-proxy \
    --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --author=pyproxy-lab --architecture=amd64 --os=linux --config.label=org.opencontainers.image.title=kube-proxy
mkdir -p "$(dirname "$OUT")"
oci_archive "$WORK/oci" "$WORK/image.tar"
mv "$WORK/image.tar" "$OUT"
log "built $OUT ($(du -m "$OUT" | cut -f1) MB)"
echo "$OUT"
