"""SNAT in bpf mode (bpf/include/pyproxy/snat.h), packet by packet: a new flow to a frontend with
externalTrafficPolicy Cluster, or one a pod sends to itself through a Service (hairpin), leaves toward its backend
from a node address and a port of the SNAT range; the backend's reply to that address and port gets its client
back on ingress and its frontend on egress, so the client sees the frontend answer.

The routing lookup that picks the node address runs in the network namespace of the thread that makes the test run:
each test gets a namespace of its own set up as the node (a device holding NODE_SIDE, its address on the backends'
network), deleted after it, and runs the ingress programs in a thread inside it.

Each test taking `dp` runs both ways the programs find that address (snat.h): from the route lookup itself
(BPF_FIB_LOOKUP_SRC, where the kernel has it), and from the egress device's entry in the devices map, the way of
kernels without it, filled as the control plane does (snat.py, from the namespace's addresses)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CAPACITY, Load
from harness import CLIENT, INGRESS, READY, ROOT, TC_EGRESS, TC_INGRESS, XDP, Dataplane, Prog, port_state
from labkit.netns import NetnsThread, scratch_node
from packets import TCP, UDP, Flow, decode, frame
from prometheus_client import CollectorRegistry

from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi, clock, gc, inspect, kernel, loader, snat
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

pytestmark = ROOT

NODE_IP, NODE_PORT = "10.0.0.1", 30080
NODE_SIDE = "10.0.1.254"
"""The node's address on the backends' network (10.0.1.0/24): where SNATed flows come from."""
SNAT_PORTS = range(abi.DEFAULT_SNAT_PORTS[0], abi.DEFAULT_SNAT_PORTS[1] + 1)
TCP_FIN, TCP_RST, TCP_ACK = 0x01, 0x04, 0x10


class Node:
    """A private network namespace set up as the node (NODE_SIDE on its device toward the backends), with a thread
    inside it where the ingress programs' test runs go: their route lookup for SNAT sees this node."""

    def __init__(self, thread: NetnsThread, ifindex: int) -> None:
        self.thread, self.ifindex = thread, ifindex

    def run(self, dp: Dataplane, prog: Prog, data: bytes) -> tuple[int, bytes]:
        """`prog` on `data` arriving on the node's device, in the node's namespace."""
        return self.thread.call(dp.run, prog, data, self.ifindex)


@pytest.fixture
def netns() -> Iterator[Node]:
    with scratch_node("pyp-snat", [("snat0", f"{NODE_SIDE}/24")]) as (thread, ifindex):
        yield Node(thread, ifindex["snat0"])


@pytest.fixture(params=["fib-src", "device-map"])
def dp(request: pytest.FixtureRequest, load: Load, netns: Node) -> Iterator[Dataplane]:
    """A fresh load (conftest's `dp`, by the loader under test), once with the programs asking the route lookup for
    the source address and once with them reading the devices map, filled from the node's addresses."""
    if request.param == "fib-src" and not kernel.features().fib_src:
        pytest.skip(f"this kernel ({kernel.release()}) has no BPF_FIB_LOOKUP_SRC")
    flags = abi.KERNEL_FIB_SRC if request.param == "fib-src" else 0
    d = Dataplane(load(None, max_entries=CAPACITY, kernel_flags=flags))
    if not flags:
        netns.thread.call(lambda: snat.write_device_addresses(d.maps.devaddrs, netlink.primary_ipv4_by_device()))
    yield d
    d.close()


def nodeport(backends: tuple[Backend, ...] = READY, proto: int = TCP, masquerade: bool = True,
             port: int = NODE_PORT) -> ServicePortState:
    return ServicePortState(
        service="default/web", port_name="http", frontend=Frontend(NODE_IP, port, Protocol(
            "TCP" if proto == TCP else "UDP")),
        backends=backends, known_backends=backends, kind=FrontendKind.NODE_PORT, external_backends=backends,
        masquerade=masquerade,
    )


