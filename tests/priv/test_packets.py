"""The programs of bpf/build/pyproxy.bpf.o, driven packet by packet with BPF_PROG_TEST_RUN.

Each test loads its own copy of the object (fresh maps), programs it the way pyproxy does (render() ->
Maps.run) and checks what a user would notice: where a packet goes, whether a receiver accepts its
checksums, and what the counters say. Frames come from tests/priv/packets.py.

What BPF_PROG_TEST_RUN cannot show, left to the end-to-end tests: test skbs are linear and CHECKSUM_NONE,
so TC's header pull and the skb checksum helpers' CHECKSUM_PARTIAL / CHECKSUM_COMPLETE handling
(BPF_F_PSEUDO_HDR) are not exercised here; and skb test runs refuse IPv4 frames shorter than an IPv4 header.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import Load
from harness import (
    ALL_PROGS,
    BOTH_PROTOS,
    CAPACITY,
    CLIENT,
    INGRESS,
    NOT_READY,
    PORT,
    READY,
    ROOT,
    TC_ACT_OK,
    TC_EGRESS,
    TC_INGRESS,
    VIP,
    XDP,
    XDP_PASS,
    Dataplane,
    Prog,
    assert_checksums_valid,
    dnat,
    port_state,
)
from packets import (
    ETH_P_8021Q,
    ETH_P_ARP,
    ETH_P_IP,
    ETH_P_IPV6,
    ETH_ZLEN,
    ICMP,
    IP_MF,
    TCP,
    TCP_ACK,
    UDP,
    Flow,
    L4Csum,
    checksum,
    decode,
    ethernet,
    frame,
    ipv4,
    l4_segment,
    ones_sum,
    payload_for_checksum,
    pseudo_header,
    pseudo_header_sum,
)

from pyproxy.dataplane.bpf import abi, clock, libbpf, loader
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

pytestmark = ROOT


# -- the test helpers themselves ------------------------------------------------------------------


def test_checksum_helpers_match_known_values() -> None:
    assert ones_sum(bytes.fromhex("0001f203f4f5f6f7")) == 0xDDF2  # RFC 1071 section 3
    header = bytes.fromhex("450000730000400040110000c0a80001c0a800c7")  # the classic worked example
    assert checksum(header) == 0xB861
    udp = Flow("192.0.2.1", "198.51.100.2", 1234, 53, UDP)
    seg = l4_segment(udp, b"odd")
    assert ones_sum(pseudo_header(udp.src, udp.dst, UDP, len(seg)) + seg) == 0xFFFF
    assert decode(frame(udp, b"odd")).l4_csum_ok
    broken = bytearray(frame(udp, b"odd"))
    broken[14 + 20 + 8] ^= 1  # flip a payload bit: the verifier must notice
    assert not decode(bytes(broken)).l4_csum_ok
    for flow in (udp, Flow("192.0.2.1", "198.51.100.2", 1234, 80, TCP)):
        for value in (0x0000, 0x0001, 0xBEEF, 0xFFFE):
            got = decode(frame(flow, payload_for_checksum(flow, 12, value))).l4_csum
            assert got == (0xFFFF if (value, flow.proto) == (0, UDP) else value)


# -- DNAT on the way in ---------------------------------------------------------------------------


@pytest.mark.parametrize("proto", BOTH_PROTOS)
@pytest.mark.parametrize("prog", INGRESS)
def test_new_flows_spread_over_ready_backends_only(dp: Dataplane, prog: Prog, proto: int) -> None:
    dp.apply(port_state(proto))
    chosen = {dnat(dp, prog, Flow(CLIENT, VIP, sport, PORT, proto), b"hello") for sport in range(40000, 40300)}
    assert chosen == set(READY)  # every ready backend, never the not-ready one
    assert dp.counter("new_flow") == 300


@pytest.mark.parametrize("prog", INGRESS)
def test_ip_options_do_not_confuse_the_translation(dp: Dataplane, prog: Prog) -> None:
    dp.apply(port_state(TCP))
    router_alert = bytes.fromhex("94040000")
    dnat(dp, prog, Flow(CLIENT, VIP, 40000, PORT), b"x", options=router_alert)


@pytest.mark.parametrize("prog", INGRESS)
def test_established_flow_keeps_its_backend_until_the_backend_is_gone(dp: Dataplane, prog: Prog) -> None:
    dp.apply(port_state(TCP))
    flow = Flow(CLIENT, VIP, 41000, PORT)
    first = dnat(dp, prog, flow)
    for _ in range(5):
        assert dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK) == first
    assert dp.counter("established") == 5

    # Not ready (terminating) but still an endpoint: the connection stays where it is.
    rest = tuple(b for b in READY if b != first)
    dp.apply(port_state(TCP, rest, (first,)))
    assert dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK) == first

    # Gone from the slices: it leaves MAP_BACKENDS and the flow moves to a ready backend, then stays.
    dp.apply(port_state(TCP, rest, ()))
    assert abi.Backend(abi.be32(first.ip), abi.be16(first.port)) not in dp.maps.backends
    moved = dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK)
    assert moved in rest
    assert dp.counter("rebalanced") == 1
    assert dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK) == moved


@pytest.mark.parametrize("prog", INGRESS)
def test_an_established_flow_checks_its_backend_again_only_in_a_new_backends_epoch(dp: Dataplane, prog: Prog) -> None:
    """The contract with the control plane: while the backends epoch is the one a flow was confirmed at, its
    packets skip the endpoint lookup; once it changes, the next packet checks the backend (and keeps it
    when it is still an endpoint). The control plane bumps the epoch only after deleting backends."""
    dp.apply(port_state(TCP))
    flow = Flow(CLIENT, VIP, 41100, PORT)
    first = dnat(dp, prog, flow)
    fwd = abi.CtKey(abi.be32(CLIENT), abi.be32(VIP), abi.be16(41100), abi.be16(PORT), TCP, abi.CT_FORWARD)
    assert dp.maps.ct[fwd].epoch == dp.applied.epoch == 0

    # Not ready (no slot, still an endpoint: no new epoch), then gone behind the control plane's back: with
    # no new epoch the flow still trusts it.
    rest = tuple(b for b in READY if b != first)
    assert all(op.map != abi.MAP_EPOCH for op in dp.apply(port_state(TCP, rest, (first, NOT_READY))).ops)
    del dp.maps.backends[abi.Backend(abi.be32(first.ip), abi.be16(first.port))]
    assert dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK) == first
    # A new epoch: the next packet checks, finds it gone and moves the flow.
    dp.maps.bump_epoch(dp.applied)
    moved = dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK)
    assert moved in rest and dp.counter("rebalanced") == 1

    # A still-alive backend keeps its flow across a new epoch, and the entry is confirmed at it.
    dp.maps.bump_epoch(dp.applied)
    assert dnat(dp, prog, flow, b"data", tcp_flags=TCP_ACK) == moved
    assert dp.maps.ct[fwd].epoch == dp.applied.epoch == 2 and dp.counter("rebalanced") == 1


@pytest.mark.parametrize("prog", INGRESS)
def test_client_ip_affinity_keeps_a_client_on_one_backend(dp: Dataplane, prog: Prog) -> None:
    dp.apply(port_state(TCP, affinity=10800))
    for client in ("192.168.1.10", "192.168.1.11", "192.168.1.12", "192.168.1.13"):
        chosen = {dnat(dp, prog, Flow(client, VIP, sport, PORT)) for sport in range(42000, 42050)}
        assert len(chosen) == 1, f"{client} went to {sorted(chosen)}"
        assert chosen <= set(READY)


@pytest.mark.parametrize("prog", INGRESS)
def test_client_ip_affinity_lasts_its_timeout_in_the_kernels_ticks(dp: Dataplane, prog: Prog) -> None:
    """The timeout reaches the map in ticks (jiffies, HZ per second) and the datapath compares it with its own
    clock: a client's affinity entry 9 s old (of 10) still decides its new connection, one 11 s old does not;
    flow entries are stamped on the same timeline that `pyproxy inspect` reads idle ages from."""
    hz = clock.kernel_hz()
    state = port_state(TCP, affinity=10, scheduler="dh")
    dp.apply(state)
    assert dp.maps.services[abi.SvcKey(abi.be32(VIP), abi.be16(PORT), TCP)].affinity_ticks == 10 * hz
    key = abi.CtKey(abi.be32(CLIENT), abi.be32(VIP), 0, abi.be16(PORT), TCP, abi.CT_AFFINITY)
    # dh sends every new flow to the one backend the frontend's address picks; the remembered backend is another
    # ready one, which only affinity can choose.
    picked = dnat(dp, prog, Flow("192.168.1.99", VIP, 45000, PORT))
    remembered = next(b for b in READY if b != picked)
    for age, want in ((9, remembered), (11, picked)):
        dp.maps.ct[key] = abi.CtValue(nat_addr=abi.be32(remembered.ip), nat_port=abi.be16(remembered.port),
                                      svc_id=dp.svc_id(state), last_seen=clock.ticks_now() - age * hz)
        got = dnat(dp, prog, Flow(CLIENT, VIP, 45000 + age, PORT))
        assert got == want, f"affinity {age} s old: went to {got}"
    renewed = dp.maps.ct[key]
    assert Backend(abi.ip_of(renewed.nat_addr), abi.port_of(renewed.nat_port)) == got
    fwd = dp.maps.ct[abi.CtKey(abi.be32(CLIENT), abi.be32(VIP), abi.be16(45011), abi.be16(PORT), TCP, abi.CT_FORWARD)]
    for v in (renewed, fwd):
        assert abs(v.last_seen - clock.ticks_now()) <= hz // 2, "stamped on another clock than ticks_now()"


@pytest.mark.parametrize("prog", INGRESS)
def test_per_frontend_stats_count_packets_and_bytes(dp: Dataplane, prog: Prog) -> None:
    tcp, udp = port_state(TCP), port_state(UDP, port=53)
    dp.apply(tcp, udp)
    sent = {TCP: [0, 0], UDP: [0, 0]}
    for sport, proto, dport, payload in ((44000, TCP, PORT, b""), (44000, TCP, PORT, b"x" * 100),
                                         (44001, TCP, PORT, b"y" * 1000), (44000, UDP, 53, b"q" * 30)):
        data = frame(Flow(CLIENT, VIP, sport, dport, proto), payload)
        assert dp.run(prog, data)[0] == prog.ok
        sent[proto][0] += 1
        sent[proto][1] += len(data)
    dp.run(prog, frame(Flow(CLIENT, VIP, 44000, 81), b"not ours"))  # not a frontend: not counted
    assert dp.stats(dp.svc_id(tcp)) == tuple(sent[TCP])
    assert dp.stats(dp.svc_id(udp)) == tuple(sent[UDP])

    # A frontend that replaces a removed one may get its id: it starts from zero.
    old_id = dp.svc_id(udp)
    dp.apply(tcp)
    other = ServicePortState("default/other", "", Frontend("10.96.0.20", 53, Protocol.UDP), READY)
    dp.apply(other, service="default/other")
    assert dp.svc_id(other) == old_id
    assert dp.stats(old_id) == (0, 0)


# -- checksum corner cases ------------------------------------------------------------------------


@pytest.mark.parametrize("prog", INGRESS)
def test_udp_without_checksum_keeps_none(dp: Dataplane, prog: Prog) -> None:
    dp.apply(port_state(UDP))
    be = dnat(dp, prog, Flow(CLIENT, VIP, 45000, PORT, UDP), b"hello", csum=L4Csum.NONE)
    assert be in READY  # dnat() compared with the frame built with checksum 0


@pytest.mark.parametrize("prog", INGRESS)
def test_udp_checksum_that_computes_to_zero_is_sent_as_all_ones(dp: Dataplane, prog: Prog) -> None:
    backend = READY[0]
    dp.apply(port_state(UDP, (backend,), ()))
    flow = Flow(CLIENT, VIP, 45001, PORT, UDP)
    payload = payload_for_checksum(flow.to(backend.ip, backend.port), 12, 0)
    before, after = decode(frame(flow, payload)), decode(frame(flow.to(backend.ip, backend.port), payload))
    # The construction hits the case: an ordinary checksum before, a computed 0 (sent as 0xffff) after.
    assert before.l4_csum not in (0, 0xFFFF, pseudo_header_sum(CLIENT, VIP, UDP, before.l4_len))
    assert after.l4_csum == 0xFFFF and after.l4_csum_ok
    assert dnat(dp, prog, flow, payload) == backend


@pytest.mark.parametrize("proto", BOTH_PROTOS)
def test_xdp_leaves_a_checksum_partial_packet_to_tc(dp: Dataplane, proto: int) -> None:
    """A packet from a veth peer or a local socket carries only the pseudo-header sum (the rest is added on
    transmit). XDP cannot see skb->ip_summed, so it passes the packet untouched and makes no decision;
    TC ingress, whose checksum helpers know the form, translates it."""
    dp.apply(port_state(proto))
    for sport in range(46000, 46020):
        flow = Flow(CLIENT, VIP, sport, PORT, proto)
        packet = frame(flow, b"hello", csum=L4Csum.PARTIAL)
        verdict, out = dp.run(XDP, packet)
        assert verdict == XDP_PASS
        assert out == packet, "XDP must not touch a packet whose checksum form it cannot tell"
        assert dnat(dp, TC_INGRESS, flow, b"hello") in READY, "TC ingress still serves the flow"


@pytest.mark.parametrize("proto", BOTH_PROTOS)
def test_xdp_complete_checksum_that_looks_partial_stays_valid(dp: Dataplane, proto: int) -> None:
    """A complete checksum equal to the pseudo-header sum (one packet in 65535) is ambiguous: XDP leaves it
    untouched, so a retransmission that repeats it byte for byte is never corrupted; TC translates it."""
    dp.apply(port_state(proto))
    flow = Flow(CLIENT, VIP, 46100, PORT, proto)
    hlen = 20 if proto == TCP else 8
    payload = payload_for_checksum(flow, 12, pseudo_header_sum(CLIENT, VIP, proto, hlen + 12))
    packet = frame(flow, payload)
    verdict, out = dp.run(XDP, packet)
    assert verdict == XDP_PASS and out == packet
    assert dnat(dp, TC_INGRESS, flow, payload) in READY


# -- reverse NAT on the way out -------------------------------------------------------------------


@pytest.mark.parametrize("proto", BOTH_PROTOS)
@pytest.mark.parametrize("prog", INGRESS)
def test_reply_from_backend_gets_the_frontend_address_back(dp: Dataplane, prog: Prog, proto: int) -> None:
    dp.apply(port_state(proto))
    for sport in range(47000, 47020):
        request = Flow(CLIENT, VIP, sport, PORT, proto)
        be = dnat(dp, prog, request, b"ping")
        reply = request.to(be.ip, be.port).reply()
        verdict, out = dp.run(TC_EGRESS, frame(reply, b"pong!", tcp_flags=TCP_ACK))
        assert verdict == TC_ACT_OK
        assert out == frame(reply.from_(VIP, PORT), b"pong!", tcp_flags=TCP_ACK)
        assert_checksums_valid(out)
    assert dp.counter("revnat") == 20


@pytest.mark.parametrize("proto", BOTH_PROTOS)
def test_egress_packet_of_no_flow_is_untouched(dp: Dataplane, proto: int) -> None:
    dp.apply(port_state(proto))
    be = dnat(dp, TC_INGRESS, Flow(CLIENT, VIP, 48000, PORT, proto))
    for stranger in (Flow(be.ip, CLIENT, be.port, 48001, proto),  # another client port
                     Flow(be.ip, "192.168.1.99", be.port, 48000, proto),  # another client
                     Flow(NOT_READY.ip, CLIENT, NOT_READY.port, 48000, proto)):  # another backend
        data = frame(stranger, b"pong")
        assert dp.run(TC_EGRESS, data) == (TC_ACT_OK, data)
    assert dp.counter("revnat") == 0


# -- everything else passes untouched -------------------------------------------------------------


def _ip_to_vip(proto: int, body: bytes, *, frag: int = 0, ihl: int | None = None, tot_len: int | None = None,
               pad_to: int = ETH_ZLEN) -> bytes:
    return ethernet(ETH_P_IP, ipv4(CLIENT, VIP, proto, body, frag=frag, ihl=ihl, tot_len=tot_len), pad_to)


def _tcp_to_vip() -> bytes:
    return l4_segment(Flow(CLIENT, VIP, 49000, PORT), b"")


def _udp_to_vip() -> bytes:
    return l4_segment(Flow(CLIENT, VIP, 49000, PORT, UDP), b"")


def _tcp_packet_to_vip() -> bytes:
    return ipv4(CLIENT, VIP, TCP, _tcp_to_vip())


OTHER_TRAFFIC = {
    "other-port": frame(Flow(CLIENT, VIP, 49000, 81)),
    "other-address": frame(Flow(CLIENT, "10.96.0.11", 49000, PORT)),
    "sctp-same-port": _ip_to_vip(socket.IPPROTO_SCTP, struct.pack("!HHII", 49000, PORT, 0, 0)),
    "icmp-echo": _ip_to_vip(ICMP, bytes.fromhex("0800f7ff00000000")),
    "arp": ethernet(ETH_P_ARP, bytes.fromhex("0001080006040001") + bytes(6) + socket.inet_aton(CLIENT)
                    + bytes(6) + socket.inet_aton(VIP), ETH_ZLEN),
    "ipv6": ethernet(ETH_P_IPV6, bytes.fromhex("6000000000140640") + bytes(15) + b"\1" + bytes(15) + b"\2"
                     + _tcp_to_vip()),
    "vlan-tagged": ethernet(ETH_P_8021Q, struct.pack("!HH", 100, ETH_P_IP) + _tcp_packet_to_vip()),
    "later-fragment": _ip_to_vip(UDP, struct.pack("!HHHH", 49000, PORT, 24, 0) + b"b" * 16, frag=IP_MF | 3),
    "last-fragment": _ip_to_vip(TCP, _tcp_to_vip(), frag=5),
}

MALFORMED = {
    "ethernet-only": ethernet(ETH_P_IP, b""),
    "ipv4-header-cut": ethernet(ETH_P_IP, _tcp_packet_to_vip()[:12]),
    # ihl 0 and a total length of 80: read as a TCP header, the IPv4 header itself says "to port 80".
    "ihl-below-5": _ip_to_vip(TCP, _tcp_to_vip() + b"p" * 40, ihl=0),
    "ihl-beyond-frame": _ip_to_vip(UDP, _udp_to_vip(), ihl=15, tot_len=60 + 8, pad_to=0),
    "version-6-in-ipv4": ethernet(ETH_P_IP, bytes([0x65]) + _tcp_packet_to_vip()[1:]),
    "tcp-header-cut": ethernet(ETH_P_IP, ipv4(CLIENT, VIP, TCP, _tcp_to_vip()[:12])),
    "udp-header-cut": ethernet(ETH_P_IP, ipv4(CLIENT, VIP, UDP, struct.pack("!HH", 49000, PORT))),
    "tot-len-below-tcp-header": _ip_to_vip(TCP, _tcp_to_vip(), tot_len=20 + 12),
    "tot-len-below-udp-header": _ip_to_vip(UDP, _udp_to_vip(), tot_len=20 + 4),
    "tot-len-below-ip-header": _ip_to_vip(TCP, _tcp_to_vip(), tot_len=10),
    # A total length of 0 is BIG TCP's only in a packet over 64 KB (tests/e2e/test_big_tcp_e2e.py); here, malformed.
    "tot-len-zero-not-big": _ip_to_vip(TCP, _tcp_to_vip(), tot_len=0),
}


@pytest.mark.parametrize("data", [pytest.param(v, id=k) for k, v in {**OTHER_TRAFFIC, **MALFORMED}.items()])
@pytest.mark.parametrize("prog", ALL_PROGS)
def test_anything_else_passes_untouched(dp: Dataplane, prog: Prog, data: bytes) -> None:
    """Frontends on both protocols exist, so a parser that overlooked any of these would translate it."""
    if prog is not XDP and data[12:14] == struct.pack("!H", ETH_P_IP) and len(data) < 14 + 20:
        # The kernel's skb test run refuses (EINVAL) an IPv4 frame without a whole IPv4 header, so TC cannot
        # be fed one here; the same parse.h code runs in XDP, which is fed these bytes.
        pytest.skip("BPF_PROG_TEST_RUN for skbs needs a complete IPv4 header")
    dp.apply(port_state(TCP), port_state(UDP))
    assert dp.run(prog, data) == (prog.ok, data)
    assert len(dp.maps.ct) == 0
    assert not any(dp.counters().values())


@pytest.mark.parametrize("prog", INGRESS)
def test_a_packet_to_a_nodeport_on_127_0_0_1_is_never_translated(dp: Dataplane, prog: Prog) -> None:
    """localhostNodePorts serves the node's own sockets only: a packet addressed to 127.0.0.1 that arrives on a
    device is a neighbour's, which must not reach a Service through it (CVE-2020-8558). The same NodePort on a node
    address is translated."""
    node_port = replace(port_state(TCP, port=30080), kind=FrontendKind.NODE_PORT, external_backends=READY)
    dp.apply(replace(node_port, frontend=Frontend("127.0.0.1", 30080, Protocol.TCP)),
             replace(node_port, frontend=Frontend(VIP, 30080, Protocol.TCP), port_name="node-address"))
    data = frame(Flow(CLIENT, "127.0.0.1", 40000, 30080))
    assert dp.run(prog, data) == (prog.ok, data)
    assert len(dp.maps.ct) == 0 and dp.counter("new_flow") == 0
    dnat(dp, prog, Flow(CLIENT, VIP, 40001, 30080))


# -- regressions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prog", INGRESS)
def test_frontend_whose_port_changed_is_served(dp: Dataplane, prog: Prog) -> None:
    """Once dropped every packet (slot_miss): the new frontend got the old one's freed service id, and the
    old frontend's slot deletions, which run later in the same plan, removed the new frontend's slots."""
    dp.apply(port_state(TCP, port=PORT))
    dp.apply(port_state(TCP, port=8000))
    dnat(dp, prog, Flow(CLIENT, VIP, 50000, 8000))
    verdict, _ = dp.run(prog, frame(Flow(CLIENT, VIP, 50001, PORT)))
    assert verdict == prog.ok and dp.counter("slot_miss") == 0
    assert dp.counter("new_flow") == 1  # the old port is no frontend any more: passed untranslated


def test_load_without_pin_dir_pins_nothing(load: Load) -> None:
    """Once failed with EINVAL where /sys/fs/bpf is no bpffs, and pinned (and reused pins) where it is:
    libbpf's default pin path from LIBBPF_PIN_BY_NAME was left in place."""
    root = Path("/sys/fs/bpf")
    before = set(root.glob(f"{abi.PROG_PREFIX}*"))
    first = second = None
    try:
        first = load(None, max_entries=CAPACITY)
        second = load(None, max_entries=CAPACITY)
        assert set(root.glob(f"{abi.PROG_PREFIX}*")) == before
        ids = [{loader.map_info(fd).id for fd in obj.maps.values()} for obj in (first, second)]
        assert not ids[0] & ids[1], "two unpinned loads share maps"
    finally:
        for obj in (first, second):
            if obj is not None:
                obj.close()
        for pin in set(root.glob(f"{abi.PROG_PREFIX}*")) - before:  # only what this test created
            pin.unlink()


