"""New-connection latency and rate through the node, every dataplane side by side in the namespace lab, with
1 to 10,000 Services (10 endpoints each) loaded; upstream kube-proxy v1.20.2's iptables mode is the anchor.

Set-up. A lab with a client, the node and 10 backends; each backend runs bench/connload's epoll server on
:8080 (answers a request's first bytes with a 38-byte HTTP response and closes). Services and their
EndpointSlices are created in the lab's real API server, and every proxy follows it through --kubeconfig, as
on a node. A few of the Services (`targets`, spread over the whole set: first, last and evenly between, so a
linear rule list is walked about half-way on average) have the 10 lab backends as endpoints; the rest point
at unused addresses and only load the rule set. Each dataplane is started on the same objects, waited for
until fully programmed (bench/rules.py, bench/controlplane.py's checkers) and idle (`wait_idle`), measured,
stopped, and the node
reset (tables flushed, conntrack flushed). Periodic resyncs are turned off (1 h) during the measurement, so
what is measured is the dataplane, not a proxy rewriting its rules meanwhile (the control-plane part
measures that). "no proxy" is the floor: the client connects to the backends' own addresses, so packets are
only routed through the node.

The node starts clean for each size (a new lab): the iptables-legacy tables, once created in a namespace,
stay (their hooks and conntrack keep costing every packet), so at each size the dataplanes run in an order
that lets none inherit another's: no proxy, bpf, nftables, iptables-nft (nft tables vanish with `nft flush
ruleset`), then the legacy ones.

Load (bench/connload.c, compiled: a Python loop could not tell the modes apart on 2 cores). One new TCP
connection per request: socket, connect, send, read the reply to EOF, close; the latency of a request is that
whole sequence, so it includes the SYN's trip through the service translation (a generator timing only
request to response, as wrk does, would leave the translation of the SYN out). Two runs each:
- paced: `rate` connections/s (1,000) spread over 2 threads: latency p50/p99 of an unsaturated node.
- closed loop: `threads` (4) connections always in flight: the rate the node sustains, and CPU per
  connection over some 20,000 connections (the paced run's 1,500 are too few for a steady number: each
  connection there also pays for waking idle CPUs; its figure is in the notes).
CPU: in this lab the node has no process of its own (but the userspace mode's proxy, see below); its kernel work
(routing, netfilter or BPF, NAT, conntrack) runs in softirq on the sending task's CPU, inside the client's
connect()/send() for the forward path and inside the servers' syscalls for the replies, and the kernel (no
IRQ_TIME_ACCOUNTING here) charges that softirq time to the task it interrupted. So "lab CPU" is the CPU time,
over the measured window, of the client (its own CLOCK_PROCESS_CPUTIME_ID), the 10 servers and ksoftirqd/*
(/proc/PID/schedstat, exact ns), per connection: the whole kernel path of a connection, both ends included. The
dataplane's own share is its excess over "no proxy" (same client, same servers, same path, no translation), also
given as "% of a core at 1,000 conn/s" (that excess x 1,000/s), the unit of the anchor figure "kube-proxy
iptables costs ~35% of a core at 1,000 new connections/s at 10,000 Services". Not measured by that: the proxy
process itself (user space), recorded apart (its CPU over the window, ~0 once its rules are set); but the
userspace mode, whose proxy process carries every connection: its CPU over the window (user and system,
/proc/PID/stat) is part of its lab CPU, as the dataplane's.

The generator is not the bottleneck: its user-space time is about 1% of a connection's CPU (~1 of ~100 us,
recorded per run as client_user_us_per_conn); its threads block in the kernel. At 4 threads both cores are
busy (the lab's tasks use 1.8-1.9 of the 2 cores in the closed loop, recorded as lab_cores_busy) and the rate
no longer rises with more threads (measured: 22.8k conn/s at 4 threads, 23.0k at 8, with no proxy), so the
closed-loop rate is the lab's capacity; it is also bounded by other work on a shared machine, which the CPU
per connection (counted on the lab's own tasks) is not.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import select
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.cluster import Cluster, bridge_into_netns, stop_process
from labkit import Lab
from labkit.netns import parse_proc_net_counters

from bench import controlplane as cp
from bench import core, rules
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from bench.upstream import register_node

TOOL = core.REPO / "bench" / "build" / "connload"
DIRECT = "no proxy (routing only)"
# At each size: those that leave nothing behind first, the iptables-legacy ones last (see the docstring).
ORDER = (DIRECT, "bpf", "nftables", "userspace", "iptables-nft", "kube-proxy iptables-nft",
         "kube-proxy iptables-legacy", "iptables-legacy")
NO_RESYNC = {"pyproxy": ["--sync-period=3600"], "upstream": ["--iptables-sync-period=1h"]}
# The client's source addresses (beside its own 10.200.0.2), each with 64,000 ports, handed out in turn by
# connload over a lab's whole life: no source address and port is used twice in one lab (a size's every
# run: some 500,000 connections), so none meets a server's TIME_WAIT or the node's conntrack entry of an
# earlier connection (see bench/connload.c).
SOURCES = ("10.200.0.64", 64)


def build_tool() -> Path:
    """bench/build/connload, built by `make bench-tools` when missing or older than its source."""
    src = core.REPO / "bench" / "connload.c"
    if not TOOL.exists() or TOOL.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["make", "-s", "bench-tools"], cwd=core.REPO, check=True, timeout=120)
    return TOOL


def targets(n: int, count: int) -> list[int]:
    """`count` Service indices spread over 0..n-1, first and last included."""
    if n <= count:
        return list(range(n))
    return sorted({round(j * (n - 1) / (count - 1)) for j in range(count)})


# ---------------------------------------------------------------------------------------------- CPU


def _schedstat_ns(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def ksoftirqd_pids() -> list[int]:
    out = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith("ksoftirqd/"):
                out.append(int(comm.parent.name))
        except OSError:
            continue
    return out


@dataclass
class Cpu:
    """CPU time of the lab's servers, the kernel's softirq threads and the proxy, at one moment."""

    servers_ns: int
    softirqd_ns: int
    proxy_s: float

    @classmethod
    def read(cls, servers: Sequence[int], softirqd: Sequence[int], proxy_pid: int | None) -> Cpu:
        return cls(sum(_schedstat_ns(p) for p in servers), sum(_schedstat_ns(p) for p in softirqd),
                   rules.proc_cpu_s(proxy_pid) if proxy_pid else 0.0)


# ---------------------------------------------------------------------------------------------- the lab


class LoadLab:
    """A lab with connload servers in its 10 backends, and the generator in its client."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.tool = str(build_tool())
        self.servers: list[int] = []
        self.tuples = 0
        """Source address and port pairs used so far (connload's FIRST for the next run)."""
        self.softirqd = ksoftirqd_pids()
        for b in lab.backends:
            proc = lab.popen(b.ns, self.tool, "serve", str(core.BACKEND_PORT), stdout=subprocess.PIPE)
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 10)
            if not ready or proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"connload server in {b.name} did not start")
            self.servers.append(proc.pid)  # `ip netns exec` execs it: same pid
        # The client's ports: 64k of them, not 28k (the servers close first, so the client keeps no TIME_WAIT),
        # on each of its SOURCES addresses.
        lab.sysctl(lab.client, {"net.ipv4.ip_local_port_range": "1024 65535"})
        first = ipaddress.IPv4Address(SOURCES[0])
        lab.exec(lab.client, "ip", "-batch", "-", input="".join(
            f"addr add {first + k}/24 dev eth0\n" for k in range(SOURCES[1])))

    def syn_retrans(self) -> int:
        """The client's SYNs sent again (a SYN lost on the way, or its answer), from its /proc/net/netstat."""
        text = self.lab.exec(self.lab.client, "cat", "/proc/net/netstat").stdout
        return parse_proc_net_counters(text).get("TcpExtTCPSynRetrans", 0)

    def load(self, addresses: Sequence[str], threads: int, rate: float, seconds: float, warmup: float,
             proxy_pid: int | None, proxy_in_path: bool = False) -> dict[str, Any]:
        """One connload run from the client; its JSON plus the lab's CPU over the measured window (with
        `proxy_in_path`, the proxy's own CPU too: the userspace mode's process is its dataplane)."""
        spec = ",".join(addresses)
        resent = self.syn_retrans()
        proc = self.lab.popen(self.lab.client, self.tool, "load", spec, str(threads), str(seconds), str(warmup),
                              str(rate), f"{SOURCES[0]}/{SOURCES[1]}", str(self.tuples), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        assert proc.stdout is not None
        marks: dict[str, Cpu] = {}
        end = time.monotonic() + warmup + seconds + 15
        line = b""
        while time.monotonic() < end:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(b"window-"):
                marks[line.strip().decode()] = Cpu.read(self.servers, self.softirqd, proxy_pid)
            elif line.startswith(b"{"):
                break
        try:
            proc.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if not line.startswith(b"{") or len(marks) != 2:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"connload load {spec} failed (rc={proc.returncode}): {err[-500:]}")
        out: dict[str, Any] = json.loads(line)
        self.tuples += int(out["tuples_used"])
        out["syn_retrans"] = self.syn_retrans() - resent
        a, b = marks["window-start"], marks["window-end"]
        out["servers_cpu_s"] = (b.servers_ns - a.servers_ns) / 1e9
        out["softirqd_cpu_s"] = (b.softirqd_ns - a.softirqd_ns) / 1e9
        out["proxy_cpu_s"] = b.proxy_s - a.proxy_s
        out["lab_cpu_s"] = out["cpu_s"] + out["servers_cpu_s"] + out["softirqd_cpu_s"]
        if proxy_in_path:
            out["lab_cpu_s"] += out["proxy_cpu_s"]
        done = max(1, out["requests"])
        out["lab_cpu_us_per_conn"] = out["lab_cpu_s"] / done * 1e6
        out["client_user_us_per_conn"] = out["user_s"] / done * 1e6
        return out