def through(dp: Dataplane, prog: Prog, flow: Flow, node: Node, tcp_flags: int, payload: bytes = b"",
            **tcp: int) -> Flow:
    """A packet of `flow` through `prog` (ingress) then TC egress: the flow as it leaves the node, checksums
    verified as its receiver would (`tcp`: seq, ack of its TCP header)."""
    verdict, out = node.run(dp, prog, frame(flow, payload, tcp_flags=tcp_flags, **tcp))
    assert verdict == prog.ok
    verdict, out = dp.run(TC_EGRESS, out)
    assert verdict == TC_EGRESS.ok
    d = decode(out)
    assert d.ip_csum_ok and d.l4_csum_ok, "a receiver would drop the translated packet"
    return d.flow


def forward(dp: Dataplane, prog: Prog, flow: Flow, node: Node, tcp_flags: int = 0x02) -> Flow:
    """The client's packet (a SYN by default) as it leaves toward its backend."""
    return through(dp, prog, flow, node, tcp_flags)


def backward(dp: Dataplane, prog: Prog, reply: Flow, node: Node, tcp_flags: int = 0x12) -> Flow:
    """The backend's reply (a SYN-ACK by default) as it leaves toward the client."""
    return through(dp, prog, reply, node, tcp_flags)


@pytest.mark.parametrize("proto", [TCP, UDP], ids=["tcp", "udp"])
@pytest.mark.parametrize("prog", INGRESS)
def test_cluster_policy_masquerades_and_the_reply_finds_its_way_back(dp: Dataplane, netns: Node, prog: Prog,
                                                                      proto: int) -> None:
    dp.apply(nodeport(proto=proto))
    client = Flow(CLIENT, NODE_IP, 40000, NODE_PORT, proto)
    out = forward(dp, prog, client, netns)
    assert out.src == NODE_SIDE and Backend(out.dst, out.dport) in READY
    assert out.sport in SNAT_PORTS
    assert dp.counter("snat") == 1 and len(dp.maps.ct) == 4, "the Service flow's pair and the SNAT pair"
    back = backward(dp, prog, out.reply(), netns)
    assert back == client.reply(), "the client must see the frontend answer, at its own port"
    assert dp.counter("revsnat") == 1
    # The flow's next packets take the same port.
    assert forward(dp, prog, client, netns, tcp_flags=TCP_ACK) == out


@pytest.mark.parametrize("prog", INGRESS)
def test_local_policy_keeps_the_clients_address(dp: Dataplane, netns: Node, prog: Prog) -> None:
    dp.apply(nodeport(masquerade=False))
    out = forward(dp, prog, Flow(CLIENT, NODE_IP, 40001, NODE_PORT), netns)
    assert (out.src, out.sport) == (CLIENT, 40001)
    assert dp.counter("snat") == 0 and len(dp.maps.ct) == 2


@pytest.mark.parametrize("prog", INGRESS)
def test_an_out_of_window_reset_keeps_the_flow_and_its_snat_port(dp: Dataplane, netns: Node, prog: Prog) -> None:
    """The defect's worst half: a forged RST freed the flow's SNAT port. Out of its sender's window it changes
    neither pair (nor the port the flow holds); the backend's own RST closes both."""
    dp.apply(nodeport(backends=READY[:1]))
    client = Flow(CLIENT, NODE_IP, 40100, NODE_PORT)
    c_isn, b_isn, far = 5_000, 9_000_000, 1 << 31
    out = through(dp, prog, client, netns, 0x02, seq=c_isn)
    back = out.reply()
    assert through(dp, TC_INGRESS, back, netns, 0x12, seq=b_isn, ack=c_isn + 1) == client.reply()
    through(dp, prog, client, netns, TCP_ACK, b"request", seq=c_isn + 1, ack=b_isn + 1)
    through(dp, TC_INGRESS, back, netns, TCP_ACK, b"y" * 1200, seq=b_isn + 1, ack=c_isn + 8)
    c_end, b_end = c_isn + 8, b_isn + 1201
    through(dp, prog, client, netns, TCP_ACK, seq=c_end, ack=b_end)

    def flows() -> list[tuple[bytes, int, int]]:
        return sorted((bytes(k), v.state, v.flags) for k, v in ((k, dp.maps.ct[k]) for k in dp.maps.ct))

    established = flows()
    assert len(established) == 4 and {st for _, st, _ in established} == {abi.CT_ST_ESTABLISHED}
    assert through(dp, TC_INGRESS, back, netns, TCP_RST, seq=b_end + far) == client.reply(), "not passed on"
    assert through(dp, prog, client, netns, TCP_RST | TCP_ACK, seq=(c_end - far) % 2**32) == out, "not passed on"
    assert flows() == established, "an out-of-window RST changed the flow or its SNAT pair"
    assert dp.counter("ct_rst_ignored") == 4  # each RST met the Service flow and the SNAT pair
    # The flow still holds its port: its next packet leaves from it.
    assert through(dp, prog, client, netns, TCP_ACK, seq=c_end, ack=b_end) == out
    through(dp, TC_INGRESS, back, netns, TCP_RST | TCP_ACK, seq=b_end, ack=c_end)
    assert {st for _, st, _ in flows()} == {abi.CT_ST_CLOSED}


