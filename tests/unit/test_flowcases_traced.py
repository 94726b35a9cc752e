"""The flow-case table (tests/flowcases.py) traced through every mode's rendered plan, without root: the same
cases tests/e2e/test_flowcases.py runs with real packets, in seconds. Each tracer (tests/tracers) follows a new
flow through what its mode's render() produced for the syncs pyproxy makes: the first (full) one from the
table's manifests, or a partial one from another cluster (tracers.common.BEFORE) to them. The broken-plan tests
show that each tracer sees a renderer mistake, and that a rule form it does not know fails the trace instead
of passing it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import flowcases
import pytest
import schedcases
from tracers import bpf, iptables, ipvs, nftables, userspace
from tracers.common import BEFORE, SOURCES, Packet, Sync, Tracer, Unmodelled, mismatches, syncs, traced_cases

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import Batch
from pyproxy.dataplane.ipvs.render import RealOp
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.model.state import Backend

TRACERS: dict[str, Callable[[Sequence[Sync]], Tracer]] = {
    "bpf": bpf.tracer,
    "iptables": iptables.tracer,
    "ipvs": ipvs.tracer,
    "nftables": nftables.tracer,
    "userspace": userspace.tracer,
}


@pytest.fixture(scope="module")
def first() -> list[Sync]:
    """pyproxy's first sync of the table's cluster."""
    return syncs(flowcases.MANIFESTS)


@pytest.fixture(scope="module")
def update() -> list[Sync]:
    """A first sync of another cluster, then the partial sync that brings it to the table's."""
    return syncs(BEFORE, flowcases.MANIFESTS)


@pytest.mark.parametrize("mode", TRACERS)
def test_every_mode_agrees_on_the_flow_table(first: list[Sync], mode: str) -> None:
    wrong = mismatches(TRACERS[mode](first), mode)
    assert not wrong, f"{mode}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("mode", TRACERS)
def test_every_mode_agrees_on_the_flow_table_after_a_partial_sync(update: list[Sync], mode: str) -> None:
    assert update[-1][1] is not None, "the second sync is a partial one"
    wrong = mismatches(TRACERS[mode](update), mode)
    assert not wrong, f"{mode}:\n" + "\n".join(wrong)


def _ipv6_modes() -> list[object]:
    """Every mode; those that do not render IPv6 yet (flowcases.NOT_RENDERED_YET) as strict expected failures, with
    why: their IPv6 cases do not count as passing, and the day they pass the mark must go."""
    return [pytest.param(mode, marks=pytest.mark.xfail(strict=True, reason=flowcases.NOT_RENDERED_YET[mode]))
            if mode in flowcases.NOT_RENDERED_YET else mode for mode in TRACERS]


@pytest.mark.parametrize("mode", _ipv6_modes())
def test_every_mode_agrees_on_the_ipv6_flow_table(first: list[Sync], mode: str) -> None:
    wrong = mismatches(TRACERS[mode](first), mode, flowcases.IPV6_CASES)
    assert not wrong, f"{mode}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("mode", _ipv6_modes())
def test_every_mode_agrees_on_the_ipv6_flow_table_after_a_partial_sync(update: list[Sync], mode: str) -> None:
    wrong = mismatches(TRACERS[mode](update), mode, flowcases.IPV6_CASES)
    assert not wrong, f"{mode}:\n" + "\n".join(wrong)


