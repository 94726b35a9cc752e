"""IPVS render(): desired state to ordered IPVS/address/ipset operations, checked without a kernel.

Every plan runs against `KernelModel`, a dictionary model of IPVS, kube-ipvs0 and the ipsets, which after
each single operation checks what the datapath needs at that instant (an address on kube-ipvs0 always has a
virtual server and its KUBE-CLUSTER-IP member; real servers only exist under their virtual server), and the
next sync starts from the model, as the backend starts from what it reads back from the kernel; `after()`,
which a partial sync starts from instead, must predict the model exactly.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from pyproxy.dataplane.ipvs import kernel
from pyproxy.dataplane.ipvs.backend import IpvsDataplane, IpvsSettings, is_mode_chain, is_mode_rule, rule_edits
from pyproxy.dataplane.ipvs.render import (
    CLUSTER_IP_SET,
    EXTERNAL_IP_LOCAL_SET,
    EXTERNAL_IP_SET,
    FRONTEND_SETS,
    IPVS_IPS_SET,
    LOAD_BALANCER_FW_SET,
    LOAD_BALANCER_LOCAL_SET,
    LOAD_BALANCER_SET,
    LOAD_BALANCER_SOURCE_CIDR_SET,
    LOOPBACK_SET,
    NO_ENDPOINTS_SET,
    NO_LOCAL_CLUSTER_IP_SET,
    NO_LOCAL_SET,
    AddressOp,
    Memory,
    Observed,
    Op,
    Options,
    Plan,
    Real,
    RealOp,
    SetOp,
    Virtual,
    VirtualOp,
    VSKey,
    after,
    cluster_entry,
    loopback_entry,
    render,
    set_name,
)
from pyproxy.dataplane.netfilter import MasqueradeSettings, restore_input
from pyproxy.model.conntrack import Stale
from pyproxy.model.objects import IPV6, Protocol, family_of
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

WEB, DNS = "default/web", "kube-system/dns"
A, B, C = (Backend(f"10.0.1.{i}", 8080) for i in (1, 2, 3))
X, Y = Backend("10.0.2.1", 53), Backend("10.0.2.2", 53)
WEB_KEY: VSKey = ("10.96.0.10", 80, "TCP")
NODE_IPS = ("10.0.0.5", "192.168.1.5")
EXT_IP, LB_IP = "192.0.2.10", "203.0.113.10"
DNS_KEY: VSKey = ("10.96.0.53", 53, "UDP")


def port(service: str, ip: str, number: int, backends: Iterable[Backend], *, protocol: Protocol = Protocol.TCP,
         affinity: int = 0, name: str = "") -> ServicePortState:
    ready = tuple(sorted(backends))
    return ServicePortState(service=service, port_name=name, frontend=Frontend(ip, number, protocol),
                            backends=ready, known_backends=ready, session_affinity_seconds=affinity)


def web(*backends: Backend, number: int = 80, affinity: int = 0) -> ServicePortState:
    return port(WEB, "10.96.0.10", number, backends, affinity=affinity)


def dns(*backends: Backend) -> ServicePortState:
    return port(DNS, "10.96.0.53", 53, backends, protocol=Protocol.UDP, name="dns")


@dataclass
class KernelModel:
    virtuals: dict[VSKey, tuple[str, int, dict[Backend, int]]] = field(default_factory=dict)
    addresses: set[str] = field(default_factory=set)
    sets: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Members of each set (an untouched set: none)."""
    conns: dict[tuple[VSKey, Backend], int] = field(default_factory=dict)
    """Active connections per real server, as a test sets them."""
    node: tuple[str, ...] = NODE_IPS
    """The node's addresses as the last sync was told them."""

    def observed(self) -> Observed:
        virtuals = {k: Virtual(s, t, {b: Real(w, self.conns.get((k, b), 0)) for b, w in reals.items()})
                    for k, (s, t, reals) in self.virtuals.items()}
        return Observed(virtuals, frozenset(self.addresses), {n: frozenset(m) for n, m in self.sets.items()})

    def run(self, op: Op) -> None:
        if isinstance(op, VirtualOp):
            assert (op.key in self.virtuals) == (op.verb != "add"), op
            if op.verb == "del":
                del self.virtuals[op.key]
            else:
                reals = self.virtuals[op.key][2] if op.key in self.virtuals else {}
                self.virtuals[op.key] = (op.scheduler, op.timeout, reals)
        elif isinstance(op, RealOp):
            assert op.key in self.virtuals, op
            reals = self.virtuals[op.key][2]
            assert (op.backend in reals) == (op.verb != "add"), op
            if op.verb == "del":
                del reals[op.backend]
            else:
                reals[op.backend] = op.weight
        elif isinstance(op, AddressOp):
            assert (op.ip in self.addresses) == (op.verb == "del"), op
            (self.addresses.add if op.verb == "add" else self.addresses.discard)(op.ip)
        else:
            members = self.sets.setdefault(op.name, set())
            (members.add if op.verb == "add" else members.discard)(op.entry)
        self.check()

    def check(self) -> None:
        """What must hold between any two operations."""
        for ip in self.addresses:
            assert ip not in self.node, f"node address {ip} bound to kube-ipvs0"
            served = [k for k in self.virtuals if k[0] == ip]
            assert served, f"{ip} is local but no virtual server serves it"
            for k in served:
                names = [set_name(name, family_of(k[0])) for name in FRONTEND_SETS]
                listed = [name for name in names if cluster_entry(k) in self.sets.get(name, set())]
                assert listed, f"{k} local but not accepted"

    def sync(self, memory: Memory, desired: Mapping[str, Iterable[ServicePortState]], *, full: bool = True,
             options: Options | None = None, now: float = 0.0, node: Iterable[str] = NODE_IPS) -> Plan:
        before = self.observed()
        self.node = tuple(node)
        plan = render(before, memory, desired, full=full, options=options or Options(), now=now, node_addresses=node)
        for op in plan.ops:
            self.run(op)
        # What a partial sync of the backend starts from instead of reading everything back.
        assert after(before, plan.ops) == self.observed()
        return plan


