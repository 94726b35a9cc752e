"""A real etcd + kube-apiserver on 127.0.0.1, for tests and `make cluster-up` / `make cluster-down` (stdlib only);
with `controllers=True` (`up --controllers`) also kube-controller-manager and kube-scheduler.

    with Cluster(tmp_path) as cluster:                      # etcd, then kube-apiserver; both gone on exit
        status, body = cluster.request("GET", "/api/v1/namespaces")
        cluster.stop_apiserver()                            # etcd keeps the data
        with cluster.extra_apiserver() as other:            # change objects while the main one is down
            other.request("DELETE", "/api/v1/namespaces/default/services/web")
        cluster.start_apiserver()                           # same port, certs and tokens: kubeconfig still works
        cluster.compact()                                   # old resourceVersions now get 410 Gone

    python tests/cluster/cluster.py up --dir .cluster       # detached; writes .cluster/kubeconfig
    python tests/cluster/cluster.py down --dir .cluster

Why it is built this way (measured facts: shared notes, real-apiserver.md):

- No registry ships kube-apiserver; `make apiserver` (tests/cluster/build-apiserver.sh) builds v1.20.2 once from
  Debian's source package and caches it outside the repository, which is where `apiserver_binary()` looks.
  This module must not import `kubernetes`: it is what tests use to check the client-facing code.
- By default there is no controller-manager, so nothing creates ServiceAccounts, Endpoints or EndpointSlices
  and deleted namespaces stay Terminating: tests create what they need, and a proxy under test sees exactly the
  slices a test wrote. The ServiceAccount admission plugin is disabled because it would reject Pods for want of
  the `default` ServiceAccount that no controller creates.
- `controllers=True` runs the real kube-controller-manager and kube-scheduler (`make apiserver` builds
  them) as a real control plane does: EndpointSlices come from the EndpointSlice controller, ServiceAccounts
  and their token Secrets from their controllers (signed with the apiserver's service-account key), so the
  ServiceAccount admission plugin stays on; with `pod_cidr`, the node IPAM controller gives each Node a
  /24 of it. Both use the admin token (simpler than their own client certificates, same effect under RBAC:
  system:masters), no leader election (one of each), and serve their health on free ports of 127.0.0.1
  with certificates they make themselves in the work directory.
  `--endpoint-reconciler-type=none`: the `kubernetes` Service exists but the apiserver writes no Endpoints for
  it (127.0.0.1 would mean nothing to a proxy under test, and each extra apiserver would add itself).
- Our own CA signs the serving certificate (SANs 127.0.0.1, localhost, kubernetes.default.svc and the first
  service IP), so clients verify TLS for real instead of skipping verification, and a restarted or extra
  apiserver presents a certificate the same kubeconfig trusts. Certificates, keys and the token file are made
  once per directory and reused, so `up` after `down` keeps kubeconfigs valid.
- Authentication is a static token file (admin in system:masters, which bypasses RBAC) plus ServiceAccount
  tokens from the TokenRequest API, so tests can act as a least-privileged proxy under `--authorization-mode=RBAC`
  (the apiserver creates its bootstrap ClusterRoles itself).
- `/readyz` is not enough: the `default` namespace appears a few seconds later, and creates in it get 404 until
  then, so start() also waits for GET /api/v1/namespaces/default.
- Watches are served from the apiserver's watch cache (measured on v1.20.2): a freshly started apiserver fills
  it at etcd's current revision, so a watch from any older resourceVersion gets HTTP 200 and then one ERROR
  event, Status 410 reason Expired "too old resource version: OLD (NOW)", even without a compaction; an
  apiserver that keeps running still serves old resourceVersions from its cache after a compaction. Reads that
  reach etcd (a list with resourceVersionMatch=Exact) get HTTP 410 after `compact()`. compact() uses etcd's v3
  JSON gateway, so no etcdctl or grpc is needed.
- Processes run in their own session (the tests' Ctrl-C does not reach them half-way, and killpg reaches all
  of a process's children) with logs in the work directory, and their pids in `<name>.pid` so `down` from
  another process can stop them. A pid is trusted only while /proc/PID/cmdline names the work directory: a
  stale pid file, or a pid reused by an unrelated process, is ignored. Test-owned clusters also get
  PR_SET_PDEATHSIG=SIGKILL, so a SIGKILLed test run leaves no apiserver behind; note that it fires when the
  *thread* that started the process ends. `up` does without it so the cluster outlives `make`.
- HTTP goes through urllib with proxies disabled: an https_proxy in the environment must not capture
  127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger("cluster")

APISERVER_VERSION = "v1.20.2"
SA_ISSUER = "https://kubernetes.default.svc"
API_AUDIENCE = SA_ISSUER
START_TIMEOUT = 60.0
STOP_GRACE = 10.0
LOG_TAIL_LINES = 30

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
# Never route loopback requests through an https_proxy/http_proxy from the environment.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ClusterError(RuntimeError):
    """The lab cluster could not be started, reached or stopped; the message says what and where to look."""


def cache_dir() -> Path:
    return Path(os.environ.get("PYPROXY_CACHE") or Path.home() / ".cache" / "pyproxy")


def apiserver_binary() -> Path:
    """$PYPROXY_APISERVER, else the binary `make apiserver` caches."""
    env = os.environ.get("PYPROXY_APISERVER")
    path = Path(env) if env else cache_dir() / f"kube-apiserver-{APISERVER_VERSION}"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ClusterError(f"no kube-apiserver at {path}: run `make apiserver` (builds {APISERVER_VERSION} once, "
                           "about 7 minutes) or set $PYPROXY_APISERVER")
    return path


def kube_binary(command: str) -> Path:
    """The binary of another Kubernetes command (kube-controller-manager, kube-scheduler, ...) that
    `make kube-binaries` caches."""
    path = cache_dir() / f"{command}-{APISERVER_VERSION}"
    if not (path.is_file() and os.access(path, os.X_OK)):
        make = "apiserver" if command in ("kube-controller-manager", "kube-scheduler") else "kube-binaries"
        raise ClusterError(f"no {command} at {path}: run `make {make}` (builds {APISERVER_VERSION}'s binaries once, "
                           "the missing ones)")
    return path


def etcd_binary() -> Path:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if not found:
        raise ClusterError("no etcd on PATH: run `make apiserver` (installs Debian's etcd-server)")
    return Path(found)


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick); racy by nature, but only among our own tests."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


# --- processes -------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    # Between fork and exec: SIGKILL when the starting thread ends, so a killed test run leaks nothing.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (our unreaped child, or an orphan nobody reaps) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pid_from_file(pid_file: Path, marker: str) -> int | None:
    """The pid in `pid_file` if that process still runs and its command line contains `marker`."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if pid <= 1 or not _alive(pid) or marker not in _cmdline(pid):
        return None
    return pid


