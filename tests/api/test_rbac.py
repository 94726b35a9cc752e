"""deploy/rbac.yaml against an API server that enforces RBAC: enough for pyproxy, and nothing more."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from apiobjects import Kube, create_manifest, service, wait_for
from cluster.cluster import Cluster

from pyproxy.k8s.client import ApiClient, ConnectionSettings, configuration
from pyproxy.k8s.events import record_node_event
from pyproxy.k8s.informer import ApiSource
from pyproxy.k8s.sink import RecordingSink

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "rbac.yaml"
# What pyproxy does with its token; each must be allowed cluster-wide.
NEEDED = {
    ("", "services", "list"), ("", "services", "watch"),
    ("", "nodes", "list"), ("", "nodes", "watch"),
    ("discovery.k8s.io", "endpointslices", "list"), ("discovery.k8s.io", "endpointslices", "watch"),
    ("", "events", "create"), ("", "events", "patch"),
    ("events.k8s.io", "events", "create"), ("events.k8s.io", "events", "patch"),
}
RESOURCES = [("", "services"), ("", "endpoints"), ("", "nodes"), ("", "pods"), ("", "secrets"),
             ("", "configmaps"), ("", "events"), ("", "namespaces"), ("", "serviceaccounts"),
             ("discovery.k8s.io", "endpointslices"), ("events.k8s.io", "events"),
             ("rbac.authorization.k8s.io", "clusterroles"), ("rbac.authorization.k8s.io", "clusterrolebindings")]
VERBS = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection", "escalate", "bind",
         "impersonate"]


@pytest.fixture(scope="module")
def proxy_token(cluster: Cluster) -> str:
    """A real ServiceAccount token (TokenRequest API) for the account deploy/rbac.yaml binds."""
    for doc in yaml.safe_load_all(RBAC.read_text()):
        create_manifest(cluster, doc)
    return cluster.service_account_token("kube-system", "pyproxy")


@pytest.fixture
def proxy_kubeconfig(cluster: Cluster, proxy_token: str, tmp_path: Path) -> Path:
    return cluster.write_kubeconfig(tmp_path / "pyproxy.kubeconfig", proxy_token)


@pytest.fixture
def proxy_source(proxy_kubeconfig: Path) -> Iterator[tuple[ApiSource, RecordingSink]]:
    sink = RecordingSink()
    src = ApiSource(ApiClient(configuration(ConnectionSettings(kubeconfig=proxy_kubeconfig))), sink, "rbac-node",
                    backoff_cap=1.0)
    src.start()
    yield src, sink
    src.stop()


def test_the_role_is_enough(kube: Kube, namespace: str, proxy_source, proxy_kubeconfig: Path) -> None:
    src, sink = proxy_source
    wait_for(lambda: sink.synced == 1, what="first list with the pyproxy ServiceAccount's token")
    kube.create(service("web", "10.96.4.1", namespace=namespace))
    kube.create(kube.endpoint_slice("web-1", "web", ["10.201.1.2"], namespace=namespace))
    wait_for(lambda: f"{namespace}/web" in sink.services and f"{namespace}/web-1" in sink.slices,
             what="watch events with the pyproxy token")
    assert all(r.stats.errors == 0 for r in src.reflectors.values()), {n: r.stats for n, r in src.reflectors.items()}
    api = ApiClient(configuration(ConnectionSettings(kubeconfig=proxy_kubeconfig)))
    assert record_node_event(api, "rbac-node", "Starting", "Starting pyproxy.")


def _allowed(cluster: Cluster, token: str, group: str, resource: str, verb: str) -> bool:
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": {"group": group, "resource": resource, "verb": verb}}}
    status, body = cluster.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review,
                                   token=token)
    assert status == 201, body
    return bool(body["status"]["allowed"])


def test_the_role_grants_nothing_more(cluster: Cluster, proxy_token: str) -> None:
    allowed = {(g, r, v) for (g, r), v in itertools.product(RESOURCES, VERBS)
               if _allowed(cluster, proxy_token, g, r, v)}
    assert allowed == NEEDED, f"missing: {NEEDED - allowed}; more than needed: {allowed - NEEDED}"
    # And for real, not only on paper: reading a Secret or changing a Service is refused.
    assert cluster.request("GET", "/api/v1/secrets", token=proxy_token)[0] == 403
    assert cluster.request("POST", "/api/v1/namespaces/default/services",
                           service("x", "10.96.4.2"), token=proxy_token)[0] == 403
