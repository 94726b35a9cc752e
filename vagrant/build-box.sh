#!/usr/bin/env bash
# Build the Vagrant lab's libvirt box locally: no box can be downloaded here, and nothing beyond Debian's
# packages (and PyPI for pyproxy's Python dependencies) is fetched. pip inside the tree trusts the host's CA bundle
# (a machine whose traffic passes a TLS proxy), which is not left in the box. Recipe and measurements: shared notes,
# vm-lab.md.
#
# Output, cached in ${PYPROXY_CACHE:-$HOME/.cache/pyproxy}/vagrant/ and rebuilt only when this script changes
# (its hash is kept in box.hash):
#   pyproxy-bookworm.box  metadata.json + box.img (qcow2 of one ext4 filesystem, no partition table)
#   vmlinuz, initrd.img   Debian's kernel and initramfs from the tree: libvirt boots them directly
#                         (kernel/initrd/cmd_line in the Vagrantfile; root=/dev/vda)
# The tree: systemd, udev, openssh-server, sudo, dbus, ifupdown, isc-dhcp-client; the vagrant user with Vagrant's
# insecure key and passwordless sudo; what the lab nodes run, so provisioning is offline: containerd, runc, the
# CNI plugins (bridge, host-local, loopback, portmap in /usr/lib/cni), conntrack, iptables, nftables, ipvsadm,
# ipset, etcd-server (disabled; node 1's provisioning enables it), kubectl (kubernetes-client 1.20), python3
# and a venv in /opt/pyproxy-venv with pyproxy's runtime dependencies, and a pause image for containerd's pod
# sandboxes (busybox sleeping; no registry exists here) in /var/lib/pyproxy-lab/pause.tar.
# The kube binaries are not in the box: provisioning reads them from a read-only 9p share.
#
# Prints the cache directory on its last line.
set -euo pipefail

CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}/vagrant
SELF_HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
MIRROR=${PYPROXY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
DISK_GB=8
VENV=/opt/pyproxy-venv
PAUSE_REF=registry.local/pause:3.2
# pyproxy's runtime dependencies (pyproject.toml); pyroute2 pinned as in tests/guest/build-image.sh.
PIP_PKGS="'pyroute2==0.9.7' 'prometheus-client>=0.17' 'PyYAML>=6' 'cffi>=1.15' 'kubernetes>=29'"
PKGS=systemd-sysv,udev,openssh-server,sudo,dbus,ifupdown,isc-dhcp-client,iproute2,iputils-ping,kmod,procps,\
linux-image-amd64,initramfs-tools,ca-certificates,busybox-static,socat,ethtool,curl,\
containerd,runc,containernetworking-plugins,conntrack,iptables,nftables,ipvsadm,ipset,etcd-server,\
kubernetes-client,python3,python3-venv,libbpf1
HOST_TOOLS=(qemu-img:qemu-utils mmdebstrap:mmdebstrap mke2fs:e2fsprogs)
VAGRANT_PUB=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -n1 || true)

log() { echo "build-box: $(date +%T) $*" >&2; }

fresh() {
    [ -f "$CACHE/box.hash" ] && [ "$(cat "$CACHE/box.hash")" = "$SELF_HASH" ] &&
        [ -s "$CACHE/pyproxy-bookworm.box" ] && [ -s "$CACHE/vmlinuz" ] && [ -s "$CACHE/initrd.img" ]
}
if fresh; then echo "$CACHE"; exit 0; fi

