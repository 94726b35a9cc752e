"""The desired state: what every dataplane backend renders from.

A frontend is one (address, port, protocol) where traffic for a Service arrives: a ClusterIP, a node address
with a nodePort, an external IP or a load-balancer IP, each with the policy decided for it in the model
(desired.py); it maps to ordered tuples of backends. Order is by address then port, so a dataplane that
assigns slots by position changes as little as possible when one endpoint comes or goes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import IPV4, IPV6, Protocol, family_of


class Frontend(NamedTuple):
    """NamedTuples rather than dataclasses, Frontend and Backend: hashing, comparing and sorting them is then C
    code, and a cold start at 10,000 Services x 10 endpoints does each about a million times. Order (by
    field, as a tuple) and equality are as a frozen dataclass's; `str()` is the familiar ip:port form."""

    ip: str
    """Canonical, of either family: a frontend's family is its address's (`family`)."""
    port: int
    protocol: Protocol

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}/{self.protocol.value}"

    @property
    def family(self) -> int:
        """IPV4 or IPV6 (objects.family_of): a frontend's backends are all of its family."""
        return family_of(self.ip)


class Backend(NamedTuple):
    ip: str
    port: int

    def __str__(self) -> str:
        # Unbracketed for IPv6 too: bpf's Maglev hashes this spelling (dataplane/bpf/maglev.py pins it).
        return f"{self.ip}:{self.port}"

    @property
    def family(self) -> int:
        return family_of(self.ip)


class FrontendKind(enum.StrEnum):
    """Where a frontend's address comes from. In this order a Service's own frontends rank when two of them are
    one (address, port, protocol): the first is kept, as upstream's rules match in this order."""

    CLUSTER_IP = "ClusterIP"
    EXTERNAL_IP = "ExternalIP"
    LOAD_BALANCER = "LoadBalancer"
    NODE_PORT = "NodePort"

    @property
    def external(self) -> bool:
        """Whether externalTrafficPolicy applies (every kind but ClusterIP)."""
        return self is not FrontendKind.CLUSTER_IP


