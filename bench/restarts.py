"""Restarts and upgrades under load lose no connection (issue 12): the restart/upgrade figure.

    python -m bench.run --parts restarts      (or `make bench-restarts`; also a part of `make bench`)

One namespace lab, 3 backends, one Service of type NodePort (externalTrafficPolicy Cluster, so the NodePort flows
are SNATed to the node) read from a manifest folder, pyproxy in bpf mode. Through it, from the lab's client:

- new connections, paced at `rate` per second (connload, bench/connload.c: connect, one request, the reply to
  EOF, close; 2 s to connect, so one lost SYN costs a resend a second later, two fail it), half to the ClusterIP
  and half to the NodePort, to connload servers on the backends;
- `long_lived` connections (half ClusterIP, half NodePort) to the lab's line servers, each exchanging a line
  every 100 ms (`python -m labkit.traffic talk`): broken when an exchange fails or another backend or
  source answers.

While both run, pyproxy is restarted `period_s` apart, in the order of `plan`: SIGTERM (a graceful stop) or
SIGKILL, then a start of the same or another build. "layout bump" starts a build whose frags map changed
layout (bench/build/pyproxy-frag-v9.bpf.o, made with -DPYPROXY_MAP_FRAGS=pyproxy_frag_v9, run by a copy of the
pyproxy package whose abi.py names that map: labkit.proxy.newer_release): that start makes a new frags map,
unpins the old one
and adopts every other map, the connection-tracking map first of all; "layout back" returns to the
current build. The part checks that the connection-tracking map is the same kernel map (same id) before
the first and after the last restart, and that the frags pins are what each build says.

Then the same load through two switches of the proxy, the node's netfilter state reset between them:
- pyproxy in iptables mode stopped with SIGTERM (its rules stay) and pyproxy started in bpf mode;
- upstream kube-proxy v1.20.2 (iptables mode, iptables-nft; bench/upstream.py) serving the same Service from a
  real API server, stopped with SIGTERM (its rules stay), and pyproxy started in bpf mode on that API server.
What a switch loses and why: README, "Restarts, upgrades and switching from kube-proxy".

Reported per run: failed new connections (of all started), broken long-lived connections (of all), the
slowest new connection (a lost SYN shows as about 1 s), the longest gap in a long-lived connection's
exchanges, the client's SYNs sent again, and each restart's time from the signal to /healthz 200 (the
dataplane serves throughout: the programs and maps stay in the kernel while no pyproxy runs).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.cluster import Cluster, bridge_into_netns, stop_process
from labkit import Lab, Pyproxy, write_manifest
from labkit.manifests import Port, documents, endpoint_slice, service
from labkit.netns import NODE_CLIENT_IP, parse_proc_net_counters
from labkit.proxy import newer_release

from bench import controlplane as cp
from bench import core
from bench.core import Deadline, Measurement, Part, Recorder
from bench.latency import build_tool
from bench.upstream import HOSTNAME, KubeProxy, register_node
from pyproxy.dataplane.bpf import abi, libbpf, loader

VIP = "10.96.40.1"
CONN_PORT = 9000
"""connload servers on the backends (new connections)."""
TALK_PORT = 8080
"""The lab's line servers on the backends (long-lived connections)."""
PORTS = [Port("conn", 80, CONN_PORT, node_port=30080), Port("talk", 81, TALK_PORT, node_port=30081)]
NEW_TARGETS = [f"{VIP}:80", f"{NODE_CLIENT_IP}:30080"]
TALK_TARGETS = [f"{VIP}:81", f"{NODE_CLIENT_IP}:30081"]
BUMPED_OBJECT = core.REPO / "bench" / "build" / "pyproxy-frag-v9.bpf.o"
BUMPED_FRAGS = "pyproxy_frag_v9"
MAP_FRAGS = abi.MAP_FRAGS
"""The current build's frags map."""

