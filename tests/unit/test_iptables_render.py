"""render() of the iptables mode and the shared netfilter helpers, checked without a kernel.

Chain names are pinned to values upstream kube-proxy produces (its own test vectors, and a kind cluster's
iptables-save for an unnamed port), so a node moving between kube-proxy and pyproxy keeps its chain names.
One full sync is pinned line by line; the other tests check what partial and full syncs touch and remove.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.iptables.render import (
    AppliedService,
    Plan,
    ext_chain,
    fw_chain,
    is_mode_chain,
    is_mode_rule,
    probability,
    render,
    sep_chain,
    svc_chain,
    svl_chain,
)
from pyproxy.model.conntrack import Stale, stale_udp_states
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, DesiredState, Frontend, FrontendKind, ServicePortState

A, B, C = (Backend(f"10.180.0.{i}", 80) for i in (1, 2, 3))
NO_MASQ = nf.MasqueradeSettings()
EVERY_SERVICES = {"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-EXTERNAL-SERVICES", "KUBE-PROXY-FIREWALL"}
"""The chains holding every Service's rules, which each sync rewrites whole (KUBE-NODEPORTS: in nat and filter)."""


def port(service: str, ip: str, number: int, backends: Iterable[Backend], *, name: str = "",
         protocol: Protocol = Protocol.TCP, affinity: int = 0, not_ready: Iterable[Backend] = ()) -> ServicePortState:
    ready = tuple(sorted(backends))
    return ServicePortState(service, name, Frontend(ip, number, protocol), ready,
                            tuple(sorted(set(ready) | set(not_ready))), affinity)


def svc1(*backends: Backend, affinity: int = 0) -> ServicePortState:
    return port("ns1/svc1", "172.30.0.41", 80, backends, name="p80", affinity=affinity)


def svc2(*backends: Backend) -> ServicePortState:
    return port("ns2/svc2", "172.30.0.42", 80, backends)


def dns(*backends: Backend, not_ready: Iterable[Backend] = ()) -> ServicePortState:
    return port("kube-system/kube-dns", "10.96.0.10", 53, backends, name="dns", protocol=Protocol.UDP,
                not_ready=not_ready)


def state(*ports: ServicePortState, node: NodeInputs | None = None) -> DesiredState:
    services: dict[str, tuple[ServicePortState, ...]] = {}
    for sp in ports:
        services[sp.service] = (*services.get(sp.service, ()), sp)
    return DesiredState(services, node=node or NodeInputs())


def saved_from(plan: Plan) -> dict[str, nf.SavedTable]:
    """What iptables-save would show after `plan` ran on empty tables (enough for chain bookkeeping)."""
    tables = {t: nf.SavedTable({c: [] for c in nf.BUILTIN_CHAINS}) for t in nf.TABLES}
    table = ""
    for line in plan.text.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":"):
            tables[table].chains.setdefault(line[1:].split()[0], [])
        elif line.startswith(("-A ", "-I ")):
            words = line.split(" ", 2)
            body = words[2].split(" ", 1)[1] if line.startswith("-I ") else words[2]
            tables[table].chains.setdefault(words[1], []).append(body)
        elif line.startswith("-X "):
            del tables[table].chains[line[3:]]
    return tables


def full(desired: DesiredState, applied: dict[str, AppliedService] | None = None,
         saved: dict[str, nf.SavedTable] | None = None, m: nf.MasqueradeSettings = NO_MASQ) -> Plan:
    return render(desired, None, applied or {}, m, saved if saved is not None else {})


def declared(plan: Plan) -> set[str]:
    return {line[1:].split()[0] for line in plan.text.splitlines() if line.startswith(":")}


def deleted(plan: Plan) -> list[str]:
    return [line[3:] for line in plan.text.splitlines() if line.startswith("-X ")]


# ---------------------------------------------------------------------------------------------- naming


def test_chain_names_are_upstreams() -> None:
    assert svc_chain(svc1(A)) == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert sep_chain(svc1(A), A) == "KUBE-SEP-SXIVWICOYRO3J4NJ"
    kubernetes = port("default/kubernetes", "10.96.0.1", 443, [A], name="https")
    assert svc_chain(kubernetes) == "KUBE-SVC-NPX46M4PTMTKRN6Y"
    assert svc_chain(dns(A)) == "KUBE-SVC-TCOU7JCQXEZGVUNU"  # the protocol is part of the hash, lowercased


def test_an_unnamed_port_hashes_without_a_colon() -> None:
    # Upstream's ServicePortName.String() is "ns/name" for an unnamed port (a kind cluster's iptables-save).
    unnamed = port("default/test-svc", "10.96.115.88", 80, [Backend("10.244.1.3", 80)])
    assert svc_chain(unnamed) == "KUBE-SVC-QKNQQNIN727HO3XU"
    assert sep_chain(unnamed, Backend("10.244.1.3", 80)) == "KUBE-SEP-SQEBHSRBMT4ZUBXZ"


