"""IPv6 and dual-stack Services in the model (pyproxy/model/desired.py), as upstream's per-family proxiers serve
them: a frontend of one family uses only the endpoints of that family's EndpointSlices; a Service has the
external frontends of a family only when it has a ClusterIP of it; source ranges, the node's addresses and its
primary address are taken per family."""

from __future__ import annotations

from pyproxy.k8s.convert import service_from_dict
from pyproxy.model import objects
from pyproxy.model.desired import compute_service_state
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import IPV4, IPV6, Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from pyproxy.model.state import Backend, FrontendKind, ServicePortState, health_check

TCP, LOCAL = objects.Protocol.TCP, objects.TrafficPolicy.LOCAL
HTTP = ServicePort("http", 80, TCP, 8080, node_port=30080)
NODE = NodeInputs(name="node-a", nodeport_addresses=("10.0.0.5", "fd00:1::5"), primary_ip="10.0.0.5",
                  primary_ipv6="fd00:1::5")


def slice_of(family: str, name: str, *addresses: str, node: str | None = None) -> EndpointSlice:
    return EndpointSlice("default", name, "web", family, tuple(Endpoint((a,), node_name=node) for a in addresses),
                         (EndpointPort("http", 8080, TCP),))


V4 = slice_of("IPv4", "web-v4", "10.244.1.5", "10.244.2.7")
V6 = slice_of("IPv6", "web-v6", "fd00:244::5", "fd00:244::7")


def web(cluster_ips: tuple[str, ...], type: str = "ClusterIP", **fields: object) -> Service:
    return Service("default", "web", type, cluster_ips, (HTTP,), **fields)  # type: ignore[arg-type]


def by_frontend(states: tuple[ServicePortState, ...]) -> dict[str, ServicePortState]:
    return {str(st.frontend): st for st in states}


def test_a_dual_stack_service_has_frontends_of_both_families_each_with_its_familys_endpoints() -> None:
    states = by_frontend(compute_service_state(web(("10.96.0.10", "fd00::10")), [V4, V6], NODE))
    assert set(states) == {"10.96.0.10:80/TCP", "fd00::10:80/TCP"}
    v4, v6 = states["10.96.0.10:80/TCP"], states["fd00::10:80/TCP"]
    assert (v4.family, v6.family) == (IPV4, IPV6)
    assert v4.backends == (Backend("10.244.1.5", 8080), Backend("10.244.2.7", 8080))
    assert v6.backends == (Backend("fd00:244::5", 8080), Backend("fd00:244::7", 8080))
    assert v6.known_backends == v6.backends
    assert {b.family for b in v6.backends} == {IPV6}


