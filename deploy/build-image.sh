#!/usr/bin/env bash
# pyproxy's container image, built with no registry: there is no FROM. Debian packages make the root filesystem
# (mmdebstrap), PyPI the Python dependencies, and umoci packs it as an OCI image layout (the steps shared with the
# lab's pod image are in deploy/oci.sh). `make image` runs this.
#
# Two layers, so a change to pyproxy repacks only its own:
#   base     Debian bookworm minbase, the tools pyproxy drives (iproute2, iptables, nftables, ipset, conntrack,
#            kmod) and libbpf1, and a venv in /opt/pyproxy with pyproxy's dependencies from pyproject.toml.
#            Takes minutes; cached as a one-layer OCI layout in ${PYPROXY_CACHE:-~/.cache/pyproxy}/image/base-KEY,
#            KEY hashing everything that decides its content (this script's build_base, its package lists, the
#            dependencies), so it is rebuilt only when one of them changes.
#   pyproxy  the wheel built from this tree, and bpf/build/pyproxy.bpf.o and sockdestroy.bpf.o (`make bpf`).
#
# Output: deploy/build/oci (an OCI image layout, tag $VERSION) and deploy/build/pyproxy-$VERSION.oci.tar (the
# same layout as one archive, for `ctr images import`, `podman load` or `skopeo copy oci-archive:...`).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=oci.sh
. "$REPO/deploy/oci.sh"
CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}/image
OUT=$REPO/deploy/build
PY=${PY:-$REPO/.venv/bin/python}
PYVER=3.11  # bookworm's python3; the pyproxy layer's site-packages path depends on it
VENV=/opt/pyproxy
ROOT_PKGS=python3,python3-venv,libbpf1,iproute2,iptables,nftables,ipset,conntrack,kmod
BPF_OBJ=$REPO/bpf/build/pyproxy.bpf.o
DESTROY_OBJ=$REPO/bpf/build/sockdestroy.bpf.o

log() { echo "build-image: $*" >&2; }

# pyproject.toml's runtime dependencies, one per line: the base's venv holds exactly these.
DEPS=$("$PY" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
       "$REPO/pyproject.toml")
VERSION=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
          "$REPO/pyproject.toml")

build_base() {  # $1: a work directory; leaves a one-layer OCI layout in $1/oci (tag base)
    local work=$1
    printf '%s\n' "$DEPS" > "$work/requirements.txt"
    # pip inside the chroot trusts the host's CA bundle: a machine whose traffic passes a TLS-inspecting proxy
    # has that proxy's CA only there. pip itself only costs image size.
    oci_debian_rootfs "$work/base.tar" "$ROOT_PKGS" \
        --customize-hook="chroot \"\$1\" python3 -m venv $VENV" \
        --customize-hook="cp /etc/ssl/certs/ca-certificates.crt \"\$1/tmp/host-ca.crt\"" \
        --customize-hook="cp \"$work/requirements.txt\" \"\$1/tmp/requirements.txt\"" \
        --customize-hook="chroot \"\$1\" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root PIP_CERT=/tmp/host-ca.crt $VENV/bin/pip install -q --no-cache-dir --disable-pip-version-check -r /tmp/requirements.txt" \
        --customize-hook="chroot \"\$1\" $VENV/bin/python -m pip uninstall -q -y pip setuptools"
    oci_new "$work/oci" base "$work/base.tar"
    rm -f "$work/base.tar"
}

BASE_KEY=$( { declare -f build_base oci_debian_rootfs oci_new; echo "$OCI_SUITE $OCI_MIRROR $ROOT_PKGS $VENV"; echo "$DEPS"; } |
           sha256sum | cut -c1-16)
BASE=$CACHE/base-$BASE_KEY

oci_require_tools
[ -s "$BPF_OBJ" ] || { log "$BPF_OBJ is missing: run make bpf"; exit 1; }
[ -s "$DESTROY_OBJ" ] || { log "$DESTROY_OBJ is missing: run make bpf"; exit 1; }

mkdir -p "$CACHE"
# Two builds at once would spend the base's minute twice and clash on deploy/build: the second waits, then finds
# the base built.
exec 9>"$CACHE/.build.lock"
flock 9
START=$(date +%s)
if [ ! -f "$BASE/index.json" ]; then
    log "base $BASE_KEY: mmdebstrap $OCI_SUITE with $ROOT_PKGS and $(echo "$DEPS" | wc -l) Python dependencies"
    WORK=$(mktemp -d "$CACHE/build.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    build_base "$WORK"
    mv "$WORK/oci" "$BASE"
    rm -rf "$WORK"
    trap - EXIT
    # Older bases are keyed by inputs that no longer exist: keep only this one.
    find "$CACHE" -maxdepth 1 -name 'base-*' ! -name "base-$BASE_KEY" -exec rm -rf {} +
    log "base built in $(( $(date +%s) - START )) s"
fi

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
# Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds. Its warnings only on failure.
mkdir -p "$STAGE/src"
cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/pyproxy" "$STAGE/src/"
find "$STAGE/src" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps --disable-pip-version-check -w "$STAGE/wheel" "$STAGE/src" > "$STAGE/wheel.log" 2>&1 ||
    { cat "$STAGE/wheel.log" >&2; exit 1; }
L=$STAGE/layer
SITE=$L$VENV/lib/python$PYVER/site-packages
"$PY" -m pip install -q --no-deps --no-compile --disable-pip-version-check --target "$SITE" "$STAGE"/wheel/pyproxy-*.whl >&2
rm -rf "$SITE/bin"  # console scripts with this machine's interpreter in their #! line
mkdir -p "$L/usr/local/bin" "$L/usr/lib/pyproxy"
cat > "$L/usr/local/bin/pyproxy" <<PYEOF
#!$VENV/bin/python3
import sys

from pyproxy.cli import main

sys.exit(main())
PYEOF
chmod 0755 "$L/usr/local/bin/pyproxy"
install -m 0644 "$BPF_OBJ" "$L/usr/lib/pyproxy/pyproxy.bpf.o"
install -m 0644 "$DESTROY_OBJ" "$L/usr/lib/pyproxy/sockdestroy.bpf.o"
oci_layer_tar "$L" "$STAGE/layer.tar"

rm -rf "$OUT/oci"
mkdir -p "$OUT"
cp -a "$BASE" "$OUT/oci"
IMG=$OUT/oci:$VERSION
umoci tag --image "$OUT/oci:base" "$VERSION"
umoci rm --image "$OUT/oci:base"
umoci raw add-layer --image "$IMG" "$STAGE/layer.tar"
umoci config --image "$IMG" \
    --config.entrypoint=/usr/local/bin/pyproxy --config.cmd=--help \
    --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.env=LANG=C.UTF-8 \
    --config.env=PYPROXY_BPF_OBJECT=/usr/lib/pyproxy/pyproxy.bpf.o \
    --author=pyproxy --architecture=amd64 --os=linux \
    --config.label=org.opencontainers.image.title=pyproxy \
    --config.label=org.opencontainers.image.version="$VERSION"
oci_archive "$OUT/oci" "$OUT/pyproxy-$VERSION.oci.tar"
log "image pyproxy:$VERSION in $OUT/oci ($(du -sm "$OUT/oci" | cut -f1) MB compressed) in $(( $(date +%s) - START )) s"
echo "$OUT/oci:$VERSION"
