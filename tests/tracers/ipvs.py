"""The ipvs mode (pyproxy/dataplane/ipvs/render.py for a run of syncs, each rendered from what the ops before
left, and the iptables rules of pyproxy/dataplane/ipvs/backend.py with their jumps) followed for a new flow
entering the node.

Models: the plans' ops applied in order (virtual and real servers, kube-ipvs0's addresses, ipset members);
nat PREROUTING walked over those ipsets (an IPv6 flow: ip6tables' rules over the KUBE-6-* sets, each table seeing
only its family's sets, as the kernel's set match does) (netfilter.py; `-m addrtype LOCAL` is a node address or one on
kube-ipvs0); a destination on kube-ipvs0 or a node address is the node's own, so the flow goes through filter
INPUT (KUBE-IPVS-FIREWALL drops sources outside a load balancer's source ranges and outside flows to a Local
frontend without a local endpoint; KUBE-IPVS-FILTER rejects a new flow to a kube-ipvs0 address on a port that
is no frontend's) to IPVS: the virtual server of (address, port, protocol) sends it to any real server of
weight > 0, a persistent one (ClientIP affinity) sends a second flow from the client where the first went, and
one with no such real server refuses it (ip_vs_leave's port unreachable). A local flow no virtual server takes
reaches the node's own stack: on kube-ipvs0 "node" (which no case expects), on a node address refused, as
nothing listens there (common.untranslated). Other destinations are forwarded through filter FORWARD and
nothing answers them.
Does not model: the kernel's IPVS (schedulers: every real server of weight > 0 is a possible pick; connection
counts, draining), conntrack, timeouts, masquerade (POSTROUTING; its marks are walked, not checked), the node's
own traffic (OUTPUT and IPVS's local-out hook).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.ipvs import render as ipvs_render
from pyproxy.dataplane.ipvs.backend import JUMPS, IpvsDataplane, IpvsSettings, rule_edits
from pyproxy.dataplane.ipvs.render import Op
from pyproxy.model.objects import IPV4, IPV6, family_of
from pyproxy.model.state import Backend
from tracers.common import NODE_ADDRESSES, Memory, Packet, Sync, Unmodelled, Verdict, as_served, untranslated
from tracers.iptables import forwarded
from tracers.netfilter import Flow, Tables


class Kernel:
    """IPVS, kube-ipvs0's addresses and the ipsets, as the ops leave them (no connections: nothing drains)."""

    def __init__(self) -> None:
        self.virtuals: dict[ipvs_render.VSKey, tuple[str, int, dict[Backend, int]]] = {}
        """(address, port, protocol) -> (scheduler, persistence seconds, {real server: weight})."""
        self.addresses: set[str] = set()
        self.members: dict[str, set[str]] = {name: set() for name in ipvs_render.SET_TYPES}

    def run(self, op: Op) -> None:
        if isinstance(op, ipvs_render.VirtualOp):
            if op.verb == "del":
                del self.virtuals[op.key]
            else:
                self.virtuals[op.key] = (op.scheduler, op.timeout, self.virtuals.get(op.key, ("", 0, {}))[2])
        elif isinstance(op, ipvs_render.RealOp):
            reals = self.virtuals[op.key][2]
            if op.verb == "del":
                del reals[op.backend]
            else:
                reals[op.backend] = op.weight
        elif isinstance(op, ipvs_render.AddressOp):
            (self.addresses.add if op.verb == "add" else self.addresses.remove)(op.ip)
        elif isinstance(op, ipvs_render.SetOp) and op.name in self.members:
            (self.members[op.name].add if op.verb == "add" else self.members[op.name].remove)(op.entry)
        else:
            raise Unmodelled(f"op {op}")

    def observed(self) -> ipvs_render.Observed:
        return ipvs_render.Observed(
            {k: ipvs_render.Virtual(sched, timeout, {b: ipvs_render.Real(w) for b, w in reals.items()})
             for k, (sched, timeout, reals) in self.virtuals.items()},
            frozenset(self.addresses), {name: frozenset(m) for name, m in self.members.items()})


