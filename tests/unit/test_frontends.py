"""Every frontend of a Service and its policy, decided once in the model (pyproxy/model/desired.py): node ports
on the node's addresses, external IPs, load-balancer IPs, the endpoint sets for inside and outside sources,
masquerade, source ranges, the health-check port; which Service serves a contested frontend across partial
updates; and that every renderer takes only the kinds it renders today."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

import pytest

from pyproxy.dataplane.bpf.render import Applied
from pyproxy.dataplane.bpf.render import render as bpf_render
from pyproxy.dataplane.iptables.render import render as iptables_render
from pyproxy.dataplane.ipvs.render import Memory, Observed, Options
from pyproxy.dataplane.ipvs.render import render as ipvs_render
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.render import render as nftables_render
from pyproxy.dataplane.nftables.table import TableState
from pyproxy.model.desired import compute_desired_state, compute_service_state, update_desired_state
from pyproxy.model.node import NodeInputs, select_nodeport_addresses
from pyproxy.model.objects import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Protocol,
    Service,
    ServicePort,
    TrafficPolicy,
)
from pyproxy.model.state import (
    Backend,
    DesiredState,
    Frontend,
    FrontendKind,
    HealthCheck,
    ServicePortState,
    health_check,
)

TCP, UDP = Protocol.TCP, Protocol.UDP
CLUSTER_IP, NODE_PORT = FrontendKind.CLUSTER_IP, FrontendKind.NODE_PORT
EXTERNAL_IP, LOAD_BALANCER = FrontendKind.EXTERNAL_IP, FrontendKind.LOAD_BALANCER
LOCAL = TrafficPolicy.LOCAL

HTTP = ServicePort("http", 80, TCP, 8080, node_port=30080)
DNS = ServicePort("dns", 53, UDP, 5353, node_port=30053)
NODE = NodeInputs(name="node-a", nodeport_addresses=("10.0.0.5", "192.168.1.5"), primary_ip="10.0.0.5")


def svc(type: str = "NodePort", name: str = "web", ip: str = "10.96.0.10", ports: tuple[ServicePort, ...] = (HTTP, DNS),
        **fields: object) -> Service:
    return Service("default", name, type, (ip,), ports, **fields)  # type: ignore[arg-type]


def ep(ip: str, node: str | None = None, ready: bool = True, serving: bool | None = None,
       terminating: bool = False) -> Endpoint:
    return Endpoint((ip,), ready, ready if serving is None else serving, terminating, node)


def slice_(*endpoints: Endpoint, service: str = "web") -> EndpointSlice:
    ports = (EndpointPort("http", 8080, TCP), EndpointPort("dns", 5353, UDP))
    return EndpointSlice("default", f"{service}-1", service, "IPv4", endpoints, ports)


def shown(states: Iterable[ServicePortState]) -> list[str]:
    return [f"{st.kind} {st.frontend}" for st in states]


def of_kind(states: Iterable[ServicePortState], kind: FrontendKind) -> list[ServicePortState]:
    return [st for st in states if st.kind is kind]


def backends(*ips: str, port: int = 8080) -> tuple[Backend, ...]:
    return tuple(Backend(ip, port) for ip in ips)


# ------------------------------------------------------------------------------------------------ frontends


def test_a_cluster_ip_service_reads_exactly_as_before() -> None:
    """Only ClusterIP frontends, with every new field at its default: what every backend renders today. A
    nodePort on a ClusterIP Service (the API would not allocate one) makes no frontend."""
    (http,) = compute_service_state(svc("ClusterIP", ports=(HTTP,)), [slice_(ep("10.1.0.1"))], NODE)
    assert http == ServicePortState("default/web", "http", Frontend("10.96.0.10", 80, TCP), backends("10.1.0.1"),
                                    backends("10.1.0.1"))


def test_node_ports_on_every_node_address_tcp_and_udp() -> None:
    states = compute_service_state(svc(), [slice_(ep("10.1.0.1"), ep("10.1.0.2"))], NODE)
    assert shown(states) == [
        "NodePort 10.0.0.5:30053/UDP", "NodePort 10.0.0.5:30080/TCP", "ClusterIP 10.96.0.10:53/UDP",
        "ClusterIP 10.96.0.10:80/TCP", "NodePort 192.168.1.5:30053/UDP", "NodePort 192.168.1.5:30080/TCP",
    ]
    for st in of_kind(states, NODE_PORT):
        port = 8080 if st.port_name == "http" else 5353
        assert st.backends == st.external_backends == backends("10.1.0.1", "10.1.0.2", port=port)
        assert st.masquerade, "externalTrafficPolicy Cluster: SNAT so replies come back through this node"
        assert st.source_ranges == () and st.health_check_node_port is None
    for st in of_kind(states, CLUSTER_IP):
        assert (st.external_backends, st.masquerade) == ((), False)


def test_no_node_addresses_no_node_port_frontends() -> None:
    states = compute_service_state(svc(), [], NodeInputs(name="node-a"))
    assert {st.kind for st in states} == {CLUSTER_IP}


def test_a_load_balancer_service_has_cluster_ip_external_ip_ingress_ip_and_node_port_frontends() -> None:
    lb = svc("LoadBalancer", ports=(HTTP,), external_ips=("192.0.2.10",), load_balancer_ips=("203.0.113.10",))
    states = compute_service_state(lb, [slice_(ep("10.1.0.1"))], NODE)
    assert sorted(shown(states)) == [
        "ClusterIP 10.96.0.10:80/TCP", "ExternalIP 192.0.2.10:80/TCP", "LoadBalancer 203.0.113.10:80/TCP",
        "NodePort 10.0.0.5:30080/TCP", "NodePort 192.168.1.5:30080/TCP",
    ]
    assert all(st.backends == backends("10.1.0.1") for st in states)
    assert all(st.session_affinity_seconds == 0 and st.port_name == "http" for st in states)


def test_external_ips_serve_on_every_proxied_type_load_balancer_ips_only_on_load_balancers() -> None:
    fields = {"external_ips": ("192.0.2.10",), "load_balancer_ips": ("203.0.113.10",)}
    cluster_ip = compute_service_state(svc("ClusterIP", ports=(HTTP,), **fields), [], NODE)
    assert shown(cluster_ip) == ["ClusterIP 10.96.0.10:80/TCP", "ExternalIP 192.0.2.10:80/TCP"]
    node_port = compute_service_state(svc("NodePort", ports=(HTTP,), **fields), [], NODE)
    assert LOAD_BALANCER not in {st.kind for st in node_port}
    assert compute_service_state(svc("ExternalName", **fields), [], NODE) == ()
    assert compute_service_state(replace(svc("LoadBalancer", **fields), cluster_ips=()), [], NODE) == (), \
        "headless: nothing, as upstream"


def test_a_frontend_a_service_claims_twice_keeps_the_first_kind() -> None:
    """An external IP equal to the ClusterIP, an ingress IP also listed as external IP: one frontend each, of
    the kind upstream's rules match first (the ExternalIP one: no source ranges on it)."""
    lb = svc("LoadBalancer", ports=(HTTP,), external_ips=("10.96.0.10", "203.0.113.10"),
             load_balancer_ips=("203.0.113.10",), load_balancer_source_ranges=("198.51.100.0/24",))
    states = compute_service_state(lb, [], NodeInputs())
    assert shown(states) == ["ClusterIP 10.96.0.10:80/TCP", "ExternalIP 203.0.113.10:80/TCP"]
    assert all(st.source_ranges == () for st in states)


