#!/usr/bin/env bash
# Build kube-apiserver once per machine from Debian bookworm's `kubernetes` source package, and install etcd.
#
# No reachable registry ships a kube-apiserver binary, but Debian's source package carries the whole v1.20.2
# tree with vendor/, which builds offline with Debian's Go 1.19 (recipe and timings: shared notes,
# real-apiserver.md). The binary is cached outside the repository so fresh clones and CI runs on the same
# machine reuse it; the build takes about 7 minutes on 2 cores and needs about 4 GB of disk.
#
# Prints the path of the cached binary on its last line.
set -euo pipefail

CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}
VERSION=v1.20.2
BIN=$CACHE/kube-apiserver-$VERSION
GO_VERSION=1.19

log() { echo "build-apiserver: $*" >&2; }

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

if ! command -v etcd >/dev/null; then
    log "installing etcd-server"
    apt-get update -qq >&2
    apt_install etcd-server
fi

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

log "no cached $BIN: building (about 7 minutes on 2 cores)"
mkdir -p "$CACHE"

# apt-get source needs deb-src entries; add them beside the machine's own sources, same mirrors.
SRC_LIST=/etc/apt/sources.list.d/pyproxy-deb-src.sources
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
    cat > "$SRC_LIST" <<'EOF'
# Added by pyproxy's tests/cluster/build-apiserver.sh to fetch the kubernetes source package.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
apt-get update -qq >&2
apt_install dpkg-dev rsync make "golang-$GO_VERSION-go" "golang-$GO_VERSION-src" golang-github-modern-go-reflect2-dev

WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
log "fetching the kubernetes source package into $WORK"
apt-get source --download-only kubernetes >&2
tar -xf kubernetes_*.orig.tar.* >&2
SRC=$(find . -maxdepth 1 -mindepth 1 -type d | head -n1)
cd "$SRC"

# reflect2 1.0.1 (vendored) crashes on Go >= 1.18; Debian's 1.0.2 is a drop-in replacement.
REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
rsync -a --delete --exclude go.mod --exclude go.sum "$REFLECT2/" vendor/github.com/modern-go/reflect2/

export GOROOT=/usr/lib/go-$GO_VERSION
export PATH=$GOROOT/bin:$PATH
export GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GOCACHE=$WORK/gocache GOPATH=$WORK/gopath
log "compiling with $(go version)"
make WHAT=cmd/kube-apiserver KUBE_GIT_VERSION=$VERSION KUBE_GIT_TREE_STATE=clean >&2
install -m 0755 _output/bin/kube-apiserver "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2
echo "$BIN"