def test_a_pod_load_balanced_onto_itself_is_masqueraded(dp: Dataplane, netns: Node) -> None:
    """Hairpin: the pod would drop a reply from its own address (upstream masquerades this case)."""
    pod = READY[0]
    dp.apply(port_state(backends=(pod,)))
    flow = Flow(pod.ip, "10.96.0.10", 45000, 80)
    out = forward(dp, TC_INGRESS, flow, netns)
    assert (out.src, out.dst, out.dport) == (NODE_SIDE, pod.ip, pod.port) and out.sport in SNAT_PORTS
    assert backward(dp, TC_INGRESS, out.reply(), netns) == flow.reply()
    # Another pod of the same Service is not masqueraded: it keeps its address.
    other = Flow("10.0.1.77", "10.96.0.10", 45001, 80)
    assert forward(dp, TC_INGRESS, other, netns).src == other.src


def test_flows_to_one_backend_get_distinct_ports_and_a_full_range_drops(load: Load, netns: Node) -> None:
    """Two ports to give out: two flows to the one backend get one each, a third is dropped (its client
    retransmits), and once a flow closes its port serves a new one."""
    first = abi.DEFAULT_SNAT_PORTS[0]
    dp = Dataplane(load(None, max_entries=CAPACITY, snat_ports=(first, first + 1)))
    try:
        dp.apply(nodeport(backends=(READY[0],)))
        a = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 41000, NODE_PORT), netns)
        b = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 41001, NODE_PORT), netns)
        assert {a.sport, b.sport} == {first, first + 1}
        verdict, _ = netns.run(dp, TC_INGRESS, frame(Flow(CLIENT, NODE_IP, 41002, NODE_PORT)))
        assert verdict == TC_INGRESS.drop and dp.counter("snat_no_port") == 1
        # The backend resets the first flow: with no other port free, its port serves a new flow before it expires.
        backward(dp, TC_INGRESS, a.reply(), netns, tcp_flags=TCP_RST)
        c = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 41002, NODE_PORT), netns)
        assert c.sport == a.sport and dp.counter("snat_early_reuse") == 1
    finally:
        dp.close()


@pytest.mark.parametrize("prog", INGRESS)
def test_a_retransmitted_syn_after_the_syn_ack_keeps_its_backend_and_snat_port(dp: Dataplane, netns: Node,
                                                                            prog: Prog) -> None:
    """The defect: a client whose first SYN-ACK was lost retransmits its SYN; taken as a new connection, it went to
    another backend from another SNAT port, and the first backend's SYN-ACK the client then ACKed was reset."""
    dp.apply(nodeport())
    for i in range(8):
        client = Flow(CLIENT, NODE_IP, 43000 + i, NODE_PORT)
        out = forward(dp, prog, client, netns)
        assert backward(dp, prog, out.reply(), netns) == client.reply()  # lost on its way to the client
        for _ in range(3):
            assert forward(dp, prog, client, netns) == out, "the retransmitted SYN left as a new connection"
        assert forward(dp, prog, client, netns, tcp_flags=TCP_ACK) == out
    assert dp.counter("ct_reopened") == 0 and dp.counter("snat") == 8