# ---------------------------------------------------------------------------------------------- one size


class Size:
    """Everything measured at one number of Services, the series in ORDER (no proxy first: the others'
    CPU is also shown as their excess over it). Ratios to upstream are tabled by the report (bench/run.py)."""

    def __init__(self, rec: Recorder, n: int, floor: str = DIRECT, floor_label: str = "no proxy") -> None:
        self.rec, self.n = rec, n
        self.floor, self.floor_label = floor, floor_label
        """The series the others' CPU is compared with, and how its notes name it."""
        self.values: dict[str, dict[str, float]] = {}

    def record(self, series: str, mode: str, paced: dict[str, Any], closed: dict[str, Any]) -> None:
        n, rec = self.n, self.rec
        cpu = closed["lab_cpu_us_per_conn"]
        floor = self.values.get(self.floor)
        over = cpu - floor["cpu"] if floor and series != self.floor else None
        self.values[series] = {"cpu": cpu}
        errors = paced["errors"] + closed["errors"]
        warn = f"; {errors} failed requests" if errors else ""
        late = f"; {paced['late']} paced slots missed" if paced["late"] else ""
        resent = paced["syn_retrans"] + closed["syn_retrans"]
        late += f"; {resent} SYNs resent" if resent else ""

        for key in ("p50_us", "p99_us"):
            rec.add(Measurement(f"latency_{key}", series, mode, n, paced[key], "us", (warn + late).lstrip("; "),
                                {"paced": paced, "closed": closed} if key == "p50_us" else {}))
        rec.add(Measurement("conn_per_s", series, mode, n, closed["rate"], "conn/s",
                            f"p50 {closed['p50_us']:.0f} us under load{warn}"))
        rec.add(Measurement("lab_cpu_us_per_conn", series, mode, n, cpu, "us",
                            (f"{over:+.0f} us over {self.floor_label}; " if over is not None else "")
                            + f"paced: {paced['lab_cpu_us_per_conn']:.0f} us",
                            {"client_user_us_per_conn": closed["client_user_us_per_conn"],
                             "proxy_cpu_s_in_window": closed["proxy_cpu_s"],
                             "lab_cores_busy": closed["lab_cpu_s"] / closed["seconds"]}))
        if over is not None:
            rec.add(Measurement("translation_core_pct", series, mode, n, over / 10, "% core"))

    def not_run(self, series: str, mode: str, why: str) -> None:
        for metric, unit in (("latency_p50_us", "us"), ("latency_p99_us", "us"), ("conn_per_s", "conn/s")):
            self.rec.add(Measurement(metric, series, mode, self.n, None, unit, why))


