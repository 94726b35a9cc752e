"""The nftables renderer and listing parser: pure, no kernel.

Small desired states in, nft commands and the state after them out: full vs partial syncs, names that stay the
same from sync to sync, stale objects removed (and only those of the Services a partial sync was given),
conntrack flushes for UDP, and the deferred chain deletion of kernels before 6.2.
"""

from __future__ import annotations

import json

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.render import (
    Plan,
    affinity_set,
    endpoint_chain,
    external_chain,
    firewall_chain,
    fixed_chains,
    local_chain,
    render,
    service_chain,
)
from pyproxy.dataplane.nftables.table import (
    FIREWALL_IPS,
    NO_ENDPOINT_NODEPORTS,
    NO_ENDPOINT_SERVICES,
    SERVICE_IPS,
    SERVICE_NODEPORTS,
    Elem,
    Hook,
    TableState,
    endpoint_of,
    owner,
    parse_listing,
)
from pyproxy.model.conntrack import Stale
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

MASQ = MasqueradeSettings()
B1, B2, B3 = Backend("10.1.0.1", 8080), Backend("10.1.0.2", 8080), Backend("10.1.0.3", 8080)


def sp(service: str = "default/web", ip: str = "10.96.0.10", port: int = 80, proto: str = "TCP",
       backends: tuple[Backend, ...] = (B1, B2), known: tuple[Backend, ...] = (), affinity: int = 0,
       port_name: str = "http") -> ServicePortState:
    return ServicePortState(service, port_name, Frontend(ip, port, Protocol(proto)), backends,
                            known or backends, affinity)


def web(*backends: Backend, **kw: object) -> dict[str, tuple[ServicePortState, ...]]:
    return {"default/web": (sp(backends=backends, **kw),)}  # type: ignore[arg-type]


def dns(*backends: Backend, known: tuple[Backend, ...] = ()) -> dict[str, tuple[ServicePortState, ...]]:
    eps = tuple(Backend(b.ip, 5353) for b in backends)
    return {"default/dns": (sp("default/dns", "10.96.0.53", 53, "UDP", eps, known, port_name="dns"),)}


def full(state: TableState, services: dict, masq: MasqueradeSettings = MASQ, **kw: object) -> Plan:
    return render(state, services, masq, full=True, **kw)  # type: ignore[arg-type]


def partial(state: TableState, services: dict, **kw: object) -> Plan:
    return render(state, services, MASQ, full=False, **kw)  # type: ignore[arg-type]


def lines_with(plan: Plan, text: str) -> list[str]:
    return [c for c in plan.commands if text in c]


def rules_of(plan: Plan, chain: str) -> list[str]:
    """The rules the plan writes into `chain` (`add chain NAME { [hook spec;] rule; … }`), in order."""
    head = f"add chain ip pyproxy {chain} {{ "
    rules = []
    for c in plan.commands:
        if c.startswith(head):
            rules += [r for r in c[len(head):-1].split("; ") if r and not r.startswith(("type ", "policy "))]
    return rules


def elements_of(plan: Plan, map_name: str) -> list[str]:
    """The elements the plan adds to `map_name` (inside `add map NAME { …; elements = { … } }`)."""
    head = f"add map ip pyproxy {map_name} {{ "
    return [c.split("elements = { ", 1)[1][:-4] for c in plan.commands if c.startswith(head) and "elements" in c]


# ---------------------------------------------------------------------------------------------------- names


def test_names_are_upstreams_stable_and_carry_their_owner() -> None:
    s = sp()
    assert service_chain(s) == service_chain(sp())  # the same from sync to sync, process to process
    assert service_chain(s).startswith("service-") and service_chain(s).endswith("-default/web/tcp/http")
    assert len(service_chain(s).split("-", 2)[1]) == 8  # the hash
    assert endpoint_chain(s, B1).endswith("-default/web/tcp/http__10.1.0.1/8080")
    assert affinity_set(s, B1).startswith("affinity-")
    assert endpoint_chain(s, B1) != endpoint_chain(s, B2)
    assert endpoint_chain(s, B1) != endpoint_chain(sp(proto="UDP"), B1)
    for name in (service_chain(s), endpoint_chain(s, B1), affinity_set(s, B1)):
        assert owner(name) == "default/web"
    assert endpoint_of(endpoint_chain(s, B1)) == B1
    assert owner("services") is None and owner("service-endpoints-check") is None


def test_long_names_are_truncated_within_nfts_limit_and_stay_unique() -> None:
    long_ns, long_name = "n" * 63, "s" * 63
    a = sp(f"{long_ns}/{long_name}", port_name="p" * 15)
    chain = endpoint_chain(a, Backend("10.255.255.255", 65535))
    assert len(chain) <= 255
    assert owner(chain) == f"{long_ns}/{long_name}"


# ---------------------------------------------------------------------------------------------------- full sync