def test_the_clients_own_port_is_kept_when_it_is_in_the_range_and_free(dp: Dataplane, netns: Node) -> None:
    """As nf_nat and Cilium: the backend sees the client's port when no other flow to it holds that port."""
    be = READY[0]
    dp.apply(nodeport(backends=(be,)))
    port = SNAT_PORTS[100]
    first = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, port, NODE_PORT), netns)
    assert first.sport == port
    other = forward(dp, TC_INGRESS, Flow("10.0.9.9", NODE_IP, port, NODE_PORT), netns)
    assert other.sport != port and other.sport in SNAT_PORTS, "two flows to one backend shared a port"
    below = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 40500, NODE_PORT), netns)
    assert below.sport in SNAT_PORTS, "a port outside the range is never given out"


def _age_all(dp: Dataplane, seconds: float) -> None:
    """Every CT entry looks idle for `seconds`."""
    then = clock.ticks_now() - int(seconds * clock.kernel_hz())
    for k in dp.maps.ct.keys_list():
        v = dp.maps.ct[k]
        v.last_seen = then
        dp.maps.ct[k] = v


def test_a_time_wait_pair_keeps_its_port_while_another_is_free(load: Load, netns: Node) -> None:
    """A flow closed by FINs both ways: the backend may hold TIME_WAIT on its tuple, so a new flow gets another port
    while there is one; when there is none, the closed pair's port is taken early (counted) rather than drop."""
    first = abi.DEFAULT_SNAT_PORTS[0]
    dp = Dataplane(load(None, max_entries=CAPACITY, snat_ports=(first, first + 1)))
    try:
        dp.apply(nodeport(backends=(READY[0],)))
        closed = _closed_snated_flow(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44000, NODE_PORT), netns)
        # Random tries: each hits the closed pair's port half the time; 32 of them all do once in 4e9.
        new = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44001, NODE_PORT), netns)
        assert new.sport != closed.sport, "a new flow took the port its backend may hold in TIME_WAIT"
        assert dp.counter("snat_early_reuse") == 0
        last = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44002, NODE_PORT), netns)
        assert last.sport == closed.sport and dp.counter("snat_early_reuse") == 1
        assert dp.counter("snat_no_port") == 0
    finally:
        dp.close()


def test_a_single_udp_exchange_frees_its_port_in_the_udp_timeout(load: Load, netns: Node) -> None:
    """The defect: a DNS-like exchange (one query, one answer) held its SNAT port for the stream timeout (120 s), so
    fresh source ports at 100 per second ran a 4,536-port range dry. It is a single exchange: the UDP timeout."""
    first = abi.DEFAULT_SNAT_PORTS[0]
    hz = clock.kernel_hz()
    dp = Dataplane(load(None, max_entries=CAPACITY, snat_ports=(first, first),
                        ct_timeouts=CtTimeouts(udp_new=5, udp_established=60).ticks(hz)))
    try:
        dp.apply(nodeport(backends=(READY[0],), proto=UDP))
        query = Flow(CLIENT, NODE_IP, 45000, NODE_PORT, UDP)
        out = forward(dp, TC_INGRESS, query, netns, tcp_flags=0)
        assert backward(dp, TC_INGRESS, out.reply(), netns, tcp_flags=0) == query.reply()
        verdict, _ = netns.run(dp, TC_INGRESS, frame(Flow(CLIENT, NODE_IP, 45001, NODE_PORT, UDP)))
        assert verdict == TC_INGRESS.drop, "the one port is the first exchange's while it lives"
        _age_all(dp, 6)
        again = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 45001, NODE_PORT, UDP), netns, tcp_flags=0)
        assert again.sport == first and dp.counter("snat_early_reuse") == 0
    finally:
        dp.close()