# A restart: the signal that ends the running pyproxy, and the start after it (mode, the newer release or not).
EVENTS: dict[str, tuple[str, str, bool]] = {
    "SIGTERM": ("SIGTERM", "bpf", False),
    "SIGKILL": ("SIGKILL", "bpf", False),
    "layout bump": ("SIGTERM", "bpf", True),
    "layout back": ("SIGTERM", "bpf", False),
    "iptables -> bpf": ("SIGTERM", "bpf", False),
}
PLAN = ["SIGTERM", "SIGKILL"] * 4 + ["layout bump", "layout back"]
SWITCH = ["iptables -> bpf"]


def bumped_release(workdir: Path) -> tuple[str, ...]:
    """The command prefix that starts the newer release whose frags map changed layout (pyproxy_frag_v9): its
    object, bench/build/pyproxy-frag-v9.bpf.o (`make bench-tools`, built here when missing), and a copy of the
    pyproxy package in `workdir` that names the map so."""
    if not BUMPED_OBJECT.exists():
        subprocess.run(["make", "-s", str(BUMPED_OBJECT.relative_to(core.REPO))], cwd=core.REPO, check=True,
                       timeout=300)
    return newer_release(workdir, BUMPED_OBJECT, {f'MAP_FRAGS = "{MAP_FRAGS}"': f'MAP_FRAGS = "{BUMPED_FRAGS}"'})


def map_id(pin: Path) -> int | None:
    """The kernel id of the map pinned at `pin`, None when there is no pin."""
    if not pin.exists():
        return None
    fd = libbpf.check(libbpf.lib().bpf_obj_get(str(pin).encode()), f"open {pin}")
    try:
        return int(loader.map_info(fd).id)
    finally:
        os.close(fd)