def test_full_sync_from_nothing_writes_the_base_and_a_service() -> None:
    plan = full(TableState(), web(B1, B2))
    cmds = plan.commands
    assert cmds[0].startswith("add table ip pyproxy")
    assert "add chain ip pyproxy nat-prerouting { type nat hook prerouting priority -100; policy accept; }" in cmds
    assert "add chain ip pyproxy filter-prerouting { type filter hook prerouting priority -110; policy accept; }" \
        in cmds
    assert rules_of(plan, "services") == ["ip daddr . meta l4proto . th dport vmap @service-ips",
                                          "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"]
    assert rules_of(plan, "filter-output") == ["ct state new jump firewall-check",
                                               "ct state new jump service-endpoints-check"]
    assert rules_of(plan, "mark-for-masquerade") == ["mark set mark or 0x00004000"]
    s = sp()
    svc, e1, e2 = service_chain(s), endpoint_chain(s, B1), endpoint_chain(s, B2)
    # A uniform pick without an anonymous map: the first endpoint with probability 1/2, else the second.
    assert rules_of(plan, svc) == [f"numgen random mod 2 0 goto {e1}", f"goto {e2}"]
    assert rules_of(plan, e1) == ["ip saddr 10.1.0.1 jump mark-for-masquerade",  # hairpin
                                  "meta l4proto tcp dnat to 10.1.0.1:8080"]
    assert elements_of(plan, SERVICE_IPS) == [f"10.96.0.10 . tcp . 80 : goto {svc}"]
    assert not lines_with(plan, "delete "), "nothing to delete in an empty table"
    # Chains exist before rules jump to them, and the element comes after its chain.
    assert cmds.index(lines_with(plan, f"add chain ip pyproxy {e1} ")[0]) < cmds.index(
        lines_with(plan, f"add chain ip pyproxy {svc} ")[0]) < cmds.index(lines_with(plan, "elements = ")[0])
    assert plan.state.elems(SERVICE_IPS) and set(plan.state.chains) >= {svc, e1, e2, "services"}
    assert plan.rule_count == 2 + 2 * 2 + sum(len(rules) for rules in fixed_chains(MASQ).values())


def test_nft_never_needs_to_list_the_table_to_add_things() -> None:
    """`add rule` and `add element` make nft fetch every chain of the table from the kernel first, which
    grows quadratically (2.5 s at 100,000 chains, for a one-Service sync): chains come with their rules,
    elements inside their map's declaration, all of a map's elements in one command."""
    many = {f"default/s{i}": (sp(f"default/s{i}", f"10.96.1.{i}", backends=(B1, B2, B3)),) for i in range(50)}
    plan = full(TableState(), {**many, **dns()})
    assert not [c for c in plan.commands if c.startswith(("add rule ", "add element "))]
    assert len(lines_with(plan, "elements = ")) == 2  # one per map
    assert len(elements_of(plan, SERVICE_IPS)[0].split(", ")) == 50
    # No literal map either: each would be an anonymous set, and thousands of those grow quadratically.
    assert not [r for c in plan.state.chains for r in rules_of(plan, c) if "vmap {" in r]
    changed = partial(plan.state, {"default/s7": (sp("default/s7", "10.96.1.7", backends=(B1, B2)),)})
    assert not [c for c in changed.commands if c.startswith(("add rule ", "add element "))]


def test_a_service_without_endpoints_is_rejected_by_map_element_only() -> None:
    plan = full(TableState(), dns())
    assert elements_of(plan, NO_ENDPOINT_SERVICES) == [
        '10.96.0.53 . udp . 53 comment "default/dns:dns" : goto reject-chain']
    assert elements_of(plan, SERVICE_IPS) == []
    assert not [c for c in plan.state.chains if owner(c)], "no chains for a Service without endpoints"
    # TCP gets a reset (ICMP errors are rate-limited per client), everything else ICMP port-unreachable.
    assert rules_of(plan, "reject-chain") == ["meta l4proto tcp reject with tcp reset", "reject"]


def test_masquerade_all_and_cluster_cidr() -> None:
    svc = service_chain(sp())
    every = full(TableState(), web(B1), MasqueradeSettings(masquerade_all=True))
    assert "ip daddr 10.96.0.10 tcp dport 80 jump mark-for-masquerade" in rules_of(every, svc)
    cidr = full(TableState(), web(B1), MasqueradeSettings(cluster_cidr="10.0.0.0/8", masquerade_bit=3))
    assert "ip daddr 10.96.0.10 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade" in rules_of(cidr, svc)
    assert rules_of(cidr, "masquerading")[0] == "mark and 0x00000008 == 0 return"


