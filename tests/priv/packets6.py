"""Ethernet/IPv6 frames for driving the IPv6 programs, and the checks a receiver makes: packets.py's twin.

Written from the RFCs (8200 IPv6 and its extension headers, 4443 ICMPv6, 793 TCP, 768 UDP, 1071 checksum) with
`struct` only, sharing with the dataplane nothing but the Internet checksum's arithmetic of packets.py. IPv6 has no
header checksum: the TCP/UDP (and ICMPv6) checksum covers the addresses through the pseudo header of RFC 8200 sec.
8.1, so a translated frame is checked by recomputing that checksum from scratch and by comparing the frame with
the one its client would have sent to the backend directly.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from packets import CSUM_OFFSET, ETH_HLEN, ETH_P_IPV6, TCP, TCP_SYN, UDP, Flow, ethernet, ones_sum

HOPOPTS, ROUTING, FRAGMENT, DSTOPTS, ICMPV6 = 0, 43, 44, 60, 58
ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH = 1, 4
IPV6_HLEN = 40


def a6(ip: str) -> bytes:
    return ipaddress.IPv6Address(ip).packed


def pseudo6(src: str, dst: str, proto: int, length: int) -> bytes:
    """RFC 8200 sec. 8.1: source, destination, upper-layer length (32 bits), three zero bytes, next header."""
    return a6(src) + a6(dst) + struct.pack("!I3xB", length, proto)


def segment6(flow: Flow, payload: bytes = b"", tcp_flags: int = TCP_SYN, *, seq: int = 1000, ack: int = 0) -> bytes:
    """A TCP or UDP header plus payload with its complete checksum over the IPv6 pseudo header."""
    if flow.proto == TCP:
        head = struct.pack("!HHIIBBHHH", flow.sport, flow.dport, seq, ack, 5 << 4, tcp_flags, 64240, 0, 0)
    else:
        head = struct.pack("!HHHH", flow.sport, flow.dport, 8 + len(payload), 0)
    seg = head + payload
    value = ~ones_sum(pseudo6(flow.src, flow.dst, flow.proto, len(seg)) + seg) & 0xFFFF
    if flow.proto == UDP and value == 0:
        value = 0xFFFF
    at = CSUM_OFFSET[flow.proto]
    return seg[:at] + struct.pack("!H", value) + seg[at + 2 :]


def ext(kind: int, nexthdr: int, *, length: int = 0, frag_offset: int = 0, more: bool = False,
        ident: int = 0x1234567) -> bytes:
    """One extension header before `nexthdr`: hop-by-hop or destination options (a PadN option filling it),
    routing (type 253, experimental, no segments left) or fragment. `length`: the header's length field (8-byte
    units beyond the first 8)."""
    if kind == FRAGMENT:
        return struct.pack("!BBHI", nexthdr, 0, frag_offset << 3 | int(more), ident)
    size = (length + 1) * 8
    if kind == ROUTING:
        return struct.pack("!BBBB", nexthdr, length, 253, 0) + b"\0" * (size - 4)
    return struct.pack("!BBBB", nexthdr, length, 1, size - 4) + b"\0" * (size - 4)  # PadN


def ipv6(src: str, dst: str, nexthdr: int, body: bytes, *, payload_len: int | None = None) -> bytes:
    """An IPv6 header then `body`; `payload_len` overrides the honest length (malformed packets)."""
    length = len(body) if payload_len is None else payload_len
    return struct.pack("!IHBB16s16s", 6 << 28, length, nexthdr, 64, a6(src), a6(dst)) + body


def chain(kinds: list[int], last: int) -> bytes:
    """Extension headers of `kinds`, in order, the last one followed by protocol `last`."""
    out = b""
    for i, kind in enumerate(kinds):
        out += ext(kind, kinds[i + 1] if i + 1 < len(kinds) else last)
    return out


def frame6(flow: Flow, payload: bytes = b"", *, tcp_flags: int = TCP_SYN, exts: tuple[int, ...] = (),
           **tcp: int) -> bytes:
    """An Ethernet frame carrying one IPv6 TCP/UDP packet of `flow`, after extension headers `exts`."""
    body = chain(list(exts), flow.proto) + segment6(flow, payload, tcp_flags, **tcp)
    return ethernet(ETH_P_IPV6, ipv6(flow.src, flow.dst, exts[0] if exts else flow.proto, body))


def fragments6(flow: Flow, payload: bytes, chunk: int, ident: int = 0x4242) -> list[bytes]:
    """One datagram of `flow` cut into fragments of `chunk` bytes (a multiple of 8) of its upper-layer packet, as
    its sender's stack cuts it: one checksum over the whole datagram, in the first fragment."""
    assert chunk % 8 == 0
    seg = segment6(flow, payload)
    out = []
    for off in range(0, len(seg), chunk):
        header = ext(FRAGMENT, flow.proto, frag_offset=off // 8, more=off + chunk < len(seg), ident=ident)
        out.append(ethernet(ETH_P_IPV6, ipv6(flow.src, flow.dst, FRAGMENT, header + seg[off : off + chunk])))
    return out


@dataclass(frozen=True)
class Decoded6:
    """What a receiving stack checks in an IPv6 TCP/UDP (or ICMPv6) frame."""

    src: str
    dst: str
    proto: int
    """The upper-layer protocol, after any extension headers."""
    l4: bytes
    """The upper-layer packet (header and payload), as the payload length bounds it."""
    csum_ok: bool
    """Its checksum verifies over the pseudo header, from scratch."""

    @property
    def flow(self) -> Flow:
        sport, dport = struct.unpack_from("!HH", self.l4)
        return Flow(self.src, self.dst, sport, dport, self.proto)


def decode6(data: bytes) -> Decoded6:
    """Parse an Ethernet/IPv6 frame, skipping extension headers, and verify its upper-layer checksum."""
    (ethertype,) = struct.unpack_from("!H", data, 12)
    assert ethertype == ETH_P_IPV6, f"not IPv6: ethertype {ethertype:#06x}"
    ip = data[ETH_HLEN:]
    first, length, nexthdr, _, src, dst = struct.unpack_from("!IHBB16s16s", ip)
    assert first >> 28 == 6 and IPV6_HLEN + length <= len(ip), "malformed IPv6 header"
    body = ip[IPV6_HLEN : IPV6_HLEN + length]
    while nexthdr in (HOPOPTS, ROUTING, DSTOPTS, FRAGMENT):
        size = 8 if nexthdr == FRAGMENT else (body[1] + 1) * 8
        nexthdr, body = body[0], body[size:]
    s, d = str(ipaddress.IPv6Address(src)), str(ipaddress.IPv6Address(dst))
    ok = ones_sum(pseudo6(s, d, nexthdr, len(body)) + body) == 0xFFFF
    return Decoded6(s, d, nexthdr, body, ok)


def reassembled(frames: list[bytes]) -> Decoded6:
    """The datagram the fragments `frames` (in order) make, checked as the receiver checks it after reassembly."""
    ip = [f[ETH_HLEN:] for f in frames]
    src, dst = ip[0][8:24], ip[0][24:40]
    assert all(p[8:24] == src and p[24:40] == dst for p in ip), "fragments of one datagram differ in addresses"
    seg = b"".join(p[IPV6_HLEN + 8 : IPV6_HLEN + struct.unpack_from("!H", p, 4)[0]] for p in ip)
    s, d = str(ipaddress.IPv6Address(src)), str(ipaddress.IPv6Address(dst))
    proto = ip[0][IPV6_HLEN]
    return Decoded6(s, d, proto, seg, ones_sum(pseudo6(s, d, proto, len(seg)) + seg) == 0xFFFF)


ICMP6_PKT_TOOBIG = 2


def packet6(flow: Flow, payload: bytes = b"", tcp_flags: int = TCP_SYN) -> bytes:
    """The IPv6 packet of `flow` (no link header): what an ICMPv6 error quotes."""
    return ipv6(flow.src, flow.dst, flow.proto, segment6(flow, payload, tcp_flags))


def icmp6_error(src: str, dst: str, icmp_type: int, code: int, quoted: bytes, rest: int = 0) -> bytes:
    """An Ethernet frame with an ICMPv6 error from `src` to `dst` quoting `quoted`, its checksum from scratch over
    the pseudo header (RFC 4443 sec. 2.3)."""
    head = struct.pack("!BBHI", icmp_type, code, 0, rest)
    csum = ~ones_sum(pseudo6(src, dst, ICMPV6, len(head) + len(quoted)) + head + quoted) & 0xFFFF
    body = head[:2] + struct.pack("!H", csum) + head[4:] + quoted
    return ethernet(ETH_P_IPV6, ipv6(src, dst, ICMPV6, body))