def test_a_rebalanced_flow_frees_its_snat_pair(dp: Dataplane, netns: Node) -> None:
    gone, kept = READY[0], READY[1]
    dp.apply(nodeport(backends=(gone,)))
    client = Flow(CLIENT, NODE_IP, 42000, NODE_PORT)
    first = forward(dp, TC_INGRESS, client, netns)
    assert first.dst == gone.ip and len(dp.maps.ct) == 4
    dp.apply(nodeport(backends=(kept,)))  # the endpoint went: the flow's next packet picks another
    again = forward(dp, TC_INGRESS, client, netns, tcp_flags=TCP_ACK)
    assert again.dst == kept.ip
    assert len(dp.maps.ct) == 4, "the old flow's SNAT pair was left behind"
    # A late reply of the old backend to the old port is no flow's any more: left as it is.
    verdict, out = netns.run(dp, TC_INGRESS, frame(first.reply(), tcp_flags=TCP_ACK))
    assert verdict == TC_INGRESS.ok and decode(out).flow == first.reply()


@pytest.mark.parametrize("prog", INGRESS)
def test_an_established_snated_flow_keeps_its_snat_pair_in_inspect_and_frees_it_when_rebalanced(
        dp: Dataplane, netns: Node, prog: Prog) -> None:
    """The defect: the backend's SYN-ACK wrote its entry's flags over the client's entry, which lost the mark of its
    SNAT pair (CT_F_MASQ): inspect showed an established flow without the address it leaves from, and a rebalance
    left the old SNAT pair (and its port) behind until it expired."""
    gone, kept = READY[0], READY[1]
    dp.apply(nodeport(backends=(gone,)))
    client = Flow(CLIENT, NODE_IP, 42100, NODE_PORT)
    out = forward(dp, prog, client, netns)
    backward(dp, prog, out.reply(), netns)
    forward(dp, prog, client, netns, tcp_flags=TCP_ACK)
    flows = [line for line in inspect.report(dp.maps).splitlines() if line.startswith("TCP ")]
    assert len(flows) == 1 and f"{gone} from {NODE_SIDE}:{out.sport}" in flows[0], flows
    dp.apply(nodeport(backends=(kept,)))
    again = forward(dp, prog, client, netns, tcp_flags=TCP_ACK)
    assert again.dst == kept.ip
    assert len(dp.maps.ct) == 4, "the old flow's SNAT pair was left behind"


def _closed_snated_flow(dp: Dataplane, prog: Prog, client: Flow, node: Node) -> Flow:
    """A connection through an SNATed frontend, opened and closed (FINs both ways): how it left the node."""
    out = forward(dp, prog, client, node)
    backward(dp, prog, out.reply(), node)
    forward(dp, prog, client, node, tcp_flags=TCP_FIN | TCP_ACK)
    backward(dp, prog, out.reply(), node, tcp_flags=TCP_FIN | TCP_ACK)
    forward(dp, prog, client, node, tcp_flags=TCP_ACK)
    return out


@pytest.mark.parametrize("prog", INGRESS)
def test_a_closed_snated_flow_does_not_snat_the_next_one_to_its_backend_from_the_same_port(
    dp: Dataplane, netns: Node, prog: Prog
) -> None:
    """The client closed a connection through a frontend that SNATs (externalTrafficPolicy Cluster) and opens one
    from the same port through another frontend of the same backend that does not (Local): the old SNAT pair has
    the new flow's tuple toward the backend, and must not put the node's address on it (seen in the two-node lab:
    1 of 30 eTP=Local connections reached the endpoint from the node)."""
    be = READY[0]
    dp.apply(nodeport(backends=(be,)), nodeport(backends=(be,), masquerade=False, port=NODE_PORT + 1))
    _closed_snated_flow(dp, prog, Flow(CLIENT, NODE_IP, 46000, NODE_PORT), netns)
    local = Flow(CLIENT, NODE_IP, 46000, NODE_PORT + 1)
    out = forward(dp, prog, local, netns)
    assert (out.src, out.sport, out.dst) == (CLIENT, 46000, be.ip), "the Local frontend keeps the client's address"
    assert backward(dp, prog, out.reply(), netns) == local.reply()
    # Back through the SNATed frontend from the same port: a new SNAT pair, and no pair left of the old one.
    again = forward(dp, prog, Flow(CLIENT, NODE_IP, 46000, NODE_PORT), netns)
    assert again.src == NODE_SIDE and again.sport in SNAT_PORTS
    snat_entries = [k for k in dp.maps.ct if dp.maps.ct[k].flags & abi.CT_F_SNAT]
    assert len(snat_entries) == 2, f"one SNAT pair, the live flow's: {snat_entries}"


