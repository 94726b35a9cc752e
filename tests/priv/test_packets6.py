"""The IPv6 datapath (bpf/include/pyproxy/lb6.h and its twins), packet by packet with BPF_PROG_TEST_RUN, both
loaders: packets go in through the IPv4 entry points, which tail-call their IPv6 twins, as on a device.

The IPv6 maps are written here entry by entry (the control plane's render does not write them yet: README, "IPv6
in bpf mode"). Every translated frame is compared with the frame its client (or backend) would have sent to the
other end directly, built from scratch by packets6.py, and its upper-layer checksum is recomputed over the IPv6
pseudo header; every frame the programs must leave alone (malformed, truncated) comes out byte for byte as it went
in."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from collections.abc import Iterator

import pytest
from conftest import Load
from harness import (
    CAPACITY,
    CLIENT,
    PROTOS,
    ROOT,
    SERVICE,
    TC_EGRESS,
    TC_INGRESS,
    VIP,
    XDP,
    XDP_TRANSLATED_MARK,
    Dataplane,
    Prog,
    dnat,
    port_state,
)
from labkit.netns import NetnsThread, scratch_node
from packets import ETH_HLEN, TCP, TCP_ACK, TCP_SYN, UDP, Flow, ones_sum
from packets6 import (
    DSTOPTS,
    HOPOPTS,
    ICMP6_DEST_UNREACH,
    ICMP6_PKT_TOOBIG,
    ICMP6_PORT_UNREACH,
    ICMPV6,
    IPV6_HLEN,
    ROUTING,
    decode6,
    ext,
    fragments6,
    frame6,
    icmp6_error,
    ipv6,
    packet6,
    pseudo6,
    reassembled,
)

from pyproxy.dataplane.bpf import abi, attach, inspect, kernel, loader
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

pytestmark = ROOT

VIP6, PORT = "fd00:96::a", 80
CLIENT6 = "fd00:c::10"
BACKENDS6 = (("fd00:1::1", 8080), ("fd00:1::2", 8080))
TC_ACT_OK, TC_ACT_REDIRECT = 0, 7
TCP_FIN, TCP_RST = 0x01, 0x04
BOTH = [pytest.param(TCP, id="tcp"), pytest.param(UDP, id="udp")]
INGRESS = [pytest.param(TC_INGRESS, id="tc"), pytest.param(XDP, id="xdp")]
ALL = [*INGRESS, pytest.param(TC_EGRESS, id="tc-egress")]


def frontend6(dp: Dataplane, proto: int, backends: tuple[tuple[str, int], ...] = BACKENDS6, *, vip: str = VIP6,
              port: int = PORT, svc_id: int = 1, flags: int = 0, sched: str = "random") -> None:
    """What the control plane writes for one IPv6 frontend: its entry, its slots, its backends (and their ports in
    the endpoint-port map)."""
    m = dp.maps
    m.services6[abi.Svc6Key(abi.in6(vip), abi.be16(port), proto, abi.SVC_SCOPE_PACKETS)] = abi.SvcValue(
        svc_id=svc_id, backend_count=len(backends), flags=flags, sched=abi.SCHED[sched])
    for i, (ip, p) in enumerate(backends):
        m.slots6[abi.SlotKey(svc_id, i)] = abi.Slot6(abi.in6(ip), abi.be16(p), 0)
        m.backends6[abi.Backend6(abi.in6(ip), abi.be16(p))] = abi.BackendInfo(0, 0)
        word = ctypes.c_uint32(p // 64)
        m.ports[word] = ctypes.c_uint64(m.ports[word].value | 1 << (p % 64))


def run(dp: Dataplane, prog: Prog, data: bytes, ifindex: int = 0) -> tuple[int, bytes]:
    return dp.run(prog, data, ifindex)


def dnat6(dp: Dataplane, prog: Prog, flow: Flow, payload: bytes = b"", *, tcp_flags: int = TCP_SYN,
          exts: tuple[int, ...] = ()) -> tuple[str, int]:
    """One client packet to the frontend: it must leave as the very frame the client would have sent to the chosen
    backend, its checksum right from scratch. Returns the backend."""
    verdict, out = run(dp, prog, frame6(flow, payload, tcp_flags=tcp_flags, exts=exts))
    assert verdict == prog.ok
    d = decode6(out)
    assert (d.dst, d.flow.dport) in BACKENDS6, f"not DNATed: {d.flow}"
    assert d.csum_ok, "a receiver would drop the translated packet"
    assert out == frame6(flow.to(d.dst, d.flow.dport), payload, tcp_flags=tcp_flags, exts=exts)
    if prog is XDP and (flow.proto == UDP or tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN):
        assert dp.meta == XDP_TRANSLATED_MARK, "XDP translated without leaving its mark for TC"
    return d.dst, d.flow.dport


def unchanged(dp: Dataplane, prog: Prog, data: bytes) -> None:
    verdict, out = run(dp, prog, data)
    assert verdict == prog.ok
    assert out == data, "a packet the programs must leave alone was changed"


@pytest.mark.parametrize("proto", BOTH)
@pytest.mark.parametrize("prog", INGRESS)
def test_clusterip_dnat_and_reply_reverse_nat(dp: Dataplane, prog: Prog, proto: int) -> None:
    frontend6(dp, proto)
    flow = Flow(CLIENT6, VIP6, 40000, PORT, proto)
    be = dnat6(dp, prog, flow, b"hello")
    # The client's next packets follow the flow to the same backend.
    assert dnat6(dp, TC_INGRESS, flow, b"more", tcp_flags=TCP_ACK) == be
    # The backend's reply leaves with the frontend as its source.
    reply = Flow(be[0], CLIENT6, be[1], 40000, proto)
    verdict, out = run(dp, TC_EGRESS, frame6(reply, b"world", tcp_flags=TCP_SYN | TCP_ACK))
    assert verdict == TC_ACT_OK
    assert decode6(out).csum_ok
    assert out == frame6(flow.reply(), b"world", tcp_flags=TCP_SYN | TCP_ACK)
    assert dp.counter("new_flow") == 1 and dp.counter("revnat") == 1


def test_the_ipv6_programs_run_on_their_own_too(dp: Dataplane) -> None:
    """Tail-called by the IPv4 entry points on a device, but attachable alone: they check the frame themselves."""
    frontend6(dp, TCP)
    own = Prog(abi.PROG_TC_INGRESS6, TC_ACT_OK, 2)
    dnat6(dp, own, Flow(CLIENT6, VIP6, 40001, PORT))


@pytest.mark.parametrize("exts", [
    pytest.param((HOPOPTS,), id="hop-by-hop"),
    pytest.param((HOPOPTS, DSTOPTS, ROUTING), id="hop-dst-routing"),
    pytest.param((DSTOPTS, ROUTING, DSTOPTS), id="dst-routing-dst"),
])
@pytest.mark.parametrize("proto", BOTH)
def test_extension_headers_before_tcp_and_udp_are_skipped(dp: Dataplane, proto: int, exts: tuple[int, ...]) -> None:
    frontend6(dp, proto)
    flow = Flow(CLIENT6, VIP6, 40100, PORT, proto)
    be = dnat6(dp, TC_INGRESS, flow, b"x" * 13, exts=exts)
    verdict, out = run(dp, TC_EGRESS, frame6(Flow(be[0], CLIENT6, be[1], 40100, proto), b"y", exts=exts,
                                             tcp_flags=TCP_ACK))
    assert out == frame6(flow.reply(), b"y", exts=exts, tcp_flags=TCP_ACK)
    # XDP leaves packets with extension headers to TC.
    unchanged(dp, XDP, frame6(Flow(CLIENT6, VIP6, 40101, PORT, proto), exts=exts))


def test_more_extension_headers_than_the_parser_walks_pass_untouched(dp: Dataplane) -> None:
    frontend6(dp, UDP)
    unchanged(dp, TC_INGRESS, frame6(Flow(CLIENT6, VIP6, 40200, PORT, UDP), exts=(HOPOPTS,) + (DSTOPTS,) * 5))


def test_a_fragmented_datagram_is_translated_whole_both_ways(dp: Dataplane) -> None:
    """The first fragment carries the ports and decides; the later one follows it by the datagram's
    identification (PYPROXY_MAP_FRAGS6), its addresses rewritten alone: the reassembled datagram's checksum holds."""
    frontend6(dp, UDP)
    flow = Flow(CLIENT6, VIP6, 40300, PORT, UDP)
    out = []
    for f in fragments6(flow, bytes(range(40)), 24):
        verdict, o = run(dp, TC_INGRESS, f)
        assert verdict == TC_ACT_OK
        out.append(o)
    d = reassembled(out)
    assert d.src == CLIENT6 and (d.dst, d.flow.dport) in BACKENDS6 and d.csum_ok
    assert dp.counter("frag_nat") == 1
    # The reply in fragments gets the frontend back, fragment by fragment.
    back = Flow(d.dst, CLIENT6, d.flow.dport, 40300, UDP)
    replies = [run(dp, TC_EGRESS, f)[1] for f in fragments6(back, bytes(range(40)), 24, ident=0x77)]
    r = reassembled(replies)
    assert (r.src, r.flow.sport, r.dst) == (VIP6, PORT, CLIENT6) and r.csum_ok


