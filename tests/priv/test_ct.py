"""Connection tracking in the BPF programs, packet by packet (BPF_PROG_TEST_RUN): the flow lifecycle, expiry, a
new connection on the ports of an old one, ICMP errors about translated flows, and IPv4 fragments.

Each test plays both sides of a conversation through the programs a node runs: the client's packets through TC
ingress (or XDP), the backend's through TC egress, and checks what the client or the backend would receive,
byte for byte against the frame the other side would have sent without a proxy in between.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import pytest
from conftest import Load
from harness import (
    CAPACITY,
    CLIENT,
    INGRESS,
    PORT,
    ROOT,
    TC_EGRESS,
    TC_INGRESS,
    VIP,
    XDP,
    Dataplane,
    Prog,
    dnat,
    port_state,
)
from packets import (
    ICMP_DEST_UNREACH,
    ICMP_FRAG_NEEDED,
    ICMP_PORT_UNREACH,
    ICMP_TIME_EXCEEDED,
    TCP,
    TCP_ACK,
    TCP_FIN,
    TCP_RST,
    TCP_SYN,
    UDP,
    Flow,
    decode,
    fragments,
    frame,
    icmp_checksum_ok,
    icmp_error,
    ip_packet,
)

from pyproxy.dataplane.bpf import abi, clock
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.model.state import Backend

pytestmark = ROOT

ONE = (Backend("10.0.1.1", 8080),)
BE = ONE[0]
ROUTER = "10.0.2.254"
BOTH = [pytest.param(TCP, id="tcp"), pytest.param(UDP, id="udp")]


def key(flow: Flow, direction: int) -> abi.CtKey:
    return abi.CtKey(abi.be32(flow.src), abi.be32(flow.dst), abi.be16(flow.sport), abi.be16(flow.dport), flow.proto,
                     direction)


def entries(dp: Dataplane, flow: Flow, be: Backend) -> tuple[abi.CtValue | None, abi.CtValue | None]:
    """The FORWARD entry of client flow `flow` (to the frontend) and the REVERSE entry of its replies from `be`."""
    back = Flow(be.ip, flow.src, be.port, flow.sport, flow.proto)
    return dp.maps.ct.get(key(flow, abi.CT_FORWARD)), dp.maps.ct.get(key(back, abi.CT_REVERSE))


def states(dp: Dataplane, flow: Flow, be: Backend) -> tuple[tuple[int, int], tuple[int, int]]:
    fwd, rev = entries(dp, flow, be)
    assert fwd is not None and rev is not None, f"flow {flow} has no entries: {fwd}, {rev}"
    return (fwd.state, fwd.flags), (rev.state, rev.flags)


def reply(dp: Dataplane, flow: Flow, be: Backend, payload: bytes = b"", tcp_flags: int = TCP_ACK, **tcp: int) -> bytes:
    """The backend answers client flow `flow` through TC egress; returns what the client receives (`tcp`: seq, ack of
    its TCP header)."""
    verdict, out = dp.run(TC_EGRESS, frame(Flow(be.ip, flow.src, be.port, flow.sport, flow.proto), payload,
                                           tcp_flags=tcp_flags, **tcp))
    assert verdict == TC_EGRESS.ok
    return out


def send(dp: Dataplane, prog: Prog, flow: Flow, tcp_flags: int = TCP_ACK, payload: bytes = b"", **tcp: int) -> Backend:
    return dnat(dp, prog, flow, payload, tcp_flags=tcp_flags, **tcp)


def ports_map(dp: Dataplane) -> BpfMap:
    return BpfMap(os.dup(dp.obj.maps[abi.MAP_PORTS]), abi.MAP_PORTS, ctypes.c_uint32, ctypes.c_uint64)


def list_port(dp: Dataplane, port: int, listed: bool = True) -> None:
    """Set or clear `port`'s bit in the endpoint-port map (the control plane keeps it from the endpoints)."""
    m = ports_map(dp)
    try:
        word = m[ctypes.c_uint32(port // 64)].value
        bit = 1 << (port % 64)
        m[ctypes.c_uint32(port // 64)] = ctypes.c_uint64(word | bit if listed else word & ~bit)
    finally:
        m.close()


def age(dp: Dataplane, k: abi.CtKey, seconds: float) -> None:
    """Make entry `k` look idle for `seconds`."""
    v = dp.maps.ct[k]
    v.last_seen = clock.ticks_now() - int(seconds * clock.kernel_hz())
    dp.maps.ct[k] = v


# -- the lifecycle ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prog", INGRESS)
def test_tcp_flow_moves_through_handshake_and_close_on_both_entries(dp: Dataplane, prog: Prog) -> None:
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41001, PORT)
    new, syn_recv, est = (abi.CT_ST_NEW, 0), (abi.CT_ST_SYN_RECV, 0), (abi.CT_ST_ESTABLISHED, 0)
    assert send(dp, prog, flow, TCP_SYN) == BE
    assert states(dp, flow, BE) == (new, new)
    send(dp, prog, flow, TCP_SYN)  # a retransmitted SYN stays on the flow
    assert states(dp, flow, BE) == (new, new)
    reply(dp, flow, BE, tcp_flags=TCP_SYN | TCP_ACK)
    assert states(dp, flow, BE) == (syn_recv, syn_recv), "the backend's answer alone does not establish a flow"
    reply(dp, flow, BE, tcp_flags=TCP_SYN | TCP_ACK)  # the backend retransmits its SYN-ACK
    send(dp, prog, flow, TCP_SYN)  # the client retransmits its SYN: it did not get the first SYN-ACK
    assert states(dp, flow, BE) == (syn_recv, syn_recv)
    send(dp, prog, flow)  # the client's ACK completes the handshake
    assert states(dp, flow, BE) == (est, est)
    send(dp, prog, flow, TCP_FIN | TCP_ACK)
    closing = (abi.CT_ST_CLOSING, abi.CT_F_FIN_FWD)
    assert states(dp, flow, BE) == (closing, closing)
    reply(dp, flow, BE, tcp_flags=TCP_FIN | TCP_ACK)
    time_wait = (abi.CT_ST_TIME_WAIT, abi.CT_F_FIN_FWD | abi.CT_F_FIN_REV)
    assert states(dp, flow, BE) == (time_wait, time_wait)
    assert send(dp, prog, flow) == BE, "the last ACK of a closed flow still reaches its backend"
    assert dp.counter("new_flow") == 1 and dp.counter("ct_reopened") == 0


def test_a_reset_closes_the_flow(dp: Dataplane) -> None:
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41002, PORT)
    send(dp, TC_INGRESS, flow, TCP_SYN)
    reply(dp, flow, BE, tcp_flags=TCP_RST | TCP_ACK)
    assert states(dp, flow, BE) == ((abi.CT_ST_CLOSED, 0), (abi.CT_ST_CLOSED, 0))


# -- the RST window (ct.h) ---------------------------------------------------------------------------------------

C_ISN, B_ISN = 1_000_000, 0xFFFF_FC00  # the backend's sequence wraps past 2^32 within the connection
REQUEST, RESPONSE = b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 1381
WINDOW = 1 << 18  # PYPROXY_CT_SEQ_WINDOW
U32 = 0xFFFF_FFFF


def talking(dp: Dataplane, prog: Prog, flow: Flow) -> tuple[Backend, int, int]:
    """A connection through the frontend past its handshake, with data both ways (the backend's reply 1,400 bytes, its
    sequence wrapping). Returns its backend and the end of each side's sequence: the client's, the backend's."""
    be = send(dp, prog, flow, TCP_SYN, seq=C_ISN)
    reply(dp, flow, be, tcp_flags=TCP_SYN | TCP_ACK, seq=B_ISN, ack=C_ISN + 1)
    send(dp, prog, flow, seq=C_ISN + 1, ack=B_ISN + 1)
    send(dp, prog, flow, TCP_ACK, REQUEST, seq=C_ISN + 1, ack=B_ISN + 1)
    c_end = C_ISN + 1 + len(REQUEST)
    reply(dp, flow, be, RESPONSE, seq=B_ISN + 1, ack=c_end)
    b_end = (B_ISN + 1 + len(RESPONSE)) & U32
    assert b_end < B_ISN, "the backend's sequence wrapped"
    send(dp, prog, flow, seq=c_end, ack=b_end)
    est = (abi.CT_ST_ESTABLISHED, 0)
    assert states(dp, flow, be) == (est, est)
    return be, c_end, b_end


def _kept(v: abi.CtValue | None) -> tuple[int, ...]:
    """What a packet that changes nothing leaves as it was: all but last_seen."""
    assert v is not None
    return v.nat_addr, v.nat_port, v.state, v.flags, v.svc_id, v.epoch, v.seq_end


OUT_OF_WINDOW = [pytest.param(WINDOW + 1, id="just-ahead"), pytest.param(-WINDOW - 1, id="just-behind"),
                 pytest.param(1 << 31, id="opposite")]


@pytest.mark.parametrize("off", OUT_OF_WINDOW)
@pytest.mark.parametrize("prog", INGRESS)
def test_an_out_of_window_reset_leaves_an_established_flow_as_it_was(dp: Dataplane, prog: Prog, off: int) -> None:
    """The defect: any RST closed a flow, so an injected one dropped a 24 h flow to the closed timeout (10 s). A RST
    from either side outside its sender's window is passed on (the endpoint ignores or challenges it), counted, and
    changes nothing; one within it closes the flow."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41100, PORT)
    be, c_end, b_end = talking(dp, prog, flow)
    before = entries(dp, flow, be)
    send(dp, prog, flow, TCP_RST, seq=(c_end + off) & U32)  # the client's, as an attacker would forge it
    assert decode(reply(dp, flow, be, tcp_flags=TCP_RST, seq=(b_end + off) & U32)).flow == flow.reply()
    est = (abi.CT_ST_ESTABLISHED, 0)
    assert states(dp, flow, be) == (est, est), "an out-of-window RST closed the flow"
    assert [_kept(v) for v in entries(dp, flow, be)] == [_kept(v) for v in before], "the RST changed the entries"
    assert dp.counter("ct_rst_ignored") == 2
    # The backend's own RST, at its sequence, closes the flow.
    reply(dp, flow, be, tcp_flags=TCP_RST | TCP_ACK, seq=b_end, ack=c_end)
    assert states(dp, flow, be) == ((abi.CT_ST_CLOSED, 0), (abi.CT_ST_CLOSED, 0))
    assert dp.counter("ct_rst_ignored") == 2


@pytest.mark.parametrize("prog", INGRESS)
def test_a_reset_within_the_window_closes_the_flow(dp: Dataplane, prog: Prog) -> None:
    """A RST answering from a socket that is gone carries the peer's ACK, behind its sender's furthest segment."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41101, PORT)
    be, c_end, _ = talking(dp, prog, flow)
    send(dp, prog, flow, TCP_RST, seq=c_end - len(REQUEST))
    assert states(dp, flow, be) == ((abi.CT_ST_CLOSED, 0), (abi.CT_ST_CLOSED, 0))
    assert dp.counter("ct_rst_ignored") == 0


def test_a_reset_in_new_is_a_refusal_and_closes_the_flow(dp: Dataplane) -> None:
    """The backend refuses the SYN: its RST's sequence is 0, nowhere near anything it sent (it sent nothing)."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41102, PORT)
    send(dp, TC_INGRESS, flow, TCP_SYN, seq=C_ISN)
    reply(dp, flow, BE, tcp_flags=TCP_RST | TCP_ACK, seq=0, ack=C_ISN + 1)
    assert states(dp, flow, BE) == ((abi.CT_ST_CLOSED, 0), (abi.CT_ST_CLOSED, 0))
    assert dp.counter("ct_rst_ignored") == 0


def test_data_far_ahead_does_not_move_the_window(dp: Dataplane) -> None:
    """A forged segment far ahead of the sender's, then a RST there, must not close the flow in two packets; the
    sender's own next segments move the window on."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41103, PORT)
    be, c_end, b_end = talking(dp, prog := TC_INGRESS, flow)
    far = (c_end + 3 * WINDOW) & U32
    send(dp, prog, flow, TCP_ACK, b"x" * 100, seq=far, ack=b_end)
    send(dp, prog, flow, TCP_RST, seq=far + 100)
    assert states(dp, flow, be)[0][0] == abi.CT_ST_ESTABLISHED and dp.counter("ct_rst_ignored") == 1
    # The client's real data, window after window: each segment starts within the window and moves it on.
    seq = c_end
    for _ in range(4):
        send(dp, prog, flow, TCP_ACK, b"y" * 1000, seq=seq, ack=b_end)
        seq += 1000
    assert entries(dp, flow, be)[0].seq_end == seq
    send(dp, prog, flow, TCP_RST, seq=seq)
    assert states(dp, flow, be)[0][0] == abi.CT_ST_CLOSED


def test_a_flow_carried_over_from_the_old_layout_takes_any_reset(dp: Dataplane) -> None:
    """An entry of pyproxy_ct_v2 knows no sequence (loader.carry_over marks both entries): any RST closes it, as the
    programs of that layout let it."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41104, PORT)
    be, c_end, _ = talking(dp, TC_INGRESS, flow)
    for k in (key(flow, abi.CT_FORWARD), key(Flow(be.ip, flow.src, be.port, flow.sport), abi.CT_REVERSE)):
        v = dp.maps.ct[k]
        v.flags |= abi.CT_F_SEQ_UNKNOWN
        v.seq_end = 0
        dp.maps.ct[k] = v
    send(dp, TC_INGRESS, flow, TCP_RST, seq=(c_end + (1 << 31)) & U32)
    assert states(dp, flow, be)[0][0] == abi.CT_ST_CLOSED
    assert dp.counter("ct_rst_ignored") == 0


@pytest.mark.parametrize("prog", INGRESS)
def test_udp_flow_is_a_single_exchange_until_it_streams(dp: Dataplane, prog: Prog) -> None:
    """As the kernel's UDP tracker: unreplied, then replied (a query and its answer: the 30 s timeout), and a
    stream (the 120 s one) only with a packet more than 2 s after the flow began."""
    dp.apply(port_state(UDP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41003, PORT, UDP)
    send(dp, prog, flow)
    assert states(dp, flow, BE) == ((abi.CT_ST_NEW, 0), (abi.CT_ST_NEW, 0))
    assert decode(reply(dp, flow, BE, b"answer")).flow == flow.reply()
    replied = ((abi.CT_ST_SYN_RECV, 0), (abi.CT_ST_SYN_RECV, 0))
    assert states(dp, flow, BE) == replied
    send(dp, prog, flow)
    reply(dp, flow, BE, b"answer again")
    assert states(dp, flow, BE) == replied, "traffic both ways within 2 s of the first packet is no stream yet"
    born(dp, flow, BE, seconds_ago=3)
    send(dp, prog, flow)
    assert states(dp, flow, BE) == ((abi.CT_ST_ESTABLISHED, 0), (abi.CT_ST_ESTABLISHED, 0))


def born(dp: Dataplane, flow: Flow, be: Backend, seconds_ago: float) -> None:
    """Make client flow `flow` to `be` look begun `seconds_ago`: its REVERSE entry holds the beginning (abi.h)."""
    k = key(Flow(be.ip, flow.src, be.port, flow.sport, flow.proto), abi.CT_REVERSE)
    v = dp.maps.ct[k]
    v.epoch = (clock.ticks_now() - int(seconds_ago * clock.kernel_hz())) & 0xFFFFFFFF
    dp.maps.ct[k] = v


# -- a new connection on the ports of an old one -----------------------------------------------------------------


def _closed_service_connection(dp: Dataplane, prog: Prog, flow: Flow) -> Backend:
    be = send(dp, prog, flow, TCP_SYN)
    reply(dp, flow, be, tcp_flags=TCP_SYN | TCP_ACK)
    send(dp, prog, flow)
    send(dp, prog, flow, TCP_FIN | TCP_ACK)
    reply(dp, flow, be, tcp_flags=TCP_FIN | TCP_ACK)
    send(dp, prog, flow)
    return be


@pytest.mark.parametrize("proto", BOTH)
@pytest.mark.parametrize("prog", INGRESS)
def test_direct_connection_after_a_service_one_on_the_same_ports_gets_untranslated_replies(
    dp: Dataplane, prog: Prog, proto: int
) -> None:
    """The defect: a client reached backend b through the ClusterIP from port P, then opens a connection to b
    itself from P. b's answer must reach the client from b, not from the ClusterIP (which the client would drop)."""
    dp.apply(port_state(proto, backends=ONE))
    list_port(dp, BE.port)
    flow = Flow(CLIENT, VIP, 41010, PORT, proto)
    if proto == TCP:
        _closed_service_connection(dp, prog, flow)
    else:
        send(dp, prog, flow)
        reply(dp, flow, BE, b"via the service")
    direct = Flow(CLIENT, BE.ip, flow.sport, BE.port, proto)
    syn = frame(direct, tcp_flags=TCP_SYN)
    assert dp.run(prog, syn) == (prog.ok, syn), "a packet to an endpoint is not translated"
    assert dp.counter("ct_untracked") == 1
    assert entries(dp, flow, BE) == (None, None), "the old flow's entries are gone"
    answer = frame(direct.reply(), b"direct", tcp_flags=TCP_SYN | TCP_ACK)
    assert dp.run(TC_EGRESS, answer) == (TC_EGRESS.ok, answer), "the endpoint's answer leaves as it is"
    # Back to the Service from the same port: a new flow, translated again.
    assert send(dp, prog, flow, TCP_SYN) == BE
    assert decode(reply(dp, flow, BE, tcp_flags=TCP_SYN | TCP_ACK)).flow == flow.reply()


def test_only_syns_and_datagrams_to_an_endpoint_port_look_for_an_old_flow(dp: Dataplane) -> None:
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41011, PORT)
    send(dp, TC_INGRESS, flow, TCP_SYN)
    reply(dp, flow, BE, tcp_flags=TCP_SYN | TCP_ACK)
    direct = Flow(CLIENT, BE.ip, flow.sport, BE.port)
    list_port(dp, BE.port, listed=False)
    dp.run(TC_INGRESS, frame(direct, tcp_flags=TCP_SYN))
    assert entries(dp, flow, BE) != (None, None), "a port no endpoint listens on costs no lookup"
    list_port(dp, BE.port)
    dp.run(TC_INGRESS, frame(direct, tcp_flags=TCP_ACK))
    assert entries(dp, flow, BE) != (None, None), "a segment that starts nothing leaves the flow alone"
    assert dp.counter("ct_untracked") == 0


@pytest.mark.parametrize("prog", INGRESS)
def test_a_syn_on_a_closed_flow_starts_a_new_flow(dp: Dataplane, prog: Prog) -> None:
    """A client that reuses its port for a new connection while the old flow lingers (closed by FINs both ways, in
    TIME_WAIT, or by a RST) gets a fresh backend choice; the old flow leaves no reverse entry."""
    dp.apply(port_state(TCP))
    flow = Flow(CLIENT, VIP, 41020, PORT)
    reopened = 0
    first = send(dp, prog, flow, TCP_SYN)
    for round_ in range(12):
        reply(dp, flow, first, tcp_flags=TCP_SYN | TCP_ACK)
        send(dp, prog, flow)
        if round_ % 2:
            send(dp, prog, flow, TCP_FIN | TCP_ACK)
            reply(dp, flow, first, tcp_flags=TCP_FIN | TCP_ACK)
        else:
            reply(dp, flow, first, tcp_flags=TCP_RST)
        second = send(dp, prog, flow, TCP_SYN)
        reopened += 1
        assert states(dp, flow, second) == ((abi.CT_ST_NEW, 0), (abi.CT_ST_NEW, 0))
        if second != first:
            assert entries(dp, flow, first)[1] is None, "the old backend's reverse entry outlived its flow"
        first = second
    assert dp.counter("ct_reopened") == reopened, "every SYN but the first found a previous connection's flow"


@pytest.mark.parametrize("prog", INGRESS)
def test_a_retransmitted_syn_follows_its_flow_in_every_open_state(dp: Dataplane, prog: Prog) -> None:
    """The defect: a client whose first SYN-ACK was lost retransmits its SYN after the backend answered; taken as a
    new connection it went to another backend, which reset the client's ACK of the first one's SYN-ACK. In NEW,
    SYN_RECV and ESTABLISHED a SYN follows the flow; the backend sorts out a stale one."""
    dp.apply(port_state(TCP))
    for i, answered, acked in ((0, False, False), (1, True, False), (2, True, True)):
        flow = Flow(CLIENT, VIP, 41025 + i, PORT)
        be = send(dp, prog, flow, TCP_SYN)
        if answered:
            reply(dp, flow, be, tcp_flags=TCP_SYN | TCP_ACK)
        if acked:
            send(dp, prog, flow)
        for _ in range(20):
            assert send(dp, prog, flow, TCP_SYN) == be
    assert dp.counter("ct_reopened") == 0 and dp.counter("new_flow") == 3


# -- expiry ----------------------------------------------------------------------------------------------------


@pytest.fixture
def short(load: Load) -> Iterator[Dataplane]:
    """A load whose UDP timeouts are 5 s (no reply yet) and 20 s (replied): the constants the programs run with
    come from the settings, at this kernel's HZ."""
    timeouts = CtTimeouts(udp_new=5, udp_established=20).ticks(clock.kernel_hz())
    dataplane = Dataplane(load(None, max_entries=CAPACITY, ct_timeouts=timeouts))
    yield dataplane
    dataplane.close()


def test_expired_entries_are_neither_followed_nor_used_for_reverse_nat(short: Dataplane) -> None:
    dp = short
    dp.apply(port_state(UDP))
    flow = Flow(CLIENT, VIP, 41030, PORT, UDP)
    be = send(dp, TC_INGRESS, flow)
    reply(dp, flow, be)
    born(dp, flow, be, seconds_ago=3)
    send(dp, TC_INGRESS, flow)  # a stream now: the 20 s timeout
    fwd, rev = key(flow, abi.CT_FORWARD), key(Flow(be.ip, CLIENT, be.port, flow.sport, UDP), abi.CT_REVERSE)
    for k in (fwd, rev):
        age(dp, k, 19)
    assert decode(reply(dp, flow, be)).flow == flow.reply(), "19 s idle of 20: still live"
    for k in (fwd, rev):
        age(dp, k, 21)
    stale = frame(Flow(be.ip, CLIENT, be.port, flow.sport, UDP))
    assert dp.run(TC_EGRESS, stale) == (TC_EGRESS.ok, stale), "an expired reverse entry rewrote a reply"
    send(dp, TC_INGRESS, flow)
    assert dp.counter("ct_expired") == 2 and dp.counter("new_flow") == 2
    assert dp.maps.ct[fwd].state == abi.CT_ST_NEW, "the expired flow was not replaced by a new one"


def test_one_way_traffic_keeps_both_directions_live(short: Dataplane) -> None:
    """A stream the backend sends to a silent client refreshes only the reverse entry; the client's next
    datagram still follows the flow (the flow is live while either direction is)."""
    dp = short
    dp.apply(port_state(UDP))
    flow = Flow(CLIENT, VIP, 41031, PORT, UDP)
    be = send(dp, TC_INGRESS, flow)
    reply(dp, flow, be)
    age(dp, key(flow, abi.CT_FORWARD), 60)
    for _ in range(50):
        assert send(dp, TC_INGRESS, flow) == be
    assert dp.counter("ct_expired") == 0 and dp.counter("new_flow") == 1


def test_a_half_open_tcp_flow_expires_in_the_syn_received_timeout(load: Load) -> None:
    """The defect: a SYN flood's flows, answered by the backend but never completed by the client, were established
    by the SYN-ACK (24 h) and held their SNAT ports for a day. They are half open until the client's ACK."""
    timeouts = CtTimeouts(tcp_syn_recv=5).ticks(clock.kernel_hz())
    dp = Dataplane(load(None, max_entries=CAPACITY, ct_timeouts=timeouts))
    try:
        dp.apply(port_state(TCP, backends=ONE))
        half, whole = Flow(CLIENT, VIP, 41033, PORT), Flow(CLIENT, VIP, 41034, PORT)
        for flow in (half, whole):
            send(dp, TC_INGRESS, flow, TCP_SYN)
            reply(dp, flow, BE, tcp_flags=TCP_SYN | TCP_ACK)
        send(dp, TC_INGRESS, whole)
        for flow in (half, whole):
            for k in (key(flow, abi.CT_FORWARD), key(Flow(BE.ip, CLIENT, BE.port, flow.sport), abi.CT_REVERSE)):
                age(dp, k, 6)
        stale = frame(Flow(BE.ip, CLIENT, BE.port, half.sport), tcp_flags=TCP_SYN | TCP_ACK)
        assert dp.run(TC_EGRESS, stale) == (TC_EGRESS.ok, stale), "a half-open flow 6 s idle (timeout 5 s) was live"
        assert decode(reply(dp, whole, BE)).flow == whole.reply(), "an established flow expired in the SYN timeout"
    finally:
        dp.close()


def test_unreplied_udp_expires_sooner(short: Dataplane) -> None:
    dp = short
    dp.apply(port_state(UDP))
    flow = Flow(CLIENT, VIP, 41032, PORT, UDP)
    be = send(dp, TC_INGRESS, flow)
    for k in (key(flow, abi.CT_FORWARD), key(Flow(be.ip, CLIENT, be.port, flow.sport, UDP), abi.CT_REVERSE)):
        age(dp, k, 6)
    send(dp, TC_INGRESS, flow)
    assert dp.counter("ct_expired") == 1, "an unreplied flow 6 s idle (timeout 5 s) was still followed"


# -- ICMP errors -------------------------------------------------------------------------------------------------


def quote(packet_frame: bytes, size: int) -> bytes:
    """The first `size` bytes of a frame's IPv4 packet: what an ICMP error carries of it."""
    return ip_packet(packet_frame)[:size]


@pytest.mark.parametrize("size", [pytest.param(48, id="tcp-checksum-quoted"), pytest.param(28, id="8-bytes-quoted")])
def test_frag_needed_from_a_router_reaches_the_client_about_its_own_packet(dp: Dataplane, size: int) -> None:
    """Path-MTU discovery: a router between node and backend cannot forward a client's (translated) segment and
    says so. The client must read the error as about the packet it sent, to the ClusterIP."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41040, PORT)
    send(dp, TC_INGRESS, flow, TCP_SYN)
    reply(dp, flow, BE, tcp_flags=TCP_SYN | TCP_ACK)
    sent = frame(flow, b"x" * 100, tcp_flags=TCP_ACK)
    after_dnat = frame(flow.to(BE.ip, BE.port), b"x" * 100, tcp_flags=TCP_ACK)
    error = icmp_error(ROUTER, CLIENT, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, quote(after_dnat, size), rest=1280)
    verdict, out = dp.run(TC_EGRESS, error)
    assert verdict == TC_EGRESS.ok
    assert out == icmp_error(ROUTER, CLIENT, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, quote(sent, size), rest=1280)
    assert icmp_checksum_ok(out)
    assert dp.counter("icmp_nat") == 1


def test_port_unreachable_from_the_backend_itself_comes_from_the_frontend(dp: Dataplane) -> None:
    dp.apply(port_state(UDP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41041, PORT, UDP)
    send(dp, TC_INGRESS, flow)
    sent, after_dnat = frame(flow, b"query"), frame(flow.to(BE.ip, BE.port), b"query")
    error = icmp_error(BE.ip, CLIENT, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, quote(after_dnat, 64))
    _, out = dp.run(TC_EGRESS, error)
    assert out == icmp_error(VIP, CLIENT, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, quote(sent, 64))


def test_an_error_about_a_reply_reaches_the_backend_about_its_own_packet(dp: Dataplane) -> None:
    """A router between node and client cannot forward the reply (sent from the ClusterIP) and reports it to
    the ClusterIP: the backend, which sent it, must get the error about its own packet."""
    dp.apply(port_state(TCP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41042, PORT)
    send(dp, TC_INGRESS, flow, TCP_SYN)
    from_backend = frame(Flow(BE.ip, CLIENT, BE.port, flow.sport), b"y" * 200, tcp_flags=TCP_ACK)
    after_revnat = frame(flow.reply(), b"y" * 200, tcp_flags=TCP_ACK)
    error = icmp_error(ROUTER, VIP, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, quote(after_revnat, 48), rest=1280)
    verdict, out = dp.run(TC_INGRESS, error)
    assert verdict == TC_INGRESS.ok
    assert out == icmp_error(ROUTER, BE.ip, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, quote(from_backend, 48), rest=1280)


@pytest.mark.parametrize("prog", [pytest.param(TC_EGRESS, id="tc-egress"), pytest.param(TC_INGRESS, id="tc"),
                                  pytest.param(XDP, id="xdp")])
def test_errors_about_other_flows_pass_untouched(dp: Dataplane, prog: Prog) -> None:
    dp.apply(port_state(TCP, backends=ONE))
    send(dp, TC_INGRESS, Flow(CLIENT, VIP, 41043, PORT), TCP_SYN)
    other = frame(Flow(CLIENT, BE.ip, 41044, BE.port))  # no Service flow has these ports
    for error in (icmp_error(ROUTER, CLIENT, ICMP_TIME_EXCEEDED, 0, quote(other, 48)),
                  icmp_error(ROUTER, VIP, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, quote(other, 48)),
                  icmp_error(ROUTER, CLIENT, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, quote(other, 24)),  # ports cut
                  icmp_error(ROUTER, CLIENT, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, b"\x45\x00")):  # quote cut
        assert dp.run(prog, error) == (prog.ok, error)
    assert dp.counter("icmp_nat") == 0


# -- fragments -------------------------------------------------------------------------------------------------


def test_a_fragmented_datagram_is_translated_whole_both_ways(dp: Dataplane) -> None:
    """A 4,000-byte UDP datagram in three fragments: each leaves as the fragment the client would have sent to
    the backend (one UDP checksum over the whole datagram, in the first), and the reply's likewise."""
    dp.apply(port_state(UDP, backends=ONE))
    flow = Flow(CLIENT, VIP, 41050, PORT, UDP)
    payload = bytes(range(256)) * 15 + b"end"
    for sent, want in zip(fragments(flow, payload, 1480), fragments(flow.to(BE.ip, BE.port), payload, 1480),
                          strict=True):
        assert dp.run(TC_INGRESS, sent) == (TC_INGRESS.ok, want)
    answer = payload[::-1]
    back = Flow(BE.ip, CLIENT, BE.port, flow.sport, UDP)
    for sent, want in zip(fragments(back, answer, 1480, ident=7), fragments(flow.reply(), answer, 1480, ident=7),
                          strict=True):
        assert dp.run(TC_EGRESS, sent) == (TC_EGRESS.ok, want)
    assert dp.counter("frag_nat") == 4 and dp.counter("new_flow") == 1


def test_xdp_leaves_fragments_to_tc(dp: Dataplane) -> None:
    dp.apply(port_state(UDP, backends=ONE))
    for f in fragments(Flow(CLIENT, VIP, 41051, PORT, UDP), b"z" * 3000, 1480):
        assert dp.run(XDP, f) == (XDP.ok, f)
    assert not any(dp.counters().values())


def test_timeouts_become_ticks_of_this_kernel() -> None:
    hz = clock.kernel_hz()
    t = CtTimeouts(tcp_closed=0.001).ticks(hz)
    assert t.tcp_established == 86400 * hz and t.udp_new == 30 * hz and t.tcp_closed == 1
    assert t.tcp_syn_recv == 60 * hz and t.tcp_time_wait == 120 * hz and t.udp_stream_after == 2 * hz
    assert t.shortest == 1, "the stream rule's 2 s is not a timeout"
    with pytest.raises(ValueError, match="udp_new"):
        CtTimeouts(udp_new=0)