def test_a_pinned_load_keeps_its_maps_and_drops_an_older_layouts_pins(load: Load) -> None:
    """A restart reuses the pinned maps (connections survive); pins of a layout the object no longer has
    (pyproxy_ct_v1 beside pyproxy_ct_v2) are removed rather than left holding kernel memory forever."""
    pins = Path(f"/run/pyproxy-test-pins-{os.getpid()}")
    first = second = None
    try:
        loader.ensure_bpffs(pins)
        first = load(pins, max_entries=CAPACITY)
        stale = pins / f"{abi.MAP_PREFIX}ct_v0"  # a layout no object of ours has any more
        libbpf.check(libbpf.lib().bpf_obj_pin(first.maps[abi.MAP_CT], str(stale).encode()), "pin")
        ct_id = loader.map_info(first.maps[abi.MAP_CT]).id
        first.close()
        first = None
        second = load(pins, max_entries=CAPACITY)
        assert loader.map_info(second.maps[abi.MAP_CT]).id == ct_id, "the pinned CT map was not reused"
        assert not stale.exists()
        assert sorted(p.name for p in pins.glob(f"{abi.MAP_PREFIX}*")) == sorted(second.maps)
    finally:
        for obj in (first, second):
            if obj is not None:
                obj.close()
        if pins.exists():
            for pin in pins.glob(f"{abi.MAP_PREFIX}*"):
                pin.unlink()
            if loader.is_mountpoint(pins):
                loader.unmount(pins)
            pins.rmdir()
