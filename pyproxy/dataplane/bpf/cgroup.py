"""Where socket load balancing hooks in: the cgroup programs of bpf/include/pyproxy/sock.h on a cgroup v2 tree.

The hooks see every socket of every process in the cgroup and below it, whatever its network namespace, so
their place is the root of the node's cgroup v2 hierarchy (a node is one host); a lab or a test gives its own
sub-cgroup instead (`BpfSettings.cgroup_root`).

They are attached through BPF links, pinned under the pin path (`links/cgroup_<program>`): a link is replaced
atomically (bpf_link_update: no moment without a hook, as `tc filter replace` for TC), and a pinned link
outlives pyproxy as the TC filters do, so SIGTERM leaves the dataplane in place. Unpinning a link is detaching
it. A start makes the links exactly what its settings say: hooks on another cgroup, or when socket load
balancing is off, are detached and logged.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi

log = logging.getLogger(__name__)

LINK_DIR = "links"
"""The subdirectory of the pin path that holds the pinned links."""
FALLBACK_MOUNT = Path("/run/pyproxy/cgroup2")
"""Where a cgroup v2 hierarchy is mounted when the node has none mounted."""


class _LinkInfo(ctypes.Structure):
    """The head of the kernel's struct bpf_link_info with its cgroup member (uapi/linux/bpf.h)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("cgroup_id", ctypes.c_uint64),
        ("attach_type", ctypes.c_uint32),
        ("pad2", ctypes.c_uint32),
        ("rest", ctypes.c_uint8 * 64),  # the union's other members are larger
    ]


def cgroup2_mount() -> Path | None:
    """The node's cgroup v2 mount point (the first in /proc/self/mountinfo), if any."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            return Path(fields[4].replace("\\040", " "))
    return None


def default_root() -> Path:
    """The root of the node's cgroup v2 hierarchy, mounting one at FALLBACK_MOUNT when there is none."""
    mount = cgroup2_mount()
    if mount is not None:
        return mount
    FALLBACK_MOUNT.mkdir(parents=True, exist_ok=True)
    loader.mount("cgroup2", FALLBACK_MOUNT, "a cgroup v2 hierarchy (the node had none; socket load balancing needs it)")
    return FALLBACK_MOUNT


def cgroup_id(path: Path) -> int:
    """A cgroup v2 directory's id: its inode number."""
    return os.stat(path).st_ino


def _link_info(fd: int) -> _LinkInfo:
    info = _LinkInfo()
    size = ffi.new("uint32_t *", ctypes.sizeof(info))
    libbpf.check(libbpf.lib().bpf_obj_get_info_by_fd(fd, ffi.cast("void *", ctypes.addressof(info)), size),
                 "bpf_obj_get_info_by_fd (link)")
    return info


def _pins(pin_dir: Path) -> dict[str, Path]:
    links = pin_dir / LINK_DIR
    return {p.name: p for p in links.glob("cgroup_*")} if links.is_dir() else {}


def v2_directory(root: Path) -> Path:
    """`root` when it is a cgroup v2 directory, else the v2 hierarchy systemd's hybrid layout mounts below it.

    A node booted with cgroup v1 controllers (`systemd.unified_cgroup_hierarchy=0`, as kubelets before cgroup v2
    support want) keeps its v2 hierarchy at /sys/fs/cgroup/unified: the DaemonSet mounts the host's whole
    /sys/fs/cgroup at --cgroup-root, so on such a node the hooks' place is `unified` below it."""
    if root.is_dir() and loader.fs_type(root) == "cgroup2":
        return root
    unified = root / "unified"
    if unified.is_dir() and loader.fs_type(unified) == "cgroup2":
        log.info("--cgroup-root %s holds cgroup v1 controllers: the socket hooks go on its v2 hierarchy %s",
                 root, unified)
        return unified
    raise loader.BpfUnavailable(f"--cgroup-root {root} is not a cgroup v2 directory (nor has one at {unified})")


def attach(progs: dict[str, int], root: Path, pin_dir: Path) -> None:
    """Attach (or atomically replace) every socket hook on cgroup `root` (or its hybrid layout's v2 hierarchy,
    v2_directory), pinned under `pin_dir`."""
    lib = libbpf.lib()
    root = v2_directory(root)
    want = cgroup_id(root)
    (pin_dir / LINK_DIR).mkdir(exist_ok=True)
    cg = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for prog, attach_type in abi.SOCK_HOOKS.items():
            pin = pin_dir / LINK_DIR / f"cgroup_{prog}"
            if pin.exists():
                fd = libbpf.check(lib.bpf_obj_get(str(pin).encode()), f"open pinned link {pin}")
                try:
                    info = _link_info(fd)
                    if info.cgroup_id == want and info.attach_type == attach_type:
                        libbpf.check(lib.bpf_link_update(fd, progs[prog], ffi.NULL), f"replace {prog} on {root}")
                        continue
                finally:
                    os.close(fd)
                pin.unlink()
                log.info("detached %s from cgroup id %d: the hooks now go on %s", prog, info.cgroup_id, root)
            fd = libbpf.check(lib.bpf_link_create(progs[prog], cg, attach_type, ffi.NULL),
                              f"attach {prog} to cgroup {root}")
            try:
                libbpf.check(lib.bpf_obj_pin(fd, str(pin).encode()), f"pin link {pin}")
            finally:
                os.close(fd)
        log.info("socket load balancing on cgroup %s (%s)", root, ", ".join(abi.SOCK_HOOKS))
    finally:
        os.close(cg)


def detach(pin_dir: Path) -> list[str]:
    """Detach every socket hook pinned under `pin_dir` (the links die with their last pin); what went."""
    done = []
    for name, pin in sorted(_pins(pin_dir).items()):
        pin.unlink()
        done.append(f"socket hook {name.removeprefix('cgroup_')} (link {pin})")
    links = pin_dir / LINK_DIR
    if links.is_dir() and not any(links.iterdir()):
        links.rmdir()
    return done
