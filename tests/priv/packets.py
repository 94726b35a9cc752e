"""Ethernet/IPv4/TCP/UDP frames for driving the BPF programs, and the checksum verifier the tests trust.

Written from the RFCs (791 IPv4, 793 TCP, 768 UDP, 1071 Internet checksum) with `struct` only and
sharing no code with the dataplane, so an error in the programs' checksum arithmetic cannot cancel out
here. Frames are built whole (checksums computed from scratch), so "the frame a client would have sent
to the backend directly" is one call, and a translated frame can be compared with it byte for byte.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass, replace

ETH_P_IP = 0x0800
ETH_P_ARP = 0x0806
ETH_P_8021Q = 0x8100
ETH_P_IPV6 = 0x86DD
TCP = socket.IPPROTO_TCP
UDP = socket.IPPROTO_UDP
ICMP = socket.IPPROTO_ICMP
ETH_HLEN = 14
ETH_ZLEN = 60  # minimum frame without FCS: shorter frames are padded on the wire

IP_MF = 0x2000
TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_ACK = 0x10

CSUM_OFFSET = {TCP: 16, UDP: 6}  # of the checksum field in the TCP / UDP header

ROUTER_MAC = bytes.fromhex("02000000aa01")
CLIENT_MAC = bytes.fromhex("02000000bb02")


class L4Csum(enum.Enum):
    """What the TCP/UDP checksum field holds."""

    FULL = "full"  # the complete checksum, as on the wire
    PARTIAL = "partial"  # CHECKSUM_PARTIAL: folded, uncomplemented pseudo-header sum (offload to come)
    NONE = "none"  # UDP only: 0, "no checksum"


def ones_sum(data: bytes) -> int:
    """RFC 1071 one's complement sum of big-endian 16-bit words (odd length padded with a zero byte),
    folded to 16 bits and not complemented. For any data with a non-zero byte the result is 1..0xffff."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def checksum(data: bytes) -> int:
    """The Internet checksum of `data` (its checksum field zeroed)."""
    return ~ones_sum(data) & 0xFFFF


def pseudo_header(src: str, dst: str, proto: int, length: int) -> bytes:
    return socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, proto, length)


def pseudo_header_sum(src: str, dst: str, proto: int, length: int) -> int:
    """The value Linux leaves in the L4 checksum field of a CHECKSUM_PARTIAL packet."""
    return ones_sum(pseudo_header(src, dst, proto, length))


@dataclass(frozen=True)
class Flow:
    """One direction of a TCP or UDP conversation."""

    src: str
    dst: str
    sport: int
    dport: int
    proto: int = TCP

    def to(self, ip: str, port: int) -> Flow:
        """The same flow with another destination (what DNAT should produce)."""
        return replace(self, dst=ip, dport=port)

    def from_(self, ip: str, port: int) -> Flow:
        """The same flow with another source (what reverse NAT should produce)."""
        return replace(self, src=ip, sport=port)

    def reply(self) -> Flow:
        return Flow(self.dst, self.src, self.dport, self.sport, self.proto)


def ethernet(ethertype: int, body: bytes, pad_to: int = 0) -> bytes:
    frame = ROUTER_MAC + CLIENT_MAC + struct.pack("!H", ethertype) + body
    return frame + b"\0" * max(0, pad_to - len(frame))


def ipv4(
    src: str,
    dst: str,
    proto: int,
    body: bytes,
    *,
    options: bytes = b"",
    frag: int = 0,
    ident: int = 0x1234,
    ttl: int = 64,
    ihl: int | None = None,
    tot_len: int | None = None,
    tos: int = 0,
) -> bytes:
    """An IPv4 header with a correct checksum, then `body`. `ihl`/`tot_len` override the honest values
    (the checksum still covers what is written) to build malformed packets."""
    assert len(options) % 4 == 0, "IPv4 options are padded to 32 bits"
    hlen = 20 + len(options)
    ihl = hlen // 4 if ihl is None else ihl
    tot_len = hlen + len(body) if tot_len is None else tot_len
    head = struct.pack(
        "!BBHHHBBH4s4s", 0x40 | ihl, tos, tot_len, ident, frag, ttl, proto, 0,
        socket.inet_aton(src), socket.inet_aton(dst),
    ) + options
    csum = checksum(head)
    return head[:10] + struct.pack("!H", csum) + head[12:] + body


