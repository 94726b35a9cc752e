"""pyproxy's Prometheus series: the bpf collector's per-frontend traffic and datapath counters (from fake maps:
the formatting only; tests/e2e/test_metrics_e2e.py counts real traffic), upstream's kubeproxy_* series, and the
Grafana dashboard in deploy/ querying only series pyproxy has."""

from __future__ import annotations

import ctypes
import json
import re
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.backend import BpfDataplane
from pyproxy.dataplane.bpf.collector import endpoint_owners
from pyproxy.dataplane.bpf.render import Applied, AppliedFrontend
from pyproxy.dataplane.bpf.settings import BpfSettings
from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.k8s.informer import ReflectorStats
from pyproxy.model.conntrack import Stale
from pyproxy.model.objects import Protocol, Service, ServicePort
from pyproxy.model.state import Backend, DesiredState, Frontend, FrontendKind, ServicePortState
from pyproxy.proxier.metrics import InformerCollector, NoLocalEndpointsCollector, ProxyMetrics, no_local_endpoints
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth, health_server

ROOT = Path(__file__).resolve().parents[2]


def samples(*collectors: Collector) -> dict[str, float]:
    """{"name{label=value,...}": value} of what `collectors` export, as a scrape reads it."""
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class FakePerCpu:
    def __init__(self, values: Mapping[int, Sequence[object]]) -> None:
        self.values = values

    def get(self, index: int) -> Sequence[object]:
        return self.values.get(index, [])


def _fe(svc_id: int, name: str, service: str) -> AppliedFrontend:
    return AppliedFrontend(svc_id=svc_id, name=name, service=service, backends=(), known=(), affinity_sec=0)


def bpf_with_traffic() -> BpfDataplane:
    dp = BpfDataplane(BpfSettings())
    dp.applied = Applied({
        ("10.96.0.10", 53, "UDP", abi.SVC_SCOPE_PACKETS): _fe(1, "kube-system/dns:dns", "kube-system/dns"),
        ("192.0.2.1", 30080, "TCP", abi.SVC_SCOPE_PACKETS): _fe(2, "default/web", "default/web"),
        ("192.0.2.1", 30080, "TCP", abi.SVC_SCOPE_NODE): _fe(3, "default/web", "default/web"),
    })
    counters = {i: [ctypes.c_uint64(i), ctypes.c_uint64(10)] for i in range(len(abi.COUNTERS))}
    dp.maps = SimpleNamespace(  # type: ignore[assignment]
        stats=FakePerCpu({1: [abi.SvcStats(3, 300), abi.SvcStats(4, 100)], 2: [abi.SvcStats(1, 60)],
                          3: [abi.SvcStats(0, 0)]}),
        counters=FakePerCpu(counters),
        endpoint_stats=lambda: {})
    return dp


def _fe_of(svc_id: int, service: str, port: str, *known: Backend) -> AppliedFrontend:
    return AppliedFrontend(svc_id=svc_id, name=f"{service}:{port}" if port else service, service=service,
                           backends=known, known=known, affinity_sec=0)


def bpf_with_endpoint_traffic() -> BpfDataplane:
    """Two Services whose Service ports share one endpoint address:port, and a not-ready endpoint with no traffic."""
    a, b, shared, idle = (Backend(f"10.0.1.{i}", 8080) for i in (1, 2, 3, 4))
    dp = BpfDataplane(BpfSettings(endpoint_counters=True))
    dp.applied = Applied({
        ("10.96.0.10", 80, "TCP", 0): _fe_of(1, "default/web", "http", a, b, shared, idle),
        ("192.0.2.1", 30080, "TCP", 0): _fe_of(2, "default/web", "http", a, b, shared, idle),
        ("10.96.0.11", 80, "TCP", 0): _fe_of(3, "apps/api", "", shared),
    })
    counts = {a: (5, 500), b: (2, 120), shared: (7, 700), idle: (0, 0), Backend("10.9.9.9", 1): (3, 3)}
    dp.maps = SimpleNamespace(stats=FakePerCpu({}), counters=FakePerCpu({}),  # type: ignore[assignment]
                              endpoint_stats=lambda: counts)
    return dp


def test_bpf_collector_exports_each_endpoint_that_was_sent_traffic_once() -> None:
    got = {k: v for k, v in samples(bpf_with_endpoint_traffic().collector).items() if k.startswith("pyproxy_endpoint_")}
    web = "namespace=default,port=http,service=web"
    assert got == {
        f"pyproxy_endpoint_packets_total{{endpoint=10.0.1.1:8080,{web}}}": 5,
        f"pyproxy_endpoint_bytes_total{{endpoint=10.0.1.1:8080,{web}}}": 500,
        f"pyproxy_endpoint_packets_total{{endpoint=10.0.1.2:8080,{web}}}": 2,
        f"pyproxy_endpoint_bytes_total{{endpoint=10.0.1.2:8080,{web}}}": 120,
        # Shared by apps/api and default/web: one series, the first Service port's labels, both Services' packets.
        "pyproxy_endpoint_packets_total{endpoint=10.0.1.3:8080,namespace=apps,port=,service=api}": 7,
        "pyproxy_endpoint_bytes_total{endpoint=10.0.1.3:8080,namespace=apps,port=,service=api}": 700,
    }, "no series for an endpoint without traffic, nor for a backend no Service has"