def test_client_ip_affinity_uses_a_timed_set_per_endpoint() -> None:
    s = sp(affinity=60)
    plan = full(TableState(), web(B1, B2, affinity=60))
    svc, e1, a1 = service_chain(s), endpoint_chain(s, B1), affinity_set(s, B1)
    assert f"add set ip pyproxy {a1} {{ type ipv4_addr; flags dynamic,timeout; timeout 60s; }}" in plan.commands
    svc_rules = rules_of(plan, svc)
    assert svc_rules[0] == f"ip saddr @{a1} goto {e1}"
    assert "numgen" in svc_rules[-2]  # affinity is checked before the random pick
    assert f"update @{a1} {{ ip saddr }}" in rules_of(plan, e1)
    # The set exists before the chain whose rules name it.
    assert plan.commands.index(lines_with(plan, f"add set ip pyproxy {a1}")[0]) < plan.commands.index(
        lines_with(plan, f"add chain ip pyproxy {e1} ")[0])
    assert plan.state.sets[a1] == 60


def test_full_sync_is_idempotent_and_touches_no_element_twice() -> None:
    first = full(TableState(), {**web(B1, B2), **dns(B1)})
    again = full(first.state, {**web(B1, B2), **dns(B1)})
    assert not lines_with(again, "element"), "elements already right are left alone"
    assert not lines_with(again, "delete "), again.commands
    assert again.state == first.state
    # Chains are rewritten whole: flushed and refilled in the same transaction.
    assert lines_with(again, f"flush chain ip pyproxy {service_chain(sp())}")


def test_full_sync_removes_what_nobody_wants_and_unknown_objects() -> None:
    first = full(TableState(), {**web(B1, B2), **dns(B1)})
    stale = TableState(present=True, chains={**first.state.chains, "old-chain": None},
                       sets={**first.state.sets, "old-set": None}, maps=first.state.maps | {"old-map"},
                       elements=first.state.elements, known=first.state.known)
    plan = full(stale, dns(B1))
    s = sp()
    for name in (service_chain(s), endpoint_chain(s, B1), endpoint_chain(s, B2), "old-chain"):
        assert f"flush chain ip pyproxy {name}" in plan.commands
        assert f"delete chain ip pyproxy {name}" in plan.commands
        assert name not in plan.state.chains
    assert "delete set ip pyproxy old-set" in plan.commands and "delete map ip pyproxy old-map" in plan.commands
    assert "delete element ip pyproxy service-ips { 10.96.0.10 . tcp . 80 }" in plan.commands
    # Deletes come last: after everything that pointed at the deleted objects was rewritten or removed.
    first_delete = min(i for i, c in enumerate(plan.commands) if c.startswith("delete chain"))
    assert all(not c.startswith(("add ", "flush ")) for c in plan.commands[first_delete:])
    assert plan.state.elems(SERVICE_IPS).keys() == {("10.96.0.53", "udp", 53)}
    assert "old-map" not in plan.state.maps


def test_a_base_chain_whose_hook_differs_is_replaced() -> None:
    first = full(TableState(), {})
    moved = TableState(present=True, chains={**first.state.chains, "nat-output": Hook("nat", "output", 0)},
                       maps=first.state.maps, elements=first.state.elements)
    cmds = full(moved, {}).commands
    i = cmds.index("delete chain ip pyproxy nat-output")
    assert cmds[i + 1] == "add chain ip pyproxy nat-output { type nat hook output priority -100; policy accept; }"
    assert "delete chain ip pyproxy nat-prerouting" not in cmds


# ---------------------------------------------------------------------------------------------------- partial


def test_partial_sync_touches_only_the_changed_service() -> None:
    first = full(TableState(), {**web(B1, B2, B3), **dns(B1)})
    plan = partial(first.state, web(B1, B2))
    assert not lines_with(plan, "dns"), "the unchanged Service is untouched"
    assert not lines_with(plan, "services ") and not lines_with(plan, "add table")
    gone = endpoint_chain(sp(), B3)
    assert plan.commands[-2:] == (f"flush chain ip pyproxy {gone}", f"delete chain ip pyproxy {gone}")
    assert not lines_with(plan, "element"), "the frontend still leads to the same service chain"
    assert rules_of(plan, service_chain(sp()))[0].startswith("numgen random mod 2 0 goto ")
    assert gone not in plan.state.chains and endpoint_chain(sp(), B1) in plan.state.chains
    assert plan.state.elems(SERVICE_IPS).keys() == first.state.elems(SERVICE_IPS).keys()


def test_partial_sync_of_a_removed_service_deletes_its_objects() -> None:
    first = full(TableState(), {**web(B1, B2, affinity=30), **dns(B1)})
    plan = partial(first.state, {"default/web": ()})
    assert "delete element ip pyproxy service-ips { 10.96.0.10 . tcp . 80 }" in plan.commands
    assert len(lines_with(plan, "delete chain")) == 3 and len(lines_with(plan, "delete set")) == 2
    assert not [c for c in plan.state.chains if owner(c) == "default/web"]
    assert not [s for s in plan.state.sets if owner(s) == "default/web"]
    assert [c for c in plan.state.chains if owner(c) == "default/dns"]


