"""Prometheus metrics with upstream kube-proxy's names, on a registry of pyproxy's own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.k8s.informer import ReflectorStats

# Upstream's buckets for sync durations: 1 ms doubling up to about 16 s.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# Upstream's network-programming buckets (0.25 s, 0.5 s, then 1 s steps to a minute and coarser up to
# 410 s), with finer ones below 0.25 s prepended: pyproxy usually programs a change well within 100 ms,
# which upstream's buckets would not resolve.
_NETWORK_PROGRAMMING_BUCKETS = (
    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
    + tuple(float(s) for s in range(1, 60))
    + tuple(float(s) for s in range(60, 120, 5))
    + tuple(float(s) for s in range(300, 420, 10))
)


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
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            buckets=_NETWORK_PROGRAMMING_BUCKETS,
            registry=r,
        )
        self.sync_errors = Counter("pyproxy_sync_errors", "Syncs that failed to apply", registry=r)
        mode_info = Gauge("pyproxy_proxy_mode", "The dataplane in use (value 1)", ["mode"], registry=r)
        mode_info.labels(mode=mode).set(1)


class InformerCollector(Collector):
    """The API informers' counters (`ReflectorStats`), one series per resource, read at scrape time."""

    def __init__(self, stats: Mapping[str, ReflectorStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        for f in fields(ReflectorStats):
            family = CounterMetricFamily(
                f"pyproxy_informer_{f.name}", f.metadata["help"], labels=["resource"]
            )
            for resource, stats in self.stats.items():
                family.add_metric([resource], getattr(stats, f.name))
            yield family
