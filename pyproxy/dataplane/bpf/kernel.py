"""What the running kernel offers the BPF dataplane, asked of the kernel itself before the object is loaded.

Two lists (README, "Kernel requirements", is their prose; tests/priv/test_kernel.py runs them on every kernel the
suite runs on):

- REQUIRED: what bpf/pyproxy.bpf.o cannot do without. One missing fails the load with an error naming it and
  the mainline version that brought it (`require()`), instead of the verifier's dump of a program it refused.
- OPTIONAL: what the programs use where it is there and replace where it is not; the loader hands the answer to
  the programs as struct pyproxy_config.kernel (abi.h), which the verifier folds, so each kernel runs its own branch.

Each probe is the smallest program or map that needs the feature, made once per process (`features()` is cached):
helpers by a call the verifier must resolve (as libbpf's probes do: "unknown func" in its log means absent), hooks
by a program of that attach type, flags and instructions by a map or program using them.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from pyproxy.dataplane.bpf import abi, libbpf
from pyproxy.dataplane.bpf.libbpf import ffi

# uapi/linux/bpf.h: enum bpf_prog_type, enum bpf_map_type, enum bpf_attach_type, enum bpf_func_id.
PROG_SCHED_CLS, PROG_XDP, PROG_CGROUP_SOCK_ADDR = 3, 6, 18
MAP_HASH, MAP_ARRAY, MAP_PERCPU_ARRAY, MAP_LRU_HASH, MAP_LPM_TRIE, MAP_HASH_OF_MAPS = 1, 2, 6, 9, 11, 13
ATTACH_CONNECT4, ATTACH_SENDMSG4, ATTACH_RECVMSG4, ATTACH_GETPEERNAME4 = 10, 14, 19, 29
FUNC_FIB_LOOKUP, FUNC_XDP_ADJUST_META, FUNC_JIFFIES64, FUNC_LOOP, FUNC_SET_RETVAL = 69, 54, 118, 181, 187
BPF_F_INNER_MAP = 0x1000
BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC = 1 << 2, 1 << 4
BPF_FIB_LOOKUP_SIZE = 64  # sizeof(struct bpf_fib_lookup)
AF_INET = 2


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One struct bpf_insn: opcode, dst_reg:4 and src_reg:4 (little-endian bitfield order), off, imm."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


# The few opcodes the probes need (uapi/linux/bpf_common.h, bpf.h).
def _mov64_imm(dst: int, imm: int) -> bytes:
    return _insn(0xB7, dst, imm=imm)  # BPF_ALU64 | BPF_MOV | BPF_K


def _mov64_reg(dst: int, src: int) -> bytes:
    return _insn(0xBF, dst, src)  # BPF_ALU64 | BPF_MOV | BPF_X


def _add64_imm(dst: int, imm: int) -> bytes:
    return _insn(0x07, dst, imm=imm)  # BPF_ALU64 | BPF_ADD | BPF_K


def _st_dw(dst: int, off: int, imm: int) -> bytes:
    return _insn(0x7A, dst, off=off, imm=imm)  # BPF_ST | BPF_MEM | BPF_DW


def _st_b(dst: int, off: int, imm: int) -> bytes:
    return _insn(0x72, dst, off=off, imm=imm)  # BPF_ST | BPF_MEM | BPF_B


def _call(helper: int) -> bytes:
    return _insn(0x85, imm=helper)  # BPF_JMP | BPF_CALL


_EXIT = _insn(0x95)  # BPF_JMP | BPF_EXIT
_R0_1 = _mov64_imm(0, 1)


class _Refused(Exception):
    """The kernel refused a probe program: its errno and verifier log."""

    def __init__(self, code: int, log: str) -> None:
        super().__init__(f"{os.strerror(code)}: {log[-300:]}")
        self.code, self.log = code, log


def _load(prog_type: int, insns: bytes, attach_type: int = 0) -> int:
    """Load a probe program; its fd, or _Refused."""
    lib = libbpf.lib()
    log = ffi.new("char[]", 4096)
    opts = ffi.new("struct bpf_prog_load_opts *")
    opts.sz = ffi.sizeof("struct bpf_prog_load_opts")
    opts.expected_attach_type = attach_type
    opts.log_level, opts.log_size, opts.log_buf = 1, len(log), log
    buf = ffi.from_buffer(insns)
    fd = int(lib.bpf_prog_load(prog_type, b"pyproxy_probe", b"GPL", buf, len(insns) // 8, opts))
    if fd < 0:
        code = -fd if fd != -1 else ffi.errno
        if code == errno.EPERM:  # (EACCES is the verifier's refusal)
            raise PermissionError(code, f"loading a BPF program: {os.strerror(code)}")
        raise _Refused(code, ffi.string(log).decode(errors="replace"))
    return fd


def _loads(prog_type: int, insns: bytes, attach_type: int = 0) -> bool:
    try:
        os.close(_load(prog_type, insns, attach_type))
    except _Refused:
        return False
    return True


def _prog_type(prog_type: int) -> Callable[[], bool]:
    return lambda: libbpf.lib().libbpf_probe_bpf_prog_type(prog_type, ffi.NULL) == 1


def _map_type(map_type: int) -> Callable[[], bool]:
    return lambda: libbpf.lib().libbpf_probe_bpf_map_type(map_type, ffi.NULL) == 1


def _hook(attach_type: int) -> Callable[[], bool]:
    """A cgroup socket-address hook: a program of its attach type loads only where the kernel knows it."""
    return lambda: _loads(PROG_CGROUP_SOCK_ADDR, _R0_1 + _EXIT, attach_type)


# What the verifier says of a helper it does not know ("invalid func unknown#181"), or knows but not for this program
# type: "unknown func bpf_loop#181" in older kernels, "program of this type cannot use helper bpf_loop#181" in newer.
_NO_HELPER = ("invalid func ", "unknown func ", "cannot use helper ")


def _helper(prog_type: int, helper: int, attach_type: int = 0) -> Callable[[], bool]:
    """A call of `helper` from `prog_type`: its arguments are not set up, so the verifier refuses the program
    either way, but only a helper it does not know (or does not allow there) makes it say so (_NO_HELPER)."""

    def probe() -> bool:
        try:
            os.close(_load(prog_type, _call(helper) + _R0_1 + _EXIT, attach_type))
        except _Refused as e:
            return not any(said in e.log for said in _NO_HELPER)
        return True

    return probe


def _inner_map_flag() -> bool:
    """BPF_F_INNER_MAP: an array made with it (the tables' template, maps.h) lets each inner array have its size."""
    lib = libbpf.lib()
    opts = ffi.new("struct bpf_map_create_opts *")
    opts.sz = ffi.sizeof("struct bpf_map_create_opts")
    opts.map_flags = BPF_F_INNER_MAP
    fd = int(lib.bpf_map_create(MAP_ARRAY, b"pyproxy_probe", 4, 4, 1, opts))
    if fd < 0:
        return False
    os.close(fd)
    return True


def _atomic_fetch_add() -> bool:
    """BPF_ATOMIC | BPF_FETCH (clang's -mcpu=v3 __sync_fetch_and_add whose result is used: the rr cursor)."""
    insns = (_st_dw(10, -8, 0) + _mov64_imm(1, 1)
             + _insn(0xDB, 10, 1, off=-8, imm=0x01)  # r1 = atomic_fetch_add((u64 *)(r10 - 8), r1)
             + _mov64_imm(0, 0) + _EXIT)
    return _loads(PROG_SCHED_CLS, insns)


def fib_lookup_src() -> bool:
    """Whether bpf_fib_lookup takes BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH. The helper checks its flags
    at run time, not the verifier: a TC program returning the helper's answer runs once on a dummy frame. An
    unknown flag answers -EINVAL before anything else; known ones go on to the lookup, which fails otherwise
    (no device 0: -ENODEV)."""
    frame_size = BPF_FIB_LOOKUP_SIZE
    insns = (
        _mov64_reg(6, 1)
        + b"".join(_st_dw(10, -frame_size + 8 * i, 0) for i in range(frame_size // 8))
        + _st_b(10, -frame_size, AF_INET)  # .family
        + _mov64_reg(1, 6) + _mov64_reg(2, 10) + _add64_imm(2, -frame_size) + _mov64_imm(3, frame_size)
        + _mov64_imm(4, BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH)
        + _call(FUNC_FIB_LOOKUP) + _EXIT
    )
    try:
        fd = _load(PROG_SCHED_CLS, insns)
    except _Refused:
        return False
    try:
        data = ffi.new("uint8_t[]", 64)  # an Ethernet frame's worth: TC test runs want at least its header
        opts = ffi.new("struct bpf_test_run_opts *")
        opts.sz = ffi.sizeof("struct bpf_test_run_opts")
        opts.data_in, opts.data_size_in = data, len(data)
        libbpf.check(libbpf.lib().bpf_prog_test_run_opts(fd, opts), "test run of the bpf_fib_lookup probe")
        return struct.unpack("=i", struct.pack("=I", opts.retval))[0] != -errno.EINVAL
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Feature:
    name: str
    since: str
    """The mainline release that brought it."""
    why: str
    """What pyproxy uses it for."""
    probe: Callable[[], bool]


REQUIRED: tuple[Feature, ...] = (
    Feature("BPF_PROG_TYPE_SCHED_CLS", "4.1", "the TC programs (ingress DNAT, egress reverse NAT and SNAT)",
            _prog_type(PROG_SCHED_CLS)),
    Feature("BPF_PROG_TYPE_XDP", "4.8", "the XDP program (--xdp-devices)", _prog_type(PROG_XDP)),
    Feature("BPF_MAP_TYPE_LRU_HASH", "4.10", "connection tracking, fragments, socket pairs", _map_type(MAP_LRU_HASH)),
    Feature("BPF_MAP_TYPE_LPM_TRIE", "4.11", "loadBalancerSourceRanges", _map_type(MAP_LPM_TRIE)),
    Feature("BPF_MAP_TYPE_HASH_OF_MAPS", "4.12", "wrr and Maglev tables", _map_type(MAP_HASH_OF_MAPS)),
    Feature("bpf_xdp_adjust_meta", "4.15", "XDP's mark for TC on the packets it translated",
            _helper(PROG_XDP, FUNC_XDP_ADJUST_META)),
    Feature("cgroup/connect4 hook", "4.17", "socket load balancing", _hook(ATTACH_CONNECT4)),
    Feature("cgroup/sendmsg4 hook", "4.18", "socket load balancing (UDP)", _hook(ATTACH_SENDMSG4)),
    Feature("bpf_fib_lookup", "4.18", "SNAT's route to the backend", _helper(PROG_SCHED_CLS, FUNC_FIB_LOOKUP)),
    Feature("cgroup/recvmsg4 hook", "5.2", "socket load balancing (UDP replies)", _hook(ATTACH_RECVMSG4)),
    Feature("bpf_jiffies64", "5.6", "the connection-tracking clock", _helper(PROG_SCHED_CLS, FUNC_JIFFIES64)),
    Feature("cgroup/getpeername4 hook", "5.8", "socket load balancing (getpeername shows the Service)",
            _hook(ATTACH_GETPEERNAME4)),
    Feature("BPF_F_INNER_MAP", "5.10", "wrr and Maglev tables of any size", _inner_map_flag),
    Feature("atomic fetch-and-add (BPF_ATOMIC, clang -mcpu=v3)", "5.12", "the rr cursor", _atomic_fetch_add),
    Feature("bpf_loop", "5.17", "SNAT port search, least-connection schedulers", _helper(PROG_SCHED_CLS, FUNC_LOOP)),
    Feature("bpf_set_retval", "5.18", "a socket hook's connection refused (ECONNREFUSED) or timed out",
            _helper(PROG_CGROUP_SOCK_ADDR, FUNC_SET_RETVAL, ATTACH_CONNECT4)),
)

OPTIONAL: tuple[Feature, ...] = (
    Feature("BPF_FIB_LOOKUP_SRC", "6.7 (6.1.81 in the 6.1 stable series)",
            "SNAT's source address from the route; without it, the egress device's primary address (snat.py)",
            fib_lookup_src),
)


@dataclass(frozen=True)
class KernelFeatures:
    missing: tuple[Feature, ...]
    """REQUIRED features this kernel lacks."""
    flags: int
    """struct pyproxy_config.kernel: abi.KERNEL_* of the OPTIONAL features it has."""

    @property
    def fib_src(self) -> bool:
        return bool(self.flags & abi.KERNEL_FIB_SRC)


def release() -> str:
    return os.uname().release


@functools.cache
def features() -> KernelFeatures:
    """Probe this kernel (once per process). Needs the privileges a load needs: PermissionError otherwise, from the
    first probe (libbpf's own probes, further down, would take a refusal for an absent feature)."""
    flags = abi.KERNEL_FIB_SRC if fib_lookup_src() else 0
    missing = tuple(f for f in REQUIRED if not f.probe())
    return KernelFeatures(missing, flags)


def describe_missing(missing: tuple[Feature, ...]) -> str:
    """The error a load gives on a kernel without everything it needs: each missing feature by name, what it is for
    and the mainline version that brought it."""
    oldest = max((f.since for f in REQUIRED), key=lambda v: tuple(int(x) for x in v.split(".")))
    parts = "; ".join(f"{f.name} (Linux {f.since}: {f.why})" for f in missing)
    return (f"this kernel ({release()}) lacks what pyproxy's BPF dataplane needs: {parts}. The BPF mode needs Linux "
            f"{oldest} or later (tested on 6.1 and 6.18; docs/bpf-datapath.md, \"Kernel requirements\"); the "
            f"iptables, nftables and IPVS modes do not need these")