def test_a_frontend_moving_between_maps_is_deleted_from_one_and_added_to_the_other() -> None:
    first = full(TableState(), dns(B1))
    empty = partial(first.state, dns())
    assert "delete element ip pyproxy service-ips { 10.96.0.53 . udp . 53 }" in empty.commands
    assert elements_of(empty, NO_ENDPOINT_SERVICES)
    back = partial(empty.state, dns(B2))
    assert "delete element ip pyproxy no-endpoint-services { 10.96.0.53 . udp . 53 }" in back.commands
    assert elements_of(back, SERVICE_IPS)
    assert back.state.elems(NO_ENDPOINT_SERVICES) == {}


def test_a_changed_affinity_timeout_recreates_the_sets_after_their_users_are_flushed() -> None:
    first = full(TableState(), web(B1, affinity=60))
    plan = partial(first.state, web(B1, affinity=30))
    a1, e1 = affinity_set(sp(), B1), endpoint_chain(sp(), B1)
    cmds = list(plan.commands)
    assert cmds.index(f"flush chain ip pyproxy {e1}") < cmds.index(f"delete set ip pyproxy {a1}") \
        < cmds.index(f"add set ip pyproxy {a1} {{ type ipv4_addr; flags dynamic,timeout; timeout 30s; }}")
    assert plan.state.sets[a1] == 30
    # Unchanged, an existing set is left as it is (with the clients it remembers).
    assert not lines_with(partial(plan.state, web(B1, affinity=30)), " set ")


# ---------------------------------------------------------------------------------------------------- conntrack


def test_udp_flows_of_endpoints_that_left_are_flushed() -> None:
    first = full(TableState(), {**dns(B1, B2), **web(B1, B2)})
    plan = partial(first.state, {**dns(B1), **web(B1)})
    assert plan.stale_udp == (Stale("10.96.0.53", 53, Backend("10.1.0.2", 5353)),)
    assert nf.conntrack_filter(plan.stale_udp[0]) == ["-p", "udp", "--orig-dst", "10.96.0.53", "--orig-port-dst",
                                                      "53", "--dst-nat", "10.1.0.2", "--reply-port-src", "5353"]


def test_a_not_ready_but_known_endpoint_keeps_its_flows_until_it_leaves() -> None:
    b1, b2 = Backend("10.1.0.1", 5353), Backend("10.1.0.2", 5353)
    first = full(TableState(), dns(B1, B2))
    not_ready = partial(first.state, dns(B1, known=(b1, b2)))
    assert not_ready.stale_udp == ()
    left = partial(not_ready.state, dns(B1))
    assert left.stale_udp == (Stale("10.96.0.53", 53, b2),)


def test_a_udp_frontend_that_gets_its_first_endpoint_forgets_its_untranslated_flows() -> None:
    first = full(TableState(), dns())
    plan = partial(first.state, dns(B1))
    assert plan.stale_udp == (Stale("10.96.0.53", 53),)
    assert nf.conntrack_filter(Stale("10.96.0.53", 53))[-2:] == ["--reply-src", "10.96.0.53"]
    gone = partial(plan.state, {"default/dns": ()})
    assert gone.stale_udp == (Stale("10.96.0.53", 53, Backend("10.1.0.1", 5353)),)


# ---------------------------------------------------------------------------------------------------- kernels < 6.2


def test_deferred_deletes_flush_now_and_delete_on_a_later_sync() -> None:
    first = full(TableState(), web(B1, B2))
    gone = endpoint_chain(sp(), B2)
    plan = partial(first.state, web(B1), defer_deletes=True)
    assert f"flush chain ip pyproxy {gone}" in plan.commands and not lines_with(plan, "delete chain")
    assert plan.deferred == {gone} and gone in plan.state.chains
    too_soon = partial(plan.state, dns(B1), pending={gone: False}, defer_deletes=True)
    assert not lines_with(too_soon, gone) and too_soon.deferred == {gone}
    later = partial(too_soon.state, dns(B1), pending={gone: True}, defer_deletes=True)
    assert f"delete chain ip pyproxy {gone}" in later.commands and later.deferred == frozenset()
    assert f"flush chain ip pyproxy {gone}" not in later.commands  # it is empty already
    assert gone not in later.state.chains


def test_a_deferred_chain_wanted_again_is_reused() -> None:
    first = full(TableState(), web(B1, B2))
    gone = endpoint_chain(sp(), B2)
    plan = partial(first.state, web(B1), defer_deletes=True)
    back = partial(plan.state, web(B1, B2), pending={gone: True}, defer_deletes=True)
    assert f"delete chain ip pyproxy {gone}" not in back.commands and back.deferred == frozenset()
    assert "meta l4proto tcp dnat to 10.1.0.2:8080" in rules_of(back, gone)


# ---------------------------------------------------------------------------------------------------- listing