def test_bpf_collector_exports_no_endpoint_series_with_the_counters_off() -> None:
    dp = bpf_with_endpoint_traffic()
    dp.settings.endpoint_counters = False
    assert not [k for k in samples(dp.collector) if k.startswith("pyproxy_endpoint_")]


def test_bpf_collector_exports_each_frontends_packets_and_bytes_summed_over_cpus() -> None:
    dp = bpf_with_traffic()
    got = samples(dp.collector)
    dns = "frontend=10.96.0.10:53/UDP,namespace=kube-system,port=dns,service=dns"
    assert got[f"pyproxy_service_packets_total{{{dns}}}"] == 7
    assert got[f"pyproxy_service_bytes_total{{{dns}}}"] == 400
    web = "namespace=default,port=,service=web"
    assert got[f"pyproxy_service_packets_total{{frontend=192.0.2.1:30080/TCP,{web}}}"] == 1
    assert got[f"pyproxy_service_bytes_total{{frontend=192.0.2.1:30080/TCP (node),{web}}}"] == 0
    assert len([k for k in got if k.startswith("pyproxy_service_packets_total{")]) == 3, "one series per frontend"
    dp.maps = None
    dp.applied = Applied()


def test_bpf_collector_exports_every_datapath_counter_by_its_name() -> None:
    got = samples(bpf_with_traffic().collector)
    for i, name in enumerate(abi.COUNTERS):
        assert got[f"pyproxy_bpf_datapath_events_total{{event={name}}}"] == i + 10


def test_bpf_collector_before_start_exports_no_series_and_no_error() -> None:
    got = samples(BpfDataplane(BpfSettings()).collector)
    assert not [k for k in got if k.startswith(("pyproxy_service_", "pyproxy_bpf_datapath_events"))]


def _sp(service: str, kind: FrontendKind, *, backends: tuple[Backend, ...] = (), external: tuple[Backend, ...] = (),
        masquerade: bool = False, drop: bool = False, port: int = 80) -> ServicePortState:
    return ServicePortState(service, "http", Frontend("10.96.0.1", port, Protocol.TCP), backends, kind=kind,
                            external_backends=external, masquerade=masquerade, drop=drop)


def test_no_local_endpoints_counts_service_ports_whose_local_policy_finds_none_here() -> None:
    b = (Backend("10.1.0.1", 8080),)
    desired = DesiredState(services={
        # externalTrafficPolicy Local, no endpoint here: its NodePort and LoadBalancer frontends count once
        "a/local": (_sp("a/local", FrontendKind.CLUSTER_IP, backends=b),
                    _sp("a/local", FrontendKind.NODE_PORT, backends=b, port=30080),
                    _sp("a/local", FrontendKind.LOAD_BALANCER, backends=b)),
        "a/served": (_sp("a/served", FrontendKind.NODE_PORT, backends=b, external=b, port=30081),),
        "a/cluster": (_sp("a/cluster", FrontendKind.NODE_PORT, backends=b, external=b, masquerade=True,
                          port=30082),),
        "a/itp": (_sp("a/itp", FrontendKind.CLUSTER_IP, drop=True),),  # internalTrafficPolicy Local
    })
    assert no_local_endpoints(desired) == {"internal": 1, "external": 1}
    got = samples(NoLocalEndpointsCollector(lambda: desired))
    assert got["kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=external}"] == 1


