"""The userspace mode's render(): from the desired state to addresses, listeners (with their socket filters) and
routes, pure, for IPv4 and IPv6 frontends; and the socket filters it compiles, run by sockfilter.run."""

from __future__ import annotations

import pytest

from pyproxy.dataplane.userspace import sockfilter
from pyproxy.dataplane.userspace.render import Route, State, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

TCP, UDP = Protocol.TCP, Protocol.UDP
B1, B2 = Backend("10.244.1.2", 8080), Backend("10.244.2.2", 8080)
CLUSTER = Frontend("10.96.0.10", 80, TCP)
NODEPORT = Frontend("192.168.1.5", 30080, TCP)
LB = Frontend("203.0.113.7", 80, TCP)
OUTSIDE, POD, NODE_ITSELF = "198.51.100.9", "10.244.3.4", "192.168.1.5"
ETH0, LO = 2, sockfilter.LOOPBACK_IFINDEX


def port(frontend: Frontend, backends: tuple[Backend, ...] = (B1, B2), **kw: object) -> ServicePortState:
    return ServicePortState("ns/web", "http", frontend, backends, known_backends=backends, **kw)  # type: ignore[arg-type]


def admits(program: tuple[sockfilter.Insn, ...] | None, source: str, ifindex: int = ETH0) -> bool:
    return program is None or sockfilter.run(program, source, ifindex)


def test_a_clusterip_with_endpoints_is_a_local_address_and_a_listener_for_every_source() -> None:
    plan = render(State(), {"ns/web": (port(CLUSTER),)}, full=True)
    assert plan.add_addresses == ("10.96.0.10",) and plan.del_addresses == ()
    assert plan.open == {CLUSTER: None}
    assert plan.routes == {CLUSTER: Route("ns/web:http", (B1, B2), None, 0, frozenset({B1, B2}))}


def test_a_frontend_without_endpoints_has_its_address_but_no_listener_so_the_node_refuses_it() -> None:
    plan = render(State(), {"ns/web": (port(CLUSTER, ()), port(Frontend("10.96.0.10", 53, UDP), ()))}, full=True)
    assert plan.add_addresses == ("10.96.0.10",) and plan.open == {}


def test_a_nodeport_listens_on_the_node_address_the_model_gave_it_and_adds_no_address() -> None:
    plan = render(State(), {"ns/web": (port(NODEPORT, kind=FrontendKind.NODE_PORT, external_backends=(B1, B2)),)},
                  full=True)
    assert plan.add_addresses == () and plan.open == {NODEPORT: None}
    assert plan.routes[NODEPORT].external_backends is None  # externalTrafficPolicy Cluster: one pool for all


def test_internal_traffic_policy_local_without_a_local_endpoint_listens_and_drops_everything() -> None:
    plan = render(State(), {"ns/web": (port(CLUSTER, (), drop=True),)}, full=True)
    [program] = plan.open.values()
    assert not any(admits(program, src, dev) for src, dev in ((OUTSIDE, ETH0), (POD, ETH0), (NODE_ITSELF, LO)))


def test_load_balancer_source_ranges_drop_other_sources_before_the_handshake() -> None:
    sp = port(LB, kind=FrontendKind.LOAD_BALANCER, external_backends=(B1, B2),
              source_ranges=("198.51.100.0/24", " 10.0.0.0/8"))
    [program] = render(State(), {"ns/web": (sp,)}, full=True).open.values()
    assert admits(program, OUTSIDE) and admits(program, "10.1.2.3")
    assert not admits(program, "198.51.101.9") and not admits(program, NODE_ITSELF, LO)


@pytest.mark.parametrize("cluster_cidr", [None, "10.244.0.0/16"])
def test_external_policy_local_without_a_local_endpoint_drops_the_outside_only(cluster_cidr: str | None) -> None:
    sp = port(NODEPORT, kind=FrontendKind.NODE_PORT, external_backends=())
    plan = render(State(), {"ns/web": (sp,)}, full=True, cluster_cidrs=(cluster_cidr,) if cluster_cidr else ())
    [program] = plan.open.values()
    assert plan.routes[NODEPORT].external_backends == ()
    assert admits(program, NODE_ITSELF, LO), "the node's own flows arrive on lo and get every endpoint"
    assert not admits(program, OUTSIDE)
    assert admits(program, POD) == (cluster_cidr is not None), "pods are inside only with --cluster-cidr"


