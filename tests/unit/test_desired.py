from dataclasses import replace

import pytest

from pyproxy.model.desired import compute_desired_state, compute_service_state, update_desired_state
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import Endpoint, EndpointPort, EndpointSlice, Protocol, Service, ServicePort, TrafficPolicy
from pyproxy.model.state import Backend, DesiredState, Frontend, FrontendKind
from pyproxy.model.tracker import ClusterState

TCP, UDP = Protocol.TCP, Protocol.UDP


def port(name: str, number: int, target: int | str, protocol: Protocol = TCP) -> ServicePort:
    return ServicePort(name, number, protocol, target)


def service(
    *ports: ServicePort, name: str = "web", ips: tuple[str, ...] = ("10.96.0.10",), type: str = "ClusterIP"
) -> Service:
    return Service("default", name, type, ips, ports)


def endpoint(ip: str, ready: bool = True) -> Endpoint:
    return Endpoint((ip,), ready=ready, serving=ready)


def slice_(
    name: str, endpoints: tuple[Endpoint, ...], ports: tuple[EndpointPort, ...], address_type: str = "IPv4"
) -> EndpointSlice:
    return EndpointSlice("default", name, "web", address_type, endpoints, ports)


HTTP = port("", 80, 8080)
HTTP_SLICE_PORT = (EndpointPort("", 8080, TCP),)


def test_one_frontend_per_cluster_ip_and_port_with_sorted_ready_backends() -> None:
    svc = service(port("http", 80, 8080), port("dns", 53, 53, UDP), ips=("10.96.0.10", "10.96.0.11"))
    eps = slice_(
        "web-1",
        (endpoint("10.0.0.2"), endpoint("10.0.0.1")),
        (EndpointPort("http", 8080, TCP), EndpointPort("dns", 5353, UDP)),
    )
    states = compute_service_state(svc, [eps])
    assert [str(s.frontend) for s in states] == [
        "10.96.0.10:53/UDP",
        "10.96.0.10:80/TCP",
        "10.96.0.11:53/UDP",
        "10.96.0.11:80/TCP",
    ]
    http = next(s for s in states if s.frontend == Frontend("10.96.0.10", 80, TCP))
    assert http.backends == (Backend("10.0.0.1", 8080), Backend("10.0.0.2", 8080))
    assert http.service == "default/web"
    assert http.display_name == "default/web:http"
    assert http.session_affinity_seconds == 0


def test_a_multi_port_service_maps_each_port_to_the_slice_port_of_the_same_name() -> None:
    svc = service(port("http", 80, 8080), port("metrics", 9090, 9100))
    eps = slice_(
        "web-1",
        (endpoint("10.0.0.1"),),
        (EndpointPort("metrics", 9100, TCP), EndpointPort("http", 8080, TCP)),
    )
    by_port = {s.port_name: s.backends for s in compute_service_state(svc, [eps])}
    assert by_port == {"http": (Backend("10.0.0.1", 8080),), "metrics": (Backend("10.0.0.1", 9100),)}


def test_named_target_port_resolves_through_slice_port_names() -> None:
    # targetPort "web" is a container port name; the slice controller resolved it to 8443 and named
    # the slice port after the service port.
    svc = service(port("https", 443, "web"))
    eps = slice_("web-1", (endpoint("10.0.0.1"),), (EndpointPort("https", 8443, TCP),))
    (state,) = compute_service_state(svc, [eps])
    assert state.backends == (Backend("10.0.0.1", 8443),)


def test_a_slice_port_of_another_protocol_does_not_match() -> None:
    svc = service(port("dns", 53, 53, UDP))
    eps = slice_("web-1", (endpoint("10.0.0.1"),), (EndpointPort("dns", 53, TCP),))
    (state,) = compute_service_state(svc, [eps])
    assert state.backends == ()


def test_two_slices_of_one_service_merge_without_duplicates() -> None:
    a = slice_("web-a", (endpoint("10.0.0.3"), endpoint("10.0.0.1")), HTTP_SLICE_PORT)
    b = slice_("web-b", (endpoint("10.0.0.2"), endpoint("10.0.0.1")), HTTP_SLICE_PORT)
    (state,) = compute_service_state(service(HTTP), [a, b])
    assert state.backends == tuple(Backend(f"10.0.0.{i}", 8080) for i in (1, 2, 3))


