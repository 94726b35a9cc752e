"""Wires one source, the change trackers, the runner and a dataplane together.

Sources only record (`set_service`, `set_endpoint_slice`, `set_node`); the runner's thread is the only one
that drains the trackers, computes the desired state and applies it.

Network-programming latency follows upstream: for every EndpointSlice change, the time it was triggered
(the slice's last-change-trigger-time annotation, set by the EndpointSlice controller, else when the event
reached pyproxy) is kept until a sync has applied the Service it belongs to; the metric observes
"applied - triggered". Trigger times older than the proxier are not observed: a restart would otherwise
report the age of every slice in the cluster.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

from pyproxy import logs
from pyproxy.dataplane.base import Dataplane
from pyproxy.model.desired import update_desired_state
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import EndpointSlice, Node, Service
from pyproxy.model.state import BOTH_FAMILIES, DesiredState, FamilyFilter, health_check
from pyproxy.model.tracker import ClusterState
from pyproxy.proxier.healthcheck import ServiceHealthServers
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.node import NodeAddresses
from pyproxy.proxier.runner import BoundedFrequencyRunner
from pyproxy.proxier.server import ProxyHealth

log = logging.getLogger(__name__)

# Young collections per full one (CPython's default: 10). CPython also waits for the heap to grow by a quarter
# before a full collection, and a cold start at 10,000 Services builds millions of long-lived objects (decoded
# JSON, model objects, plans) as fast as it can: with the default, rescanning them took ~40% of the CPU of
# building the desired state and the plan. Those objects form no reference cycles, so full collections only
# need to be rare; young cycles (an exception's traceback) are still collected at the default pace.
YOUNG_COLLECTIONS_PER_FULL = 10_000


def tune_gc() -> None:
    """Make full garbage collections rare (see YOUNG_COLLECTIONS_PER_FULL); process-wide, idempotent."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, YOUNG_COLLECTIONS_PER_FULL)


