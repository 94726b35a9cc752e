"""From Services, EndpointSlices and this node to the desired state, with upstream kube-proxy's semantics.

Every rule is decided here, once; the dataplane backends only render what it says:

- the frontends of each Service port: each ClusterIP; for NodePort and LoadBalancer Services, each node-port
  address (an input: `NodeInputs.nodeport_addresses`) with the port's nodePort; each external IP; for
  LoadBalancer Services, each ingress IP. Per family, as upstream's per-family proxiers (kube-proxy's
  MetaProxier): a Service has the other frontends of a family (IPv4, IPv6) only when it has a ClusterIP of it,
  and each frontend uses only the endpoints of its own family's EndpointSlices, the source ranges of its family
  and the node's primary address of it. One Service's frontends are unique: of two that are one address,
  port and protocol, the first kind (ClusterIP, ExternalIP, LoadBalancer, NodePort: upstream's rule order) stays;
- each frontend's policy (ServicePortState): the endpoints new flows from inside and from outside the cluster
  may use (ready ones, else serving and terminating ones; with topology-aware routing the ready ones hinted
  for this node's zone; externalTrafficPolicy Local: this node's for outside sources; internalTrafficPolicy
  Local: this node's for the ClusterIP, dropped when it has none while the cluster has some), whether it
  masquerades, its source ranges, the health-check node port;
- which Service serves a frontend two Services claim: the one already serving it keeps it; among new
  claimants, the first by `namespace/name`. The others wait (`DesiredState.waiting`) and the first waiting
  gets it once it is free, in the same update or a later one; a renderer may take frontends as unique.

Pure functions: the sync loop calls `update_desired_state` with the Service keys the trackers reported
changed, and every other Service's entry is reused as is (the Services a freed frontend goes to are
recomputed too, and named in `also_changed`).
"""

from __future__ import annotations

import ipaddress
import logging
import operator
from collections.abc import Callable, Collection, Iterable, Mapping

from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import (
    FAMILY_NAMES,
    IPV4,
    PREFER_CLOSE,
    PREFER_SAME_ZONE,
    EndpointSlice,
    Service,
    ServicePort,
    TrafficPolicy,
    family_of,
)
from pyproxy.model.state import Backend, DesiredState, Frontend, FrontendKind, RejectedClaim, ServicePortState

# ExternalName Services are DNS-only; every other type gets a ClusterIP frontend.
_PROXIED_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer"})
_NODE_PORT_TYPES = frozenset({"NodePort", "LoadBalancer"})
_KIND_RANK = {kind: i for i, kind in enumerate(FrontendKind)}
_ANY_SOURCE = frozenset({"0.0.0.0/0", "::/0"})
_NO_NODE = NodeInputs()
_by_frontend = operator.attrgetter("frontend")
_TOPOLOGY_DISTRIBUTIONS = frozenset({PREFER_CLOSE, PREFER_SAME_ZONE})
_TOPOLOGY_MODES = frozenset({"Auto", "auto"})

log = logging.getLogger(__name__)


# Backend(ip, port) without the Python-level __new__ a NamedTuple has: this loop makes one per endpoint, and a
# cold start at 10,000 Services x 10 endpoints makes 100,000.
_new_backend = tuple.__new__


def _topology_zone(svc: Service, node: NodeInputs) -> str | None:
    """The zone whose hinted endpoints the Service's cluster endpoints are narrowed to, if the endpoints allow
    it (`_PortBackends`): this node's, when the Service asks for topology-aware routing (upstream's
    canUseTopology: spec.trafficDistribution PreferClose, or the topology-mode annotation Auto) and the node
    has a zone label; else None."""
    if not node.zone or (svc.traffic_distribution not in _TOPOLOGY_DISTRIBUTIONS
                         and svc.topology_mode not in _TOPOLOGY_MODES):
        return None
    return node.zone