def test_the_ipv6_tracers_see_a_lost_ipv6_reject_and_firewall(first: list[Sync]) -> None:
    """The IPv6 tables are walked, not the IPv4 ones: breaking only the ip6 table's (ip6tables') rules shows."""
    script = "".join(nftables.scripts(first))
    broken = re.sub(r"(add chain ip6 pyproxy reject-chain \{ )[^}]*\}", r"\1}", script)
    broken = re.sub(r"ip6 saddr != \{[^}]*\} drop; ", "", broken)
    assert broken.count("reject") < script.count("reject")
    wrong = mismatches(nftables.NftablesTracer([broken]), "nftables", flowcases.IPV6_CASES)
    # (A NodePort left without its reject still refuses: the node's own stack has nothing on that port.)
    assert [w.split(" (")[0] for w in wrong] == [
        "IPv6: no ready endpoints: rejected", "IPv6: no ready endpoints: rejected, udp",
        "IPv6: a load-balancer IP whose source ranges leave the client out: no answer"], wrong
    assert not mismatches(nftables.NftablesTracer([broken]), "nftables"), "the IPv4 table is untouched"
    [text6] = iptables.restore_texts(first, family=6)
    tracer = iptables.IptablesTracer(iptables.restore_texts(first), [_without_lines(text6, "-j REJECT")])
    assert [w.split(" (")[0] for w in mismatches(tracer, "iptables", flowcases.IPV6_CASES)] == [
        "IPv6: no ready endpoints: rejected", "IPv6: no ready endpoints: rejected, udp"]
    # ipvs: ip6tables' source-range firewall over the KUBE-6-* sets.
    [ops] = ipvs.plans(first)
    text6 = _without_lines(ipvs.rules_text(family=6), "KUBE-SOURCE-RANGES-FIREWALL -j DROP")
    tracer = ipvs.IpvsTracer([ops], None, text6)
    assert [w.split(" (")[0] for w in mismatches(tracer, "ipvs", flowcases.IPV6_CASES)] == [
        "IPv6: a load-balancer IP whose source ranges leave the client out: no answer"]
    assert not mismatches(tracer, "ipvs"), "the IPv4 table is untouched"


@pytest.mark.parametrize("masquerade", [
    MasqueradeSettings(masquerade_all=True),
    MasqueradeSettings(cluster_cidr="10.201.0.0/16", masquerade_bit=3),
    MasqueradeSettings(cluster_cidr="10.201.0.0/16", cluster_cidr6="fd00:10:201::/48"),
], ids=["masquerade-all", "cluster-cidr", "cluster-cidr-pair"])
def test_masquerade_settings_change_no_outcome(update: list[Sync], masquerade: MasqueradeSettings) -> None:
    # The netfilter modes render other rules with these settings (marks, `! -s`, `ip saddr !=`): same table.
    tracers: dict[str, Tracer] = {
        "iptables": iptables.IptablesTracer(iptables.restore_texts(update, masquerade),
                                            iptables.restore_texts(update, masquerade, family=6)),
        "ipvs": ipvs.IpvsTracer(ipvs.plans(update), ipvs.rules_text(masquerade), ipvs.rules_text(masquerade, 6)),
        "nftables": nftables.NftablesTracer(nftables.scripts(update, masquerade)),
    }
    for mode, tracer in tracers.items():
        wrong = mismatches(tracer, mode) + mismatches(tracer, mode, flowcases.IPV6_CASES)
        assert not wrong, f"{mode}:\n" + "\n".join(wrong)


def _without_lines(text: str, part: str) -> str:
    kept = [line for line in text.splitlines() if part not in line]
    assert len(kept) < len(text.splitlines()), f"no line has {part!r}: the test needs another"
    return "\n".join(kept) + "\n"


def test_bpf_tracer_sees_a_lost_slot(first: list[Sync]) -> None:
    [plan] = bpf.plans(first)
    # The plan's last slot write goes missing: a frontend counts a slot that is not there.
    batches = tuple(Batch(b.verb, b.map, b.keys[:-1], (b.values or [])[:-1])
                    if (b.verb, b.map) == ("put", abi.MAP_SLOTS) else b for b in plan.batches)
    wrong = mismatches(bpf.BpfTracer([dataclasses.replace(plan, batches=batches)]), "bpf")
    assert len(wrong) == 1 and "no-answer" in wrong[0], wrong


def test_iptables_tracer_sees_a_missing_reject(first: list[Sync]) -> None:
    [text] = iptables.restore_texts(first)
    wrong = mismatches(iptables.IptablesTracer([_without_lines(text, "-j REJECT")]), "iptables")
    assert [w.split(" (")[0] for w in wrong] == [
        "no endpoints: rejected", "no endpoints: rejected, udp", "no ready endpoints: rejected",
        "an IPv4-only Service ignores IPv6 slices: no endpoints, rejected"], wrong


