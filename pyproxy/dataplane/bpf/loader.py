"""Loading bpf/build/pyproxy.bpf.o: bpffs, pinned maps, and adopting the maps of a previous run.

A restart must keep every connection, so the maps outlive the process in two ways:
- pinned under the pin path (default /sys/fs/bpf/pyproxy), in a bpffs pyproxy mounts when none is there;
- held by the programs left attached to the devices. Under `ip netns exec` /sys is a fresh sysfs per
  invocation, so a bpffs mounted there dies with the process; the next run then finds the old maps through
  the attached program (map ids in its prog info) and reuses them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyproxy.dataplane.bpf import abi, clock, conntrack, kernel, libbpf
from pyproxy.dataplane.bpf.errors import BpfUnavailable
from pyproxy.dataplane.bpf.libbpf import ffi
from pyproxy.dataplane.bpf.maps import lookup_batch

log = logging.getLogger(__name__)

BPF_FS_ROOT = Path("/sys/fs/bpf")
TEST_KERNEL_FLAGS = "PYPROXY_TEST_KERNEL_FLAGS"
SO_NETNS_COOKIE = getattr(socket, "SO_NETNS_COOKIE", 71)
"""<asm-generic/socket.h>; Python names it from 3.13 on."""
"""Tests only (tests/e2e/test_flowcases.py): struct pyproxy_config.kernel (abi.KERNEL_*) instead of what the kernel
offers, so a newer kernel runs the ways of older ones (never more than it offers: the programs would fail)."""


class _ProgInfo(ctypes.Structure):
    """The head of the kernel's struct bpf_prog_info (uapi/linux/bpf.h): the fields pyproxy reads."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
    ]