class _PortBackends:
    """The backends of one service port, deduplicated and sorted: `usable` (the ready ones, else the serving and
    terminating ones), `known` (all; the same tuple as `usable` when every one is ready, the common case) and,
    when asked for, `local` (the usable ones among those on node `node_name`; None is no node's) and
    `local_ready` (whether those are ready ones).

    With a `zone` (`_topology_zone`), `usable` is narrowed to the ready ones hinted for it, as upstream's
    CategorizeEndpoints does for the cluster endpoints: only when every ready one has a zone hint and one is
    hinted for `zone`, so a Service never loses its endpoints to topology. The serving-and-terminating
    fallback (nothing ready) and `local` ignore hints, as upstream's do. `skipped`: why a `zone` did not
    narrow them, in upstream's words ("" when it did, or was not asked to)."""

    __slots__ = ("usable", "known", "local", "local_ready", "skipped")

    def __init__(self, port: ServicePort, slices: Iterable[EndpointSlice], local: bool, node_name: str | None,
                 zone: str | None = None, family: int = IPV4):
        ready: set[Backend] = set()
        known: set[Backend] = set()
        draining: set[Backend] = set()
        """Serving and terminating, not ready: usable only when nothing is ready."""
        on_node: set[Backend] = set()
        in_zone: set[Backend] = set()
        """Ready and hinted for `zone`."""
        unhinted = False
        """A ready one has no zone hint: no topology (upstream: "one or more endpoints is missing a zone hint")."""
        address_type = FAMILY_NAMES[family]
        for eps in slices:
            if eps.address_type != address_type:  # another family's, or FQDN
                continue
            # Match by (name, protocol), not targetPort: the slice controller already resolved targetPort
            # (named ones included) into the slice ports' numbers, and names the slice ports after the
            # service ports.
            for ep_port in eps.ports:
                if ep_port.name != port.name or ep_port.protocol != port.protocol:
                    continue
                number = ep_port.port
                for ep in eps.endpoints:
                    # Like upstream, only the first address counts: the API says they are fungible.
                    if not ep.addresses:
                        continue
                    backend: Backend = _new_backend(Backend, (ep.addresses[0], number))
                    known.add(backend)
                    if ep.ready:
                        ready.add(backend)
                        if zone is not None:
                            if not ep.zone_hints:
                                unhinted = True
                            elif zone in ep.zone_hints:
                                in_zone.add(backend)
                    elif ep.serving and ep.terminating:
                        draining.add(backend)
                    if local and node_name is not None and ep.node_name == node_name:
                        on_node.add(backend)
        self.known = tuple(sorted(known))
        self.usable = self.known if len(ready) == len(known) else tuple(sorted(ready or draining))
        self.skipped = ""
        if zone is not None and ready:
            if unhinted:
                self.skipped = "one or more endpoints is missing a zone hint"
            elif not in_zone:
                self.skipped = f"no endpoint is hinted for zone {zone}"
            elif len(in_zone) < len(ready):
                self.usable = tuple(sorted(in_zone))
        local_ready = on_node & ready
        self.local_ready = bool(local_ready)
        self.local = tuple(sorted(local_ready or on_node & draining)) if local else ()


def _unquiet(backends: tuple[Backend, ...], quiet: frozenset[str]) -> tuple[Backend, ...]:
    """`backends` but those whose address has weight 0."""
    return tuple(b for b in backends if b.ip not in quiet)


def _quiesced(backends: tuple[Backend, ...], quiet: frozenset[str]) -> tuple[Backend, ...]:
    """Those of `backends` whose address has weight 0."""
    return tuple(b for b in backends if b.ip in quiet) if quiet else ()