def test_a_later_fragment_without_its_first_passes_untouched(dp: Dataplane) -> None:
    frontend6(dp, UDP)
    later = fragments6(Flow(CLIENT6, VIP6, 40400, PORT, UDP), bytes(40), 24, ident=0x99)[1]
    for prog in (TC_INGRESS, XDP, TC_EGRESS):
        unchanged(dp, prog, later)


def _truncated() -> list[object]:
    flow = Flow(CLIENT6, VIP6, 40500, PORT, TCP)
    whole = frame6(flow, b"data")
    seg = whole[ETH_HLEN + IPV6_HLEN :]
    hop = ext(HOPOPTS, TCP, length=1)  # 16 bytes
    return [
        pytest.param(whole[: ETH_HLEN + 30], id="ipv6-header"),
        pytest.param(whole[: ETH_HLEN + IPV6_HLEN + 10], id="tcp-header-cut"),
        # The payload length says the TCP header is not all there, though the frame holds it.
        pytest.param(whole[:ETH_HLEN] + ipv6(CLIENT6, VIP6, TCP, seg, payload_len=12), id="tcp-header-short"),
        # A hop-by-hop header of 16 bytes, the frame cut in its middle.
        pytest.param(whole[:ETH_HLEN] + ipv6(CLIENT6, VIP6, HOPOPTS, hop + seg)[: IPV6_HLEN + 12],
                     id="ext-header-cut"),
        # ... or longer than the payload length.
        pytest.param(whole[:ETH_HLEN] + ipv6(CLIENT6, VIP6, HOPOPTS, hop + seg, payload_len=12),
                     id="ext-header-past-payload"),
        # An IPv6 ethertype over a header whose version is 4.
        pytest.param(whole[:ETH_HLEN] + b"\x40" + whole[ETH_HLEN + 1 :], id="ipv6-header-version-4"),
    ]


