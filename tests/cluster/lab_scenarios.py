"""`make lab-test`: the Service proxy as deployed in production on the Vagrant lab's nodes, cross-node scenarios
per proxy mode, one table.

Run by `vagrant/lab.sh test` inside the lab's network namespace (the nodes' addresses exist only there), after
it imported the images into every node's containerd:

    python tests/cluster/lab_scenarios.py --kubeconfig ADMIN --modes bpf,ipvs,nftables,kube-proxy

Per mode it switches the nodes' proxy the way an operator would: pyproxy from deploy/ (rbac.yaml, the kube-proxy
ConfigMap with the lab's values patched in below, daemonset.yaml unchanged), a mode change as a ConfigMap edit and
a rollout; upstream kube-proxy v1.20.2 (vagrant/manifests/kube-proxy.yaml, the reference) after pyproxy's
documented way back (README, "Migrating from kube-proxy, and back"). Then the scenarios, with real pods from the
echo image (vagrant/manifests/lab-test.yaml) as clients and endpoints. Clients run an agent (AGENT below) in one
`kubectl exec` per client pod for the whole run: under TCG every exec costs tens of seconds, and background
traffic must run while kubectl scales and deletes.

Nothing is timed against a limit: a scenario passes on what answered, from where, and what failed; the numbers
(connections, failures, durations) are printed as measured. Results accumulate per mode in RESULTS, so a run of
one mode (`--modes ipvs`) updates its column of the table and keeps the others'.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "vagrant" / "manifests"
DEPLOY = REPO / "deploy"
NET = "192.168.50"
API = f"https://{NET}.11:6443"
CLUSTER_CIDR = "10.244.0.0/16"
PROXIES = {"kube-proxy": ("kube-proxy", "iptables"), "kube-proxy-ipvs": ("kube-proxy", "ipvs")}
"""Column name -> (DaemonSet, the ConfigMap's mode); every other column is pyproxy in that mode."""
SCENARIOS = ["rollout", "clusterip", "nodeport", "etp-local", "cross-node", "scale", "proxy-restart", "checks"]
WAIT = 10.0
"""Seconds a client of the scale and restart scenarios waits for a new connection's answer, or a long-lived one's
next exchange, before it counts a failure: TCP's first three SYN retransmissions (1, 3, 7 s). Under emulation a
node busy starting a pod (the restarted proxy's own) stalls every process on it for seconds, the client's too
(the agent's stall meter says how long): what is counted is a connection the proxy lost or broke, not a slow
node. The cells give the slowest answer and the client's longest stall, so a stall still shows."""

# The client side, run in every client pod with `python3 -u -c AGENT` (and locally for the lab network's host):
# JSON commands on stdin, each run in its own thread, results as JSON lines. `probe` opens one NEW connection per
# request (count, or until stopped); `talk` keeps connections open and asks on each every interval until stopped.
# Replies are the echo server's `POD:PORT CLIENT_IP:CLIENT_PORT` (tests/labkit/traffic.py). Self-contained, stdlib.
AGENT = r'''
import errno, json, socket, sys, threading, time
from collections import Counter
LOCK, STOPS, STALLS = threading.Lock(), {}, []
def stall_meter():
    # How long this agent went without a CPU: a 50 ms sleep that took much longer. Under emulation a node
    # busy starting a pod stalls its every process, this client's included: a timeout then says nothing
    # of the proxy. Kept: (when, seconds) of every stall above 0.5 s.
    while True:
        t = time.monotonic()
        time.sleep(0.05)
        late = time.monotonic() - t - 0.05
        if late > 0.5:
            with LOCK: STALLS.append((t, late))
threading.Thread(target=stall_meter, daemon=True).start()
def stalls(t0):
    # the 5 longest since t0, longest first: (seconds after t0, seconds stalled)
    with LOCK: seen = [(round(t - t0, 1), round(d, 1)) for t, d in STALLS if t >= t0]
    return {"stalls": sorted(seen, key=lambda x: -x[1])[:5]}
def emit(msg):
    with LOCK:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()
def kind(e):
    if isinstance(e, socket.timeout): return "timeout"
    if isinstance(e, ConnectionRefusedError): return "refused"
    if isinstance(e, ConnectionResetError): return "reset"
    if isinstance(e, OSError) and e.errno: return errno.errorcode.get(e.errno, str(e.errno))
    return type(e).__name__
def ask(sock, end):
    sock.sendall(b"probe\n")
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(max(0.01, end - time.monotonic()))
        chunk = sock.recv(1024)
        if not chunk: break
        data += chunk
    words = data.decode(errors="replace").split()
    if len(words) != 2: raise EOFError("no reply")
    return words[0].rsplit(":", 1)[0], words[1].rsplit(":", 1)[0]
def probe(c, stop):
    replies, seen, errors, first = Counter(), Counter(), Counter(), []
    n, t0, slowest = 0, time.monotonic(), (0.0, 0.0)
    while not stop.is_set() and (c.get("count") is None or n < c["count"]):
        n += 1
        t = time.monotonic()
        try:
            with socket.create_connection((c["ip"], c["port"]), timeout=c["timeout"]) as s:
                name, src = ask(s, t + c["timeout"])
        except Exception as e:
            errors[kind(e)] += 1
            if len(first) < 50: first.append([round(time.monotonic() - t0, 1), kind(e)])
        else:
            replies[name] += 1
            seen[src] += 1
            slowest = max(slowest, (round(time.monotonic() - t, 2), round(t - t0, 1)))
        if c.get("interval"): stop.wait(c["interval"])
    return {"count": n, "failures": sum(errors.values()), "replies": dict(replies), "seen_from": dict(seen),
            "errors": dict(errors), "first_failures": first, "elapsed": round(time.monotonic() - t0, 1),
            "slowest": slowest, **stalls(t0)}
def talk(c, stop):
    conns, failed, t0 = [], [], time.monotonic()
    for _ in range(c["count"]):
        try:
            s = socket.create_connection((c["ip"], c["port"]), timeout=c["timeout"])
            conns.append({"s": s, "first": ask(s, time.monotonic() + c["timeout"])[0]})
        except Exception as e:
            failed.append(kind(e))
    emit({"id": c["id"], "progress": {"opened": len(conns), "failed_to_open": failed}})
    exchanges, broken, slowest = 0, [], (0.0, 0.0)
    while not stop.wait(c["interval"]):
        for k in conns:
            if "broken" in k: continue
            t = time.monotonic()
            try:
                name = ask(k["s"], t + c["timeout"])[0]
                if name != k["first"]: k["broken"] = "answered by " + name
            except Exception as e:
                k["broken"] = kind(e)
            if "broken" in k: broken.append(k["first"] + ": " + k["broken"] + f" at +{time.monotonic() - t0:.1f}s")
            else:
                exchanges += 1
                slowest = max(slowest, (round(time.monotonic() - t, 2), round(t - t0, 1)))
    for k in conns: k["s"].close()
    return {"opened": len(conns), "failed_to_open": failed, "broken": broken, "exchanges": exchanges,
            "backends": sorted({k["first"] for k in conns}), "slowest": slowest, **stalls(t0)}
def run(c, stop):
    try: result = {"probe": probe, "talk": talk}[c["op"]](c, stop)
    except Exception as e: result = {"error": repr(e)}
    emit({"id": c["id"], "result": result})
emit({"id": 0, "ready": True})
for line in sys.stdin:
    c = json.loads(line)
    if c["op"] == "stop":
        STOPS[c["target"]].set()
        continue
    STOPS[c["id"]] = threading.Event()
    threading.Thread(target=run, args=(c, STOPS[c["id"]]), daemon=True).start()
'''


class LabError(Exception):
    pass


def log(msg: str) -> None:
    print(f"lab-test: {time.strftime('%H:%M:%S')} {msg}", flush=True)


class Kube:
    def __init__(self, kubeconfig: str, kubectl: str = "kubectl") -> None:
        self.base = [kubectl, f"--kubeconfig={kubeconfig}"]

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 900) -> str:
        p = subprocess.run([*self.base, *args], input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode:
            raise LabError(f"kubectl {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    def exists(self, *args: str) -> bool:
        return bool(self("get", *args, "--ignore-not-found", "-o", "name").strip())

    def pods(self, selector: str, namespace: str = "default") -> list[dict[str, Any]]:
        """name, ip, node, ready, deleting of each pod matching `selector`."""
        out = []
        for p in self.json("-n", namespace, "get", "pods", "-l", selector)["items"]:
            conds = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
            out.append({"name": p["metadata"]["name"], "ip": p["status"].get("podIP"),
                        "node": p["spec"].get("nodeName"), "ready": conds.get("Ready") == "True",
                        "deleting": "deletionTimestamp" in p["metadata"]})
        return out


class Agent:
    """AGENT running in `argv` (a client pod through kubectl exec, or a local python3)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen([*argv, "python3", "-u", "-c", AGENT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.msgs: dict[int, dict[str, Any]] = {}
        self.cond = threading.Condition()
        self.next_id = 1
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr or []), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self.msgs.setdefault(msg["id"], {}).update(msg)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def _wait(self, id_: int, key: str, timeout: float) -> Any:
        end = time.monotonic() + timeout
        with self.cond:
            while key not in self.msgs.get(id_, {}):
                if self.proc.poll() is not None:
                    raise LabError(f"agent {self.name} exited: {''.join(self.stderr[-5:]).strip()}")
                if not self.cond.wait(min(5.0, max(0.0, end - time.monotonic()))) and time.monotonic() >= end:
                    raise LabError(f"agent {self.name}: no {key} for request {id_} in {timeout:.0f} s")
            return self.msgs[id_][key]

    def ready(self, timeout: float = 300) -> None:
        self._wait(0, "ready", timeout)

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def start(self, op: str, **args: Any) -> int:
        id_, self.next_id = self.next_id, self.next_id + 1
        self._send({"id": id_, "op": op, **args})
        return id_

    def progress(self, id_: int, timeout: float = 120) -> Any:
        return self._wait(id_, "progress", timeout)

    def result(self, id_: int, timeout: float = 300) -> Any:
        res = self._wait(id_, "result", timeout)
        if "error" in res:
            raise LabError(f"agent {self.name}: {res['error']}")
        return res

    def stop(self, id_: int, timeout: float = 120) -> Any:
        self._send({"op": "stop", "target": id_})
        return self.result(id_, timeout)

    def probe(self, ip: str, port: int, count: int, timeout: float = 2.0) -> Any:
        return self.result(self.start("probe", ip=ip, port=port, count=count, timeout=timeout),
                           timeout=30 + count * (timeout + 1))

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def short(pod: str) -> str:
    """A pod's name without its Deployment's prefix: spread-5d8f7c9b6-x2k4q -> x2k4q."""
    return pod.rsplit("-", 1)[-1]


def short_break(broken: str) -> str:
    """`spread-5d8f7c9b6-x2k4q: timeout at +3.2s` -> `x2k4q: timeout at +3.2s`."""
    pod, _, why = broken.partition(": ")
    return f"{short(pod)}: {why}"


def programming(metrics: str) -> str:
    """kubeproxy_network_programming_duration_seconds from a /metrics text: how many changes, and the bucket
    bounds below which half and all of them were programmed (from the EndpointSlice controller's trigger time
    to the dataplane: what a pod's preStop delay has to cover)."""
    name = "kubeproxy_network_programming_duration_seconds"
    buckets = _buckets(metrics, name)
    count = next((float(m[1]) for m in re.finditer(rf"^{name}_count (\S+)$", metrics, re.M)), 0.0)
    if not count:
        return "none"
    p50 = next((le for le, c in buckets if c >= count / 2), float("inf"))
    top = next((le for le, c in buckets if c >= count), float("inf"))
    return f"{count:.0f} changes, half <= {p50:g} s, all <= {top:g} s"


def _buckets(metrics: str, name: str) -> list[tuple[float, float]]:
    out = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(out)


def eps(names: Any) -> str:
    return "{" + ",".join(sorted(short(n) for n in names)) + "}"


def when(r: dict[str, Any], events: dict[str, float]) -> str:
    """A probe loop's failure times and the scenario's events, in seconds since the loop began: which failures
    fell while pods were going away, and which did not."""
    fails = ", ".join(f"+{t:.0f}s {k}" for t, k in r["first_failures"][:8]) or "none"
    marks = ", ".join(f"{name} +{t:.0f}s" for name, t in events.items())
    return f"failures at {fails} ({marks})"


def pace(r: dict[str, Any]) -> str:
    """The slowest answer a loop got and the client's longest stall (its agent without a CPU), with their
    times: a timeout within a stall is the node's, not the proxy's."""
    slowest, at = r.get("slowest", (0.0, 0.0))
    out = f"slowest answer {slowest:.1f} s at +{at:.0f}s"
    if r.get("stalls"):
        when_, longest = r["stalls"][0]
        out += f", client stalled up to {longest:.1f} s at +{when_:.0f}s"
    return out


def answered(r: dict[str, Any]) -> str:
    return f"{r['count'] - r['failures']}/{r['count']}"


def errors(r: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"


class Lab:
    def __init__(self, kube: Kube, nodes: int) -> None:
        self.kube = kube
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.node_ip = {n: f"{NET}.{10 + i}" for i, n in enumerate(self.nodes, 1)}
        self.clients: dict[str, Agent] = {}
        self.client_ip: dict[str, str] = {}
        self.client_pods: dict[str, str] = {}
        self.host: Agent | None = None
        self.host_ip = ""
        self.svc: dict[str, str] = {}
        self.only = set(SCENARIOS)
        self.restart_proxies = False
        """A new image was imported under the same tag: running proxy pods restart even if their ConfigMap did
        not change."""
        self.logs: Path | None = None
        """Where each column's proxy pods' logs are kept (their start included), to read beside a failure's
        times; None: not kept."""

    # -- set up ---------------------------------------------------------------------------------------------------

    def configmap(self, mode: str) -> str:
        """deploy/configmap.yaml with the lab's values: the API server's address (no `kubernetes` ClusterIP works
        before a proxy runs), the mode, and the pod CIDR (pod traffic is told from node traffic by it)."""
        text = (DEPLOY / "configmap.yaml").read_text()
        for pattern, value in ((r"(\n\s+server: ).*", rf"\g<1>{API}"), (r'(\n\s+mode: )""', rf"\g<1>{mode}"),
                               (r'(\n\s+clusterCIDR: )""', rf"\g<1>{CLUSTER_CIDR}")):
            text, n = re.subn(pattern, value, text)
            if n != 1:
                raise LabError(f"deploy/configmap.yaml: {pattern!r} matched {n} times, want once")
        return text

    def setup(self) -> None:
        k = self.kube
        log("workload: vagrant/manifests/lab-test.yaml; rbac.yaml")
        k("apply", "-f", str(DEPLOY / "rbac.yaml"))
        k("apply", "-f", str(MANIFESTS / "lab-test.yaml"))
        for what in ("daemonset/lab-client", "deployment/spread", "deployment/local1"):
            k("rollout", "status", what, "--timeout=900s")
        self.svc = {s: k("get", "svc", s, "-o", "jsonpath={.spec.clusterIP}") for s in ("spread", "local1")}
        log(f"Services: {self.svc}")
        route = subprocess.run(["ip", "-o", "route", "get", self.node_ip["node1"]], capture_output=True,
                               text=True, check=True).stdout
        self.host_ip = route.split(" src ")[1].split()[0]
        self.host = Agent("host", [])
        clients = {p["node"]: p for p in k.pods("app=lab-client") if p["ready"] and not p["deleting"]}
        missing = set(self.nodes) - set(clients)
        if missing:
            raise LabError(f"no ready lab-client pod on {sorted(missing)}")
        self.client_pods = {node: clients[node]["name"] for node in self.nodes}
        self.client_ip = {node: clients[node]["ip"] for node in self.nodes}
        self.host.ready()
        self.ensure_clients()
        log(f"agents ready: host {self.host_ip}, clients {self.client_ip}")

    def ensure_clients(self) -> None:
        """An agent in every client pod, started again where its kubectl exec ended (an API server that
        restarted, a node that lost it)."""
        started = []
        for node, pod in self.client_pods.items():
            a = self.clients.get(node)
            if a is None or a.proc.poll() is not None:
                log(f"starting the client agent in {pod} ({node}): one kubectl exec for the whole run")
                self.clients[node] = Agent(node, [*self.kube.base, "exec", "-i", pod, "--"])
                started.append(self.clients[node])
        for a in started:
            a.ready()

    def close(self) -> None:
        for a in [*self.clients.values(), *([self.host] if self.host else [])]:
            a.close()

    def respread(self) -> None:
        """spread's replicas on every node again: scaling down picks its victims without the topology spread
        constraint (only the scheduler honours it), and a ClusterIP "across nodes" must have endpoints on both."""
        nodes = {p["node"] for p in self.kube.pods("app=spread") if p["ready"] and not p["deleting"]}
        if nodes >= set(self.nodes):
            return
        log(f"spread's replicas are on {sorted(nodes)} only: rollout restart, so the scheduler spreads them again")
        self.kube("rollout", "restart", "deployment/spread")
        self.kube("rollout", "status", "deployment/spread", "--timeout=900s")
        end = time.monotonic() + 600
        while len(self.kube.pods("app=spread")) > 3 and time.monotonic() < end:  # the old ones gone
            time.sleep(3)

    def ready_names(self, app: str) -> set[str]:
        return {p["name"] for p in self.kube.pods(f"app={app}") if p["ready"] and not p["deleting"]}

    # -- the proxy ----------------------------------------------------------------------------------------------

    def keep_logs(self, column: str, ds: str) -> None:
        """The proxy pods' logs with timestamps as `column` ends, one file per node (the restarted pod's start is
        in node2's); a failure's times print as seconds after its scenario's start, logged with the clock."""
        if self.logs is None:
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        for node, pod in self.proxy_pods(ds).items():
            text = self.kube("-n", "kube-system", "logs", "--timestamps", pod["name"], check=False)
            (self.logs / f"{column}-{node}.log").write_text(text)
        log(f"{column}: proxy logs kept in {self.logs}/{column}-*.log")

    def proxy_pods(self, ds: str) -> dict[str, dict[str, Any]]:
        return {p["node"]: p for p in self.kube.pods(f"k8s-app={ds}", "kube-system") if not p["deleting"]}

    def switch(self, column: str) -> str:
        """Run `column`'s proxy on every node; what it took, measured."""
        k = self.kube
        ds, mode = PROXIES.get(column, ("pyproxy", column))
        t0 = time.monotonic()
        # pods read the ConfigMap at their start: only a changed one needs new pods
        changed = "unchanged" not in k("apply", "-f", "-", stdin=self.configmap(mode))
        if ds == "pyproxy":
            if k.exists("-n", "kube-system", "daemonset", "kube-proxy"):
                # kube-proxy leaves its rules when it stops; pyproxy removes them at its start (README)
                self.delete_proxy("kube-proxy")
            existed = k.exists("-n", "kube-system", "daemonset", "pyproxy")
            k("apply", "-f", str(DEPLOY / "daemonset.yaml"))
        else:
            if k.exists("-n", "kube-system", "daemonset", "pyproxy"):
                self.pyproxy_cleanup()
            existed = k.exists("-n", "kube-system", "daemonset", "kube-proxy")
            k("apply", "-f", str(MANIFESTS / "kube-proxy.yaml"))
        if existed and (changed or self.restart_proxies):
            k("-n", "kube-system", "rollout", "restart", f"daemonset/{ds}")
        k("-n", "kube-system", "rollout", "status", f"daemonset/{ds}", "--timeout=900s")
        rolled = time.monotonic() - t0
        # kube-proxy's DaemonSet (as kubeadm's) has no readiness probe: ready is not yet programmed
        health = {n: self.wait_healthz(n) for n in self.nodes}
        programmed = self.wait_programmed()
        return (f"{rolled:.0f} s rollout, {time.monotonic() - t0:.0f} s to healthz {sum(health.values())}/"
                f"{len(self.nodes)} and traffic ({programmed})")

    def pyproxy_cleanup(self) -> None:
        """README's way back from pyproxy: the DaemonSet's own command turned into `pyproxy cleanup` (with every
        mount and privilege it needs), rolled out to every node, then deleted. Its probes go too (startup,
        readiness, liveness): nothing serves /healthz or /livez once pyproxy is not running, and the rollout would
        stop at the first node."""
        k = self.kube
        log("pyproxy cleanup on every node (the DaemonSet's command replaced), then deleting it")
        patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/command",
                  "value": ["/bin/sh", "-c", "pyproxy cleanup; exec sleep infinity"]},
                 {"op": "remove", "path": "/spec/template/spec/containers/0/startupProbe"},
                 {"op": "remove", "path": "/spec/template/spec/containers/0/readinessProbe"},
                 {"op": "remove", "path": "/spec/template/spec/containers/0/livenessProbe"}]
        k("-n", "kube-system", "patch", "daemonset", "pyproxy", "--type=json", "-p", json.dumps(patch))
        k("-n", "kube-system", "rollout", "status", "daemonset/pyproxy", "--timeout=900s")
        for node, pod in self.proxy_pods("pyproxy").items():
            out = self.wait_logs(pod["name"], "kube-system", r"^removed ", 180)
            log(f"  {node}: pyproxy cleanup: {out.strip().splitlines()[-1] if out.strip() else '(no output)'}")
        self.delete_proxy("pyproxy")

    def delete_proxy(self, ds: str, timeout: float = 300) -> None:
        """Delete a proxy's DaemonSet and wait for its pods to be gone: the next proxy binds the same host ports."""
        self.kube("-n", "kube-system", "delete", "daemonset", ds, "--wait=true")
        end = time.monotonic() + timeout
        while self.kube.pods(f"k8s-app={ds}", "kube-system") and time.monotonic() < end:
            time.sleep(2)

    def wait_logs(self, pod: str, namespace: str, pattern: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            out = self.kube("-n", namespace, "logs", pod, check=False)
            if re.search(pattern, out, re.I | re.M) or time.monotonic() >= end:
                return out
            time.sleep(5)

    def healthz(self, node: str) -> int | None:
        from labkit.traffic import http_get  # the host's side runs in this tree's venv

        return http_get(f"http://{self.node_ip[node]}:10256/healthz", timeout=3)["status"]

    def wait_healthz(self, node: str, timeout: float = 600) -> bool:
        end = time.monotonic() + timeout
        while self.healthz(node) != 200:
            if time.monotonic() >= end:
                return False
            time.sleep(2)
        return True

    def wait_programmed(self, timeout: float = 600) -> str:
        """Until every client reaches the spread Service's ClusterIP: the proxy serves it on every node."""
        t0 = time.monotonic()
        for node, a in self.clients.items():
            while a.probe(self.svc["spread"], 80, 3, timeout=1)["failures"]:
                if time.monotonic() - t0 > timeout:
                    raise LabError(f"the ClusterIP does not answer from {node} after {timeout} s")
                time.sleep(2)
        return f"{time.monotonic() - t0:.0f} s more"

    # -- scenarios: each returns (passed, what was measured) -----------------------------------------------------

    def clusterip(self) -> tuple[bool, str]:
        want = self.ready_names("spread")
        on = sorted({p["node"] for p in self.kube.pods("app=spread") if p["name"] in want})
        ok, parts = on == self.nodes, [f"replicas on {'+'.join(on)}"]
        for node, a in self.clients.items():
            r = a.probe(self.svc["spread"], 80, 30)
            seen = set(r["replies"])
            ok &= r["failures"] == 0 and seen == want
            parts.append(f"from {node} {answered(r)}, seen {len(seen & want)}/{len(want)} {eps(seen)}")
        return ok, "; ".join(parts)

    def nodeport(self) -> tuple[bool, str]:
        assert self.host
        want = self.ready_names("spread")
        ok, parts = True, []
        for node in self.nodes:
            r = self.host.probe(self.node_ip[node], 30080, 30)
            seen = set(r["replies"])
            ok &= r["failures"] == 0 and seen == want
            parts.append(f"{node}:30080 {answered(r)}, seen {len(seen & want)}/{len(want)}, src "
                         f"{'/'.join(sorted(r['seen_from']))}")
        return ok, "; ".join(parts)

    def etp_local(self) -> tuple[bool, str]:
        """local1's endpoints are all on node1: node1's NodePort answers from them with the client's own address,
        node2's does not answer at all."""
        assert self.host
        local = self.ready_names("local1")
        r1 = self.host.probe(self.node_ip["node1"], 30081, 20)
        seen = set(r1["replies"])
        ok = r1["failures"] == 0 and seen == local and set(r1["seen_from"]) == {self.host_ip}
        parts = [f"node1 {answered(r1)} by {len(seen)}/{len(local)} local, src {'/'.join(sorted(r1['seen_from']))}"
                 f"{' (client)' if set(r1['seen_from']) == {self.host_ip} else ''}"]
        for node in self.nodes[1:]:
            r = self.host.probe(self.node_ip[node], 30081, 5, timeout=1)
            ok &= r["failures"] == r["count"]
            parts.append(f"{node} {answered(r)} ({errors(r)})")
        return ok, "; ".join(parts)

    def cross_node(self) -> tuple[bool, str]:
        """A pod on node2 reaching a Service whose endpoints are all on node1."""
        local = self.ready_names("local1")
        r = self.clients["node2"].probe(self.svc["local1"], 80, 30)
        seen = set(r["replies"])
        src = set(r["seen_from"])
        ok = r["failures"] == 0 and seen == local and src == {self.client_ip["node2"]}
        return ok, (f"node2 -> node1's {len(local)}: {answered(r)}, seen {len(seen & local)}/{len(local)}, src "
                    f"{'pod' if src == {self.client_ip['node2']} else '/'.join(sorted(src))}")

    def scale(self) -> tuple[bool, str]:
        """3 -> 6 -> 3 replicas under continuous new connections from every client."""
        k = self.kube
        before = self.ready_names("spread")
        loops = {n: a.start("probe", ip=self.svc["spread"], port=80, count=None, interval=0.05, timeout=WAIT)
                 for n, a in self.clients.items()}
        t0 = time.monotonic()
        log(f"scale: traffic from every client since {time.strftime('%T')} (+0s below)")
        events: dict[str, float] = {}

        def mark(name: str) -> None:
            events[name] = time.monotonic() - t0

        try:
            time.sleep(5)
            mark("up")
            k("scale", "deployment/spread", "--replicas=6")
            k("rollout", "status", "deployment/spread", "--timeout=900s")
            mark("6 ready")
            time.sleep(10)  # the proxies follow the new endpoints; the traffic reaches them
            up = self.ready_names("spread")
            new = up - before
        finally:
            mark("down")
            k("scale", "deployment/spread", "--replicas=3")
            end = time.monotonic() + 600
            while len(k.pods("app=spread")) > 3 and time.monotonic() < end:  # until the deleted pods are gone
                time.sleep(3)
            mark("gone")
            time.sleep(5)
            res = {n: self.clients[n].stop(i) for n, i in loops.items()}
        total = sum(r["count"] for r in res.values())
        failed = sum(r["failures"] for r in res.values())
        got = set().union(*(set(r["replies"]) for r in res.values()))
        ok = failed == 0 and len(new) == 3 and new <= got
        detail = "; ".join(f"{n} {r['failures']}/{r['count']} failed ({errors(r)}; {when(r, events)}; {pace(r)})"
                           for n, r in res.items())
        return ok, (f"{len(before)}->{len(up)}->3: {failed} of {total} connections failed ({detail}); "
                    f"{len(new & got)}/{len(new)} new replicas answered")

    def proxy_restart(self, ds: str) -> tuple[bool, str]:
        """Delete node2's proxy pod under traffic: long-lived connections and new ones from node2's client."""
        node, a = "node2", self.clients["node2"]
        talk = a.start("talk", ip=self.svc["spread"], port=80, count=6, interval=0.2, timeout=WAIT)
        opened = a.progress(talk)
        loop = a.start("probe", ip=self.svc["spread"], port=80, count=None, interval=0.05, timeout=WAIT)
        t_loop = time.monotonic()
        log(f"proxy-restart: traffic from {node}'s client since {time.strftime('%T')} (+0s below)")
        events: dict[str, float] = {}
        try:
            old = self.proxy_pods(ds)[node]["name"]
            time.sleep(3)
            t0 = time.monotonic()
            events["deleted"] = t0 - t_loop
            self.kube("-n", "kube-system", "delete", "pod", old, "--wait=false")
            end = t0 + 600
            while True:
                pod = self.proxy_pods(ds).get(node)
                if pod and pod["name"] != old and "new pod" not in events:
                    events["new pod"] = time.monotonic() - t_loop
                if pod and pod["name"] != old and pod["ready"]:
                    events["ready"] = time.monotonic() - t_loop
                    break
                if time.monotonic() > end:
                    break
                time.sleep(2)
            healthy = self.wait_healthz(node, timeout=max(1.0, end - time.monotonic()))
            took = time.monotonic() - t0
            time.sleep(5)
        finally:
            t = a.stop(talk)
            r = a.stop(loop)
        ok = healthy and opened["opened"] == 6 and not t["broken"] and r["failures"] == 0
        return ok, (f"{node}'s {ds} back in {took:.0f} s: established {t['opened'] - len(t['broken'])}/"
                    f"{t['opened']} kept ({t['exchanges']} exchanges{'; broken: ' if t['broken'] else ''}"
                    f"{', '.join(short_break(b) for b in t['broken'][:3])}; {pace(t)}), new {r['failures']} of "
                    f"{r['count']} failed ({errors(r)}; {when(r, events)}; {pace(r)})")

    def checks(self, ds: str, mode: str) -> tuple[bool, str]:
        """What a user runs: the DaemonSet ready everywhere, each node's /healthz and /metrics, the logs naming
        the mode, the EndpointSlices."""
        k = self.kube
        st = k.json("-n", "kube-system", "get", "daemonset", ds)["status"]
        ready = st.get("numberReady", 0)
        ok = ready == st.get("desiredNumberScheduled") == len(self.nodes)
        health = sum(self.healthz(n) == 200 for n in self.nodes)
        pods = self.proxy_pods(ds)
        get_metrics = ("import urllib.request; print(urllib.request.urlopen("
                       "'http://127.0.0.1:10249/metrics', timeout=10).read().decode())")

        def node_checks(node: str) -> tuple[bool, bool, str]:
            name = pods[node]["name"]
            metrics = k("-n", "kube-system", "exec", name, "--", "python3", "-c", get_metrics, check=False)
            logs = k("-n", "kube-system", "logs", name, check=False)
            return ("kubeproxy_sync_proxy_rules_duration_seconds" in metrics,
                    re.search(rf"Using {mode} Proxier", logs, re.I) is not None, programming(metrics))

        with ThreadPoolExecutor(len(self.nodes)) as pool:
            per_node = list(pool.map(node_checks, self.nodes))
        metrics_ok = sum(m for m, _, _ in per_node)
        logs_ok = sum(lg for _, lg, _ in per_node)
        latency = "; ".join(f"{node} {p}" for node, (_, _, p) in zip(self.nodes, per_node, strict=True))
        ok &= health == metrics_ok == logs_ok == len(self.nodes)
        slices = k("get", "endpointslices", "-l", "kubernetes.io/service-name in (spread,local1)", "-o", "wide")
        print(slices, end="", flush=True)
        n = len(self.nodes)
        return ok, (f"ds {ready}/{n} ready, /healthz {health}/{n}, /metrics {metrics_ok}/{n}, "
                    f"logs 'Using {mode} Proxier' {logs_ok}/{n}; network programming: {latency}")

    def run_column(self, column: str) -> dict[str, Any]:
        ds, mode = PROXIES.get(column, ("pyproxy", column))
        t0 = time.monotonic()
        cells: dict[str, Any] = {}

        def done() -> dict[str, Any]:
            self.keep_logs(column, ds)
            when = time.strftime("%FT%TZ", time.gmtime())
            return {"cells": cells, "seconds": round(time.monotonic() - t0), "when": when}

        def record(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
            try:
                ok, detail = fn()
            except Exception as e:  # noqa: BLE001 - a failed scenario is a table cell; the next one still runs
                ok, detail = False, f"error: {e}"
            cells[name] = [ok, detail]
            log(f"{column} {name}: {'PASS' if ok else 'FAIL'} {detail}")

        log(f"=== {column}: {ds} in {mode} mode")
        try:
            self.ensure_clients()
            self.respread()
            cells["rollout"] = [True, self.switch(column)]
            log(f"{column} rollout: {cells['rollout'][1]}")
        except Exception as e:  # noqa: BLE001 - the column records why nothing else ran
            cells["rollout"] = [False, f"error: {e}"]
            log(f"{column} rollout: FAIL {e}")
            return done()
        runs: dict[str, Callable[[], tuple[bool, str]]] = {
            "clusterip": self.clusterip, "nodeport": self.nodeport, "etp-local": self.etp_local,
            "cross-node": self.cross_node, "scale": self.scale, "proxy-restart": lambda: self.proxy_restart(ds),
            "checks": lambda: self.checks(ds, mode)}
        for name, fn in runs.items():
            if name in self.only:
                record(name, fn)
        return done()


ROWS = {
    "rollout": "proxy rolled out on every node",
    "clusterip": "ClusterIP, 3 replicas on 2 nodes, from a pod on each node",
    "nodeport": "NodePort from the host to each node",
    "etp-local": "eTP=Local NodePort (endpoints on node1 only)",
    "cross-node": "pod on node2 -> Service with endpoints on node1",
    "scale": "scale 3->6->3 under traffic",
    "proxy-restart": "proxy pod on node2 deleted under traffic",
    "checks": "DaemonSet ready, /healthz, /metrics, logs",
}


def table(results: dict[str, Any]) -> str:
    cols = list(results)
    lines = ["| scenario | " + " | ".join(f"{c} ({results[c]['seconds']} s)" for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for row in SCENARIOS:
        cells = []
        for c in cols:
            cell = results[c]["cells"].get(row)
            cells.append("not run" if cell is None else f"**{'pass' if cell[0] else 'FAIL'}** {cell[1]}")
        lines.append(f"| {ROWS[row]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--kubectl", default="kubectl", help="the kubectl to run (lab.sh: the v1.20.2 one it built)")
    parser.add_argument("--modes", default="bpf,ipvs,nftables,kube-proxy",
                        help="comma-separated columns, in order: pyproxy modes, kube-proxy, kube-proxy-ipvs")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--restart-proxies", action="store_true",
                        help="restart running proxy pods at each switch (lab.sh: a new image was imported)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS[1:]),
                        help="comma-separated scenarios to run after the rollout (a rerun of some keeps the "
                             "column's other cells)")
    parser.add_argument("--results", type=Path, required=True, help="JSON file the columns accumulate in")
    parser.add_argument("--logs", type=Path, help="folder to keep each column's proxy pod logs in")
    args = parser.parse_args(argv)
    if args.nodes != 2:
        raise SystemExit("lab-test's scenarios are written for 2 nodes (PYPROXY_NODES=2)")
    results: dict[str, Any] = json.loads(args.results.read_text()) if args.results.exists() else {}
    lab = Lab(Kube(args.kubeconfig, args.kubectl), args.nodes)
    lab.only = set(args.scenarios.split(","))
    lab.restart_proxies = args.restart_proxies
    lab.logs = args.logs
    unknown = lab.only - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    t0 = time.monotonic()
    ok = True
    try:
        lab.setup()
        for column in [c for c in args.modes.split(",") if c]:
            ran = lab.run_column(column)
            if column in results and lab.only != set(SCENARIOS[1:]):  # a rerun of some: keep the others' cells
                ran["cells"] = {**results[column]["cells"], **ran["cells"]}
            results[column] = ran
            args.results.write_text(json.dumps(results, indent=1))
            ok &= all(cell[0] for cell in results[column]["cells"].values())
            print(table({column: results[column]}), flush=True)
    finally:
        lab.close()
    log(f"done in {time.monotonic() - t0:.0f} s; every column so far ({args.results}):")
    print(table(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
