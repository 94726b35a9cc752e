"""What every source of objects delivers into: the proxier implements it, tests record with it."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from pyproxy.model.objects import EndpointSlice, Node, Service


class ObjectSink(Protocol):
    """Where a source delivers objects; None deletes."""

    def set_service(self, key: str, svc: Service | None) -> None: ...

    def set_endpoint_slice(self, key: str, s: EndpointSlice | None) -> None: ...

    def set_node(self, node: Node | None) -> None:
        """The node pyproxy runs on (the API source's, or the manifest source's when a manifest holds it)."""

    def mark_synced(self) -> None:
        """Every Service and EndpointSlice that existed at start has been delivered (called once)."""


class RecordingSink:
    """A sink for tests of sources: applies what it is given to plain dicts and records each call."""

    def __init__(self) -> None:
        self.services: dict[str, Service] = {}
        self.slices: dict[str, EndpointSlice] = {}
        self.node: Node | None = None
        self.calls: list[tuple[str, str, bool]] = []
        """(kind, key, present) per call."""
        self.synced = 0
        self.changed = threading.Event()
        """Set at every call; tests clear it and wait."""
        self._lock = threading.Lock()

    def _set(self, store: dict[str, Any], kind: str, key: str, obj: Any) -> None:
        with self._lock:
            self.calls.append((kind, key, obj is not None))
            if obj is None:
                del store[key]  # deleting what was never delivered is a bug in the source
            else:
                store[key] = obj
        self.changed.set()

    def set_service(self, key: str, svc: Service | None) -> None:
        self._set(self.services, "Service", key, svc)

    def set_endpoint_slice(self, key: str, s: EndpointSlice | None) -> None:
        self._set(self.slices, "EndpointSlice", key, s)

    def set_node(self, node: Node | None) -> None:
        with self._lock:
            self.calls.append(("Node", node.name if node else "", node is not None))
            self.node = node
        self.changed.set()

    def mark_synced(self) -> None:
        self.synced += 1
        self.changed.set()