def run_size(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, cluster: Cluster, n: int,
             skip: dict[str, str]) -> None:
    size = Size(rec, n)
    chosen = targets(n, int(p["targets"]))
    rec.param(f"targets_at_{n}", chosen)
    with lab_session(cluster, Lab(10, prefix="pbl")) as (lab, loadlab, kubeconfig):
        backend_addrs = [f"{b.ip}:{core.BACKEND_PORT}" for b in lab.backends]
        addresses = [f"{core.vip(i)}:{core.PORT}" for i in chosen]
        run_series(p, rec, deadline, size,
                   Series(lab, loadlab, kubeconfig, addresses, lambda: two_loads(p, loadlab, backend_addrs, None)),
                   skip)
        if n == max(p["services"]) and n > 1 and "bpf" in p["series"] and "bpf" not in skip:
            # Four rounds of two loads each, plus programming n Services twice: not begun on what would not
            # finish, so a slow machine reports the A/B as not run rather than failing the sizes measured.
            need = int(p["paired_rounds"]) * 3 * (float(p["seconds"]) + float(p["warmup_s"])) + float(p["min_left_s"])
            if deadline.remaining() < need:
                for key in ("p50_us", "p99_us"):
                    rec.add(Measurement(f"latency_{key}", PAIRED, "bpf", n, None, "us",
                                        f"not run: {deadline.remaining():.0f} s of the budget left"))
            else:
                paired(p, rec, deadline, lab, loadlab, n)