def test_external_traffic_policy_local_with_a_local_endpoint_keeps_two_pools_and_no_filter() -> None:
    sp = port(NODEPORT, kind=FrontendKind.NODE_PORT, external_backends=(B1,))
    plan = render(State(), {"ns/web": (sp,)}, full=True)
    assert plan.open == {NODEPORT: None}
    assert (plan.routes[NODEPORT].backends, plan.routes[NODEPORT].external_backends) == ((B1, B2), (B1,))


def test_many_source_ranges_still_compile_to_jumps_that_reach() -> None:
    ranges = tuple(f"10.{i}.0.0/16" for i in range(200))  # past what an 8-bit conditional jump reaches
    program = sockfilter.compile_admission(source_ranges=ranges, internal_only=True, cluster_cidr="192.168.0.0/16")
    assert program is not None and len(program) > 255
    assert admits(program, "10.199.3.4", LO) and not admits(program, "10.199.3.4")
    assert admits(program, "10.0.0.1", LO) and not admits(program, "10.200.0.1", LO)
    assert admits(program, "10.5.0.1") is False and admits(program, "192.168.0.1") is False
    assert sockfilter.run(program, "192.168.3.4", ETH0) is False  # not in the ranges: dropped before the CIDR


def test_a_partial_sync_touches_only_the_changed_services() -> None:
    other = ServicePortState("ns/db", "sql", Frontend("10.96.0.20", 5432, TCP), (B2,), known_backends=(B2,))
    state = render(State(), {"ns/web": (port(CLUSTER),), "ns/db": (other,)}, full=True).state
    # An endpoint leaves ns/web: its route changes, its listener stays open, ns/db is not looked at.
    plan = render(state, {"ns/web": (port(CLUSTER, (B1,)),)}, full=False)
    assert (plan.open, plan.close, plan.refilter, plan.add_addresses, plan.del_addresses) == ({}, (), {}, (), ())
    assert list(plan.routes) == [CLUSTER] and plan.routes[CLUSTER].backends == (B1,)
    # Its last endpoint leaves: the listener closes, the address stays (the node refuses the flows).
    plan = render(plan.state, {"ns/web": (port(CLUSTER, ()),)}, full=False)
    assert plan.close == (CLUSTER,) and plan.del_addresses == ()
    # The Service goes: its route and address go; ns/db is still served.
    plan = render(plan.state, {"ns/web": ()}, full=False)
    assert plan.routes == {CLUSTER: None} and plan.del_addresses == ("10.96.0.10",)
    assert set(plan.state.entries) == {other.frontend} and plan.state.addresses == {"10.96.0.20"}


def test_a_policy_change_refilters_the_open_listener() -> None:
    state = render(State(), {"ns/web": (port(LB, kind=FrontendKind.LOAD_BALANCER, external_backends=(B1, B2)),)},
                   full=True).state
    fenced = port(LB, kind=FrontendKind.LOAD_BALANCER, external_backends=(B1, B2), source_ranges=("10.0.0.0/8",))
    plan = render(state, {"ns/web": (fenced,)}, full=False)
    assert plan.open == {} and plan.close == () and list(plan.refilter) == [LB]
    assert render(plan.state, {"ns/web": (fenced,)}, full=True).empty


def test_a_full_sync_removes_what_no_service_wants_and_keeps_the_rest_as_is() -> None:
    state = render(State(), {"ns/web": (port(CLUSTER),)}, full=True).state
    left = State(state.entries, state.addresses | {"10.96.9.9"})  # an address a previous run left
    plan = render(left, {"ns/web": (port(CLUSTER),)}, full=True)
    assert plan.del_addresses == ("10.96.9.9",) and plan.open == {} and plan.routes == {}


# IPv6 (issue 15): the same plan, /128 addresses, and filters that read the IPv6 source's four words.
B1_6, B2_6 = Backend("fd00:10:244:1::2", 8080), Backend("fd00:10:244:2::2", 8080)
CLUSTER6 = Frontend("fd00:10:96::10", 80, TCP)
LB6 = Frontend("2001:db8::7", 80, TCP)
NODEPORT6 = Frontend("fd00:192:168:1::5", 30080, TCP)
OUTSIDE6, POD6, NODE6 = "2001:db8:9::9", "fd00:10:244:3::4", "fd00:192:168:1::5"


