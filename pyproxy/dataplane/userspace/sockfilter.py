"""Classic BPF socket filters (SO_ATTACH_FILTER): how the userspace mode drops a new flow's packets by their
source without netfilter and without the bpf() syscall.

A listening TCP socket runs its filter on each SYN before a request socket exists (tcp_v4_rcv or tcp_v6_rcv ->
tcp_filter), so a SYN the filter refuses is dropped as a netfilter DROP drops it: no SYN-ACK, no reset, the client
waits. A UDP socket runs it on each datagram. Classic filters need no capability and work where the bpf() syscall
is refused (the kernel converts them itself), which is where this mode runs.

The source address is loaded relative to the network header (SKF_NET_OFF), not from the start of the data: by
the time a socket's filter runs, the data begins at the TCP or UDP header, past the IP header, whose length an
IPv6 packet's extension headers make unknown. An IPv4 socket sees IPv4 headers only, an IPv6 socket (IPV6_V6ONLY,
as the proxy opens them) IPv6 headers only, so a filter is compiled for its frontend's family: the IPv4 source is
one word at offset 12, the IPv6 source four words at offset 8.

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

from pyproxy.model.objects import IPV4, IPV6

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
SADDR = {IPV4: (12, 4), IPV6: (8, 16)}
"""Per family, the source address's offset in the IP header and its length in bytes."""
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


LOAD_IFINDEX = Insn(LD_W_ABS, 0, 0, _u32(SKF_AD_OFF + SKF_AD_IFINDEX))


def _load(offset: int) -> Insn:
    """Load the 32-bit word at `offset` in the IP header."""
    return Insn(LD_W_ABS, 0, 0, _u32(SKF_NET_OFF + offset))


def _words(cidr: str, family: int) -> list[tuple[int, int, int]]:
    """(header offset, network, mask) of each source word `cidr` constrains (none for a /0)."""
    net = ipaddress.ip_network(cidr.strip(), strict=False)
    if net.version != family:
        raise ValueError(f"{cidr} is not an IPv{family} CIDR, as the frontend's socket filter needs")
    offset, size = SADDR[family]
    address, mask = net.network_address.packed, net.netmask.packed
    out = []
    for i in range(0, size, 4):
        m = int.from_bytes(mask[i:i + 4], "big")
        if m:
            out.append((offset + i, int.from_bytes(address[i:i + 4], "big"), m))
    return out


def _match_any(cidrs: Sequence[str], family: int, then: int) -> list[Insn]:
    """Instructions that jump `then` instructions past their own end when the source is in one of `cidrs`, and
    fall through past their end otherwise. Each CIDR: per word it constrains, load, mask and compare (a mismatch
    skips to the next CIDR: at most 13 instructions, within the 8-bit jt/jf), then a long jump (JA's 32 bits reach
    anywhere), so any number of ranges fits."""
    blocks: list[list[Insn]] = []
    for cidr in cidrs:
        words = _words(cidr, family)
        block: list[Insn] = []
        for j, (offset, net, mask) in enumerate(words):
            rest = 3 * (len(words) - j - 1) + 1  # the later words' instructions and the block's JA
            block += [_load(offset), Insn(AND_K, 0, 0, mask), Insn(JEQ_K, 0, rest, net)]
        blocks.append(block)
    out: list[Insn] = []
    for i, block in enumerate(blocks):
        after = sum(len(b) + 1 for b in blocks[i + 1:])  # instructions of the ranges after this one
        out += [*block, Insn(JA, 0, 0, after + then)]
    return out


def compile_admission(*, family: int = IPV4, drop_all: bool = False, source_ranges: Sequence[str] = (),
                      internal_only: bool = False, cluster_cidr: str | None = None) -> tuple[Insn, ...] | None:
    """The filter of a frontend's socket of `family` (IPV4 or IPV6; the CIDRs are of it): None takes every source.
    `drop_all` drops every packet; `source_ranges` (loadBalancerSourceRanges) drops sources outside them;
    `internal_only` then keeps only the node's own packets (arriving on `lo`) and, with `cluster_cidr`, the pods'
    (externalTrafficPolicy Local without a local endpoint: the outside's traffic is dropped, the node and pods get
    every endpoint)."""
    if drop_all:
        return (Insn(RET_K, 0, 0, DROP),)
    if not source_ranges and not internal_only:
        return None
    out: list[Insn] = []
    if source_ranges:
        out += _match_any(source_ranges, family, then=1)
        out.append(Insn(RET_K, 0, 0, DROP))  # in no range
    if internal_only:
        inside = [cluster_cidr] if cluster_cidr else []
        pods = _match_any(inside, family, then=1)
        out += [LOAD_IFINDEX, Insn(JEQ_K, 0, 1, LOOPBACK_IFINDEX), Insn(JA, 0, 0, len(pods) + 1), *pods]
        out.append(Insn(RET_K, 0, 0, DROP))
    out.append(Insn(RET_K, 0, 0, ACCEPT))
    return tuple(out)


def run(program: Sequence[Insn], source: str, ifindex: int) -> bool:
    """Whether `program` keeps a packet from `source` (an IPv4 or IPv6 address: the header the socket of its
    family sees) that arrived on device `ifindex`: an interpreter of the instructions compile_admission emits, for
    tests and tracers (anything else, a load outside the source address among it, is a ValueError)."""
    address = ipaddress.ip_address(source)
    offset, size = SADDR[address.version]
    header = bytes(offset) + address.packed
    a, pc = 0, 0
    while True:
        insn = program[pc]
        at = insn.k - _u32(SKF_NET_OFF)
        if insn == LOAD_IFINDEX:
            a = ifindex
        elif insn.code == LD_W_ABS and offset <= at <= offset + size - 4:
            a = int.from_bytes(header[at:at + 4], "big")
        elif insn.code == AND_K:
            a &= insn.k
        elif insn.code == JEQ_K:
            pc += insn.jt if a == insn.k else insn.jf
        elif insn.code == JA:
            pc += insn.k
        elif insn.code == RET_K:
            return insn.k != DROP
        else:
            raise ValueError(f"instruction {insn} is not one compile_admission emits for an IPv{address.version} "
                             "source")
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