def test_a_service_becomes_a_virtual_server_with_its_ready_endpoints() -> None:
    k = KernelModel()
    plan = k.sync(Memory(), {WEB: [web(A, B)]})
    assert k.virtuals == {WEB_KEY: ("rr", 0, {A: 1, B: 1})}
    assert k.addresses == {"10.96.0.10"}
    assert k.sets[CLUSTER_IP_SET] == {"10.96.0.10,tcp:80"}
    assert k.sets[LOOPBACK_SET] == {"10.0.1.1,tcp:8080,10.0.1.1", "10.0.1.2,tcp:8080,10.0.1.2"}
    assert k.sets[IPVS_IPS_SET] == {"10.96.0.10"}
    assert plan.memory.owners == {WEB_KEY: WEB}
    kinds = [type(op).__name__ for op in plan.ops]
    # ipset members first, then IPVS, then the address that makes the ClusterIP local.
    assert kinds == ["SetOp"] * 4 + ["VirtualOp", "RealOp", "RealOp", "AddressOp"]


def test_nothing_changes_nothing() -> None:
    k = KernelModel()
    plan = k.sync(Memory(), {WEB: [web(A, B)], DNS: [dns(X)]})
    assert k.sync(plan.memory, {WEB: [web(A, B)], DNS: [dns(X)]}).ops == ()
    assert k.sync(plan.memory, {WEB: [web(A, B)]}, full=False).ops == ()


def test_no_endpoints_keeps_a_virtual_server_without_real_servers() -> None:
    # The kernel answers such a virtual server with ICMP port unreachable: connection refused, at once.
    k = KernelModel()
    k.sync(Memory(), {WEB: [web()]})
    assert k.virtuals == {WEB_KEY: ("rr", 0, {})}
    assert k.addresses == {"10.96.0.10"}
    assert not k.sets.get(LOOPBACK_SET)


def test_scheduler_and_affinity_are_applied_and_edited_in_place() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A)]}, options=Options("wrr")).memory
    assert k.virtuals[WEB_KEY][:2] == ("wrr", 0)
    plan = k.sync(memory, {WEB: [web(A, affinity=10800)]}, options=Options("sh"))
    assert plan.ops == (VirtualOp("set", WEB_KEY, "sh", 10800),)
    assert k.virtuals[WEB_KEY] == ("sh", 10800, {A: 1})


def test_removed_tcp_endpoint_drains_then_goes_when_idle() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A, B)]}).memory
    k.conns[(WEB_KEY, B)] = 2
    plan = k.sync(memory, {WEB: [web(A)]}, full=False, now=100.0)
    assert plan.ops == (RealOp("set", WEB_KEY, B, 0),)
    assert plan.memory.draining_since == {(WEB_KEY, B): 100.0}
    # Still connected: it stays at weight 0, and the clock keeps its start.
    plan = k.sync(plan.memory, {}, full=False, now=200.0)
    assert plan.ops == ()
    assert plan.memory.draining_since == {(WEB_KEY, B): 100.0}
    assert k.sets[LOOPBACK_SET] >= {loopback_entry(WEB_KEY, B)}  # its flows may still hairpin
    # Idle: deleted at the next sync of anything, here a partial sync of another Service.
    k.conns[(WEB_KEY, B)] = 0
    plan = k.sync(plan.memory, {DNS: [dns(X)]}, full=False, now=210.0)
    assert RealOp("del", WEB_KEY, B) in plan.ops
    assert k.virtuals[WEB_KEY][2] == {A: 1}
    assert plan.memory.draining_since == {}
    assert loopback_entry(WEB_KEY, B) not in k.sets[LOOPBACK_SET]


def test_draining_is_bounded_by_the_grace_period() -> None:
    k = KernelModel()
    options = Options(grace_seconds=60.0)
    memory = k.sync(Memory(), {WEB: [web(A, B)]}, options=options).memory
    k.conns[(WEB_KEY, B)] = 1
    memory = k.sync(memory, {WEB: [web(A)]}, options=options, now=0.0).memory
    assert k.sync(memory, {WEB: [web(A)]}, options=options, now=59.0).ops == ()
    plan = k.sync(memory, {WEB: [web(A)]}, options=options, now=60.0)
    assert plan.ops[0] == RealOp("del", WEB_KEY, B)


def test_removed_endpoint_without_connections_and_udp_ones_go_at_once() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A, B)], DNS: [dns(X, Y)]}).memory
    k.conns[(DNS_KEY, Y)] = 5  # UDP: upstream never waits (expire_nodest_conn ends those flows)
    plan = k.sync(memory, {WEB: [web(A)], DNS: [dns(X)]})
    assert {op for op in plan.ops if isinstance(op, RealOp)} == {RealOp("del", WEB_KEY, B), RealOp("del", DNS_KEY, Y)}
    assert plan.memory.draining_since == {}


def test_a_draining_endpoint_that_comes_back_is_restored() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A, B)]}).memory
    k.conns[(WEB_KEY, B)] = 1
    memory = k.sync(memory, {WEB: [web(A)]}).memory
    plan = k.sync(memory, {WEB: [web(A, B)]})
    assert plan.ops == (RealOp("set", WEB_KEY, B, 1),)
    assert plan.memory.draining_since == {}


def test_removed_service_unbinds_its_address_before_its_virtual_server_goes() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A)], DNS: [dns(X)]}).memory
    plan = k.sync(memory, {WEB: []}, full=False)
    assert plan.ops[:2] == (AddressOp("del", "10.96.0.10"), VirtualOp("del", WEB_KEY))
    assert all(isinstance(op, SetOp) and op.verb == "del" for op in plan.ops[2:])
    assert set(k.virtuals) == {DNS_KEY}
    assert k.addresses == {"10.96.0.53"}
    assert k.sets[CLUSTER_IP_SET] == {cluster_entry(DNS_KEY)}
    assert plan.memory.owners == {DNS_KEY: DNS}


def test_one_port_of_a_two_port_service_goes_and_the_address_stays() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A), web(A, number=90)]}).memory
    plan = k.sync(memory, {WEB: [web(A)]}, full=False)
    assert VirtualOp("del", ("10.96.0.10", 90, "TCP")) in plan.ops
    assert not any(isinstance(op, AddressOp) for op in plan.ops)
    assert k.addresses == {"10.96.0.10"}