@dataclass(frozen=True, slots=True)
class ServicePortState:
    """One frontend of a Service and where its traffic goes, with the policy the model decided for it. The
    fields after `session_affinity_seconds` have defaults that are what a ClusterIP frontend carries (but
    `health_check_node_port`), so a ClusterIP frontend reads as it always has."""

    service: str
    """`namespace/name` of the Service."""
    port_name: str
    frontend: Frontend
    """Of one family (`family`); every backend below is of the same one: a frontend uses only the endpoints of
    its own family's EndpointSlices (upstream's per-family proxiers)."""
    backends: tuple[Backend, ...]
    """The endpoints new connections may use, sorted: the ready ones or, when none is ready, the serving and
    terminating ones (upstream's ProxyTerminatingEndpoints). Empty means: no usable endpoint, reject (but see
    `drop`). A ClusterIP frontend of a Service with internalTrafficPolicy Local holds this node's endpoints
    only (by nodeName), chosen the same way among them. For an external frontend (`kind.external`) these serve
    sources inside the cluster (pods, the node itself); `external_backends` serve the others.

    Topology-aware routing (spec.trafficDistribution PreferClose, or the topology-mode annotation Auto, on a
    node with a zone label) narrows these cluster endpoints, not this node's Local ones, to the ready ones
    whose `hints.forZones` name the node's zone: only when every ready endpoint has a zone hint and one names
    this zone (else all of them, as upstream); never the serving-and-terminating fallback."""
    known_backends: tuple[Backend, ...] = ()
    """Every endpoint of the slices (ready or not), sorted. Established flows to one of these are kept;
    a flow whose backend left this set is re-balanced: bpf mode at its next packet, the netfilter modes by
    deleting its UDP conntrack entries (model/conntrack.py, as upstream)."""
    session_affinity_seconds: int = 0
    """0 = no affinity; else ClientIP affinity lasting this long."""
    kind: FrontendKind = FrontendKind.CLUSTER_IP
    external_backends: tuple[Backend, ...] = ()
    """External frontends only: the endpoints new connections from outside the cluster may use, sorted. With
    externalTrafficPolicy Cluster the same as `backends` (topology included); with Local this node's endpoints
    (by nodeName, hints ignored): its ready ones or, when none is ready, its serving and terminating ones.
    Empty while `backends` is not: drop that traffic (upstream's DROP; the client keeps waiting for another
    node); both empty: reject. Always () for a ClusterIP frontend, which serves every source from `backends`."""
    masquerade: bool = False
    """Every new flow to this frontend is SNATed to a node address, whatever its source: upstream's rule for
    external frontends with externalTrafficPolicy Cluster (external clients and pods alike), so replies come
    back through this node. False: only the general rules apply (node-originated and hairpin traffic, and for
    ClusterIP frontends --masquerade-all / --cluster-cidr); with Local, external clients and pods keep their
    address."""
    source_ranges: tuple[str, ...] = ()
    """LoadBalancer frontends only: the CIDRs of the frontend's family a new flow's source must be in (the
    loadBalancerSourceRanges of that family, plus the load-balancer IPs of it when a range holds the node's
    primary IP of it, as upstream); traffic from elsewhere is dropped. (): any source (also when a range is
    0.0.0.0/0 or ::/0, and, as upstream, when every range is of the other family). Other kinds: always ()."""
    health_check_node_port: int | None = None
    """The Service's healthCheckNodePort, on each of its frontends, when upstream serves one (a LoadBalancer
    Service with externalTrafficPolicy Local); else None."""
    local_ready: bool = False
    """External frontends with externalTrafficPolicy Local: `external_backends` are this node's ready endpoints
    (False: its serving-and-terminating ones, or none). The health-check node port counts only ready ones, as
    upstream: a node left with terminating endpoints only fails its check, so load balancers drain it."""
    drop: bool = False
    """ClusterIP frontends with internalTrafficPolicy Local only: `backends` is empty because this node has no
    usable endpoint while the cluster has some; new flows, from every source, are dropped instead of rejected
    (upstream's "has no local endpoints" DROP). False when the cluster has none either (reject). Always False
    for an external frontend, whose drop is `external_backends` empty while `backends` is not."""
    scheduler: str = ""
    """The Service's `pyproxy.io/scheduler` (objects.SCHEDULERS); "": the mode's default (--bpf-scheduler,
    --ipvs-scheduler). The netfilter modes choose at random whatever it says."""
    weights: tuple[tuple[str, int], ...] = ()
    """The Service's `pyproxy.io/weights`, endpoint address -> weight, sorted; see `weight`. An endpoint of weight 0
    is in neither `backends` nor `external_backends` (no new flows, in every mode) but stays known."""
    quiesced: tuple[Backend, ...] = ()
    """The endpoints this frontend's new flows would use but for their weight 0, sorted: the ipvs mode keeps them as
    real servers of weight 0 (IPVS's quiesced server), whose established connections go on."""
    node_denied: bool = False
    """LoadBalancer frontends with `source_ranges` none of which holds the node's primary address of the family: the
    node's own new connections are dropped, as upstream's firewall chain drops them by the address they leave from.
    A dataplane that sees the node's packets (netfilter's OUTPUT) checks their source itself; bpf's socket hooks,
    which see a socket before it has an address, go by this."""

    def masquerades(self, masquerade_all: bool) -> bool:
        """Whether every new flow to this frontend is SNATed to a node address: `masquerade`, or --masquerade-all
        (`masquerade_all`) for a ClusterIP frontend (an external one with externalTrafficPolicy Local keeps its
        clients' addresses, as upstream)."""
        return self.masquerade or (masquerade_all and not self.kind.external)

    @property
    def node_only(self) -> bool:
        """A NodePort on 127.0.0.1 (upstream's localhostNodePorts, `NodeInputs.nodeport_addresses`): only the node's
        own processes reach it. No packet to it may be translated: a packet addressed to a loopback address that
        arrives on a device comes from a neighbour, which must not reach a Service through it (CVE-2020-8558,
        which upstream's iptables mode guards against with its "block incoming localnet connections" rule); and
        a pod's own 127.0.0.1 is its own namespace's."""
        return self.frontend.ip.startswith("127.")

    def pods_at_socket(self, masquerade_all: bool) -> bool:
        """Whether a pod's connection to this frontend may be translated at its socket (bpf's cgroup hooks, which
        see every pod below the node's cgroup) instead of by the packet path on its veth: only where both give the
        pod the same. Not where the pod's flow is SNATed (`masquerades`: the backend would see the pod's address),
        nor where source ranges apply (the socket does not know the pod's address to check). externalTrafficPolicy
        Local frontends are translated at the socket from every endpoint, upstream's short circuit for pods.
        --cluster-cidr's rule masquerades sources outside the cluster CIDR, which a pod is not. Not UDP: a pod's
        connected UDP socket (a resolver's) pointed at a backend once would keep it after that endpoint leaves,
        where the packet path moves the flow at its next datagram (moving a socket needs bpf_sock_destroy, not
        used); its datagrams keep their per-port flows on TC as upstream's conntrack has them. Never a `node_only`
        frontend: a pod's 127.0.0.1 is its own."""
        return (not self.masquerades(masquerade_all) and not self.source_ranges
                and self.frontend.protocol is not Protocol.UDP and not self.node_only)

    def weight(self, backend: Backend) -> int:
        """The weight of one of the backends (1 unless the Service's annotation names its address)."""
        for ip, weight in self.weights:
            if ip == backend.ip:
                return weight
        return 1

    @property
    def family(self) -> int:
        """The frontend's family (IPV4 or IPV6)."""
        return self.frontend.family

    @property
    def display_name(self) -> str:
        return f"{self.service}:{self.port_name}" if self.port_name else self.service