def _terminate(pid: int, proc: subprocess.Popen[bytes] | None = None, grace: float = STOP_GRACE) -> None:
    """SIGTERM to the process group, SIGKILL after `grace` seconds; quiet if it is already gone."""

    def signal_group(sig: signal.Signals) -> None:
        # Every process here leads its own session (start_new_session), so its pgid is its pid.
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        except PermissionError:
            log.warning("no permission to signal process %d", pid)

    def wait(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.05)
            if not _alive(pid):
                return True
            time.sleep(0.05)
        return False

    if not _alive(pid):
        if proc is not None:
            proc.poll()
        return
    signal_group(signal.SIGTERM)
    if not wait(grace):
        log.warning("process %d ignored SIGTERM for %gs: SIGKILL", pid, grace)
        signal_group(signal.SIGKILL)
        wait(5.0)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)


class _Process:
    """One long-running child with its log and pid file in the work directory."""

    def __init__(self, name: str, argv: list[str], workdir: Path, *, die_with_parent: bool,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_file = workdir / f"{name}.log"
        self.pid_file = workdir / f"{name}.pid"
        self.die_with_parent = die_with_parent
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self) -> None:
        with open(self.log_file, "ab") as logf:
            # Appended, not truncated: a restarted apiserver's log follows the previous run's.
            logf.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            logf.flush()
            preexec: Callable[[], None] | None = _die_with_parent if self.die_with_parent else None
            self.proc = subprocess.Popen(  # noqa: S603
                self.argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=preexec, env=self.env, close_fds=True)
        self.pid_file.write_text(f"{self.proc.pid}\n")
        log.debug("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            _terminate(self.proc.pid, self.proc)
            log.debug("stopped %s (pid %d, exit %s)", self.name, self.proc.pid, self.proc.returncode)
        with contextlib.suppress(OSError):
            self.pid_file.unlink()

    def fail(self, what: str) -> ClusterError:
        code = self.exit_code()
        state = f"exited with {code}" if code is not None else "still running"
        return ClusterError(f"{what} ({self.name} {state}); last lines of {self.log_file}:\n"
                            f"{_log_tail(self.log_file)}")


# --- HTTP ------------------------------------------------------------------------------------------------


def _http_json(url: str, method: str = "GET", body: Any = None, *, token: str | None = None,
               context: ssl.SSLContext | None = None, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """One JSON request; (status, decoded body) also for 4xx/5xx. A non-JSON body comes back as {"text": ...}."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json"}
    if data is not None:
        # A dict PATCH is a JSON merge patch; everything else is plain JSON.
        headers["Content-Type"] = "application/merge-patch+json" if method == "PATCH" else "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    opener = _opener if context is None else urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode(errors="replace")
    try:
        decoded = json.loads(text) if text.strip() else {}
    except ValueError:
        return status, {"text": text}
    return status, decoded if isinstance(decoded, dict) else {"items": decoded}


class ApiServer:
    """One kube-apiserver process on 127.0.0.1:<port>; Cluster runs its main apiserver as one of these too."""

    def __init__(self, cluster: Cluster, port: int, name: str) -> None:
        self.cluster = cluster
        self.port = port
        self.server = f"https://127.0.0.1:{port}"
        self._process = _Process(name, cluster.apiserver_argv(port), cluster.workdir,
                                 die_with_parent=cluster.die_with_parent)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def log_file(self) -> Path:
        return self._process.log_file

    def running(self) -> bool:
        return self._process.running()

    def start(self, timeout: float = START_TIMEOUT) -> ApiServer:
        if _port_in_use(self.port):
            # The previous apiserver on this port may still be closing its listener: give it a moment.
            deadline = time.monotonic() + STOP_GRACE
            while _port_in_use(self.port):
                if time.monotonic() > deadline:
                    raise ClusterError(f"cannot start kube-apiserver: 127.0.0.1:{self.port} is already in use")
                time.sleep(0.1)
        self._process.start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self._process.stop()
            raise
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until /readyz says ok and the `default` namespace exists (it appears seconds after /readyz)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        last = "no answer yet"
        while True:
            if self._process.exit_code() is not None:
                raise self._process.fail(f"kube-apiserver on {self.server} exited before it was ready")
            try:
                status, body = self.request("GET", "/readyz", timeout=2.0)
                if status == 200:
                    status, body = self.request("GET", "/api/v1/namespaces/default", timeout=2.0)
                    if status == 200:
                        log.info("kube-apiserver %s ready in %.1fs (pid %d)", self.server, time.monotonic() - t0,
                                 self.pid)
                        return
                    last = f"GET /api/v1/namespaces/default: {status}"
                else:
                    last = f"GET /readyz: {status} {body.get('text', body)!s:.200}"
            except (OSError, urllib.error.URLError, ssl.SSLError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise self._process.fail(f"kube-apiserver on {self.server} not ready after {timeout:g}s "
                                         f"(last: {last})")
            time.sleep(0.1)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None,
                *, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
        """HTTPS JSON to this apiserver (admin token by default), verifying its certificate against our CA."""
        return _http_json(self.server + path, method, body, token=token or self.cluster.admin_token,
                          context=self.cluster.ssl_context(), timeout=timeout)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s; idempotent."""
        self._process.stop()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --- the cluster -----------------------------------------------------------------------------------------

_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = pyproxy-lab
[v3_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[v3_server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
subjectAltName = {sans}
"""


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise ClusterError("openssl is not installed") from exc
    except subprocess.CalledProcessError as exc:
        raise ClusterError(f"openssl {' '.join(args)} failed: {exc.stderr.strip()}") from exc


class Cluster:
    """etcd plus kube-apiserver(s) on 127.0.0.1, all state under `workdir`."""

    STATE_FILE = "cluster.json"

    def __init__(self, workdir: Path, *, etcd_port: int = 0, apiserver_port: int = 0,
                 authorization_mode: str = "RBAC", service_cidr: str = "10.96.0.0/12",
                 die_with_parent: bool = True, controllers: bool = False, pod_cidr: str | None = None) -> None:
        self.workdir = Path(workdir).resolve()
        self.etcd_port = etcd_port or free_port()
        self.etcd_peer_port = free_port()
        while self.etcd_peer_port == self.etcd_port:
            self.etcd_peer_port = free_port()
        self.apiserver_port = apiserver_port or free_port()
        self.authorization_mode = authorization_mode
        self.service_cidr = service_cidr
        self.die_with_parent = die_with_parent
        self.controllers = controllers
        self.pod_cidr = pod_cidr
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.pki = self.workdir / "pki"
        self.ca_file = self.pki / "ca.crt"
        self.token_file = self.workdir / "tokens.csv"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.etcd_data = self.workdir / "etcd"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.admin_token = self._admin_token()
        self._ssl: ssl.SSLContext | None = None
        self._etcd: _Process | None = None
        self._main: ApiServer | None = None
        self._extra: list[ApiServer] = []
        self._controllers: list[tuple[_Process, int]] = []

    # The work directory in a command line tells our processes from whatever reused a stale pid.
    @property
    def marker(self) -> str:
        return f"{self.workdir}/"

    # -- files

    def _admin_token(self) -> str:
        with contextlib.suppress(OSError):
            for line in self.token_file.read_text().splitlines():
                fields = line.split(",")
                if len(fields) >= 3 and fields[1] == "admin" and fields[0]:
                    return fields[0]
        token = secrets.token_hex(24)
        self.token_file.write_text(f'{token},admin,admin-uid,"system:masters"\n')
        self.token_file.chmod(0o600)
        return token

    def _ensure_pki(self) -> None:
        names = ("ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "sa.key", "sa.pub")
        if all((self.pki / n).is_file() for n in names):
            return
        self.pki.mkdir(parents=True, exist_ok=True)
        first_service_ip = next(ipaddress.ip_network(self.service_cidr, strict=False).hosts())
        sans = ",".join(["IP:127.0.0.1", f"IP:{first_service_ip}", "DNS:localhost", "DNS:kubernetes",
                         "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                         "DNS:kubernetes.default.svc.cluster.local"])
        (self.pki / "openssl.cnf").write_text(_OPENSSL_CONFIG.format(sans=sans))
        days = "3650"
        _openssl("req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", days, "-config", "openssl.cnf", "-extensions", "v3_ca", "-subj", "/CN=pyproxy-lab-ca",
                 cwd=self.pki)
        _openssl("req", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", "apiserver.key",
                 "-out", "apiserver.csr", "-config", "openssl.cnf", "-subj", "/CN=kube-apiserver", cwd=self.pki)
        _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-set_serial", str(secrets.randbits(63)), "-days", days, "-out", "apiserver.crt",
                 "-extfile", "openssl.cnf", "-extensions", "v3_server", cwd=self.pki)
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=self.pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=self.pki)
        for key in ("ca.key", "apiserver.key", "sa.key"):
            (self.pki / key).chmod(0o600)

    def write_kubeconfig(self, path: Path, token: str, server: str | None = None) -> Path:
        """A kubeconfig (JSON, which every YAML loader reads) for `token`, trusting our CA via embedded data."""
        ca_data = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "pyproxy-lab",
                          "cluster": {"server": server or self.server, "certificate-authority-data": ca_data}}],
            "users": [{"name": "pyproxy-lab-user", "user": {"token": token}}],
            "contexts": [{"name": "pyproxy-lab", "context": {"cluster": "pyproxy-lab", "user": "pyproxy-lab-user"}}],
            "current-context": "pyproxy-lab",
        }
        path = Path(path)
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o600)
        return path

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=str(self.ca_file))
        return self._ssl

    # -- processes

    def apiserver_argv(self, port: int) -> list[str]:
        return [
            str(apiserver_binary()),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.pki}",
            f"--tls-cert-file={self.pki / 'apiserver.crt'}",
            f"--tls-private-key-file={self.pki / 'apiserver.key'}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={self.pki / 'sa.pub'}",
            f"--service-account-signing-key-file={self.pki / 'sa.key'}",
            f"--api-audiences={API_AUDIENCE}",
            f"--token-auth-file={self.token_file}",
            f"--authorization-mode={self.authorization_mode}",
            f"--service-cluster-ip-range={self.service_cidr}",
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            *([] if self.controllers else ["--disable-admission-plugins=ServiceAccount"]),
            "--logtostderr=true",
            "--v=1",
        ]

    def _etcd_argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        return [
            str(etcd_binary()),
            "--name=default",
            f"--data-dir={self.etcd_data}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def _start_etcd(self, timeout: float) -> None:
        # An inherited ETCD_* variable would silently override the flags above.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        self._etcd = _Process("etcd", self._etcd_argv(), self.workdir, die_with_parent=self.die_with_parent,
                              env=env)
        self._etcd.start()
        t0 = time.monotonic()
        while True:
            if self._etcd.exit_code() is not None:
                raise self._etcd.fail("etcd exited during startup")
            with contextlib.suppress(OSError, urllib.error.URLError):
                status, body = _http_json(f"{self.etcd_url}/health", timeout=2.0)
                if status == 200 and body.get("health") in ("true", True):
                    log.info("etcd %s ready in %.1fs (pid %d)", self.etcd_url, time.monotonic() - t0,
                             self._etcd.pid)
                    return
            if time.monotonic() - t0 > timeout:
                raise self._etcd.fail(f"etcd on {self.etcd_url} not healthy after {timeout:g}s")
            time.sleep(0.05)

    def controller_argv(self, command: str, port: int) -> list[str]:
        """kube-controller-manager's or kube-scheduler's command line, serving its health on 127.0.0.1:<port>."""
        argv = [
            str(kube_binary(command)),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--port=0",  # no insecure port: 10251/10252 would clash with another cluster's
            f"--cert-dir={self.pki / command}",
            "--logtostderr=true",
            "--v=1",
        ]
        if command == "kube-controller-manager":
            argv += [
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                f"--service-cluster-ip-range={self.service_cidr}",
            ]
            if self.pod_cidr:
                argv += ["--allocate-node-cidrs=true", f"--cluster-cidr={self.pod_cidr}", "--node-cidr-mask-size=24"]
        return argv

    def _start_controllers(self, timeout: float) -> None:
        for command in ("kube-controller-manager", "kube-scheduler"):
            port = free_port()
            proc = _Process(command, self.controller_argv(command, port), self.workdir,
                            die_with_parent=self.die_with_parent)
            proc.start()
            self._controllers.append((proc, port))
        # Their serving certificates are their own, self-signed: /healthz only says the process is up.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        t0 = time.monotonic()
        for proc, port in self._controllers:
            while True:
                if proc.exit_code() is not None:
                    raise proc.fail(f"{proc.name} exited during startup")
                with contextlib.suppress(OSError, urllib.error.URLError):
                    status, body = _http_json(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2.0)
                    if status == 200:
                        log.info("%s healthy in %.1fs (pid %d)", proc.name, time.monotonic() - t0, proc.pid)
                        break
                if time.monotonic() - t0 > timeout:
                    raise proc.fail(f"{proc.name} not healthy on 127.0.0.1:{port} after {timeout:g}s")
                time.sleep(0.1)
        # Healthy is not acting: kube-controller-manager starts its informers only once every controller has
        # started, about 10 s later here. The `default` ServiceAccount its serviceaccount controller makes is the
        # first sign that they run.
        manager = self._controllers[0][0]
        while self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] != 200:
            if manager.exit_code() is not None or time.monotonic() - t0 > timeout:
                raise manager.fail(f"no `default` ServiceAccount after {time.monotonic() - t0:.0f}s: the "
                                   "controllers do not act")
            time.sleep(0.2)
        log.info("controllers acting in %.1fs", time.monotonic() - t0)

    def _write_state(self) -> None:
        state = {"server": self.server, "apiserver_port": self.apiserver_port, "etcd_port": self.etcd_port,
                 "etcd_peer_port": self.etcd_peer_port, "authorization_mode": self.authorization_mode,
                 "service_cidr": self.service_cidr, "kubeconfig": str(self.kubeconfig),
                 "controllers": self.controllers, "pod_cidr": self.pod_cidr}
        (self.workdir / self.STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    def start(self, timeout: float = START_TIMEOUT) -> Cluster:
        """etcd, then the main apiserver (then the controller-manager and the scheduler); returns once it is ready
        and the `default` namespace exists (and the controllers are healthy)."""
        t0 = time.monotonic()
        # Fail with the `make apiserver` / `make kube-binaries` hint before creating anything.
        apiserver_binary()
        if self.controllers:
            kube_binary("kube-controller-manager")
            kube_binary("kube-scheduler")
        for port, what in ((self.etcd_port, "etcd client"), (self.etcd_peer_port, "etcd peer"),
                           (self.apiserver_port, "kube-apiserver")):
            if _port_in_use(port):
                raise ClusterError(f"{what} port 127.0.0.1:{port} is already in use (another cluster? "
                                   f"`python tests/cluster/cluster.py down --dir ...` stops one)")
        self._ensure_pki()
        self.write_kubeconfig(self.kubeconfig, self.admin_token)
        self._write_state()
        try:
            self._start_etcd(timeout)
            self._main = ApiServer(self, self.apiserver_port, "apiserver")
            self._main.start(max(5.0, timeout - (time.monotonic() - t0)))
            if self.controllers:
                self._start_controllers(max(5.0, timeout - (time.monotonic() - t0)))
        except BaseException:
            self.stop()
            raise
        log.info("cluster %s up in %.1fs (workdir %s)", self.server, time.monotonic() - t0, self.workdir)
        return self

    def stop_apiserver(self) -> None:
        """Only the main apiserver; etcd (and any extra apiserver) keeps running."""
        if self._main is not None:
            self._main.stop()

    def start_apiserver(self, timeout: float = START_TIMEOUT) -> None:
        """The main apiserver again, same port, certificates and tokens; returns once it is ready."""
        if self._etcd is None or not self._etcd.running():
            raise ClusterError("start_apiserver() needs a running etcd: call start() first")
        if self._main is not None and self._main.running():
            return
        self._main = ApiServer(self, self.apiserver_port, "apiserver")
        self._main.start(timeout)

    def extra_apiserver(self, timeout: float = START_TIMEOUT) -> ApiServer:
        """Another apiserver on the same etcd and credentials, on a free port, started and ready.

        The caller stops it (it is a context manager); stop() stops it too."""
        if self._etcd is None or not self._etcd.running():
            raise ClusterError("extra_apiserver() needs a running etcd: call start() first")
        port = free_port()
        extra = ApiServer(self, port, f"apiserver-{port}")
        extra.start(timeout)
        self._extra.append(extra)
        return extra

    def stop(self) -> None:
        """Controllers, apiservers, then etcd: SIGTERM, SIGKILL after 10 s. Idempotent; quiet about dead processes."""
        for proc, _ in self._controllers:
            proc.stop()
        self._controllers.clear()
        for extra in self._extra:
            extra.stop()
        self._extra.clear()
        if self._main is not None:
            self._main.stop()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        # Whatever else this directory's pid files name (an extra apiserver started by another process).
        stop_dir(self.workdir)

    # -- API helpers

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                token: str | None = None) -> tuple[int, dict[str, Any]]:
        """HTTPS JSON to the main apiserver (admin token by default); (status, body), also for 4xx/5xx."""
        return _http_json(self.server + path, method, body, token=token or self.admin_token,
                          context=self.ssl_context())

    def service_account_token(self, namespace: str, name: str, expiration_seconds: int = 3600) -> str:
        """A token for an existing ServiceAccount from the TokenRequest API (audience: the apiserver)."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [API_AUDIENCE], "expirationSeconds": expiration_seconds}}
        status, resp = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body)
        token = resp.get("status", {}).get("token") if status in (200, 201) else None
        if not token:
            raise ClusterError(f"TokenRequest for serviceaccount {namespace}/{name}: {status} "
                               f"{resp.get('message', resp)}")
        return str(token)

    def compact(self) -> int:
        """Compact etcd at its current revision (physically); returns that revision."""
        status, resp = _http_json(f"{self.etcd_url}/v3/maintenance/status", "POST", {})
        if status != 200 or "header" not in resp:
            raise ClusterError(f"etcd status: {status} {resp}")
        revision = int(resp["header"]["revision"])
        status, resp = _http_json(f"{self.etcd_url}/v3/kv/compaction", "POST",
                                  {"revision": str(revision), "physical": True}, timeout=60.0)
        # Compacting twice at one revision is an error to etcd but exactly the state the caller asked for.
        if status != 200 and "compacted" not in str(resp.get("error", "")):
            raise ClusterError(f"etcd compaction at {revision}: {status} {resp}")
        log.info("etcd compacted at revision %d", revision)
        return revision

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def stop_dir(workdir: Path) -> list[str]:
    """Stop every process the pid files in `workdir` name (controllers, apiservers, then etcd); returns their names.

    Works across processes (the CLI's `down`); stale pid files are removed without signalling anyone."""
    workdir = Path(workdir).resolve()
    marker = f"{workdir}/"
    pid_files = [*sorted(workdir.glob("kube-*.pid")), *sorted(workdir.glob("apiserver*.pid")),
                 *sorted(workdir.glob("etcd*.pid"))]
    stopped: list[str] = []
    for pid_file in pid_files:
        pid = _pid_from_file(pid_file, marker)
        if pid is not None:
            _terminate(pid)
            stopped.append(f"{pid_file.stem} (pid {pid})")
        with contextlib.suppress(OSError):
            pid_file.unlink()
    return stopped


def running_server(workdir: Path) -> str | None:
    """The server URL of the cluster `up` started in `workdir` if its etcd and apiserver run and it is ready."""
    workdir = Path(workdir).resolve()
    try:
        state = json.loads((workdir / Cluster.STATE_FILE).read_text())
        server = str(state["server"])
        token = next(line.split(",")[0] for line in (workdir / "tokens.csv").read_text().splitlines()
                     if line.split(",")[1:2] == ["admin"])
    except (OSError, ValueError, KeyError, StopIteration):
        return None
    marker = f"{workdir}/"
    if _pid_from_file(workdir / "etcd.pid", marker) is None or _pid_from_file(workdir / "apiserver.pid",
                                                                             marker) is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(workdir / "pki" / "ca.crt"))
        status, _ = _http_json(f"{server}/readyz", token=token, context=context, timeout=5.0)
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return None
    return server if status == 200 else None


# --- reaching the apiserver from a network namespace -----------------------------------------------------


def bridge_into_netns(netns: str, host_port: int, ns_port: int = 6443, *, host_pid: int | None = None,
                      die_with_parent: bool = True, timeout: float = 10.0) -> subprocess.Popen[bytes]:
    """Make the host's 127.0.0.1:<host_port> reachable as 127.0.0.1:<ns_port> inside `netns` (an `ip netns` name).

    A socat listens inside the namespace and, per connection, runs a second socat in the network namespace of
    `host_pid` (default: this process), found through /proc/PID/ns/net (/proc/1/ns/net cannot be opened here).
    The colons of the inner address are escaped because socat splits EXEC's argument on them. The bridge leads
    its own process group: os.killpg(bridge.pid, SIGTERM) ends the listener and every open connection."""
    pid = host_pid or os.getpid()
    subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10)
    inner = f"nsenter --net=/proc/{pid}/ns/net socat STDIO TCP\\:127.0.0.1\\:{host_port}"
    argv = ["ip", "netns", "exec", netns, "socat",
            f"TCP-LISTEN:{ns_port},bind=127.0.0.1,fork,reuseaddr", f"EXEC:{inner}"]
    bridge: subprocess.Popen[bytes] = subprocess.Popen(  # noqa: S603
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True, preexec_fn=_die_with_parent if die_with_parent else None)
    probe = (f"import socket; socket.create_connection(('127.0.0.1', {ns_port}), 1).close()")
    deadline = time.monotonic() + timeout
    while True:
        if bridge.poll() is not None:
            err = bridge.stderr.read().decode(errors="replace") if bridge.stderr else ""
            raise ClusterError(f"socat bridge into {netns} exited with {bridge.returncode}: {err.strip()}")
        cp = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe], capture_output=True,
                            timeout=10)
        if cp.returncode == 0:
            return bridge
        if time.monotonic() > deadline:
            _terminate(bridge.pid, bridge)
            raise ClusterError(f"socat bridge into {netns}: 127.0.0.1:{ns_port} not reachable after {timeout:g}s")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process this module started in its own group (a bridge): SIGTERM to the group, then SIGKILL."""
    _terminate(proc.pid, proc)


# --- CLI -------------------------------------------------------------------------------------------------


def _cmd_up(args: argparse.Namespace) -> int:
    workdir = Path(args.dir).resolve()
    kubeconfig = workdir / "kubeconfig"
    server = running_server(workdir)
    if server is not None:
        print(f"cluster in {workdir} is already running: {server}")
        print(f"kubeconfig: {kubeconfig}")
        return 0
    # Half a cluster (etcd alive, apiserver dead, or a stale pid file): clear it and start over.
    for name in stop_dir(workdir) if workdir.is_dir() else []:
        print(f"stopped leftover {name}")
    cluster = Cluster(workdir, etcd_port=args.etcd_port, apiserver_port=args.port,
                      authorization_mode=args.authorization_mode, service_cidr=args.service_cidr,
                      die_with_parent=False, controllers=args.controllers, pod_cidr=args.pod_cidr)
    t0 = time.monotonic()
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"cluster up failed: {exc}", file=sys.stderr)
        return 1
    print(f"cluster up in {time.monotonic() - t0:.1f}s: {cluster.server} (etcd {cluster.etcd_url}, "
          f"authorization {cluster.authorization_mode}"
          f"{', controller-manager and scheduler' if cluster.controllers else ''})")
    print(f"kubeconfig: {cluster.kubeconfig}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    workdir = Path(args.dir).resolve()
    if not workdir.is_dir():
        print(f"nothing to stop: no {workdir}")
        return 0
    stopped = stop_dir(workdir)
    # The next `up` starts from an empty etcd; certificates and tokens stay so kubeconfigs remain valid.
    shutil.rmtree(workdir / "etcd", ignore_errors=True)
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing was running from {workdir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/cluster/cluster.py",
                                     description="A local etcd + kube-apiserver (+ kube-controller-manager and "
                                                 "kube-scheduler) for pyproxy's tests and demos.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start etcd and kube-apiserver, detached")
    up.add_argument("--dir", default=".cluster", help="state, logs, certificates and kubeconfig (default .cluster)")
    up.add_argument("--port", type=int, default=6443, help="kube-apiserver secure port (default 6443)")
    up.add_argument("--etcd-port", type=int, default=2379, help="etcd client port (default 2379)")
    up.add_argument("--authorization-mode", default="RBAC", help="RBAC (default) or AlwaysAllow")
    up.add_argument("--service-cidr", default="10.96.0.0/12", help="service cluster IP range")
    up.add_argument("--controllers", action="store_true",
                    help="also kube-controller-manager and kube-scheduler (`make apiserver` builds them)")
    up.add_argument("--pod-cidr", default=None, help="with --controllers: give each Node a /24 of this range")
    down = sub.add_parser("down", help="stop the cluster `up` started and forget its etcd data")
    down.add_argument("--dir", default=".cluster")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return _cmd_up(args) if args.command == "up" else _cmd_down(args)


if __name__ == "__main__":
    sys.exit(main())
