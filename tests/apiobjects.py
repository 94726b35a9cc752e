"""Building and changing Services and EndpointSlices on a real API server, for the tests.

The API server is kube-apiserver v1.20 (see tests/cluster/build-apiserver.sh), which serves EndpointSlices as
discovery.k8s.io/v1beta1 only; `Kube.slice_version` follows what the server serves, like pyproxy.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cluster.cluster import Cluster

from pyproxy.k8s.client import ApiClient, ApiError, ConnectionSettings, configuration
from pyproxy.k8s.informer import slice_locator

TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def service(name: str, ip: str, ports: Sequence[tuple[str, int, str]] = (("", 80, "TCP"),),
            namespace: str = "default", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {
            "clusterIP": ip,
            "ports": [{"name": n, "port": p, "protocol": proto, "targetPort": p} for n, p, proto in ports],
        },
    }


class Kube:
    """Admin access through pyproxy's own client (the transport under test elsewhere, here only a tool)."""

    def __init__(self, kubeconfig: Path) -> None:
        cfg = configuration(ConnectionSettings(kubeconfig=kubeconfig))
        cfg.connection_pool_maxsize = 32
        self.api = ApiClient(cfg)
        self.slice_path, self.slice_api_version = slice_locator(self.api)

    def close(self) -> None:
        self.api.close()

    # ---- objects

    def endpoint_slice(self, name: str, service_name: str | None, addresses: Iterable[str],
                       ports: Sequence[tuple[str, int, str]] = (("", 8080, "TCP"),), *,
                       namespace: str = "default", not_ready: Iterable[str] = (),
                       trigger_time: float | None = None) -> dict[str, Any]:
        """A slice in the server's version; `service_name=None` leaves out the service label."""
        not_ready = set(not_ready)
        labels = {"kubernetes.io/service-name": service_name} if service_name else {}
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
        if trigger_time is not None:
            meta["annotations"] = {TRIGGER_ANNOTATION: rfc3339(trigger_time)}
        return {
            "apiVersion": self.slice_api_version,
            "kind": "EndpointSlice",
            "metadata": meta,
            "addressType": "IPv4",
            "endpoints": [{"addresses": [a], "conditions": {"ready": a not in not_ready}} for a in addresses],
            "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
        }

    def _collection(self, obj: dict[str, Any]) -> str:
        ns = obj["metadata"].get("namespace", "default")
        if obj["kind"] == "Service":
            return f"/api/v1/namespaces/{ns}/services"
        if obj["kind"] == "Namespace":
            return "/api/v1/namespaces"
        return self.slice_path.replace("/endpointslices", f"/namespaces/{ns}/endpointslices")

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.api.request("POST", self._collection(obj), body=obj)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT over whatever version is there (Services insist on a resourceVersion): last writer wins, which is
        what a test that owns the object wants."""
        path = f"{self._collection(obj)}/{obj['metadata']['name']}"
        current = self.api.request("GET", path)
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
        return self.api.request("PUT", path, body=body)

    def delete(self, obj: dict[str, Any], missing_ok: bool = False) -> None:
        try:
            self.api.request("DELETE", f"{self._collection(obj)}/{obj['metadata']['name']}")
        except ApiError as e:
            if not (missing_ok and e.status == 404):
                raise

    def namespace(self, prefix: str = "t") -> str:
        """A new namespace with a unique name (namespaces are never deleted: no controller finalizes them)."""
        name = f"{prefix}-{secrets.token_hex(4)}"
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        return name

    def list_keys(self, kind: str) -> set[str]:
        """namespace/name of every Service or EndpointSlice the server has."""
        path = "/api/v1/services" if kind == "Service" else self.slice_path
        items = self.api.request("GET", path)["items"]
        return {f"{i['metadata']['namespace']}/{i['metadata']['name']}" for i in items}

    def create_many(self, objects: Sequence[dict[str, Any]], threads: int = 16) -> float:
        """Create in parallel; returns the time.time() at which the last create was answered."""
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(self.create, objects))
        return time.time()

    def delete_many(self, objects: Sequence[dict[str, Any]], threads: int = 16) -> None:
        def delete(obj: dict[str, Any]) -> None:
            self.delete(obj, missing_ok=True)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(delete, objects))


def wait_for(check: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02,
             what: str = "condition") -> float:
    """Seconds until `check()` held; AssertionError naming `what` if it did not within `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} did not hold within {timeout:g}s")
        time.sleep(interval)
    return time.monotonic() - start


def manifest_path(doc: dict[str, Any], name: bool = False) -> str:
    """The REST path of a manifest's collection (or, with `name`, of the object itself)."""
    version = doc["apiVersion"]
    base = "/api/v1" if version == "v1" else f"/apis/{version}"
    plural = doc["kind"].lower() + "s"
    ns = doc["metadata"].get("namespace")
    path = f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"
    return f"{path}/{doc['metadata']['name']}" if name else path


def create_manifest(cluster: Cluster, doc: dict[str, Any], *, replace: bool = False) -> dict[str, Any]:
    """POST a manifest as `kubectl create` does; one that exists already is left as it is, or with `replace`
    deleted and created again. Returns the object as the server stored it."""
    status, body = cluster.request("POST", manifest_path(doc), doc)
    if status == 409 and replace:
        cluster.request("DELETE", manifest_path(doc, name=True))
        status, body = cluster.request("POST", manifest_path(doc), doc)
    assert status in (201, 409), f"{doc['kind']} {doc['metadata']['name']}: {status} {body.get('message')}"
    status, body = cluster.request("GET", manifest_path(doc, name=True))
    assert status == 200, body
    return body