# --------------------------------------------------------------------------------------- node-port addresses


ADDRESSES = ("192.168.1.5", "10.0.0.5", "fd00::5", "127.0.0.1", "10.0.0.5", "fe80::5", "2001:db8::5")


@pytest.mark.parametrize(
    ("setting", "primary", "primary6", "expected"),
    [
        # Unset: all, as upstream's iptables mode, IPv4 first (IPv6 link-local ones never).
        ((), "10.0.0.5", None, ("10.0.0.5", "127.0.0.1", "192.168.1.5", "2001:db8::5", "fd00::5")),
        (("primary",), "10.0.0.5", "fd00::5", ("10.0.0.5", "fd00::5")),
        (("10.0.0.0/8",), None, None, ("10.0.0.5", "2001:db8::5", "fd00::5")),
        (("10.0.0.0/8", " 192.168.0.0/16", "fd00::/8"), None, None, ("10.0.0.5", "192.168.1.5", "fd00::5")),
        (("172.16.0.0/12", "fc00::/16"), None, None, ()),
        # As upstream: a family given no CIDR matches all its addresses.
        (("fd00::/8",), None, None, ("10.0.0.5", "127.0.0.1", "192.168.1.5", "fd00::5")),
        (("primary",), None, "fd00::5", ("10.0.0.5", "127.0.0.1", "192.168.1.5", "fd00::5")),
        (("primary",), "10.0.0.5", None, ("10.0.0.5", "2001:db8::5", "fd00::5")),
    ],
)
def test_nodeport_addresses_select_the_node_addresses_node_ports_serve_on(
    setting: tuple[str, ...], primary: str | None, primary6: str | None, expected: tuple[str, ...]
) -> None:
    assert select_nodeport_addresses(ADDRESSES, setting, primary, primary6) == expected


