"""The flow-case table (tests/flowcases.py) traced through every mode's rendered plan, without root: the same
cases tests/e2e/test_flowcases.py runs with real packets, in seconds. Each tracer (tests/tracers) follows a new
flow through what its mode's render() produced from the desired state pyproxy computes for the table's
manifests. The broken-plan tests show that each tracer sees a renderer mistake, and that a rule form it does
not know fails the trace instead of passing it."""

from __future__ import annotations

import dataclasses
import re

import pytest
from tracers import bpf, iptables, ipvs, nftables
from tracers.common import Tracer, Unmodelled, desired_state, mismatches

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import Batch
from pyproxy.dataplane.ipvs.render import RealOp
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.model.state import DesiredState


@pytest.fixture(scope="module")
def desired() -> DesiredState:
    return desired_state()


TRACERS = {
    "bpf": bpf.BpfTracer,
    "iptables": iptables.IptablesTracer,
    "ipvs": ipvs.IpvsTracer,
    "nftables": nftables.NftablesTracer,
}


@pytest.mark.parametrize("mode", TRACERS)
def test_every_mode_agrees_on_the_flow_table(desired: DesiredState, mode: str) -> None:
    wrong = mismatches(TRACERS[mode](desired), mode)
    assert not wrong, f"{mode}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("masquerade", [
    MasqueradeSettings(masquerade_all=True),
    MasqueradeSettings(cluster_cidr="10.201.0.0/16", masquerade_bit=3),
], ids=["masquerade-all", "cluster-cidr"])
def test_masquerade_settings_change_no_outcome(desired: DesiredState, masquerade: MasqueradeSettings) -> None:
    # The netfilter modes render other rules with these settings (marks, `! -s`, `ip saddr !=`): same table.
    tracers: dict[str, Tracer] = {
        "iptables": iptables.IptablesTracer(desired, iptables.restore_text(desired, masquerade)),
        "ipvs": ipvs.IpvsTracer(desired, rules=ipvs.rules_text(masquerade)),
        "nftables": nftables.NftablesTracer(desired, nftables.script(desired, masquerade)),
    }
    for mode, tracer in tracers.items():
        wrong = mismatches(tracer, mode)
        assert not wrong, f"{mode}:\n" + "\n".join(wrong)


def _without_lines(text: str, part: str) -> str:
    kept = [line for line in text.splitlines() if part not in line]
    assert len(kept) < len(text.splitlines()), f"no line has {part!r}: the test needs another"
    return "\n".join(kept) + "\n"


def test_bpf_tracer_sees_a_lost_slot(desired: DesiredState) -> None:
    plan = bpf.plan(desired)
    # The plan's last slot write goes missing: a frontend counts a slot that is not there.
    batches = tuple(Batch(b.verb, b.map, b.keys[:-1], (b.values or [])[:-1])
                    if (b.verb, b.map) == ("put", abi.MAP_SLOTS) else b for b in plan.batches)
    wrong = mismatches(bpf.BpfTracer(desired, dataclasses.replace(plan, batches=batches)), "bpf")
    assert len(wrong) == 1 and "no-answer" in wrong[0], wrong


def test_iptables_tracer_sees_a_missing_reject(desired: DesiredState) -> None:
    text = _without_lines(iptables.restore_text(desired), "-j REJECT")
    wrong = mismatches(iptables.IptablesTracer(desired, text), "iptables")
    assert [w.split(" (")[0] for w in wrong] == [
        "no endpoints: rejected", "no endpoints: rejected, udp", "no ready endpoints: rejected"], wrong


def test_iptables_tracer_fails_on_a_rule_it_does_not_know(desired: DesiredState) -> None:
    text = iptables.restore_text(desired).replace("-m statistic --mode random", "-m nth --every 2", 1)
    with pytest.raises(Unmodelled, match="-m nth"):
        iptables.IptablesTracer(desired, text)


def test_ipvs_tracer_sees_a_missing_filter(desired: DesiredState) -> None:
    # Without KUBE-IPVS-FILTER's reject, a ClusterIP's other ports reach the node's own listeners.
    rules = _without_lines(ipvs.rules_text(), "-j REJECT")
    wrong = mismatches(ipvs.IpvsTracer(desired, rules=rules), "ipvs")
    assert len(wrong) == 1 and "port the service does not have" in wrong[0] and "traced mixed node" in wrong[0], wrong


def test_ipvs_tracer_sees_a_lost_real_server(desired: DesiredState) -> None:
    plan = ipvs.ops(desired)
    lost = next(op for op in plan if isinstance(op, RealOp) and op.key == ("10.96.20.2", 80, "TCP"))
    wrong = mismatches(ipvs.IpvsTracer(desired, tuple(op for op in plan if op != lost)), "ipvs")
    assert len(wrong) == 1 and "endpoints from two slices" in wrong[0], wrong


def test_nftables_tracer_sees_a_lost_affinity_update(desired: DesiredState) -> None:
    text = re.sub(r"update @\S+ \{ ip saddr \}; ", "", nftables.script(desired))
    wrong = mismatches(nftables.NftablesTracer(desired, text), "nftables")
    assert len(wrong) == 1 and "ClientIP affinity sticks" in wrong[0] and "traced backends" in wrong[0], wrong


def test_nftables_tracer_fails_on_a_statement_it_does_not_know(desired: DesiredState) -> None:
    text = nftables.script(desired).replace("numgen random mod", "numgen inc mod", 1)
    with pytest.raises(Unmodelled, match="numgen inc"):
        nftables.NftablesTracer(desired, text)
