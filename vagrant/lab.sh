#!/bin/bash
# The Vagrant lab's life cycle: lab.sh up | down | status | smoke | test (make lab-up / lab-down / lab-status /
# lab-smoke / lab-test).
#
# There is no systemd as PID 1 on this machine, so virtlogd and libvirtd are started by hand, inside a private
# network namespace (NETNS below) so that libvirt's bridges, dnsmasq and NAT rules never touch the host's network;
# vagrant, virsh and kubectl run in that namespace too (the nodes' addresses only exist there). libvirtd also gets
# a private mount namespace where its qemu.conf runs qemu as root (the box's kernel and the lab share live under
# /root/.cache; nothing in /etc is changed). `down` destroys the VMs, the networks, libvirtd, virtlogd and the
# namespace: nothing is left running and no bridge exists on the host.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}
export PYPROXY_CACHE=$CACHE
LAB=$CACHE/vagrant
SHARE=$LAB/share
RUN=/run/pyproxy-vlab
NETNS=pyproxy-vlab
NODES=${PYPROXY_NODES:-2}
NET=${PYPROXY_LAB_NET:-192.168.50}
KUBE_VERSION=v1.20.2
UP_TIMEOUT=${PYPROXY_LAB_UP_TIMEOUT:-2700}      # vagrant up, seconds
READY_TIMEOUT=${PYPROXY_LAB_READY_TIMEOUT:-900}  # every Node Ready after provisioning, seconds
export PYPROXY_NODES=$NODES PYPROXY_LAB_NET=$NET PYPROXY_LAB_SHARE=$SHARE
export VAGRANT_HOME=$LAB/home VAGRANT_DEFAULT_PROVIDER=libvirt LIBVIRT_DEFAULT_URI=qemu:///system
export VAGRANT_CWD=$HERE VAGRANT_CHECKPOINT_DISABLE=1
HOST_PKGS="vagrant vagrant-libvirt libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients dnsmasq-base
           qemu-system-x86 qemu-utils mmdebstrap e2fsprogs openssl"
# kubectl is the v1.20.2 one make kube-binaries builds, not Debian's kubernetes-client: that package conflicts with
# other kubectl packages a machine may carry (a fresh machine here has Google Cloud SDK's 1.32), and apt stops.
KUBECTL=$CACHE/kubectl-$KUBE_VERSION

T0=$(date +%s)
log() { echo "lab: $(date +%T) (+$(( $(date +%s) - T0 ))s) $*" >&2; }
inns() { ip netns exec "$NETNS" "$@"; }
kc() { inns "$KUBECTL" --kubeconfig "$SHARE/pki/admin.kubeconfig" "$@"; }
pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

host_packages() {
    local missing=0
    for f in /usr/bin/vagrant /usr/sbin/libvirtd /usr/sbin/virtlogd /usr/bin/virsh /usr/sbin/dnsmasq \
             /usr/bin/qemu-system-x86_64 /usr/bin/qemu-img /usr/bin/mmdebstrap /usr/bin/openssl; do
        [ -e "$f" ] || missing=1
    done
    vagrant plugin list 2>/dev/null | grep -q vagrant-libvirt || missing=1
    if [ $missing = 1 ]; then
        log "installing host packages"
        apt-get update -qq
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $HOST_PKGS
    fi
}

start_libvirt() {
    mkdir -p "$RUN"
    ip netns list | grep -qw "$NETNS" || { ip netns add "$NETNS"; ip -n "$NETNS" link set lo up; }
    if ! pid_alive "$RUN/virtlogd.pid"; then
        inns virtlogd --daemon --pid-file "$RUN/virtlogd.pid"
    fi
    if ! pid_alive "$RUN/libvirtd.pid"; then
        cat >"$RUN/qemu.conf" <<'EOT'
user = "+0"
group = "+0"
dynamic_ownership = 0
security_driver = "none"
EOT
        inns unshare -m --propagation private sh -c \
            "mount --bind '$RUN/qemu.conf' /etc/libvirt/qemu.conf && exec libvirtd --daemon --pid-file '$RUN/libvirtd.pid'"
    fi
    for _ in $(seq 60); do inns virsh -q version >/dev/null 2>&1 && return 0; sleep 0.5; done
    log "libvirtd did not answer"; return 1
}