def _source_ranges(svc: Service, node: NodeInputs, family: int) -> tuple[tuple[str, ...], bool]:
    """The source ranges of the Service's load-balancer frontends of `family` (see ServicePortState.source_ranges):
    the ranges of that family only, as upstream's per-family proxiers (none of it: any source); and whether they
    leave the node out (ServicePortState.node_denied)."""
    ranges = tuple(r for r in svc.load_balancer_source_ranges if family_of(r) == family)
    if not ranges or not _ANY_SOURCE.isdisjoint(ranges):
        return (), False
    primary = node.primary_ip if family == IPV4 else node.primary_ipv6
    if primary and any(ipaddress.ip_address(primary) in ipaddress.ip_network(r) for r in ranges):
        host = 32 if family == IPV4 else 128
        ranges += tuple(f"{ip}/{host}" for ip in svc.load_balancer_ips
                        if family_of(ip) == family and f"{ip}/{host}" not in ranges)
        return ranges, False
    return ranges, bool(primary)


def _external_frontends(svc: Service, port: ServicePort, node: NodeInputs, family: int
                        ) -> list[tuple[FrontendKind, Frontend]]:
    """Every frontend of `family` of one service port but its ClusterIPs, by kind."""
    number, proto = port.port, port.protocol
    frontends = [(FrontendKind.EXTERNAL_IP, Frontend(ip, number, proto)) for ip in svc.external_ips
                 if family_of(ip) == family]
    if svc.type == "LoadBalancer":
        frontends += [(FrontendKind.LOAD_BALANCER, Frontend(ip, number, proto)) for ip in svc.load_balancer_ips
                      if family_of(ip) == family]
    if svc.type in _NODE_PORT_TYPES and port.node_port:
        frontends += [(FrontendKind.NODE_PORT, Frontend(ip, port.node_port, proto)) for ip in node.nodeport_addresses
                      if family_of(ip) == family]
    return frontends


def compute_service_state(
    svc: Service | None, slices: Iterable[EndpointSlice], node: NodeInputs | None = None
) -> tuple[ServicePortState, ...]:
    """Every frontend one Service claims, with its policy, sorted by frontend; () when it has nothing to serve:
    absent, ExternalName, headless or without a ClusterIP (as upstream, a Service without one serves none of
    its other frontends either; per family: without a ClusterIP of a family, none of that family's)."""
    if svc is None or svc.type not in _PROXIED_TYPES or not svc.cluster_ips:
        return ()
    node = node or _NO_NODE
    slices = tuple(slices)
    affinity = svc.session_affinity_timeout if svc.session_affinity == "ClientIP" else 0
    cluster_policy = svc.external_traffic_policy is TrafficPolicy.CLUSTER
    internal_local = svc.internal_traffic_policy is TrafficPolicy.LOCAL
    health = None if cluster_policy or svc.type != "LoadBalancer" else svc.health_check_node_port
    scheduler, weights = svc.scheduler, svc.weights
    quiet = frozenset(ip for ip, weight in weights if weight == 0)
    zone = _topology_zone(svc, node)
    states: list[ServicePortState] = []
    for cluster_ip in svc.cluster_ips:  # at most one per family (the conversion checks it)
        family = family_of(cluster_ip)
        ranges, node_denied = _source_ranges(svc, node, family) if svc.type == "LoadBalancer" else ((), False)
        states += _family_states(svc, cluster_ip, family, slices, node, ranges, node_denied, affinity, cluster_policy,
                                 internal_local, health, scheduler, weights, quiet, zone)
    if len(states) > 1 and len({st.frontend for st in states}) < len(states):
        # One frontend claimed twice by the Service itself: the first kind stays (sorted() is stable).
        unique: dict[Frontend, ServicePortState] = {}
        for st in sorted(states, key=lambda st: _KIND_RANK[st.kind]):
            unique.setdefault(st.frontend, st)
        states = list(unique.values())
    states.sort(key=_by_frontend)
    return tuple(states)