@pytest.mark.parametrize("prog", ALL)
@pytest.mark.parametrize("data", _truncated())
def test_malformed_and_truncated_packets_pass_untouched(dp: Dataplane, prog: Prog, data: bytes) -> None:
    if prog is not XDP and len(data) < ETH_HLEN + IPV6_HLEN:
        pytest.skip("BPF_PROG_TEST_RUN for skbs needs a complete IPv6 header (EINVAL): XDP's run shows the case")
    frontend6(dp, TCP)
    unchanged(dp, prog, data)
    assert dp.counter("new_flow") == 0


def test_no_endpoints_tcp_gets_a_reset(dp: Dataplane) -> None:
    frontend6(dp, TCP, ())
    flow = Flow(CLIENT6, VIP6, 40600, PORT, TCP)
    data = frame6(flow, seq=5000)
    verdict, out = run(dp, TC_INGRESS, data)
    assert verdict == TC_ACT_REDIRECT
    assert out[:12] == data[6:12] + data[0:6], "back to the sender's link address"
    d = decode6(out)
    assert d.flow == flow.reply() and d.csum_ok
    seq, ack, flags = struct.unpack_from("!II", d.l4, 4) + (d.l4[13],)
    assert (seq, ack, flags) == (0, 5001, TCP_RST | TCP_ACK)
    assert dp.counter("no_backend") == 1


def test_no_endpoints_udp_gets_an_icmpv6_port_unreachable(dp: Dataplane) -> None:
    frontend6(dp, UDP, ())
    flow = Flow(CLIENT6, VIP6, 40700, PORT, UDP)
    data = frame6(flow, b"question")
    verdict, out = run(dp, TC_INGRESS, data)
    assert verdict == TC_ACT_REDIRECT
    assert out[:12] == data[6:12] + data[0:6]
    d = decode6(out)
    assert (d.src, d.dst, d.proto) == (VIP6, CLIENT6, ICMPV6)
    assert d.l4[:2] == bytes((ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH))
    # The quote: the datagram's IPv6 header and first 8 bytes, as sent.
    assert d.l4[8:] == data[ETH_HLEN : ETH_HLEN + IPV6_HLEN + 8]
    assert ones_sum(pseudo6(VIP6, CLIENT6, ICMPV6, len(d.l4)) + d.l4) == 0xFFFF, "ICMPv6 checksum"