@pytest.mark.parametrize(("mode", "present", "absent"), [
    ("iptables", ["kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                  "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"],
     ["kubeproxy_sync_proxy_rules_nftables_sync_failures_total"]),
    ("ipvs", ["kubeproxy_sync_proxy_rules_iptables_restore_failures_total"],
     ["kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"]),
    ("nftables", ["kubeproxy_sync_proxy_rules_nftables_sync_failures_total"],
     ["kubeproxy_sync_proxy_rules_iptables_restore_failures_total"]),
    ("bpf", [], ["kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                 "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"]),
])
def test_each_mode_has_upstreams_failure_counters_of_that_mode(mode: str, present: list[str],
                                                                 absent: list[str]) -> None:
    got = samples(*ProxyMetrics(mode).registry._collector_to_names)  # noqa: SLF001
    for name in present:
        assert got[name] == 0
    for name in absent:
        assert name not in got


def test_a_failed_sync_counts_in_the_modes_failure_counter_and_syncs_by_kind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(1)
    metrics = ProxyMetrics("iptables")
    dp = FakeDataplane()
    p = Proxier(dp, min_sync_period=0, sync_period=3600, metrics=metrics, health=ProxyHealth(sync_period=30))
    p.set_service("default/a", Service("default", "a", "ClusterIP", ("10.96.0.1",),
                                       (ServicePort("", 80, Protocol.TCP, 8080),)))
    assert metrics.last_queued._value.get() > 0  # noqa: SLF001
    p.mark_synced()
    p.sync()  # the first: full
    p.set_service("default/b", Service("default", "b", "ClusterIP", ("10.96.0.2",),
                                       (ServicePort("", 80, Protocol.TCP, 8080),)))
    dp.fail_next = 1
    with pytest.raises(Exception, match="injected"):
        p.sync()  # a partial one, failed
    p.sync()  # the retry: full
    got = samples(*metrics.registry._collector_to_names)  # noqa: SLF001
    assert got["kubeproxy_sync_proxy_rules_iptables_restore_failures_total"] == 1
    assert got["kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"] == 1
    assert got["kubeproxy_sync_full_proxy_rules_duration_seconds_count"] == 2
    assert got["kubeproxy_sync_partial_proxy_rules_duration_seconds_count"] == 0
    assert got["kubeproxy_sync_proxy_rules_duration_seconds_count"] == 2
    said = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("SyncProxyRules complete elapsed=") for m in said) == 2
    failed = [m for m in said if m.startswith("Sync failed ")]
    assert len(failed) == 1
    assert re.fullmatch(r"Sync failed elapsed=[\d.]+ms fullSync=False servicesChanged=1", failed[0])


def test_healthz_and_livez_answers_are_counted_by_code() -> None:
    metrics = ProxyMetrics("fake")
    health = ProxyHealth(sync_period=30)
    server = health_server("127.0.0.1", 0, health, metrics).start()
    try:
        for path in ("/healthz", "/livez", "/livez"):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5).close()
            except urllib.error.HTTPError as e:
                assert e.code == 503  # not synced yet
    finally:
        server.stop()
    got = samples(*metrics.registry._collector_to_names)  # noqa: SLF001
    assert got["kubeproxy_proxy_healthz_total{code=503}"] == 1
    assert got["kubeproxy_proxy_livez_total{code=200}"] == 2


def test_conntrack_reconciler_counts_deleted_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nf.shutil, "which", lambda _name: "/usr/sbin/conntrack")
    monkeypatch.setattr(nf, "conntrack_delete", lambda *_args: 3)
    m = nf.ConntrackMetrics()
    stale = Stale("10.96.0.10", 53)
    assert nf.clear_stale_udp([stale, stale], m) == 6
    assert nf.clear_stale_udp([], m) == 0
    got = samples(m)
    assert got["kubeproxy_conntrack_reconciler_deleted_entries_total"] == 6
    assert got["kubeproxy_conntrack_reconciler_sync_duration_seconds_count"] == 1


def all_sample_names() -> set[str]:
    """Every sample name pyproxy can export, over its modes (families with no sample yet included)."""
    collectors: list[Collector] = []
    for mode in ("iptables", "ipvs", "nftables", "bpf"):
        collectors += ProxyMetrics(mode).registry._collector_to_names  # noqa: SLF001
    collectors += [bpf_with_traffic().collector, bpf_with_endpoint_traffic().collector, nf.ConntrackMetrics(),
                   InformerCollector({"services": ReflectorStats()}), NoLocalEndpointsCollector(DesiredState)]
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "info": ("_info",)}
    for c in collectors:
        for family in c.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:pyproxy|kubeproxy)_[a-z0-9_]+)", expr))


def test_the_grafana_dashboard_queries_only_series_pyproxy_exports() -> None:
    board = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    assert exprs
    queried = set().union(*map(_metrics_in, exprs))
    known = all_sample_names()
    assert queried - known == set()
    for needed in ("pyproxy_service_packets_total", "pyproxy_service_bytes_total", "pyproxy_bpf_datapath_events_total",
                   "pyproxy_bpf_map_entries", "kubeproxy_sync_proxy_rules_duration_seconds_bucket"):
        assert needed in queried


def test_every_series_the_operator_guide_lists_exists() -> None:
    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    section = guide[guide.index("### Metrics"):]
    section = section[:section.index("\n## ", 1) if "\n## " in section else len(section)]
    table = "\n".join(line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `"))
    listed = {n for n in re.findall(r"`((?:pyproxy|kubeproxy)_[a-z0-9_]+)", table) if not n.endswith("_")}
    assert listed
    known = all_sample_names()
    families = {n.removesuffix(s) for n in known for s in ("_total", "_bucket", "_seconds")}
    assert {n for n in listed if n not in known and n not in families} == set()


def test_a_shared_endpoint_is_labelled_by_namespace_then_name_then_port() -> None:
    shared = Backend("10.0.1.3", 8080)
    owners = endpoint_owners([_fe_of(1, "a/b", "z", shared), _fe_of(2, "a-x/a", "a", shared),
                              _fe_of(3, "a/b", "y", shared)])
    assert owners == {shared: ("a", "b", "y")}  # "a" before "a-x", though "a-x/a" sorts before "a/b" as a string
