"""Per-endpoint counters (--bpf-endpoint-counters, MAP_EPSTATS), packet by packet with BPF_PROG_TEST_RUN: the
programs count each packet they send to a backend beside the frontend's count, and the control plane keeps one
entry per backend, removed when the backend leaves every Service and kept when it stays (a restart too)."""

from __future__ import annotations

import pytest
from harness import (
    CLIENT,
    INGRESS,
    NOT_READY,
    PORT,
    ROOT,
    TC_INGRESS,
    VIP,
    XDP,
    Dataplane,
    Prog,
    backend_of,
    dnat,
    port_state,
)
from packets import TCP, TCP_ACK, TCP_SYN, UDP, Flow, frame

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

pytestmark = ROOT

TWO = (Backend("10.0.1.1", 8080), Backend("10.0.1.2", 8080))
OTHER = "default/other"


def other_service(backends: tuple[Backend, ...]) -> ServicePortState:
    return ServicePortState(OTHER, "", Frontend("10.96.0.20", PORT, Protocol.TCP), backends, backends)


def packet(dp: Dataplane, prog: Prog, flow: Flow, payload: bytes, flags: int,
           sent: dict[Backend, list[int]]) -> Backend:
    """One client packet through `prog`; adds it to what its backend was sent."""
    be = dnat(dp, prog, flow, payload, tcp_flags=flags)
    got = sent.setdefault(be, [0, 0])
    got[0] += 1
    got[1] += len(frame(flow, payload, tcp_flags=flags))
    return be


def until_both_served(dp: Dataplane, first_port: int) -> dict[Backend, list[int]]:
    """New TCP flows through TC from `first_port` on until both of TWO got one; what each was sent."""
    sent: dict[Backend, list[int]] = {}
    for sport in range(first_port, first_port + 200):
        packet(dp, TC_INGRESS, Flow(CLIENT, VIP, sport, PORT, TCP), b"x", TCP_SYN, sent)
        if set(sent) == set(TWO):
            return sent
    raise AssertionError(f"200 new flows reached only {set(sent)}")


@pytest.mark.parametrize("prog", INGRESS)
def test_each_backend_counts_the_packets_and_bytes_sent_to_it(dp_counted: Dataplane, prog: Prog) -> None:
    dp = dp_counted
    assert dp.capacity[abi.MAP_EPSTATS] == dp.capacity[abi.MAP_BACKENDS], "sized as the backends map, resized too"
    st = port_state(TCP, TWO)
    dp.apply(st)
    # Every backend known (ready or not) has its entry from the start, at zero.
    assert dp.endpoint_stats() == {b: (0, 0) for b in (*TWO, NOT_READY)}

    sent: dict[Backend, list[int]] = {}
    flows = []
    for sport in range(42000, 42200):  # new flows until both backends have some
        flows.append(Flow(CLIENT, VIP, sport, PORT, TCP))
        packet(dp, prog, flows[-1], b"", TCP_SYN, sent)
        if len(flows) >= 4 and set(sent) == set(TWO):
            break
    for i, flow in enumerate(flows):  # then established packets of every size
        for n in range(1 + i % 3):
            packet(dp, prog, flow, b"p" * (100 * n + i), TCP_ACK, sent)
    dp.run(prog, frame(Flow(CLIENT, VIP, 42000, 81), b"not ours"))  # not a frontend: counted nowhere

    assert set(sent) == set(TWO)
    assert dp.endpoint_stats() == {**{b: (n, size) for b, (n, size) in sent.items()}, NOT_READY: (0, 0)}
    # The frontend's own counter saw the same packets, here split by backend.
    assert dp.stats(dp.svc_id(st)) == (sum(n for n, _ in sent.values()), sum(size for _, size in sent.values()))


def test_udp_through_xdp_and_tc_adds_up_per_backend(dp_counted: Dataplane) -> None:
    dp = dp_counted
    dp.apply(port_state(UDP, TWO, (), port=53))
    want: dict[Backend, list[int]] = {b: [0, 0] for b in TWO}
    for k, prog in enumerate((XDP, TC_INGRESS)):
        for sport in range(43000, 43040):
            data = frame(Flow(CLIENT, VIP, sport + 100 * k, 53, UDP), b"d" * (sport % 50))
            verdict, out = dp.run(prog, data)
            assert verdict == prog.ok
            got = want[backend_of(out)]
            got[0] += 1
            got[1] += len(data)
    assert all(n for n, _ in want.values()), "both backends served"
    assert dp.endpoint_stats() == {b: tuple(v) for b, v in want.items()}


def test_counters_off_write_and_count_nothing(dp: Dataplane) -> None:
    st = port_state(TCP, TWO)
    dp.apply(st)
    dnat(dp, TC_INGRESS, Flow(CLIENT, VIP, 42500, PORT, TCP))
    assert dp.stats(dp.svc_id(st))[0] == 1
    assert dp.endpoint_stats() == {}


def test_an_endpoint_loses_its_counts_only_when_it_leaves_every_service(dp_counted: Dataplane) -> None:
    dp = dp_counted
    shared, own = TWO
    dp.apply(port_state(TCP, TWO, ()))
    dp.apply(other_service((shared,)), service=OTHER)
    sent = until_both_served(dp, 44000)
    counted = dp.endpoint_stats()
    assert counted == {b: tuple(v) for b, v in sent.items()}

    # Out of the first Service, still an endpoint of the other: it keeps its entry and its counts.
    dp.apply(port_state(TCP, (own,), ()))
    assert dp.endpoint_stats() == counted
    # Out of every Service: its entry goes with it from the backends map.
    plan = dp.apply(other_service(()), service=OTHER)
    assert [b for b in plan.released] == [shared]
    assert dp.endpoint_stats() == {own: counted[own]}
    # Back again: it starts from zero.
    dp.apply(other_service((shared,)), service=OTHER)
    assert dp.endpoint_stats() == {own: counted[own], shared: (0, 0)}


def test_a_restart_keeps_the_counts_of_endpoints_that_stay(dp_counted: Dataplane) -> None:
    """What BpfDataplane.start does with the maps a previous run left: read what is applied, put the counters map
    in line with it, then a full sync renders every Service from that state."""
    dp = dp_counted
    stays, goes = TWO
    st = port_state(TCP, TWO, ())
    dp.apply(st)
    until_both_served(dp, 45000)
    before = dp.endpoint_stats()

    applied = dp.maps.read_applied()
    dp.maps.sync_endpoint_stats(applied, True)
    assert dp.endpoint_stats() == before
    # The first sync of the new run: `goes` left its Service while pyproxy was down.
    plan = render(applied, {st.service: (port_state(TCP, (stays,), ()),)}, dp.capacity, endpoint_counters=True)
    dp.maps.run_batches(plan.batches)
    assert dp.endpoint_stats() == {stays: before[stays]}

    # Restarted with the counters off, the map is emptied; on again, every backend starts from zero.
    applied.commit(plan)
    dp.maps.sync_endpoint_stats(applied, False)
    assert dp.endpoint_stats() == {}
    dp.maps.sync_endpoint_stats(applied, True)
    assert dp.endpoint_stats() == {stays: (0, 0)}

