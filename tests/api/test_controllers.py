"""The real control plane of tests/cluster/cluster.py (`controllers=True`): kube-controller-manager and
kube-scheduler v1.20.2 beside etcd and kube-apiserver act on what a user creates, as on a real cluster.

No kubelet runs here, so this test plays the kubelet's part for one Pod (it reports the Pod's IP and readiness
the way a kubelet's status update does); everything else comes from the real controllers: the ServiceAccount and
its token, the EndpointSlice of a Service with a selector, the Node's pod CIDR, the Pod's node.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from apiobjects import wait_for
from cluster.cluster import Cluster

POD_CIDR = "10.244.0.0/16"
NODE = "node-1"
SLICES = "/apis/discovery.k8s.io/v1beta1/namespaces/default/endpointslices"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A missing binary fails here with a message naming `make apiserver`: never a skip.
    with Cluster(tmp_path_factory.mktemp("controlplane"), controllers=True, pod_cidr=POD_CIDR) as c:
        yield c


def get(cluster: Cluster, path: str) -> dict[str, Any]:
    status, body = cluster.request("GET", path)
    return body if status == 200 else {}


def create(cluster: Cluster, path: str, obj: dict[str, Any]) -> dict[str, Any]:
    status, body = cluster.request("POST", path, obj)
    assert status == 201, body
    return body


def service_slices(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get(cluster, f"{SLICES}?labelSelector=kubernetes.io/service-name%3D{name}").get(
        "items", [])
    return items


def test_controller_manager_makes_service_accounts_and_endpoint_slices(plane: Cluster) -> None:
    # The ServiceAccount and token controllers (so the ServiceAccount admission plugin can stay on).
    wait_for(lambda: bool(get(plane, "/api/v1/namespaces/default/serviceaccounts/default").get("secrets")),
             timeout=60, interval=0.2, what="the default ServiceAccount with its token Secret")

    create(plane, "/api/v1/namespaces/default/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
    wait_for(lambda: bool(service_slices(plane, "web")), timeout=30, interval=0.2, what="web's EndpointSlice")
    (slice_,) = service_slices(plane, "web")
    assert slice_["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] == "endpointslice-controller.k8s.io"
    assert not slice_.get("endpoints")  # no Pod yet


def test_scheduler_places_a_pod_and_its_endpoint_follows(plane: Cluster) -> None:
    create(plane, "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    # What a kubelet reports: without a Ready condition the node lifecycle controller taints the Node and the
    # scheduler would leave the Pod Pending.
    status, body = plane.request("PATCH", f"/api/v1/nodes/{NODE}/status", {"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}],
        "addresses": [{"type": "InternalIP", "address": "192.0.2.11"}],
        "allocatable": {"cpu": "2", "memory": "2Gi", "pods": "110"},
        "capacity": {"cpu": "2", "memory": "2Gi", "pods": "110"}}})
    assert status == 200, body
    wait_for(lambda: bool(get(plane, f"/api/v1/nodes/{NODE}").get("spec", {}).get("podCIDR")), timeout=30,
             interval=0.2, what="the node IPAM controller's podCIDR")
    assert get(plane, f"/api/v1/nodes/{NODE}")["spec"]["podCIDR"].startswith("10.244.")

    create(plane, "/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-1", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "echo", "image": "localhost/pyproxy-echo:1",
                                 "ports": [{"containerPort": 8080}]}]}})
    pod_path = "/api/v1/namespaces/default/pods/web-1"
    wait_for(lambda: get(plane, pod_path).get("spec", {}).get("nodeName") == NODE, timeout=30, interval=0.2,
             what="the scheduler binding web-1 to node-1")

    status, body = plane.request("PATCH", f"{pod_path}/status", {"status": {
        "phase": "Running", "podIP": "10.244.0.5", "podIPs": [{"ip": "10.244.0.5"}],
        "conditions": [{"type": "Ready", "status": "True"}]}})
    assert status == 200, body

    def endpoint() -> list[dict[str, Any]]:
        slices = service_slices(plane, "web")
        return [ep for s in slices for ep in s.get("endpoints") or []]

    wait_for(lambda: bool(endpoint()), timeout=30, interval=0.2, what="web-1 in web's EndpointSlice")
    (ep,) = endpoint()
    assert ep["addresses"] == ["10.244.0.5"]
    assert ep["topology"]["kubernetes.io/hostname"] == NODE
    assert ep["conditions"]["ready"] is True