@dataclass(frozen=True, slots=True)
class RejectedClaim:
    """A frontend a Service claims that another Service serves."""

    claim: ServicePortState
    holder: str
    """The Service that serves the frontend."""

    def __str__(self) -> str:
        return (f"{self.claim.display_name} {self.claim.kind} {self.claim.frontend}: "
                f"frontend already served by {self.holder}")


@dataclass(frozen=True)
class DesiredState:
    """Per Service (`namespace/name`), the states of the frontends it serves, of every kind. Services with
    nothing to serve are absent. A frontend is served by one Service at most (see desired.py for which).

    The fields after `node` describe the update that made this state, not the state: they do not take part in
    equality."""

    services: Mapping[str, tuple[ServicePortState, ...]] = field(default_factory=dict)
    holders: Mapping[Frontend, str] = field(default_factory=dict)
    """Every frontend in `services` -> the Service serving it."""
    waiting: Mapping[str, tuple[ServicePortState, ...]] = field(default_factory=dict)
    """Per Service, the frontends it claims that another Service serves (absent: none)."""
    claimants: Mapping[Frontend, tuple[str, ...]] = field(default_factory=dict)
    """Every frontend in `waiting` -> the Services waiting for it, sorted: the first gets it when it is free."""
    node: NodeInputs = field(default_factory=NodeInputs)
    """What this state was computed for: a change recomputes every Service."""
    rejected: tuple[RejectedClaim, ...] = field(default=(), compare=False)
    """Claims the update rejected that the previous state had not rejected for the same holder: logged once."""
    also_changed: frozenset[str] = field(default=frozenset(), compare=False)
    """Services whose entry in `services` the update changed though they were not among the keys it was asked
    about (a frontend freed by one of those went to them; the node changed): a partial apply includes them."""

    def frontends(self) -> dict[Frontend, ServicePortState]:
        return {sp.frontend: sp for states in self.services.values() for sp in states}

    def notices(self) -> list[str]:
        """Lines for the log, once per change: the claims the update rejected."""
        return [str(c) for c in self.rejected]


