# shellcheck shell=bash
# Sourced (not run) by the scripts that build OCI images with no registry, so with no FROM: Debian packages make
# the root filesystem (mmdebstrap) and umoci packs it. deploy/build-image.sh builds pyproxy's own image with it,
# tests/cluster/build-pod-image.sh the lab's echo pod. The sourcing script defines log() and sets -euo pipefail.

OCI_MIRROR=http://deb.debian.org/debian
OCI_SUITE=bookworm

oci_require_tools() {
    local tool
    for tool in mmdebstrap umoci; do
        command -v $tool >/dev/null || { log "$tool is missing: run make install (Debian package $tool)"; exit 1; }
    done
}

# oci_debian_rootfs OUT.tar PACKAGES [MMDEBSTRAP-ARG...]: Debian minbase with PACKAGES (comma-separated) as a
# tarball. The extra arguments (customize hooks, in which "$1" is the root) run before the clean-up of docs, man
# pages and locales, which only cost image size. mmdebstrap itself empties the root's /tmp, apt lists and apt
# cache after the hooks; a hook must not: mmdebstrap keeps its APT_CONFIG file in the root's /tmp, and with that
# file gone its own final `apt-get update` (no sources) and `apt-get clean` act on the HOST's apt, wiping
# /var/lib/apt/lists and /var/cache/apt/archives (seen here with mmdebstrap 1.3.5).
oci_debian_rootfs() {
    local out=$1 packages=$2
    shift 2
    mmdebstrap --variant=minbase --include="$packages" "$@" \
        --customize-hook='rm -rf "$1"/usr/share/doc "$1"/usr/share/man "$1"/usr/share/info "$1"/usr/share/locale' \
        "$OCI_SUITE" "$out" "$OCI_MIRROR" >&2
}

# oci_new LAYOUT TAG LAYER.tar: a new OCI image layout holding one image, TAG, of that one layer.
oci_new() {
    umoci init --layout "$1"
    umoci new --image "$1:$2"
    umoci raw add-layer --image "$1:$2" "$3"
}

# oci_layer_tar DIR OUT.tar: DIR's tree as a layer, every entry owned by root whatever the builder's umask or
# user, with fixed times so an unchanged tree packs alike.
oci_layer_tar() {
    tar --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -C "$1" -cf "$2" .
}

# oci_archive LAYOUT OUT.tar: drop unreferenced blobs and write the layout as one archive, for
# `ctr images import`, `podman load` or `skopeo copy oci-archive:...`.
oci_archive() {
    umoci gc --layout "$1"
    (cd "$1" && tar --numeric-owner -cf "$2" .)
}
