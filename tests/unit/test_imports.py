"""What a pyproxy reading manifests loads: not the Kubernetes client (about 0.6 s and 30 MB at start), which
is imported only once a connection to an API server is configured."""

import subprocess
import sys
from pathlib import Path

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_manifest_mode_does_not_import_the_kubernetes_client() -> None:
    assert _run("import sys, pyproxy.cli, pyproxy.proxier.app; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))") == "[]"


def test_a_configured_connection_still_reads_the_kubeconfig(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    assert _run("from pathlib import Path; from pyproxy.k8s import client; "
                f"print(client.configuration(client.ConnectionSettings(kubeconfig=Path({str(path)!r}))).host)"
                ) == "https://127.0.0.1:6443"
