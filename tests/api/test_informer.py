"""The informers against a real kube-apiserver and etcd: what reaches the proxier's sink, whatever the API
server does (no dataplane here: tests/e2e/test_api_e2e.py follows the same changes into the BPF maps)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from apiobjects import Kube, service, wait_for
from cluster.cluster import Cluster

from pyproxy.k8s.client import ApiClient, ConnectionSettings, configuration
from pyproxy.k8s.informer import ApiSource
from pyproxy.k8s.sink import RecordingSink
from pyproxy.model.objects import Protocol


def make_source(kubeconfig: Path, node: str = "node-a") -> tuple[ApiSource, RecordingSink]:
    sink = RecordingSink()
    api = ApiClient(configuration(ConnectionSettings(kubeconfig=kubeconfig)))
    # Short backoff and idle timeout keep reconnect tests quick; the logic is the production one.
    return ApiSource(api, sink, node, backoff_cap=1.0, idle_timeout=20.0), sink


@pytest.fixture
def source(kubeconfig: Path) -> Iterator[tuple[ApiSource, RecordingSink]]:
    src, sink = make_source(kubeconfig)
    src.start()
    wait_for(lambda: sink.synced == 1, what="first list of Services and EndpointSlices")
    yield src, sink
    src.stop()
    src.api.close()


def in_sync(kube: Kube, sink: RecordingSink) -> bool:
    """The sink holds exactly the API server's Services and (valid) EndpointSlices."""
    return set(sink.services) == kube.list_keys("Service") and set(sink.slices) == kube.list_keys("EndpointSlice")


def test_creates_updates_and_deletes_reach_the_sink(kube: Kube, namespace: str, source) -> None:
    _, sink = source
    svc = service("web", "10.96.1.10", [("http", 80, "TCP"), ("dns", 53, "UDP")], namespace=namespace)
    eps = kube.endpoint_slice("web-1", "web", ["10.201.1.2", "10.201.2.2"], [("http", 8080, "TCP")],
                              namespace=namespace)
    kube.create(svc)
    kube.create(eps)
    key = f"{namespace}/web"
    wait_for(lambda: key in sink.services and f"{namespace}/web-1" in sink.slices, what="create")
    assert sink.services[key].cluster_ips == ("10.96.1.10",)
    assert {(p.port, p.protocol) for p in sink.services[key].ports} == {(80, Protocol.TCP), (53, Protocol.UDP)}
    assert sink.slices[f"{namespace}/web-1"].service_key == key

    kube.replace(kube.endpoint_slice("web-1", "web", ["10.201.1.2", "10.201.2.2"], [("http", 8080, "TCP")],
                                     namespace=namespace, not_ready=["10.201.2.2"]))
    wait_for(lambda: [e.ready for e in sink.slices[f"{namespace}/web-1"].endpoints] == [True, False],
             what="endpoint turning not ready")

    kube.delete(svc)
    wait_for(lambda: key not in sink.services, what="Service delete")
    kube.delete(eps)
    wait_for(lambda: f"{namespace}/web-1" not in sink.slices, what="slice delete")
    assert in_sync(kube, sink)


def test_endpointslice_version_is_found_by_discovery(source) -> None:
    src, _ = source
    # kube-apiserver 1.20 serves only v1beta1; a 1.21+ server would give v1.
    assert src.reflectors["endpointslices"]._api_version == "discovery.k8s.io/v1beta1"


