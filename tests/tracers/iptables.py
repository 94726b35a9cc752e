"""The iptables mode's rules (pyproxy/dataplane/iptables/render.py: a first, full sync onto tables without our
chains, then partial ones, each restored with --noflush onto what the ones before left) walked for a new flow
entering the node from a pod or a routed client.

Models (see netfilter.py for the rule forms): nat PREROUTING (KUBE-SERVICES -> KUBE-SVC-*, or for external
frontends KUBE-FW-* / KUBE-NODEPORTS -> KUBE-EXT-* -> KUBE-SVC-* or KUBE-SVL-* -> every KUBE-SEP-* the
`statistic` rules can reach -> DNAT), then routing: a flow DNATed to an endpoint, or untranslated to an address
that is not the node's, is forwarded, through filter FORWARD (KUBE-PROXY-FIREWALL, KUBE-FORWARD, KUBE-SERVICES,
KUBE-EXTERNAL-SERVICES: their REJECTs and DROPs); an untranslated flow to a node address goes through filter
INPUT (the same chains' verdicts) to the node's own stack; an untranslated flow nothing stopped is the node's
stack's or leaves the node (common.untranslated). `-m recent` affinity makes a second flow find the first one's
endpoint. IPv6 flows walk the ip6tables-restore inputs (render's family=6), IPv4 ones the iptables ones.
Does not model: the node's own traffic (OUTPUT), POSTROUTING (masquerade changes who answers, not whether),
conntrack beyond a first packet, the affinity timeout, real randomness, ICMP rate limits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.iptables.render import AppliedService, render
from tracers.common import NODE_ADDRESSES, Memory, Packet, Sync, Unmodelled, Verdict, untranslated
from tracers.netfilter import Flow, Tables


def restore_texts(syncs: Sequence[Sync], masquerade: nf.MasqueradeSettings | None = None, family: int = 4
                  ) -> list[str]:
    """The iptables-restore inputs (family 6: ip6tables-restore's) of `syncs` in turn, as the iptables backend's
    apply() renders them: the first sync full, onto tables without our chains (so every jump is inserted), the
    later ones partial."""
    applied: dict[str, AppliedService] = {}
    out = []
    for i, (desired, changed) in enumerate(syncs):
        if i and changed is None:
            raise Unmodelled("a later full sync (it needs iptables-save of the tables so far)")
        plan = render(desired, changed, applied, masquerade or nf.MasqueradeSettings(), None if i else {}, family)
        applied = plan.applied
        out.append(plan.text)
    return out


def forwarded(tables: Tables, flow: Flow, translated: bool) -> Iterator[Verdict]:
    """A flow the node forwards, through filter FORWARD: to its endpoint if `translated`, else away."""
    return _through(tables, "FORWARD", flow, translated)


def _through(tables: Tables, chain: str, flow: Flow, translated: bool) -> Iterator[Verdict]:
    for verdict, f in tables.walk("filter", chain, flow):
        if verdict == "REJECT":
            yield Verdict("refused")
        elif verdict == "DROP":
            yield Verdict("no-answer")
        elif not translated:
            yield untranslated(f.pkt)
        else:
            yield Verdict("dnat", f"{f.pkt.dst}:{f.pkt.port}", f.memory)


class IptablesTracer:
    def __init__(self, texts: Sequence[str], texts6: Sequence[str] = ()) -> None:
        # iptables-restore --noflush, one input after the other; ip6tables-restore's beside them
        self.tables = Tables("".join(texts), local=NODE_ADDRESSES.__contains__)
        self.tables6 = Tables("".join(texts6), local=NODE_ADDRESSES.__contains__)

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        tables = self.tables6 if ":" in pkt.dst else self.tables
        for verdict, f in tables.walk("nat", "PREROUTING", Flow(pkt, memory=memory)):
            if verdict == "DROP":
                raise Unmodelled(f"DROP in nat (iptables refuses it) for {pkt}")
            if verdict != "DNAT" and f.pkt.dst in NODE_ADDRESSES:
                yield from _through(tables, "INPUT", f, False)  # to the node's own stack
            else:
                yield from forwarded(tables, f, verdict == "DNAT")


def tracer(syncs: Sequence[Sync]) -> IptablesTracer:
    return IptablesTracer(restore_texts(syncs), restore_texts(syncs, family=6))
