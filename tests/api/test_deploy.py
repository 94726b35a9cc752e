"""deploy/ on a real API server: it accepts every manifest as written (nothing dropped on the way: v1.20 prunes
unknown fields without a word), and the files agree with each other and with upstream kube-proxy's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from apiobjects import create_manifest
from cluster.cluster import Cluster

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FILES = ["rbac.yaml", "configmap.yaml", "daemonset.yaml"]


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for name in FILES for d in _docs(name) if d["kind"] == kind]
    return doc


def _missing(sent: Any, stored: Any, where: str = "") -> list[str]:
    """Where `stored` lacks or changed what `sent` has (dicts by key, lists item by item)."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [where or "/"]
        return [m for k, v in sent.items() for m in (_missing(v, stored[k], f"{where}.{k}") if k in stored
                                                     else [f"{where}.{k}"])]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [where]
        return [m for i, (a, b) in enumerate(zip(sent, stored, strict=True)) for m in _missing(a, b, f"{where}[{i}]")]
    return [] if sent == stored else [f"{where}: {sent!r} stored as {stored!r}"]


@pytest.mark.parametrize("name", FILES)
def test_the_api_server_accepts_deploy(cluster: Cluster, name: str) -> None:
    for doc in _docs(name):
        stored = create_manifest(cluster, doc, replace=doc["kind"] in ("ConfigMap", "DaemonSet"))
        assert _missing(doc, stored) == [], f"{name}: {doc['kind']} {doc['metadata']['name']}"


def test_the_daemonset_runs_pyproxy_as_upstream_runs_kube_proxy() -> None:
    ds, cm, sa = _by_kind("DaemonSet"), _by_kind("ConfigMap"), _by_kind("ServiceAccount")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["serviceAccountName"] == sa["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["command"][:4] == ["/usr/local/bin/pyproxy", "run", "--config=/var/lib/kube-proxy/config.conf",
                                        "--hostname-override=$(NODE_NAME)"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts.keys() == volumes.keys()
    assert volumes["kube-proxy"]["configMap"]["name"] == cm["metadata"]["name"] == "kube-proxy"
    assert mounts["kube-proxy"]["mountPath"] == "/var/lib/kube-proxy"
    hosts = {v["hostPath"]["path"]: mounts[n] for n, v in volumes.items() if "hostPath" in v}
    assert hosts.keys() == {"/sys/fs/bpf", "/sys/fs/cgroup", "/run/xtables.lock", "/lib/modules"}
    assert hosts["/lib/modules"].get("readOnly") is True
    assert f"--cgroup-root={hosts['/sys/fs/cgroup']['mountPath']}" in container["command"]
    # kubeadm's ConfigMap, so the one a cluster has already serves both proxies.
    assert cm["metadata"]["namespace"] == ds["metadata"]["namespace"] == "kube-system"
    config = yaml.safe_load(cm["data"]["config.conf"])
    assert (config["apiVersion"], config["kind"]) == ("kubeproxy.config.k8s.io/v1alpha1", "KubeProxyConfiguration")
    kubeconfig = yaml.safe_load(cm["data"]["kubeconfig.conf"])
    assert config["clientConnection"]["kubeconfig"] == "/var/lib/kube-proxy/kubeconfig.conf"
    assert kubeconfig["users"][0]["user"]["tokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
