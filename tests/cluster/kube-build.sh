# shellcheck shell=bash
# Sourced (not run) by the scripts that build one command of Kubernetes v1.20.2 from Debian bookworm's own
# `kubernetes` source package and cache the binary outside the repository: tests/cluster/build-apiserver.sh
# (kube-apiserver) and bench/build-kube-proxy.sh (kube-proxy). Recipe and timings: shared notes,
# real-apiserver.md. The sourcing script defines log() (its own prefix) and sets -euo pipefail.

CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}
VERSION=v1.20.2
GO_VERSION=1.19

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

# kube_cached BIN: the cached binary exists and runs.
kube_cached() {
    [ -x "$1" ] && "$1" --version >/dev/null 2>&1
}

# kube_build WHAT BIN: fetch the source package, build `make WHAT=<WHAT>` offline with Debian's Go and install
# the result as BIN (atomically). The work tree (about 4 GB) is removed on exit.
kube_build() {
    local what=$1 bin=$2 src_list=/etc/apt/sources.list.d/pyproxy-deb-src.sources
    mkdir -p "$CACHE"

    # apt-get source needs deb-src entries; add them beside the machine's own sources, same mirrors.
    if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
        cat > "$src_list" <<'SOURCES'
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
SOURCES
    fi
    apt-get update -qq >&2
    apt_install dpkg-dev rsync make "golang-$GO_VERSION-go" "golang-$GO_VERSION-src" golang-github-modern-go-reflect2-dev

    WORK=$(mktemp -d "$CACHE/build.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    cd "$WORK"
    log "fetching the kubernetes source package into $WORK"
    apt-get source --download-only kubernetes >&2
    tar -xf kubernetes_*.orig.tar.* >&2
    local src
    src=$(find . -maxdepth 1 -mindepth 1 -type d | head -n1)
    cd "$src"

    # reflect2 1.0.1 (vendored) crashes on Go >= 1.18; Debian's 1.0.2 is a drop-in replacement.
    local reflect2=/usr/share/gocode/src/github.com/modern-go/reflect2
    rsync -a --delete --exclude go.mod --exclude go.sum "$reflect2/" vendor/github.com/modern-go/reflect2/

    export GOROOT=/usr/lib/go-$GO_VERSION
    export PATH=$GOROOT/bin:$PATH
    export GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GOCACHE=$WORK/gocache GOPATH=$WORK/gopath
    log "compiling with $(go version)"
    make WHAT="$what" KUBE_GIT_VERSION="$VERSION" KUBE_GIT_TREE_STATE=clean >&2
    install -m 0755 "_output/bin/$(basename "$what")" "$bin.tmp"
    mv "$bin.tmp" "$bin"
    "$bin" --version >&2
}
