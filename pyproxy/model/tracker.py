"""Change tracking between the sources (watch threads) and the sync loop, as upstream kube-proxy's
`ServiceChangeTracker` / `EndpointsChangeTracker`.

Sources record every update as it arrives; the sync loop drains the accumulated changes and recomputes
only what they touch. The store a tracker exposes is the state *as of the last drain*: it only changes
inside `drain()`, so the sync thread (the only one that drains) can read it without racing the watch
threads, and it always matches the changes it was handed.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

from pyproxy.model.objects import EndpointSlice, Service

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Change(Generic[T]):
    """What one key looked like at the last drain (`previous`) and looks like now (`current`);
    None means absent."""

    previous: T | None
    current: T | None


class ChangeTracker(Generic[T]):
    """A keyed store plus the changes recorded since the last drain. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: dict[str, T] = {}
        self._pending: dict[str, Change[T]] = {}
        self.current: Mapping[str, T] = MappingProxyType(self._store)
        """Read-only view of the store as of the last drain; read it from the draining thread."""

    def update(self, key: str, obj: T | None) -> bool:
        """Record that `key` is now `obj` (None: deleted). Returns False for a no-op (the same object
        again, or deleting an absent key), which records nothing."""
        with self._lock:
            change = self._pending.get(key)
            previous = change.previous if change else self._store.get(key)
            latest = change.current if change else previous
            if obj == latest:
                return False
            if obj == previous:
                # Back to how the sync loop last saw it: nothing left for it to do.
                del self._pending[key]
            else:
                self._pending[key] = Change(previous, obj)
            return True

    def pending(self) -> int:
        """How many keys have changed since the last drain."""
        with self._lock:
            return len(self._pending)

    def pending_keys(self) -> frozenset[str]:
        """The keys that have changed since the last drain."""
        with self._lock:
            return frozenset(self._pending)

    def drain(self) -> dict[str, Change[T]]:
        """Apply the pending changes to the store, clear them and return them."""
        with self._lock:
            changes, self._pending = self._pending, {}
            for key, change in changes.items():
                if change.current is None:
                    del self._store[key]
                else:
                    self._store[key] = change.current
            return changes


class ClusterState:
    """The Services and EndpointSlices the proxy knows, with slices indexed by the Service they
    belong to. Watch threads call `services.update` / `slices.update`; the sync thread calls
    `drain_changed_services` and then reads `services.current` and `slices_for`."""

    def __init__(self) -> None:
        self.services: ChangeTracker[Service] = ChangeTracker()
        self.slices: ChangeTracker[EndpointSlice] = ChangeTracker()
        # service key -> {slice key: slice}; follows `slices.current`, so it only changes on drain.
        self._by_service: dict[str, dict[str, EndpointSlice]] = {}

    def slices_for(self, service_key: str) -> tuple[EndpointSlice, ...]:
        """The EndpointSlices of one Service as of the last drain, sorted by slice key."""
        by_key = self._by_service.get(service_key, {})
        return tuple(by_key[k] for k in sorted(by_key))

    def drain_changed_services(self) -> set[str]:
        """Drain both trackers and return the key of every Service whose state may have changed:
        changed Services, and the Services a changed slice belonged to before and belongs to now."""
        changed = set(self.services.drain())
        for key, change in self.slices.drain().items():
            if change.previous is not None:
                old = change.previous.service_key
                changed.add(old)
                del self._by_service[old][key]
                if not self._by_service[old]:
                    del self._by_service[old]
            if change.current is not None:
                changed.add(change.current.service_key)
                self._by_service.setdefault(change.current.service_key, {})[key] = change.current
        return changed

    def pending_counts(self) -> tuple[int, int]:
        """(Service changes pending, EndpointSlice changes pending), for metrics."""
        return self.services.pending(), self.slices.pending()
