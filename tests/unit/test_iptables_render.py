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
    ConntrackFlush,
    Plan,
    is_mode_chain,
    is_mode_rule,
    probability,
    render,
    sep_chain,
    svc_chain,
    udp_flushes,
)
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, DesiredState, Frontend, ServicePortState

A, B, C = (Backend(f"10.180.0.{i}", 80) for i in (1, 2, 3))
NO_MASQ = nf.MasqueradeSettings()


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


def state(*ports: ServicePortState) -> DesiredState:
    services: dict[str, tuple[ServicePortState, ...]] = {}
    for sp in ports:
        services[sp.service] = (*services.get(sp.service, ()), sp)
    return DesiredState(services)


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
        ":KUBE-FORWARD - [0:0]",
        '-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I OUTPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD',
        '-A KUBE-SERVICES -m comment --comment "ns2/svc2 has no endpoints" -m tcp -p tcp -d 172.30.0.42/32 '
        "--dport 80 -j REJECT --reject-with tcp-reset",
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT',
        "COMMIT",
    ]
    assert plan.applied == {"ns1/svc1": AppliedService((svc1(A, B),), frozenset({svc, sep_a, sep_b})),
                            "ns2/svc2": AppliedService((svc2(),), frozenset())}
    assert (plan.written, plan.removed) == (8, 0)


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
    assert declared(plan) == {svc_chain(svc1(A)), sep_chain(svc1(A), A), sep_chain(svc1(A), B), "KUBE-SERVICES"}
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


def test_udp_flows_of_an_endpoint_that_left_are_flushed() -> None:
    fe = dns(A).frontend
    assert udp_flushes((dns(A, B),), (dns(A),)) == [ConntrackFlush(fe, B.ip)]
    assert udp_flushes((dns(A, B),), ()) == [ConntrackFlush(fe, A.ip), ConntrackFlush(fe, B.ip)]


def test_a_not_ready_endpoint_keeps_its_udp_flows() -> None:
    assert udp_flushes((dns(A, B),), (dns(A, not_ready=[B]),)) == []


def test_a_udp_frontend_getting_its_first_endpoint_drops_unnated_flows() -> None:
    fe = dns(A).frontend
    assert udp_flushes((), (dns(A),)) == [ConntrackFlush(fe, None)]
    assert udp_flushes((dns(),), (dns(A),)) == [ConntrackFlush(fe, None)]
    assert udp_flushes((dns(A),), (dns(A, B),)) == []


def test_tcp_flows_are_left_alone() -> None:
    assert udp_flushes((svc1(A, B),), (svc1(A),)) == []


def test_render_collects_the_flushes_of_the_changed_services() -> None:
    before = full(state(dns(A, B)))
    plan = render(state(dns(A)), {"kube-system/kube-dns"}, before.applied, NO_MASQ)
    assert plan.flushes == (ConntrackFlush(dns(A).frontend, B.ip),)


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
