"""Upstream kube-proxy v1.20.2, run for real in a namespace lab's node against the lab's real API server: the
anchor every benchmark number is divided by.

The binary is built once from Debian's own `kubernetes` source package (bench/build-kube-proxy.sh, cached in
~/.cache/pyproxy). `KubeProxy` starts and stops it the way `labkit.Pyproxy` does pyproxy, so
the benchmark parts treat both alike (`start`, `proc`, `terminate`, `close`, `log_tail`, `metrics_url`).

What kube-proxy 1.20 needs to run in a network namespace (found by running it):
- conntrack: it raises nf_conntrack_max and writes /sys/module/nf_conntrack/parameters/hashsize, which only the
  initial namespace may: `--conntrack-max-per-core=0` leaves the limit as it is. The TCP timeouts
  (net.netfilter.nf_conntrack_tcp_timeout_*) are per namespace and writable, but are left alone too
  (`--conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0`) so every mode sees the same.
- which iptables: it runs `iptables`, `iptables-save` and `iptables-restore` from PATH. A private folder of
  symlinks to the `-legacy` or `-nft` binaries, first on its PATH, picks the backend (a real node picks it
  with update-alternatives).
- the API: `--kubeconfig` through the lab's socat bridge (127.0.0.1:6443 inside the node). 1.20 reads
  EndpointSlices (discovery.k8s.io/v1beta1, EndpointSliceProxying is on by default) and first its own Node
  object for the node's IP: without one it retries for about 35 s before assuming 127.0.0.1, so the benchmarks
  register the node (`register_node`) as a kubelet would.
- metrics and healthz on the node's own loopback (127.0.0.1:10249, :10256), like pyproxy in the lab.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from cluster.cluster import cache_dir
from labkit import Lab
from labkit.proxy import HEALTHZ_PORT, METRICS_PORT

from bench import core
from pyproxy.k8s.client import ApiError

VERSION = "v1.20.2"
BACKENDS = ("legacy", "nft")
IPTABLES_TOOLS = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save",
                  "ip6tables-restore")


def binary() -> Path:
    """The cached kube-proxy, built by `make kube-proxy` (bench/build-kube-proxy.sh) when missing."""
    path = cache_dir() / f"kube-proxy-{VERSION}"
    if not path.exists():
        cp = subprocess.run(["bash", str(core.REPO / "bench" / "build-kube-proxy.sh")], capture_output=True,
                            text=True, timeout=900, check=False)
        if cp.returncode != 0 or not path.exists():
            raise RuntimeError(f"cannot build kube-proxy {VERSION}: {cp.stderr[-2000:]}")
    return path


HOSTNAME = "bench-node"


def register_node(api: Any, ip: str, name: str = HOSTNAME) -> None:
    """The lab node's Node object with its InternalIP (a kubelet's registration), unless it is there."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]}}
    try:
        api.request("POST", "/api/v1/nodes", body=node)
    except ApiError as e:
        if e.status != 409:
            raise


def iptables_shim(folder: Path, backend: str) -> Path:
    """A folder whose iptables* are the `backend` (legacy or nft) binaries: first on kube-proxy's PATH."""
    if backend not in BACKENDS:
        raise ValueError(f"iptables backend {backend!r}: want one of {BACKENDS}")
    shim = folder / f"iptables-{backend}-bin"
    shim.mkdir(parents=True, exist_ok=True)
    for tool in IPTABLES_TOOLS:
        name, _, suffix = tool.partition("-")
        target = Path(f"/usr/sbin/{name}-{backend}" + (f"-{suffix}" if suffix else ""))
        link = shim / tool
        if not link.is_symlink():
            link.symlink_to(target)
    return shim


class KubeProxy:
    """`kube-proxy --proxy-mode=<mode>` (iptables; ipvs in the guest, bench/guest.py) in `lab.node`, logging to
    `log_path`; iptables `backend` legacy or nft (ipvs mode writes a few iptables rules too)."""

    def __init__(self, lab: Lab, kubeconfig: Path, *, backend: str, log_path: Path | None = None,
                 extra_args: Sequence[str] = (), hostname: str = HOSTNAME, mode: str = "iptables") -> None:
        self.lab = lab
        self.backend = backend
        self.mode = mode
        self.kubeconfig = kubeconfig
        self.log_path = log_path or lab.workdir / f"kube-proxy-{backend}.log"
        self.extra_args = tuple(extra_args)
        self.hostname = hostname
        self.metrics_url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._shim = iptables_shim(lab.workdir, backend)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self._shim}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return env

    def command(self) -> list[str]:
        return [str(binary()), f"--proxy-mode={self.mode}", f"--kubeconfig={self.kubeconfig}",
                f"--hostname-override={self.hostname}", "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
                f"--metrics-bind-address=127.0.0.1:{METRICS_PORT}",
                f"--healthz-bind-address=127.0.0.1:{HEALTHZ_PORT}", "--iptables-min-sync-period=1s", "--v=2",
                *self.extra_args]

    def __enter__(self) -> KubeProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log.write(f"### PATH={self._shim}:... {' '.join(self.command())}\n".encode())
        self._log.flush()
        self.proc = self.lab.popen(self.lab.node, *self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                   stderr=subprocess.STDOUT, env=self.env())

    def terminate(self, timeout: float = 10.0) -> int | None:
        """SIGTERM to its group (iptables-restore children too); SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            return None

    def close(self) -> None:
        self.terminate(timeout=5.0)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
