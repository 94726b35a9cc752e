#!/usr/bin/env bash
# Build the qemu guest that runs pyproxy's IPVS tests: this machine's kernel has no IPVS and cannot load modules,
# so IPVS is exercised inside a guest booting Debian bookworm's own kernel (recipe and timings: shared notes,
# vm-lab.md).
#
# What is built, cached outside the repository in ${PYPROXY_CACHE:-$HOME/.cache/pyproxy}/guest/:
#   vmlinuz      the standard linux-image-6.1.0-*-amd64 (not -cloud: that one has no 9p)
#   initrd.img   a busybox stage 1: loads virtio/ext4 modules, mounts the root image, switch_root
#   rootfs.img   ext4 made by mmdebstrap: python3, iproute2, ipvsadm (assertions only), iptables, ipset,
#                conntrack, kmod, procps, socat, ethtool, nftables, libbpf1, bpftool, the kernel's modules (a subset:
#                virtio, filesystems, net/ with 8021q, top-level drivers/net with macvlan, and bonding),
#                and a venv in /opt/pyproxy-venv with pyproxy's runtime and test dependencies
# The repository is NOT in the image: tests/guest/run.py shares the working tree read-only over 9p, so the
# guest always runs the current code. The image is rebuilt only when a file is missing or this script changed
# (its hash is stored beside the image); qemu attaches rootfs.img with snapshot=on, so runs never modify it.
#
# Prints the cache directory on its last line.
set -euo pipefail

CACHE=${PYPROXY_CACHE:-$HOME/.cache/pyproxy}/guest
SELF_HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
MIRROR=http://deb.debian.org/debian
SUITE=bookworm
VENV=/opt/pyproxy-venv
# pyproxy's runtime dependencies (pyproject.toml) and pytest; pyroute2 pinned to the IPVS API the code uses.
# (Quoted word by word below: the hook runs under sh -c, where a bare >= would redirect.)
PIP_PKGS="'pyroute2==0.9.7' 'prometheus-client>=0.17' 'PyYAML>=6' 'cffi>=1.15' 'kubernetes>=29' 'pytest>=7'"
# nftables and libbpf1: the benchmark runs pyproxy's nftables and bpf modes beside IPVS in the guest (bench/guest.py),
# and tests/e2e/test_guest_kernel.py runs the BPF fixtures (tests/priv) on this kernel; bpftool: their ABI checks read
# the object's BTF with it.
ROOT_PKGS=python3,python3-venv,ca-certificates,iproute2,ipvsadm,iptables,ipset,conntrack,kmod,procps,socat,ethtool,\
nftables,libbpf1,bpftool
HOST_TOOLS=(qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils mmdebstrap:mmdebstrap cpio:cpio
            busybox:busybox-static mke2fs:e2fsprogs depmod:kmod dpkg-deb:dpkg)
# Kernel module folders copied into the guest; the rest (GPUs, sound, wireless, ...) only costs image size.
MODULE_DIRS="kernel/arch kernel/block kernel/crypto kernel/fs kernel/lib kernel/mm kernel/net kernel/virt
             kernel/drivers/virtio kernel/drivers/block kernel/drivers/char"
# Stage 1 needs these to mount the root image (in load order, dependencies resolved below).
STAGE1_MODULES="virtio_pci virtio_blk crc32c_generic ext4"

log() { echo "build-image: $*" >&2; }

if [ -f "$CACHE/image.hash" ] && [ "$(cat "$CACHE/image.hash")" = "$SELF_HASH" ] &&
   [ -s "$CACHE/vmlinuz" ] && [ -s "$CACHE/initrd.img" ] && [ -s "$CACHE/rootfs.img" ]; then
    echo "$CACHE"
    exit 0
fi

missing=()
for tool in "${HOST_TOOLS[@]}"; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

mkdir -p "$CACHE"
# Two test runs building at once would race on the same files: the second waits, then finds the image built.
exec 9>"$CACHE/.build.lock"
flock 9
if [ -f "$CACHE/image.hash" ] && [ "$(cat "$CACHE/image.hash")" = "$SELF_HASH" ] && [ -s "$CACHE/rootfs.img" ]; then
    echo "$CACHE"
    exit 0
fi

START=$(date +%s)
WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# ---- kernel: the version linux-image-amd64 points at, unpacked (its postinst, which builds an initramfs
# with initramfs-tools, never runs)
KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-6\.1\.0-[0-9]*-amd64\)$/\1/p' | head -n1)
if [ -z "$KPKG" ]; then
    apt-get update -qq >&2
    KPKG=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-6\.1\.0-[0-9]*-amd64\)$/\1/p' | head -n1)