def l4_segment(flow: Flow, payload: bytes, csum: L4Csum = L4Csum.FULL, tcp_flags: int = TCP_SYN, *,
               seq: int = 1000, ack: int = 0, window: int = 64240) -> bytes:
    """A TCP or UDP header plus payload, its checksum field as `csum` says."""
    if flow.proto == TCP:
        head = struct.pack("!HHIIBBHHH", flow.sport, flow.dport, seq, ack, 5 << 4, tcp_flags, window, 0, 0)
    elif flow.proto == UDP:
        head = struct.pack("!HHHH", flow.sport, flow.dport, 8 + len(payload), 0)
    else:
        raise ValueError(f"not TCP or UDP: {flow.proto}")
    seg = head + payload
    at = CSUM_OFFSET[flow.proto]
    pseudo = pseudo_header(flow.src, flow.dst, flow.proto, len(seg))
    if csum is L4Csum.NONE:
        assert flow.proto == UDP, "only UDP may omit its checksum"
        value = 0
    elif csum is L4Csum.PARTIAL:
        value = ones_sum(pseudo)
    else:
        value = checksum(pseudo + seg)
        if flow.proto == UDP and value == 0:
            value = 0xFFFF  # RFC 768: a computed 0 is sent as all ones
    return seg[:at] + struct.pack("!H", value) + seg[at + 2 :]


def payload_for_checksum(flow: Flow, size: int, value: int, tcp_flags: int = TCP_SYN) -> bytes:
    """`size` payload bytes, the last two chosen so that the TCP/UDP checksum of `flow` computes to `value`
    (before UDP turns a 0 into 0xffff): corner cases that random traffic hits once in 65535 packets."""
    assert size >= 2 and size % 2 == 0
    head = b"z" * (size - 2)
    seg = bytearray(l4_segment(flow, head + b"\0\0", L4Csum.FULL, tcp_flags))
    at = CSUM_OFFSET[flow.proto]
    seg[at : at + 2] = b"\0\0"
    rest = ones_sum(pseudo_header(flow.src, flow.dst, flow.proto, len(seg)) + bytes(seg))
    # checksum = ~(rest + last), so rest + last must be ~value in one's complement arithmetic (mod 0xffff).
    return head + struct.pack("!H", ((~value & 0xFFFF) - rest) % 0xFFFF)


def frame(
    flow: Flow,
    payload: bytes = b"",
    *,
    csum: L4Csum = L4Csum.FULL,
    tcp_flags: int = TCP_SYN,
    options: bytes = b"",
    frag: int = 0,
    pad_to: int = ETH_ZLEN,
    **tcp: int,
) -> bytes:
    """An Ethernet frame carrying one IPv4 TCP/UDP packet of `flow`, padded to the Ethernet minimum. `tcp`:
    seq, ack, window of a TCP header (l4_segment's defaults otherwise)."""
    seg = l4_segment(flow, payload, csum, tcp_flags, **tcp)
    return ethernet(ETH_P_IP, ipv4(flow.src, flow.dst, flow.proto, seg, options=options, frag=frag), pad_to)


@dataclass(frozen=True)
class Decoded:
    """What a receiving stack checks in an IPv4 TCP/UDP frame."""

    flow: Flow
    ip_csum_ok: bool
    l4_csum: int
    """The raw TCP/UDP checksum field."""
    l4_csum_ok: bool
    """The complete checksum verifies over pseudo header, header and payload (False for UDP's 0)."""
    l4_len: int