def test_iptables_tracer_fails_on_a_rule_it_does_not_know(first: list[Sync]) -> None:
    [text] = iptables.restore_texts(first)
    with pytest.raises(Unmodelled, match="-m nth"):
        iptables.IptablesTracer([text.replace("-m statistic --mode random", "-m nth --every 2", 1)])


def test_iptables_tracer_sees_a_lost_firewall_local_policy_and_local_drop(first: list[Sync]) -> None:
    [text] = iptables.restore_texts(first)

    def wrong_after(broken: str) -> list[str]:
        assert broken != text
        return [w.split(" (")[0] for w in mismatches(iptables.IptablesTracer([broken]), "iptables")]

    # KUBE-FW lets every source on: the client outside loadBalancerSourceRanges is answered.
    assert wrong_after(re.sub(r"-s \S+ (-j KUBE-EXT-)", r"\1", text)) == [
        "a load-balancer IP whose source ranges leave the client out: no answer",
        "a load-balancer IP whose source ranges leave a pod out: no answer"]
    # externalTrafficPolicy Local's KUBE-EXT sent to KUBE-SVC: the other node's endpoint answers too.
    assert wrong_after(re.sub(r"^(-A KUBE-EXT-\S+) -j KUBE-SVL-", r"\1 -j KUBE-SVC-", text, flags=re.M)) == [
        "externalTrafficPolicy Local: only this node's endpoint",
        "PreferClose, externalTrafficPolicy Local: outside clients get this node's endpoint"]
    # Without filter's "has no local endpoints" DROP, the untranslated flow reaches the node's stack: refused.
    assert wrong_after(_without_lines(text, "has no local endpoints")) == [
        "externalTrafficPolicy Local, no endpoint on this node: no answer"]


def test_iptables_tracer_fails_on_an_external_form_it_does_not_know(first: list[Sync]) -> None:
    [text] = iptables.restore_texts(first)
    assert "--src-type LOCAL" in text
    with pytest.raises(Unmodelled, match="addrtype --src-type"):
        iptables.IptablesTracer([text.replace("--src-type LOCAL", "--src-type UNICAST", 1)])


def test_ipvs_tracer_sees_a_missing_filter(first: list[Sync]) -> None:
    # Without KUBE-IPVS-FILTER's reject, a ClusterIP's other ports reach the node's own listeners.
    wrong = mismatches(ipvs.IpvsTracer(ipvs.plans(first), _without_lines(ipvs.rules_text(), "-j REJECT")), "ipvs")
    assert len(wrong) == 1 and "port the service does not have" in wrong[0] and "traced mixed node" in wrong[0], wrong


def test_ipvs_tracer_sees_a_lost_real_server(first: list[Sync]) -> None:
    [ops] = ipvs.plans(first)
    lost = next(op for op in ops if isinstance(op, RealOp) and op.key == ("10.96.20.2", 80, "TCP"))
    wrong = mismatches(ipvs.IpvsTracer([tuple(op for op in ops if op != lost)]), "ipvs")
    assert len(wrong) == 1 and "endpoints from two slices" in wrong[0], wrong