class HealthCheck(NamedTuple):
    """What a Service's healthCheckNodePort server answers from (see `health_check`)."""

    port: int
    local_endpoints: int


def health_check(states: Iterable[ServicePortState]) -> HealthCheck | None:
    """The healthCheckNodePort server of one Service, from its frontends in the desired state: its port and its
    local ready endpoints, counted as upstream counts them (distinct addresses over all its ports, each counted
    once however many ports it serves). None: the Service has no such server. The count comes from the
    Local-policy external frontends' `external_backends`, so a Service none of whose external frontends is
    served (no node-port address, no load-balancer IP yet, or all held by another Service) counts 0, and one
    none of whose frontends is served (not in `DesiredState.services`) has no server. A dual-stack Service's
    count is that of the family with more (upstream runs one per family, each counting its own)."""
    port = None
    local: dict[int, set[str]] = {IPV4: set(), IPV6: set()}
    for sp in states:
        if sp.health_check_node_port is None:
            return None  # a Service-level setting: on every frontend or on none
        port = sp.health_check_node_port
        if sp.local_ready:
            local[sp.family].update(b.ip for b in sp.external_backends)
    # A dual-stack pod has an address of each family: counted per family, it is one endpoint, not two.
    return None if port is None else HealthCheck(port, max(len(local[IPV4]), len(local[IPV6])))


IPV4_ONLY = frozenset({IPV4})
BOTH_FAMILIES = frozenset({IPV4, IPV6})


class FamilyFilter:
    """The desired state as a dataplane that renders only some IP families sees it: the frontends of the others
    left out (and the node-port addresses of the others), the Services left with none absent, as if they had
    nothing to serve. The proxier runs one before `apply` for a mode that cannot render IPv6 yet, so that mode
    keeps serving IPv4 exactly as before and never sees an address it cannot write.

    Incremental, as the sync is: `update` looks at the changed Services only (every Service on a full sync), and
    when no Service has a frontend of a left-out family, the state given is the state returned, unchanged."""

    def __init__(self, families: frozenset[int]) -> None:
        self.families = families
        self.skipped: dict[str, tuple[tuple[ServicePortState, ...], int]] = {}
        """Service -> (its frontends kept, how many were left out), for the Services with some left out."""
        self.newly: list[str] = []
        """The Services the last `update` found with frontends left out, sorted (for its log line)."""

    def update(self, desired: DesiredState, changed: Iterable[str] | None) -> DesiredState:
        """`desired` restricted to `self.families`; `changed`: the Services that changed since the last update
        (None: all of them, a full sync)."""
        services = desired.services
        if changed is None:
            self.skipped = {}
            changed = services.keys()
        families = self.families
        newly = []
        for key in changed:
            states = services.get(key, ())
            kept = tuple(st for st in states if st.frontend.family in families)
            if len(kept) < len(states):
                self.skipped[key] = (kept, len(states) - len(kept))
                newly.append(key)
            else:
                self.skipped.pop(key, None)
        self.newly = sorted(newly)
        node = desired.node
        addresses = tuple(ip for ip in node.nodeport_addresses if family_of(ip) in families)
        if not self.skipped and addresses == node.nodeport_addresses:
            return desired
        served = dict(services)
        for key, (kept, _) in self.skipped.items():
            if kept:
                served[key] = kept
            else:
                served.pop(key, None)
        return replace(desired, services=served, node=replace(node, nodeport_addresses=addresses))

    def summary(self, mode: str) -> str | None:
        """One line for the log when the last update left out frontends of Services that changed; else None."""
        if not self.newly:
            return None
        frontends = sum(n for _, n in self.skipped.values())
        names = ", ".join(self.newly[:5]) + (f" and {len(self.newly) - 5} more" if len(self.newly) > 5 else "")
        wanted = "/".join(f"IPv{f}" for f in sorted(self.families))
        return (f"{mode} mode renders {wanted} only (yet): the other family's frontends of {names} are not served "
                f"({frontends} frontends of {len(self.skipped)} Services in all)")
