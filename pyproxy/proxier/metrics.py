"""Prometheus metrics with upstream kube-proxy's names, on a registry of pyproxy's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Upstream's buckets for sync durations: 1 ms doubling up to about 16 s.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))


class ProxyMetrics:
    def __init__(self, mode: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            buckets=_SYNC_BUCKETS,
            registry=r,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            registry=r,
        )
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", registry=r
        )
        self.service_changes_total = Counter(
            "kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", registry=r
        )
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            registry=r,
        )
        self.endpoint_changes_total = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", registry=r
        )
        self.sync_errors = Counter("pyproxy_sync_errors", "Syncs that failed to apply", registry=r)
        mode_info = Gauge("pyproxy_proxy_mode", "The dataplane in use (value 1)", ["mode"], registry=r)
        mode_info.labels(mode=mode).set(1)