def _family_states(svc: Service, cluster_ip: str, family: int, slices: tuple[EndpointSlice, ...], node: NodeInputs,
                   ranges: tuple[str, ...], node_denied: bool, affinity: int, cluster_policy: bool,
                   internal_local: bool,
                   health: int | None, scheduler: str, weights: tuple[tuple[str, int], ...], quiet: frozenset[str],
                   zone: str | None) -> list[ServicePortState]:
    """The frontends of one family of a Service (`cluster_ip` its ClusterIP of that family), with that family's
    endpoints only."""
    key = svc.key
    states: list[ServicePortState] = []
    # Positional arguments, in ServicePortState's order: a cold start builds one per frontend of every Service.
    for port in svc.ports:
        external = _external_frontends(svc, port, node, family)
        b = _PortBackends(port, slices, internal_local or (bool(external) and not cluster_policy), node.name, zone,
                          family)
        usable, known, local = b.usable, b.known, b.local
        # Weight 0 (pyproxy.io/weights) quiesces an endpoint, IPVS's way: no new flow in any mode; it stays known,
        # so its established flows go on.
        if quiet:
            usable, local = _unquiet(usable, quiet), _unquiet(local, quiet)
        if b.skipped:
            log.debug("%s: skipping topology aware endpoint filtering since %s", key, b.skipped)
        # internalTrafficPolicy applies to the ClusterIP only (external frontends' in-cluster sources keep every
        # endpoint, as upstream's short circuit does).
        internal = local if internal_local else usable
        drop = internal_local and not internal and bool(usable)
        quiesced = _quiesced(b.local if internal_local else b.usable, quiet)
        states.append(ServicePortState(key, port.name, Frontend(cluster_ip, port.port, port.protocol), internal, known,
                                       affinity, FrontendKind.CLUSTER_IP, (), False, (), health, False, drop,
                                       scheduler, weights, quiesced))
        if external:
            outside = usable if cluster_policy else local
            ready = not cluster_policy and b.local_ready
            quiesced = _quiesced(b.usable if cluster_policy or not b.local else b.local, quiet)
            states += [ServicePortState(key, port.name, fe, usable, known, affinity, kind, outside, cluster_policy,
                                        ranges if kind is FrontendKind.LOAD_BALANCER else (), health, ready, False,
                                        scheduler, weights, quiesced,
                                        node_denied and kind is FrontendKind.LOAD_BALANCER)
                       for kind, fe in external]
    return states