class Proxier:
    """Implements the sources' ObjectSink protocol and owns the sync."""

    def __init__(
        self,
        dataplane: Dataplane,
        *,
        min_sync_period: float,
        sync_period: float,
        full_sync_period: float = 3600.0,
        metrics: ProxyMetrics,
        health: ProxyHealth,
        node_name: str | None = None,
        service_health: ServiceHealthServers | None = None,
    ) -> None:
        tune_gc()
        self.dataplane = dataplane
        self.cluster = ClusterState()
        self.desired = DesiredState()
        self.served = self.desired
        """What the dataplane was given: `desired` but the frontends of the IP families it cannot render (a
        dataplane names those it can in `ip_families`)."""
        families = dataplane.ip_families
        self._families = None if families >= BOTH_FAMILIES else FamilyFilter(families)
        self.metrics = metrics
        # Read when scraped rather than set at every change: listing 10,000 Services records 20,000 changes.
        metrics.service_changes_pending.set_function(self.cluster.services.pending)
        metrics.endpoint_changes_pending.set_function(self.cluster.slices.pending)
        self.health = health
        self.full_sync_period = full_sync_period
        self.runner = BoundedFrequencyRunner(self.sync, min_sync_period, sync_period)
        self._synced = False
        self._last_full = float("-inf")
        self._need_full = True
        """The next sync rewrites everything: the first one, and the one after a failure."""
        self._retry: set[str] = set()
        self.node: Node | None = None
        """The own Node as last seen (None until the API source delivers it)."""
        self._node_inputs = NodeInputs(name=node_name)
        """What the model is told of this node: its name now, its addresses once `set_node_inputs` gives them."""
        self.node_addresses: NodeAddresses | None = None
        """Follows the node's addresses (and takes the Node's primary address and zone from `set_node`), if any."""
        self.service_health = service_health
        """The healthCheckNodePort servers, told of every Service a sync applied (None: none are run)."""
        self._started = time.time()
        # Serialises recording a slice change with its trigger time against the sync's drain, so a trigger
        # time is never taken by a sync that did not also take its change.
        self._lock = threading.Lock()
        self._triggers: dict[str, list[float]] = {}
        """service key -> trigger times (Unix) of its endpoint changes not yet applied."""
        self.on_unserved: Callable[[str, str], None] | None = None
        """Told once of each Service a sync left out (the dataplane's `unserved`: a full BPF map), with why:
        the API source records a Kubernetes Event about it."""
        self._reported: set[str] = set()

    # -- ObjectSink ------------------------------------------------------------------------------

    def set_service(self, key: str, svc: Service | None) -> None:
        if self.cluster.services.update(key, svc):
            self.metrics.service_changes_total.inc()
            self._queued()

    def set_endpoint_slice(self, key: str, s: EndpointSlice | None) -> None:
        arrived = time.time()
        with self._lock:
            if not self.cluster.slices.update(key, s):
                return
            if s is not None:
                triggered = s.trigger_time if s.trigger_time is not None else arrived
                if triggered >= self._started:
                    self._triggers.setdefault(s.service_key, []).append(triggered)
        self.metrics.endpoint_changes_total.inc()
        self._queued()

    def set_node(self, node: Node | None) -> None:
        self.health.set_node(node)
        if node == self.node:
            return
        if node is None:
            # Labels feed topology only: the last known ones are a better guess than none.
            log.warning("the own node was deleted from the API; keeping its last known labels")
            return
        log.info("node %s: zone=%s addresses=%s%s", node.name, node.zone or "-",
                 ",".join(f"{t}={a}" for t, a in node.addresses) or "-", " (being deleted)" if node.deleting else "")
        self.node = node
        if self.node_addresses is not None:
            self.node_addresses.set_from_node(node.primary_ipv4, node.zone, node.primary_ipv6)

    def set_node_inputs(self, inputs: NodeInputs) -> None:
        """This node as the model sees it changed (its addresses, its primary address, its zone): every Service is
        recomputed at the next sync."""
        with self._lock:
            if inputs == self._node_inputs:
                return
            self._node_inputs = inputs
        self._queued()

    def mark_synced(self) -> None:
        self._synced = True
        self.runner.request()

    def _queued(self) -> None:
        self.health.queued()
        self.metrics.last_queued.set_to_current_time()
        self.runner.request()

    # -- the one sync ----------------------------------------------------------------------------

    def sync(self) -> bool:
        """One sync; False when it had nothing it may do yet."""
        if not self._synced:
            return False  # never program a partial view: wait for every source's first complete read
        start = time.monotonic()
        with self._lock:
            changed = self.cluster.drain_changed_services() | self._retry
            triggers, self._triggers = self._triggers, {}
            node = self._node_inputs
        full = self._need_full or start - self._last_full >= self.full_sync_period
        self.desired = update_desired_state(
            self.desired, self.cluster.services.current, self.cluster.slices_for, changed, node
        )
        changed |= self.desired.also_changed  # waiting Services that got a frontend a changed one let go of
        for notice in self.desired.notices():  # rejected claims
            log.warning("%s", notice)
        if not changed and not full and not self.dataplane.housekeeping_due():
            self._update_service_health(())  # ports that could not be bound are tried again
            # What was queued (a Node event, a slice change no frontend sees) is handled: nothing to apply is
            # applied. Without this, /healthz stayed 503 from 2 x --sync-period on until a real change came.
            self.metrics.last_sync.set_to_current_time()
            self.health.updated()
            return True
        served = self.desired if self._families is None else self._families.update(self.desired,
                                                                                    None if full else changed)
        try:
            self.dataplane.apply(served, None if full else changed)
        except Exception:
            self._retry = changed
            self._need_full = True
            with self._lock:
                for svc, times in triggers.items():
                    self._triggers.setdefault(svc, []).extend(times)
            self.metrics.sync_errors.inc()
            if self.metrics.mode_failures is not None:
                self.metrics.mode_failures.inc()
            if self.metrics.partial_failures is not None and not full:
                self.metrics.partial_failures.inc()
            logs.kv(log, 0, "Sync failed", elapsed=f"{(time.monotonic() - start) * 1000:.1f}ms", fullSync=full,
                    servicesChanged=len(changed))
            raise
        self._retry = set()
        self.served = served
        if self._families is not None and (summary := self._families.summary(self.dataplane.mode)):
            log.warning("%s", summary)
        self._report_unserved()
        self._update_service_health(changed)
        applied = time.time()
        for times in triggers.values():
            for triggered in times:
                self.metrics.network_programming.observe(max(0.0, applied - triggered))
        if full:
            self._last_full, self._need_full = start, False
        elapsed = time.monotonic() - start
        self.metrics.sync_duration.observe(elapsed)
        (self.metrics.sync_full_duration if full else self.metrics.sync_partial_duration).observe(elapsed)
        self.metrics.last_sync.set_to_current_time()
        self.health.updated()
        # Upstream's V(2) "SyncProxyRules complete" with its elapsed, and what the sync did.
        logs.kv(log, 2, "SyncProxyRules complete", elapsed=f"{elapsed * 1000:.1f}ms", fullSync=full,
                servicesChanged=len(changed), services=len(self.desired.services))
        return True

    def _report_unserved(self) -> None:
        unserved = self.dataplane.unserved
        for key in unserved.keys() - self._reported:
            if self.on_unserved is not None:
                self.on_unserved(key, unserved[key])
        self._reported = set(unserved)

    def _update_service_health(self, applied: set[str] | tuple[()]) -> None:
        """Tell the healthCheckNodePort servers what the Services just applied now have."""
        if self.service_health is not None:
            services = self.served.services
            self.service_health.update({key: health_check(services.get(key, ())) for key in applied},
                                       self.served.node.nodeport_addresses)
