#!/usr/bin/env bash
# The lab's pod images, built with no registry, as pyproxy's own image is (deploy/oci.sh):
#
#   echo   Debian bookworm minbase with python3, and the lab's traffic tool (tests/labkit/traffic.py, stdlib
#          only) as /usr/local/bin/traffic. Its entrypoint, echo-server, answers every TCP connection, HTTP GET
#          and UDP datagram on 8080/tcp and 5353/udp (arguments replace those: `--tcp 80,8080 --udp 53`) with one
#          line, `POD:PORT CLIENT_IP:CLIENT_PORT`: the pod's name (its hostname, or $POD_NAME), the port the
#          request reached and the client address the pod saw. The same image is the lab's client:
#              kubectl exec POD -- traffic probe --tcp 10.96.0.10 80 --count 20
#   pause  the pod sandbox image containerd's CRI needs for every pod (its default, registry.k8s.io/pause, cannot
#          be pulled here): Kubernetes' own pause.c from the same Debian source package as the binaries
#          (tests/cluster/kube-build.sh), linked statically with Debian's gcc; tag from that source (3.4).
#          Point containerd at it: [plugins."io.containerd.grpc.v1.cri"] sandbox_image = "localhost/pause:3.4".
#
# Cached in ${PYPROXY_CACHE:-~/.cache/pyproxy}/pod-image/ as NAME-KEY.oci.tar, KEY hashing everything that
# decides the image (this script, deploy/oci.sh's steps, traffic.py), so each is rebuilt only when one of them
# changes (about a minute or two); NAME.oci.tar links to the current one. On a node:
#     ctr -n k8s.io images import --base-name localhost/pyproxy-echo echo.oci.tar     # localhost/pyproxy-echo:1
#     ctr -n k8s.io images import --base-name localhost/pause pause.oci.tar           # localhost/pause:3.4
# and pods name `image: localhost/pyproxy-echo:1` with `imagePullPolicy: Never` (no registry to pull from).
#
# Prints the two archives' paths, echo's then pause's.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=../../deploy/oci.sh
. "$REPO/deploy/oci.sh"
# shellcheck source=kube-build.sh
. "$REPO/tests/cluster/kube-build.sh"
OUT=$CACHE/pod-image
TRAFFIC=$REPO/tests/labkit/traffic.py
ECHO_TAG=1

log() { echo "build-pod-image: $*" >&2; }

build_echo() {  # $1: a work directory; leaves the image in $1/oci
    local work=$1
    install -m 0755 "$TRAFFIC" "$work/traffic"
    sed -i '1i #!/usr/bin/python3' "$work/traffic"
    cat > "$work/echo-server" <<'SH'
#!/bin/sh
# Every reply names the pod: its hostname (Kubernetes sets it to the pod's name) unless POD_NAME says otherwise.
[ $# -gt 0 ] || set -- --tcp 8080 --udp 5353
exec /usr/local/bin/traffic serve --name "${POD_NAME:-$(cat /proc/sys/kernel/hostname)}" "$@"
SH
    chmod 0755 "$work/echo-server"
    oci_debian_rootfs "$work/rootfs.tar" python3 \
        --customize-hook="install -m 0755 \"$work/traffic\" \"$work/echo-server\" \"\$1/usr/local/bin/\""
    oci_new "$work/oci" "$ECHO_TAG" "$work/rootfs.tar"
    umoci config --image "$work/oci:$ECHO_TAG" \
        --config.entrypoint=/usr/local/bin/echo-server \
        --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --config.env=LANG=C.UTF-8 --config.env=PYTHONUNBUFFERED=1 \
        --config.exposedports=8080/tcp --config.exposedports=5353/udp \
        --author=pyproxy --architecture=amd64 --os=linux \
        --config.label=org.opencontainers.image.title=pyproxy-echo
}

build_pause() {  # $1: a work directory; leaves the image in $1/oci
    local work=$1 src tag
    apt_ensure gcc libc6-dev
    src=$(kube_source "$work" '*/build/pause/linux/pause.c' '*/build/pause/Makefile')
    tag=$(sed -n 's/^TAG = //p' "$src/build/pause/Makefile")
    mkdir -p "$work/layer"
    # Upstream's flags (build/pause/Makefile), so the binary is what its image would hold.
    gcc -Os -Wall -Werror -static -DVERSION="v$tag-$VERSION" -o "$work/layer/pause" "$src/build/pause/linux/pause.c"
    strip "$work/layer/pause"
    oci_layer_tar "$work/layer" "$work/layer.tar"
    oci_new "$work/oci" "$tag" "$work/layer.tar"
    umoci config --image "$work/oci:$tag" --config.entrypoint=/pause \
        --author=pyproxy --architecture=amd64 --os=linux --config.label=org.opencontainers.image.title=pause
}

# cached NAME INPUT...: $OUT/NAME-KEY.oci.tar, built by build_NAME unless it exists; KEY hashes the builder, the
# OCI steps and the INPUT files. Prints the archive's path.
cached() {
    local name=$1 key archive start work
    shift
    key=$( { declare -f "build_$name" oci_debian_rootfs oci_new oci_layer_tar; echo "$OCI_SUITE $OCI_MIRROR $VERSION";
             cat "$@" /dev/null; } | sha256sum | cut -c1-16)
    archive=$OUT/$name-$key.oci.tar
    if [ ! -s "$archive" ]; then
        oci_require_tools
        start=$(date +%s)
        log "building $archive"
        work=$(mktemp -d "$OUT/build.XXXXXX")
        # shellcheck disable=SC2064  # the trap is for this work directory
        trap "rm -rf '$work'" EXIT
        "build_$name" "$work"
        oci_archive "$work/oci" "$work/image.oci.tar"
        mv "$work/image.oci.tar" "$archive"
        rm -rf "$work"
        trap - EXIT
        # Archives of inputs that no longer exist: keep only this one.
        find "$OUT" -maxdepth 1 -name "$name-*.oci.tar" ! -name "$name-$key.oci.tar" -delete
        log "$name built in $(( $(date +%s) - start )) s, $(du -m "$archive" | cut -f1) MB"
    fi
    ln -sfn "$(basename "$archive")" "$OUT/$name.oci.tar"
    echo "$archive"
}

mkdir -p "$OUT"
# Two builds at once would spend the minutes twice: the second waits, then finds the images built.
exec 9>"$OUT/.build.lock"
flock 9
cached echo "$TRAFFIC"
cached pause
