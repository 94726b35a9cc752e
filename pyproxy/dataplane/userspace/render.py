"""From the desired state to what the userspace proxy must change (pure: no I/O).

How traffic reaches the proxy, without netfilter: every ClusterIP, external IP and load-balancer IP gets a `local`
route in the local table (/32 or /128, on `lo`, routing protocol ROUTE_PROTO), so the node takes their packets as
its own, and the proxy listens on each frontend's address and port itself; a NodePort frontend is already one of
the node's addresses (the model makes one per node-port address of each family). Both families are served alike,
each frontend from its own family's endpoints (the model gives each its family's). Routes rather than
addresses on a dummy device (as the ipvs mode's kube-ipvs0): the kernel inserts a route in O(log n) where each
address walks the device's others (1.6 ms an address at 2,000, measured), a kernel without the dummy driver (this
project's test machine) has them too, and they are no node addresses (no NodePorts on them). Per frontend:

- endpoints to serve: a listener (TCP) or socket (UDP) on ip:port, and a `Route` the proxy picks endpoints from;
- no usable endpoint at all: no listener, so the kernel answers as for any closed local port: a TCP reset, or an
  ICMP port unreachable for UDP (upstream's REJECT);
- traffic to drop (internalTrafficPolicy Local without a local endpoint; sources outside loadBalancerSourceRanges;
  externalTrafficPolicy Local without a local endpoint, for sources outside the cluster): a listener whose classic
  BPF socket filter (sockfilter.py) drops those packets before any handshake, so the client waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pyproxy.dataplane.userspace.sockfilter import Insn, compile_admission
from pyproxy.model.objects import family_of
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

DEVICE = "lo"
ROUTE_PROTO = 203
"""The routing protocol number of pyproxy's local routes (`ip route show table local proto 203`): how a start and
cleanup tell them from the kernel's own."""


@dataclass(frozen=True)
class Route:
    """Where the proxy sends a new flow (TCP connection, UDP session) of one frontend."""

    name: str
    """The Service port, for logs."""
    backends: tuple[Backend, ...]
    """For every source, or (with `external_backends`) for the node's own and the pods' flows."""
    external_backends: tuple[Backend, ...] | None = None
    """externalTrafficPolicy Local: the endpoints for sources outside the cluster (neither the node nor, with
    --cluster-cidr, a pod); None: `backends` serve every source."""
    affinity_seconds: int = 0
    """ClientIP affinity: a client's new flows go where its last one went, while that is this recent."""
    known: frozenset[Backend] = frozenset()
    """Every endpoint of the slices: a UDP session to an endpoint outside them is ended, and the client's next
    datagram starts a new one."""


@dataclass(frozen=True)
class Entry:
    service: str
    route: Route
    local: bool
    """The frontend's address gets a local route (all kinds but NodePort)."""
    listen: bool
    """A socket listens on the frontend (else the kernel refuses its flows)."""
    program: tuple[Insn, ...] | None = None
    """The listener's socket filter; None takes every source."""


@dataclass(frozen=True)
class State:
    """What the proxy runs: every frontend's entry, and the addresses with a local route of ROUTE_PROTO."""

    entries: Mapping[Frontend, Entry] = field(default_factory=dict)
    addresses: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Plan:
    add_addresses: tuple[str, ...]
    """Added before any listener opens: a socket cannot bind an address the node does not have."""
    close: tuple[Frontend, ...]
    """Listeners to close (their established connections and UDP sessions go on until they end)."""
    routes: Mapping[Frontend, Route | None]
    """New or changed routes; None: the frontend is gone."""
    refilter: Mapping[Frontend, tuple[Insn, ...] | None]
    """Open listeners whose filter changes."""
    open: Mapping[Frontend, tuple[Insn, ...] | None]
    """Listeners to open, with their filters."""
    del_addresses: tuple[str, ...]
    """Removed once no listener uses them."""
    state: State
    """The state once all of it is done."""

    @property
    def empty(self) -> bool:
        return not (self.add_addresses or self.close or self.routes or self.refilter or self.open
                    or self.del_addresses)


def entry(service: str, sp: ServicePortState, cluster_cidrs: Sequence[str] = ()) -> Entry:
    """The proxy's entry for one frontend of the desired state; `cluster_cidrs`: --cluster-cidr's, at most one of
    each family (the frontend's filter uses its family's)."""
    external = None
    if sp.kind.external and sp.external_backends != sp.backends:
        external = sp.external_backends
    route = Route(sp.display_name, sp.backends, external, sp.session_affinity_seconds,
                  frozenset(sp.known_backends) | frozenset(sp.backends) | frozenset(sp.external_backends))
    listen = bool(sp.backends or sp.external_backends or sp.drop)
    program = None
    if listen:
        pods = next((c for c in cluster_cidrs if family_of(c) == sp.family), None)
        program = compile_admission(family=sp.family, drop_all=sp.drop, source_ranges=sp.source_ranges,
                                    internal_only=external == (), cluster_cidr=pods)
    return Entry(service, route, sp.kind is not FrontendKind.NODE_PORT, listen, program)


def render(state: State, services: Mapping[str, Sequence[ServicePortState]], *, full: bool,
           cluster_cidrs: Sequence[str] = ()) -> Plan:
    """What brings `state` to the desired one: `services` are every Service (full) or the changed ones, each with
    its frontends (none: the Service is gone)."""
    if full:
        entries: dict[Frontend, Entry] = {}
    else:
        entries = {f: e for f, e in state.entries.items() if e.service not in services}
    for key, states in services.items():
        for sp in states:
            entries[sp.frontend] = entry(key, sp, cluster_cidrs)
    addresses = frozenset(f.ip for f, e in entries.items() if e.local)
    old = state.entries
    close = tuple(sorted(f for f, e in old.items() if e.listen and not (f in entries and entries[f].listen)))
    opened = {f: e.program for f, e in sorted(entries.items()) if e.listen and not (f in old and old[f].listen)}
    refilter = {f: e.program for f, e in sorted(entries.items())
                if e.listen and f in old and old[f].listen and old[f].program != e.program}
    routes: dict[Frontend, Route | None] = {f: None for f in sorted(old.keys() - entries.keys())}
    routes.update((f, e.route) for f, e in sorted(entries.items()) if f not in old or old[f].route != e.route)
    return Plan(
        add_addresses=tuple(sorted(addresses - state.addresses)),
        close=close,
        routes=routes,
        refilter=refilter,
        open=opened,
        del_addresses=tuple(sorted(state.addresses - addresses)),
        state=State(entries, addresses),
    )