@pytest.mark.parametrize("prog", INGRESS)
def test_a_direct_connection_after_an_snated_one_on_the_same_ports_keeps_the_clients_address(
    dp: Dataplane, netns: Node, prog: Prog
) -> None:
    """The connection-tracking defect's SNAT twin: after a closed SNATed connection to backend b from port P, the
    client connects to b itself from P; b must see the client, and its answer must reach the client from b."""
    be = READY[0]
    dp.apply(nodeport(backends=(be,)))
    _closed_snated_flow(dp, prog, Flow(CLIENT, NODE_IP, 46100, NODE_PORT), netns)
    direct = Flow(CLIENT, be.ip, 46100, be.port)
    assert forward(dp, prog, direct, netns) == direct, "a packet to an endpoint leaves untranslated"
    assert backward(dp, prog, direct.reply(), netns) == direct.reply()
    assert not [k for k in dp.maps.ct if dp.maps.ct[k].flags & abi.CT_F_SNAT], "the old SNAT pair is gone"


def test_no_route_to_the_backend_means_no_snat(dp: Dataplane, netns: Node) -> None:
    far = Backend("198.18.0.1", 8080)  # no route in the namespace: the stack would drop it anyway
    dp.apply(nodeport(backends=(far,)))
    out = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 43000, NODE_PORT), netns)
    assert (out.src, out.dst) == (CLIENT, far.ip)
    assert dp.counter("snat_no_route") == 1 and dp.counter("snat") == 0


@pytest.mark.parametrize("cut", [14 + 20 + 2, 14 + 20 + 12])  # (a test run refuses a shorter IPv4 header)
def test_truncated_packets_to_an_snat_port_pass_untouched(dp: Dataplane, netns: Node, cut: int) -> None:
    dp.apply(nodeport())
    out = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44000, NODE_PORT), netns)
    data = frame(out.reply(), tcp_flags=0x12)[:cut]
    for prog in (TC_INGRESS, XDP):
        verdict, seen = netns.run(dp, prog, data)
        assert verdict == prog.ok and seen == data
    assert dp.counter("revsnat") == 0


def test_a_reply_from_another_port_of_the_backend_is_not_translated(dp: Dataplane, netns: Node) -> None:
    dp.apply(nodeport(backends=(READY[0],)))
    out = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44100, NODE_PORT), netns)
    stranger = Flow(out.dst, out.src, out.dport + 1, out.sport)
    verdict, seen = netns.run(dp, TC_INGRESS, frame(stranger, tcp_flags=0x12))
    assert verdict == TC_INGRESS.ok and decode(seen).flow == stranger


def test_inspect_shows_where_an_snated_flow_leaves_from(dp: Dataplane, netns: Node) -> None:
    dp.apply(nodeport(backends=(READY[0],)))
    out = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44200, NODE_PORT), netns)
    flows = [line for line in inspect.report(dp.maps).splitlines() if line.startswith("TCP ")]
    assert len(flows) == 1, "one flow, its SNAT pair not listed as another"
    assert f"{CLIENT}:44200 -> {NODE_IP}:{NODE_PORT}" in flows[0]
    assert f"{READY[0]} from {NODE_SIDE}:{out.sport}" in flows[0]


