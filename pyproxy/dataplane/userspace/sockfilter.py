"""Classic BPF socket filters (SO_ATTACH_FILTER): how the userspace mode drops a new flow's packets by their
source without netfilter and without the bpf() syscall.

A listening TCP socket runs its filter on each SYN before a request socket exists (tcp_v4_rcv -> tcp_filter), so
a SYN the filter refuses is dropped as a netfilter DROP drops it: no SYN-ACK, no reset, the client waits. A UDP
socket runs it on each datagram. Classic filters need no capability and work where the bpf() syscall is refused
(the kernel converts them itself), which is where this mode runs.

`compile_admission` is pure: the plan carries the instructions, `attach` only hands them to the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import socket
import struct
from collections.abc import Sequence
from typing import NamedTuple

SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27

# linux/filter.h and linux/bpf_common.h
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JA = 0x05  # BPF_JMP | BPF_JA
RET_K = 0x06  # BPF_RET | BPF_K
SKF_AD_OFF = -0x1000
SKF_AD_IFINDEX = 8
SKF_NET_OFF = -0x100000
IPV4_SADDR = 12
"""Offset of the source address in the IPv4 header."""
LOOPBACK_IFINDEX = 1
"""`lo` is ifindex 1 in every network namespace: the node's own packets to its own addresses arrive on it."""
ACCEPT, DROP = 0xFFFFFFFF, 0


class Insn(NamedTuple):
    code: int
    jt: int
    jf: int
    k: int


def _u32(value: int) -> int:
    return value & 0xFFFFFFFF


LOAD_SOURCE = Insn(LD_W_ABS, 0, 0, _u32(SKF_NET_OFF + IPV4_SADDR))
LOAD_IFINDEX = Insn(LD_W_ABS, 0, 0, _u32(SKF_AD_OFF + SKF_AD_IFINDEX))


def _network(cidr: str) -> tuple[int, int]:
    net = ipaddress.IPv4Network(cidr.strip(), strict=False)
    return int(net.network_address), int(net.netmask)


def _match_any(cidrs: Sequence[str], then: int) -> list[Insn]:
    """Instructions that jump `then` instructions past their own end when the source is in one of `cidrs`, and
    fall through past their end otherwise. Each CIDR: load, mask, compare, and a long jump (jt/jf reach 255 at
    most; JA's 32 bits reach anywhere), so any number of ranges fits."""
    out: list[Insn] = []
    for i, cidr in enumerate(cidrs):
        net, mask = _network(cidr)
        after = 4 * (len(cidrs) - i - 1)  # instructions of the ranges after this one
        out += [LOAD_SOURCE, Insn(AND_K, 0, 0, mask), Insn(JEQ_K, 0, 1, net), Insn(JA, 0, 0, after + then)]
    return out


def compile_admission(*, drop_all: bool = False, source_ranges: Sequence[str] = (), internal_only: bool = False,
                      cluster_cidr: str | None = None) -> tuple[Insn, ...] | None:
    """The filter of a frontend's socket: None takes every source. `drop_all` drops every packet; `source_ranges`
    (loadBalancerSourceRanges) drops sources outside them; `internal_only` then keeps only the node's own packets
    (arriving on `lo`) and, with `cluster_cidr`, the pods' (externalTrafficPolicy Local without a local
    endpoint: the outside's traffic is dropped, the node and pods get every endpoint)."""
    if drop_all:
        return (Insn(RET_K, 0, 0, DROP),)
    if not source_ranges and not internal_only:
        return None
    out: list[Insn] = []
    if source_ranges:
        out += _match_any(source_ranges, then=1)
        out.append(Insn(RET_K, 0, 0, DROP))  # in no range
    if internal_only:
        inside = [cluster_cidr] if cluster_cidr else []
        out += [LOAD_IFINDEX, Insn(JEQ_K, 0, 1, LOOPBACK_IFINDEX), Insn(JA, 0, 0, 4 * len(inside) + 1)]
        out += _match_any(inside, then=1)
        out.append(Insn(RET_K, 0, 0, DROP))
    out.append(Insn(RET_K, 0, 0, ACCEPT))
    return tuple(out)


def run(program: Sequence[Insn], source: str, ifindex: int) -> bool:
    """Whether `program` keeps a packet from `source` that arrived on device `ifindex`: an interpreter of the
    instructions compile_admission emits, for tests and tracers (anything else is a ValueError)."""
    a, pc = 0, 0
    while True:
        insn = program[pc]
        if insn == LOAD_SOURCE:
            a = int(ipaddress.IPv4Address(source))
        elif insn == LOAD_IFINDEX:
            a = ifindex
        elif insn.code == AND_K:
            a &= insn.k
        elif insn.code == JEQ_K:
            pc += insn.jt if a == insn.k else insn.jf
        elif insn.code == JA:
            pc += insn.k
        elif insn.code == RET_K:
            return insn.k != DROP
        else:
            raise ValueError(f"instruction {insn} is not one compile_admission emits")
        pc += 1


def attach(sock: socket.socket, program: Sequence[Insn] | None) -> None:
    """Give `sock` the filter (replacing any it had); None removes it."""
    if program is None:
        with contextlib.suppress(OSError):  # ENOENT: it had none
            sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        return
    code = b"".join(struct.pack("HBBI", *insn) for insn in program)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))  # struct sock_fprog {len; *filter}
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