def test_partial_sync_touches_only_its_services() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A)], DNS: [dns(X)]}).memory
    # DNS is absent from this partial sync's desired state: it is not being synced, so it stays.
    plan = k.sync(memory, {WEB: [web(A, B)]}, full=False)
    assert plan.ops == (SetOp("add", LOOPBACK_SET, loopback_entry(WEB_KEY, B)), RealOp("add", WEB_KEY, B, 1))
    assert DNS_KEY in k.virtuals


def test_full_sync_adopts_a_previous_run_and_removes_only_its_stale_objects() -> None:
    k = KernelModel()
    k.sync(Memory(), {WEB: [web(A)], DNS: [dns(X)]})
    foreign: VSKey = ("192.0.2.1", 80, "TCP")  # someone else's virtual server: not on kube-ipvs0, not listed
    k.virtuals[foreign] = ("wlc", 0, {C: 1})
    # A restart: nothing remembered. Same desired state: nothing to do, traffic untouched.
    plan = k.sync(Memory(), {WEB: [web(A)], DNS: [dns(X)]})
    assert plan.ops == ()
    assert plan.memory.owners == {WEB_KEY: WEB, DNS_KEY: DNS}
    # DNS deleted while pyproxy was down: the first full sync removes its leftovers, never the foreign one.
    k2 = KernelModel()
    k2.sync(Memory(), {WEB: [web(A)], DNS: [dns(X)]})
    k2.virtuals[foreign] = ("wlc", 0, {C: 1})
    k2.sync(Memory(), {WEB: [web(A)]})
    assert set(k2.virtuals) == {WEB_KEY, foreign}
    assert k2.addresses == {"10.96.0.10"}


def test_ipset_members_are_stable_strings() -> None:
    assert cluster_entry(("10.96.0.53", 53, "UDP")) == "10.96.0.53,udp:53"
    assert loopback_entry(("10.96.0.10", 80, "TCP"), Backend("10.0.1.1", 8080)) == "10.0.1.1,tcp:8080,10.0.1.1"
    assert cluster_entry(("10.96.0.9", 9, "SCTP")) == "10.96.0.9,sctp:9"


# --------------------------------------------------------------------------------------------- iptables


@pytest.mark.parametrize(("m", "marking"), [
    (MasqueradeSettings(), "-m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ"),
    (MasqueradeSettings(masquerade_all=True), "--match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"),
    (MasqueradeSettings(cluster_cidr="10.244.0.0/16"),
     "--match-set KUBE-CLUSTER-IP dst,dst ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"),
])
def test_rules_mark_masquerade_per_settings(m: MasqueradeSettings, marking: str) -> None:
    text = restore_input(rule_edits(m))
    services = [line for line in text.splitlines() if line.startswith("-A KUBE-SERVICES ")]
    marks = [i for i, line in enumerate(services) if "KUBE-CLUSTER-IP" in line and "KUBE-MARK-MASQ" in line]
    accepts = [i for i, line in enumerate(services)
               if line == "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT"]
    assert len(marks) == len(accepts) == 1 and marks[0] < accepts[0], services
    assert services[marks[0]].endswith(marking)
    postrouting = [line for line in text.splitlines() if line.startswith("-A KUBE-POSTROUTING ")]
    # The hairpin rule comes before the RETURN of unmarked packets, or it would never match.
    assert "--match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE" in postrouting[0]
    assert postrouting[1].endswith("-j RETURN")
    assert "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT" in text


def test_mode_rules_are_recognised_by_their_ipsets() -> None:
    assert is_mode_rule("nat", "KUBE-SERVICES", "-m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT")
    assert not is_mode_rule("nat", "KUBE-SERVICES", "-m comment --comment x -j KUBE-SVC-ABCDEFGHIJKLMNOP")


# ------------------------------------------------------------------------------- NodePort, ExternalIP, LB


def ext(kind: FrontendKind, ip: str, number: int, backends: Iterable[Backend], local: Iterable[Backend] | None = None,
        *, ranges: tuple[str, ...] = (), service: str = WEB, protocol: Protocol = Protocol.TCP) -> ServicePortState:
    """An external frontend as the model makes it: `local` None is externalTrafficPolicy Cluster (every endpoint,
    masqueraded), else Local with this node's endpoints `local`."""
    ready = tuple(sorted(backends))
    outside = ready if local is None else tuple(sorted(local))
    return ServicePortState(service=service, port_name="", frontend=Frontend(ip, number, protocol), backends=ready,
                            known_backends=ready, kind=kind, external_backends=outside, masquerade=local is None,
                            source_ranges=ranges)


def node_ports(number: int, backends: Iterable[Backend], local: Iterable[Backend] | None = None,
               ips: Iterable[str] = NODE_IPS, protocol: Protocol = Protocol.TCP) -> list[ServicePortState]:
    return [ext(FrontendKind.NODE_PORT, ip, number, backends, local, protocol=protocol) for ip in ips]


def test_a_node_port_is_a_virtual_server_on_each_node_address_never_bound() -> None:
    k = KernelModel()
    k.sync(Memory(), {WEB: [web(A, B), *node_ports(30080, [A, B])],
                      DNS: [dns(X), *node_ports(30053, [X], protocol=Protocol.UDP)]})
    for ip in NODE_IPS:
        assert k.virtuals[(ip, 30080, "TCP")] == ("rr", 0, {A: 1, B: 1})
        assert k.virtuals[(ip, 30053, "UDP")] == ("rr", 0, {X: 1})
    assert k.addresses == {"10.96.0.10", "10.96.0.53"}
    assert k.sets["KUBE-NODE-PORT-TCP"] == {"30080"} and k.sets["KUBE-NODE-PORT-UDP"] == {"30053"}
    assert not k.sets["KUBE-NODE-PORT-LOCAL-TCP"] and not k.sets["KUBE-NODE-PORT-LOCAL-UDP"]
    assert k.sets[IPVS_IPS_SET] == {"10.96.0.10", "10.96.0.53"}