def test_a_single_stack_ipv6_service_serves_ipv6_only_and_ignores_ipv4_slices() -> None:
    svc = service_from_dict({"metadata": {"name": "web", "namespace": "default"}, "spec": {
        "type": "NodePort", "ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv6"], "clusterIP": "fd00::10",
        "clusterIPs": ["fd00::10"], "externalIPs": ["192.0.2.10", "2001:db8::10"],
        "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}})
    states = by_frontend(compute_service_state(svc, [V4, V6], NODE))
    # No IPv4 frontend at all: the IPv4 external IP and node address wait for an IPv4 ClusterIP.
    assert {k: st.kind for k, st in states.items()} == {
        "fd00::10:80/TCP": FrontendKind.CLUSTER_IP,
        "2001:db8::10:80/TCP": FrontendKind.EXTERNAL_IP,
        "fd00:1::5:30080/TCP": FrontendKind.NODE_PORT,
    }
    assert all(st.backends == (Backend("fd00:244::5", 8080), Backend("fd00:244::7", 8080)) for st in states.values())


def test_prefer_dual_stack_with_one_family_allocated_serves_that_family() -> None:
    svc = web(("10.96.0.10",), ip_families=("IPv4",), ip_family_policy="PreferDualStack")
    states = compute_service_state(svc, [V4, V6], NODE)
    assert [str(st.frontend) for st in states] == ["10.96.0.10:80/TCP"]
    assert states[0].backends == (Backend("10.244.1.5", 8080), Backend("10.244.2.7", 8080))


def test_ipv6_slices_are_ignored_for_an_ipv4_only_service_and_leave_it_without_endpoints() -> None:
    states = compute_service_state(web(("10.96.0.10",), "NodePort"), [V6], NODE)
    assert [(str(st.frontend), st.backends, st.known_backends) for st in states] == [
        ("10.0.0.5:30080/TCP", (), ()),  # the IPv4 node address only: no IPv6 node port without an IPv6 ClusterIP
        ("10.96.0.10:80/TCP", (), ()),
    ]


def test_source_ranges_apply_per_family() -> None:
    svc = web(("10.96.0.10", "fd00::10"), "LoadBalancer", load_balancer_ips=("203.0.113.10", "2001:db8::11"),
              load_balancer_source_ranges=("10.0.0.0/8", "2001:db8:1::/48"))
    lbs = {str(st.frontend): st.source_ranges for st in compute_service_state(svc, [V4, V6], NODE)
           if st.kind is FrontendKind.LOAD_BALANCER}
    # A range holding the node's primary address of its family also admits that family's LB IPs (allowFromNode).
    assert lbs == {"203.0.113.10:80/TCP": ("10.0.0.0/8", "203.0.113.10/32"),
                   "2001:db8::11:80/TCP": ("2001:db8:1::/48",)}
    node6 = NodeInputs(name="node-a", primary_ipv6="2001:db8:1::5")
    lbs = {str(st.frontend): st.source_ranges for st in compute_service_state(svc, [], node6)
           if st.kind is FrontendKind.LOAD_BALANCER}
    assert lbs["2001:db8::11:80/TCP"] == ("2001:db8:1::/48", "2001:db8::11/128")
    # As upstream: ranges of the other family only leave a family's LB IPs open; ::/0 is any source.
    only_v4 = web(("10.96.0.10", "fd00::10"), "LoadBalancer", load_balancer_ips=("2001:db8::11",),
                  load_balancer_source_ranges=("10.0.0.0/8",))
    any_v6 = web(("fd00::10",), "LoadBalancer", load_balancer_ips=("2001:db8::11",),
                 load_balancer_source_ranges=("::/0", "2001:db8:1::/48"))
    for svc in (only_v4, any_v6):
        assert [st.source_ranges for st in compute_service_state(svc, [], NODE)
                if st.kind is FrontendKind.LOAD_BALANCER] == [()]


def test_external_traffic_policy_local_and_the_health_check_count_per_family() -> None:
    v4 = slice_of("IPv4", "web-v4", "10.244.1.5", node="node-a")
    v6 = slice_of("IPv6", "web-v6", "fd00:244::5", "fd00:244::7", node="node-a")
    svc = web(("10.96.0.10", "fd00::10"), "LoadBalancer", external_traffic_policy=LOCAL,
              health_check_node_port=31000)
    states = by_frontend(compute_service_state(svc, [v4, v6], NODE))
    assert states["fd00:1::5:30080/TCP"].external_backends == (Backend("fd00:244::5", 8080),
                                                                Backend("fd00:244::7", 8080))
    assert states["10.0.0.5:30080/TCP"].external_backends == (Backend("10.244.1.5", 8080),)
    # One pod with an address of each family counts once: the family with more local endpoints decides.
    hc = health_check(states.values())
    assert hc is not None and hc.local_endpoints == 2


def test_ipv6_weights_quiesce_ipv6_endpoints() -> None:
    svc = web(("fd00::10",), weights=(("fd00:244::5", 0),))
    (st,) = compute_service_state(svc, [V6], NODE)
    assert (st.backends, st.quiesced) == ((Backend("fd00:244::7", 8080),), (Backend("fd00:244::5", 8080),))


def test_source_ranges_that_leave_the_node_out_deny_the_nodes_own_connections() -> None:
    """ServicePortState.node_denied, per family: the node's primary address of the family outside every range (bpf's
    socket hooks refuse the node's connect then, as the packet path drops its packets by their source)."""
    svc = web(("10.96.0.10", "fd00::10"), "LoadBalancer", load_balancer_ips=("203.0.113.10", "2001:db8::11"),
              load_balancer_source_ranges=("10.0.0.0/8", "2001:db8:1::/48"))
    node = NodeInputs(name="node-a", primary_ip="10.0.0.5", primary_ipv6="2001:db8:2::5")
    denied = {str(st.frontend): st.node_denied for st in compute_service_state(svc, [V4, V6], node)}
    assert denied["203.0.113.10:80/TCP"] is False and denied["2001:db8::11:80/TCP"] is True
    assert not any(st.node_denied for st in compute_service_state(svc, [V4, V6], node)
                   if st.kind is not FrontendKind.LOAD_BALANCER)
    # No primary address known: nothing to deny by.
    assert not any(st.node_denied for st in compute_service_state(svc, [V4, V6], NodeInputs(name="node-a")))