def _listing(plan: Plan) -> dict:
    """What `nft -j list table ip pyproxy` prints for a plan's state (the shapes nft 1.0.6 uses)."""
    items: list[dict] = [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "ip", "name": "pyproxy"}}]
    for name, hook in plan.state.chains.items():
        chain: dict[str, object] = {"family": "ip", "table": "pyproxy", "name": name}
        if hook:
            chain |= {"type": hook.type, "hook": hook.hook, "prio": hook.priority, "policy": "accept"}
        items.append({"chain": chain})
    for name, timeout in plan.state.sets.items():
        items.append({"set": {"name": name, "type": "ipv4_addr", "flags": ["timeout"], "timeout": timeout}})
    for m in plan.state.maps:
        elems = []
        for (ip, proto, port), e in plan.state.elems(m).items():
            key: dict = {"concat": [ip, proto, port]}
            if e.comment:
                key = {"elem": {"val": key, "comment": e.comment}}
            kind, target = e.verdict.split(" ", 1)
            elems.append([key, {kind: {"target": target}}])
        items.append({"map": {"name": m, "type": ["ipv4_addr", "inet_proto", "inet_service"], "map": "verdict",
                              "elem": elems}})
    items.append({"rule": {"chain": "services", "expr": []}})
    return {"nftables": items}


def test_a_listing_parses_back_into_the_state_a_plan_left() -> None:
    plan = full(TableState(), {**web(B1, B2, affinity=10), **dns(), **dns(B3)})
    parsed = parse_listing(json.loads(json.dumps(_listing(plan))))
    assert parsed == plan.state
    # Read back, a restarted pyproxy plans nothing for elements or deletions when nothing changed.
    again = full(parsed, {**web(B1, B2, affinity=10), **dns(B3)})
    assert not lines_with(again, "element") and not lines_with(again, "delete ")


def test_an_absent_table_and_foreign_elements() -> None:
    assert parse_listing({"nftables": [{"metainfo": {}}]}) == TableState()
    weird = {"nftables": [{"table": {}}, {"map": {"name": SERVICE_IPS, "elem": [["10.0.0.1", {"accept": None}]]}}]}
    assert parse_listing(weird).elems(SERVICE_IPS) == {}


def test_family_wide_listings_count_only_pyproxys_table() -> None:
    """read_table() lists chains, sets and maps of the whole `ip` family (not `list table`, which would list
    every rule): objects of other tables, e.g. iptables-nft's `nat`, are not ours."""
    plan = full(TableState(), web(B1, B2))
    ours = _listing(plan)["nftables"]
    foreign = [{"table": {"family": "ip", "name": "nat"}},
               {"chain": {"family": "ip", "table": "nat", "name": "KUBE-SERVICES"}},
               {"set": {"family": "ip", "table": "nat", "name": "other-set"}},
               {"map": {"family": "ip", "table": "nat", "name": SERVICE_IPS, "elem": []}}]
    parsed = parse_listing({"nftables": [*foreign, *ours]})
    assert parsed == plan.state


def test_lazy_deletes_keep_a_sync_that_only_adds_free_of_deletes() -> None:
    """Any delete makes nft list every chain first (seconds at 100,000 chains): a partial sync that deletes
    nothing else flushes the endpoint chain it no longer wants and leaves deleting it for later."""
    first = full(TableState(), {**web(B1, B2), **dns(B1)})
    gone = endpoint_chain(sp(), B2)
    plan = partial(first.state, web(B1), lazy_deletes=True)
    assert not lines_with(plan, "delete ") and f"flush chain ip pyproxy {gone}" in plan.commands
    assert plan.deferred == {gone}
    # Still deferred on the next small sync, even when old enough; gone with the next sync that deletes anyway.
    small = partial(plan.state, dns(B1, B2), pending={gone: True}, lazy_deletes=True)
    assert not lines_with(small, "delete ") and small.deferred == {gone}
    removal = partial(small.state, {"default/dns": ()}, pending={gone: True}, lazy_deletes=True)
    assert f"delete chain ip pyproxy {gone}" in removal.commands and removal.deferred == frozenset()
    assert f"delete chain ip pyproxy {gone}" in full(plan.state, web(B1), pending={gone: True}).commands


# ------------------------------------------------------------------------- NodePort, ExternalIP, LoadBalancer

NODE_IPS = ("10.0.0.5", "192.168.1.5")


def ext(kind: FrontendKind, ip: str, port: int = 80, backends: tuple[Backend, ...] = (B1, B2),
        external: tuple[Backend, ...] | None = None, local: bool = False, ranges: tuple[str, ...] = (),
        service: str = "default/web", proto: str = "TCP") -> ServicePortState:
    """An external frontend of default/web's http port: externalTrafficPolicy Cluster (masquerade, every
    endpoint), or Local (`local`: `external`, this node's endpoints, and no masquerade)."""
    return ServicePortState(service, "http", Frontend(ip, port, Protocol(proto)), backends, backends, 0, kind,
                            backends if external is None else external, not local, ranges)