def decode(data: bytes) -> Decoded:
    """Parse an Ethernet/IPv4/TCP-or-UDP frame (lengths from the IPv4 header, padding ignored) and verify
    both checksums the way a receiver does: the one's complement sum including the field is all ones."""
    (ethertype,) = struct.unpack_from("!H", data, 12)
    assert ethertype == ETH_P_IP, f"not IPv4: ethertype {ethertype:#06x}"
    ip = data[ETH_HLEN:]
    ver_ihl, _, tot_len, _, _, _, proto, _, src, dst = struct.unpack_from("!BBHHHBBH4s4s", ip)
    hlen = (ver_ihl & 0xF) * 4
    assert ver_ihl >> 4 == 4 and hlen >= 20 and tot_len <= len(ip), "malformed IPv4 header"
    seg = ip[hlen:tot_len]
    sport, dport = struct.unpack_from("!HH", seg)
    (l4_csum,) = struct.unpack_from("!H", seg, CSUM_OFFSET[proto])
    flow = Flow(socket.inet_ntoa(src), socket.inet_ntoa(dst), sport, dport, proto)
    pseudo = pseudo_header(flow.src, flow.dst, proto, len(seg))
    return Decoded(
        flow=flow,
        ip_csum_ok=ones_sum(ip[:hlen]) == 0xFFFF,
        l4_csum=l4_csum,
        l4_csum_ok=not (proto == UDP and l4_csum == 0) and ones_sum(pseudo + seg) == 0xFFFF,
        l4_len=len(seg),
    )


ICMP_DEST_UNREACH = 3
ICMP_FRAG_NEEDED = 4  # code of ICMP_DEST_UNREACH
ICMP_PORT_UNREACH = 3  # code of ICMP_DEST_UNREACH
ICMP_TIME_EXCEEDED = 11


def icmp_error(src: str, dst: str, icmp_type: int, code: int, quoted: bytes, rest: int = 0, *, ident: int = 0x1234,
               tos: int = 0) -> bytes:
    """An Ethernet frame with an ICMP error from `src` to `dst` quoting `quoted` (an IPv4 packet, cut as the
    sender likes), its ICMP and IPv4 checksums computed from scratch (RFC 792)."""
    head = struct.pack("!BBHI", icmp_type, code, 0, rest)
    csum = checksum(head + quoted)
    body = head[:2] + struct.pack("!H", csum) + head[4:] + quoted
    return ethernet(ETH_P_IP, ipv4(src, dst, ICMP, body, ident=ident, tos=tos), ETH_ZLEN)


def turned_around(data: bytes) -> bytes:
    """A frame with its Ethernet addresses swapped: what a host sends back on the link a frame came from."""
    return data[6:12] + data[0:6] + data[12:]


def icmp_checksum_ok(data: bytes) -> bool:
    """Whether the ICMP checksum of an Ethernet/IPv4/ICMP frame verifies (over the IPv4 payload)."""
    ip = data[ETH_HLEN:]
    hlen = (ip[0] & 0xF) * 4
    (tot_len,) = struct.unpack_from("!H", ip, 2)
    return ones_sum(ip[hlen:tot_len]) == 0xFFFF


def ip_packet(data: bytes) -> bytes:
    """The IPv4 packet of an Ethernet frame, without link padding."""
    ip = data[ETH_HLEN:]
    (tot_len,) = struct.unpack_from("!H", ip, 2)
    return ip[:tot_len]


def fragments(flow: Flow, payload: bytes, chunk: int, ident: int = 0x4242) -> list[bytes]:
    """The Ethernet frames of one TCP/UDP datagram of `flow` cut into IPv4 fragments of `chunk` payload bytes
    (a multiple of 8), as a sender's stack fragments it: one L4 checksum over the whole datagram."""
    assert chunk % 8 == 0
    seg = l4_segment(flow, payload, L4Csum.FULL)
    out = []
    for off in range(0, len(seg), chunk):
        more = IP_MF if off + chunk < len(seg) else 0
        body = seg[off : off + chunk]
        out.append(ethernet(ETH_P_IP, ipv4(flow.src, flow.dst, flow.proto, body, frag=more | off // 8, ident=ident),
                            ETH_ZLEN))
    return out
