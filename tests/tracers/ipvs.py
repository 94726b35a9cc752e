"""The ipvs mode (pyproxy/dataplane/ipvs/render.py on an empty kernel, and the iptables rules of
pyproxy/dataplane/ipvs/backend.py with their jumps) followed for a new flow entering the node.

Models: the plan's ops applied in order (virtual and real servers, kube-ipvs0's addresses, ipset members);
nat PREROUTING walked over those ipsets (netfilter.py); a destination on kube-ipvs0 is the node's own, so the
flow goes through filter INPUT (KUBE-IPVS-FILTER rejects a new flow to a ClusterIP on a port that is no
Service's) to IPVS: the virtual server of (address, port, protocol) sends it to any real server of weight > 0,
a persistent one (ClientIP affinity) sends a second flow from the client where the first went, and one with
no such real server refuses it (ip_vs_leave's port unreachable); a local flow no virtual server takes reaches
the node's own stack ("node", which no case expects). Other destinations are forwarded through filter FORWARD
and nothing answers them.
Does not model: the kernel's IPVS (schedulers: every real server of weight > 0 is a possible pick; connection
counts, draining), conntrack, timeouts, masquerade (POSTROUTING), the node's own traffic (OUTPUT).
"""

from __future__ import annotations

from collections.abc import Iterator

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.ipvs import render as ipvs_render
from pyproxy.dataplane.ipvs.backend import JUMPS, rule_edits
from pyproxy.dataplane.ipvs.render import Op
from pyproxy.model.state import DesiredState
from tracers.common import Memory, Packet, Unmodelled, Verdict
from tracers.iptables import forwarded
from tracers.netfilter import Flow, Tables


def ops(desired: DesiredState) -> tuple[Op, ...]:
    """The first (full) sync's plan onto a kernel with nothing of ours."""
    return ipvs_render.render(ipvs_render.Observed(), ipvs_render.Memory(), desired.services, full=True,
                              options=ipvs_render.Options(), now=0.0).ops


def rules_text(masquerade: nf.MasqueradeSettings | None = None) -> str:
    """The iptables-restore input of the first sync: the mode's chains and the jumps into them."""
    edits = rule_edits(masquerade or nf.MasqueradeSettings())
    for jump in JUMPS:
        edits[jump.table].insert(jump)
    return nf.restore_input(edits)


class IpvsTracer:
    def __init__(self, desired: DesiredState, plan: tuple[Op, ...] | None = None, rules: str | None = None) -> None:
        self.virtuals: dict[tuple[str, int, str], tuple[int, dict[str, int]]] = {}
        """(address, port, protocol) -> (persistence seconds, {"ip:port": weight})."""
        self.addresses: set[str] = set()
        members: dict[str, set[str]] = {name: set() for name in ipvs_render.SET_TYPES}
        for op in ops(desired) if plan is None else plan:
            if isinstance(op, ipvs_render.VirtualOp) and op.verb in ("add", "set"):
                self.virtuals[op.key] = (op.timeout, self.virtuals.get(op.key, (0, {}))[1])
            elif isinstance(op, ipvs_render.RealOp) and op.verb in ("add", "set"):
                self.virtuals[op.key][1][str(op.backend)] = op.weight
            elif isinstance(op, ipvs_render.AddressOp) and op.verb == "add":
                self.addresses.add(op.ip)
            elif isinstance(op, ipvs_render.SetOp) and op.verb == "add":
                members[op.name].add(op.entry)
            else:
                raise Unmodelled(f"op {op} in a first sync")
        ipsets = {name: (kind, frozenset(members[name])) for name, kind in ipvs_render.SET_TYPES.items()}
        self.tables = Tables(rules if rules is not None else rules_text(), ipsets)

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        for verdict, f in self.tables.walk("nat", "PREROUTING", Flow(pkt, memory=memory)):
            if verdict == "DROP":
                yield Verdict("no-answer")
            elif verdict == "DNAT":
                raise Unmodelled("a DNAT rule in ipvs mode")
            elif f.pkt.dst in self.addresses:
                yield from self._local(f)
            else:
                yield from forwarded(self.tables, f, translated=False)

    def _local(self, flow: Flow) -> Iterator[Verdict]:
        for verdict, f in self.tables.walk("filter", "INPUT", flow):
            if verdict in ("REJECT", "DROP"):
                yield Verdict("refused" if verdict == "REJECT" else "no-answer")
                continue
            pkt = f.pkt
            virtual = self.virtuals.get((pkt.dst, pkt.port, pkt.proto.upper()))
            if virtual is None:
                yield Verdict("node")
                continue
            persistence, reals = virtual
            template = ("template", pkt.src, pkt.dst, str(pkt.port), pkt.proto)
            earlier = [fact[-1] for fact in f.memory if fact[:-1] == template and reals.get(fact[-1], 0) > 0]
            if persistence and earlier:
                yield Verdict("dnat", earlier[0], f.memory)
                continue
            usable = [real for real, weight in reals.items() if weight > 0]
            if not usable:
                yield Verdict("refused")
            for real in usable:
                yield Verdict("dnat", real, f.memory | {(*template, real)} if persistence else f.memory)