def test_probabilities_have_ten_decimals() -> None:
    assert [probability(n) for n in (3, 2)] == ["0.3333333333", "0.5000000000"]


# ------------------------------------------------------------------------------------------- full sync


def test_full_sync_on_empty_tables() -> None:
    plan = full(state(svc1(A, B), svc2()))
    sep_a, sep_b = "KUBE-SEP-SXIVWICOYRO3J4NJ", "KUBE-SEP-LXVODXWDISEETFEF"
    svc = "KUBE-SVC-XPGD46QRK7WJZT7O"
    match = "-m tcp -p tcp -d 172.30.0.41/32 --dport 80"
    assert plan.text.splitlines() == [
        "*nat",
        f":{svc} - [0:0]",
        f":{sep_a} - [0:0]",
        f":{sep_b} - [0:0]",
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-NODEPORTS - [0:0]",
        ":KUBE-MARK-MASQ - [0:0]",
        ":KUBE-POSTROUTING - [0:0]",
        '-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
        '-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        f'-A {svc} -m comment --comment "ns1/svc1:p80" -m statistic --mode random --probability 0.5000000000 '
        f"-j {sep_a}",
        f'-A {svc} -m comment --comment "ns1/svc1:p80" -j {sep_b}',
        f'-A {sep_a} -m comment --comment "ns1/svc1:p80" -s 10.180.0.1/32 -j KUBE-MARK-MASQ',
        f'-A {sep_a} -m comment --comment "ns1/svc1:p80" -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80',
        f'-A {sep_b} -m comment --comment "ns1/svc1:p80" -s 10.180.0.2/32 -j KUBE-MARK-MASQ',
        f'-A {sep_b} -m comment --comment "ns1/svc1:p80" -m tcp -p tcp -j DNAT --to-destination 10.180.0.2:80',
        f'-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" {match} -j {svc}',
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE '
        "--random-fully",
        "COMMIT",
        "*filter",
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-EXTERNAL-SERVICES - [0:0]",
        ":KUBE-PROXY-FIREWALL - [0:0]",
        ":KUBE-NODEPORTS - [0:0]",
        ":KUBE-FORWARD - [0:0]",
        '-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" '
        "-j KUBE-EXTERNAL-SERVICES",
        '-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" '
        "-j KUBE-EXTERNAL-SERVICES",
        '-I INPUT 1 -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS',
        '-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I OUTPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD',
        *(f'-I {chain} 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" '
          "-j KUBE-PROXY-FIREWALL" for chain in ("INPUT", "OUTPUT", "FORWARD")),
        '-A KUBE-SERVICES -m comment --comment "ns2/svc2 has no endpoints" -m tcp -p tcp -d 172.30.0.42/32 '
        "--dport 80 -j REJECT --reject-with tcp-reset",
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT',
        "COMMIT",
    ]
    assert plan.applied == {"ns1/svc1": AppliedService((svc1(A, B),), frozenset({svc, sep_a, sep_b})),
                            "ns2/svc2": AppliedService((svc2(),), frozenset())}
    assert (plan.written, plan.removed) == (12, 0)


def test_jumps_already_there_are_not_added_again() -> None:
    desired = state(svc1(A))
    first = full(desired)
    second = full(desired, first.applied, saved_from(first))
    assert "-I " not in second.text
    assert not deleted(second)


def test_a_jump_someone_removed_comes_back_alone() -> None:
    desired = state(svc1(A))
    first = full(desired)
    saved = saved_from(first)
    saved["nat"].chains["OUTPUT"] = []
    inserted = [line for line in full(desired, first.applied, saved).text.splitlines() if line.startswith("-I ")]
    assert inserted == ['-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES']


def test_full_sync_removes_chains_of_ours_nobody_wants_and_nothing_else() -> None:
    saved = {"nat": nf.SavedTable({"PREROUTING": [], "KUBE-SVC-AAAAAAAAAAAAAAAA": ["-j KUBE-SEP-BBBBBBBBBBBBBBBB"],
                                   "KUBE-SEP-BBBBBBBBBBBBBBBB": [], "DOCKER": [], "KUBE-KUBELET-CANARY": []}),
             "filter": nf.SavedTable({"INPUT": []})}
    plan = full(state(svc1(A)), saved=saved)
    assert deleted(plan) == ["KUBE-SEP-BBBBBBBBBBBBBBBB", "KUBE-SVC-AAAAAAAAAAAAAAAA"]
    assert plan.text.index("-X KUBE-SEP") > plan.text.index("-A KUBE-SERVICES")
    assert "DOCKER" not in plan.text and "CANARY" not in plan.text


def test_full_sync_trusts_iptables_save_not_applied() -> None:
    # After a failed restore, `applied` may name chains the kernel never got: a full sync must not -X them.
    ghost = {"ns1/svc1": AppliedService((svc1(A, B),), frozenset({"KUBE-SEP-NEVERMADEXXXXXX"}))}
    plan = full(state(svc1(A)), applied=ghost, saved={"nat": nf.SavedTable(), "filter": nf.SavedTable()})
    assert deleted(plan) == []


