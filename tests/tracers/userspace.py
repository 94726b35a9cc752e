"""The userspace mode (pyproxy/dataplane/userspace/render.py for a run of syncs, each rendered from the state the
plan before left) followed for a new flow entering the node.

Models, for both families (an IPv6 packet meets IPv6 frontends only: their sockets are IPV6_V6ONLY): the Service
addresses the plans give local routes (local, as the node's own addresses are); a listener per frontend with its
classic BPF socket filter, run by sockfilter.run on the packet's source as arriving on a device other than lo;
the route's endpoints for the source (externalTrafficPolicy Local's `external_backends` for a source that is
neither the node nor, with --cluster-cidr, a pod: the tracer's sources are the client and pods, and the table runs
without --cluster-cidr, so there every source is outside); ClientIP affinity (a second flow from the client goes
where the first went). A local destination without a listener is refused by the node's stack; any
other destination is routed on, and nothing answers.
Does not model: the proxy's round robin order (every endpoint is a possible pick), connect retries (every endpoint
answers in the table), UDP sessions, the node's own traffic.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence

from pyproxy.dataplane.userspace import render as us_render
from pyproxy.dataplane.userspace import sockfilter
from pyproxy.dataplane.userspace.backend import UserspaceDataplane, UserspaceSettings
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Frontend
from tracers.common import Memory, Packet, Sync, Verdict, as_served, untranslated

ENTERING_IFINDEX = 2
"""A device index other than lo's: the table's traced flows come from the client's link or a pod's."""


def plans(syncs: Sequence[Sync], cluster_cidrs: Sequence[str] = ()) -> list[us_render.Plan]:
    """The plans of `syncs` in turn, each rendered from the state the one before left (the frontends of the
    families the mode renders: the proxier leaves out the others)."""
    state, out = us_render.State(), []
    for desired, changed in as_served(syncs, UserspaceDataplane(UserspaceSettings()).ip_families):
        keys = desired.services.keys() if changed is None else changed
        plan = us_render.render(state, {k: desired.services.get(k, ()) for k in keys}, full=changed is None,
                                cluster_cidrs=cluster_cidrs)
        state = plan.state
        out.append(plan)
    return out


class Proxy:
    """The listeners, filters, routes and addresses the plans leave, as the proxy and the kernel would hold them."""

    def __init__(self, plans: Sequence[us_render.Plan], cluster_cidrs: Sequence[str] = ()) -> None:
        self.cluster = tuple(ipaddress.ip_network(c) for c in cluster_cidrs)
        self.addresses: set[str] = set()
        self.listeners: dict[Frontend, tuple[sockfilter.Insn, ...] | None] = {}
        self.routes: dict[Frontend, us_render.Route] = {}
        for plan in plans:
            self.addresses |= set(plan.add_addresses)
            for f in plan.close:
                del self.listeners[f]
            for f, route in plan.routes.items():
                if route is None:
                    self.routes.pop(f, None)
                else:
                    self.routes[f] = route
            for f, program in plan.refilter.items():
                assert f in self.listeners, f"refilter of {f}, which does not listen"
                self.listeners[f] = program
            for f, program in plan.open.items():
                assert f not in self.listeners, f"{f} opened twice"
                self.listeners[f] = program
            self.addresses -= set(plan.del_addresses)

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        frontend = Frontend(pkt.dst, pkt.port, Protocol(pkt.proto.upper()))
        if frontend not in self.listeners:
            yield Verdict("refused") if pkt.dst in self.addresses else untranslated(pkt)
            return
        program = self.listeners[frontend]
        if program is not None and not sockfilter.run(program, pkt.src, ENTERING_IFINDEX):
            yield Verdict("no-answer")
            return
        route = self.routes[frontend]
        src = ipaddress.ip_address(pkt.src)
        inside = any(src in net for net in self.cluster if net.version == src.version)
        pool = route.backends if route.external_backends is None or inside else route.external_backends
        fact = ("affinity", str(frontend), pkt.src)
        earlier = [f[-1] for f in memory if f[:-1] == fact and f[-1] in {str(b) for b in pool}]
        if route.affinity_seconds and earlier:
            yield Verdict("dnat", earlier[0], memory)
            return
        for backend in pool:
            yield Verdict("dnat", str(backend), memory | {(*fact, str(backend))} if route.affinity_seconds else memory)


def tracer(syncs: Sequence[Sync]) -> Proxy:
    return Proxy(plans(syncs))