def test_node_port_virtual_servers_follow_the_node_addresses() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [web(A), *node_ports(30080, [A], ips=NODE_IPS[:1])], DNS: [dns(X)]}).memory
    # The node gained an address and lost the other: the model recomputes the Service, the proxier syncs it.
    plan = k.sync(memory, {WEB: [web(A), *node_ports(30080, [A], ips=["172.16.0.9"])]}, full=False)
    assert {key for key in k.virtuals if key[1] == 30080} == {("172.16.0.9", 30080, "TCP")}
    assert VirtualOp("del", (NODE_IPS[0], 30080, "TCP")) in plan.ops
    assert not any(isinstance(op, AddressOp) for op in plan.ops), "node addresses are never bound"
    assert k.sets["KUBE-NODE-PORT-TCP"] == {"30080"}
    # Its last node-port address gone: the virtual server and the set member go.
    k.sync(plan.memory, {WEB: [web(A)]}, full=False)
    assert not any(key[1] == 30080 for key in k.virtuals) and not k.sets["KUBE-NODE-PORT-TCP"]
    assert DNS_KEY in k.virtuals


def test_external_and_load_balancer_ips_are_bound_and_listed_by_policy() -> None:
    k = KernelModel()
    k.sync(Memory(), {WEB: [web(A, B), ext(FrontendKind.EXTERNAL_IP, EXT_IP, 80, [A, B]),
                            ext(FrontendKind.LOAD_BALANCER, LB_IP, 80, [A, B], [A])]})
    assert k.virtuals[(EXT_IP, 80, "TCP")][2] == {A: 1, B: 1}
    assert k.virtuals[(LB_IP, 80, "TCP")][2] == {A: 1}  # Local: this node's endpoints
    assert k.addresses == {"10.96.0.10", EXT_IP, LB_IP}
    assert k.sets[EXTERNAL_IP_SET] == {f"{EXT_IP},tcp:80"} and not k.sets[EXTERNAL_IP_LOCAL_SET]
    assert k.sets[LOAD_BALANCER_SET] == k.sets[LOAD_BALANCER_LOCAL_SET] == {f"{LB_IP},tcp:80"}
    # The policy flips: the members move between the sets, the virtual servers stay.
    plan = k.sync(Memory(), {WEB: [web(A, B), ext(FrontendKind.EXTERNAL_IP, EXT_IP, 80, [A, B], [A]),
                                   ext(FrontendKind.LOAD_BALANCER, LB_IP, 80, [A, B])]})
    assert not any(isinstance(op, VirtualOp) for op in plan.ops)
    assert k.sets[EXTERNAL_IP_LOCAL_SET] == {f"{EXT_IP},tcp:80"} and not k.sets[EXTERNAL_IP_SET]
    assert not k.sets[LOAD_BALANCER_LOCAL_SET]
    assert k.virtuals[(LB_IP, 80, "TCP")][2] == {A: 1, B: 1}


def test_source_ranges_are_listed_as_ipset_prints_them() -> None:
    k = KernelModel()
    k.sync(Memory(), {WEB: [web(A), ext(FrontendKind.LOAD_BALANCER, LB_IP, 80, [A],
                                        ranges=("198.51.100.0/24", " 10.1.2.3/16", f"{LB_IP}/32"))]})
    assert k.sets[LOAD_BALANCER_FW_SET] == {f"{LB_IP},tcp:80"}
    assert k.sets[LOAD_BALANCER_SOURCE_CIDR_SET] == {
        f"{LB_IP},tcp:80,198.51.100.0/24", f"{LB_IP},tcp:80,10.1.0.0/16", f"{LB_IP},tcp:80,{LB_IP}"}


def test_local_policy_without_a_local_endpoint_serves_all_and_is_listed_for_the_drop() -> None:
    k = KernelModel()
    # The cluster has endpoints, none on this node: every endpoint serves pods and the node; outside sources
    # are dropped by the rule over KUBE-NO-LOCAL-ENDPOINTS.
    memory = k.sync(Memory(), {WEB: [web(A, B), *node_ports(30080, [A, B], [])]}).memory
    assert k.virtuals[(NODE_IPS[0], 30080, "TCP")][2] == {A: 1, B: 1}
    assert k.sets[NO_LOCAL_SET] == {f"{ip},tcp:30080" for ip in NODE_IPS}
    assert k.sets["KUBE-NODE-PORT-LOCAL-TCP"] == {"30080"}
    # A local endpoint comes: only it serves, and the drop goes.
    memory = k.sync(memory, {WEB: [web(A, B), *node_ports(30080, [A, B], [A])]}, full=False).memory
    assert k.virtuals[(NODE_IPS[0], 30080, "TCP")][2] == {A: 1}
    assert not k.sets[NO_LOCAL_SET]
    assert not k.sets[NO_ENDPOINTS_SET]
    # No endpoint anywhere: no real server (refused), and nothing to drop; new TCP flows are reset by the rule
    # over KUBE-NO-ENDPOINTS before IPVS's rate-limited ICMP answer.
    memory = k.sync(memory, {WEB: [web(), *node_ports(30080, [], [])]}, full=False).memory
    assert k.virtuals[(NODE_IPS[0], 30080, "TCP")][2] == {}
    assert not k.sets[NO_LOCAL_SET]
    assert k.sets[NO_ENDPOINTS_SET] == {"10.96.0.10,tcp:80", *(f"{ip},tcp:30080" for ip in NODE_IPS)}
    k.sync(memory, {WEB: [web(A), *node_ports(30080, [A], [A])]}, full=False)
    assert not k.sets[NO_ENDPOINTS_SET]