missing=()
for tool in "${HOST_TOOLS[@]}"; do command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}"); done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
[ -n "$VAGRANT_PUB" ] || { log "Vagrant's insecure public key not found (is vagrant installed?)"; exit 1; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9
if fresh; then echo "$CACHE"; exit 0; fi

START=$(date +%s)
WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/root
mkdir -p "$WORK/files"

# ---- files copied into the tree
F=$WORK/files
cp "$VAGRANT_PUB" "$F/vagrant.pub"
cat >"$F/interfaces" <<'EOT'
# eth0: Vagrant's management network (DHCP); Vagrant appends the private network (eth1).
auto lo
iface lo inet loopback

auto eth0
iface eth0 inet dhcp
EOT
echo '/dev/vda / ext4 defaults,noatime 0 1' >"$F/fstab"
cat >"$F/sysctl.conf" <<'EOT'
net.ipv4.ip_forward = 1
net.bridge.bridge-nf-call-iptables = 1
net.bridge.bridge-nf-call-ip6tables = 1
EOT
printf '%s\n' br_netfilter overlay >"$F/modules.conf"
cat >"$F/containerd.toml" <<EOT
# pyproxy lab: no registry is reachable; the sandbox image is imported at provisioning.
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_REF"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
EOT

# ---- the pause image: an OCI archive of busybox sleeping (what a pod sandbox needs: a process holding the
# namespaces). Built from the tree's busybox-static by the hook below.
cat >"$F/pause-image.sh" <<'EOT'
#!/bin/bash
set -euo pipefail
root=$1 ref=$2 out=$3
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
mkdir -p "$d/rootfs/bin" "$d/oci/blobs/sha256"
cp "$root/bin/busybox" "$d/rootfs/bin/busybox"
tar -C "$d/rootfs" --owner=0 --group=0 --numeric-owner --mtime=@0 --sort=name -cf "$d/layer.tar" bin
diffid=$(sha256sum "$d/layer.tar" | cut -d' ' -f1)
gzip -n "$d/layer.tar"
blob() { local s; s=$(sha256sum "$1" | cut -d' ' -f1); cp "$1" "$d/oci/blobs/sha256/$s"; echo "$s $(stat -c %s "$1")"; }
read -r ldig lsize < <(blob "$d/layer.tar.gz")
printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/bin/busybox","sleep","2147483647"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$diffid" >"$d/config.json"
read -r cdig csize < <(blob "$d/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
    "$cdig" "$csize" "$ldig" "$lsize" >"$d/manifest.json"
read -r mdig msize < <(blob "$d/manifest.json")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$mdig" "$msize" "$ref" "${ref##*:}" >"$d/oci/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$d/oci/oci-layout"
tar -C "$d/oci" -cf "$out" oci-layout index.json blobs
EOT

log "mmdebstrap $SUITE (this is most of the time)"
# shellcheck disable=SC2016
mmdebstrap --variant=minbase --include="$PKGS" \
    --customize-hook="copy-in $F/interfaces /etc/network" \
    --customize-hook="copy-in $F/fstab /etc" \
    --customize-hook='echo pyproxy-box >"$1/etc/hostname"' \
    --customize-hook=': >"$1/etc/machine-id"; rm -f "$1/var/lib/dbus/machine-id"' \
    --customize-hook='chroot "$1" useradd -m -s /bin/bash vagrant' \
    --customize-hook='echo vagrant:vagrant | chroot "$1" chpasswd' \
    --customize-hook='echo "vagrant ALL=(ALL) NOPASSWD: ALL" >"$1/etc/sudoers.d/vagrant"; chmod 440 "$1/etc/sudoers.d/vagrant"' \
    --customize-hook="mkdir -p \"\$1/home/vagrant/.ssh\"; cp $F/vagrant.pub \"\$1/home/vagrant/.ssh/authorized_keys\"" \
    --customize-hook='chmod 700 "$1/home/vagrant/.ssh"; chmod 600 "$1/home/vagrant/.ssh/authorized_keys"; chroot "$1" chown -R vagrant:vagrant /home/vagrant/.ssh' \
    --customize-hook="cp $F/sysctl.conf \"\$1/etc/sysctl.d/90-pyproxy-lab.conf\"; cp $F/modules.conf \"\$1/etc/modules-load.d/pyproxy-lab.conf\"" \
    --customize-hook="mkdir -p \"\$1/etc/containerd\" \"\$1/etc/cni/net.d\" \"\$1/var/lib/pyproxy-lab\"; cp $F/containerd.toml \"\$1/etc/containerd/config.toml\"" \
    --customize-hook='chroot "$1" systemctl disable etcd.service' \
    --customize-hook='chroot "$1" systemctl enable containerd.service' \
    --customize-hook="bash $F/pause-image.sh \"\$1\" $PAUSE_REF \"\$1/var/lib/pyproxy-lab/pause.tar\"" \
    --customize-hook="chroot \"\$1\" python3 -m venv $VENV" \
    --customize-hook="cp /etc/ssl/certs/ca-certificates.crt \"\$1/tmp/host-ca.crt\"" \
    --customize-hook="chroot \"\$1\" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root PIP_CERT=/tmp/host-ca.crt $VENV/bin/pip install -q --no-cache-dir --disable-pip-version-check $PIP_PKGS" \
    --customize-hook='rm -f "$1/tmp/host-ca.crt"' \
    --customize-hook='cd "$1"/lib/modules/*/kernel && rm -rf drivers/gpu drivers/media drivers/infiniband drivers/net/wireless drivers/net/ethernet sound drivers/staging drivers/bluetooth net/bluetooth net/wireless net/mac80211 drivers/usb drivers/hid drivers/input drivers/iio drivers/scsi drivers/isdn drivers/mmc drivers/nfc' \
    --customize-hook='chroot "$1" sh -c "depmod \$(ls /lib/modules)"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/* "$1"/usr/share/doc "$1"/usr/share/man "$1"/usr/share/locale' \
    "$SUITE" "$ROOT" "$MIRROR" >&2

KVER=$(ls "$ROOT/lib/modules" | head -n1)
cp "$ROOT/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
cp "$ROOT/boot/initrd.img-$KVER" "$WORK/initrd.img"
log "kernel $KVER; tree $(du -sh "$ROOT" | cut -f1)"

mke2fs -q -t ext4 -L root -d "$ROOT" "$WORK/root.ext4" "${DISK_GB}G"
rm -rf "$ROOT"
mkdir -p "$WORK/box"
qemu-img convert -O qcow2 "$WORK/root.ext4" "$WORK/box/box.img"
rm -f "$WORK/root.ext4"
printf '{"provider":"libvirt","format":"qcow2","virtual_size":%s}\n' "$DISK_GB" >"$WORK/box/metadata.json"
tar -C "$WORK/box" -cf "$WORK/pyproxy-bookworm.box" metadata.json box.img

mv -f "$WORK/vmlinuz" "$WORK/initrd.img" "$WORK/pyproxy-bookworm.box" "$CACHE/"
echo "$SELF_HASH" >"$CACHE/box.hash"
log "box built in $(( $(date +%s) - START )) s: $(du -h "$CACHE/pyproxy-bookworm.box" | cut -f1)"
echo "$CACHE"
