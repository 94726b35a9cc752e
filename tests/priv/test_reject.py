"""A frontend without usable endpoints refuses flows at once, as upstream's REJECT does (bpf/include/pyproxy/
reject.h): TC answers a TCP segment with a reset and a UDP datagram with an ICMP port unreachable, sent back on
the device it came in on; XDP leaves such packets to TC. Each answer is compared byte for byte with the one a
host would build from scratch."""

from __future__ import annotations

import os
import time

import pytest
from harness import CLIENT, PORT, ROOT, TC_ACT_SHOT, TC_INGRESS, VIP, XDP, Dataplane, port_state
from packets import (
    ICMP_DEST_UNREACH,
    ICMP_PORT_UNREACH,
    TCP,
    TCP_ACK,
    TCP_SYN,
    UDP,
    Flow,
    frame,
    icmp_checksum_ok,
    icmp_error,
    ip_packet,
    turned_around,
)

pytestmark = ROOT

TC_ACT_REDIRECT = 7
TCP_FIN, TCP_RST = 0x01, 0x04


def empty(dp: Dataplane, proto: int) -> None:
    dp.apply(port_state(proto, backends=(), not_ready=()))


@pytest.mark.parametrize(("flags", "payload", "seq", "ack", "answer"), [
    pytest.param(TCP_SYN, b"", 0, 1001, TCP_RST | TCP_ACK, id="syn"),
    pytest.param(TCP_ACK, b"data" * 25, 777, 0, TCP_RST, id="segment-of-a-flow"),
    pytest.param(TCP_FIN, b"", 0, 1001, TCP_RST | TCP_ACK, id="fin-without-ack"),
])
def test_tcp_to_a_frontend_without_endpoints_gets_a_reset(dp: Dataplane, flags: int, payload: bytes, seq: int,
                                                            ack: int, answer: int) -> None:
    empty(dp, TCP)
    flow = Flow(CLIENT, VIP, 42000, PORT)
    verdict, out = dp.run(TC_INGRESS, frame(flow, payload, tcp_flags=flags, seq=1000, ack=777))
    assert verdict == TC_ACT_REDIRECT
    assert out == turned_around(frame(flow.reply(), payload, tcp_flags=answer, seq=seq, ack=ack, window=0))
    assert dp.counter("no_backend") == 1 and len(dp.maps.ct) == 0


def test_udp_to_a_frontend_without_endpoints_gets_port_unreachable(dp: Dataplane) -> None:
    empty(dp, UDP)
    flow = Flow(CLIENT, VIP, 42001, PORT, UDP)
    sent = frame(flow, b"query" * 40)
    verdict, out = dp.run(TC_INGRESS, sent)
    assert verdict == TC_ACT_REDIRECT
    want = icmp_error(VIP, CLIENT, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, ip_packet(sent)[:28], ident=0, tos=0xC0)
    assert out == turned_around(want)
    assert icmp_checksum_ok(out)


@pytest.mark.parametrize("proto", [pytest.param(TCP, id="tcp"), pytest.param(UDP, id="udp")])
def test_xdp_leaves_the_answer_to_tc(dp: Dataplane, proto: int) -> None:
    empty(dp, proto)
    data = frame(Flow(CLIENT, VIP, 42002, PORT, proto))
    assert dp.run(XDP, data) == (XDP.ok, data)


@pytest.mark.parametrize("data", [
    pytest.param(frame(Flow(CLIENT, VIP, 42003, PORT), tcp_flags=TCP_RST), id="a-reset"),
    pytest.param(frame(Flow(CLIENT, VIP, 42004, PORT), options=b"\x01\x01\x01\x00"), id="ip-options"),
])
def test_what_cannot_be_answered_safely_is_dropped(dp: Dataplane, data: bytes) -> None:
    empty(dp, TCP)
    assert dp.run(TC_INGRESS, data)[0] == TC_ACT_SHOT


def test_a_flood_gets_refusals_at_the_kernels_icmp_rate_and_the_rest_is_dropped(dp: Dataplane) -> None:
    """A SYN flood to a frontend without endpoints is not answered one for one (a reflector): each CPU sends a burst
    of 50, then 1,000 a second, as the kernel limits its own ICMP errors; the rest is dropped and counted."""
    empty(dp, TCP)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # one CPU's bucket (the test runs on the calling CPU)
    try:
        start = time.monotonic()
        verdicts = [dp.run(TC_INGRESS, frame(Flow(CLIENT, VIP, 20000 + i, PORT), tcp_flags=TCP_SYN))[0]
                    for i in range(400)]
        elapsed_ms = (time.monotonic() - start) * 1000
        answered, dropped = verdicts.count(TC_ACT_REDIRECT), verdicts.count(TC_ACT_SHOT)
        assert answered + dropped == 400
        assert 50 <= answered <= 50 + elapsed_ms + 2, f"{answered} refusals in {elapsed_ms:.0f} ms"
        assert verdicts[:50] == [TC_ACT_REDIRECT] * 50, "the burst comes first"
        assert dp.counter("refusal_limited") == dropped > 0
        time.sleep(0.05)
        assert dp.run(TC_INGRESS, frame(Flow(CLIENT, VIP, 21000, PORT), tcp_flags=TCP_SYN))[0] == TC_ACT_REDIRECT
    finally:
        os.sched_setaffinity(0, cpus)