def plans(syncs: Sequence[Sync]) -> list[tuple[Op, ...]]:
    """The ops of `syncs` in turn, as the ipvs backend's apply() renders them from what the kernel holds (the
    frontends of the families it renders: the proxier leaves out the others)."""
    kernel, memory, out = Kernel(), ipvs_render.Memory(), []
    for desired, changed in as_served(syncs, IpvsDataplane(IpvsSettings()).ip_families):
        full = changed is None
        keys = set(desired.services) | set(memory.owners.values()) if changed is None else changed
        plan = ipvs_render.render(kernel.observed(), memory, {k: desired.services.get(k, ()) for k in keys},
                                  full=full, options=ipvs_render.Options(), now=0.0,
                                  node_addresses=desired.node.nodeport_addresses)
        for op in plan.ops:
            kernel.run(op)
        memory = plan.memory
        out.append(plan.ops)
    return out


def rules_text(masquerade: nf.MasqueradeSettings | None = None, family: int = IPV4) -> str:
    """The iptables-restore input (family 6: ip6tables-restore's) of the first sync: the mode's chains and the
    jumps into them."""
    edits = rule_edits(masquerade or nf.MasqueradeSettings(), family)
    for jump in JUMPS:
        edits[jump.table].insert(jump)
    return nf.restore_input(edits)


class IpvsTracer:
    def __init__(self, plans: Sequence[tuple[Op, ...]], rules: str | None = None, rules6: str | None = None) -> None:
        self.kernel = Kernel()
        for op in (op for ops in plans for op in ops):
            self.kernel.run(op)
        self.tables = {family: Tables(text if text is not None else rules_text(family=family),
                                      self._ipsets(family), self._local)
                       for family, text in ((IPV4, rules), (IPV6, rules6))}

    def _ipsets(self, family: int) -> dict[str, tuple[str, frozenset[str]]]:
        return {name: (kind, frozenset(self.kernel.members[name])) for name, kind in ipvs_render.SET_TYPES.items()
                if ipvs_render.SET_FAMILIES[name] == family}

    def _local(self, ip: str) -> bool:
        """`-m addrtype --*-type LOCAL`: the node's addresses, those on kube-ipvs0 and loopback."""
        return ip in NODE_ADDRESSES or ip in self.kernel.addresses or ip.startswith("127.") or ip == "::1"

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        tables = self.tables[family_of(pkt.dst)]
        for verdict, f in tables.walk("nat", "PREROUTING", Flow(pkt, memory=memory)):
            if verdict == "DROP":
                yield Verdict("no-answer")
            elif verdict == "DNAT":
                raise Unmodelled("a DNAT rule in ipvs mode")
            elif self._local(f.pkt.dst):
                yield from self._input(tables, f)
            else:
                yield from forwarded(tables, f, translated=False)

    def _input(self, tables: Tables, flow: Flow) -> Iterator[Verdict]:
        for verdict, f in tables.walk("filter", "INPUT", flow):
            if verdict in ("REJECT", "DROP"):
                yield Verdict("refused" if verdict == "REJECT" else "no-answer")
                continue
            pkt = f.pkt
            virtual = self.kernel.virtuals.get((pkt.dst, pkt.port, pkt.proto.upper()))
            if virtual is None:
                # The node's own stack: a node address's listeners refuse the table's ports; an address on
                # kube-ipvs0 must not get there (KUBE-IPVS-FILTER).
                yield Verdict("node") if pkt.dst in self.kernel.addresses else untranslated(pkt)
                continue
            _, persistence, weights = virtual
            reals = {str(b): w for b, w in weights.items()}
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


def tracer(syncs: Sequence[Sync]) -> IpvsTracer:
    return IpvsTracer(plans(syncs))