def test_an_ipv6_clusterip_is_a_local_address_and_a_listener_beside_the_ipv4_one() -> None:
    plan = render(State(), {"ns/web": (port(CLUSTER), port(CLUSTER6, (B1_6, B2_6)))}, full=True)
    assert plan.add_addresses == ("10.96.0.10", "fd00:10:96::10")
    assert plan.open == {CLUSTER: None, CLUSTER6: None}
    # Each family's frontend dials its own family's endpoints only (as the model gave them).
    assert plan.routes[CLUSTER].backends == (B1, B2) and plan.routes[CLUSTER6].backends == (B1_6, B2_6)
    plan = render(plan.state, {"ns/web": (port(CLUSTER),)}, full=False)  # the IPv6 family dropped
    assert plan.close == (CLUSTER6,) and plan.del_addresses == ("fd00:10:96::10",)


def test_ipv6_source_ranges_compare_every_word_of_the_source() -> None:
    sp = port(LB6, (B1_6,), kind=FrontendKind.LOAD_BALANCER, external_backends=(B1_6,),
              source_ranges=("2001:db8:9::/48", "fd00:1:2:3:4:5:6:7/128", "fd00:ff00::/24"))
    [program] = render(State(), {"ns/web": (sp,)}, full=True).open.values()
    assert admits(program, OUTSIDE6) and admits(program, "2001:db8:9:ffff::1")
    assert not admits(program, "2001:db8:a::9") and not admits(program, "2001:db9:9::9")
    assert admits(program, "fd00:1:2:3:4:5:6:7") and not admits(program, "fd00:1:2:3:4:5:6:8")
    assert not admits(program, "fd00:1:2:3:4:5:7:7"), "a /128 compares the last words too"
    assert admits(program, "fd00:ff80::1") and not admits(program, "fd00:fe00::1"), "a mask inside a word"
    assert not admits(program, NODE6, LO)


@pytest.mark.parametrize("cluster_cidrs", [(), ("10.244.0.0/16",), ("10.244.0.0/16", "fd00:10:244::/48")])
def test_ipv6_external_policy_local_without_a_local_endpoint_uses_the_ipv6_cluster_cidr(
        cluster_cidrs: tuple[str, ...]) -> None:
    sp = port(NODEPORT6, (B1_6,), kind=FrontendKind.NODE_PORT, external_backends=())
    [program] = render(State(), {"ns/web": (sp,)}, full=True, cluster_cidrs=cluster_cidrs).open.values()
    assert admits(program, NODE6, LO) and admits(program, "::1", LO) and not admits(program, OUTSIDE6)
    assert admits(program, POD6) == (len(cluster_cidrs) == 2), "pods are inside only with an IPv6 --cluster-cidr"


def test_an_ipv6_internal_policy_local_without_a_local_endpoint_drops_everything() -> None:
    [program] = render(State(), {"ns/web": (port(CLUSTER6, (), drop=True),)}, full=True).open.values()
    assert not any(admits(program, src, dev) for src, dev in ((OUTSIDE6, ETH0), (POD6, ETH0), (NODE6, LO)))


def test_a_filter_is_of_its_frontends_family() -> None:
    program = sockfilter.compile_admission(family=6, source_ranges=("2001:db8::/32",))
    assert program is not None
    with pytest.raises(ValueError, match="not one compile_admission emits for an IPv4 source"):
        sockfilter.run(program, "10.0.0.1", ETH0)  # an IPv4 socket never runs an IPv6 filter
    with pytest.raises(ValueError, match="10.0.0.0/8 is not an IPv6 CIDR"):
        sockfilter.compile_admission(family=6, source_ranges=("10.0.0.0/8",))


def test_many_ipv6_source_ranges_still_compile_to_jumps_that_reach() -> None:
    ranges = tuple(f"fd00:{i:x}::/32" for i in range(100))  # past what an 8-bit conditional jump reaches
    program = sockfilter.compile_admission(family=6, source_ranges=ranges, internal_only=True,
                                           cluster_cidr="fd00:5:1::/48")
    assert program is not None and len(program) > 255
    assert admits(program, "fd00:63::1", LO) and not admits(program, "fd00:63::1")
    assert admits(program, "fd00:0::1", LO) and not admits(program, "fd00:64::1", LO)
    assert admits(program, "fd00:5:1::9") and not admits(program, "fd00:5:2::9"), "a pod, and one outside the CIDR"
    assert not admits(program, "fd01:5:1::9"), "not in the ranges: dropped before the CIDR"