def test_ipvs_tracer_sees_a_missing_firewall_and_a_lost_local_policy(first: list[Sync]) -> None:
    [ops] = ipvs.plans(first)
    wrong = mismatches(ipvs.IpvsTracer([ops], _without_lines(ipvs.rules_text(), "KUBE-SOURCE-RANGES-FIREWALL -j DROP")),
                       "ipvs")
    assert [w.split(" (")[0] for w in wrong] == [
        "a load-balancer IP whose source ranges leave the client out: no answer",
        "a load-balancer IP whose source ranges leave a pod out: no answer"], wrong
    wrong = mismatches(ipvs.IpvsTracer([ops], _without_lines(ipvs.rules_text(), "KUBE-NO-LOCAL-ENDPOINTS")), "ipvs")
    assert [w.split(" (")[0] for w in wrong] == [
        "externalTrafficPolicy Local, no endpoint on this node: no answer"], wrong
    # externalTrafficPolicy Local's virtual servers given the other node's endpoint too.
    local = [op for op in ops if isinstance(op, RealOp) and op.key[1] == flowcases.LOCAL_HTTP.node_port]
    assert local and all(op.backend.ip == flowcases.B1 for op in local)
    unlocal = tuple(ops) + tuple(dataclasses.replace(op, backend=Backend(flowcases.B2, op.backend.port))
                                 for op in local)
    wrong = mismatches(ipvs.IpvsTracer([unlocal]), "ipvs")
    assert [w.split(" (")[0] for w in wrong] == ["externalTrafficPolicy Local: only this node's endpoint"], wrong


def test_ipvs_tracer_fails_on_a_rule_form_it_does_not_know(first: list[Sync]) -> None:
    text = ipvs.rules_text()
    assert "--dst-type LOCAL" in text
    with pytest.raises(Unmodelled, match="addrtype"):
        ipvs.IpvsTracer(ipvs.plans(first), text.replace("--dst-type LOCAL", "--dst-type UNICAST", 1))


def test_nftables_tracer_sees_a_lost_affinity_update(first: list[Sync]) -> None:
    [script] = nftables.scripts(first)
    wrong = mismatches(nftables.NftablesTracer([re.sub(r"update @\S+ \{ ip saddr \}; ", "", script)]), "nftables")
    assert len(wrong) == 1 and "ClientIP affinity sticks" in wrong[0] and "traced backends" in wrong[0], wrong


def test_nftables_tracer_fails_on_a_statement_it_does_not_know(first: list[Sync]) -> None:
    [script] = nftables.scripts(first)
    with pytest.raises(Unmodelled, match="numgen inc"):
        nftables.NftablesTracer([script.replace("numgen random mod", "numgen inc mod", 1)])


def test_nftables_tracer_sees_a_missing_firewall_and_a_lost_local_policy(first: list[Sync]) -> None:
    [script] = nftables.scripts(first)
    wrong = mismatches(nftables.NftablesTracer([re.sub(r"ip saddr != \{[^}]*\} drop; ", "", script)]), "nftables")
    assert [w.split(" (")[0] for w in wrong] == [
        "a load-balancer IP whose source ranges leave the client out: no answer",
        "a load-balancer IP whose source ranges leave a pod out: no answer"], wrong
    # externalTrafficPolicy Local's external chain sent to the service chain: the other node's endpoint answers too.
    unlocal = re.sub(r"goto (local-\S+); \}", lambda m: "goto service-" + m[1].removeprefix("local-") + "; }", script)
    assert unlocal != script
    wrong = mismatches(nftables.NftablesTracer([unlocal]), "nftables")
    assert [w.split(" (")[0] for w in wrong] == [
        "externalTrafficPolicy Local: only this node's endpoint",
        "PreferClose, externalTrafficPolicy Local: outside clients get this node's endpoint"], wrong


def test_nftables_tracer_fails_on_an_external_form_it_does_not_know(first: list[Sync]) -> None:
    [script] = nftables.scripts(first)
    assert "fib saddr type local" in script
    with pytest.raises(Unmodelled, match="fib daddr"):
        nftables.NftablesTracer([script.replace("fib saddr type local", "fib daddr type local", 1)])