@contextlib.contextmanager
def lab_session(cluster: Cluster, lab: Lab) -> Iterator[tuple[Lab, LoadLab, Path]]:
    """`lab` started, with connload servers in its backends, the API server bridged into its node, and a
    kubeconfig for the proxies there."""
    with lab:
        loadlab = LoadLab(lab)
        bridge = bridge_into_netns(lab.node, cluster.apiserver_port)
        try:
            yield lab, loadlab, cluster.write_kubeconfig(lab.workdir / "kubeconfig", cluster.admin_token,
                                                         server="https://127.0.0.1:6443")
        finally:
            stop_process(bridge)


@dataclass
class Series:
    """What a size's series run on: the lab, the addresses the load goes to, and how the floor is measured."""

    lab: Lab
    loadlab: LoadLab
    kubeconfig: Path
    addresses: Sequence[str]
    floor: Callable[[], tuple[dict[str, Any], dict[str, Any]]]
    """The floor's paced and closed-loop runs."""
    served: Callable[[cp.Proxy], str] | None = None
    """After a proxy programmed its frontends: why the addresses are not served ("" when they are)."""
    order: Sequence[str] = ORDER


def run_series(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, size: Size, on: Series,
               skip: dict[str, str]) -> None:
    """Each series of `on.order` named in p["series"], in turn, at size.n Services: the floor (`size.floor`)
    or a dataplane; a dataplane that does not finish (or serve) is not run at larger sizes (`skip`)."""
    n = size.n
    for series in [s for s in on.order if s in p["series"]]:
        v = cp.VARIANTS.get(series)
        mode = "floor" if v is None else v.name
        if series in skip:
            size.not_run(series, mode, skip[series])
            continue
        if v is not None and v.upstream and v.backend == "nft" and n > int(p["upstream_nft_max"]):
            size.not_run(series, mode, "not run: its first sync does not finish at this size "
                         "(control-plane part; 9.5 min measured)")
            continue
        if deadline.remaining() < float(p["min_left_s"]):
            size.not_run(series, mode, f"not run: {deadline.remaining():.0f} s of the budget left")
            continue
        rec.step(f"{series} @ {n:,} services")
        if v is None:
            size.record(series, mode, *on.floor())
            continue
        why = measure_variant(p, rec, deadline, on, v, size)
        if why:
            size.not_run(series, mode, why)
            skip[series] = why if why.startswith("not served") else f"not run: did not finish at {n:,} Services"


PAIRED = "bpf, 1 vs N Services in one lab (A/B)"


