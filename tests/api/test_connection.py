"""Finding and reaching the API server: kubeconfig, --master, in-cluster; and what pyproxy does when it cannot."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from apiobjects import wait_for
from cluster.cluster import Cluster, free_port

from pyproxy.k8s.client import ApiClient, ConfigError, ConnectionSettings, configuration
from pyproxy.k8s.informer import ApiSource
from pyproxy.k8s.sink import RecordingSink

ROOT = Path(__file__).resolve().parents[2]


def test_master_overrides_the_kubeconfig_server(cluster: Cluster, tmp_path: Path) -> None:
    # The kubeconfig names a port where nothing listens; --master names the real server.
    wrong = cluster.write_kubeconfig(tmp_path / "kc", cluster.admin_token, server=f"https://127.0.0.1:{free_port()}")
    api = ApiClient(configuration(ConnectionSettings(kubeconfig=wrong, master=cluster.server)))
    assert api.request("GET", "/api/v1/namespaces/default")["metadata"]["name"] == "default"


@pytest.mark.parametrize("settings, message", [
    (ConnectionSettings(kubeconfig=Path("/nonexistent/kubeconfig")), "--kubeconfig /nonexistent/kubeconfig"),
    (ConnectionSettings(master="127.0.0.1:6443"), "want an http:// or https:// URL"),
])
def test_bad_connection_settings_are_named(settings: ConnectionSettings, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        configuration(settings)


def test_a_malformed_kubeconfig_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nclusters: [\n")
    with pytest.raises(ConfigError, match=str(bad)):
        configuration(ConnectionSettings(kubeconfig=bad))


def test_no_configuration_at_all_says_what_to_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="--kubeconfig or --master"):
        configuration(ConnectionSettings())


@pytest.mark.root
def test_in_cluster_configuration_from_the_service_account(cluster: Cluster, tmp_path: Path) -> None:
    """As in a pod: KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA mounted at
    /var/run/secrets/kubernetes.io/serviceaccount (a tmpfs in a private mount namespace, so the host's
    /run is untouched)."""
    for doc in yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()):
        kind = doc["kind"]
        path = {"ServiceAccount": "/api/v1/namespaces/kube-system/serviceaccounts",
                "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"}[kind]
        assert cluster.request("POST", path, doc)[0] in (201, 409)
    secrets = tmp_path / "sa"
    secrets.mkdir()
    (secrets / "token").write_text(cluster.service_account_token("kube-system", "pyproxy"))
    (secrets / "ca.crt").write_bytes(cluster.ca_file.read_bytes())
    (secrets / "namespace").write_text("kube-system")
    script = (
        "from pyproxy.k8s.client import ApiClient, ConnectionSettings, configuration, in_cluster\n"
        "import json\n"
        "assert in_cluster()\n"
        "api = ApiClient(configuration(ConnectionSettings()))\n"
        "print(json.dumps([api.host, len(api.request('GET', '/api/v1/services')['items'])]))\n"
    )
    mount = "/var/run/secrets/kubernetes.io/serviceaccount"
    shell = (f"mkdir -p /run/secrets && mount -t tmpfs pyproxy-test /run/secrets && mkdir -p {mount} && "
             f"cp {secrets}/* {mount}/ && exec {sys.executable} -c \"$SCRIPT\"")
    env = {**os.environ, "SCRIPT": script, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(cluster.apiserver_port)}
    cp = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell], env=env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    host, services = json.loads(cp.stdout)
    assert host == f"https://127.0.0.1:{cluster.apiserver_port}" and services >= 1


def test_unreachable_at_start_never_syncs_and_catches_up_later(cluster: Cluster, tmp_path: Path) -> None:
    """Nothing listens yet: every list fails and backs off, nothing is marked synced (so no sync could run on a
    partial view); once a server appears at that address, the first lists complete."""
    port = free_port()
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kc", cluster.admin_token, server=f"https://127.0.0.1:{port}")
    sink = RecordingSink()
    source = ApiSource(ApiClient(configuration(ConnectionSettings(kubeconfig=kubeconfig))), sink, "n",
                       backoff_cap=0.5)
    source.start()
    try:
        wait_for(lambda: source.reflectors["services"].stats.errors >= 3, what="failed lists")
        assert sink.synced == 0 and sink.calls == []
        # A TCP relay from the kubeconfig's port to the real server: the API server "comes up".
        relay = subprocess.Popen(["socat", f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr",
                                  f"TCP:127.0.0.1:{cluster.apiserver_port}"])
        try:
            wait_for(lambda: sink.synced == 1, timeout=15, what="first lists once the server is reachable")
            assert "default/kubernetes" in sink.services
        finally:
            relay.terminate()
            relay.wait(5)
    finally:
        source.stop()


def test_no_sync_until_endpointslices_have_listed_too(cluster: Cluster, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A token that may list Services but not EndpointSlices: Services list, the proxier is never told the
    view is complete (so it never programs Services without their endpoints), and the 403 is logged."""
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "services-only"},
            "rules": [{"apiGroups": [""], "resources": ["services", "nodes"], "verbs": ["list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "services-only"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "services-only"},
               "subjects": [{"kind": "ServiceAccount", "name": "services-only", "namespace": "default"}]}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "services-only"}}
    assert cluster.request("POST", "/api/v1/namespaces/default/serviceaccounts", sa)[0] in (201, 409)
    assert cluster.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", role)[0] in (201, 409)
    assert cluster.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)[0] in (201, 409)
    caplog.set_level(logging.WARNING, logger="pyproxy.k8s.informer")
    token = cluster.service_account_token("default", "services-only")
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kc", token)
    sink = RecordingSink()
    source = ApiSource(ApiClient(configuration(ConnectionSettings(kubeconfig=kubeconfig))), sink, "n",
                       backoff_cap=0.5)
    source.start()
    try:
        wait_for(lambda: source.reflectors["services"].stats.lists == 1
                 and source.reflectors["endpointslices"].stats.errors >= 2, what="services listed, slices refused")
        assert "default/kubernetes" in sink.services
        assert sink.synced == 0
        assert any("endpointslices" in r.getMessage() and "403" in r.getMessage() for r in caplog.records), \
            caplog.text
    finally:
        source.stop()


def test_pyproxy_run_with_a_missing_kubeconfig_exits_with_the_reason() -> None:
    # The configuration is checked before any dataplane starts, so this needs no privileges and changes nothing.
    cp = subprocess.run([sys.executable, "-m", "pyproxy", "run", "--kubeconfig=/nonexistent/kc"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 1
    assert "--kubeconfig /nonexistent/kc: no such file" in cp.stderr