# ----------------------------------------------------------------------------------------- partial sync


def test_partial_sync_writes_only_the_changed_service_and_kube_services() -> None:
    before = full(state(svc1(A), svc2(B)))
    plan = render(state(svc1(A, B), svc2(B)), {"ns1/svc1"}, before.applied, NO_MASQ)
    assert declared(plan) == {svc_chain(svc1(A)), sep_chain(svc1(A), A), sep_chain(svc1(A), B), *EVERY_SERVICES}
    assert "-I " not in plan.text and "KUBE-POSTROUTING" not in plan.text
    # KUBE-SERVICES is rewritten whole: the unchanged Service keeps its jump.
    assert f"-j {svc_chain(svc2(B))}" in plan.text
    assert plan.applied["ns2/svc2"] == before.applied["ns2/svc2"]


def test_partial_sync_deletes_the_chain_of_an_endpoint_that_left() -> None:
    before = full(state(svc1(A, B, C)))
    plan = render(state(svc1(A, C)), {"ns1/svc1"}, before.applied, NO_MASQ)
    assert deleted(plan) == [sep_chain(svc1(A), B)]
    assert plan.text.index(f"-X {sep_chain(svc1(A), B)}") > plan.text.rindex(f"-A {svc_chain(svc1(A))}")
    assert plan.applied["ns1/svc1"].chains == {svc_chain(svc1(A)), sep_chain(svc1(A), A), sep_chain(svc1(A), C)}


def test_partial_sync_deletes_every_chain_of_a_service_that_went() -> None:
    before = full(state(svc1(A, B), svc2(C)))
    plan = render(state(svc2(C)), {"ns1/svc1"}, before.applied, NO_MASQ)
    assert set(deleted(plan)) == set(before.applied["ns1/svc1"].chains)
    assert "ns1/svc1" not in plan.applied
    assert not [line for line in plan.text.splitlines() if line.startswith("-A ") and "ns1/svc1" in line]


def test_a_service_losing_its_endpoints_rejects_instead() -> None:
    before = full(state(svc1(A)))
    plan = render(state(svc1()), {"ns1/svc1"}, before.applied, NO_MASQ)
    assert set(deleted(plan)) == {svc_chain(svc1(A)), sep_chain(svc1(A), A)}
    assert '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints"' in plan.text


def test_full_sync_needs_iptables_save() -> None:
    with pytest.raises(ValueError, match="iptables-save"):
        render(state(svc1(A)), None, {}, NO_MASQ)


# ------------------------------------------------------------------------------------- rule semantics


def test_session_affinity_checks_then_records_the_client() -> None:
    plan = full(state(svc1(A, B, affinity=10800)))
    sep_a, sep_b = sep_chain(svc1(A), A), sep_chain(svc1(A), B)
    svc_rules = [line for line in plan.text.splitlines() if line.startswith(f"-A {svc_chain(svc1(A))}")]
    assert [r.split('" ', 1)[1] for r in svc_rules] == [
        f"-m recent --name {sep_a} --rcheck --seconds 10800 --reap -j {sep_a}",
        f"-m recent --name {sep_b} --rcheck --seconds 10800 --reap -j {sep_b}",
        f"-m statistic --mode random --probability 0.5000000000 -j {sep_a}",
        f"-j {sep_b}",
    ]
    assert f"-m recent --name {sep_a} --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80" in plan.text


@pytest.mark.parametrize(("m", "expected"), [
    (nf.MasqueradeSettings(), None),
    (nf.MasqueradeSettings(masquerade_all=True), "--dport 80 -j KUBE-MARK-MASQ"),
    (nf.MasqueradeSettings(cluster_cidr="10.244.0.0/16"), "--dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"),
], ids=["none", "all", "cluster-cidr"])
def test_clusterip_masquerade_follows_the_settings(m: nf.MasqueradeSettings, expected: str | None) -> None:
    rules = [line for line in full(state(svc1(A)), m=m).text.splitlines()
             if line.startswith("-A KUBE-SERVICES") and "KUBE-MARK-MASQ" in line]
    assert [r.split("172.30.0.41/32 ")[1] for r in rules] == ([expected] if expected else [])


def test_masquerade_bit_sets_the_mark() -> None:
    text = full(state(svc1(A)), m=nf.MasqueradeSettings(masquerade_bit=3)).text
    assert "-A KUBE-MARK-MASQ -j MARK --or-mark 0x8\n" in text
    with pytest.raises(ValueError, match="0..31"):
        nf.mark(nf.MasqueradeSettings(masquerade_bit=32))


def test_udp_and_sctp_match_their_protocol() -> None:
    sctp = port("ns/s", "10.96.0.9", 9, [A], protocol=Protocol.SCTP)
    text = full(state(dns(A), sctp)).text
    assert "-m udp -p udp -d 10.96.0.10/32 --dport 53" in text
    assert "-m sctp -p sctp -j DNAT --to-destination 10.180.0.1:80" in text