@pytest.mark.parametrize("setting", [("10.0.0.5",), ("primary", "10.0.0.0/8"), ("eth0",)])
def test_a_nodeport_addresses_entry_that_is_no_cidr_is_named(setting: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="--nodeport-addresses: '.*' is not a CIDR"):
        select_nodeport_addresses(ADDRESSES, setting, "10.0.0.5")


def test_node_ports_serve_on_the_selected_addresses_only() -> None:
    node = replace(NODE, nodeport_addresses=select_nodeport_addresses(ADDRESSES, ("primary",), NODE.primary_ip))
    states = compute_service_state(svc(ports=(HTTP,)), [], node)
    assert shown(of_kind(states, NODE_PORT)) == ["NodePort 10.0.0.5:30080/TCP"]


# ---------------------------------------------------------------------------------------- endpoints, policy


SPREAD = slice_(ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-b"), ep("10.1.0.3"))


def test_external_traffic_policy_local_limits_only_outside_sources_to_this_nodes_endpoints() -> None:
    lb = svc("LoadBalancer", ports=(HTTP,), external_ips=("192.0.2.10",), load_balancer_ips=("203.0.113.10",),
             external_traffic_policy=LOCAL, health_check_node_port=31000)
    states = compute_service_state(lb, [SPREAD], NODE)
    everyone = backends("10.1.0.1", "10.1.0.2", "10.1.0.3")
    for st in states:
        assert st.backends == everyone, "pods and the node itself use every endpoint (upstream's short circuit)"
        assert st.health_check_node_port == 31000, "Service-level: on every frontend"
        if st.kind.external:
            assert st.external_backends == backends("10.1.0.1"), "only nodeName == this node's name"
            assert not st.masquerade, "the client keeps its address"
        else:
            assert st.external_backends == () and not st.masquerade


def test_external_traffic_policy_local_without_a_local_endpoint_drops_outside_traffic() -> None:
    """external_backends empty while backends are not: upstream's DROP (reject only when the cluster has none)."""
    for node in (replace(NODE, name="node-c"), replace(NODE, name=None)):
        states = compute_service_state(svc(ports=(HTTP,), external_traffic_policy=LOCAL), [SPREAD], node)
        for st in of_kind(states, NODE_PORT):
            assert st.external_backends == () and len(st.backends) == 3


def test_the_health_check_port_is_served_only_for_load_balancers_with_local_policy() -> None:
    for type, policy in (("NodePort", LOCAL), ("LoadBalancer", TrafficPolicy.CLUSTER)):
        states = compute_service_state(svc(type, external_traffic_policy=policy, health_check_node_port=31000), [],
                                       NODE)
        assert {st.health_check_node_port for st in states} == {None}


@pytest.mark.parametrize(("endpoints", "count"), [
    # Distinct local ready addresses over every port (upstream's LocalReadyEndpoints): each serves two ports.
    ((ep("10.1.0.1", "node-a"), ep("10.1.0.4", "node-a"), ep("10.1.0.2", "node-b"), ep("10.1.0.3")), 2),
    # A local endpoint that is terminating (and still serving) does not count: load balancers drain the node.
    ((ep("10.1.0.1", "node-a", ready=False, serving=True, terminating=True), ep("10.1.0.2", "node-b")), 0),
    ((ep("10.1.0.1", "node-a", ready=False, serving=True, terminating=True),), 0),
    ((), 0),
])
def test_the_health_check_counts_this_nodes_ready_endpoints(endpoints: tuple[Endpoint, ...], count: int) -> None:
    lb = svc("LoadBalancer", external_traffic_policy=LOCAL, health_check_node_port=31000)
    slices = [slice_(*endpoints)]  # each endpoint serves both ports, http and dns
    assert health_check(compute_service_state(lb, slices, NODE)) == HealthCheck(31000, count)
    assert health_check(compute_service_state(replace(lb, external_traffic_policy=TrafficPolicy.CLUSTER), slices,
                                              NODE)) is None


def test_a_health_check_without_a_served_external_frontend_counts_nothing() -> None:
    """No node-port address and no load-balancer IP: nothing external is served here, so nothing is local."""
    lb = svc("LoadBalancer", ports=(HTTP,), external_traffic_policy=LOCAL, health_check_node_port=31000)
    states = compute_service_state(lb, [slice_(ep("10.1.0.1", "node-a"))], replace(NODE, nodeport_addresses=()))
    assert health_check(states) == HealthCheck(31000, 0)
    assert health_check(()) is None


@pytest.mark.parametrize(
    ("endpoints", "usable", "local"),
    [
        # Ready ones when there are: terminating ones are left out.
        ((ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-a", ready=False, serving=True, terminating=True)),
         ("10.1.0.1",), ("10.1.0.1",)),
        # None ready: the serving and terminating ones (upstream's ProxyTerminatingEndpoints) ...
        ((ep("10.1.0.1", "node-b", ready=False, serving=True, terminating=True),
          ep("10.1.0.2", "node-a", ready=False, serving=True, terminating=True)),
         ("10.1.0.1", "10.1.0.2"), ("10.1.0.2",)),
        # ... never one that is not serving, nor a not-ready one that is not terminating.
        ((ep("10.1.0.1", "node-a", ready=False, serving=False, terminating=True),
          ep("10.1.0.2", "node-a", ready=False, serving=True)),
         (), ()),
        # Per scope: the cluster has a ready endpoint, this node only a terminating one.
        ((ep("10.1.0.1", "node-b"), ep("10.1.0.2", "node-a", ready=False, serving=True, terminating=True)),
         ("10.1.0.1",), ("10.1.0.2",)),
    ],
)
def test_new_flows_use_ready_endpoints_else_serving_terminating_ones_per_scope(
    endpoints: tuple[Endpoint, ...], usable: tuple[str, ...], local: tuple[str, ...]
) -> None:
    states = compute_service_state(svc(ports=(HTTP,), external_traffic_policy=LOCAL), [slice_(*endpoints)], NODE)
    (cluster,) = of_kind(states, CLUSTER_IP)
    assert cluster.backends == backends(*usable)
    assert cluster.known_backends == backends(*sorted(e.addresses[0] for e in endpoints))
    for st in of_kind(states, NODE_PORT):
        assert (st.backends, st.external_backends) == (backends(*usable), backends(*local))


@pytest.mark.parametrize(
    ("endpoints", "internal", "drop"),
    [
        # This node's ready endpoints only; the other node's and a local terminating one are left out.
        ((ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-b"),
          ep("10.1.0.3", "node-a", ready=False, serving=True, terminating=True)), ("10.1.0.1",), False),
        # None ready here (though the cluster has one): this node's serving and terminating ones.
        ((ep("10.1.0.1", "node-b"), ep("10.1.0.2", "node-a", ready=False, serving=True, terminating=True)),
         ("10.1.0.2",), False),
        # None usable here while the cluster has some: dropped, not rejected. A missing nodeName is no node's.
        ((ep("10.1.0.1", "node-b"), ep("10.1.0.2"), ep("10.1.0.3", "node-a", ready=False, serving=False,
                                                       terminating=True)), (), True),
        # None usable anywhere: rejected, as with the Cluster policy.
        ((ep("10.1.0.1", "node-a", ready=False, serving=False, terminating=True),), (), False),
        ((), (), False),
    ],
)
def test_internal_traffic_policy_local_limits_the_cluster_ip_to_this_nodes_endpoints(
    endpoints: tuple[Endpoint, ...], internal: tuple[str, ...], drop: bool
) -> None:
    states = compute_service_state(svc(ports=(HTTP,), internal_traffic_policy=LOCAL), [slice_(*endpoints)], NODE)
    (cluster,) = of_kind(states, CLUSTER_IP)
    assert (cluster.backends, cluster.drop) == (backends(*internal), drop)
    assert cluster.known_backends == backends(*sorted(e.addresses[0] for e in endpoints))
    # iTP applies to the ClusterIP only: the node ports' sources inside the cluster keep every usable endpoint.
    cluster_policy = compute_service_state(svc(ports=(HTTP,)), [slice_(*endpoints)], NODE)
    for st, before in zip(of_kind(states, NODE_PORT), of_kind(cluster_policy, NODE_PORT), strict=True):
        assert st == before and not st.drop


def test_a_flip_of_the_internal_traffic_policy_changes_the_cluster_ip_only() -> None:
    spread = [slice_(ep("10.1.0.1", "node-b"), ep("10.1.0.2", "node-c"))]
    cluster = svc("ClusterIP", ports=(HTTP,))
    local = replace(cluster, internal_traffic_policy=LOCAL)
    before = compute_desired_state({cluster.key: cluster}, lambda key: spread, NODE)
    after = update_desired_state(before, {local.key: local}, lambda key: spread, [local.key])
    ((was,), (now,)) = before.services[cluster.key], after.services[cluster.key]
    assert (was.backends, was.drop) == (backends("10.1.0.1", "10.1.0.2"), False)
    assert (now.backends, now.drop) == ((), True)
    assert now.known_backends == was.known_backends, "established flows to the other nodes' endpoints are kept"
    back = update_desired_state(after, {cluster.key: cluster}, lambda key: spread, [cluster.key])
    assert back.services == before.services


def test_source_ranges_apply_to_load_balancer_frontends_only() -> None:
    lb = svc("LoadBalancer", ports=(HTTP,), external_ips=("192.0.2.10",), load_balancer_ips=("203.0.113.10",),
             load_balancer_source_ranges=("198.51.100.0/24",))
    states = compute_service_state(lb, [], replace(NODE, primary_ip="192.0.2.99"))
    assert {st.kind: st.source_ranges for st in states} == {
        CLUSTER_IP: (), EXTERNAL_IP: (), NODE_PORT: (), LOAD_BALANCER: ("198.51.100.0/24",)}


def test_a_range_holding_the_node_admits_the_load_balancer_ips_and_any_source_means_no_ranges() -> None:
    lb = svc("LoadBalancer", ports=(HTTP,), load_balancer_ips=("203.0.113.10", "203.0.113.11"),
             load_balancer_source_ranges=("10.0.0.0/24",))
    ranges = {st.source_ranges for st in of_kind(compute_service_state(lb, [], NODE), LOAD_BALANCER)}
    assert ranges == {("10.0.0.0/24", "203.0.113.10/32", "203.0.113.11/32")}
    anywhere = replace(lb, load_balancer_source_ranges=("10.0.0.0/24", "0.0.0.0/0"))
    assert {st.source_ranges for st in compute_service_state(anywhere, [], NODE)} == {()}


# --------------------------------------------------------------------------------------- contested frontends


FE = Frontend("10.96.0.10", 80, TCP)
NO_SLICES: dict[str, tuple[EndpointSlice, ...]] = {}


def cluster(*services: Service) -> dict[str, Service]:
    return {s.key: s for s in services}


def update(prev: DesiredState, services: dict[str, Service], *changed: str) -> DesiredState:
    return update_desired_state(prev, services, lambda key: NO_SLICES.get(key, ()), set(changed))


def holder(desired: DesiredState, fe: Frontend = FE) -> str | None:
    return desired.holders.get(fe)


def test_a_cluster_ip_freed_and_taken_by_another_service_in_the_same_update() -> None:
    services = cluster(svc("ClusterIP", "a", ports=(HTTP,)))
    first = update(DesiredState(), services, "default/a")
    services = cluster(svc("ClusterIP", "a", "10.96.0.11", (HTTP,)), svc("ClusterIP", "b", ports=(HTTP,)))
    second = update(first, services, "default/a", "default/b")
    assert holder(second) == "default/b" and holder(second, FE._replace(ip="10.96.0.11")) == "default/a"
    assert second.rejected == () and second.waiting == {} and second.claimants == {}


def test_a_cluster_ip_freed_in_a_later_update_goes_to_the_service_waiting_for_it() -> None:
    services = cluster(svc("ClusterIP", "b", ports=(HTTP,)))
    first = update(DesiredState(), services, "default/b")
    services["default/a"] = svc("ClusterIP", "a", ports=(HTTP,))  # sorts first, but b serves it already
    second = update(first, services, "default/a")
    assert holder(second) == "default/b" and "default/a" not in second.services
    services["default/b"] = svc("ClusterIP", "b", "10.96.0.12", (HTTP,))
    third = update(second, services, "default/b")
    assert holder(third) == "default/a"
    assert third.also_changed == {"default/a"}, "a partial apply must include the Service that got it"
    assert shown(third.services["default/a"]) == ["ClusterIP 10.96.0.10:80/TCP"]
    assert third.waiting == {} and third.claimants == {}


def test_a_deleted_service_releases_its_frontends_to_the_first_waiting_and_the_rest_wait_for_it() -> None:
    services = cluster(*(svc("ClusterIP", name, ports=(HTTP,)) for name in ("a", "c", "b")))
    first = update(DesiredState(), services, *services)
    assert holder(first) == "default/a" and first.claimants[FE] == ("default/b", "default/c")
    del services["default/a"]
    second = update(first, services, "default/a")
    assert set(second.services) == {"default/b"} and second.also_changed == {"default/b"}
    assert second.claimants == {FE: ("default/c",)}
    assert [str(c) for c in second.rejected] == [
        "default/c:http ClusterIP 10.96.0.10:80/TCP: frontend already served by default/b"]
    del services["default/b"]
    third = update(second, services, "default/b")
    assert set(third.services) == {"default/c"} and third.claimants == {} and third.waiting == {}
    assert third == update(DesiredState(), services, *services)


def test_a_freed_frontend_goes_to_the_first_by_name_of_the_waiting_and_the_new_claimants() -> None:
    services = cluster(svc("ClusterIP", "a", ports=(HTTP,)), svc("ClusterIP", "c", ports=(HTTP,)))
    first = update(DesiredState(), services, *services)
    del services["default/a"]
    services["default/b"] = svc("ClusterIP", "b", ports=(HTTP,))
    second = update(first, services, "default/a", "default/b")
    assert holder(second) == "default/b" and second.claimants == {FE: ("default/c",)}
    services["default/aa"] = svc("ClusterIP", "aa", ports=(HTTP,))
    del services["default/b"]
    third = update(second, services, "default/b", "default/aa")
    assert holder(third) == "default/aa", "a newcomer sorting before the one waiting"


def test_a_service_losing_one_frontend_serves_its_others() -> None:
    """Two Services allocated one nodePort (manifests can): the first keeps the node ports, the other serves its
    ClusterIP and waits for them."""
    services = cluster(svc("NodePort", "a", ports=(HTTP,)), svc("NodePort", "b", "10.96.0.20", (HTTP,)))
    desired = update_desired_state(DesiredState(), services, lambda key: (), set(services), NODE)
    assert shown(desired.services["default/b"]) == ["ClusterIP 10.96.0.20:80/TCP"]
    assert shown(desired.waiting["default/b"]) == ["NodePort 10.0.0.5:30080/TCP", "NodePort 192.168.1.5:30080/TCP"]
    del services["default/a"]
    after = update_desired_state(desired, services, lambda key: (), {"default/a"})
    assert after.node == NODE, "the node carries over"
    assert len(after.services["default/b"]) == 3 and after.also_changed == {"default/b"}


def test_a_changed_node_recomputes_every_service() -> None:
    services = cluster(svc("NodePort", "a", ports=(HTTP,)), svc("ClusterIP", "b", "10.96.0.20", (HTTP,)))
    first = update_desired_state(DesiredState(), services, lambda key: (), set(services), NODE)
    moved = replace(NODE, nodeport_addresses=("10.0.0.6",))
    second = update_desired_state(first, services, lambda key: (), set(), moved)
    assert second.also_changed == {"default/a"}, "only the Service whose frontends changed"
    assert shown(of_kind(second.services["default/a"], NODE_PORT)) == ["NodePort 10.0.0.6:30080/TCP"]
    assert second == compute_desired_state(services, lambda key: (), moved)


# ------------------------------------------------------------------------------------------- what is rendered


def test_every_renderer_programs_every_kind_of_frontend() -> None:
    """A Service with every kind of frontend: each mode's plan holds its external and load-balancer addresses and
    its node ports, not its ClusterIP alone (each renderer's own tests say how)."""
    services = cluster(svc("LoadBalancer", external_ips=("192.0.2.10",), load_balancer_ips=("203.0.113.10",),
                           external_traffic_policy=LOCAL, health_check_node_port=31000,
                           load_balancer_source_ranges=("198.51.100.0/24",)))
    full = update_desired_state(DesiredState(), services, lambda key: (slice_(ep("10.1.0.1", "node-a")),),
                                set(services), NODE)
    assert len(full.services["default/web"]) == 10
    plans = {
        "bpf": str(bpf_render(Applied(), full.services, {}).batches),
        "iptables": iptables_render(full, set(full.services), {}, MasqueradeSettings()).text,
        "ipvs": str(ipvs_render(Observed(), Memory(), full.services, full=True, options=Options(), now=0.0).ops),
        "nftables": "\n".join(nftables_render(TableState(), full.services, MasqueradeSettings(), full=True).commands),
    }
    for mode, plan in plans.items():
        for frontend in ("192.0.2.10", "203.0.113.10", "30080", "30053"):
            assert frontend in plan, f"{mode} mode leaves {frontend} out"


def test_contested_frontends_stay_consistent_across_random_partial_updates() -> None:
    """Random creates, deletes and address changes over a few shared addresses, node ports and node changes:
    after every update each frontend is served by one Service at most, by one that claims it; every other claim
    waits, and nothing free is waited for; and a dataplane applying only `changed | also_changed` holds exactly
    the desired state."""
    rng = random.Random(10)
    ips, names = ("10.96.0.1", "10.96.0.2", "10.96.0.3"), ("a", "b", "c", "d", "e")
    nodes = (NODE, replace(NODE, nodeport_addresses=("10.0.0.6",)), NodeInputs())
    services: dict[str, Service] = {}
    desired, applied = DesiredState(), {}
    for _ in range(400):
        changed = set()
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(names)
            if rng.random() < 0.3:
                services.pop(f"default/{name}", None)
            else:
                ports = (replace(HTTP, node_port=rng.choice((30080, 30081))),)
                services[f"default/{name}"] = svc(rng.choice(("ClusterIP", "NodePort")), name, rng.choice(ips), ports,
                                                  external_ips=(rng.choice(ips),))
            changed.add(f"default/{name}")
        node = rng.choice(nodes) if rng.random() < 0.1 else None
        desired = update_desired_state(desired, services, lambda key: (), changed, node)
        for key in changed | desired.also_changed:
            applied.pop(key, None)
            if key in desired.services:
                applied[key] = desired.services[key]
        assert applied == desired.services
        served = {st.frontend: key for key, states in desired.services.items() for st in states}
        assert desired.holders == served and sum(map(len, desired.services.values())) == len(served)
        waiting = {(st.frontend, key) for key, states in desired.waiting.items() for st in states}
        assert waiting == {(fe, key) for fe, keys in desired.claimants.items() for key in keys}
        assert all(fe in served and served[fe] != key for fe, key in waiting)
        for key, svc_ in services.items():
            wanted = {st.frontend for st in compute_service_state(svc_, (), desired.node)}
            mine = {st.frontend for st in desired.services.get(key, ())}
            assert wanted == mine | {fe for fe, k in waiting if k == key}