def test_internal_local_policy_without_a_local_endpoint_is_listed_for_the_drop_not_the_reset() -> None:
    k = KernelModel()
    # internalTrafficPolicy Local, none of the cluster's endpoints here: no real server, and the ClusterIP goes
    # into KUBE-NO-LOCAL-CLUSTER-IP, whose rule drops pods' and outside flows, not KUBE-NO-ENDPOINTS (reset).
    memory = k.sync(Memory(), {WEB: [replace(web(), drop=True)]}).memory
    assert k.virtuals[WEB_KEY][2] == {}
    assert k.sets[NO_LOCAL_CLUSTER_IP_SET] == {"10.96.0.10,tcp:80"}
    assert not k.sets[NO_ENDPOINTS_SET]
    # A local endpoint comes: it serves, and the drop goes.
    k.sync(memory, {WEB: [web(A)]}, full=False)
    assert k.virtuals[WEB_KEY][2] == {A: 1}
    assert not k.sets[NO_LOCAL_CLUSTER_IP_SET]
    drop = next(line for line in restore_input(rule_edits(MasqueradeSettings(cluster_cidr="10.244.0.0/16")))
                .splitlines() if "KUBE-NO-LOCAL-CLUSTER-IP" in line)
    assert drop.endswith("-j DROP") and "--src-type" not in drop and " -s " not in drop, drop


def test_a_partial_sync_keeps_what_other_services_account_for() -> None:
    k = KernelModel()
    lb = ext(FrontendKind.LOAD_BALANCER, LB_IP, 80, [A], [A], ranges=("10.0.0.0/8",))
    memory = k.sync(Memory(), {WEB: [web(A), lb, *node_ports(30080, [A], [A])], DNS: [dns(X)]}).memory
    before = {name: set(m) for name, m in k.sets.items()}
    plan = k.sync(memory, {DNS: [dns(X, Y)]}, full=False)
    assert {name: set(m) for name, m in k.sets.items() if name != LOOPBACK_SET} == {
        name: m for name, m in before.items() if name != LOOPBACK_SET}
    assert all(isinstance(op, (RealOp, SetOp)) and getattr(op, "verb", "") == "add" for op in plan.ops), plan.ops
    # Removing the Service takes all of it, across kinds.
    k.sync(plan.memory, {WEB: []}, full=False)
    assert set(k.virtuals) == {DNS_KEY}
    assert k.addresses == {"10.96.0.53"}
    assert all(not m for name, m in k.sets.items() if name not in (CLUSTER_IP_SET, IPVS_IPS_SET, LOOPBACK_SET))


def test_a_restart_removes_stale_node_ports_of_a_previous_run_only() -> None:
    k = KernelModel()
    k.sync(Memory(), {WEB: [web(A), *node_ports(30080, [A])], DNS: [dns(X), *node_ports(30053, [X])]})
    foreign: VSKey = (NODE_IPS[0], 8443, "TCP")  # someone else's, on a node address
    k.virtuals[foreign] = ("wlc", 0, {C: 1})
    # DNS deleted while pyproxy was down: nothing remembered, its node ports are known by the node-port set.
    k.sync(Memory(), {WEB: [web(A), *node_ports(30080, [A])]})
    assert set(k.virtuals) == {WEB_KEY, foreign, *((ip, 30080, "TCP") for ip in NODE_IPS)}
    assert k.sets["KUBE-NODE-PORT-TCP"] == {"30080"}


def test_rules_for_external_frontends() -> None:
    text = restore_input(rule_edits(MasqueradeSettings(cluster_cidr="10.244.0.0/16")))
    lines = text.splitlines()
    # Cluster policy marks for SNAT; Local returns first, but for the node's own flows.
    assert ("-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port with "
            "externalTrafficPolicy=local\" -m set --match-set KUBE-NODE-PORT-LOCAL-TCP dst -m addrtype ! "
            "--src-type LOCAL -j RETURN") in lines
    node_port = [line for line in lines if line.startswith("-A KUBE-NODE-PORT -p tcp")]
    assert node_port[1].endswith("--match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ")
    assert lines.index("-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ") > lines.index(
        "-A KUBE-LOAD-BALANCER -m set --match-set KUBE-LOAD-BALANCER-LOCAL dst,dst -m addrtype ! --src-type LOCAL "
        "-j RETURN")
    # Source ranges and the Local drop, before IPVS; pods (--cluster-cidr) are not dropped.
    assert "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP" in lines
    drop = next(line for line in lines if "KUBE-NO-LOCAL-ENDPOINTS" in line)
    assert "! -s 10.244.0.0/16" in drop and drop.endswith("-j DROP") and "--ctstate NEW" in drop
    reset = next(line for line in lines if "KUBE-NO-ENDPOINTS" in line)
    assert reset.startswith("-A KUBE-IPVS-FIREWALL") and "-p tcp" in reset
    assert reset.endswith("-j REJECT --reject-with tcp-reset")
    # The node-port jump comes after every accept, so it sees no other frontend.
    services = [line for line in lines if line.startswith("-A KUBE-SERVICES")]
    assert services[-1] == "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT"
    for chain in ("KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"):
        assert is_mode_chain("nat", chain)
    for chain in ("KUBE-IPVS-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER"):
        assert is_mode_chain("filter", chain)
    assert not is_mode_chain("nat", "KUBE-SERVICES")


def test_cleanup_can_tell_every_rule_of_ours_in_the_shared_services_chain() -> None:
    # KUBE-SERVICES is shared with the iptables mode: cleanup removes our rules there by their ipsets, or as
    # jumps to our own chains; any other rule would keep the chain, and the jumps to it, after a cleanup.
    nat = rule_edits(MasqueradeSettings(cluster_cidr="10.244.0.0/16"))["nat"]
    ours = [line.split(" ", 2)[2] for line in nat.rules if line.startswith("-A KUBE-SERVICES ")]
    assert ours
    for body in ours:
        assert is_mode_rule("nat", "KUBE-SERVICES", body) or is_mode_chain("nat", body.rsplit("-j ", 1)[1]), body


def test_an_external_ip_that_is_a_node_address_is_served_but_never_bound() -> None:
    # Bound, it would be in KUBE-IPVS-IPS, and KUBE-IPVS-FILTER would reject the node's own services on it.
    k = KernelModel()
    state = [web(A), ext(FrontendKind.EXTERNAL_IP, NODE_IPS[1], 80, [A])]
    memory = k.sync(Memory(), {WEB: state}).memory
    assert k.virtuals[(NODE_IPS[1], 80, "TCP")][2] == {A: 1}
    assert k.addresses == {"10.96.0.10"} and k.sets[IPVS_IPS_SET] == {"10.96.0.10"}
    assert k.sets[EXTERNAL_IP_SET] == {f"{NODE_IPS[1]},tcp:80"}
    # The node loses that address: the model recomputes the Service, which binds it now.
    k.sync(memory, {WEB: state}, full=False, node=NODE_IPS[:1])
    assert k.addresses == {"10.96.0.10", NODE_IPS[1]}