fi
[ -n "$KPKG" ] || { log "cannot tell which linux-image-6.1.0-*-amd64 package is current"; exit 1; }
KVER=${KPKG#linux-image-}
log "kernel $KVER"
(cd "$WORK" && apt-get download "$KPKG" >&2 2>/dev/null || (cd "$WORK" && apt-get download "$KPKG" >&2))
dpkg-deb -x "$WORK"/"$KPKG"_*.deb "$WORK/kernel"
KMOD=$WORK/kernel/lib/modules/$KVER

# ---- root filesystem. pip inside the chroot trusts the host's CA bundle: a machine whose traffic passes a
# TLS-inspecting proxy has that proxy's CA only there.
log "mmdebstrap $SUITE with $ROOT_PKGS"
mmdebstrap --variant=minbase --include="$ROOT_PKGS" \
    --customize-hook="chroot \"\$1\" python3 -m venv $VENV" \
    --customize-hook="cp /etc/ssl/certs/ca-certificates.crt \"\$1/tmp/host-ca.crt\"" \
    --customize-hook="chroot \"\$1\" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root PIP_CERT=/tmp/host-ca.crt $VENV/bin/pip install -q --no-cache-dir --disable-pip-version-check $PIP_PKGS" \
    --customize-hook="rm -f \"\$1/tmp/host-ca.crt\"" \
    "$SUITE" "$WORK/rootfs" "$MIRROR" >&2
ROOT=$WORK/rootfs

mkdir -p "$ROOT/lib/modules/$KVER"
for d in $MODULE_DIRS; do
    if [ -d "$KMOD/$d" ]; then
        mkdir -p "$ROOT/lib/modules/$KVER/$(dirname "$d")"
        cp -a "$KMOD/$d" "$ROOT/lib/modules/$KVER/$d"
    fi
done
# Only the top-level drivers/net modules (dummy, veth, virtio_net, macvlan, ...), not the vendor NIC subfolders; and
# bonding, in a subfolder of its own, for the lab's bond uplink (8021q, for its VLAN uplink, is under kernel/net).
mkdir -p "$ROOT/lib/modules/$KVER/kernel/drivers/net"
cp -a "$KMOD"/kernel/drivers/net/*.ko "$KMOD"/kernel/drivers/net/bonding "$ROOT/lib/modules/$KVER/kernel/drivers/net/"
cp -a "$KMOD"/modules.builtin "$KMOD"/modules.builtin.modinfo "$KMOD"/modules.order "$ROOT/lib/modules/$KVER/"
depmod -b "$ROOT" "$KVER"

# PID 1 of the guest: mount the shares, run the command the runner left in the output share, record its exit
# code there, power off. It never falls into a shell: whatever fails, the machine powers off (or, should this
# script die, the kernel panics and qemu -no-reboot exits).
cat > "$ROOT/usr/local/sbin/pyproxy-guest-init" <<'INIT'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
hostname pyproxy-guest
ip link set lo up
modprobe -a 9pnet_virtio 9p
repo=$(sed -n 's/.*pyproxy\.repo=\([^ ]*\).*/\1/p' /proc/cmdline)
mkdir -p /mnt/out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /mnt/out
if [ -n "$repo" ]; then
    mkdir -p "$repo"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro repo "$repo"
fi
rc=125
if [ -f /mnt/out/run.sh ]; then
    bash /mnt/out/run.sh </dev/null 2>&1 | tee /mnt/out/output.log >/dev/console
    rc=${PIPESTATUS[0]}
else
    echo "pyproxy-guest-init: no /mnt/out/run.sh" >/dev/console
fi
echo "$rc" > /mnt/out/rc.tmp && mv /mnt/out/rc.tmp /mnt/out/rc
sync
umount /mnt/out
echo o > /proc/sysrq-trigger
sleep 10
INIT
chmod 0755 "$ROOT/usr/local/sbin/pyproxy-guest-init"
echo pyproxy-guest > "$ROOT/etc/hostname"
rm -rf "$ROOT/var/cache/apt/archives/"*.deb "$ROOT/var/lib/apt/lists/"* "$ROOT/usr/share/doc" "$ROOT/usr/share/man"

SIZE_MB=$(( $(du -sm "$ROOT" | cut -f1) * 5 / 4 + 256 ))
log "rootfs.img: ${SIZE_MB} MB"
mke2fs -q -t ext4 -L pyproxy-root -d "$ROOT" -F "$WORK/rootfs.img" "${SIZE_MB}M"

# ---- stage 1 initramfs
I=$WORK/initramfs
mkdir -p "$I"/{bin,dev,proc,sys,newroot,modules}
cp "$(command -v busybox)" "$I/bin/busybox"
: > "$I/modules.list"
deps=""
for m in $STAGE1_MODULES; do
    deps+=$(modprobe -S "$KVER" -d "$ROOT" --show-depends "$m")$'\n'
done
for path in $(awk '$1 == "insmod" {print $2}' <<<"$deps"); do
    name=$(basename "$path")
    if [ ! -e "$I/modules/$name" ]; then
        cp "$path" "$I/modules/$name"
        echo "$name" >> "$I/modules.list"
    fi
done
cat > "$I/init" <<'STAGE1'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() { echo "stage1: $*"; echo o > /proc/sysrq-trigger; sleep 10; }
for m in $(cat /modules.list); do insmod /modules/$m || echo "stage1: insmod $m failed"; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
mount -t ext4 /dev/vda /newroot || fail "cannot mount /dev/vda"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /usr/local/sbin/pyproxy-guest-init
STAGE1
chmod 0755 "$I/init"
(cd "$I" && find . | cpio -o -H newc --quiet) > "$WORK/initrd.img"

cp "$WORK/kernel/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
for f in vmlinuz initrd.img rootfs.img; do
    mv "$WORK/$f" "$CACHE/$f"
done
echo "$KVER" > "$CACHE/kernel.version"
echo "$SELF_HASH" > "$CACHE/image.hash"
log "built in $(( $(date +%s) - START )) s"
echo "$CACHE"