def test_no_endpoints_with_extension_headers_is_dropped(dp: Dataplane) -> None:
    frontend6(dp, UDP, ())
    verdict, _ = run(dp, TC_INGRESS, frame6(Flow(CLIENT6, VIP6, 40800, PORT, UDP), exts=(HOPOPTS,)))
    assert verdict == TC_INGRESS.drop


@pytest.mark.parametrize("proto", BOTH)
def test_direct_connection_after_a_closed_service_one_on_the_same_ports_is_not_translated(
    dp: Dataplane, proto: int
) -> None:
    """The CT defect case: a Service flow ends, then the client talks to the backend itself from the same port.
    The old flow's reverse entry must not rewrite the backend's direct replies to come from the frontend."""
    frontend6(dp, proto)
    flow = Flow(CLIENT6, VIP6, 40900, PORT, proto)
    ip, port = dnat6(dp, TC_INGRESS, flow)
    run(dp, TC_EGRESS, frame6(Flow(ip, CLIENT6, port, 40900, proto), tcp_flags=TCP_SYN | TCP_ACK))
    if proto == TCP:
        dnat6(dp, TC_INGRESS, flow, tcp_flags=TCP_RST | TCP_ACK)
    direct = Flow(CLIENT6, ip, 40900, port, proto)
    unchanged(dp, TC_INGRESS, frame6(direct))
    assert dp.counter("ct_untracked") == 1
    unchanged(dp, TC_EGRESS, frame6(direct.reply(), b"direct", tcp_flags=TCP_SYN | TCP_ACK))
    # And the frontend starts a new flow.
    dnat6(dp, TC_INGRESS, flow)
    assert dp.counter("new_flow") == 2


def test_a_retransmitted_syn_follows_and_a_syn_after_a_reset_starts_a_new_flow(dp: Dataplane) -> None:
    frontend6(dp, TCP)
    flow = Flow(CLIENT6, VIP6, 41000, PORT, TCP)
    be = dnat6(dp, TC_INGRESS, flow)
    run(dp, TC_EGRESS, frame6(Flow(be[0], CLIENT6, be[1], 41000, TCP), tcp_flags=TCP_SYN | TCP_ACK))
    for _ in range(10):  # the client did not get the SYN-ACK: the same connection, to the same backend
        assert dnat6(dp, TC_INGRESS, flow) == be
    assert dp.counter("ct_reopened") == 0
    run(dp, TC_EGRESS, frame6(Flow(be[0], CLIENT6, be[1], 41000, TCP), tcp_flags=TCP_RST | TCP_ACK))
    dnat6(dp, TC_INGRESS, flow)
    assert dp.counter("ct_reopened") == 1


@pytest.mark.parametrize("sched", ["rr", "wrr", "lc", "sed", "nq", "sh", "dh", "maglev"])
def test_every_scheduler_picks_a_backend(dp: Dataplane, sched: str) -> None:
    """The schedulers' address-independent half is sched.h's, shared; the tables (wrr, maglev) are absent here, so
    those fall back to random as IPv4's do while a table is being written."""
    frontend6(dp, TCP, sched=sched)
    seen = {dnat6(dp, TC_INGRESS, Flow(CLIENT6, VIP6, 42000 + i, PORT, TCP)) for i in range(8)}
    assert seen <= set(BACKENDS6) and seen
    if sched == "rr":
        assert seen == set(BACKENDS6)
    if sched in ("sh", "dh"):
        assert len(seen) == 1
    if sched in ("lc", "sed", "nq"):
        # Each new flow went to the backend with fewer open ones: they alternate.
        assert seen == set(BACKENDS6)
        assert sorted(dp.maps.backends6[abi.Backend6(abi.in6(ip), abi.be16(p))].active for ip, p in BACKENDS6) == [4, 4]


# -- NodePort SNAT --------------------------------------------------------------------------------------------

