"""The desired state: what every dataplane backend renders from.

A frontend is one (ClusterIP, port, protocol); it maps to an ordered tuple of backends. Order is by
address then port, so a dataplane that assigns slots by position changes as little as possible when one
endpoint comes or goes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from pyproxy.model.objects import Protocol


class Frontend(NamedTuple):
    """NamedTuples rather than dataclasses, Frontend and Backend: hashing, comparing and sorting them is then C
    code, and a cold start at 10,000 Services x 10 endpoints does each about a million times. Order (by
    field, as a tuple) and equality are as a frozen dataclass's; `str()` is the familiar ip:port form."""

    ip: str
    port: int
    protocol: Protocol

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}/{self.protocol.value}"


class Backend(NamedTuple):
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServicePortState:
    """One frontend of a Service and where its traffic goes."""

    service: str
    """`namespace/name` of the Service."""
    port_name: str
    frontend: Frontend
    backends: tuple[Backend, ...]
    """Ready endpoints, sorted; these receive new connections. Empty means: no endpoints, reject."""
    known_backends: tuple[Backend, ...] = ()
    """Every endpoint of the slices (ready or not), sorted. Established flows to one of these are kept;
    a flow whose backend left this set is re-balanced (upstream flushes conntrack for it)."""
    session_affinity_seconds: int = 0
    """0 = no affinity; else ClientIP affinity lasting this long."""

    @property
    def display_name(self) -> str:
        return f"{self.service}:{self.port_name}" if self.port_name else self.service


@dataclass(frozen=True)
class DesiredState:
    """Per Service (`namespace/name`), the states of its frontends. Services with nothing to serve are
    absent."""

    services: Mapping[str, tuple[ServicePortState, ...]] = field(default_factory=dict)

    def frontends(self) -> dict[Frontend, ServicePortState]:
        return {sp.frontend: sp for states in self.services.values() for sp in states}