def test_userspace_tracer_sees_a_lost_filter_and_a_lost_local_policy(first: list[Sync]) -> None:
    [plan] = userspace.plans(first)

    def wrong_after(broken: userspace.us_render.Plan) -> list[str]:
        return [w.split(" (")[0] for w in mismatches(userspace.Proxy([broken]), "userspace")]

    # Every listener without its filter: the source ranges and the Local drops let everyone in.
    unfiltered = dataclasses.replace(plan, open={f: None for f in plan.open})
    assert wrong_after(unfiltered) == [
        "a load-balancer IP whose source ranges leave the client out: no answer",
        "a load-balancer IP whose source ranges leave a pod out: no answer",
        "externalTrafficPolicy Local, no endpoint on this node: no answer",
        "internalTrafficPolicy Local, no endpoint on this node: a pod's flow is dropped"]
    # externalTrafficPolicy Local's routes without their own endpoints: the other node's endpoint answers too.
    unlocal = {f: dataclasses.replace(r, external_backends=None) if r is not None and r.external_backends else r
               for f, r in plan.routes.items()}
    assert wrong_after(dataclasses.replace(plan, routes=unlocal)) == [
        "externalTrafficPolicy Local: only this node's endpoint",
        "PreferClose, externalTrafficPolicy Local: outside clients get this node's endpoint"]


def test_userspace_tracer_sees_a_lost_ipv6_filter_and_ipv6_frontends_served_from_ipv4_endpoints(
        first: list[Sync]) -> None:
    """The IPv6 listeners' filters and routes are followed, not the IPv4 ones'."""
    [plan] = userspace.plans(first)

    def wrong_after(broken: userspace.us_render.Plan) -> list[str]:
        return [w.split(" (")[0] for w in mismatches(userspace.Proxy([broken]), "userspace", flowcases.IPV6_CASES)]

    unfiltered = dataclasses.replace(plan, open={f: None if ":" in f.ip else p for f, p in plan.open.items()})
    assert wrong_after(unfiltered) == ["IPv6: a load-balancer IP whose source ranges leave the client out: no answer"]
    assert not mismatches(userspace.Proxy([unfiltered]), "userspace"), "the IPv4 frontends keep their filters"
    # A dual-stack Service's IPv6 frontends given its IPv4 frontend's endpoints.
    ipv4 = {f.port: r for f, r in plan.routes.items() if r is not None and f.ip == "10.96.20.30"}
    crossed = {f: ipv4.get(f.port, r) if f.ip == "fd00:10:96::30" else r for f, r in plan.routes.items()}
    assert wrong_after(dataclasses.replace(plan, routes=crossed)) == [
        "dual-stack: the IPv6 ClusterIP reaches the IPv6 endpoints only"]


def test_userspace_cluster_cidr_lets_pods_past_the_local_drop(first: list[Sync]) -> None:
    # With --cluster-cidr the pods are inside: the Local frontends' filters let them in (the route then gives them
    # every endpoint), while the client outside is still dropped.
    [plan] = userspace.plans(first, cluster_cidrs=("10.201.0.0/16",))
    proxy = userspace.Proxy([plan], cluster_cidrs=("10.201.0.0/16",))
    elsewhere = Packet(SOURCES["b1"], "tcp", flowcases.NODE_IP, flowcases.ELSEWHERE_HTTP.node_port)
    assert {v.kind for v in proxy.flows(elsewhere, frozenset())} == {"dnat"}
    outside = dataclasses.replace(elsewhere, src=SOURCES["client"])
    assert {v.kind for v in proxy.flows(outside, frozenset())} == {"no-answer"}


def test_the_tracers_follow_every_case_but_the_nodes_own_traffic() -> None:
    """So an empty or shrinking selection cannot make the table pass: only node-originated cases are left to the
    privileged run."""
    left_out = [case for case in flowcases.CASES if case not in traced_cases()]
    assert left_out and all(case.src == "node" for case in left_out)
    assert len(traced_cases()) == len(flowcases.CASES) - len(left_out) >= 10


def test_ipvs_never_picks_an_endpoint_of_weight_zero() -> None:
    # The scheduler table's wrr Service weighs b3 0 (pyproxy.io/weights): from the annotation to the real
    # servers, no new flow may reach it, with or without affinity.
    tracer = ipvs.tracer(syncs(schedcases.manifests()))
    for ip in (schedcases.service_ip("wrr"), schedcases.sticky_ip("wrr")):
        picks = {v.backend for v in tracer.flows(Packet(SOURCES["client"], "tcp", ip, 80), frozenset())}
        assert picks == {f"{schedcases.B1}:8080", f"{schedcases.B2}:8080"}, (ip, picks)
