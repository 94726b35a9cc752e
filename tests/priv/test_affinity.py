"""ClientIP affinity keeps a client only on an endpoint its frontend's new flows may use (issue 25), both families,
packet by packet with BPF_PROG_TEST_RUN, the frontend programmed by render() as pyproxy does.

Upstream (iptables, ipvs) honours a client's affinity only to the endpoints new connections may use: the ready ones,
or the serving and terminating ones while none is ready (the model's `ServicePortState.backends`, the frontend's
slots). An endpoint that stays known but not usable (unready, or terminating beside ready ones: its established
flows go on) or that left the Service while another Service still has it, is not honoured: the client's next flow
chooses anew and sticks to its new backend, also once the old one is ready again.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from harness import ROOT, TC_INGRESS, XDP, Dataplane, Prog, dnat
from packets import TCP, Flow
from packets6 import decode6, frame6

from pyproxy.dataplane.bpf import abi
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

pytestmark = ROOT

SERVICE, OTHER = "default/web", "default/other"
PORT = 80


@dataclass(frozen=True)
class Family:
    vip: str
    other_vip: str
    client: str
    backends: tuple[Backend, ...]

    @property
    def six(self) -> bool:
        return ":" in self.vip


V4 = Family("10.96.0.10", "10.96.0.11", "192.168.1.10", tuple(Backend(f"10.0.1.{i}", 8080) for i in (1, 2, 3)))
V6 = Family("fd00:96::a", "fd00:96::b", "fd00:c::10", tuple(Backend(f"fd00:1::{i}", 8080) for i in (1, 2, 3)))
FAMILIES = [pytest.param(V4, id="ipv4"), pytest.param(V6, id="ipv6")]
PROGS = [pytest.param(TC_INGRESS, id="tc"), pytest.param(XDP, id="xdp")]


def state(fam: Family, usable: tuple[Backend, ...], known: tuple[Backend, ...] = (), *, service: str = SERVICE,
          vip: str = "", affinity: int = 10800) -> ServicePortState:
    """A frontend whose new flows may use `usable` (ready, or serving-terminating while none is ready), and that also
    knows `known` (endpoints of its slices new flows may not use)."""
    return ServicePortState(service=service, port_name="http", frontend=Frontend(vip or fam.vip, PORT, Protocol.TCP),
                            backends=tuple(sorted(usable)), known_backends=tuple(sorted({*usable, *known})),
                            session_affinity_seconds=affinity)


def new_flow(dp: Dataplane, prog: Prog, fam: Family, sport: int) -> Backend:
    """A SYN from the client on a port of its own: the backend it went to."""
    if not fam.six:
        return dnat(dp, prog, Flow(fam.client, fam.vip, sport, PORT, TCP))
    flow = Flow(fam.client, fam.vip, sport, PORT, TCP)
    verdict, out = dp.run(prog, frame6(flow))
    assert verdict == prog.ok
    d = decode6(out)
    be = Backend(d.dst, d.flow.dport)
    assert be in fam.backends, f"not translated: {d.flow}"
    assert d.csum_ok and out == frame6(flow.to(be.ip, be.port))
    return be


def new_flows(dp: Dataplane, prog: Prog, fam: Family, first: int, count: int = 12) -> set[Backend]:
    return {new_flow(dp, prog, fam, sport) for sport in range(first, first + count)}


def remembered(dp: Dataplane, fam: Family) -> Backend:
    """The backend the client's AFFINITY entry names."""
    if not fam.six:
        v = dp.maps.ct[abi.CtKey(abi.be32(fam.client), abi.be32(fam.vip), 0, abi.be16(PORT), TCP, abi.CT_AFFINITY)]
        return Backend(abi.ip_of(v.nat_addr), abi.port_of(v.nat_port))
    v6 = dp.maps.ct6[abi.Ct6Key(abi.in6(fam.client), abi.in6(fam.vip), 0, abi.be16(PORT), TCP, abi.CT_AFFINITY)]
    return Backend(abi.ip6_of(v6.nat_addr), abi.port_of(v6.nat_port))


def sticky_client(dp: Dataplane, prog: Prog, fam: Family) -> Backend:
    """The frontend with its three endpoints ready and the client's affinity to one of them (A): returns A."""
    dp.apply(state(fam, fam.backends))
    (a,) = new_flows(dp, prog, fam, 40000)
    assert remembered(dp, fam) == a
    return a


@pytest.mark.parametrize("prog", PROGS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_an_endpoint_no_longer_ready_loses_the_clients_affinity_for_good(dp: Dataplane, prog: Prog,
                                                                         fam: Family) -> None:
    """A turns unready (or terminating while others are ready): known, not usable. The client's next flows go to
    one other backend and stay there, and stay there once A is ready again."""
    a = sticky_client(dp, prog, fam)
    rest = tuple(b for b in fam.backends if b != a)
    dp.apply(state(fam, rest, (a,)))
    moved = new_flows(dp, prog, fam, 41000)
    assert len(moved) == 1 and a not in moved, f"with A={a} unready the client went to {sorted(moved)}"
    (b,) = moved
    assert remembered(dp, fam) == b
    dp.apply(state(fam, fam.backends))
    assert new_flows(dp, prog, fam, 42000) == {b}, "the client's affinity moved back to A"


@pytest.mark.parametrize("fam", FAMILIES)
def test_affinity_holds_to_a_serving_terminating_endpoint_while_none_is_ready(dp: Dataplane, fam: Family) -> None:
    """No endpoint ready: new flows use the serving-terminating ones, and so does affinity. With A and another
    terminating, every flow of the client stays on A; with A the only one, on A still."""
    a = sticky_client(dp, TC_INGRESS, fam)
    rest = tuple(b for b in fam.backends if b != a)
    dp.apply(state(fam, (a, rest[0]), rest))
    assert new_flows(dp, TC_INGRESS, fam, 41000) == {a}
    dp.apply(state(fam, (a,), rest))
    assert new_flows(dp, TC_INGRESS, fam, 42000) == {a}
    assert remembered(dp, fam) == a


@pytest.mark.parametrize("fam", FAMILIES)
def test_an_endpoint_that_left_the_service_is_not_honoured_while_another_service_has_it(dp: Dataplane,
                                                                                         fam: Family) -> None:
    """A leaves this Service's slices but stays an endpoint of another Service (so in the backends map): this
    Service's affinity to it ends."""
    a = sticky_client(dp, TC_INGRESS, fam)
    rest = tuple(b for b in fam.backends if b != a)
    dp.apply(state(fam, (a,), service=OTHER, vip=fam.other_vip), service=OTHER)
    dp.apply(state(fam, rest))
    backends = dp.maps.backends6 if fam.six else dp.maps.backends
    key = abi.Backend6(abi.in6(a.ip), abi.be16(a.port)) if fam.six else abi.Backend(abi.be32(a.ip), abi.be16(a.port))
    assert key in backends  # still an endpoint: of the other Service
    moved = new_flows(dp, TC_INGRESS, fam, 41000)
    assert len(moved) == 1 and a not in moved, f"with A={a} gone the client went to {sorted(moved)}"