def web_all(*extra: ServicePortState,
            backends: tuple[Backend, ...] = (B1, B2)) -> dict[str, tuple[ServicePortState, ...]]:
    return {"default/web": (sp(backends=backends), *extra)}


def test_external_ip_and_load_balancer_ip_go_through_the_external_chain_which_masquerades() -> None:
    plan = full(TableState(), web_all(ext(FrontendKind.EXTERNAL_IP, "192.0.2.10"),
                                      ext(FrontendKind.LOAD_BALANCER, "203.0.113.10")), nodeport_ips=NODE_IPS)
    s = sp()
    svc, extc = service_chain(s), external_chain(s)
    assert sorted(elements_of(plan, SERVICE_IPS)[0].split(", ")) == [
        f"10.96.0.10 . tcp . 80 : goto {svc}", f"192.0.2.10 . tcp . 80 : goto {extc}",
        f"203.0.113.10 . tcp . 80 : goto {extc}"]
    # externalTrafficPolicy Cluster: every new flow is SNATed, so replies from another node's endpoint come back.
    assert rules_of(plan, extc) == ["jump mark-for-masquerade", f"goto {svc}"]
    assert rules_of(plan, svc) == [f"numgen random mod 2 0 goto {endpoint_chain(s, B1)}",
                                   f"goto {endpoint_chain(s, B2)}"]
    assert owner(extc) == "default/web"
    assert plan.commands.index(lines_with(plan, f"add chain ip pyproxy {svc} ")[0]) < plan.commands.index(
        lines_with(plan, f"add chain ip pyproxy {extc} ")[0]), "the service chain exists before the jump to it"


def test_node_ports_are_one_element_per_protocol_and_port_on_the_nodeport_ips() -> None:
    frontends = [ext(FrontendKind.NODE_PORT, ip, 30080) for ip in NODE_IPS]
    plan = full(TableState(), web_all(*frontends), nodeport_ips=NODE_IPS)
    assert elements_of(plan, SERVICE_NODEPORTS) == [f"tcp . 30080 : goto {external_chain(sp())}"]
    assert ('add set ip pyproxy nodeport-ips { type ipv4_addr; comment "IPs that accept NodePort traffic"; '
            'elements = { 10.0.0.5, 192.168.1.5 } }') in plan.commands
    assert plan.state.nodeport_ips == frozenset(NODE_IPS)
    assert rules_of(plan, "service-endpoints-check")[1] == (
        "ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports")
    # A partial sync leaves the set alone while the addresses stay, and rewrites it when they change.
    same = partial(plan.state, web_all(*frontends), nodeport_ips=NODE_IPS)
    assert not lines_with(same, "nodeport-ips")
    moved = partial(plan.state, {}, nodeport_ips=("10.0.0.6",))
    assert lines_with(moved, "flush set ip pyproxy nodeport-ips") and lines_with(moved, "elements = { 10.0.0.6 }")
    assert moved.state.nodeport_ips == {"10.0.0.6"}
    gone = partial(plan.state, {"default/web": ()}, nodeport_ips=NODE_IPS)
    assert "delete element ip pyproxy service-nodeports { tcp . 30080 }" in gone.commands


def test_without_endpoints_every_frontend_is_rejected() -> None:
    none = ()
    plan = full(TableState(), web_all(ext(FrontendKind.NODE_PORT, NODE_IPS[0], 30080, backends=none),
                                      ext(FrontendKind.EXTERNAL_IP, "192.0.2.10", backends=none), backends=none),
                nodeport_ips=NODE_IPS)
    assert elements_of(plan, NO_ENDPOINT_NODEPORTS) == ['tcp . 30080 comment "default/web:http" : goto reject-chain']
    assert sorted(elements_of(plan, NO_ENDPOINT_SERVICES)[0].split(", ")) == [
        '10.96.0.10 . tcp . 80 comment "default/web:http" : goto reject-chain',
        '192.0.2.10 . tcp . 80 comment "default/web:http" : goto reject-chain']
    assert not [c for c in plan.state.chains if owner(c)]


