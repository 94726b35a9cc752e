"""Prometheus metrics with upstream kube-proxy's names, on a registry of pyproxy's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.k8s.informer import ReflectorStats
from pyproxy.model.state import DesiredState

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


_MODE_FAILURES = {
    "iptables": ("kubeproxy_sync_proxy_rules_iptables_restore_failures", "Cumulative proxy iptables restore failures"),
    "ipvs": ("kubeproxy_sync_proxy_rules_iptables_restore_failures", "Cumulative proxy iptables restore failures"),
    "nftables": ("kubeproxy_sync_proxy_rules_nftables_sync_failures", "Cumulative proxy nftables sync failures"),
}
"""Mode -> (name without _total, help) of upstream's counter of failed syncs in that mode."""


class ProxyMetrics:
    def __init__(self, mode: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def sync_histogram(name: str, help_: str) -> Histogram:
            return Histogram(name, help_, buckets=_SYNC_BUCKETS, registry=r)

        self.sync_duration = sync_histogram("kubeproxy_sync_proxy_rules_duration_seconds",
                                            "SyncProxyRules latency in seconds")
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
        self.sync_full_duration = sync_histogram("kubeproxy_sync_full_proxy_rules_duration_seconds",
                                                 "SyncProxyRules latency in seconds for full resyncs")
        self.sync_partial_duration = sync_histogram("kubeproxy_sync_partial_proxy_rules_duration_seconds",
                                                    "SyncProxyRules latency in seconds for partial resyncs")
        self.last_queued = Gauge("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                                 "The last time a sync of proxy rules was queued", registry=r)
        self.healthz = Counter("kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"], registry=r)
        self.livez = Counter("kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", ["code"], registry=r)
        self.sync_errors = Counter("pyproxy_sync_errors", "Syncs that failed to apply", registry=r)
        # Upstream's per-mode failure counters: a failed apply in that mode is what upstream counts (iptables-restore
        # for iptables and ipvs, the nft transaction for nftables). The bpf mode has none of upstream's.
        failure = _MODE_FAILURES.get(mode)
        self.mode_failures = Counter(failure[0], failure[1], registry=r) if failure else None
        self.partial_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures", registry=r,
        ) if mode == "iptables" else None
        """iptables mode: failed partial syncs (the next sync is a full one, as upstream's fallback)."""
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


def no_local_endpoints(desired: DesiredState) -> dict[str, int]:
    """Upstream's kubeproxy_sync_proxy_rules_no_local_endpoints_total, by traffic_policy: Service ports whose Local
    policy finds no usable endpoint on this node. "external": an external frontend with externalTrafficPolicy
    Local (not masqueraded) and no local endpoint; "internal": a ClusterIP frontend with internalTrafficPolicy
    Local that drops because this node has none while the cluster has some (the model does not keep the policy
    of one whose cluster has none either, which upstream also counts)."""
    internal: set[tuple[str, str]] = set()
    external: set[tuple[str, str]] = set()
    for states in desired.services.values():
        for sp in states:
            if sp.kind.external:
                if not sp.masquerade and not sp.external_backends:
                    external.add((sp.service, sp.port_name))
            elif sp.drop:
                internal.add((sp.service, sp.port_name))
    return {"internal": len(internal), "external": len(external)}


class NoLocalEndpointsCollector(Collector):
    """kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy}, counted at scrape time from the last
    desired state (a gauge, as upstream's, despite its name)."""

    def __init__(self, desired: Callable[[], DesiredState]) -> None:
        self.desired = desired

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                                   "Number of services with a Local traffic policy and no endpoints",
                                   labels=["traffic_policy"])
        for policy, n in no_local_endpoints(self.desired()).items():
            family.add_metric([policy], n)
        yield family
