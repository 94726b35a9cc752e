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


class Protocol(enum.StrEnum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"


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


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: str
    """ClusterIP, NodePort, LoadBalancer or ExternalName."""
    cluster_ips: tuple[str, ...]
    """IPv4 ClusterIPs in dotted form; empty for a headless Service or one without a ClusterIP."""
    ports: tuple[ServicePort, ...]
    session_affinity: str = "None"
    """"None" or "ClientIP"."""
    session_affinity_timeout: int = DEFAULT_SESSION_AFFINITY_TIMEOUT
    """Seconds a ClientIP affinity lasts."""

    @property
    def key(self) -> str:
        return object_key(self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Endpoint:
    addresses: tuple[str, ...]
    ready: bool = True
    """Per the API, an unset `ready` condition means ready."""
    serving: bool = True
    terminating: bool = False
    node_name: str | None = None
    zone: str | None = None


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
    """IPv4, IPv6 or FQDN; only IPv4 slices are served today."""
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
    """(type, address) pairs in the API's order, e.g. ("InternalIP", "10.0.0.5")."""

    @property
    def zone(self) -> str | None:
        return dict(self.labels).get(ZONE_LABEL)