# ---------------------------------------------------------------------------------------------- conntrack
# The planner's cases are tests/unit/test_conntrack_plan.py's; here: which old state IPVS hands it.


def test_udp_entries_of_a_removed_real_server_are_planned_by_address_and_node_ports_by_port() -> None:
    k = KernelModel()
    first = k.sync(Memory(), {DNS: [dns(X, Y), *node_ports(30053, [X, Y], protocol=Protocol.UDP)]})
    assert set(first.stale_udp) == {Stale("10.96.0.53", 53), *(Stale(ip, 30053) for ip in NODE_IPS)}
    plan = k.sync(first.memory, {DNS: [dns(X), *node_ports(30053, [X], protocol=Protocol.UDP)]}, full=False)
    assert set(plan.stale_udp) == {Stale("", 30053, Y), Stale("10.96.0.53", 53, Y)}
    assert k.sync(plan.memory, {DNS: [dns(X), *node_ports(30053, [X], protocol=Protocol.UDP)]}).stale_udp == ()


def test_a_restart_plans_no_entries_of_endpoints_still_there_only_of_those_the_kernel_shows_gone() -> None:
    k = KernelModel()
    k.sync(Memory(), {DNS: [dns(X, Y)], WEB: [web(A, B)]})
    # Nothing remembered: the kernel's real servers are the old state. X stays, Y left while pyproxy was down.
    plan = k.sync(Memory(), {DNS: [dns(X)], WEB: [web(A)]})
    assert plan.stale_udp == (Stale("10.96.0.53", 53, Y),)
    assert k.sync(Memory(), {DNS: [dns(X)], WEB: [web(A)]}).stale_udp == ()


def test_a_not_ready_endpoint_keeps_its_udp_entries_until_it_leaves() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {DNS: [dns(X, Y)]}).memory
    not_ready = ServicePortState(service=DNS, port_name="dns", frontend=Frontend("10.96.0.53", 53, Protocol.UDP),
                                 backends=(X,), known_backends=(X, Y))
    plan = k.sync(memory, {DNS: [not_ready]})
    assert plan.stale_udp == () and (DNS_KEY, Y) not in k.conns and Y not in k.virtuals[DNS_KEY][2]
    assert k.sync(plan.memory, {DNS: [dns(X)]}).stale_udp == (Stale("10.96.0.53", 53, Y),)


def scheduled(st: ServicePortState, scheduler: str = "", weights: Mapping[str, int] | None = None) -> ServicePortState:
    return replace(st, scheduler=scheduler, weights=tuple(sorted((weights or {}).items())))


@pytest.mark.parametrize("asked, used", [("rr", "rr"), ("wrr", "wrr"), ("lc", "lc"), ("sed", "sed"), ("nq", "nq"),
                                         ("sh", "sh"), ("dh", "dh"), ("maglev", "mh"), ("", "lc"), ("random", "lc")])
def test_a_services_scheduler_is_ipvs_own_else_the_nodes(asked: str, used: str) -> None:
    k = KernelModel()
    plan = k.sync(Memory(), {WEB: [scheduled(web(A), asked)]}, options=Options("lc"))
    assert k.virtuals[WEB_KEY][0] == used
    # Said once in the log, by the backend: IPVS has no uniform random choice.
    assert plan.fallbacks == ({WEB: "random"} if asked == "random" else {})


def test_weights_come_from_the_annotation_and_zero_quiesces() -> None:
    k = KernelModel()
    k.sync(Memory(), {WEB: [scheduled(web(A, B, C), "wrr", {A.ip: 3, C.ip: 0})]})
    assert k.virtuals[WEB_KEY] == ("wrr", 0, {A: 3, B: 1, C: 0})


def test_a_changed_scheduler_or_weight_is_an_edit_that_keeps_connections() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [scheduled(web(A, B), "rr")]}).memory
    k.conns[(WEB_KEY, A)] = 3
    plan = k.sync(memory, {WEB: [scheduled(web(A, B), "maglev", {A.ip: 0, B.ip: 5})]}, full=False)
    # No del of either: a deleted virtual or real server ends its established connections.
    assert plan.ops == (VirtualOp("set", WEB_KEY, "mh", 0), RealOp("set", WEB_KEY, A, 0), RealOp("set", WEB_KEY, B, 5))
    assert plan.memory.draining_since == {}  # weight 0 by request is not draining: it stays
    plan = k.sync(plan.memory, {DNS: [dns(X)]}, full=False, now=10_000.0)
    assert not any(isinstance(op, RealOp) and op.key == WEB_KEY for op in plan.ops)
    assert k.virtuals[WEB_KEY] == ("mh", 0, {A: 0, B: 5})


def test_a_quiesced_endpoint_that_leaves_drains_like_any_other() -> None:
    k = KernelModel()
    memory = k.sync(Memory(), {WEB: [scheduled(web(A, B), "wrr", {B.ip: 0})]}).memory
    k.conns[(WEB_KEY, B)] = 1
    plan = k.sync(memory, {WEB: [scheduled(web(A), "wrr", {B.ip: 0})]}, full=False, now=5.0)
    assert plan.ops == ()
    assert plan.memory.draining_since == {(WEB_KEY, B): 5.0}
    k.conns[(WEB_KEY, B)] = 0
    plan = k.sync(plan.memory, {DNS: [dns(X)]}, full=False, now=6.0)
    assert RealOp("del", WEB_KEY, B) in plan.ops


def test_a_service_asking_for_random_is_logged_once_until_it_asks_again(caplog: pytest.LogCaptureFixture) -> None:
    dp = IpvsDataplane(IpvsSettings(scheduler="sh"))
    with caplog.at_level(logging.INFO, logger="pyproxy.dataplane.ipvs.backend"):
        for fallbacks in ({WEB: "random"}, {WEB: "random"}, {}, {WEB: "random"}):
            dp._log_fallbacks({WEB, DNS}, fallbacks)
        dp._log_fallbacks({DNS}, {})  # a sync of another Service says nothing of this one
        dp._log_fallbacks({WEB}, {WEB: "random"})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"Service {WEB} asks for the random scheduler, which IPVS has not: its virtual servers use "
                     "--ipvs-scheduler=sh"] * 2, lines