def paired(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, lab: Lab, loadlab: LoadLab, n: int) -> None:
    """bpf's latency with 1 and with n Services loaded, in one lab and one pyproxy, alternating.

    Why: between labs (one per size) and runs minutes apart, this VM's paced p50 moves by 20-30 us with no
    proxy at all, more than the 10% the target allows. Here only the loaded Service set changes: pyproxy
    follows a manifest file that is rewritten between 1 and n Services (the measured Service, index 0, has
    the lab's backends in both), each state is measured `paired_rounds` times in ABBA order so a drift of
    the machine weighs on both alike, and the medians of the runs' p50s and p99s are compared. The direct
    path (no proxy) is measured in every round too, as the same lab's floor."""
    rec.step(f"{PAIRED}: 1 <-> {n:,} Services, {p['paired_rounds']} rounds")
    folder = lab.workdir / "paired"
    folder.mkdir()
    real = {0: [b.ip for b in lab.backends]}

    def load_services(count: int) -> None:
        tmp = folder / ".services.json"
        tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List",
                                   "items": cp.objects(0, count, cp.NAMESPACE_PREFIX, cp.SLICE_V1, real)}))
        tmp.rename(folder / "services.json")  # atomic: the source never reads half a file

    def programmed(count: int, timeout: float) -> bool:
        with contextlib.closing(cp.BpfProgress(Path(lab.pin_path), n)) as progress:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                # count frontends present, and the next one absent (after shrinking from n)
                if progress.poll() >= count and (count == n or progress.backends(count) is None):
                    return True
                time.sleep(0.05)
        return False

    seconds, warmup = float(p["seconds"]), float(p["warmup_s"])
    target = [f"{core.vip(0)}:{core.PORT}"]
    direct = [f"{b.ip}:{core.BACKEND_PORT}" for b in lab.backends]
    runs: dict[int, list[dict[str, Any]]] = {1: [], n: []}
    floor: list[dict[str, Any]] = []
    v = cp.VARIANTS["bpf"]
    load_services(1)
    proxy = cp.make_proxy(lab, v, source=folder, extra=NO_RESYNC["pyproxy"], log_path=lab.workdir / "paired.log")
    try:
        proxy.start()
        assert proxy.proc is not None
        for k in range(int(p["paired_rounds"])):
            for count in ((1, n) if k % 2 == 0 else (n, 1)):
                timeout = deadline.within(float(p["program_timeout_s"]), reserve=float(p["min_left_s"]) / 2)
                load_services(count)
                if not programmed(count, timeout):
                    raise RuntimeError(f"{PAIRED}: {count:,} Services not programmed within {timeout:.0f} s")
                wait_idle([proxy.proc.pid], 10.0)
                runs[count].append(loadlab.load(target, int(p["paced_threads"]), float(p["rate"]), seconds,
                                                warmup, proxy.proc.pid))
            floor.append(loadlab.load(direct, int(p["paced_threads"]), float(p["rate"]), seconds, warmup, None))
    finally:
        cp.stop_proxy(proxy, v)
        proxy.close()
    base = statistics.median(r["p50_us"] for r in runs[1])
    for count, samples in runs.items():
        for key in ("p50_us", "p99_us"):
            values = sorted(r[key] for r in samples)
            med = statistics.median(values)
            note = (f"median of {len(values)} runs {values[0]:.0f}-{values[-1]:.0f} us; "
                    f"no proxy {statistics.median(r[key] for r in floor):.0f} us")
            if key == "p50_us" and count != 1:
                note += f"; {med / base - 1:+.0%} vs 1 Service"
            rec.add(Measurement(f"latency_{key}", PAIRED, "bpf", count, med, "us", note,
                                {"runs": [r[key] for r in samples], "no_proxy": [r[key] for r in floor]}))