def test_not_ready_endpoints_are_known_but_receive_no_new_connections() -> None:
    eps = slice_("web-1", (endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False)), HTTP_SLICE_PORT)
    (state,) = compute_service_state(service(HTTP), [eps])
    assert state.backends == (Backend("10.0.0.1", 8080),)
    assert state.known_backends == (Backend("10.0.0.1", 8080), Backend("10.0.0.2", 8080))


def test_ipv6_slices_are_ignored() -> None:
    v6 = slice_("web-v6", (Endpoint(("fd00::1",)),), HTTP_SLICE_PORT, address_type="IPv6")
    (state,) = compute_service_state(service(HTTP), [v6])
    assert state.known_backends == ()


def test_a_service_without_slices_has_frontends_that_reject() -> None:
    (state,) = compute_service_state(service(HTTP), [])
    assert state.frontend == Frontend("10.96.0.10", 80, TCP)
    assert state.backends == ()


def test_client_ip_affinity_carries_its_timeout() -> None:
    svc = replace(service(HTTP), session_affinity="ClientIP", session_affinity_timeout=600)
    (state,) = compute_service_state(svc, [])
    assert state.session_affinity_seconds == 600


def test_services_with_nothing_to_serve_are_absent() -> None:
    eps = slice_("web-1", (endpoint("10.0.0.1"),), HTTP_SLICE_PORT)
    services = {
        "default/headless": service(HTTP, name="headless", ips=()),
        "default/external": service(HTTP, name="external", ips=(), type="ExternalName"),
        "default/web": service(HTTP),
    }
    desired = compute_desired_state(services, lambda key: [eps])
    assert set(desired.services) == {"default/web"}
    assert compute_service_state(None, [eps]) == ()


def test_node_port_and_load_balancer_services_get_cluster_ip_frontends() -> None:
    for svc_type in ("NodePort", "LoadBalancer"):
        (state,) = compute_service_state(service(HTTP, type=svc_type), [])
        assert state.frontend == Frontend("10.96.0.10", 80, TCP)


def test_update_recomputes_only_changed_services_and_leaves_prev_intact() -> None:
    state = ClusterState()
    state.services.update("default/web", service(HTTP))
    state.services.update("default/db", service(HTTP, name="db", ips=("10.96.0.20",)))
    state.slices.update("default/web-1", slice_("web-1", (endpoint("10.0.0.1"),), HTTP_SLICE_PORT))
    state.drain_changed_services()
    prev = compute_desired_state(state.services.current, state.slices_for)
    prev_web = prev.services["default/web"]

    state.services.update("default/web", None)
    state.services.update("default/api", service(HTTP, name="api", ips=("10.96.0.30",)))
    changed = state.drain_changed_services()
    new = update_desired_state(prev, state.services.current, state.slices_for, changed)

    assert set(new.services) == {"default/db", "default/api"}
    assert new.services["default/db"] is prev.services["default/db"]  # reused, not recomputed
    assert prev.services["default/web"] is prev_web
    assert set(prev.services) == {"default/web", "default/db"}
    assert new == compute_desired_state(state.services.current, state.slices_for)


def test_empty_inputs_give_an_empty_desired_state() -> None:
    assert compute_desired_state({}, lambda key: []) == DesiredState({})


# Which Service serves a frontend two claim: decided in the model (these cases were the bpf, nftables and ipvs
# renderers' own); renderers take frontends as unique. More cases in test_frontends.py.

WEB_FRONTEND = Frontend("10.96.0.10", 80, TCP)


def test_of_two_services_claiming_one_frontend_the_first_by_name_serves_it() -> None:
    services = {"default/zzz": service(HTTP, name="zzz"), "default/web": service(HTTP)}
    desired = compute_desired_state(services, lambda key: [])
    assert set(desired.services) == {"default/web"}
    assert desired.holders == {WEB_FRONTEND: "default/web"}
    assert [st.frontend for st in desired.waiting["default/zzz"]] == [WEB_FRONTEND]
    assert desired.claimants == {WEB_FRONTEND: ("default/zzz",)}
    assert [str(c) for c in desired.rejected] == [
        "default/zzz ClusterIP 10.96.0.10:80/TCP: frontend already served by default/web"
    ]
    assert desired.notices() == [str(desired.rejected[0])]


