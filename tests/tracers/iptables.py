"""The iptables mode's rules (pyproxy/dataplane/iptables/render.py, a full sync onto empty tables) walked for a
new flow entering the node from a pod or a routed client.

Models (see netfilter.py for the rule forms): nat PREROUTING (KUBE-SERVICES -> KUBE-SVC-* -> every KUBE-SEP-*
the `statistic` rules can reach -> DNAT), then routing: the ClusterIPs are not the node's, so the flow is
forwarded, through filter FORWARD (KUBE-FORWARD, and KUBE-SERVICES' REJECT of frontends without endpoints) to
the endpoint it was DNATed to; an untranslated flow leaves the node and nothing answers. `-m recent` affinity
makes a second flow find the first one's endpoint.
Does not model: the node's own traffic (OUTPUT), POSTROUTING (masquerade changes who answers, not whether),
conntrack beyond a first packet, the affinity timeout, real randomness, ICMP rate limits.
"""

from __future__ import annotations

from collections.abc import Iterator

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.iptables.render import render
from pyproxy.model.state import DesiredState
from tracers.common import Memory, Packet, Verdict
from tracers.netfilter import Flow, Tables


def restore_text(desired: DesiredState, masquerade: nf.MasqueradeSettings | None = None) -> str:
    """The first sync's iptables-restore input: everything, onto tables without our chains."""
    return render(desired, None, {}, masquerade or nf.MasqueradeSettings(), {}).text


def forwarded(tables: Tables, flow: Flow, translated: bool) -> Iterator[Verdict]:
    """A flow the node forwards, through filter FORWARD: to its endpoint if `translated`, else away."""
    for verdict, f in tables.walk("filter", "FORWARD", flow):
        if verdict == "REJECT":
            yield Verdict("refused")
        elif verdict == "DROP" or not translated:
            yield Verdict("no-answer")
        else:
            yield Verdict("dnat", f"{f.pkt.dst}:{f.pkt.port}", f.memory)


class IptablesTracer:
    def __init__(self, desired: DesiredState, text: str | None = None) -> None:
        self.tables = Tables(text if text is not None else restore_text(desired))

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        for verdict, f in self.tables.walk("nat", "PREROUTING", Flow(pkt, memory=memory)):
            if verdict == "DROP":
                yield Verdict("no-answer")
            else:
                yield from forwarded(self.tables, f, verdict == "DNAT")
