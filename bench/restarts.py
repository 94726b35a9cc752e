"""Restarts and upgrades under load lose no connection (issue 12): the restart/upgrade figure.

    python -m bench.run --parts restarts      (or `make bench-restarts`; also a part of `make bench`)

One namespace lab, 3 backends, one Service of type NodePort (externalTrafficPolicy Cluster, so the NodePort flows
are SNATed to the node) read from a manifest folder, pyproxy in bpf mode. Through it, from the lab's client:

- new connections, paced at `rate` per second (connload, bench/connload.c: connect, one request, the reply to
  EOF, close; 2 s to connect, so one lost SYN costs a resend a second later, two fail it), half to the ClusterIP
  and half to the NodePort, to connload servers on the backends;
- `long_lived` connections (half ClusterIP, half NodePort) to the lab's line servers, each exchanging a line
  every 100 ms (`python -m pyproxy.lab.traffic talk`): broken when an exchange fails or another backend or
  source answers.

While both run, pyproxy is restarted `period_s` apart, in the order of `plan`: SIGTERM (a graceful stop) or
SIGKILL, then a start of the same or another build. "layout bump" starts a build whose frags map changed
layout (bench/build/pyproxy-frag-v9.bpf.o, made with -DPYPROXY_MAP_FRAGS=pyproxy_frag_v9, and
PYPROXY_TEST_MAP_FRAGS naming it to the Python side): that start makes a new frags map, unpins the old one
and adopts every other map, the connection-tracking map first of all; "layout back" returns to the
current build. The part checks that the connection-tracking map is the same kernel map (same id) before
the first and after the last restart, and that the frags pins are what each build says.

Then the same load through a switch of the proxy: pyproxy in iptables mode (standing in for upstream
kube-proxy's iptables mode: the same rules, so the same conntrack-DNATed flows) stopped with SIGTERM (its rules
stay, as kube-proxy's do), and pyproxy started in bpf mode (README, "Switching from kube-proxy").

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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import core
from bench.core import Deadline, Measurement, Part, Recorder
from bench.latency import build_tool
from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.lab import Lab, Pyproxy, write_manifest
from pyproxy.lab.manifests import Port, documents, endpoint_slice, service
from pyproxy.lab.netns import NODE_CLIENT_IP, parse_proc_net_counters

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
BUMPED_ENV = ("env", f"PYPROXY_TEST_MAP_FRAGS={BUMPED_FRAGS}", f"PYPROXY_BPF_OBJECT={BUMPED_OBJECT}")
MAP_FRAGS = "pyproxy_frag_v1"
"""The current build's frags map (abi.MAP_FRAGS unless this process was itself started with the override)."""

# A restart: the signal that ends the running pyproxy, and the start after it (mode, wrapper).
EVENTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "SIGTERM": ("SIGTERM", "bpf", ()),
    "SIGKILL": ("SIGKILL", "bpf", ()),
    "layout bump": ("SIGTERM", "bpf", BUMPED_ENV),
    "layout back": ("SIGTERM", "bpf", ()),
    "iptables -> bpf": ("SIGTERM", "bpf", ()),
}
PLAN = ["SIGTERM", "SIGKILL"] * 4 + ["layout bump", "layout back"]
SWITCH = ["iptables -> bpf"]