class _Update:
    """One update of a DesiredState: the indexes copied from the previous state, changed in place."""

    def __init__(self, prev: DesiredState) -> None:
        self.prev = prev
        self.served = dict(prev.services)
        self.waiting = dict(prev.waiting)
        self.holders = dict(prev.holders)
        self.claimants = dict(prev.claimants)
        self.rejected: list[RejectedClaim] = []
        self.promoted: dict[str, list[ServicePortState]] = {}
        """Services outside the update that get a frontend they waited for."""

    def withdraw(self, keys: Iterable[str]) -> dict[Frontend, str]:
        """Take back every claim of the Services `keys`; returns the frontends they served -> which served it."""
        freed: dict[Frontend, str] = {}
        for key in keys:
            for st in self.served.pop(key, ()):
                del self.holders[st.frontend]
                freed[st.frontend] = key
            for st in self.waiting.pop(key, ()):
                self._unwait(st.frontend, key)
        return freed

    def _unwait(self, fe: Frontend, key: str) -> None:
        rest = tuple(k for k in self.claimants[fe] if k != key)
        if rest:
            self.claimants[fe] = rest
        else:
            del self.claimants[fe]

    def _reject(self, st: ServicePortState, holder: str) -> None:
        fe, key = st.frontend, st.service
        self.claimants[fe] = tuple(sorted((*self.claimants.get(fe, ()), key)))
        # Logged once: not again while it waits for the same holder.
        if key not in self.prev.claimants.get(fe, ()) or self.prev.holders.get(fe) != holder:
            self.rejected.append(RejectedClaim(st, holder))

    def _promote(self, key: str, fe: Frontend) -> None:
        """`key`, waiting outside this update, now serves `fe`."""
        self._unwait(fe, key)
        self.holders[fe] = key
        self.promoted.setdefault(key, []).extend(st for st in self.waiting[key] if st.frontend == fe)

    def claim(self, wanted: Mapping[str, tuple[ServicePortState, ...]], freed: Mapping[Frontend, str]) -> None:
        """Decide who serves each frontend the recomputed Services (`wanted`) claim or let go of (`freed`)."""
        holders, claimants = self.holders, self.claimants
        if freed:
            for key, states in wanted.items():  # what a Service served and still claims, it keeps
                for st in states:
                    if freed.get(st.frontend) == key:
                        holders[st.frontend] = key
        losers: set[str] = set()
        for key in sorted(wanted):
            for st in wanted[key]:
                fe = st.frontend
                holder = holders.get(fe)
                if holder is None:
                    if fe not in claimants:  # nobody else wants it: the common case
                        holders[fe] = key
                        continue
                    holder = min(key, claimants[fe][0])
                    if holder == key:
                        holders[fe] = key
                    else:
                        self._promote(holder, fe)
                if holder != key:
                    self._reject(st, holder)
                    losers.add(key)
        for fe, old in freed.items():
            if fe not in self.holders and fe in self.claimants:  # let go of, and no recomputed Service took it
                self._promote(self.claimants[fe][0], fe)
            holder = self.holders.get(fe)
            if holder is not None and holder != old:  # the others waiting for it now wait for another holder
                for other in self.claimants.get(fe, ()):
                    if other not in wanted:
                        self.rejected += [RejectedClaim(st, holder) for st in self.waiting[other] if st.frontend == fe]
        self.served.update((key, states) for key, states in wanted.items() if key not in losers)
        for key in losers:
            states = wanted[key]
            served = tuple(st for st in states if holders[st.frontend] == key)
            if served:
                self.served[key] = served
            self.waiting[key] = tuple(st for st in states if holders[st.frontend] != key)
        for key, gained in self.promoted.items():
            self.served[key] = tuple(sorted((*self.served.get(key, ()), *gained), key=_by_frontend))
            still = tuple(st for st in self.waiting.pop(key) if st not in gained)
            if still:
                self.waiting[key] = still


def update_desired_state(
    prev: DesiredState,
    services: Mapping[str, Service],
    slices_for: Callable[[str], Iterable[EndpointSlice]],
    changed: Collection[str],
    node: NodeInputs | None = None,
) -> DesiredState:
    """A new DesiredState equal to `prev` except for the `changed` Service keys, recomputed from `services`,
    `slices_for` and `node` (None: `prev.node`; a different node recomputes every Service), and for the Services
    that get a frontend one of those let go of (named in `also_changed`). `prev` is not modified."""
    node = prev.node if node is None else node
    keys = set(changed)
    if node != prev.node:
        keys |= prev.services.keys() | prev.waiting.keys()
    update = _Update(prev)
    freed = update.withdraw(keys)
    wanted = {}
    for key in keys:
        states = compute_service_state(services.get(key), slices_for(key), node)
        if states:
            wanted[key] = states
    update.claim(wanted, freed)
    served = update.served
    recomputed = keys | update.promoted.keys()
    also = {k for k in recomputed if k not in changed and served.get(k) != prev.services.get(k)}
    return DesiredState(
        services=served,
        holders=update.holders,
        waiting=update.waiting,
        claimants=update.claimants,
        node=node,
        rejected=tuple(sorted(update.rejected, key=lambda c: (c.claim.service, c.claim.frontend))),
        also_changed=frozenset(also),
    )


def compute_desired_state(
    services: Mapping[str, Service],
    slices_for: Callable[[str], Iterable[EndpointSlice]],
    node: NodeInputs | None = None,
) -> DesiredState:
    """The full desired state of every Service."""
    return update_desired_state(DesiredState(), services, slices_for, services, node)
