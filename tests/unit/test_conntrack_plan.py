"""model/conntrack.py: which UDP conntrack entries a change of endpoints made stale (the plan every
netfilter-based mode runs), and the `conntrack -D` filter each planned entry becomes (dataplane/netfilter.py)."""

from __future__ import annotations

import pytest

from pyproxy.dataplane import netfilter as nf
from pyproxy.model.conntrack import Stale, stale_udp_states
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

B1, B2, B3 = (Backend(f"10.244.0.{i}", 5353) for i in (1, 2, 3))
VIP, EXT_IP, LB_IP = "10.96.0.10", "192.0.2.10", "203.0.113.10"
NODE_IPS = ("10.0.0.5", "192.168.1.5")


def fe(ip: str = VIP, port: int = 53, *, ready: tuple[Backend, ...] = (), not_ready: tuple[Backend, ...] = (),
       kind: FrontendKind = FrontendKind.CLUSTER_IP, proto: Protocol = Protocol.UDP,
       external: tuple[Backend, ...] | None = None) -> ServicePortState:
    known = tuple(sorted({*ready, *not_ready}))
    ext = () if kind is FrontendKind.CLUSTER_IP else (ready if external is None else external)
    return ServicePortState("kube-system/dns", "dns", Frontend(ip, port, proto), tuple(sorted(ready)), known,
                            kind=kind, external_backends=ext)


def node_port(*, ready: tuple[Backend, ...] = (), external: tuple[Backend, ...] | None = None
              ) -> list[ServicePortState]:
    return [fe(ip, 30053, ready=ready, kind=FrontendKind.NODE_PORT, external=external) for ip in NODE_IPS]


CASES = [
    # (id, old states, new states, the plan)
    ("nothing changed", [fe(ready=(B1,))], [fe(ready=(B1,))], []),
    ("endpoint replaced", [fe(ready=(B1,))], [fe(ready=(B2,))], [Stale(VIP, 53, B1)]),
    ("one of two left", [fe(ready=(B1, B2))], [fe(ready=(B1,))], [Stale(VIP, 53, B2)]),
    ("endpoint added", [fe(ready=(B1,))], [fe(ready=(B1, B2))], []),
    # Not ready but still in the slice: its established flows are kept (upstream); they go when it leaves.
    ("endpoint turned not ready", [fe(ready=(B1, B2))], [fe(ready=(B1,), not_ready=(B2,))], []),
    ("not-ready endpoint left", [fe(ready=(B1,), not_ready=(B2,))], [fe(ready=(B1,))], [Stale(VIP, 53, B2)]),
    ("last endpoint left", [fe(ready=(B1,))], [fe()], [Stale(VIP, 53, B1)]),
    ("frontend removed", [fe(ready=(B1, B2))], [], [Stale(VIP, 53, B1), Stale(VIP, 53, B2)]),
    # Flows begun while it rejected were never DNATed: the first endpoint must get them.
    ("first endpoint", [fe()], [fe(ready=(B1,))], [Stale(VIP, 53)]),
    ("first endpoint replacing a not-ready one", [fe(not_ready=(B1,))], [fe(ready=(B2,))],
     [Stale(VIP, 53), Stale(VIP, 53, B1)]),
    # A frontend the mode knew nothing of (a new Service, or every Service on the first sync after a start):
    # only untranslated entries go, never an endpoint's (upstream 122740).
    ("new frontend / restart", [], [fe(ready=(B1, B2))], [Stale(VIP, 53)]),
    ("restart without endpoints", [], [fe()], []),
    ("TCP is left alone", [fe(ready=(B1,), proto=Protocol.TCP)], [fe(proto=Protocol.TCP)], []),
    ("SCTP is left alone", [fe(ready=(B1,), proto=Protocol.SCTP)], [fe(proto=Protocol.SCTP)], []),
    ("external IP", [fe(EXT_IP, ready=(B1,), kind=FrontendKind.EXTERNAL_IP)],
     [fe(EXT_IP, ready=(B2,), kind=FrontendKind.EXTERNAL_IP)], [Stale(EXT_IP, 53, B1)]),
    ("load-balancer IP", [fe(LB_IP, ready=(B1,), kind=FrontendKind.LOAD_BALANCER)],
     [fe(LB_IP, ready=(B2,), kind=FrontendKind.LOAD_BALANCER)], [Stale(LB_IP, 53, B1)]),
    ("load-balancer IP first endpoint", [fe(LB_IP, kind=FrontendKind.LOAD_BALANCER)],
     [fe(LB_IP, ready=(B1,), kind=FrontendKind.LOAD_BALANCER)], [Stale(LB_IP, 53)]),
    # NodePorts: DNATed entries by port on any address (as upstream), once however many addresses serve it.
    ("node port endpoint left", node_port(ready=(B1, B2)), node_port(ready=(B2,)), [Stale("", 30053, B1)]),
    # ... untranslated ones per address: only "reply from the original destination" tells them apart.
    ("node port first endpoint", node_port(), node_port(ready=(B1,)),
     [Stale(ip, 30053) for ip in NODE_IPS]),
    ("node port removed", node_port(ready=(B1,)), [], [Stale("", 30053, B1)]),
    # externalTrafficPolicy Local without a local endpoint: pods still get DNATed to the cluster's endpoints.
    ("Local node port, no local endpoint", node_port(ready=(B1,), external=()),
     node_port(ready=(B2,), external=()), [Stale("", 30053, B1)]),
    ("several frontends at once", [fe(ready=(B1,)), fe(EXT_IP, ready=(B1,), kind=FrontendKind.EXTERNAL_IP),
                                   fe(VIP, 5353, ready=(B3,))],
     [fe(ready=(B2,)), fe(EXT_IP, ready=(B2,), kind=FrontendKind.EXTERNAL_IP), fe(VIP, 5353, ready=(B3,))],
     [Stale(VIP, 53, B1), Stale(EXT_IP, 53, B1)]),
]


@pytest.mark.parametrize(("old", "new", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan(old: list[ServicePortState], new: list[ServicePortState], want: list[Stale]) -> None:
    assert sorted(stale_udp_states(old, new), key=str) == sorted(want, key=str)


FILTERS = [
    (Stale(VIP, 53, B1), ["-p", "udp", "--orig-dst", VIP, "--orig-port-dst", "53",
                          "--dst-nat", B1.ip, "--reply-port-src", "5353"]),
    (Stale("", 30053, B1), ["-p", "udp", "--orig-port-dst", "30053", "--dst-nat", B1.ip, "--reply-port-src", "5353"]),
    # Never DNATed: the reply comes from the frontend itself, which no live endpoint flow's does.
    (Stale(VIP, 53), ["-p", "udp", "--orig-dst", VIP, "--orig-port-dst", "53", "--reply-src", VIP]),
]


@pytest.mark.parametrize(("stale", "argv"), FILTERS, ids=[str(f[0]) for f in FILTERS])
def test_conntrack_filter(stale: Stale, argv: list[str]) -> None:
    assert nf.conntrack_filter(stale) == argv


def test_untranslated_entries_need_an_address() -> None:
    with pytest.raises(ValueError):
        nf.conntrack_filter(Stale("", 30053))