NODE6, NODE_PORT = "fd00:ee::1", 30080
NODE_SIDE6 = "fd00:1::fe"
"""The node's address on the backends' network (fd00:1::/64): where SNATed flows come from."""


@pytest.fixture
def node6() -> Iterator[tuple[NetnsThread, int]]:
    with scratch_node("pyp-snat6", [("snat0", "10.0.1.254/24")]) as (thread, ifindex):
        for cmd in (["sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"],
                    ["ip", "addr", "add", f"{NODE_SIDE6}/64", "dev", "snat0", "nodad"]):
            subprocess.run(["ip", "netns", "exec", thread.netns, *cmd], check=True)
        yield thread, ifindex["snat0"]


@pytest.fixture(params=["fib-src", "device-map"])
def dp6(request: pytest.FixtureRequest, load: Load, node6: tuple[NetnsThread, int]) -> Iterator[Dataplane]:
    if request.param == "fib-src" and not kernel.features().fib_src:
        pytest.skip(f"this kernel ({kernel.release()}) has no BPF_FIB_LOOKUP_SRC")
    flags = abi.KERNEL_FIB_SRC if request.param == "fib-src" else 0
    d = Dataplane(load(None, max_entries=CAPACITY, kernel_flags=flags))
    if not flags:
        d.maps.devaddrs6[ctypes.c_uint32(node6[1])] = abi.in6(NODE_SIDE6)
    yield d
    d.close()


@pytest.mark.parametrize("proto", BOTH)
@pytest.mark.parametrize("prog", INGRESS)
def test_nodeport_snat_and_the_reply_finds_its_way_back(dp6: Dataplane, node6: tuple[NetnsThread, int], prog: Prog,
                                                         proto: int) -> None:
    thread, ifindex = node6
    frontend6(dp6, proto, vip=NODE6, port=NODE_PORT, flags=abi.SVC_F_MASQ)
    client = Flow(CLIENT6, NODE6, 43000, NODE_PORT, proto)

    def through(p: Prog, data: bytes) -> bytes:
        verdict, out = thread.call(dp6.run, p, data, ifindex)
        assert verdict == p.ok
        verdict, out = dp6.run(TC_EGRESS, out)
        assert verdict == TC_EGRESS.ok
        assert decode6(out).csum_ok, "a receiver would drop the translated packet"
        return out

    out = decode6(through(prog, frame6(client)))
    assert out.src == NODE_SIDE6 and (out.dst, out.flow.dport) in BACKENDS6
    snat_port = out.flow.sport
    assert abi.DEFAULT_SNAT_PORTS[0] <= snat_port <= abi.DEFAULT_SNAT_PORTS[1]
    assert dp6.counter("snat") == 1
    back = decode6(through(TC_INGRESS, frame6(out.flow.reply(), b"answer", tcp_flags=TCP_SYN | TCP_ACK)))
    assert back.flow == client.reply()
    assert dp6.counter("revsnat") == 1
    # The client's next packet takes the same way.
    assert decode6(through(TC_INGRESS, frame6(client, tcp_flags=TCP_ACK))).flow == out.flow


def ct6_states(dp: Dataplane) -> list[tuple[int, int, int]]:
    """Every IPv6 flow entry's direction, state and flags, in key order."""
    return sorted((k.dir, v.state, v.flags) for k, v in ((k, dp.maps.ct6[k]) for k in dp.maps.ct6))