@pytest.mark.parametrize("scheduler, persistence, flags", [("rr", 0, 0), ("rr", 600, 0x1), ("sh", 0, 0x8),
                                                           ("mh", 600, 0x9), ("dh", 0, 0)])
def test_sh_and_mh_fall_back_past_a_weight_0_real_server(scheduler: str, persistence: int, flags: int) -> None:
    # Without sh-fallback / mh-fallback, IPVS refuses the clients that hash to a quiesced or draining endpoint.
    calls: list[tuple[str, Any]] = []

    class Recorder:
        def service(self, verb: str, service: Any) -> None:
            calls.append((verb, service))

    kernel.put_virtual(Recorder(), "add", WEB_KEY, scheduler, persistence)  # type: ignore[arg-type]
    [(verb, service)] = calls
    assert verb == "add" and service.combined["sched_name"] == scheduler
    assert service.combined["flags"] == {"flags": flags, "mask": 0xFFFF}


@pytest.mark.parametrize("scheduler, flags, read", [("sh", 0x8, "sh"), ("sh", 0, "sh without fallback"),
                                                    ("mh", 0x1, "mh without fallback"), ("rr", 0, "rr")])
def test_a_hashing_virtual_server_without_its_fallback_flag_is_edited(scheduler: str, flags: int, read: str) -> None:
    class Attrs(dict[str, Any]):
        def get_attr(self, name: str) -> Any:
            return self.get(name)

    svc = Attrs(IPVS_SVC_ATTR_AF=2, IPVS_SVC_ATTR_PROTOCOL=6, IPVS_SVC_ATTR_ADDR=WEB_KEY[0],
                IPVS_SVC_ATTR_PORT=WEB_KEY[1], IPVS_SVC_ATTR_SCHED_NAME=scheduler, IPVS_SVC_ATTR_TIMEOUT=600,
                IPVS_SVC_ATTR_FLAGS={"flags": flags, "mask": 0xFFFF})
    found = kernel._service_of(Attrs(IPVS_CMD_ATTR_SERVICE=svc))
    assert found == (WEB_KEY, read, 600 if flags & 1 else 0)
    # Adopted as it was read: the one that lacks its flag is edited (put_virtual sets it), the others are not.
    k = KernelModel(virtuals={WEB_KEY: (read, 0, {})})
    asked = {"mh": "maglev"}.get(scheduler, scheduler)
    ops = k.sync(Memory(owners={WEB_KEY: WEB}), {WEB: [scheduled(web(), asked)]}).ops
    assert (VirtualOp("set", WEB_KEY, scheduler, 0) in ops) == (read != scheduler), ops


# ---------------------------------------------------------------------------------------------------- IPv6
# Upstream's IPv6 proxier: the same virtual servers, kube-ipvs0 addresses (/128) and sets, named KUBE-6-*.

A6, B6 = (Backend(f"fd00:10:244::{i}", 8080) for i in (1, 2))
X6 = Backend("fd00:10:244::9", 53)
WEB6_KEY: VSKey = ("fd00:10:96::a", 80, "TCP")
NODE_IPS6 = ("fd00:10:0:1::5",)


def test_ipv6_sets_are_upstreams_kube_6_names_within_ipsets_31_characters() -> None:
    assert set_name(CLUSTER_IP_SET, IPV6) == "KUBE-6-CLUSTER-IP"
    assert set_name(LOAD_BALANCER_SOURCE_CIDR_SET, IPV6) == "KUBE-6-LOAD-BALANCER-SOURCE-CID"
    assert set_name("KUBE-NODE-PORT-LOCAL-SCTP-HASH", IPV6) == "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"
    assert set_name(CLUSTER_IP_SET, 4) == CLUSTER_IP_SET
    from pyproxy.dataplane.ipvs.render import SET_FAMILIES, SET_TYPES, SET_TYPES4
    assert len(SET_TYPES) == len(SET_FAMILIES) == 2 * len(SET_TYPES4), "two names are one after the cut"
    assert all(len(name) <= 31 for name in SET_TYPES)


def test_a_dual_stack_service_is_a_virtual_server_per_family_each_in_its_familys_sets() -> None:
    k = KernelModel()
    web6 = port(WEB, WEB6_KEY[0], 80, [A6, B6])
    plan = k.sync(Memory(), {WEB: [web(A, B), web6, *node_ports(30080, [A6], ips=NODE_IPS6)]},
                  node=(*NODE_IPS, *NODE_IPS6))
    assert k.virtuals[WEB6_KEY] == ("rr", 0, {A6: 1, B6: 1})
    assert k.virtuals[(NODE_IPS6[0], 30080, "TCP")] == ("rr", 0, {A6: 1})
    assert k.addresses == {"10.96.0.10", "fd00:10:96::a"}
    assert AddressOp("add", "fd00:10:96::a") in plan.ops
    assert k.sets["KUBE-6-CLUSTER-IP"] == {"fd00:10:96::a,tcp:80"}
    assert k.sets["KUBE-6-IPVS-IPS"] == {"fd00:10:96::a"}
    assert k.sets["KUBE-6-LOOP-BACK"] == {"fd00:10:244::1,tcp:8080,fd00:10:244::1",
                                          "fd00:10:244::2,tcp:8080,fd00:10:244::2"}
    assert k.sets["KUBE-6-NODE-PORT-TCP"] == {"30080"}
    # The IPv4 sets hold IPv4 members only: an inet set refuses an IPv6 one.
    assert k.sets[CLUSTER_IP_SET] == {"10.96.0.10,tcp:80"} and k.sets[IPVS_IPS_SET] == {"10.96.0.10"}
    assert "fd00" not in "".join(k.sets[LOOPBACK_SET]) and "KUBE-NODE-PORT-TCP" not in k.sets
    # The IPv6 half goes, the IPv4 one stays.
    k.sync(plan.memory, {WEB: [web(A, B)]}, full=False)
    assert set(k.virtuals) == {WEB_KEY} and k.addresses == {"10.96.0.10"}
    assert not any(k.sets[name] for name in k.sets if name.startswith("KUBE-6-"))