def test_tcp_is_refused_with_a_reset_and_udp_with_icmp() -> None:
    rejects = [line for line in full(state(svc2(), dns())).text.splitlines() if "-j REJECT" in line]
    assert [line.split("-j ")[1] for line in rejects] == ["REJECT", "REJECT --reject-with tcp-reset"]


# ---------------------------------------------------------------------------------------------- conntrack


# The planner's cases are tests/unit/test_conntrack_plan.py's; here: render() hands its plan on.


def test_render_collects_the_flushes_of_the_changed_services() -> None:
    before = full(state(dns(A, B)))
    plan = render(state(dns(A)), {"kube-system/kube-dns"}, before.applied, NO_MASQ)
    assert plan.stale_udp == (Stale("10.96.0.10", 53, B),)


def test_the_first_sync_after_a_start_clears_no_endpoint_flows() -> None:
    """Nothing applied yet (a restart adopting the previous run's rules): only never-DNATed entries go."""
    plan = full(state(dns(A, B)))
    assert plan.stale_udp == (Stale("10.96.0.10", 53),)


# ------------------------------------------------------------------------------------ netfilter helpers


SAVE = """# Generated by iptables-save v1.8.9
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "default/kubernetes:https" -j KUBE-SVC-NPX46M4PTMTKRN6Y
COMMIT
"""


def test_parse_save_and_jump_presence() -> None:
    saved = nf.parse_save(SAVE)
    assert saved["nat"].rules("KUBE-SERVICES")[0].endswith("-j KUBE-SVC-NPX46M4PTMTKRN6Y")
    assert nf.Jump("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals").present(saved)
    assert not nf.Jump("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals").present(saved)


def _tables(nat: dict[str, list[str]], filter: dict[str, list[str]] | None = None) -> dict[str, nf.SavedTable]:
    return {"nat": nf.SavedTable(nat), "filter": nf.SavedTable(filter or {})}


IPTABLES_MODE = (is_mode_chain, is_mode_rule)
MASQ = {"KUBE-MARK-MASQ": ["-j MARK --or-mark 0x4000"], "KUBE-POSTROUTING": ["-j MASQUERADE"],
        "POSTROUTING": ['-m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING']}


def test_cleanup_removes_the_mode_and_the_shared_chains_it_alone_used() -> None:
    nat = {"PREROUTING": ['-m comment --comment "kubernetes service portals" -j KUBE-SERVICES', "-j DOCKER"],
           "KUBE-SERVICES": ["-d 10.96.0.1/32 -j KUBE-SVC-X"], "KUBE-SVC-X": ["-j KUBE-SEP-Y"],
           "KUBE-SEP-Y": ["-j KUBE-MARK-MASQ", "-j DNAT --to-destination 10.0.0.1:80"], "DOCKER": [], **MASQ}
    edits, done = nf.removal_plan(_tables(nat), *IPTABLES_MODE)
    text = nf.restore_input(edits)
    assert set(edits["nat"].removed) == {"KUBE-SERVICES", "KUBE-SVC-X", "KUBE-SEP-Y", "KUBE-MARK-MASQ",
                                         "KUBE-POSTROUTING"}
    assert '-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in text
    assert "DOCKER" not in text
    assert len(done) == 7


def test_cleanup_takes_the_masquerade_marks_of_kube_services_too() -> None:
    masq = '-d 10.96.0.1/32 -p tcp -m comment --comment "default/kubernetes:https cluster IP" ! -s 10.0.0.0/8 ' \
           "-j KUBE-MARK-MASQ"
    nat = {"KUBE-SERVICES": [masq, "-d 10.96.0.1/32 -j KUBE-SVC-X"], "KUBE-SVC-X": [], **MASQ}
    edits, _ = nf.removal_plan(_tables(nat), *IPTABLES_MODE)
    assert set(edits["nat"].removed) == {"KUBE-SERVICES", "KUBE-SVC-X", "KUBE-MARK-MASQ", "KUBE-POSTROUTING"}


def test_cleanup_takes_the_internal_local_drops_of_filter_kube_services_too() -> None:
    drop = '-m comment --comment "default/web:http has no local endpoints" -m tcp -p tcp -d 10.96.0.1/32 ' \
           "--dport 80 -j DROP"
    assert is_mode_rule("filter", "KUBE-SERVICES", drop)
    assert not is_mode_rule("filter", "KUBE-SERVICES", "-d 10.96.0.1/32 -j DROP")


