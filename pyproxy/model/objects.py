"""Normalised Kubernetes objects: the subset of Service and EndpointSlice that a service proxy acts on.

Both sources (manifest files and the API server) convert into these frozen dataclasses, so equality is
cheap and a no-op update can be recognised by `==`. EndpointSlices of `discovery.k8s.io/v1` and
`v1beta1` normalise to the same `EndpointSlice`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# The label an EndpointSlice carries to name the Service it belongs to.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# Set by the EndpointSlice controller to when the change that produced this slice happened.
LAST_CHANGE_TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
# Seconds a ClientIP session affinity lasts when the Service does not say (upstream default: 3 hours).
DEFAULT_SESSION_AFFINITY_TIMEOUT = 10800
# pyproxy's own annotations: which scheduler picks a new flow's endpoint, and the endpoints' weights.
SCHEDULER_ANNOTATION = "pyproxy.io/scheduler"
WEIGHTS_ANNOTATION = "pyproxy.io/weights"
# The schedulers a Service may ask for (README, "Schedulers"): IPVS's names where IPVS has one, plus uniform
# random choice (the netfilter modes' only one) and Maglev consistent hashing.
SCHEDULERS = ("random", "rr", "wrr", "lc", "sed", "nq", "sh", "dh", "maglev")
# The largest weight an endpoint may have (IPVS's weights are 32-bit; this keeps a wrr sequence short).
MAX_WEIGHT = 100
# Topology-aware routing (upstream's topology.go): the annotation that asks for it ("Auto"), its pre-1.27 name,
# and the spec.trafficDistribution values that ask for it too (PreferSameZone is PreferClose's newer name).
TOPOLOGY_MODE_ANNOTATION = "service.kubernetes.io/topology-mode"
TOPOLOGY_AWARE_HINTS_ANNOTATION = "service.kubernetes.io/topology-aware-hints"
PREFER_CLOSE = "PreferClose"
PREFER_SAME_ZONE = "PreferSameZone"
# IP families, as ipaddress's `version` numbers them; an address's is `family_of(address)`.
IPV4 = 4
IPV6 = 6
# spec.ipFamilies' and an EndpointSlice's addressType's names of each family.
FAMILY_NAMES = {IPV4: "IPv4", IPV6: "IPv6"}
# spec.ipFamilyPolicy's values.
IP_FAMILY_POLICIES = ("SingleStack", "PreferDualStack", "RequireDualStack")


def family_of(address: str) -> int:
    """IPV6 for an IPv6 address (or CIDR), else IPV4: model addresses are valid and canonical, so a colon tells."""
    return IPV6 if ":" in address else IPV4


def join_host_port(ip: str, port: int) -> str:
    """"ip:port", an IPv6 address in brackets (upstream's net.JoinHostPort): how endpoints and frontends are
    written wherever an address and a port go together (DNAT targets, `pyproxy inspect`)."""
    return f"[{ip}]:{port}" if family_of(ip) == IPV6 else f"{ip}:{port}"


class Protocol(enum.StrEnum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"


class TrafficPolicy(enum.StrEnum):
    """spec.externalTrafficPolicy / spec.internalTrafficPolicy: all the cluster's endpoints, or this node's."""

    CLUSTER = "Cluster"
    LOCAL = "Local"


class InvalidObject(ValueError):
    """An object that cannot be served; the message names the kind, namespace/name and what is wrong."""

    def __init__(self, kind: str, key: str, reason: str) -> None:
        super().__init__(f"{kind} {key}: {reason}")
        self.kind = kind
        self.key = key
        self.reason = reason


def object_key(namespace: str, name: str) -> str:
    """The `namespace/name` form used as the key of every tracker and map in the model."""
    return f"{namespace}/{name}"


@dataclass(frozen=True, slots=True)
class ServicePort:
    name: str
    """The port's name; "" for the single unnamed port of a one-port Service."""
    port: int
    """The port the ClusterIP listens on (1-65535)."""
    protocol: Protocol
    target_port: int | str
    """Informational: the EndpointSlice controller already resolved it into the slices' port numbers."""
    node_port: int | None = None
    """spec.ports[].nodePort: allocated for NodePort and LoadBalancer Services (None: not allocated)."""


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: str
    """ClusterIP, NodePort, LoadBalancer or ExternalName."""
    cluster_ips: tuple[str, ...]
    """spec.clusterIPs in canonical form, at most one per family, the primary family's first; empty for a headless
    Service or one without a ClusterIP. A family's other frontends (external IPs, load-balancer IPs, node ports)
    are served only when the Service has a ClusterIP of that family, as upstream's per-family proxiers."""
    ports: tuple[ServicePort, ...]
    session_affinity: str = "None"
    """"None" or "ClientIP"."""
    session_affinity_timeout: int = DEFAULT_SESSION_AFFINITY_TIMEOUT
    """Seconds a ClientIP affinity lasts."""
    external_ips: tuple[str, ...] = ()
    """spec.externalIPs of both families, canonical, in the object's order."""
    load_balancer_ips: tuple[str, ...] = ()
    """status.loadBalancer.ingress[].ip of both families, those whose ipMode is VIP (or unset): traffic arrives
    addressed to them. Traffic from an ingress with ipMode Proxy (a proxying load balancer) is not addressed to
    its IP."""
    external_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    """Applies to the external frontends (node ports, external IPs, load-balancer IPs); absent means Cluster."""
    internal_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    """Applies to the ClusterIPs; absent means Cluster."""
    health_check_node_port: int | None = None
    """spec.healthCheckNodePort (None: unset or 0)."""
    load_balancer_source_ranges: tuple[str, ...] = ()
    """spec.loadBalancerSourceRanges of both families, trimmed and in canonical form ("10.0.0.0/8"); empty: any
    source. Each family's load-balancer IPs take that family's ranges only (upstream's per-family proxiers)."""
    scheduler: str = ""
    """The `pyproxy.io/scheduler` annotation, one of SCHEDULERS; "": the node's default (--bpf-scheduler,
    --ipvs-scheduler)."""
    weights: tuple[tuple[str, int], ...] = ()
    """The `pyproxy.io/weights` annotation ("10.244.1.5=3,fd00::7=0"): endpoint address (canonical) -> weight
    (0-MAX_WEIGHT; 0: no new flows, as IPVS's quiesced server), sorted; an endpoint not named weighs 1."""
    traffic_distribution: str = ""
    """spec.trafficDistribution as written ("": unset); PreferClose (or PreferSameZone) asks for topology-aware
    routing. Other values are kept but ask for nothing pyproxy does."""
    topology_mode: str = ""
    """The `service.kubernetes.io/topology-mode` annotation, else the older `topology-aware-hints` one (upstream's
    hintsAnnotation); "Auto" or "auto" asks for topology-aware routing."""
    ip_families: tuple[str, ...] = ()
    """spec.ipFamilies as written ("IPv4", "IPv6"; the primary first), checked against `cluster_ips`; (): unset
    (the families are the ClusterIPs')."""
    ip_family_policy: str = ""
    """spec.ipFamilyPolicy (IP_FAMILY_POLICIES; "": unset, SingleStack): checked against the ClusterIPs, else
    informational, as upstream's proxies: which frontends a Service has follows its ClusterIPs."""
    ignored: tuple[str, ...] = ()
    """What of the object was ignored, each with why (a malformed pyproxy.io/ annotation: the API server checks
    no annotation, so a typo there must not cost the Service its traffic). The sources log it once per version."""

    @property
    def key(self) -> str:
        return object_key(self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Endpoint:
    addresses: tuple[str, ...]
    ready: bool = True
    """Per the API, an unset `ready` condition means ready."""
    serving: bool = True
    """Unset: as `ready` (the API's documented default). Upstream kube-proxy reads an unset one as true, which
    differs only for an endpoint that is terminating, not ready, and says nothing about serving."""
    terminating: bool = False
    node_name: str | None = None
    """The node it runs on (v1 `nodeName`, v1beta1 topology `kubernetes.io/hostname`); None: unknown, which is
    never this node."""
    zone: str | None = None
    zone_hints: tuple[str, ...] = ()
    """`hints.forZones[].name`: the zones whose nodes should use this endpoint (set by the EndpointSlice
    controller for topology-aware routing), sorted and unique; (): no hint."""


@dataclass(frozen=True, slots=True)
class EndpointPort:
    name: str
    port: int
    protocol: Protocol


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    service_name: str
    """From the `kubernetes.io/service-name` label."""
    address_type: str
    """IPv4, IPv6 or FQDN. A frontend uses the slices of its own family only; FQDN slices are never used (as
    upstream)."""
    endpoints: tuple[Endpoint, ...] = ()
    ports: tuple[EndpointPort, ...] = ()
    trigger_time: float | None = field(default=None, compare=False)
    """Unix time from the last-change-trigger-time annotation; not compared, so it never makes a no-op
    update look like a change."""

    @property
    def key(self) -> str:
        return object_key(self.namespace, self.name)

    @property
    def service_key(self) -> str:
        return object_key(self.namespace, self.service_name)


# The well-known label of a node's zone (topology-aware routing reads it).
ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True, slots=True)
class Node:
    """The node pyproxy runs on: kept for topology and node-port features."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    """Sorted (key, value) pairs, so equal nodes compare equal."""
    addresses: tuple[tuple[str, str], ...] = ()
    """(type, address) pairs in the API's order, e.g. ("InternalIP", "10.0.0.5"); InternalIP and ExternalIP
    ones are valid IP addresses in canonical form."""
    deleting: bool = False
    """The node is going away: it has a deletionTimestamp, or the cluster autoscaler's ToBeDeletedByClusterAutoscaler
    taint. Upstream's /healthz then answers 503 ("nodeEligible": false), so load balancers stop sending to it."""

    @property
    def key(self) -> str:
        """Nodes are cluster-scoped: the name alone."""
        return self.name

    @property
    def zone(self) -> str | None:
        return dict(self.labels).get(ZONE_LABEL)

    def primary_ip(self, family: int) -> str | None:
        """The node's primary address of `family` as upstream picks it (GetNodeHostIPs): the first InternalIP of
        that family, else the first ExternalIP of it; None when it has neither."""
        for wanted in NODE_IP_TYPES:
            for kind, address in self.addresses:
                if kind == wanted and family_of(address) == family:
                    return address
        return None

    @property
    def primary_ipv4(self) -> str | None:
        return self.primary_ip(IPV4)

    @property
    def primary_ipv6(self) -> str | None:
        return self.primary_ip(IPV6)


# The taint the cluster autoscaler puts on a node it is about to delete.
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"

# The Node address types that are IP addresses (the others, Hostname and InternalDNS/ExternalDNS, are names),
# in the order upstream prefers them for the primary address.
NODE_IP_TYPES = ("InternalIP", "ExternalIP")