@pytest.mark.parametrize("prog", INGRESS)
def test_an_out_of_window_reset_leaves_an_snated_ipv6_flow_as_it_was(dp6: Dataplane, node6: tuple[NetnsThread, int],
                                                                     prog: Prog) -> None:
    """ct.h's RST window, IPv6 (test_ct.py has IPv4's cases): a NodePort flow through SNAT, data both ways, then a
    forged RST from each side outside its sender's window: passed on, counted, the flow and its SNAT pair as they
    were; the backend's own RST closes both pairs."""
    thread, ifindex = node6
    frontend6(dp6, TCP, vip=NODE6, port=NODE_PORT, flags=abi.SVC_F_MASQ)
    client = Flow(CLIENT6, NODE6, 43100, NODE_PORT, TCP)
    c_isn, b_isn, far = 7_000_000, 0xFFFF_FF00, 1 << 31

    def through(p: Prog, data: bytes) -> Flow:
        verdict, out = thread.call(dp6.run, p, data, ifindex)
        assert verdict == p.ok
        verdict, out = dp6.run(TC_EGRESS, out)
        assert verdict == TC_EGRESS.ok
        return decode6(out).flow

    out = through(prog, frame6(client, seq=c_isn))
    back = out.reply()  # the backend's packets, to the node's address and SNAT port
    assert through(TC_INGRESS, frame6(back, tcp_flags=TCP_SYN | TCP_ACK, seq=b_isn, ack=c_isn + 1)) == client.reply()
    through(prog, frame6(client, b"request", tcp_flags=TCP_ACK, seq=c_isn + 1, ack=b_isn + 1))
    through(TC_INGRESS, frame6(back, b"x" * 1000, tcp_flags=TCP_ACK, seq=b_isn + 1, ack=c_isn + 8))
    c_end, b_end = c_isn + 8, (b_isn + 1001) & 0xFFFF_FFFF
    through(prog, frame6(client, tcp_flags=TCP_ACK, seq=c_end, ack=b_end))
    established = ct6_states(dp6)
    assert len(established) == 4 and {st for _, st, _ in established} == {abi.CT_ST_ESTABLISHED}

    assert through(prog, frame6(client, tcp_flags=TCP_RST, seq=c_end + far)) == out, "not passed on to the backend"
    assert through(TC_INGRESS, frame6(back, tcp_flags=TCP_RST, seq=(b_end + far) & 0xFFFF_FFFF)) == client.reply()
    assert ct6_states(dp6) == established, "an out-of-window RST changed the flow or its SNAT pair"
    assert dp6.counter("ct_rst_ignored") == 4, "each RST counted once per pair it passed (Service flow, SNAT pair)"
    through(TC_INGRESS, frame6(back, tcp_flags=TCP_RST | TCP_ACK, seq=b_end, ack=c_end))
    assert {st for _, st, _ in ct6_states(dp6)} == {abi.CT_ST_CLOSED}


# -- ICMPv6 errors about translated flows -----------------------------------------------------------------------

ROUTER6 = "fd00:2::fe"


@pytest.mark.parametrize("proto", BOTH)
def test_packet_too_big_from_a_router_reaches_the_client_about_its_own_packet(dp: Dataplane, proto: int) -> None:
    """Path-MTU discovery through a ClusterIP: the router saw client -> backend; the client must see its own
    client -> frontend in the quote, every checksum recomputed (the quoted TCP/UDP one too)."""
    frontend6(dp, proto)
    flow = Flow(CLIENT6, VIP6, 44000, PORT, proto)
    ip, port = dnat6(dp, TC_INGRESS, flow, b"big" * 8)
    seen = packet6(flow.to(ip, port), b"big" * 8)
    verdict, out = run(dp, TC_EGRESS, icmp6_error(ROUTER6, CLIENT6, ICMP6_PKT_TOOBIG, 0, seen, rest=1280))
    assert verdict == TC_ACT_OK
    assert out == icmp6_error(ROUTER6, CLIENT6, ICMP6_PKT_TOOBIG, 0, packet6(flow, b"big" * 8), rest=1280)
    assert dp.counter("icmp_nat") == 1


def test_port_unreachable_from_the_backend_itself_comes_from_the_frontend(dp: Dataplane) -> None:
    frontend6(dp, UDP)
    flow = Flow(CLIENT6, VIP6, 44100, PORT, UDP)
    ip, port = dnat6(dp, TC_INGRESS, flow, b"q")
    quoted = packet6(flow.to(ip, port), b"q")
    verdict, out = run(dp, TC_EGRESS, icmp6_error(ip, CLIENT6, ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH, quoted))
    assert out == icmp6_error(VIP6, CLIENT6, ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH, packet6(flow, b"q"))


def test_an_error_about_a_reply_reaches_the_backend_about_its_own_packet(dp: Dataplane) -> None:
    """The client's stack answers the frontend's reply with an error: it enters toward the frontend and must reach
    the backend quoting backend -> client."""
    frontend6(dp, UDP)
    flow = Flow(CLIENT6, VIP6, 44200, PORT, UDP)
    ip, port = dnat6(dp, TC_INGRESS, flow, b"q")
    back = Flow(ip, CLIENT6, port, 44200, UDP)
    verdict, out = run(dp, TC_INGRESS, icmp6_error(CLIENT6, VIP6, ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH,
                                                   packet6(flow.reply(), b"a")))
    assert verdict == TC_ACT_OK
    assert out == icmp6_error(CLIENT6, ip, ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH, packet6(back, b"a"))