def test_cleanup_keeps_shared_chains_another_mode_still_uses() -> None:
    # IPVS mode's KUBE-SERVICES marks with a set match: the iptables mode's cleanup takes only its own rule.
    ipvs_rule = "-m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"
    nat = {"PREROUTING": ["-j KUBE-SERVICES"], "KUBE-SERVICES": [ipvs_rule, "-d 10.96.0.1/32 -j KUBE-SVC-XX"],
           "KUBE-SVC-XX": [], **MASQ}
    filter = {"KUBE-SERVICES": ['-m comment --comment "a/b has no endpoints" -j REJECT'], "FORWARD": []}
    edits, _ = nf.removal_plan(_tables(nat, filter), *IPTABLES_MODE)
    assert edits["nat"].removed == ["KUBE-SVC-XX"]
    assert edits["nat"].rules == ["-D KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-XX"]
    assert edits["filter"].removed == ["KUBE-SERVICES"]


def test_cleanup_of_nothing_does_nothing() -> None:
    edits, done = nf.removal_plan(_tables({"PREROUTING": ["-j DOCKER"], "DOCKER": []}), *IPTABLES_MODE)
    assert done == [] and nf.restore_input(edits) == ""


def test_another_modes_cleanup_leaves_the_running_modes_chains_even_empty() -> None:
    """The iptables mode runs with every Service served: its filter KUBE-SERVICES is empty and nothing marks for
    masquerade. The IPVS mode's cleanup at its start must leave those chains; `pyproxy cleanup` (no mode runs)
    takes them."""
    from pyproxy.dataplane.ipvs.backend import is_mode_chain as ipvs_chain
    from pyproxy.dataplane.ipvs.backend import is_mode_rule as ipvs_rule

    portals = '-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    nat = {"KUBE-SERVICES": [], "PREROUTING": ['-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'],
           **MASQ}
    filter = {"KUBE-SERVICES": [], "INPUT": [portals], "FORWARD": [portals, "-j KUBE-FORWARD"],
              "KUBE-FORWARD": ["-j ACCEPT"], "KUBE-IPVS-FILTER": ["-j RETURN"]}
    keep = {(table, chain) for table, chain in nf.SHARED_CHAINS}
    edits, done = nf.removal_plan(_tables(nat, filter), ipvs_chain, ipvs_rule, keep)
    assert done == ["filter chain KUBE-IPVS-FILTER (the mode's own chain)"]
    assert edits["filter"].removed == ["KUBE-IPVS-FILTER"] and not edits["nat"]

    edits, done = nf.removal_plan(_tables(nat, filter), ipvs_chain, ipvs_rule)
    assert "filter chain KUBE-SERVICES (shared, and no rule left uses it)" in done
    assert "filter rule in INPUT: " + portals + " (jumps to a removed chain)" in done


# ------------------------------------------------------------------------------------- external frontends

NODE_IPS = ("10.0.0.5", "192.168.1.5")
NODE = NodeInputs(name="node-a", nodeport_addresses=NODE_IPS)
EXTERNAL_IP, LB_IP = "192.0.2.10", "203.0.113.10"


def web(backends: Iterable[Backend] = (A, B), *, local: Iterable[Backend] | None = None, ranges: tuple[str, ...] = (),
        protocol: Protocol = Protocol.TCP, health: int | None = None) -> list[ServicePortState]:
    """Every frontend of one service port of a LoadBalancer Service (ClusterIP, external IP, LB IP, NodePort on
    each node address), with the policy the model gives them: externalTrafficPolicy Cluster, or Local with
    `local` this node's endpoints."""
    ready = tuple(sorted(backends))
    cluster = local is None
    outside = ready if cluster else tuple(sorted(local or ()))
    base = ServicePortState("ns3/web", "http", Frontend("10.96.0.30", 80, protocol), ready, ready,
                            health_check_node_port=health)
    kinds = [(FrontendKind.EXTERNAL_IP, Frontend(EXTERNAL_IP, 80, protocol)),
             (FrontendKind.LOAD_BALANCER, Frontend(LB_IP, 80, protocol)),
             *((FrontendKind.NODE_PORT, Frontend(ip, 30080, protocol)) for ip in NODE_IPS)]
    return [base, *(ServicePortState("ns3/web", "http", fe, ready, ready, 0, kind, outside, cluster,
                                     ranges if kind is FrontendKind.LOAD_BALANCER else (), health)
                    for kind, fe in kinds)]


def chain_rules(plan: Plan, chain: str, table: str = "nat") -> list[str]:
    """The rule bodies `plan` writes into `chain` of `table`."""
    part = plan.text.split(f"*{table}\n", 1)[1].split("COMMIT", 1)[0]
    return [line.split(" ", 2)[2] for line in part.splitlines() if line.startswith(f"-A {chain} ")]


def targets(plan: Plan, chain: str, table: str = "nat") -> list[str]:
    return [nf.target(body) or "" for body in chain_rules(plan, chain, table)]


SP = web()[0]


