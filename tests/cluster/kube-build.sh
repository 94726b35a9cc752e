# shellcheck shell=bash
# Sourced (not run) by the scripts that build commands of Kubernetes v1.20.2 from Debian bookworm's own
# `kubernetes` source package and cache each binary outside the repository as $CACHE/<command>-v1.20.2:
# tests/cluster/build-apiserver.sh (kube-apiserver), tests/cluster/build-kube-binaries.sh (the node and
# control-plane commands) and bench/build-kube-proxy.sh (kube-proxy). Recipe and timings: shared notes,
# real-apiserver.md. The sourcing script defines log() (its own prefix) and sets -euo pipefail.

CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}
VERSION=v1.20.2
GO_VERSION=1.19

# Other work on the machine may hold apt's lock (another build, a VM provisioning): wait for it rather than fail.
APT_OPTS=(-o DPkg::Lock::Timeout=900)

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "$@" >&2
}

# apt_ensure PKG...: install the packages that are missing; nothing (no update, no lock) when all are there.
apt_ensure() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    apt-get "${APT_OPTS[@]}" update -qq >&2
    apt_install "${missing[@]}"
}

# kube_bin CMD: where command CMD (cmd/kube-scheduler or kube-scheduler) is cached.
kube_bin() {
    echo "$CACHE/$(basename "$1")-$VERSION"
}

# kube_version BIN: the binary's version line (kubectl has no --version flag).
kube_version() {
    case $(basename "$1") in
        kubectl-*) "$1" version --client --short ;;
        *) "$1" --version ;;
    esac
}

# kube_cached BIN: the cached binary exists and runs.
kube_cached() {
    [ -x "$1" ] && kube_version "$1" >/dev/null 2>&1
}

# kube_source DIR [MEMBER-PATTERN...]: fetch the kubernetes source package into DIR and unpack it there (only
# the members matching the patterns, if any); prints the source tree's path.
kube_source() {
    local dir=$1
    shift
    # apt-get source needs deb-src entries; add them beside the machine's own sources, same mirrors.
    local src_list=/etc/apt/sources.list.d/pyproxy-deb-src.sources
    if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
        cat > "$src_list" <<'SOURCES'
# Added by pyproxy's tests/cluster/kube-build.sh to fetch the kubernetes source package.
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
        apt-get "${APT_OPTS[@]}" update -qq >&2
    fi
    apt_ensure dpkg-dev
    log "fetching the kubernetes source package into $dir"
    # Callers take the path from a command substitution, where errexit does not reach: fail explicitly.
    (cd "$dir" && apt-get source --download-only kubernetes >&2 &&
        tar -xf kubernetes_*.orig.tar.* ${1:+--wildcards} "$@" >&2) || return 1
    find "$dir" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | grep . || return 1
}

# kube_build CMD...: build the commands (cmd/<name>) whose cached binary is missing, all from one unpack of the
# source package and one `make WHAT="..."` (the unpack, code generation and the shared packages are most of the
# cost), offline with Debian's Go, and install each as $(kube_bin CMD) atomically. The work tree (about 4 GB) is
# removed on return.
kube_build() {
    local missing=() c
    mkdir -p "$CACHE"
    # One build at a time (`make apiserver` and `make kube-binaries` at once would each take 4 GB and both
    # cores): the second waits, then builds only what the first did not.
    exec 8>"$CACHE/.kube-build.lock"
    flock 8
    for c in "$@"; do
        kube_cached "$(kube_bin "$c")" || missing+=("$c")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    apt_ensure rsync make "golang-$GO_VERSION-go" "golang-$GO_VERSION-src" golang-github-modern-go-reflect2-dev

    # A subshell so the work tree's trap and cd stay local to this build.
    (
        WORK=$(mktemp -d "$CACHE/build.XXXXXX")
        trap 'rm -rf "$WORK"' EXIT
        src=$(kube_source "$WORK")
        cd "$src"

        # reflect2 1.0.1 (vendored) crashes on Go >= 1.18; Debian's 1.0.2 is a drop-in replacement.
        rsync -a --delete --exclude go.mod --exclude go.sum \
            /usr/share/gocode/src/github.com/modern-go/reflect2/ vendor/github.com/modern-go/reflect2/

        export GOROOT=/usr/lib/go-$GO_VERSION
        export PATH=$GOROOT/bin:$PATH
        # CGO_ENABLED=0 for every command, kubelet included: Kubernetes' make builds its "static" list (apiserver,
        # controller-manager, scheduler, proxy, kubectl) without cgo and leaves kubelet to the environment, and
        # kubelet 1.20 builds without cgo; a static binary copies into any node (the lab's VMs) as is.
        export GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GOCACHE=$WORK/gocache GOPATH=$WORK/gopath
        log "compiling ${missing[*]} with $(go version)"
        make WHAT="${missing[*]}" KUBE_GIT_VERSION="$VERSION" KUBE_GIT_TREE_STATE=clean >&2
        for c in "${missing[@]}"; do
            bin=$(kube_bin "$c")
            install -m 0755 "_output/bin/$(basename "$c")" "$bin.tmp"
            mv "$bin.tmp" "$bin"
            kube_version "$bin" >&2
        done
    )
}