def test_a_partial_update_never_takes_a_frontend_another_service_serves() -> None:
    """Also when the newcomer sorts first, and when both are recomputed in one update: the holder keeps it."""
    services = {"default/web": service(HTTP)}
    first = compute_desired_state(services, lambda key: [])
    services["default/aaa"] = service(HTTP, name="aaa")
    second = update_desired_state(first, services, lambda key: [], {"default/aaa"})
    assert set(second.services) == {"default/web"} and second.holders[WEB_FRONTEND] == "default/web"
    assert [c.claim.service for c in second.rejected] == ["default/aaa"]
    assert second.also_changed == frozenset()
    third = update_desired_state(second, services, lambda key: [], {"default/web", "default/aaa"})
    assert third.holders[WEB_FRONTEND] == "default/web"
    assert third.rejected == (), "a rejection already reported is not reported again"
    assert third == second


# Topology-aware routing (upstream's CategorizeEndpoints / canUseTopology): node-a is in zone z1.
ZONED = NodeInputs(name="node-a", nodeport_addresses=("10.0.0.5",), zone="z1")
NP_HTTP = ServicePort("http", 80, TCP, 8080, node_port=30080)
NP_SLICE_PORT = (EndpointPort("http", 8080, TCP),)


def hinted(ip: str, *zones: str, ready: bool = True, node: str | None = None, terminating: bool = False) -> Endpoint:
    return Endpoint((ip,), ready=ready, serving=ready or terminating, terminating=terminating, node_name=node,
                    zone_hints=zones)


def zoned_service(**fields: object) -> Service:
    svc = Service("default", "web", "NodePort", ("10.96.0.10",), (NP_HTTP,), traffic_distribution="PreferClose")
    return replace(svc, **fields)


def topology_states(svc: Service, *endpoints: Endpoint, node: NodeInputs = ZONED) -> dict[str, tuple[str, ...]]:
    """frontend kind -> its backends' IPs; the NodePort's external_backends as "outside"."""
    states = compute_service_state(svc, [slice_("web-1", endpoints, NP_SLICE_PORT)], node)
    out = {}
    for st in states:
        out[str(st.kind)] = tuple(b.ip for b in st.backends)
        if st.kind.external:
            out["outside"] = tuple(b.ip for b in st.external_backends)
        assert len(st.known_backends) == len(endpoints)  # topology never hides an endpoint's flows
    return out


THREE_ZONES = (hinted("10.0.0.1", "z1"), hinted("10.0.0.2", "z2"), hinted("10.0.0.3", "z3", "z1"))
ALL = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
IN_Z1 = ("10.0.0.1", "10.0.0.3")


def test_prefer_close_narrows_every_cluster_endpoint_set_to_the_nodes_zone() -> None:
    assert topology_states(zoned_service(), *THREE_ZONES) == {"ClusterIP": IN_Z1, "NodePort": IN_Z1, "outside": IN_Z1}


@pytest.mark.parametrize(
    ("fields", "filtered"),
    [
        ({"traffic_distribution": "PreferSameZone"}, True),  # PreferClose's newer name
        ({"traffic_distribution": "", "topology_mode": "Auto"}, True),
        ({"traffic_distribution": "", "topology_mode": "auto"}, True),
        # Upstream logs any other annotation value as unexpected and ignores it.
        ({"traffic_distribution": "", "topology_mode": "Disabled"}, False),
        ({"traffic_distribution": "", "topology_mode": "true"}, False),
        ({"traffic_distribution": ""}, False),
        ({"traffic_distribution": "PreferSameNode"}, False),  # node hints: not implemented
    ],
)
def test_only_prefer_close_or_the_auto_annotation_ask_for_topology(fields: dict[str, str], filtered: bool) -> None:
    expected = IN_Z1 if filtered else ALL
    assert topology_states(zoned_service(**fields), *THREE_ZONES)["ClusterIP"] == expected


def test_one_ready_endpoint_without_a_zone_hint_turns_topology_off() -> None:
    assert topology_states(zoned_service(), *THREE_ZONES, hinted("10.0.0.4"))["ClusterIP"] == (*ALL, "10.0.0.4")
    # A not-ready one without a hint does not count.
    assert topology_states(zoned_service(), *THREE_ZONES, hinted("10.0.0.4", ready=False))["ClusterIP"] == IN_Z1


def test_no_endpoint_hinted_for_the_nodes_zone_turns_topology_off() -> None:
    assert topology_states(zoned_service(), hinted("10.0.0.1", "z2"), hinted("10.0.0.2", "z3"))["ClusterIP"] == (
        "10.0.0.1", "10.0.0.2")
    # Hinted for z1 but not ready: still none for z1 among the ready ones.
    states = topology_states(zoned_service(), hinted("10.0.0.1", "z1", ready=False), hinted("10.0.0.2", "z2"))
    assert states["ClusterIP"] == ("10.0.0.2",)


