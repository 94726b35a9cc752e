"""A dataplane that programs nothing and remembers every apply: for unit tests of the proxier. It
satisfies the same `Dataplane` protocol as the real backends."""

from __future__ import annotations

from collections.abc import Mapping, Set
from types import MappingProxyType

from pyproxy.dataplane.base import DataplaneError
from pyproxy.model.state import BOTH_FAMILIES, DesiredState


class FakeDataplane:
    mode = "fake"
    ip_families = BOTH_FAMILIES
    unserved: Mapping[str, str] = MappingProxyType({})
    collector = None

    def __init__(self) -> None:
        self.applies: list[tuple[DesiredState, frozenset[str] | None]] = []
        self.fail_next = 0
        """How many coming applies raise DataplaneError (and change nothing)."""
        self.state = DesiredState()
        self.started = self.stopped = False
        self.housekeeping = False
        """What housekeeping_due() answers."""

    def start(self) -> None:
        self.started = True

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise DataplaneError("injected failure")
        self.applies.append((desired, frozenset(changed) if changed is not None else None))
        self.state = desired

    def housekeeping_due(self) -> bool:
        return self.housekeeping

    def stop(self) -> None:
        self.stopped = True