def test_external_frontends_lead_to_the_external_chain_which_masquerades_with_cluster_policy() -> None:
    plan = full(state(*web(), node=NODE))
    ext, svc = ext_chain(SP), svc_chain(SP)
    assert ext == "KUBE-EXT-" + svc.removeprefix("KUBE-SVC-"), "upstream: one hash for every chain of a port"
    assert chain_rules(plan, "KUBE-SERVICES") == [
        f'-m comment --comment "ns3/web:http cluster IP" -m tcp -p tcp -d 10.96.0.30/32 --dport 80 -j {svc}',
        f'-m comment --comment "ns3/web:http external IP" -m tcp -p tcp -d {EXTERNAL_IP}/32 --dport 80 -j {ext}',
        f'-m comment --comment "ns3/web:http loadbalancer IP" -m tcp -p tcp -d {LB_IP}/32 --dport 80 -j {ext}',
        # Last: only the node-port addresses the model chose.
        *(f'-m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" '
          f"-d {ip}/32 -j KUBE-NODEPORTS" for ip in NODE_IPS),
    ]
    # One rule per service port, whatever the number of node addresses.
    assert chain_rules(plan, "KUBE-NODEPORTS") == [f'-m comment --comment "ns3/web:http" -m tcp -p tcp --dport 30080 '
                                                   f"-j {ext}"]
    assert chain_rules(plan, ext) == [
        '-m comment --comment "masquerade traffic for ns3/web:http external destinations" -j KUBE-MARK-MASQ',
        f"-j {svc}"]
    assert svl_chain(SP) not in plan.text and "KUBE-FW-" not in plan.text
    # Every frontend of the port shares one KUBE-SVC and its KUBE-SEPs, declared once.
    assert sorted(declared(plan) - EVERY_SERVICES - {"KUBE-MARK-MASQ", "KUBE-POSTROUTING", "KUBE-FORWARD"}) == sorted(
        {svc, ext, sep_chain(SP, A), sep_chain(SP, B)})
    assert plan.applied["ns3/web"].chains == {svc, ext, sep_chain(SP, A), sep_chain(SP, B)}
    assert not chain_rules(plan, "KUBE-EXTERNAL-SERVICES", "filter")


@pytest.mark.parametrize("cidr", [None, "10.244.0.0/16"])
def test_local_policy_short_circuits_pods_and_the_node_and_keeps_clients_on_local_endpoints(cidr: str | None) -> None:
    # B is this node's, serving and terminating: not among the cluster-wide endpoints (A is ready elsewhere).
    plan = full(state(*web([A], local=[B]), node=NODE), m=nf.MasqueradeSettings(cluster_cidr=cidr))
    ext, svc, svl = ext_chain(SP), svc_chain(SP), svl_chain(SP)
    pods = [f'-m comment --comment "pod traffic for ns3/web:http external destinations" -s {cidr} -j {svc}'] \
        if cidr else []
    assert chain_rules(plan, ext) == [
        *pods,
        '-m comment --comment "masquerade LOCAL traffic for ns3/web:http external destinations" '
        "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
        '-m comment --comment "route LOCAL traffic for ns3/web:http external destinations" '
        f"-m addrtype --src-type LOCAL -j {svc}",
        f"-j {svl}",
    ]
    assert targets(plan, svl) == [sep_chain(SP, B)]
    assert targets(plan, svc) == [sep_chain(SP, A)]
    assert chain_rules(plan, sep_chain(SP, B))[-1].endswith("-j DNAT --to-destination 10.180.0.2:80")
    assert not chain_rules(plan, "KUBE-EXTERNAL-SERVICES", "filter")


def test_local_policy_without_a_local_endpoint_drops_what_is_not_short_circuited() -> None:
    plan = full(state(*web([A, B], local=[]), node=NODE))
    ext = ext_chain(SP)
    assert targets(plan, ext) == ["KUBE-MARK-MASQ", svc_chain(SP)]  # the node's own traffic only
    assert svl_chain(SP) not in plan.text
    # In filter, after DNAT: only flows no nat rule translated are still addressed to a frontend.
    drops = chain_rules(plan, "KUBE-EXTERNAL-SERVICES", "filter")
    assert [r.split("/32")[0].rsplit(" ", 1)[1] for r in drops] == [EXTERNAL_IP, LB_IP, *NODE_IPS]
    assert all('"ns3/web:http has no local endpoints"' in r and r.endswith(" -j DROP") for r in drops), drops
    assert "-j KUBE-NODEPORTS" in plan.text and ext in chain_rules(plan, "KUBE-NODEPORTS")[0]


def test_external_frontends_without_endpoints_are_rejected_in_filter() -> None:
    plan = full(state(*web([]), node=NODE))
    assert chain_rules(plan, "KUBE-SERVICES", "filter") == [
        '-m comment --comment "ns3/web:http has no endpoints" -m tcp -p tcp -d 10.96.0.30/32 --dport 80 '
        "-j REJECT --reject-with tcp-reset"]
    assert chain_rules(plan, "KUBE-EXTERNAL-SERVICES", "filter") == [
        f'-m comment --comment "ns3/web:http has no endpoints" -m tcp -p tcp -d {ip}/32 --dport {port} '
        "-j REJECT --reject-with tcp-reset"
        for ip, port in [(EXTERNAL_IP, 80), (LB_IP, 80), *((ip, 30080) for ip in NODE_IPS)]]
    assert not chain_rules(plan, "KUBE-NODEPORTS")
    assert targets(plan, "KUBE-SERVICES") == ["KUBE-NODEPORTS"] * len(NODE_IPS)
    assert plan.applied["ns3/web"].chains == frozenset()