class _MapInfo(ctypes.Structure):
    """The head of the kernel's struct bpf_map_info."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


def _info(fd: int, info: ctypes.Structure) -> None:
    size = ffi.new("uint32_t *", ctypes.sizeof(info))
    libbpf.check(
        libbpf.lib().bpf_obj_get_info_by_fd(fd, ffi.cast("void *", ctypes.addressof(info)), size),
        "bpf_obj_get_info_by_fd",
    )


def prog_name(prog_id: int) -> str | None:
    """The kernel name of a program (15 characters at most), None if it is gone."""
    fd = libbpf.lib().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        return None
    try:
        info = _ProgInfo()
        _info(fd, info)
        return info.name.decode()
    finally:
        os.close(fd)


def is_ours(prog_id: int | None) -> bool:
    name = prog_name(prog_id) if prog_id else None
    return bool(name and name.startswith(abi.PROG_PREFIX))


def maps_of_program(prog_id: int) -> dict[str, int]:
    """Map name -> new fd for every map the program uses (the caller owns the fds)."""
    fd = libbpf.lib().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        return {}
    try:
        ids = (ctypes.c_uint32 * 32)()
        info = _ProgInfo(nr_map_ids=32, map_ids=ctypes.addressof(ids))
        _info(fd, info)
        out = {}
        for map_id in ids[: min(info.nr_map_ids, 32)]:
            mfd = libbpf.lib().bpf_map_get_fd_by_id(map_id)
            if mfd < 0:
                continue
            minfo = _MapInfo()
            _info(mfd, minfo)
            out[minfo.name.decode()] = mfd
        return out
    finally:
        os.close(fd)


def map_info(fd: int) -> _MapInfo:
    info = _MapInfo()
    _info(fd, info)
    return info


def fs_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path` (from /proc/self/mountinfo)."""
    best, fstype = "", None
    target = os.path.realpath(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mnt = fields[4].replace("\\040", " ")
        sep = fields.index("-")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, fields[sep + 1]
    return fstype


def is_mountpoint(path: Path) -> bool:
    target = os.path.realpath(path)
    return any(line.split()[4] == target for line in Path("/proc/self/mountinfo").read_text().splitlines())


def mount(fstype: str, where: Path, what: str) -> None:
    """mount -t fstype fstype where; BpfUnavailable naming `what` (e.g. "a bpffs") when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(fstype.encode(), str(where).encode(), fstype.encode(), 0, None) != 0:
        code = ctypes.get_errno()
        raise BpfUnavailable(f"cannot mount {what} at {where}: {os.strerror(code)}")
    log.info("mounted %s at %s", what, where)



def unmount(where: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(str(where).encode(), 0) != 0:
        raise OSError(ctypes.get_errno(), f"cannot unmount {where}")


def ensure_bpffs(pin_dir: Path) -> None:
    """Make `pin_dir` a directory on a bpffs, mounting one when none is there. Under `ip netns exec`,
    /sys/fs/bpf exists but is a plain sysfs directory: mount there, as a host would at boot."""
    if pin_dir.exists() and fs_type(pin_dir) == "bpf":
        return
    parent = pin_dir.parent
    if parent.exists() and fs_type(parent) != "bpf" and (parent == BPF_FS_ROOT or fs_type(parent) == "sysfs"):
        mount("bpf", parent, "a bpffs")
    if parent.exists() and fs_type(parent) == "bpf":
        pin_dir.mkdir(exist_ok=True)
        return
    pin_dir.mkdir(parents=True, exist_ok=True)
    mount("bpf", pin_dir, "a bpffs")


def _close_object(handle: Any) -> None:
    libbpf.lib().bpf_object__close(handle)


@dataclass
class LoadedObject:
    """The loaded object: program and map fds, valid until `close()`. What either loader gives the rest of pyproxy
    (this module's `load`, libbpf's; bcc.load, BCC's), whose `release` frees its handle."""

    handle: Any
    progs: dict[str, int] = field(default_factory=dict)
    maps: dict[str, int] = field(default_factory=dict)
    release: Callable[[Any], None] = _close_object
    kernel_flags: int = 0
    """struct pyproxy_config.kernel as loaded (abi.KERNEL_*): which of their ways the programs take."""

    def close(self) -> None:
        if self.handle is not None:
            self.release(self.handle)
            self.handle = None


def _iter_maps(obj: Any) -> list[Any]:
    lib, m = libbpf.lib(), ffi.NULL
    out: list[Any] = []
    while True:
        m = lib.bpf_object__next_map(obj, m)
        if m == ffi.NULL:
            return out
        out.append(m)


def _compatible(m: Any, fd: int) -> bool:
    lib, info = libbpf.lib(), map_info(fd)
    return (
        info.type == lib.bpf_map__type(m)
        and info.key_size == lib.bpf_map__key_size(m)
        and info.value_size == lib.bpf_map__value_size(m)
        and info.max_entries == lib.bpf_map__max_entries(m)
        and info.map_flags == lib.bpf_map__map_flags(m)
    )


def _adopt(m: Any, name: str, adopt: dict[str, int] | None) -> None:
    if not adopt or name not in adopt:
        return
    if _compatible(m, adopt[name]):
        libbpf.check(libbpf.lib().bpf_map__reuse_fd(m, adopt[name]), f"reuse map {name}")
        log.info("reusing map %s of the programs already attached", name)
    else:
        log.warning("attached programs use map %s of another shape: not reusing it", name)


def unpin_other_layouts(pin_dir: Path, ours: set[str], keep: frozenset[str] = frozenset()) -> None:
    """Remove the pins of pyproxy maps this object does not have: an older layout's (pyproxy_ct_v1 once
    pyproxy_ct_v2 exists), which nothing will read again and which would otherwise hold their memory. `keep`: pins
    left for retire_old_layouts (the CT maps carried over, which the old programs still write until the new ones are
    attached)."""
    for pin in pin_dir.glob(f"{abi.MAP_PREFIX}*"):
        if pin.name not in ours and pin.name not in keep:
            pin.unlink()
            log.info("removed %s: a map of another layout version, replaced by this one", pin)


CARRIED_OVER = frozenset(c.old for c in abi.CT_CARRY_OVER)
"""The old CT maps' pins that load() leaves in place for retire_old_layouts."""


def _carry_one(c: abi.CarryOver, pin: Path, new_fd: int) -> int:
    """Copy the entries of the old-layout map pinned at `pin` into the map `new_fd`, converted; entries the new map
    has already (the new programs' own, or a first pass's) are left as they are. Returns how many were copied."""
    lib = libbpf.lib()
    fd = lib.bpf_obj_get(str(pin).encode())
    if fd < 0:
        raise OSError(ffi.errno, f"cannot open it: {os.strerror(ffi.errno)}")
    try:
        info = map_info(fd)
        want = (ctypes.sizeof(c.key), ctypes.sizeof(c.old_value))
        if (info.key_size, info.value_size) != want:
            raise ValueError(f"its entries are {info.key_size}+{info.value_size} bytes, not the {want[0]}+{want[1]} "
                             f"of {c.old}")
        keys, values = lookup_batch(fd, c.old, *want) or _lookup_each(fd, c.old, *want)
        copied = 0
        for i in range(len(keys) // want[0]):
            key, value = keys[i * want[0]:(i + 1) * want[0]], c.convert(values[i * want[1]:(i + 1) * want[1]])
            ret = lib.bpf_map_update_elem(new_fd, ffi.from_buffer(key), ffi.from_buffer(value), libbpf.BPF_NOEXIST)
            if ret == 0:
                copied += 1
            elif (-ret if ret != -1 else ffi.errno) != errno.EEXIST:
                libbpf.check(ret, f"update of map {c.new}")
        return copied
    finally:
        os.close(fd)


def _lookup_each(fd: int, name: str, key_size: int, value_size: int) -> tuple[bytes, bytes]:
    """Every key and value of a map one lookup at a time (kernels or map types without the batch call)."""
    lib, keys, values = libbpf.lib(), [], []
    cur, nxt, val = ffi.NULL, ffi.new("char[]", key_size), ffi.new("char[]", value_size)
    while lib.bpf_map_get_next_key(fd, cur, nxt) == 0:
        key = bytes(ffi.buffer(nxt))
        if lib.bpf_map_lookup_elem(fd, nxt, val) == 0:
            keys.append(key)
            values.append(bytes(ffi.buffer(val)))
        cur = ffi.new("char[]", key)
    return b"".join(keys), b"".join(values)


def carry_over(pin_dir: Path | None, maps: dict[str, int]) -> dict[str, int]:
    """Copy the flows of a previous release's CT maps (abi.CT_CARRY_OVER: pinned under `pin_dir` in the layout before
    the sequence field) into this load's, so an upgrade keeps established connections: run by load(), before the new
    programs are attached, and again by retire_old_layouts() after, for the flows the old programs began in between.
    A map that cannot be read costs its flows (they start again as new ones, which may reset them), never the
    start: one error line says so. Returns old map name -> entries copied."""
    done: dict[str, int] = {}
    if pin_dir is None:
        return done
    for c in abi.CT_CARRY_OVER:
        pin = pin_dir / c.old
        if c.new not in maps or not pin.exists():
            continue
        try:
            done[c.old] = n = _carry_one(c, pin, maps[c.new])
        except (OSError, ValueError) as e:
            log.error("cannot carry the flows of %s over into %s (%s): the connections it tracked are not kept",
                      pin, c.new, e)
            continue
        if n:
            log.info("carried %d flow entries of %s over into %s (any RST closes them, as before)", n, pin, c.new)
    return done


def retire_old_layouts(pin_dir: Path | None, maps: dict[str, int]) -> dict[str, int]:
    """Once the new programs are attached: carry over what the old programs recorded since load(), then remove the
    old CT maps' pins (the old programs' own references go when they are replaced). Returns carry_over's counts."""
    if pin_dir is None:
        return {}
    done = carry_over(pin_dir, maps)
    for name in CARRIED_OVER:
        pin = pin_dir / name
        if pin.exists():
            pin.unlink()
            log.info("removed %s: its flows are carried over into the map of the new layout", pin)
    return done


def _set_rodata(m: Any, config: abi.Config) -> None:
    """Write the programs' constants (the .rodata section: struct pyproxy_config) before load."""
    lib = libbpf.lib()
    size = ffi.new("size_t *")
    current = lib.bpf_map__initial_value(m, size)
    if current == ffi.NULL or size[0] != ctypes.sizeof(config):
        raise BpfUnavailable(f"the object's .rodata holds {size[0]} bytes, not one {abi.CONFIG_VAR} "
                             f"({ctypes.sizeof(config)} bytes): object and pyproxy do not match")
    data = bytes(config)
    libbpf.check(lib.bpf_map__set_initial_value(m, ffi.from_buffer(data), len(data)), "set .rodata")


# Kernel map types whose memory _map_bytes estimates differently (uapi enum bpf_map_type).
_ARRAYS = {2, 6}  # ARRAY, PERCPU_ARRAY
_PERCPU = {5, 6, 10}  # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
_ELEMENT_OVERHEAD = 56  # a hash map element's header (struct htab_elem) and its bucket's share, roughly


def _map_bytes(m: Any, entries: int) -> int:
    """About the memory a map of `entries` needs: what a refused size is told in (the kernel says only ENOMEM)."""
    lib = libbpf.lib()
    key, value, kind = lib.bpf_map__key_size(m), lib.bpf_map__value_size(m), lib.bpf_map__type(m)
    value = (value + 7) // 8 * 8 * (libbpf.lib().libbpf_num_possible_cpus() if kind in _PERCPU else 1)
    if kind in _ARRAYS:
        return entries * value
    return entries * ((key + 7) // 8 * 8 + value + _ELEMENT_OVERHEAD)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def kernel_features(kernel_flags: int | None = None) -> int:
    """struct pyproxy_config.kernel (abi.KERNEL_*): what this kernel offers, probed (kernel.py), unless
    `kernel_flags` (or, for tests, TEST_KERNEL_FLAGS) says; BpfUnavailable naming what a kernel without what the
    programs need lacks."""
    try:
        offered = kernel.features()
    except PermissionError as e:
        raise BpfUnavailable(f"cannot probe the kernel's BPF features: {e} (needs root: CAP_BPF and CAP_SYS_ADMIN)") \
            from e
    if offered.missing:
        raise BpfUnavailable(kernel.describe_missing(offered.missing))
    if kernel_flags is None and TEST_KERNEL_FLAGS in os.environ:
        kernel_flags = int(os.environ[TEST_KERNEL_FLAGS], 0)
        log.warning("%s=%#x: the programs take these kernel features as all there is", TEST_KERNEL_FLAGS, kernel_flags)
    return offered.flags if kernel_flags is None else kernel_flags


def netns_cookie() -> int:
    """The cookie of this process's network namespace (SO_NETNS_COOKIE, Linux 5.14), which bpf_get_netns_cookie()
    returns for a socket of it: the node's own namespace, for the socket hooks (sock.h)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), sys.byteorder)


def constants(ct_timeouts: abi.CtTimeoutTicks | None, snat_ports: tuple[int, int], cluster_cidr: str | None,
              endpoint_counters: bool = False, kernel_flags: int = 0, cluster_cidr6: str | None = None,
              socket_lb_hostns_only: bool = False, host_netns: int | None = None) -> abi.Config:
    """The programs' constants (struct pyproxy_config) from the settings and `kernel_flags` (kernel_features());
    timeouts default to conntrack.CtTimeouts() at this kernel's HZ. `cluster_cidr` and `cluster_cidr6` are
    --cluster-cidr's IPv4 and IPv6 CIDRs (MasqueradeSettings), each for its own family's flows;
    `socket_lb_hostns_only` is --bpf-socket-lb-hostns-only. The node's network namespace is this process's unless
    `host_netns` names another's cookie (tests: a namespace of their own as the node's)."""
    if ct_timeouts is None:
        ct_timeouts = conntrack.CtTimeouts().ticks(clock.kernel_hz())
    return abi.Config(ct=ct_timeouts, snat=abi.SnatPorts(*snat_ports), cluster=abi.Cidr.of(cluster_cidr),
                      endpoint_counters=int(endpoint_counters), kernel=kernel_flags,
                      cluster6=abi.Cidr6.of(cluster_cidr6),
                      refusal=abi.RefusalRate(10**9 // abi.REFUSALS_PER_SECOND, abi.REFUSAL_BURST),
                      sock_hostns_only=int(socket_lb_hostns_only),
                      host_netns=netns_cookie() if host_netns is None else host_netns)


def fill_jumps(loaded: LoadedObject) -> None:
    """Put this load's IPv6 programs in the program arrays the IPv4 entry points tail-call (abi.JUMPS6): until then
    IPv6 packets pass untouched. Pinned arrays held the previous load's programs: each entry is replaced."""
    if not any(prog in loaded.progs for jumps in abi.JUMPS6.values() for prog in jumps.values()):
        return  # not the datapath (bench's verdict-only floor, its steps on adopted maps): nothing to put anywhere
    lib = libbpf.lib()
    for name, jumps in abi.JUMPS6.items():
        for index, prog in jumps.items():
            key, value = ffi.new("uint32_t *", index), ffi.new("uint32_t *", loaded.progs[prog])
            libbpf.check(lib.bpf_map_update_elem(loaded.maps[name], key, value, libbpf.BPF_ANY),
                         f"put {prog} in {name}")


def capacities(max_entries: dict[str, int] | None) -> dict[str, int] | None:
    """The capacities asked for, with the per-endpoint counters map at the backends map's size unless it is given
    one (it holds an entry per backend), and the affinity map at the slots map's (an entry per slot at most)."""
    for sized, follower in ((abi.MAP_BACKENDS, abi.MAP_EPSTATS), (abi.MAP_BACKENDS6, abi.MAP_EPSTATS6),
                            (abi.MAP_SLOTS, abi.MAP_AFFINITY), (abi.MAP_SLOTS6, abi.MAP_AFFINITY6)):
        if max_entries and sized in max_entries and follower not in max_entries:
            max_entries = {**max_entries, follower: max_entries[sized]}
    return max_entries


def load(
    obj_path: Path,
    pin_dir: Path | None,
    max_entries: dict[str, int] | None = None,
    adopt: dict[str, int] | None = None,
    ct_timeouts: abi.CtTimeoutTicks | None = None,
    snat_ports: tuple[int, int] = abi.DEFAULT_SNAT_PORTS,
    cluster_cidr: str | None = None,
    endpoint_counters: bool = False,
    kernel_flags: int | None = None,
    cluster_cidr6: str | None = None,
    socket_lb_hostns_only: bool = False,
    host_netns: int | None = None,
) -> LoadedObject:
    """Open and load the object. Maps come, in this order of preference, from their pin under `pin_dir`,
    from `adopt` (name -> fd of a previous run's map), or new (and then pinned). A pinned or adopted map of
    another shape (e.g. a changed capacity) is not reused: a warning says so and a new one replaces it.
    `ct_timeouts` (default: conntrack.CtTimeouts() at this kernel's HZ), `snat_ports` (the first and last
    source port SNAT gives out), `cluster_cidr` and `cluster_cidr6` (--cluster-cidr's IPv4 and IPv6 CIDRs) and
    `endpoint_counters` (--bpf-endpoint-counters), `socket_lb_hostns_only` and `host_netns` (constants()) become
    the programs' constants, and so does what this kernel offers (kernel.py; `kernel_flags`, abi.KERNEL_*,
    overrides the probe: tests run the older kernels' ways here).
    A kernel without what the programs need fails here, naming what it lacks."""
    config = constants(ct_timeouts, snat_ports, cluster_cidr, endpoint_counters, kernel_features(kernel_flags),
                       cluster_cidr6, socket_lb_hostns_only, host_netns)
    max_entries = capacities(max_entries)
    lib = libbpf.lib()
    if not obj_path.exists():
        raise BpfUnavailable(f"BPF object {obj_path} not found (run `make bpf`)")
    obj = lib.bpf_object__open_file(str(obj_path).encode(), ffi.NULL)
    if obj == ffi.NULL:
        raise BpfUnavailable(f"cannot open BPF object {obj_path}: {os.strerror(ffi.errno)}")
    loaded = LoadedObject(obj, kernel_flags=config.kernel)
    try:
        for m in _iter_maps(obj):
            name = ffi.string(lib.bpf_map__name(m)).decode()
            if lib.bpf_map__is_internal(m):
                # libbpf's own map of a data section ("pyproxy.rodata"): never pinned nor adopted, made anew
                # at every load; .rodata holds the programs' constants.
                if name.endswith(".rodata"):
                    _set_rodata(m, config)
                continue
            if max_entries and name in max_entries:
                libbpf.check(lib.bpf_map__set_max_entries(m, max_entries[name]), f"resize map {name}")
            if pin_dir is None:
                # LIBBPF_PIN_BY_NAME gave every map a default pin under /sys/fs/bpf at open: unpinned
                # means no pin at all (tests, benchmarks).
                libbpf.check(lib.bpf_map__set_pin_path(m, ffi.NULL), f"unpin {name}")
                _adopt(m, name, adopt)
                continue
            pin = pin_dir / name
            if pin.exists():
                fd = lib.bpf_obj_get(str(pin).encode())
                ok = fd >= 0 and _compatible(m, fd)
                if fd >= 0:
                    os.close(fd)
                if not ok:
                    log.warning("pinned map %s has another shape or size: replacing it (its entries are lost)", pin)
                    pin.unlink()
            else:
                _adopt(m, name, adopt)
            libbpf.check(lib.bpf_map__set_pin_path(m, str(pin).encode()), f"pin path for {name}")
        ret = lib.bpf_object__load(obj)
        if ret < 0:
            code = -ret if ret != -1 else ffi.errno
            hint = " (needs root: CAP_BPF and CAP_SYS_ADMIN)" if code in (errno.EPERM, errno.EACCES) else ""
            if max_entries and code in (errno.ENOMEM, errno.E2BIG, errno.EINVAL):
                hint += "; the map sizes asked for need " + "; ".join(
                    f"{name}: {n:,} entries, about {_gib(_map_bytes(m, n))}"
                    for m in _iter_maps(obj)
                    if (name := ffi.string(lib.bpf_map__name(m)).decode()) in max_entries
                    and (n := max_entries[name]))
            raise BpfUnavailable(f"the kernel refused to load {obj_path}: {os.strerror(code)}{hint}")
        for m in _iter_maps(obj):
            if not lib.bpf_map__is_internal(m):
                loaded.maps[ffi.string(lib.bpf_map__name(m)).decode()] = lib.bpf_map__fd(m)
        if pin_dir is not None:
            carry_over(pin_dir, loaded.maps)
            unpin_other_layouts(pin_dir, set(loaded.maps), keep=CARRIED_OVER)
        p = ffi.NULL
        while True:
            p = lib.bpf_object__next_program(obj, p)
            if p == ffi.NULL:
                break
            loaded.progs[ffi.string(lib.bpf_program__name(p)).decode()] = lib.bpf_program__fd(p)
        fill_jumps(loaded)
        return loaded
    except BaseException:
        loaded.close()
        raise