def test_objects_that_cannot_be_served_are_skipped_by_name(kube: Kube, namespace: str, source,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    _, sink = source
    caplog.set_level(logging.WARNING, logger="pyproxy.k8s.informer")
    orphan = kube.endpoint_slice("orphan", None, ["10.201.1.2"], namespace=namespace)
    good = kube.endpoint_slice("good", "web", ["10.201.1.2"], namespace=namespace)
    kube.create(orphan)
    kube.create(good)
    wait_for(lambda: f"{namespace}/good" in sink.slices, what="the good slice")
    assert f"{namespace}/orphan" not in sink.slices
    warnings = [r.getMessage() for r in caplog.records if f"{namespace}/orphan" in r.getMessage()]
    assert warnings and "kubernetes.io/service-name" in warnings[0], caplog.text

    # A slice that later loses its label is removed, as if deleted; gaining it back restores it.
    kube.replace(kube.endpoint_slice("good", None, ["10.201.1.2"], namespace=namespace))
    wait_for(lambda: f"{namespace}/good" not in sink.slices, what="slice that lost its label")
    kube.replace(good)
    wait_for(lambda: f"{namespace}/good" in sink.slices, what="slice that got its label back")
    kube.delete(orphan)
    kube.delete(good)


def test_a_typo_in_a_pyproxy_annotation_keeps_the_service_and_is_logged_once(kube: Kube, namespace: str, source,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The API server admits any annotation: a Service whose pyproxy.io/scheduler names no scheduler is still
    served (with the node's default), and the log says so once for that version, not at every relist."""
    src, sink = source
    caplog.set_level(logging.WARNING, logger="pyproxy.k8s.informer")
    svc = service("typo", "10.96.1.30", [("http", 80, "TCP")], namespace=namespace)
    svc["metadata"]["annotations"] = {"pyproxy.io/scheduler": "leastconn"}
    kube.create(svc)
    key = f"{namespace}/typo"
    wait_for(lambda: key in sink.services, what="the Service with a bad annotation")
    assert sink.services[key].scheduler == ""
    src.reflectors["services"].list()  # a relist converts it again
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert lines == [f"services {key}: ignoring metadata.annotations[pyproxy.io/scheduler] 'leastconn' is not one "
                     "of random, rr, wrr, lc, sed, nq, sh, dh, maglev: the node's default scheduler applies"], lines
    kube.delete(svc)


def test_services_for_another_proxy_are_not_ours(kube: Kube, namespace: str, source) -> None:
    _, sink = source
    other = service("other", "10.96.1.11", namespace=namespace,
                    labels={"service.kubernetes.io/service-proxy-name": "someone-else"})
    mine = service("mine", "10.96.1.12", namespace=namespace)
    kube.create(other)
    kube.create(mine)
    wait_for(lambda: f"{namespace}/mine" in sink.services, what="our Service")
    assert f"{namespace}/other" not in sink.services
    kube.delete(other)
    kube.delete(mine)


def test_own_node_labels_and_addresses(kube: Kube, kubeconfig: Path) -> None:
    name = "node-labels-test"
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "zone-a"}}}
    kube.api.request("POST", "/api/v1/nodes", body=node)
    src, sink = make_source(kubeconfig, node=name)
    src.start()
    try:
        wait_for(lambda: sink.node is not None, what="own node")
        assert sink.node is not None and sink.node.zone == "zone-a"
        # Another node's changes are not delivered: the watch is on our node's name only.
        kube.api.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node",
                                                        "metadata": {"name": f"{name}-other"}})
        node["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-b"
        kube.api.request("PUT", f"/api/v1/nodes/{name}", body=node)
        wait_for(lambda: sink.node is not None and sink.node.zone == "zone-b", what="zone change")
        assert {c[1] for c in sink.calls if c[0] == "Node"} == {name}
    finally:
        src.stop()
        for n in (name, f"{name}-other"):
            kube.api.request("DELETE", f"/api/v1/nodes/{n}")


def test_expired_watch_relists_to_exactly_the_api_state(kube: Kube, namespace: str, cluster: Cluster,
                                                         source) -> None:
    """Changes made while pyproxy cannot watch, then etcd compaction and a restarted API server: the watch
    cannot resume (410 Gone), the relist reconciles by diff: no stale object, no duplicate delivery."""
    src, sink = source
    stays = service("stays", "10.96.2.1", namespace=namespace)
    goes = service("goes", "10.96.2.2", namespace=namespace)
    eps = kube.endpoint_slice("stays-1", "stays", ["10.201.1.2"], namespace=namespace)
    for obj in (stays, goes, eps):
        kube.create(obj)
    wait_for(lambda: {f"{namespace}/stays", f"{namespace}/goes"} <= set(sink.services), what="initial objects")
    expired_before = src.reflectors["services"].stats.expired

    cluster.stop_apiserver()
    with cluster.extra_apiserver() as other:
        # Through another API server on the same etcd: this proxy's watch never sees these events.
        status, _ = other.request("DELETE", f"/api/v1/namespaces/{namespace}/services/goes")
        assert status == 200
        status, _ = other.request("POST", f"/api/v1/namespaces/{namespace}/services",
                                  service("new", "10.96.2.3", namespace=namespace))
        assert status == 201
        moved = kube.endpoint_slice("stays-1", "stays", ["10.201.2.2"], namespace=namespace)
        status, _ = other.request("PUT", f"{kube.slice_path.replace('/endpointslices', '')}/namespaces/"
                                         f"{namespace}/endpointslices/stays-1", moved)
        assert status == 200, status
    cluster.compact()
    calls_before = len(sink.calls)
    cluster.start_apiserver()

    wait_for(lambda: in_sync(kube, sink) and f"{namespace}/new" in sink.services, timeout=30,
             what="relist to the API's state")
    wait_for(lambda: sink.slices[f"{namespace}/stays-1"].endpoints[0].addresses == ("10.201.2.2",),
             what="slice changed while away")
    assert src.reflectors["services"].stats.expired > expired_before, src.reflectors["services"].stats
    after = sink.calls[calls_before:]
    # Each change delivered once; nothing that did not change is delivered as a change.
    assert after.count(("Service", f"{namespace}/goes", False)) == 1, after
    assert after.count(("Service", f"{namespace}/new", True)) == 1, after
    for obj in (stays, eps, service("new", "10.96.2.3", namespace=namespace)):
        kube.delete(obj)


def test_unreachable_api_server_keeps_the_last_state(kube: Kube, namespace: str, cluster: Cluster,
                                                     source) -> None:
    src, sink = source
    svc = service("kept", "10.96.3.1", namespace=namespace)
    kube.create(svc)
    wait_for(lambda: f"{namespace}/kept" in sink.services, what="Service")
    before = (dict(sink.services), dict(sink.slices))
    calls = len(sink.calls)
    cluster.stop_apiserver()
    try:
        # Reconnect attempts fail and back off; nothing is delivered meanwhile, least of all deletions.
        wait_for(lambda: src.reflectors["services"].stats.errors >= 2, timeout=15, what="failed reconnects")
        assert (dict(sink.services), dict(sink.slices)) == before
        assert sink.calls[calls:] == []
    finally:
        cluster.start_apiserver()
    kube.delete(svc)
    wait_for(lambda: f"{namespace}/kept" not in sink.services, timeout=15, what="watch resumed after restart")