def test_source_ranges_lead_the_load_balancer_ip_through_the_firewall_chain() -> None:
    plan = full(state(*web(ranges=("198.51.100.0/24", "10.0.0.5/32")), node=NODE))
    fw, ext = fw_chain(SP), ext_chain(SP)
    assert [t for t in targets(plan, "KUBE-SERVICES") if t.startswith(("KUBE-FW-", "KUBE-EXT-"))] == [ext, fw]
    assert chain_rules(plan, fw) == [f'-m comment --comment "ns3/web:http loadbalancer IP" -s {r} -j {ext}'
                                     for r in ("198.51.100.0/24", "10.0.0.5/32")]
    # What KUBE-FW did not let on is still addressed to the load-balancer IP in filter: dropped. Not the other
    # frontends (the NodePort bypasses the ranges, as upstream's).
    assert chain_rules(plan, "KUBE-PROXY-FIREWALL", "filter") == [
        f'-m comment --comment "ns3/web:http traffic not accepted by {fw}" -m tcp -p tcp -d {LB_IP}/32 --dport 80 '
        "-j DROP"]
    assert chain_rules(plan, "KUBE-NODEPORTS")[0].endswith(f"-j {ext}")


def test_the_health_check_node_port_is_accepted_once_per_service() -> None:
    plan = full(state(*web(local=[A], health=31000), node=NODE))
    assert chain_rules(plan, "KUBE-NODEPORTS", "filter") == [
        '-m comment --comment "ns3/web health check node port" -m tcp -p tcp --dport 31000 -j ACCEPT']
    assert not chain_rules(full(state(*web(), node=NODE)), "KUBE-NODEPORTS", "filter")


def test_partial_sync_rewrites_and_removes_the_external_chains_of_the_changed_service() -> None:
    ranged = web(ranges=("198.51.100.0/24",))
    before = full(state(*ranged, svc1(A), node=NODE))
    assert {fw_chain(SP), ext_chain(SP)} <= before.applied["ns3/web"].chains

    # Cluster -> Local, ranges gone: KUBE-SVL comes, KUBE-FW goes; svc1 is not touched.
    plan = render(state(*web(local=[A]), svc1(A), node=NODE), {"ns3/web"}, before.applied, NO_MASQ)
    assert deleted(plan) == [fw_chain(SP)]  # B stays: still a cluster-wide endpoint
    assert {svl_chain(SP), ext_chain(SP), svc_chain(SP)} <= declared(plan)
    assert svc_chain(svc1(A)) not in declared(plan) and declared(plan) >= EVERY_SERVICES
    assert plan.text.index(f"-X {fw_chain(SP)}") > plan.text.index("-A KUBE-SERVICES")
    assert "KUBE-PROXY-FIREWALL -m" not in plan.text and f"-j {fw_chain(SP)}" not in plan.text

    # Local -> Cluster: KUBE-SVL goes.
    local = render(state(*web(local=[A]), svc1(A), node=NODE), {"ns3/web"}, before.applied, NO_MASQ)
    back = render(state(*web(), svc1(A), node=NODE), {"ns3/web"}, local.applied, NO_MASQ)
    assert deleted(back) == [svl_chain(SP)]

    # The Service goes: every chain of it, and its rules in the shared chains.
    gone = render(state(svc1(A), node=NODE), {"ns3/web"}, before.applied, NO_MASQ)
    assert set(deleted(gone)) == before.applied["ns3/web"].chains
    assert not chain_rules(gone, "KUBE-NODEPORTS") and not chain_rules(gone, "KUBE-PROXY-FIREWALL", "filter")


def test_full_sync_removes_stale_external_chains_and_keeps_the_fixed_ones() -> None:
    stale = ["KUBE-EXT-AAAAAAAAAAAAAAAA", "KUBE-FW-AAAAAAAAAAAAAAAA", "KUBE-SVL-AAAAAAAAAAAAAAAA"]
    saved = {"nat": nf.SavedTable({"PREROUTING": [], "KUBE-NODEPORTS": [], **{c: [] for c in stale}}),
             "filter": nf.SavedTable({"INPUT": [], "KUBE-EXTERNAL-SERVICES": [], "KUBE-PROXY-FIREWALL": []})}
    plan = full(state(*web(local=[A]), node=NODE), saved=saved)
    assert deleted(plan) == stale
    assert {ext_chain(SP), svl_chain(SP)} <= declared(plan)