def test_the_collector_reports_the_snat_ports_held_in_all_and_for_the_busiest_backend(dp: Dataplane,
                                                                                     netns: Node) -> None:
    """pyproxy_bpf_snat_ports_in_use{,_max}: how close SNAT is to running dry, which only the busiest node address,
    backend and protocol tells (the range is per backend). Three flows to one backend, one to another, one direct
    (eTP Local: not SNATed): 4 ports held, 3 for the busiest."""
    dp.apply(nodeport(backends=(READY[0],)), nodeport(backends=(READY[1],), port=NODE_PORT + 1),
             nodeport(backends=(READY[2],), port=NODE_PORT + 2, masquerade=False))
    for sport in (44300, 44301, 44302):
        forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, sport, NODE_PORT), netns)
    forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44303, NODE_PORT + 1), netns)
    forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 44304, NODE_PORT + 2), netns)
    hz = clock.kernel_hz()
    metrics = gc.CtGcMetrics()
    collector = gc.CtGarbageCollector(
        BpfMap(os.dup(dp.obj.maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue),
        BpfMap(os.dup(dp.obj.maps[abi.MAP_SERVICES]), abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue),
        capacity=dp.capacity[abi.MAP_CT], timeouts=CtTimeouts().ticks(hz), hz=hz, metrics=metrics)
    try:
        collector.run_pass()
    finally:
        collector.close()
    registry = CollectorRegistry()
    registry.register(metrics)
    assert registry.get_sample_value("pyproxy_bpf_snat_ports_in_use") == 4
    assert registry.get_sample_value("pyproxy_bpf_snat_ports_in_use_max") == 3


def test_masquerade_all_snats_every_clusterip_flow(dp: Dataplane, netns: Node) -> None:
    dp.apply(port_state(), masq=MasqueradeSettings(masquerade_all=True))
    out = forward(dp, TC_INGRESS, Flow("10.0.1.77", "10.96.0.10", 45100, 80), netns)
    assert out.src == NODE_SIDE and out.sport in SNAT_PORTS


def test_cluster_cidr_snats_clusterip_flows_from_outside_it(load: Load, netns: Node) -> None:
    cidr = "10.0.0.0/16"  # the pods: 10.0.1.0/24 is this node's share
    dp = Dataplane(load(None, max_entries=CAPACITY, cluster_cidr=cidr))
    try:
        dp.apply(port_state(), masq=MasqueradeSettings(cluster_cidr=cidr))
        pod = forward(dp, TC_INGRESS, Flow("10.0.1.77", "10.96.0.10", 45200, 80), netns)
        assert (pod.src, pod.sport) == ("10.0.1.77", 45200), "a pod keeps its address"
        outside = forward(dp, XDP, Flow(CLIENT, "10.96.0.10", 45201, 80), netns)
        assert outside.src == NODE_SIDE and outside.sport in SNAT_PORTS
    finally:
        dp.close()


def test_without_fib_src_the_egress_devices_primary_address_is_the_source(bpf_object: Path) -> None:
    """Kernels without BPF_FIB_LOOKUP_SRC: the route lookup names the egress device, the devices map its primary
    address (not a secondary one, not another device's); a device missing from the map means no SNAT."""
    with scratch_node("pyp-snat", [("in0", "10.0.1.254/24"), ("out0", "10.0.2.254/24")]) as (thread, ifindex):
        node = Node(thread, ifindex["in0"])
        subprocess.run(["ip", "-n", thread.netns, "addr", "add", "10.0.2.253/24", "dev", "out0"], check=True)
        dp = Dataplane(loader.load(bpf_object, None, max_entries=CAPACITY, kernel_flags=0))
        try:
            far = Backend("10.0.2.7", 8080)
            dp.apply(nodeport(backends=(far,)))
            out = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 46200, NODE_PORT), node)
            assert (out.src, out.dst) == (CLIENT, far.ip), "no entry for out0 yet: no SNAT"
            assert dp.counter("snat_no_route") == 1
            wanted = thread.call(netlink.primary_ipv4_by_device)
            assert wanted == {ifindex["in0"]: "10.0.1.254", ifindex["out0"]: "10.0.2.254"}
            assert snat.write_device_addresses(dp.maps.devaddrs, wanted)
            assert not snat.write_device_addresses(dp.maps.devaddrs, wanted), "nothing changed"
            out = forward(dp, TC_INGRESS, Flow(CLIENT, NODE_IP, 46201, NODE_PORT), node)
            assert out.src == "10.0.2.254" and out.sport in SNAT_PORTS
            assert snat.write_device_addresses(dp.maps.devaddrs, {})
            assert len(dp.maps.devaddrs) == 0
        finally:
            dp.close()