stop_libvirt() {
    if pid_alive "$RUN/libvirtd.pid"; then
        for net in $(inns virsh -q net-list --name 2>/dev/null); do inns virsh -q net-destroy "$net" >/dev/null || true; done
        kill "$(cat "$RUN/libvirtd.pid")"
    fi
    if pid_alive "$RUN/virtlogd.pid"; then kill "$(cat "$RUN/virtlogd.pid")"; fi
    for _ in $(seq 40); do
        pid_alive "$RUN/libvirtd.pid" || pid_alive "$RUN/virtlogd.pid" || break
        sleep 0.5
    done
    # dnsmasq of the lab's networks outlives libvirtd when vagrant-libvirt removed the network first (seen here);
    # libvirt records their pids
    for net in vagrant-libvirt pyproxy-lab default; do
        local pf=/run/libvirt/network/$net.pid pid
        pid=$(cat "$pf" 2>/dev/null || true)
        if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dnsmasq ]; then
            kill "$pid" && log "stopped the dnsmasq of network $net (pid $pid)"
        fi
        rm -f "$pf"
    done
    ip netns list | grep -qw "$NETNS" && ip netns del "$NETNS"
    rm -rf "$RUN"
}

prepare_share() {
    mkdir -p "$SHARE/bin" "$SHARE/images"
    local missing=()
    [ -x "$KUBECTL" ] || missing+=("$KUBECTL")  # the host's; the nodes have their box's
    for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
        local src=$CACHE/$b-$KUBE_VERSION
        if [ -x "$src" ]; then
            ln -f "$src" "$SHARE/bin/$b" 2>/dev/null || cp -f "$src" "$SHARE/bin/$b"
        else
            missing+=("$src")
        fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "missing kube binaries (make apiserver / make kube-binaries builds them): ${missing[*]}"
        return 1
    fi
    # The pod image built locally (tests/cluster/build-pod-image.sh) is imported into every node's containerd
    # as localhost/pyproxy-echo:1 (a NAME.base-name file beside NAME.tar gives ctr's --base-name).
    rm -f "$SHARE"/images/*
    local echo_img=$CACHE/pod-image/echo.oci.tar
    if [ -e "$echo_img" ]; then
        ln -f "$(readlink -f "$echo_img")" "$SHARE/images/echo.tar" 2>/dev/null || cp -f "$echo_img" "$SHARE/images/echo.tar"
        echo localhost/pyproxy-echo >"$SHARE/images/echo.base-name"
    else
        log "no pod image ($echo_img): the nodes get none (tests/cluster/build-pod-image.sh builds it)"
    fi
    "$HERE/pki.sh" "$SHARE/pki" "$NODES" "$NET"
}

add_box() {
    local hash
    hash=$(cat "$LAB/box.hash")
    if [ "$(cat "$VAGRANT_HOME/pyproxy-box.hash" 2>/dev/null)" != "$hash" ]; then
        log "vagrant box add pyproxy/bookworm"
        vagrant box add --force --name pyproxy/bookworm "$LAB/pyproxy-bookworm.box" >&2
        # vagrant-libvirt keeps the box's image as a volume in the default pool: drop an older one
        for vol in $(inns virsh -q vol-list default 2>/dev/null | awk '/pyproxy-VAGRANTSLASH-bookworm/ {print $1}'); do
            inns virsh -q vol-delete --pool default "$vol" >/dev/null
        done
        echo "$hash" >"$VAGRANT_HOME/pyproxy-box.hash"
    fi
}

wait_ready() {
    local deadline=$(( $(date +%s) + READY_TIMEOUT )) ready
    while :; do
        ready=$( (kc get nodes --no-headers 2>/dev/null || true) | awk '$2 == "Ready"' | wc -l)
        [ "$ready" -ge "$NODES" ] && return 0
        if [ "$(date +%s)" -ge "$deadline" ]; then
            log "only $ready of $NODES nodes Ready after ${READY_TIMEOUT}s"
            kc get nodes -o wide >&2 || true
            return 1
        fi
        sleep 5
    done
}

# ssh NODE COMMAND...: as root on a node, without vagrant's start-up cost per call (its ssh-config, written once
# per lab-test).
node_ssh() {
    inns ssh -F "$RUN/ssh_config" -o LogLevel=ERROR "$1" sudo "${@:2}"
}

# import_image ARCHIVE BASE-NAME: into every node's containerd, as the README's deploying section says (no
# registry); skipped on a node that has this very manifest already (an unchanged image costs nothing).
import_image() {
    local archive=$1 base=$2 digest name pids=() node t0 rc=0
    name=$(basename "$archive")
    mkdir -p "$SHARE/deploy"
    ln -f "$archive" "$SHARE/deploy/$name" 2>/dev/null || cp -f "$archive" "$SHARE/deploy/$name"
    digest=$(tar -xOf "$archive" ./index.json | python3 -c 'import json, sys; print(json.load(sys.stdin)["manifests"][0]["digest"])')
    t0=$(date +%s)
    for i in $(seq 1 "$NODES"); do
        node=node$i
        ( if node_ssh "$node" ctr -n k8s.io images ls | grep -q "$digest"; then
              log "$node has $base ($digest)"
          else
              node_ssh "$node" ctr -n k8s.io images import --base-name "$base" "/lab/deploy/$name" >/dev/null
              touch "$RUN/images-changed"  # pods already running the old image under this tag must restart
              log "$node: imported $name as $base in $(( $(date +%s) - t0 ))s"
          fi ) &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    return $rc
}

case ${1:-} in
up)
    rm -f "$LAB/lab-test-results.json"  # a new lab, a new table (make lab-test)
    host_packages
    prepare_share
    log "box"
    "$HERE/build-box.sh" >/dev/null
    start_libvirt
    add_box
    log "vagrant up ($NODES nodes; their serial consoles: $LAB/logs/)"
    mkdir -p "$LAB/logs"
    T_UP=$(date +%s)
    inns timeout "$UP_TIMEOUT" vagrant up --provider=libvirt
    log "vagrant up took $(( $(date +%s) - T_UP ))s; waiting for $NODES Ready nodes"
    wait_ready
    log "lab up: $NODES nodes Ready in $(( $(date +%s) - T0 ))s in all"
    kc get nodes -o wide
    ;;
down)
    if pid_alive "$RUN/libvirtd.pid"; then
        log "vagrant destroy"
        inns vagrant destroy -f >&2 || true
    fi
    stop_libvirt
    left=$(ip -o link show type bridge 2>/dev/null | grep -E 'virbr|cni0|pyproxy-lab' || true)
    [ -z "$left" ] || { log "bridges left on the host: $left"; exit 1; }
    log "lab down"
    ;;
smoke)
    # One echo pod per node behind a ClusterIP Service: the EndpointSlice the real controller writes, and each
    # pod reaching the other across nodes (pod CIDR routes, no overlay, no NAT: the peer sees the pod's address).
    kc apply -f "$HERE/manifests/echo.yaml"
    kc rollout status deployment/echo --timeout=900s
    kc get pods -l app=echo -o wide
    kc get endpointslices -l kubernetes.io/service-name=echo -o wide
    mapfile -t pods < <(kc get pods -l app=echo -o jsonpath='{range .items[*]}{.metadata.name} {.status.podIP}{"\n"}{end}')
    [ ${#pods[@]} -ge 2 ] || { log "expected 2 echo pods, got ${#pods[@]}"; exit 1; }
    for k in 0 1; do
        read -r from _ <<<"${pods[$k]}"
        read -r _ to_ip <<<"${pods[$(( 1 - k ))]}"
        log "$from -> $to_ip:8080"
        kc exec "$from" -- traffic probe --tcp "$to_ip" 8080 --count 3
    done
    log "smoke passed"
    ;;
test)
    # make lab-test: pyproxy's image (make image) and upstream kube-proxy's (vagrant/kube-proxy-image.sh) into
    # every node's containerd, then tests/cluster/lab_scenarios.py per proxy mode (PYPROXY_LAB_MODES, in order).
    # A lab that is not running is brought up first (as make lab-up).
    if ! pid_alive "$RUN/libvirtd.pid" || ! kc get nodes >/dev/null 2>&1; then
        log "the lab is not running: bringing it up (make lab-up)"
        "$0" up
    fi
    wait_ready
    PY=${PY:-$REPO/.venv/bin/python}
    version=$(sed -n 's|^ *image: localhost/pyproxy:||p' "$REPO/deploy/daemonset.yaml")
    image=$REPO/deploy/build/pyproxy-$version.oci.tar
    [ -s "$image" ] || { log "$image is missing: make image"; exit 1; }
    inns vagrant ssh-config >"$RUN/ssh_config"
    log "images: $image, kube-proxy's"
    import_image "$image" localhost/pyproxy
    modes=${PYPROXY_LAB_MODES:-bpf,ipvs,nftables,kube-proxy}
    case ,$modes, in *,kube-proxy*) import_image "$("$HERE/kube-proxy-image.sh")" localhost/kube-proxy;; esac
    log "images imported"
    rc=0
    restart=()
    if [ -e "$RUN/images-changed" ]; then restart=(--restart-proxies); rm -f "$RUN/images-changed"; fi
    inns env PYTHONPATH="$REPO:$REPO/tests" "$PY" "$REPO/tests/cluster/lab_scenarios.py" --kubeconfig "$SHARE/pki/admin.kubeconfig" --kubectl "$KUBECTL" \
        --nodes "$NODES" --modes "$modes" ${PYPROXY_LAB_SCENARIOS:+--scenarios "$PYPROXY_LAB_SCENARIOS"} "${restart[@]}" \
        --results "$LAB/lab-test-results.json" --logs "$LAB/logs/proxies" || rc=$?
    log "lab-test took $(( $(date +%s) - T0 ))s (rc $rc)"
    exit $rc
    ;;
status)
    if ! pid_alive "$RUN/libvirtd.pid"; then echo "lab: not running (no libvirtd)"; exit 0; fi
    inns vagrant status
    inns virsh list --all
    kc get nodes -o wide
    kc get pods -A -o wide
    ;;
*)
    echo "usage: $0 up|down|status|smoke|test" >&2; exit 2;;
esac