def test_udp_flows_of_every_frontend_kind_are_planned() -> None:
    before = web([A, B], protocol=Protocol.UDP)
    after = web([A], protocol=Protocol.UDP)
    plan = render(state(*after, node=NODE), {"ns3/web"}, full(state(*before, node=NODE)).applied, NO_MASQ)
    # NodePorts by port on any address (as upstream), the other kinds by their address.
    assert plan.stale_udp == tuple(stale_udp_states(before, after))
    assert {(s.ip, s.endpoint) for s in plan.stale_udp} == {(ip, B) for ip in ("", "10.96.0.30", EXTERNAL_IP, LB_IP)}


def test_cleanup_removes_the_external_chains_and_their_jumps() -> None:
    plan = full(state(*web(local=[A], ranges=("198.51.100.0/24",), health=31000), svc2(), node=NODE))
    saved = saved_from(plan)
    edits, done = nf.removal_plan(saved, *IPTABLES_MODE)
    removed = {(t, c) for t, e in edits.items() for c in e.removed}
    assert {("nat", "KUBE-NODEPORTS"), ("filter", "KUBE-NODEPORTS"), ("filter", "KUBE-EXTERNAL-SERVICES"),
            ("filter", "KUBE-PROXY-FIREWALL"), ("nat", ext_chain(SP)), ("nat", fw_chain(SP)),
            ("nat", svl_chain(SP))} <= removed
    left = {c for t, st in saved.items() for c in st.chains if (t, c) not in removed}
    assert not [c for c in left if c.startswith("KUBE-")], left
    # Every jump from a built-in chain the first sync inserted goes with them.
    jumps = [line for line in done if line.split(" rule in ")[-1].split(":")[0] in nf.BUILTIN_CHAINS]
    assert len(jumps) == len([line for line in plan.text.splitlines() if line.startswith("-I ")]), jumps


# ------------------------------------------------------------------------------------------------- IPv6


V6A, V6B = Backend("fd00:180::1", 80), Backend("fd00:180::2", 80)


def test_a_dual_stack_service_renders_each_family_for_its_own_restore() -> None:
    v4 = port("ns1/svc1", "172.30.0.41", 80, [A], name="p80")
    v6 = port("ns1/svc1", "fd00:30::41", 80, [V6A, V6B], name="p80")
    udp6 = port("ns1/svc1", "fd00:30::41", 53, [], name="dns", protocol=Protocol.UDP)
    node = NodeInputs(nodeport_addresses=("10.0.0.5", "fd00:1::5"))
    m = nf.MasqueradeSettings(cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:244::/56")
    desired = state(v4, v6, udp6, node=node)
    saved = {t: nf.SavedTable() for t in nf.TABLES}
    four = render(desired, None, {}, m, saved).text
    assert four == render(state(v4, node=NodeInputs(nodeport_addresses=("10.0.0.5",))), None, {}, m, saved).text
    six = render(desired, None, {}, m, saved, family=6).text
    assert "172.30.0.41" not in six and "10.0.0.5" not in six and "10.244.0.0/16" not in six
    assert ('-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d fd00:30::41/128 '
            '--dport 80 ! -s fd00:244::/56 -j KUBE-MARK-MASQ') in six
    assert "-d fd00:1::5/128 -j KUBE-NODEPORTS" in six
    # Upstream's endpoint string, "[addr]:port", names the chain and is DNAT's destination.
    sep = sep_chain(v6, V6A)
    assert sep == "KUBE-SEP-" + nf.chain_hash("ns1/svc1:p80tcp[fd00:180::1]:80")
    assert f'-A {sep} -m comment --comment "ns1/svc1:p80" -s fd00:180::1/128 -j KUBE-MARK-MASQ' in six
    assert (f'-A {sep} -m comment --comment "ns1/svc1:p80" -m tcp -p tcp -j DNAT --to-destination '
            '[fd00:180::1]:80') in six
    # No endpoints, UDP: ICMPv6 port unreachable (TCP: a reset, as for IPv4).
    assert ('-m udp -p udp -d fd00:30::41/128 --dport 53 -j REJECT --reject-with icmp6-port-unreachable') in six
    # IPv4 names are upstream's as before: "ip:port".
    assert sep_chain(v4, A) == "KUBE-SEP-" + nf.chain_hash("ns1/svc1:p80tcp10.180.0.1:80")


def test_the_ipv6_plan_clears_stale_ipv6_udp_flows() -> None:
    e1, e2 = Backend("fd00:180::1", 53), Backend("fd00:180::2", 53)
    before = port("kube-system/kube-dns", "fd00:96::10", 53, [e1, e2], name="dns", protocol=Protocol.UDP)
    after = port("kube-system/kube-dns", "fd00:96::10", 53, [e2], name="dns", protocol=Protocol.UDP)
    saved = {t: nf.SavedTable() for t in nf.TABLES}
    first = render(state(before), None, {}, NO_MASQ, saved, family=6)
    plan = render(state(after), {"kube-system/kube-dns"}, first.applied, NO_MASQ, family=6)
    assert plan.stale_udp == (Stale("fd00:96::10", 53, e1),)
    assert nf.conntrack_filter(plan.stale_udp[0])[:2] == ["-f", "ipv6"]