def ensure_bumped_object() -> Path:
    """bench/build/pyproxy-frag-v9.bpf.o, built by `make bench-tools` when missing."""
    if not BUMPED_OBJECT.exists():
        subprocess.run(["make", "-s", str(BUMPED_OBJECT.relative_to(core.REPO))], cwd=core.REPO, check=True,
                       timeout=300)
    return BUMPED_OBJECT


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
        self.resent0 = self.syn_resent()
        self.talk = lab.popen(lab.client, sys.executable, "-m", "pyproxy.lab.traffic", "talk", ",".join(TALK_TARGETS),
                              "--count", str(long_lived), "--interval", "0.1", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        assert self.talk.stdout is not None
        self.opened = json.loads(self.talk.stdout.readline())
        if self.opened["opened"] != long_lived:
            raise RuntimeError(f"long-lived connections did not all open: {self.opened}")
        self.seconds = seconds
        threads = max(2, int(rate // 50))
        self.conn = lab.popen(lab.client, str(build_tool()), "load", ",".join(NEW_TARGETS), str(threads),
                              f"{seconds:.1f}", "0", f"{rate:g}", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        assert self.conn.stdout is not None
        if self.conn.stdout.readline().strip() != "window-start":
            raise RuntimeError(f"connload did not start: {self.conn.stderr.read() if self.conn.stderr else ''}")
        self.started = time.monotonic()

    def syn_resent(self) -> int:
        text = self.lab.exec(self.lab.client, "cat", "/proc/net/netstat").stdout
        return parse_proc_net_counters(text).get("TcpExtTCPSynRetrans", 0)

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
        return {"new": new, "talk": talk, "syn_resent": self.syn_resent() - self.resent0}


def start_proxy(lab: Lab, source: Path, log: Path, mode: str, wrapper: Sequence[str]) -> Pyproxy:
    proxy = Pyproxy(lab, source, log_path=log, mode=mode, wrapper=wrapper)
    proxy.start()
    proxy.wait_healthy(30.0)
    return proxy


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


def run_plan(lab: Lab, source: Path, log: Path, plan: Sequence[str], first_mode: str, rate: float,
             long_lived: int, period: float, lead: float, say: Callable[[str], None]) -> dict[str, Any]:
    """pyproxy started in `first_mode`, the load started, the `plan`'s restarts `period` s apart after `lead` s,
    `lead` s more of load; the load's results, each restart's seconds to healthy, the CT map's ids."""
    ct_pin = Path(lab.pin_path) / abi.MAP_CT
    proxy = start_proxy(lab, source, log, first_mode, ())
    ct_ids = [map_id(ct_pin)]
    frags: list[dict[str, bool]] = []
    down: list[float] = []
    try:
        probe = lab.probe("tcp", VIP, 81, 10)
        if probe["failures"]:
            raise RuntimeError(f"the Service does not answer before the restarts: {probe}")
        load = Load(lab, rate, lead * 2 + period * (len(plan) - 1), long_lived)
        for k, event in enumerate(plan):
            delay = load.started + lead + k * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sig, mode, wrapper = EVENTS[event]
            t0 = time.monotonic()
            if sig == "SIGKILL":
                proxy.kill()
            elif proxy.terminate() != 0:
                raise RuntimeError(f"{event}: pyproxy did not exit 0 on SIGTERM:\n{proxy.log_tail()}")
            proxy = start_proxy(lab, source, log, mode, wrapper)
            down.append(round(time.monotonic() - t0, 2))
            ct_ids.append(map_id(ct_pin))
            pins = Path(lab.pin_path)
            frags.append({MAP_FRAGS: (pins / MAP_FRAGS).exists(), BUMPED_FRAGS: (pins / BUMPED_FRAGS).exists()})
            say(f"restart {k + 1}/{len(plan)} ({event}): healthy after {down[-1]:.2f} s; CT map id {ct_ids[-1]}; "
                f"frags pins {frags[-1]}")
        result = load.finish()
    finally:
        proxy.close()  # killed, then `pyproxy cleanup`: the next run starts from nothing
    return {**result, "seconds_to_healthy": down, "ct_map_ids": ct_ids, "frags_pins": frags}


def check_layouts(plan: Sequence[str], result: Mapping[str, Any]) -> list[str]:
    """What is wrong with the maps across the restarts: the CT map replaced, or frags pins not each build's."""
    problems = []
    ids = [i for i in result["ct_map_ids"] if i is not None]
    if len(ids) != len(result["ct_map_ids"]) or len(set(ids)) != 1:
        problems.append(f"the connection-tracking map was not kept: ids {result['ct_map_ids']}")
    for event, pins in zip(plan, result["frags_pins"], strict=True):
        bumped = EVENTS[event][2] == BUMPED_ENV
        if pins != {MAP_FRAGS: not bumped, BUMPED_FRAGS: bumped}:
            problems.append(f"after {event}: frags pins {pins}")
    return problems


def record(rec: Recorder, series: str, n: int, result: Mapping[str, Any], note: str = "") -> None:
    new, talk = result["new"], result["talk"]
    total = new["requests"] + new["errors"]
    broken = len(talk["broken"]) + len(talk["failed_to_open"])
    detail = {"connload": new, "talk": talk, "syn_resent": result["syn_resent"],
              "seconds_to_healthy": result["seconds_to_healthy"], "ct_map_ids": result["ct_map_ids"]}
    rec.add(Measurement("failed_new", series, "bpf", n, float(new["errors"]), "connections",
                        f"of {total:,} at {new['rate']:.0f}/s{'; ' + note if note else ''}", detail))
    rec.add(Measurement("broken_long", series, "bpf", n, float(broken), "connections",
                        f"of {talk['connections']}, {talk['exchanges']:,} exchanges"))
    rec.add(Measurement("total_new", series, "bpf", n, float(total), "connections"))
    rec.add(Measurement("max_new_ms", series, "bpf", n, new["max_us"] / 1000, "ms",
                        f"p99 {new['p99_us'] / 1000:.2f} ms; SYNs resent {result['syn_resent']}"))
    rec.add(Measurement("max_gap_ms", series, "bpf", n, float(talk["max_gap_ms"]), "ms", "100 ms asked"))
    rec.add(Measurement("healthy_s", series, "bpf", n, max(result["seconds_to_healthy"]), "s",
                        f"each: {', '.join(f'{s:.1f}' for s in result['seconds_to_healthy'])}"))


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    ensure_bumped_object()
    build_tool()
    plan = list(p["plan"])
    rec.note(f"Namespace lab, 3 backends, one NodePort Service (externalTrafficPolicy Cluster): {p['rate']} new "
             f"connections/s (half ClusterIP, half NodePort) and {p['long_lived']} long-lived connections "
             f"exchanging a line every 100 ms, through {len(plan)} restarts {p['period_s']} s apart: "
             f"{', '.join(plan)}. 'layout bump' starts a build whose frags map changed layout (pyproxy_frag_v9), "
             "'layout back' the current one; the connection-tracking map is checked to be the same kernel map "
             "throughout. The switch row starts pyproxy in iptables mode (kube-proxy's rules and conntrack "
             "DNAT), stops it with SIGTERM and starts bpf mode.")
    with Lab(3, prefix="prs") as lab:
        source = set_up(lab)
        log = lab.workdir / "pyproxy.log"
        rec.step(f"{len(plan)} restarts under load")
        result = run_plan(lab, source, log, plan, "bpf", float(p["rate"]), int(p["long_lived"]),
                          float(p["period_s"]), float(p["lead_s"]), rec.log)
        problems = check_layouts(plan, result)
        record(rec, "restarts: " + ", ".join(f"{plan.count(e)}x {e}" for e in dict.fromkeys(plan)), len(plan),
               result, "; ".join(problems))
        if problems:
            raise RuntimeError("; ".join(problems))
        if deadline.remaining() < 2 * float(p["lead_s"]) + 30:
            rec.note("the switch from iptables mode was not run: out of time")
            return
        rec.step("iptables mode -> bpf mode under load")
        result = run_plan(lab, source, log, SWITCH, "iptables", float(p["rate"]), int(p["long_lived"]),
                          float(p["period_s"]), float(p["lead_s"]), rec.log)
        record(rec, "switch: pyproxy iptables mode -> bpf mode", 1, result)


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"plan": ["SIGTERM", "SIGKILL", "layout bump", "layout back"], "rate": 200, "long_lived": 20,
                "period_s": 4.0, "lead_s": 3.0}
    return {"plan": PLAN, "rate": 200, "long_lived": 20, "period_s": 5.0, "lead_s": 4.0}


PART = Part(
    name="restarts",
    title="Restarts and upgrades under load: failed new and broken long-lived connections",
    budget_s={True: 90.0, False: 180.0},
    params=params,
    run=run,
    metrics={
        "failed_new": "new connections that failed (connect, request or reply), of all started",
        "broken_long": "long-lived connections broken (an exchange failed or another backend answered)",
        "total_new": "new connections started",
        "max_new_ms": "the slowest new connection, ms (a lost SYN would show as about 1,000 ms)",
        "max_gap_ms": "the longest gap between two exchanges of one long-lived connection, ms",
        "healthy_s": "the longest restart: signal to /healthz 200 of the next pyproxy, s (the dataplane serves "
                     "meanwhile)",
    },
    size_word="restart",
)