def test_local_policy_uses_this_nodes_endpoints_and_short_circuits_pods_and_the_node() -> None:
    s = sp(backends=(B1, B2, B3))
    frontend = ext(FrontendKind.NODE_PORT, NODE_IPS[0], 30080, backends=(B1, B2, B3), external=(B2,), local=True)
    cidr = MasqueradeSettings(cluster_cidr="10.244.0.0/16")
    plan = full(TableState(), web_all(frontend, backends=(B1, B2, B3)), cidr, nodeport_ips=NODE_IPS)
    svc, extc, loc = service_chain(s), external_chain(s), local_chain(s)
    assert rules_of(plan, extc) == [
        f"ip saddr 10.244.0.0/16 goto {svc}",  # pods: every endpoint, their own address kept
        "fib saddr type local jump mark-for-masquerade",  # the node: every endpoint, masqueraded
        f"fib saddr type local goto {svc}",
        f"goto {loc}"]  # the rest (outside the cluster): this node's endpoints, the client's address kept
    assert rules_of(plan, loc) == [f"goto {endpoint_chain(s, B2)}"]
    # Without --cluster-cidr nothing is known to be a pod: no short circuit.
    bare = full(TableState(), web_all(frontend, backends=(B1, B2, B3)), nodeport_ips=NODE_IPS)
    assert not [r for r in rules_of(bare, extc) if "saddr 10.244" in r]
    # All endpoints local: the service chain serves both.
    every = ext(FrontendKind.NODE_PORT, NODE_IPS[0], 30080, external=(B1, B2), local=True)
    assert rules_of(full(TableState(), web_all(every)), extc)[-1] == f"goto {svc}"


def test_local_policy_without_a_local_endpoint_drops_outside_traffic_only() -> None:
    frontend = ext(FrontendKind.LOAD_BALANCER, "203.0.113.10", external=(), local=True)
    plan = full(TableState(), web_all(frontend), MasqueradeSettings(cluster_cidr="10.244.0.0/16"))
    extc = external_chain(sp())
    assert rules_of(plan, extc)[-1] == "drop"
    assert rules_of(plan, extc)[0].startswith("ip saddr 10.244.0.0/16 goto ")  # pods are still served
    assert elements_of(plan, NO_ENDPOINT_SERVICES) == [], "not rejected: the cluster has endpoints"
    assert f"203.0.113.10 . tcp . 80 : goto {extc}" in elements_of(plan, SERVICE_IPS)[0]


def test_source_ranges_drop_other_sources_on_load_balancer_ips_only() -> None:
    ranges = ("198.51.100.0/24", "203.0.113.10/32")
    plan = full(TableState(), web_all(ext(FrontendKind.LOAD_BALANCER, "203.0.113.10", ranges=ranges),
                                      ext(FrontendKind.NODE_PORT, NODE_IPS[0], 30080)), nodeport_ips=NODE_IPS)
    fw = firewall_chain(sp())
    assert elements_of(plan, FIREWALL_IPS) == [f"203.0.113.10 . tcp . 80 : goto {fw}"]
    assert rules_of(plan, fw) == ["ip saddr != { 198.51.100.0/24, 203.0.113.10/32 } drop"]
    assert rules_of(plan, "filter-prerouting") == ["ct state new jump firewall-check",
                                                   "ct state new jump service-endpoints-check"]
    assert owner(fw) == "default/web"
    # The firewall holds also while the Service has no endpoints (upstream: the drop comes before the reject).
    empty = full(TableState(), web_all(ext(FrontendKind.LOAD_BALANCER, "203.0.113.10", backends=(), ranges=ranges),
                                       backends=()))
    assert elements_of(empty, FIREWALL_IPS) == [f"203.0.113.10 . tcp . 80 : goto {fw}"]
    gone = partial(plan.state, {"default/web": ()}, nodeport_ips=NODE_IPS)
    assert "delete element ip pyproxy firewall-ips { 203.0.113.10 . tcp . 80 }" in gone.commands
    assert f"flush chain ip pyproxy {fw}" in gone.commands


def test_a_listing_with_node_ports_parses_back() -> None:
    listing = {"nftables": [
        {"table": {"family": "ip", "name": "pyproxy"}},
        {"set": {"family": "ip", "table": "pyproxy", "name": "nodeport-ips", "type": "ipv4_addr",
                 "elem": ["10.0.0.5", "192.168.1.5"]}},
        {"map": {"family": "ip", "table": "pyproxy", "name": "service-nodeports",
                 "type": ["inet_proto", "inet_service"], "map": "verdict",
                 "elem": [[{"concat": ["tcp", 30080]}, {"goto": {"target": "external-X"}}]]}},
    ]}
    state = parse_listing(listing)
    assert state.nodeport_ips == frozenset(NODE_IPS)
    assert state.elems(SERVICE_NODEPORTS) == {("", "tcp", 30080): Elem("goto external-X")}


def test_udp_node_port_flows_of_endpoints_that_left_are_flushed_by_port() -> None:
    e1, e2 = Backend("10.1.0.1", 5353), Backend("10.1.0.2", 5353)
    dns_np = {"default/dns": (ext(FrontendKind.NODE_PORT, NODE_IPS[0], 30053, backends=(e1, e2), proto="UDP",
                                  service="default/dns"),)}
    first = full(TableState(), dns_np, nodeport_ips=NODE_IPS)
    assert Stale(NODE_IPS[0], 30053) in first.stale_udp, "a NodePort that just got endpoints forgets older flows"
    fewer = {"default/dns": (ext(FrontendKind.NODE_PORT, NODE_IPS[0], 30053, backends=(e1,), proto="UDP",
                                 service="default/dns"),)}
    plan = partial(first.state, fewer, nodeport_ips=NODE_IPS)
    assert plan.stale_udp == (Stale("", 30053, e2),)
    assert nf.conntrack_filter(plan.stale_udp[0]) == ["-p", "udp", "--orig-port-dst", "30053",
                                                      "--dst-nat", "10.1.0.2", "--reply-port-src", "5353"]