def test_a_restart_adopts_ipv6_virtual_servers_by_their_kube_6_sets() -> None:
    k = KernelModel()
    lb6 = ext(FrontendKind.LOAD_BALANCER, "fd00:203::10", 80, [A6], ranges=("fd00:10:200::/64",))
    k.sync(Memory(), {WEB: [port(WEB, WEB6_KEY[0], 80, [A6]), lb6, *node_ports(30080, [A6], ips=NODE_IPS6)]},
           node=NODE_IPS6)
    assert k.sets["KUBE-6-LOAD-BALANCER-SOURCE-CID"] == {"fd00:203::10,tcp:80,fd00:10:200::/64"}
    # Nothing remembered, the Service gone: every one of them is known as ours and removed.
    k.addresses.clear()  # not even kube-ipvs0's addresses tell: the sets do
    k.sync(Memory(), {}, node=NODE_IPS6)
    assert k.virtuals == {} and not any(k.sets.values())


def test_ipv6_udp_entries_are_planned_per_family() -> None:
    k = KernelModel()
    dns6 = port(DNS, "fd00:10:96::35", 53, [X6], protocol=Protocol.UDP, name="dns")
    first = k.sync(Memory(), {DNS: [dns(X), dns6, *node_ports(30053, [X6], ips=NODE_IPS6, protocol=Protocol.UDP)]},
                   node=NODE_IPS6)
    dns6_gone = port(DNS, "fd00:10:96::35", 53, [], protocol=Protocol.UDP, name="dns")
    plan = k.sync(first.memory, {DNS: [dns(X), dns6_gone, *node_ports(30053, [], ips=NODE_IPS6,
                                                                        protocol=Protocol.UDP)]},
                  full=False, node=NODE_IPS6)
    # The NodePort's entries by port, of its family (conntrack's -f ipv6), the ClusterIP's by address.
    assert set(plan.stale_udp) == {Stale("", 30053, X6), Stale("fd00:10:96::35", 53, X6)}
    assert {s.family for s in plan.stale_udp} == {IPV6}


def test_ipv6_rules_match_the_ipv6_sets_and_cidr() -> None:
    m = MasqueradeSettings(cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:10:244::/56")
    text6, text4 = restore_input(rule_edits(m, IPV6)), restore_input(rule_edits(m))
    sets6 = {line.split("--match-set ")[1].split()[0] for line in text6.splitlines() if "--match-set" in line}
    sets4 = {line.split("--match-set ")[1].split()[0] for line in text4.splitlines() if "--match-set" in line}
    assert sets6 == {set_name(name, IPV6) for name in sets4}
    assert "--match-set KUBE-6-CLUSTER-IP dst,dst ! -s fd00:10:244::/56 -j KUBE-MARK-MASQ" in text6
    assert "10.244.0.0/16" not in text6 and "fd00" not in text4
    for name in sets4:
        text6 = text6.replace(f" {set_name(name, IPV6)} ", f" {name} ")
    assert text6.replace("fd00:10:244::/56", "10.244.0.0/16") == text4
    assert all(is_mode_rule("nat", "KUBE-SERVICES", line) for line in text6.splitlines() if "--match-set" in line)


def test_ipv6_virtual_servers_carry_their_prefix_length() -> None:
    # The kernel refuses an IPv6 service without its netmask (a prefix length, 1..128); pyroute2 sets IPv4's only.
    calls: list[Any] = []

    class Recorder:
        def service(self, verb: str, service: Any) -> None:
            calls.append(service.combined)

    kernel.put_virtual(Recorder(), "add", WEB6_KEY, "rr", 0)  # type: ignore[arg-type]
    kernel.put_virtual(Recorder(), "add", WEB_KEY, "rr", 0)  # type: ignore[arg-type]
    import socket
    import struct
    assert struct.unpack("=I", socket.inet_aton(calls[0]["netmask"])) == (128,)
    assert "netmask" not in calls[1]  # pyroute2 gives IPv4 its 255.255.255.255
    assert kernel._create_options("KUBE-6-CLUSTER-IP", "hash:ip,port") == "family inet6"
    assert kernel._create_options("KUBE-CLUSTER-IP", "hash:ip,port") == "family inet"
    assert kernel._create_options("KUBE-6-NODE-PORT-TCP", "bitmap:port") == "range 0-65535"


def test_a_node_without_usable_ip6tables_is_served_ipv4_only_saying_so(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    import contextlib

    from pyproxy.dataplane import netfilter as nf
    from pyproxy.dataplane import netlink
    from pyproxy.dataplane.base import ModeUnavailable
    from pyproxy.dataplane.ipvs import backend
    from pyproxy.model.state import BOTH_FAMILIES, IPV4_ONLY

    class Socket:
        def close(self) -> None:
            pass

    def tools(flavour: str, family: int = 4) -> nf.Tools:
        if family == 6:
            raise ModeUnavailable("ip6tables-nft-save not found in PATH (install the iptables package)")
        return nf.Tools("nft", "iptables-nft-save", "iptables-nft-restore")

    for name in ("check_sysctls", "check_ipset", "write_sysctls"):
        monkeypatch.setattr(backend.kernel, name, lambda: None)
    monkeypatch.setattr(backend.kernel, "open_ipvs", Socket)
    monkeypatch.setattr(backend.nf, "tools", tools)
    monkeypatch.setattr(backend.nf, "check_usable", lambda t: None)
    monkeypatch.setattr(netlink, "rtnl", contextlib.nullcontext)
    monkeypatch.setattr(netlink, "host_addresses", lambda ipr, name: frozenset())
    dp = IpvsDataplane(IpvsSettings())
    assert dp.ip_families == BOTH_FAMILIES
    with caplog.at_level(logging.WARNING):
        dp.start()
    assert dp.ip_families == IPV4_ONLY and dp.tools6 is None
    assert [r.getMessage() for r in caplog.records] == [
        "ipvs mode serves IPv4 only: ip6tables-nft-save not found in PATH (install the iptables package)"]