@pytest.mark.parametrize("prog", [pytest.param(TC_INGRESS, id="tc"), pytest.param(TC_EGRESS, id="tc-egress")])
def test_icmpv6_errors_about_other_flows_pass_untouched(dp: Dataplane, prog: Prog) -> None:
    frontend6(dp, TCP)
    other = packet6(Flow(CLIENT6, "fd00:1::9", 44300, 443, TCP))
    unchanged(dp, prog, icmp6_error(ROUTER6, CLIENT6, ICMP6_PKT_TOOBIG, 0, other, rest=1280))
    assert dp.counter("icmp_nat") == 0


# -- programmed by render(), as the control plane will ------------------------------------------------------------


def _state6(proto: int = TCP, backends: tuple[tuple[str, int], ...] = BACKENDS6, scheduler: str = "",
            vip: str = VIP6) -> ServicePortState:
    bes = tuple(sorted(Backend(ip, p) for ip, p in backends))
    # wrr has a table only when the weights differ.
    weights = ((bes[0].ip, 3), (bes[1].ip, 1)) if scheduler == "wrr" else ()
    return ServicePortState(service=SERVICE, port_name=f"v6-{proto}", frontend=Frontend(vip, PORT, PROTOS[proto]),
                            backends=bes, known_backends=bes, scheduler=scheduler, weights=weights)


@pytest.mark.parametrize("scheduler", ["", "wrr", "maglev"])
def test_render_programs_ipv6_frontends_beside_ipv4_ones(dp: Dataplane, scheduler: str) -> None:
    """A dual-stack Service's two frontends: render writes each to its family's maps (the tables too, for wrr and
    Maglev), the programs serve both, a restart reads both back, and the Service's removal takes both out."""
    plan = dp.apply(port_state(TCP), _state6(TCP, scheduler=scheduler))
    assert {b.map for b in plan.batches} >= {abi.MAP_SERVICES, abi.MAP_SERVICES6, abi.MAP_SLOTS6, abi.MAP_BACKENDS6}
    if scheduler:
        assert abi.MAP_TABLES6 in {b.map for b in plan.batches}
        assert len(dp.maps.tables6.arrays) == 1
    dnat6(dp, TC_INGRESS, Flow(CLIENT6, VIP6, 45000, PORT, TCP))
    dnat(dp, TC_INGRESS, Flow(CLIENT, VIP, 45000, PORT, TCP))
    # What a restart reads back (IPv4's read-back is test_maps.py's).
    read = dp.maps.read_applied()
    key6 = (VIP6, PORT, "TCP", abi.SVC_SCOPE_PACKETS)
    assert read.frontends[key6] == dp.applied.frontends[key6]
    assert {b for b in read.backend_refs if ":" in b.ip} == {Backend(ip, p) for ip, p in BACKENDS6}
    dp.apply(service=SERVICE)
    assert len(dp.maps.services6) == len(dp.maps.slots6) == len(dp.maps.backends6) == 0
    assert len(dp.maps.services) == 0 and len(dp.maps.tables6.outer) == 0
    unchanged(dp, TC_INGRESS, frame6(Flow(CLIENT6, VIP6, 45001, PORT, TCP)))


def test_a_restart_without_pins_finds_the_ipv6_maps_through_the_program_arrays(dp: Dataplane) -> None:
    """What a restart adopts when no pin is reachable (attach.maps_in_use): the attached IPv4 programs' maps, and
    through their program arrays the IPv6 programs' (which the IPv4 programs do not hold)."""
    found = {name: os.dup(fd) for name, fd in dp.obj.maps.items() if name in abi.JUMPS6}
    try:
        for pid in attach.jumped_to(found):
            attach._add_maps_of(pid, found)
        assert {abi.MAP_CT6, abi.MAP_SERVICES6, abi.MAP_SLOTS6, abi.MAP_BACKENDS6, abi.MAP_FRAGS6} <= found.keys()
        assert loader.map_info(found[abi.MAP_CT6]).id == loader.map_info(dp.obj.maps[abi.MAP_CT6]).id
    finally:
        for fd in found.values():
            os.close(fd)