# ---------------------------------------------------------------------------------------------------- IPv6


V6_B1, V6_B2 = Backend("fd00:244::1", 8080), Backend("fd00:244::1:2", 8080)


def rules6(plan: Plan, chain: str) -> list[str]:
    head = f"add chain ip6 pyproxy {chain} {{ "
    return [r for c in plan.commands if c.startswith(head)
            for r in c[len(head):-1].split("; ") if r and not r.startswith(("type ", "policy "))]


def test_ipv6_frontends_render_upstreams_rules_in_the_ip6_table() -> None:
    s = sp(ip="fd00::10", backends=(V6_B1, V6_B2), affinity=60)
    masq = MasqueradeSettings(cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:244::/56")
    plan = render(TableState(), {"default/web": (s,)}, masq, full=True, nodeport_ips=["fd00:1::5"], family=6)
    assert all(c.split()[2:4] == ["ip6", "pyproxy"] or c.startswith("add table ip6 pyproxy") for c in plan.commands)
    assert rules6(plan, "services") == ["ip6 daddr . meta l4proto . th dport vmap @service-ips",
                                        "ip6 daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"]
    # Rejects: a TCP reset, else nft's default for ip6, ICMPv6 port unreachable.
    assert rules6(plan, "reject-chain") == ["meta l4proto tcp reject with tcp reset", "reject"]
    assert any("type ipv6_addr . inet_proto . inet_service : verdict" in c for c in plan.commands)
    assert any("nodeport-ips { type ipv6_addr;" in c and "elements = { fd00:1::5 }" in c for c in plan.commands)
    # Chain names write the address's colons as dots (nft names hold no colon), and read back.
    e1 = endpoint_chain(s, V6_B1)
    assert e1.endswith("-default/web/tcp/http__fd00.244..1/8080") and endpoint_of(e1) == V6_B1
    assert endpoint_of(endpoint_chain(s, V6_B2)) == V6_B2
    assert rules6(plan, e1) == ["ip6 saddr fd00:244::1 jump mark-for-masquerade",
                                f"update @{affinity_set(s, V6_B1)} {{ ip6 saddr }}",
                                "meta l4proto tcp dnat to [fd00:244::1]:8080"]
    assert rules6(plan, service_chain(s))[0] == ("ip6 daddr fd00::10 tcp dport 80 ip6 saddr != fd00:244::/56 "
                                                 "jump mark-for-masquerade")
    assert f"add set ip6 pyproxy {affinity_set(s, V6_B1)} {{ type ipv6_addr; flags dynamic,timeout; timeout 60s; }}" \
        in plan.commands


def test_ipv6_source_ranges_and_local_short_circuit_use_the_ipv6_cluster_cidr() -> None:
    lb = ServicePortState("default/web", "http", Frontend("2001:db8::11", 80, Protocol.TCP), (V6_B1, V6_B2),
                          (V6_B1, V6_B2), kind=FrontendKind.LOAD_BALANCER, external_backends=(V6_B1,),
                          source_ranges=("2001:db8:1::/48",))
    masq = MasqueradeSettings(cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:244::/56")
    plan = render(TableState(), {"default/web": (lb,)}, masq, full=True, family=6)
    assert rules6(plan, firewall_chain(lb)) == ["ip6 saddr != { 2001:db8:1::/48 } drop"]
    assert rules6(plan, external_chain(lb))[0] == f"ip6 saddr fd00:244::/56 goto {service_chain(lb)}"


def test_ipv6_udp_flows_of_a_gone_endpoint_are_cleared_with_conntracks_ipv6_family() -> None:
    e1, e2 = Backend("fd00:244::1", 5353), Backend("fd00:244::2", 5353)
    udp = sp("default/dns", "fd00::53", 53, "UDP", (e1, e2), port_name="dns")
    first = render(TableState(), {"default/dns": (udp,)}, MASQ, full=True, family=6)
    gone = render(first.state, {"default/dns": (sp("default/dns", "fd00::53", 53, "UDP", (e2,), port_name="dns"),)},
                  MASQ, full=False, family=6)
    assert gone.stale_udp == (Stale("fd00::53", 53, e1),)
    assert nf.conntrack_filter(gone.stale_udp[0])[:2] == ["-f", "ipv6"]
    assert nf.conntrack_filter(Stale("10.96.0.53", 53, B1))[0] == "-p"