def two_loads(p: Mapping[str, Any], loadlab: LoadLab, addresses: Sequence[str],
              proxy_pid: int | None, proxy_in_path: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    seconds, warmup = float(p["seconds"]), float(p["warmup_s"])
    paced = loadlab.load(addresses, int(p["paced_threads"]), float(p["rate"]), seconds, warmup, proxy_pid,
                         proxy_in_path)
    closed = loadlab.load(addresses, int(p["threads"]), 0, seconds, warmup, proxy_pid, proxy_in_path)
    return paced, closed


def measure_variant(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, on: Series, v: cp.Variant,
                    size: Size) -> str:
    """Start `v` on n Services, wait until programmed, load it, stop it; why it did not finish, or ""."""
    lab, n = on.lab, size.n
    proxy = cp.make_proxy(lab, v, kubeconfig=on.kubeconfig, extra=NO_RESYNC["upstream" if v.upstream else "pyproxy"],
                          log_path=lab.workdir / f"{v.name.replace(' ', '-')}-{n}.log")
    progress = cp.PROGRESS[v.name](lab, n)
    try:
        proxy.start()
        assert proxy.proc is not None
        started = time.monotonic()
        timeout = deadline.within(float(p["program_timeout_s"]), reserve=float(p["min_left_s"]))
        while progress.poll() < n:
            if proxy.proc.poll() is not None:
                raise RuntimeError(f"{v.name} exited with {proxy.proc.returncode}:\n{proxy.log_tail()}")
            if time.monotonic() - started > timeout:
                return f"not programmed within {timeout:.0f} s"
            time.sleep(0.05)
        programmed = time.monotonic() - started
        idle = wait_idle([proxy.proc.pid], deadline.within(float(p["idle_timeout_s"]), reserve=float(p["min_left_s"])))
        if isinstance(progress, rules.SyncProgress) and v.mode == "iptables":
            rec.param(f"target_positions_{v.name}_{n}", positions(progress.counts, on.addresses))
        why = on.served(proxy) if on.served is not None else ""
        if why:
            return why
        paced, closed = two_loads(p, on.loadlab, on.addresses, proxy.proc.pid, v.in_path)
        paced["programmed_s"], paced["idle_wait_s"] = round(programmed, 2), round(idle, 2)
        size.record(v.name, v.name, paced, closed)
        return ""
    finally:
        progress.close()
        cp.stop_proxy(proxy, v)
        proxy.close()


def wait_idle(pids: Sequence[int], timeout: float, window: float = 0.5, busy: float = 0.1) -> float:
    """Wait until these processes (and their children) used under `busy` of a CPU over `window` seconds: a
    proxy may sync again right after its first sync (upstream does at 10,000 Services), the API server and
    etcd work on for a while after thousands of creates, and a load run beside that measures the
    contention, not the dataplane. Seconds waited (bounded by `timeout`)."""
    started = time.monotonic()
    last = sum(rules.proc_cpu_s(p) for p in pids)
    while time.monotonic() - started < timeout:
        time.sleep(window)
        now = sum(rules.proc_cpu_s(p) for p in pids)
        if now - last < busy * window:
            break
        last = now
    return time.monotonic() - started


def cluster_pids(cluster: Cluster) -> list[int]:
    """etcd's and the API server's pids: the processes whose command line names the cluster's folder."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cluster.marker in cmdline.read_bytes().decode(errors="replace"):
                out.append(int(cmdline.parent.name))
        except OSError:
            continue
    return out


def positions(counts: Mapping[str, int], addresses: Sequence[str]) -> list[float]:
    """Where the targets sit in the rule list (0 first .. 1 last) as listed: for iptables, how far down
    KUBE-SERVICES a new connection walks."""
    order = {vip: i for i, vip in enumerate(counts)}
    total = max(1, len(order) - 1)
    return [round(order.get(a.split(":")[0], -1) / total, 3) for a in addresses]


# ---------------------------------------------------------------------------------------------- the part


def params(quick: bool) -> dict[str, Any]:
    common = {"series": list(ORDER), "targets": 5, "rate": 1000, "paced_threads": 2, "threads": 4}
    if quick:
        return {**common, "services": [100], "seconds": 0.6, "warmup_s": 0.3, "program_timeout_s": 30,
                "idle_timeout_s": 10, "upstream_nft_max": 1000, "min_left_s": 8, "paired_rounds": 2}
    return {**common, "services": [1, 1000, 10000], "seconds": 1.5, "warmup_s": 0.5, "program_timeout_s": 40,
            "idle_timeout_s": 30, "upstream_nft_max": 1000, "min_left_s": 25, "paired_rounds": 4}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    rec.note("Latency from the paced run (1,000 new connections/s); conn/s and CPU from the closed loop (4 in "
             "flight). Lab CPU = client + 10 servers + ksoftirqd over the window, per connection (the node's "
             "kernel work runs in softirq inside those tasks); the dataplane's share is its excess over no "
             "proxy; the userspace mode's lab CPU includes its proxy process's. Ratio tables divide by upstream "
             "kube-proxy v1.20.2 iptables-legacy at the same size. This "
             "kernel has no IPVS (that mode is measured in the qemu guest). kube-proxy iptables-nft is not run "
             "past 1,000 Services: its first sync of 10,000 does not finish (control-plane part).")
    on_api(p, rec, cp.objects, lambda cluster, n, skip: run_size(p, rec, deadline, cluster, n, skip))


Objects = Callable[[int, int, str, str, Mapping[int, Sequence[str]]], list[dict[str, Any]]]
"""Services first..last-1 and their slices (namespace, slice apiVersion), some with other endpoints."""


def on_api(p: Mapping[str, Any], rec: Recorder, objects: Objects,
           each: Callable[[Cluster, int, dict[str, str]], None]) -> None:
    """A real API server holding p["services"] Services of `objects` in turn, growing; `each` measures at
    every size (the series it could not finish in `skip`). The `targets` Services have the lab's backends
    as endpoints, the others unused addresses."""
    with tempfile.TemporaryDirectory(prefix="pyproxy-bench-") as tmp, \
            Cluster(Path(tmp), authorization_mode="AlwaysAllow") as cluster:
        rec.step("etcd + kube-apiserver started")
        kube = cp.Kube(cluster.kubeconfig)
        try:
            namespace = kube.namespace(cp.NAMESPACE_PREFIX)
            register_node(kube.api, cp.NODE_IP)
            created, real = 0, set()
            skip: dict[str, str] = {}
            for n in p["services"]:
                chosen = targets(n, int(p["targets"]))
                lab_backends = [f"10.201.{b}.2" for b in range(1, core.ENDPOINTS + 1)]
                rec.step(f"creating {2 * (n - created):,} objects through the API ({n:,} services in all)")
                kube.create_many(objects(created, n, namespace, kube.slice_api_version,
                                         {i: lab_backends for i in chosen}), threads=16)
                for i in chosen:  # made earlier with unused endpoints: now the lab's backends
                    if i < created and i not in real:
                        kube.replace(cp.slice_of(i, namespace, kube.slice_api_version, addresses=lab_backends))
                real |= set(chosen)
                created = max(created, n)
                rec.param(f"api_server_settled_s_at_{n}", round(wait_idle(cluster_pids(cluster), 30.0), 1))
                each(cluster, n, skip)
        finally:
            kube.close()


PART = Part(
    name="latency",
    title="New-connection latency and rate through the node, every mode and upstream kube-proxy",
    budget_s={True: 100.0, False: 480.0},
    params=params,
    run=run,
    figures=(
        Figure("latency", "New TCP connection through the node vs Services (namespace lab)", (
            Panel("latency_p50_us", "microseconds", "p50 of one new connection (paced, 1,000 conn/s)"),
            Panel("latency_p99_us", "microseconds (log)", "p99 (paced, 1,000 conn/s)", logy=True),
        )),
        Figure("conn_rate", "New connections per second and CPU per connection vs Services (namespace lab)", (
            Panel("conn_per_s", "connections/s", "closed loop, 4 in flight, 2 cores"),
            Panel("lab_cpu_us_per_conn", "microseconds of CPU", "lab CPU per connection (closed loop)"),
        )),
    ),
    metrics={
        "latency_p50_us": "p50 latency of one new TCP connection (connect+request+reply+close), us, paced",
        "latency_p99_us": "p99 latency, us, paced at 1,000 conn/s",
        "conn_per_s": "new connections per second, closed loop (4 in flight)",
        "lab_cpu_us_per_conn": "lab CPU per connection (client + servers + ksoftirqd), us, closed loop",
        "translation_core_pct": "the dataplane's CPU over no proxy, % of a core at 1,000 conn/s",
    },
)
