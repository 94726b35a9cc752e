"""External frontends in bpf mode (NodePort, ExternalIP, LoadBalancer IP) with externalTrafficPolicy Local, packet
by packet: outside clients reach only this node's endpoints and keep their address; with none here the flow is
dropped (the client waits for another node, as upstream); loadBalancerSourceRanges keep new flows from other
sources out. Policy Cluster, which SNATs: test_snat.py."""

from __future__ import annotations

import os

import pytest
from conftest import Load
from harness import CAPACITY, CLIENT, INGRESS, READY, ROOT, TC_INGRESS, Dataplane, Prog, backend_of, dnat
from packets import Flow, frame

from pyproxy.dataplane.bpf.mapset import Maps
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

pytestmark = ROOT

NODE_IP, NODE_PORT, LB_IP = "10.0.0.1", 30080, "203.0.113.10"
LOCAL = READY[0]


def external(kind: FrontendKind, ip: str, port: int, local: tuple[Backend, ...], *, ranges: tuple[str, ...] = (),
             masquerade: bool = False) -> ServicePortState:
    return ServicePortState(
        service="default/web", port_name=f"{kind}-{port}", frontend=Frontend(ip, port, Protocol.TCP),
        backends=READY, known_backends=READY, kind=kind, external_backends=local, masquerade=masquerade,
        source_ranges=ranges,
    )


@pytest.mark.parametrize("prog", INGRESS)
def test_local_policy_serves_outside_clients_from_this_nodes_endpoints_only(dp: Dataplane, prog: Prog) -> None:
    dp.apply(external(FrontendKind.NODE_PORT, NODE_IP, NODE_PORT, (LOCAL,)))
    got = {dnat(dp, prog, Flow(CLIENT, NODE_IP, 40000 + i, NODE_PORT)) for i in range(30)}
    assert got == {LOCAL}, "a flow from outside went to an endpoint on another node"


@pytest.mark.parametrize("prog", INGRESS)
def test_local_policy_without_a_local_endpoint_drops(dp: Dataplane, prog: Prog) -> None:
    dp.apply(external(FrontendKind.EXTERNAL_IP, "192.0.2.10", 80, ()))
    data = frame(Flow(CLIENT, "192.0.2.10", 40100, 80))
    assert dp.run(prog, data)[0] == prog.drop
    assert dp.counter("no_local") == 1 and dp.counter("no_backend") == 0 and len(dp.maps.ct) == 0


@pytest.mark.parametrize("prog", INGRESS)
def test_source_ranges_keep_other_sources_out(dp: Dataplane, prog: Prog) -> None:
    dp.apply(external(FrontendKind.LOAD_BALANCER, LB_IP, 80, (LOCAL,), ranges=("192.168.1.0/24", "10.9.0.0/16")))
    assert dnat(dp, prog, Flow(CLIENT, LB_IP, 40200, 80)) == LOCAL  # CLIENT is 192.168.1.10
    assert dnat(dp, prog, Flow("10.9.200.1", LB_IP, 40201, 80)) == LOCAL
    outside = frame(Flow("198.51.100.7", LB_IP, 40202, 80))
    assert dp.run(prog, outside)[0] == prog.drop
    assert dp.counter("source_denied") == 1


def test_changed_ranges_apply_to_new_flows_and_survive_a_restart(dp: Dataplane) -> None:
    dp.apply(external(FrontendKind.LOAD_BALANCER, LB_IP, 80, (LOCAL,), ranges=("192.168.1.0/24",)))
    dp.apply(external(FrontendKind.LOAD_BALANCER, LB_IP, 80, (LOCAL,), ranges=("198.51.100.0/24",)))
    assert dp.run(TC_INGRESS, frame(Flow(CLIENT, LB_IP, 40300, 80)))[0] == TC_INGRESS.drop
    assert backend_of(dp.run(TC_INGRESS, frame(Flow("198.51.100.7", LB_IP, 40301, 80)))[1]) == LOCAL
    assert len(dp.maps.srcranges) == 1, "the old range's entry was left behind"
    # A restart rebuilds what is applied from the maps alone: the same frontends, flags and ranges.
    again = Maps({name: os.dup(fd) for name, fd in dp.obj.maps.items()})
    try:
        def served(frontends: dict) -> dict:
            return {k: (fe.svc_id, fe.backends, fe.flags, fe.source_ranges) for k, fe in frontends.items()}

        assert served(again.read_applied().frontends) == served(dp.applied.frontends)
    finally:
        again.close()
    dp.apply()  # the Service goes: its ranges go with it
    assert len(dp.maps.srcranges) == 0


POD = "10.244.1.5"
"""A pod of this node, inside the --cluster-cidr the short-circuit test loads with."""


def test_a_pod_reaches_every_endpoint_of_a_local_frontend_keeping_its_address(load: Load) -> None:
    """Upstream's short circuit on TC (a pod's veth, its flows left there by the socket hooks or with
    --bpf-socket-lb-hostns-only): a source inside --cluster-cidr reaching an externalTrafficPolicy Local external IP
    is served from every endpoint, unmasqueraded (dnat checks the frame is the pod's own, only its destination
    changed), as if it had gone out and come back; an outside client still gets this node's endpoint only."""
    d = Dataplane(load(None, max_entries=CAPACITY, cluster_cidr="10.244.0.0/16"))
    try:
        d.apply(external(FrontendKind.EXTERNAL_IP, "192.0.2.11", 80, (LOCAL,)))
        from_pod = {dnat(d, TC_INGRESS, Flow(POD, "192.0.2.11", 41000 + i, 80)) for i in range(30)}
        assert from_pod == set(READY), f"a pod reached only {from_pod}"
        from_outside = {dnat(d, TC_INGRESS, Flow(CLIENT, "192.0.2.11", 42000 + i, 80)) for i in range(30)}
        assert from_outside == {LOCAL}
    finally:
        d.close()