def test_the_devices_map_follows_the_nodes_addresses(bpf_object: Path) -> None:
    """What bpf mode runs on kernels without BPF_FIB_LOOKUP_SRC (snat.DeviceAddresses): the map holds each device's
    primary address from the start, and follows netlink as addresses come and go."""
    with scratch_node("pyp-snat", [("out0", "10.0.2.254/24")]) as (thread, ifindex):
        dp = Dataplane(loader.load(bpf_object, None, max_entries=CAPACITY, kernel_flags=0))
        # Made in the namespace's thread: the watcher's own thread, and its netlink socket, are the namespace's.
        follower = thread.call(lambda: snat.DeviceAddresses(
            BpfMap(os.dup(dp.obj.maps[abi.MAP_DEVADDRS]), abi.MAP_DEVADDRS, ctypes.c_uint32, ctypes.c_uint32)))
        try:
            thread.call(follower.start)

            def devices() -> dict[int, str]:
                return {int(k.value): abi.ip_of(int(v.value)) for k, v in dp.maps.devaddrs.items()}

            assert devices() == {ifindex["out0"]: "10.0.2.254"}
            for args in (["add", "10.0.3.1/24"], ["del", "10.0.2.254/24"]):
                subprocess.run(["ip", "-n", thread.netns, "addr", *args, "dev", "out0"], check=True)
            deadline = time.monotonic() + 10
            while devices() != {ifindex["out0"]: "10.0.3.1"} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert devices() == {ifindex["out0"]: "10.0.3.1"}
        finally:
            follower.stop()
            dp.close()


def test_the_ipv6_devices_map_follows_the_nodes_ipv6_addresses(bpf_object: Path) -> None:
    """The same for IPv6 SNAT (abi.MAP_DEVADDRS6): each device's first usable global IPv6 address, followed."""
    with scratch_node("pyp-snat", [("out0", "10.0.2.254/24")]) as (thread, ifindex):
        subprocess.run(["ip", "-n", thread.netns, "addr", "add", "fd00:2::fe/64", "dev", "out0", "nodad"], check=True)
        dp = Dataplane(loader.load(bpf_object, None, max_entries=CAPACITY, kernel_flags=0))
        follower = thread.call(lambda: snat.DeviceAddresses(
            BpfMap(os.dup(dp.obj.maps[abi.MAP_DEVADDRS]), abi.MAP_DEVADDRS, ctypes.c_uint32, ctypes.c_uint32),
            devaddrs6=BpfMap(os.dup(dp.obj.maps[abi.MAP_DEVADDRS6]), abi.MAP_DEVADDRS6, ctypes.c_uint32, abi.In6)))
        try:
            thread.call(follower.start)

            def devices6() -> dict[int, str]:
                return {int(k.value): abi.ip6_of(v) for k, v in dp.maps.devaddrs6.items()}

            assert devices6() == {ifindex["out0"]: "fd00:2::fe"}
            for args in (["add", "fd00:3::1/64", "nodad"], ["del", "fd00:2::fe/64"]):
                subprocess.run(["ip", "-n", thread.netns, "addr", *args, "dev", "out0"], check=True)
            deadline = time.monotonic() + 10
            while devices6() != {ifindex["out0"]: "fd00:3::1"} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert devices6() == {ifindex["out0"]: "fd00:3::1"}
        finally:
            follower.stop()
            dp.close()