def test_a_node_without_a_zone_label_uses_every_endpoint() -> None:
    assert topology_states(zoned_service(), *THREE_ZONES, node=replace(ZONED, zone=None))["ClusterIP"] == ALL


def test_the_terminating_fallback_ignores_hints() -> None:
    draining = (hinted("10.0.0.1", "z1", ready=False, terminating=True),
                hinted("10.0.0.2", "z2", ready=False, terminating=True))
    assert topology_states(zoned_service(), *draining)["ClusterIP"] == ("10.0.0.1", "10.0.0.2")


def test_local_traffic_policies_ignore_hints() -> None:
    # 10.0.0.2 is this node's but hinted for z2 only.
    eps = (hinted("10.0.0.1", "z1"), hinted("10.0.0.2", "z2", node="node-a"), hinted("10.0.0.3", "z1"))
    itp = topology_states(zoned_service(internal_traffic_policy=TrafficPolicy.LOCAL), *eps)
    assert itp == {"ClusterIP": ("10.0.0.2",), "NodePort": IN_Z1, "outside": IN_Z1}
    # externalTrafficPolicy Local: outside sources get this node's; pods and the node (upstream's short
    # circuit to the cluster endpoints) the zone's.
    etp = topology_states(zoned_service(external_traffic_policy=TrafficPolicy.LOCAL), *eps)
    assert etp == {"ClusterIP": IN_Z1, "NodePort": IN_Z1, "outside": ("10.0.0.2",)}


def test_topology_is_decided_per_service_port() -> None:
    svc = zoned_service(ports=(NP_HTTP, ServicePort("dns", 53, UDP, 5353)))
    eps = slice_("web-1", THREE_ZONES, (*NP_SLICE_PORT, EndpointPort("dns", 5353, UDP)))
    dns_only = slice_("web-2", (hinted("10.0.0.9"),), (EndpointPort("dns", 5353, UDP),))
    by_port = {st.port_name: tuple(b.ip for b in st.backends)
               for st in compute_service_state(svc, [eps, dns_only], ZONED) if st.kind is FrontendKind.CLUSTER_IP}
    assert by_port == {"http": IN_Z1, "dns": (*ALL, "10.0.0.9")}


def test_a_change_of_the_nodes_zone_recomputes_every_service() -> None:
    svc = zoned_service()
    slices = {svc.key: [slice_("web-1", THREE_ZONES, NP_SLICE_PORT)]}
    state = compute_desired_state({svc.key: svc}, lambda key: slices.get(key, []), ZONED)
    moved = update_desired_state(state, {svc.key: svc}, lambda key: slices.get(key, []), (),
                                 replace(ZONED, zone="z2"))
    (states,) = moved.services.values()
    assert {tuple(b.ip for b in st.backends) for st in states} == {("10.0.0.2",)}


def test_weight_zero_quiesces_an_endpoint_in_every_mode() -> None:
    """pyproxy.io/weights 0: no new flow (out of `backends`, so no mode can choose it), established ones go on (it
    stays known), and the ipvs mode keeps it as a real server of weight 0 (`quiesced`)."""
    svc = replace(service(HTTP), weights=(("10.0.0.2", 0), ("10.0.0.3", 4)), scheduler="wrr")
    eps = slice_("web-1", (endpoint("10.0.0.1"), endpoint("10.0.0.2"), endpoint("10.0.0.3")), HTTP_SLICE_PORT)
    (st,) = compute_service_state(svc, [eps])
    assert st.backends == (Backend("10.0.0.1", 8080), Backend("10.0.0.3", 8080))
    assert Backend("10.0.0.2", 8080) in st.known_backends and st.quiesced == (Backend("10.0.0.2", 8080),)
    assert [st.weight(b) for b in st.backends] == [1, 4] and st.scheduler == "wrr"
    # Every endpoint quiesced: nothing takes new flows, which are refused as for a Service without endpoints.
    (gone,) = compute_service_state(replace(svc, weights=(("10.0.0.1", 0), ("10.0.0.2", 0), ("10.0.0.3", 0))), [eps])
    assert gone.backends == () and len(gone.quiesced) == 3 and not gone.drop