def test_clients_outside_the_cluster_cidrs_ipv6_half_are_masqueraded(load: Load, node6: tuple[NetnsThread, int]
                                                                      ) -> None:
    """--cluster-cidr with an IPv6 prefix (dual stack: "v4,v6", MasqueradeSettings.cluster_cidr6): a ClusterIP
    flagged F_MASQ_OUTSIDE SNATs IPv6 clients outside that prefix, and leaves those inside their own address."""
    thread, ifindex = node6
    d = Dataplane(load(None, max_entries=CAPACITY, cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:c::/48"))
    try:
        frontend6(d, TCP, flags=abi.SVC_F_MASQ_OUTSIDE)

        def leaving(client: str, sport: int) -> str:
            verdict, out = thread.call(d.run, TC_INGRESS, frame6(Flow(client, VIP6, sport, PORT, TCP)), ifindex)
            verdict, out = d.run(TC_EGRESS, out)
            assert decode6(out).csum_ok
            return decode6(out).src

        assert leaving(CLIENT6, 46000) == CLIENT6  # fd00:c::10, inside fd00:c::/48
        assert leaving("fd00:99::10", 46001) == NODE_SIDE6
        assert d.counter("snat") == 1
    finally:
        d.close()


def test_an_ipv6_pod_reaches_every_endpoint_of_a_local_frontend(load: Load) -> None:
    """pyproxy_lb6_pod_view, the IPv6 short circuit on TC: a source inside --cluster-cidr's IPv6 prefix reaching an
    externalTrafficPolicy Local external IP is served from every endpoint, unmasqueraded (dnat6 checks the frame);
    an outside client from this node's endpoint only."""
    d = Dataplane(load(None, max_entries=CAPACITY, cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:c::/48"))
    try:
        bes = tuple(sorted(Backend(ip, p) for ip, p in BACKENDS6))
        d.apply(ServicePortState(service=SERVICE, port_name="ext6", frontend=Frontend("fd00:ee::1", PORT, PROTOS[TCP]),
                                 backends=bes, known_backends=bes, kind=FrontendKind.EXTERNAL_IP,
                                 external_backends=bes[:1]))
        from_pod = {dnat6(d, TC_INGRESS, Flow(CLIENT6, "fd00:ee::1", 48000 + i, PORT, TCP)) for i in range(30)}
        assert from_pod == set(BACKENDS6), f"a pod reached only {from_pod}"
        outside = {dnat6(d, TC_INGRESS, Flow("fd00:99::10", "fd00:ee::1", 48100 + i, PORT, TCP)) for i in range(30)}
        assert outside == {BACKENDS6[0]}
    finally:
        d.close()


def test_ipv6_backends_have_per_endpoint_counters(load: Load) -> None:
    """--bpf-endpoint-counters: render keeps an entry per IPv6 backend in PYPROXY_MAP_EPSTATS6, and the programs
    count the packets and bytes each one got, new flow and established alike."""
    d = Dataplane(load(None, max_entries=CAPACITY, endpoint_counters=True), endpoint_counters=True)
    try:
        d.apply(_state6(TCP, backends=BACKENDS6[:1]))
        assert set(d.maps.endpoint_stats()) == {Backend(*BACKENDS6[0])}
        flow = Flow(CLIENT6, VIP6, 47000, PORT, TCP)
        data = frame6(flow)
        dnat6(d, TC_INGRESS, flow)
        dnat6(d, TC_INGRESS, flow, tcp_flags=TCP_ACK)
        assert d.maps.endpoint_stats()[Backend(*BACKENDS6[0])] == (2, 2 * len(data))
        d.apply(service=SERVICE)
        assert d.maps.endpoint_stats() == {}
    finally:
        d.close()


def test_inspect_shows_ipv6_frontends_and_flows(dp: Dataplane) -> None:
    dp.apply(_state6(TCP, scheduler="lc"))
    ip, port = dnat6(dp, TC_INGRESS, Flow(CLIENT6, VIP6, 48000, PORT, TCP))
    view = inspect.view(dp.maps)
    fe = next(f for f in view.frontends if f.ip == VIP6)
    assert {(e.ip, e.port) for e in fe.endpoints} == set(BACKENDS6)
    assert sum(e.active or 0 for e in fe.endpoints) == 1
    assert [f.backend for f in view.flows] == [f"[{ip}]:{port}"]
    text = inspect.report(dp.maps)
    assert f"[{VIP6}]:{PORT}/TCP" in text and f"[{ip}]:{port}" in text and f"[{CLIENT6}]:48000" in text, text
