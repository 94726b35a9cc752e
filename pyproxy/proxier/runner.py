"""A bounded-frequency runner, after upstream kube-proxy's async.BoundedFrequencyRunner.

`request()` may be called from any thread, any number of times: bursts coalesce into one run. Runs are
at least `min_interval` apart, at most `max_interval` apart (the periodic resync), and a failed run is
retried after `retry_interval`. A run that returns False did nothing (e.g. the sources had not listed yet)
and does not count against the minimum interval: the next request runs at once; without one, the next run is
`max_interval` after it (never at once again, which would spin a core while the sources read).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BoundedFrequencyRunner:
    def __init__(
        self,
        fn: Callable[[], bool | None],
        min_interval: float,
        max_interval: float,
        retry_interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.retry_interval = retry_interval if retry_interval is not None else max(min_interval, 1.0)
        self._clock = clock
        self._cond = threading.Condition()
        self._requested = False
        self._last_run = float("-inf")
        self._idle_since: float | None = None
        """When the last run returned False (did nothing); None after a run that did something."""
        self._retry_at: float | None = None
        self._stop = False

    def request(self) -> None:
        with self._cond:
            self._requested = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _next_due(self) -> float:
        due = self._last_run + self.max_interval
        if self._idle_since is not None:
            due = max(due, self._idle_since + self.max_interval)
        if self._requested:
            due = min(due, self._last_run + self.min_interval)
        if self._retry_at is not None:
            due = min(due, max(self._retry_at, self._last_run + self.min_interval))
        return due

    def loop(self) -> None:
        """Run until `stop()`; call from the one thread that owns syncing."""
        while True:
            with self._cond:
                while not self._stop:
                    wait = self._next_due() - self._clock()
                    if wait <= 0:
                        break
                    self._cond.wait(timeout=wait)
                if self._stop:
                    return
                self._requested = False
                self._retry_at = None
                previous, self._last_run = self._last_run, self._clock()
            try:
                did_nothing = self._fn() is False
                with self._cond:
                    if did_nothing:
                        self._idle_since, self._last_run = self._last_run, previous
                    else:
                        self._idle_since = None
            except Exception:  # noqa: BLE001 - logged and retried, never kills the loop
                log.exception("sync failed; retrying in %.1fs", self.retry_interval)
                with self._cond:
                    self._idle_since = None
                    self._retry_at = self._clock() + self.retry_interval