class Load:
    """The two loads from the lab's client: connload's paced new connections and the long-lived talkers."""

    def __init__(self, lab: Lab, rate: float, seconds: float, long_lived: int) -> None:
        self.lab = lab
        self.resent0 = self.resent()
        self.talk = lab.popen(lab.client, sys.executable, "-m", "labkit.traffic", "talk", ",".join(TALK_TARGETS),
                              "--count", str(long_lived), "--interval", "0.1", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        assert self.talk.stdout is not None
        self.opened = json.loads(self.talk.stdout.readline())
        if self.opened["opened"] != long_lived:
            raise RuntimeError(f"long-lived connections did not all open: {self.opened}")
        self.seconds = seconds
        threads = max(4, int(rate // 25))  # each blocks on its connection: room for a slow one
        self.conn = lab.popen(lab.client, str(build_tool()), "load", ",".join(NEW_TARGETS), str(threads),
                              f"{seconds:.1f}", "0", f"{rate:g}", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        assert self.conn.stdout is not None
        if self.conn.stdout.readline().strip() != "window-start":
            raise RuntimeError(f"connload did not start: {self.conn.stderr.read() if self.conn.stderr else ''}")
        self.started = time.monotonic()

    def resent(self) -> dict[str, int]:
        """The client's SYNs sent again, and TCP segments sent again by the client and the backends (a packet
        lost on the way, or its answer), from their /proc/net/netstat and /proc/net/snmp."""
        out = {"syn": 0, "segments": 0}
        for ns in [self.lab.client, *(b.ns for b in self.lab.backends)]:
            text = self.lab.exec(ns, "cat", "/proc/net/netstat", "/proc/net/snmp").stdout
            counters = parse_proc_net_counters(text)
            out["segments"] += counters.get("TcpRetransSegs", 0)
            if ns == self.lab.client:
                out["syn"] = counters.get("TcpExtTCPSynRetrans", 0)
        return out

    def finish(self) -> dict[str, Any]:
        """Wait for connload's window to end, then stop the talkers; both results and the SYNs resent."""
        assert self.conn.stdout is not None and self.talk.stdin is not None and self.talk.stdout is not None
        end = self.started + self.seconds + 10
        new: dict[str, Any] | None = None
        while new is None and time.monotonic() < end:
            ready, _, _ = select.select([self.conn.stdout], [], [], max(0.0, end - time.monotonic()))
            line = self.conn.stdout.readline() if ready else ""
            if not line:
                break
            if line.startswith("{"):
                new = json.loads(line)
        self.conn.wait(timeout=10)
        self.talk.stdin.close()
        talk = json.loads(self.talk.stdout.readline())
        self.talk.wait(timeout=10)
        if new is None:
            raise RuntimeError(f"connload gave no result: {self.conn.stderr.read() if self.conn.stderr else ''}")
        now = self.resent()
        return {"new": new, "talk": talk, "syn_resent": now["syn"] - self.resent0["syn"],
                "segments_resent": now["segments"] - self.resent0["segments"]}


def set_up(lab: Lab) -> Path:
    """Servers on the backends (line servers, connload servers), the Service's manifests; their folder."""
    lab.start_servers(tcp=[TALK_PORT])
    tool = str(build_tool())
    for b in lab.backends:
        lab.sysctl(b.ns, {"net.ipv4.tcp_max_tw_buckets": 0})  # as bench/nodeport.py: SNAT reuses ports
        proc = lab.popen(b.ns, tool, "serve", str(CONN_PORT), stdout=subprocess.PIPE)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        if not ready or proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"connload server in {b.name} did not start")
    source = lab.workdir / "manifests"
    source.mkdir(exist_ok=True)
    write_manifest(source, "svc.yaml", documents(
        service("web", VIP, PORTS, type="NodePort", external_traffic_policy="Cluster"),
        endpoint_slice("web", {b.ip: True for b in lab.backends}, PORTS)))
    return source


def run_plan(lab: Lab, first: Callable[[], Any], start: Callable[[str, Sequence[str]], Pyproxy], plan: Sequence[str],
             p: Mapping[str, Any], say: Callable[[str], None], bumped: Sequence[str] = ()) -> dict[str, Any]:
    """The proxy `first()` starts (serving the Service), the load started, the `plan`'s restarts p["period_s"]
    apart after p["lead_s"], each ending the running proxy and starting pyproxy with `start(mode, wrapper)`
    (wrapper: `bumped` for the newer release), p["lead_s"] more of load; the load's results, each restart's
    seconds to healthy, the CT map's ids."""
    ct_pin = Path(lab.pin_path) / abi.MAP_CT
    period, lead = float(p["period_s"]), float(p["lead_s"])
    proxy = first()
    ct_ids = [map_id(ct_pin)]
    frags: list[dict[str, bool]] = []
    down: list[float] = []
    try:
        load = Load(lab, float(p["rate"]), lead * 2 + period * (len(plan) - 1), int(p["long_lived"]))
        for k, event in enumerate(plan):
            delay = load.started + lead + k * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sig, mode, newer = EVENTS[event]
            t0 = time.monotonic()
            if sig == "SIGKILL":
                proxy.kill()
            elif proxy.terminate() != 0 and isinstance(proxy, Pyproxy):
                raise RuntimeError(f"{event}: pyproxy did not exit 0 on SIGTERM:\n{proxy.log_tail()}")
            proxy = start(mode, bumped if newer else ())
            down.append(round(time.monotonic() - t0, 2))
            ct_ids.append(map_id(ct_pin))
            pins = Path(lab.pin_path)
            frags.append({MAP_FRAGS: (pins / MAP_FRAGS).exists(), BUMPED_FRAGS: (pins / BUMPED_FRAGS).exists()})
            say(f"restart {k + 1}/{len(plan)} ({event}): healthy after {down[-1]:.2f} s; CT map id {ct_ids[-1]}; "
                f"frags pins {frags[-1]}")
        result = load.finish()
    finally:
        proxy.close()  # pyproxy: killed, then `pyproxy cleanup`, so the next run starts from nothing
    return {**result, "seconds_to_healthy": down, "ct_map_ids": ct_ids, "frags_pins": frags}


def wait_served(lab: Lab, what: str, timeout: float = 60.0) -> None:
    """Until the line servers' port answers through the ClusterIP and the NodePort (a proxy's first sync)."""
    end = time.monotonic() + timeout
    while True:
        results = [lab.probe("tcp", ip, port, 4) for ip, port in ((VIP, 81), (NODE_CLIENT_IP, 30081))]
        if not any(r["failures"] for r in results):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"{what} does not serve the Service: {results}")
        time.sleep(0.5)


def kube_proxy_switch(lab: Lab, log: Path, p: Mapping[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """Upstream kube-proxy v1.20.2 (iptables mode, iptables-nft) serving the Service from a real API server,
    stopped with SIGTERM under the load, pyproxy in bpf mode started on the same API server."""
    with tempfile.TemporaryDirectory(prefix="pyproxy-bench-") as tmp, \
            Cluster(Path(tmp), authorization_mode="AlwaysAllow") as cluster:
        kube = cp.Kube(cluster.kubeconfig)
        bridge = bridge_into_netns(lab.node, cluster.apiserver_port)
        try:
            namespace = kube.namespace("restarts")
            register_node(kube.api, NODE_CLIENT_IP)
            svc = cp.service("web", VIP, [(port.name, port.port, "TCP") for port in PORTS], namespace=namespace)
            svc["spec"]["type"] = "NodePort"
            svc["spec"]["externalTrafficPolicy"] = "Cluster"
            for spec, port in zip(svc["spec"]["ports"], PORTS, strict=True):
                spec.update(targetPort=port.backend_port, nodePort=port.node_port)
            kube.create_many([svc, kube.endpoint_slice("web-1", "web", [b.ip for b in lab.backends],
                                                       [(port.name, port.backend_port, "TCP") for port in PORTS],
                                                       namespace=namespace)])
            kubeconfig = cluster.write_kubeconfig(lab.workdir / "kubeconfig", cluster.admin_token,
                                                  server="https://127.0.0.1:6443")

            def first() -> KubeProxy:
                proxy = KubeProxy(lab, kubeconfig, backend="nft")
                proxy.start()
                wait_served(lab, "kube-proxy")
                return proxy

            def start(mode: str, wrapper: Sequence[str]) -> Pyproxy:
                proxy = Pyproxy(lab, None, log_path=log, mode=mode, wrapper=wrapper,
                                extra_args=[f"--kubeconfig={kubeconfig}", f"--hostname-override={HOSTNAME}"])
                proxy.start()
                proxy.wait_healthy(30.0)
                return proxy

            return run_plan(lab, first, start, SWITCH, p, say)
        finally:
            stop_process(bridge)
            kube.close()


def check_layouts(plan: Sequence[str], result: Mapping[str, Any]) -> list[str]:
    """What is wrong with the maps across the restarts: the CT map replaced, or frags pins not each build's."""
    problems = []
    ids = [i for i in result["ct_map_ids"] if i is not None]
    if len(ids) != len(result["ct_map_ids"]) or len(set(ids)) != 1:
        problems.append(f"the connection-tracking map was not kept: ids {result['ct_map_ids']}")
    for event, pins in zip(plan, result["frags_pins"], strict=True):
        bumped = EVENTS[event][2]
        if pins != {MAP_FRAGS: not bumped, BUMPED_FRAGS: bumped}:
            problems.append(f"after {event}: frags pins {pins}")
    return problems


def record(rec: Recorder, series: str, n: int, result: Mapping[str, Any], note: str = "") -> None:
    new, talk = result["new"], result["talk"]
    total = new["requests"] + new["errors"]
    broken = len(talk["broken"]) + len(talk["failed_to_open"])
    detail = {"connload": new, "talk": talk, "syn_resent": result["syn_resent"],
              "segments_resent": result["segments_resent"],
              "seconds_to_healthy": result["seconds_to_healthy"], "ct_map_ids": result["ct_map_ids"]}
    rec.add(Measurement("failed_new", series, "bpf", n, float(new["errors"]), "connections",
                        f"of {total:,} at {new['rate']:.0f}/s{'; ' + note if note else ''}", detail))
    rec.add(Measurement("broken_long", series, "bpf", n, float(broken), "connections",
                        f"of {talk['connections']}, {talk['exchanges']:,} exchanges"))
    rec.add(Measurement("total_new", series, "bpf", n, float(total), "connections",
                        f"{new['late']:,} paced starts late" if new["late"] else ""))
    rec.add(Measurement("max_new_ms", series, "bpf", n, new["max_us"] / 1000, "ms",
                        f"p99 {new['p99_us'] / 1000:.2f} ms; SYNs resent {result['syn_resent']}"))
    rec.add(Measurement("max_gap_ms", series, "bpf", n, float(talk["max_gap_ms"]), "ms",
                        f"100 ms asked; TCP segments resent {result['segments_resent']}"))
    rec.add(Measurement("healthy_s", series, "bpf", n, max(result["seconds_to_healthy"]), "s",
                        f"each: {', '.join(f'{s:.1f}' for s in result['seconds_to_healthy'])}"))


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    build_tool()
    plan = list(p["plan"])
    rec.note(f"Namespace lab, 3 backends, one NodePort Service (externalTrafficPolicy Cluster): {p['rate']} new "
             f"connections/s (half ClusterIP, half NodePort) and {p['long_lived']} long-lived connections "
             f"exchanging a line every 100 ms, through {len(plan)} restarts {p['period_s']} s apart: "
             f"{', '.join(plan)}. 'layout bump' starts a build whose frags map changed layout (pyproxy_frag_v9), "
             "'layout back' the current one; the connection-tracking map is checked to be the same kernel map "
             "throughout. The switch rows start pyproxy in iptables mode, or upstream kube-proxy v1.20.2 "
             "(iptables-nft) on a real API server, stop it with SIGTERM (its rules and conntrack entries stay) and "
             "start pyproxy in bpf mode.")
    with Lab(3, prefix="prs") as lab:
        source = set_up(lab)
        log = lab.workdir / "pyproxy.log"

        def start(mode: str, wrapper: Sequence[str]) -> Pyproxy:
            proxy = Pyproxy(lab, source, log_path=log, mode=mode, wrapper=wrapper)
            proxy.start()
            proxy.wait_healthy(30.0)
            wait_served(lab, f"pyproxy {mode}")
            return proxy

        rec.step(f"{len(plan)} restarts under load")
        result = run_plan(lab, lambda: start("bpf", ()), start, plan, p, rec.log, bumped_release(lab.workdir))
        problems = check_layouts(plan, result)
        record(rec, "restarts: " + ", ".join(f"{plan.count(e)}x {e}" for e in dict.fromkeys(plan)), len(plan),
               result, "; ".join(problems))
        if problems:
            raise RuntimeError("; ".join(problems))
        rec.step("pyproxy iptables mode -> bpf mode under load")
        result = run_plan(lab, lambda: start("iptables", ()), start, SWITCH, p, rec.log)
        record(rec, "switch: pyproxy iptables mode -> bpf mode", 1, result)
        cp.reset_node(lab, legacy=False)
        rec.step("kube-proxy v1.20.2 iptables mode -> pyproxy bpf mode under load")
        result = kube_proxy_switch(lab, log, p, rec.log)
        record(rec, "switch: kube-proxy v1.20.2 iptables (nft) -> pyproxy bpf", 1, result)


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"plan": ["SIGTERM", "SIGKILL", "layout bump", "layout back"], "rate": 200, "long_lived": 20,
                "period_s": 4.0, "lead_s": 3.0}
    return {"plan": PLAN, "rate": 200, "long_lived": 20, "period_s": 5.0, "lead_s": 4.0}


PART = Part(
    name="restarts",
    title="Restarts and upgrades under load: failed new and broken long-lived connections",
    budget_s={True: 120.0, False: 240.0},
    params=params,
    run=run,
    metrics={
        "failed_new": "new connections that failed (connect, request or reply), of all started",
        "broken_long": "long-lived connections broken (an exchange failed or another backend answered)",
        "total_new": "new connections started",
        "max_new_ms": "the slowest new connection, ms (a lost SYN would show as about 1,000 ms)",
        "max_gap_ms": "the longest gap between two exchanges of one long-lived connection, ms",
        "healthy_s": "the longest restart: signal to the next pyproxy's /healthz 200 and the Service answering, s "
                     "(the dataplane serves meanwhile)",
    },
    size_word="restart",
)
