"""Control plane: from empty to fully programmed, one endpoint change, and peak RSS, per mode.

pyproxy runs as a user runs it (`python -m pyproxy run --proxy-mode=MODE` in a namespace lab's node), fed
by one of two sources, with N Services x 10 endpoints already there when it starts:
- manifests: one JSON `kind: List` file in --source (JSON, not YAML: PyYAML's pure-Python parser would
  dominate at 50,000 objects and measure PyYAML rather than pyproxy). This isolates pyproxy's own cost.
- API server: the lab's real kube-apiserver v1.20.2 + etcd (tests/cluster/cluster.py), objects created through
  the API beforehand with 16 client threads, pyproxy following it with --kubeconfig through a socat bridge
  into the node namespace (as tests/e2e/test_api_e2e.py does). The end-to-end figure.

"Fully programmed" is read from the kernel, not from pyproxy: a poller walks the expected frontends in a
fixed order, one services-map lookup each, and checks each has all 10 backends (render() writes a frontend
entry only after its slots, so its count covers them). Entries are never removed while programming, so the
poller resumes at the first frontend still missing: about N lookups in all plus one per poll (every 20 ms),
instead of BpfMap.keys_list()'s syscall per key per poll. The clock runs from the start of the pyproxy
process to the poll that found the last frontend. Beside it: pyproxy's CPU time until then, its syncs
(count and time inside them, from its own /metrics), and its peak RSS (VmHWM from /proc).

One endpoint change (API server, at `change_at` Services): a slice loses or regains one endpoint; the time
from the PUT to the frontend's backend count in the map, one map lookup per millisecond; one change per
--min-sync-period (1 s) so each is a change on its own.

Every dataplane runs here (`VARIANTS`): pyproxy's bpf, nftables and iptables modes (iptables on both the
legacy and the nft backend), and upstream kube-proxy v1.20.2's iptables mode (bench/upstream.py), the anchor
(API server only: it has no manifest source). A dataplane plugs in with a checker (`PROGRESS`) that counts
the expected frontends already programmed. The netfilter checkers (bench/rules.py) cannot poll the kernel
every 20 ms at 10,000 Services (one listing takes seconds), so they count once per sync, when the proxy's
`kubeproxy_sync_proxy_rules_last_timestamp_seconds` moves, and the time "programmed" is that sync's end as
the metric says; one endpoint change likewise ends at the end of the first sync after the write whose rules
show it. CPU time counts the proxy's children too (iptables-restore, nft). Between runs the node is reset
by flushing its tables (`nft flush ruleset`, iptables-legacy -F/-X when it was used): `pyproxy cleanup`
takes over 30 s after the iptables mode's 10,000 Services, and cleaning up is not what is measured here. A
dataplane that does not finish within its bound at a size (`netfilter_timeout_s`) is not run at larger
sizes, nor from the API server at that size when it did not finish from manifests.

Dual-stack (issue 15: 10,000 dual-stack Services x 10 endpoints per family programmed in bpf mode within 2x
the IPv4-only time): bpf mode from manifests, each Service RequireDualStack with an IPv4 and an IPv6
ClusterIP and two slices (addressType IPv4 / IPv6), against the same N IPv4-only Services, started in
alternation (IPv4-only, dual-stack, IPv4-only, ...) so the machine's load drifts over both alike; the
poller waits for both families' frontends. At `change_at` Services each start also has one endpoint change
through its manifest file, timed by pyproxy's own sync-duration metric (see dual_stack_runs). Not from the
API server: the lab's kube-apiserver v1.20.2 has no dual-stack Services (IPv6DualStack is an alpha gate
there, and its service CIDR is IPv4 only).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from apiobjects import Kube, service  # the tests' API helpers (tests/ is on sys.path: bench/__init__.py)
from cluster.cluster import Cluster, bridge_into_netns, stop_process
from labkit import Lab, Pyproxy
from labkit.netns import NODE_CLIENT_IP
from labkit.proxy import METRICS_PORT
from prometheus_client.parser import text_string_to_metric_families

from bench import core, rules
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from bench.upstream import HOSTNAME, KubeProxy, register_node
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.inspect import open_maps
from pyproxy.dataplane.bpf.mapset import Maps

POLL_S = 0.02
NODE_IP = NODE_CLIENT_IP
"""The lab node's address on the client's link: its Node object's InternalIP."""
NAMESPACE_PREFIX = "bench"
SLICE_V1 = "discovery.k8s.io/v1"


def endpoints(i: int, count: int = core.ENDPOINTS, family: str = "IPv4") -> list[str]:
    address = core.endpoint if family == "IPv4" else core.endpoint6
    return [address(i * core.ENDPOINTS + j) for j in range(count)]


def slice_of(i: int, namespace: str, api_version: str, count: int = core.ENDPOINTS,
             addresses: Sequence[str] | None = None, family: str = "IPv4") -> dict[str, Any]:
    """Service i's EndpointSlice of `family` (IPv4: svc-i-1, IPv6: svc-i-2): `count` ready endpoints on port
    8080 (`addresses`, default endpoints(i) of that family)."""
    chosen = list(addresses if addresses is not None else endpoints(i, family=family))[:count]
    return {"apiVersion": api_version, "kind": "EndpointSlice", "addressType": family,
            "metadata": {"name": f"svc-{i}-{1 if family == 'IPv4' else 2}", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": f"svc-{i}"}},
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in chosen],
            "ports": [{"name": "", "port": core.BACKEND_PORT, "protocol": "TCP"}]}


def dual_stack_service(i: int, namespace: str) -> dict[str, Any]:
    """Service i as RequireDualStack: ClusterIPs vip(i) and vip6(i), IPv4 the primary family."""
    svc = service(f"svc-{i}", core.vip(i), namespace=namespace)
    svc["spec"] |= {"clusterIPs": [core.vip(i), core.vip6(i)], "ipFamilies": ["IPv4", "IPv6"],
                    "ipFamilyPolicy": "RequireDualStack"}
    return svc


def objects(first: int, last: int, namespace: str, slice_version: str,
            addresses: Mapping[int, Sequence[str]] | None = None, *, dual_stack: bool = False) -> list[dict[str, Any]]:
    """Services first..last-1 and their slices; `addresses` gives some of them other endpoints (real ones).
    `dual_stack`: each Service RequireDualStack, with an IPv6 slice of as many endpoints beside the IPv4 one."""
    out = []
    for i in range(first, last):
        if dual_stack:
            out += [dual_stack_service(i, namespace), slice_of(i, namespace, slice_version),
                    slice_of(i, namespace, slice_version, family="IPv6")]
        else:
            out += [service(f"svc-{i}", core.vip(i), namespace=namespace),
                    slice_of(i, namespace, slice_version, addresses=(addresses or {}).get(i))]
    return out


# ---------------------------------------------------------------------------------------- the dataplanes


@dataclass(frozen=True)
class Variant:
    """A dataplane as the benchmarks run it: pyproxy in one mode (and iptables backend), or upstream."""

    name: str
    """The series' name and the measurements' mode: "bpf", "iptables-legacy", "kube-proxy iptables-nft"."""
    mode: str
    """--proxy-mode (upstream: iptables)."""
    backend: str | None = None
    """iptables backend, legacy or nft."""
    upstream: bool = False
    xdp: bool = False
    """bpf mode with the XDP program also on the client-facing device (--xdp-devices)."""

    @property
    def netfilter(self) -> bool:
        return self.mode not in ("bpf", "userspace")

    @property
    def in_path(self) -> bool:
        """The proxy process carries the traffic itself (the userspace mode): its CPU is the dataplane's."""
        return self.mode == "userspace"


VARIANTS = {v.name: v for v in (
    Variant("kube-proxy iptables-legacy", "iptables", "legacy", upstream=True),
    Variant("kube-proxy iptables-nft", "iptables", "nft", upstream=True),
    Variant("bpf", "bpf"),
    Variant("bpf XDP", "bpf", xdp=True),
    Variant("nftables", "nftables"),
    Variant("iptables-legacy", "iptables", "legacy"),
    Variant("iptables-nft", "iptables", "nft"),
    Variant("userspace", "userspace"),
)}
"""In the order they run at each size: the anchor first."""
ANCHOR = "kube-proxy iptables-legacy"
"""Upstream's iptables mode on the backend where it finishes at 10,000 Services: what ratios divide by."""


class BenchPyproxy(Pyproxy):
    """pyproxy as `Pyproxy` runs it, but reset like the other dataplanes between runs (see `reset_node`)."""

    def cleanup(self) -> subprocess.CompletedProcess[str]:
        if self.mode == "bpf":
            return super().cleanup()
        reset_node(self.lab, self.mode == "iptables" and "--iptables-backend=legacy" in self.extra_args)
        self._cleaned = True
        return subprocess.CompletedProcess([], 0, "", "")


Proxy = BenchPyproxy | KubeProxy


def make_proxy(lab: Lab, v: Variant, *, source: Path | None = None, kubeconfig: Path | None = None,
               extra: Sequence[str] = (), log_path: Path | None = None) -> Proxy:
    """The proxy of `v`, not started, following `source` (manifests) or `kubeconfig` (the API server)."""
    if v.upstream:
        if kubeconfig is None:
            raise ValueError("upstream kube-proxy follows an API server only")
        return KubeProxy(lab, kubeconfig, backend=v.backend or "legacy", log_path=log_path, extra_args=extra)
    args = [f"--iptables-backend={v.backend}"] if v.backend else []
    if v.xdp:
        args.append(f"--xdp-devices={lab.node_client_ifname}")
    if kubeconfig is not None:
        args += [f"--kubeconfig={kubeconfig}", f"--hostname-override={HOSTNAME}"]
    return BenchPyproxy(lab, source, log_path=log_path, mode=v.mode, extra_args=[*args, *extra])


def reset_node(lab: Lab, legacy: bool) -> None:
    """Empty the node's netfilter tables and conntrack: nft (which holds iptables-nft's tables too) always,
    iptables-legacy's only when `legacy` was used (touching them would create them: their hooks, and with
    them conntrack, would then burden every later run in this node)."""
    lab.exec(lab.node, "nft", "flush", "ruleset", timeout=120)
    if legacy:
        for table in ("nat", "filter"):
            lab.exec(lab.node, "iptables-legacy", "-w", "5", "-t", table, "-F", timeout=120)
            lab.exec(lab.node, "iptables-legacy", "-w", "5", "-t", table, "-X", timeout=120)
    rules.conntrack_flush(lab)


def stop_proxy(proxy: Proxy, v: Variant) -> None:
    """Stop it, and whatever it still runs (an iptables-restore or nft that has not answered yet would
    otherwise go on, and write its rules later), and reset the node for the next run."""
    proxy.terminate()
    if proxy.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proxy.proc.pid, signal.SIGKILL)  # its own session: the group is its pid
    if isinstance(proxy, KubeProxy):
        reset_node(proxy.lab, v.backend == "legacy")
    else:
        proxy.cleanup()


# ---------------------------------------------------------------------------------------- progress checkers


class Progress(Protocol):
    """How many of the expected frontends the dataplane has fully programmed."""

    def poll(self) -> int: ...

    def backends(self, index: int) -> int | None:
        """Frontend `index`'s ready backends as programmed (None: not there)."""
        ...

    def programmed_at(self) -> float | None:
        """Wall-clock time the counted state was written, when the checker knows it better than its poll
        (netfilter: the sync's end); None: the poll that saw it is the time."""
        ...

    def applied(self, index: int, want: int, since: float, timeout: float) -> float | None:
        """Wall-clock time at which frontend `index` had `want` backends, after `since`; None: not within
        `timeout` seconds."""
        ...

    def close(self) -> None: ...


class BpfProgress:
    """`dual_stack`: a frontend counts once both its families' entries (services and services6) have all
    their backends."""

    def __init__(self, pin_path: Path, count: int, dual_stack: bool = False) -> None:
        self.pin_path = pin_path
        port, tcp = abi.be16(core.PORT), abi.IPPROTO["TCP"]
        self.keys = [abi.SvcKey(abi.be32(core.vip(i)), port, tcp, abi.SVC_SCOPE_PACKETS) for i in range(count)]
        self.keys6 = [abi.Svc6Key(abi.in6(core.vip6(i)), port, tcp, abi.SVC_SCOPE_PACKETS)
                      for i in range(count)] if dual_stack else []
        self.done = 0
        self._maps: Maps | None = None

    def _open(self) -> Maps | None:
        # Only pinned maps: open_maps() would otherwise look at programs in *this* (the host's) namespace.
        if self._maps is None and all((self.pin_path / n).exists() for n in abi.ALL_MAPS):
            self._maps = open_maps(self.pin_path)
        return self._maps

    def backends(self, index: int) -> int | None:
        maps = self._open()
        v = maps.services.get(self.keys[index]) if maps is not None else None
        return None if v is None else int(v.backend_count)

    def backends6(self, index: int) -> int | None:
        maps = self._open()
        v = maps.services6.get(self.keys6[index]) if maps is not None else None
        return None if v is None else int(v.backend_count)

    def _complete(self, index: int) -> bool:
        return self.backends(index) == core.ENDPOINTS and (not self.keys6 or self.backends6(index) == core.ENDPOINTS)

    def poll(self) -> int:
        while self.done < len(self.keys) and self._complete(self.done):
            self.done += 1
        return self.done

    def programmed_at(self) -> float | None:
        return None

    def applied(self, index: int, want: int, since: float, timeout: float) -> float | None:
        """One map lookup per millisecond."""
        end = time.monotonic() + timeout
        while self.backends(index) != want:
            if time.monotonic() > end:
                return None
            time.sleep(0.001)
        return time.time()

    def close(self) -> None:
        if self._maps is not None:
            self._maps.close()


def _sync_progress(v: Variant) -> Callable[[Lab, int], Progress]:
    return lambda lab, count: rules.SyncProgress(
        lab, [core.vip(i) for i in range(count)], rules.lister_for(lab, v.mode, v.backend), METRICS_PORT,
        rules.nftables_one(lab) if v.mode == "nftables" else None)


PROGRESS: dict[str, Callable[[Lab, int], Progress]] = {
    **{name: (lambda lab, count: BpfProgress(Path(lab.pin_path), count)) for name, v in VARIANTS.items()
       if v.mode == "bpf"},
    **{name: _sync_progress(v) for name, v in VARIANTS.items() if v.netfilter},
    "userspace": lambda lab, count: rules.SyncProgress(lab, [core.vip(i) for i in range(count)],
                                                        rules.userspace_lister(lab), METRICS_PORT),
}


# ---------------------------------------------------------------------------------------- one run of pyproxy


def metrics(lab: Lab, proxy: Proxy) -> dict[str, float]:
    """pyproxy's /metrics as {"name{labels}": value}, asked from inside the node."""
    result = lab.http_get(lab.node, proxy.metrics_url, expect=200, timeout=5.0)
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(result["body"] or ""):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


SYNC_COUNT = "kubeproxy_sync_proxy_rules_duration_seconds_count"
SYNC_SUM = "kubeproxy_sync_proxy_rules_duration_seconds_sum"
PENDING_SERVICES = "kubeproxy_sync_proxy_rules_service_changes_pending"
PENDING_ENDPOINTS = "kubeproxy_sync_proxy_rules_endpoint_changes_pending"


@dataclass
class Sample:
    programmed_s: float
    cpu_s: float
    """pyproxy's CPU time (user + system) from its start until programmed."""
    syncs: float
    sync_total_s: float
    """Time inside syncs until then, from pyproxy's own metric."""
    rss_peak_mb: float = 0.0


class Run:
    """A proxy started on a lab node with N frontends to program."""

    def __init__(self, lab: Lab, v: Variant, n: int, *, source: Path | None = None,
                 kubeconfig: Path | None = None, dual_stack: bool = False) -> None:
        self.lab, self.variant, self.mode, self.n = lab, v, v.name, n
        self.proxy = make_proxy(lab, v, source=source, kubeconfig=kubeconfig,
                                log_path=lab.workdir / f"{v.name.replace(' ', '-')}-{n}{'-dual' * dual_stack}.log")
        if dual_stack and v.mode != "bpf":
            raise ValueError(f"dual-stack runs have a checker in bpf mode only, not {v.name}")
        self.progress: Progress = (BpfProgress(Path(lab.pin_path), n, dual_stack=True) if dual_stack
                                   else PROGRESS[v.name](lab, n))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.close()
        self.proxy.close()

    @property
    def pid(self) -> int:
        assert self.proxy.proc is not None
        return self.proxy.proc.pid

    def program(self, timeout: float) -> Sample | str:
        """Start the proxy and wait until every frontend is programmed: the numbers, or why it did not finish."""
        started, started_wall = time.monotonic(), time.time()
        self.proxy.start()
        assert self.proxy.proc is not None
        done = 0
        while done < self.n:
            if self.proxy.proc.poll() is not None:
                raise RuntimeError(f"{self.mode} exited with {self.proxy.proc.returncode}:\n{self.proxy.log_tail()}")
            if time.monotonic() - started > timeout:
                return f"{done:,} of {self.n:,} frontends after {time.monotonic() - started:.0f} s{self._why()}"
            time.sleep(POLL_S)
            done = self.progress.poll()
        at = self.progress.programmed_at()
        elapsed = time.monotonic() - started if at is None else at - started_wall
        cpu = rules.proc_cpu_s(self.pid)
        m = self.settled_metrics()
        return Sample(elapsed, cpu, m.get(SYNC_COUNT, 0.0), m.get(SYNC_SUM, 0.0))

    def _why(self) -> str:
        """The proxy's last error line, if it logged one (e.g. a restore that timed out)."""
        errors = [line for line in self.proxy.log_tail(200).splitlines()
                  if ("failed" in line or "rror" in line) and not line.startswith(" ")]
        return f" (last error: {errors[-1].strip()[-160:]})" if errors else ""

    def settled_metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once the sync that wrote the last frontend has ended (it still writes names and updates
        its metrics after that): nothing pending and the sync count unchanged between two reads."""
        end = time.monotonic() + timeout
        last = None
        while True:
            m = metrics(self.lab, self.proxy)
            count = m.get(SYNC_COUNT, 0.0)
            pending = m.get(PENDING_SERVICES, 0.0) + m.get(PENDING_ENDPOINTS, 0.0)
            if (count >= 1 and pending == 0 and count == last) or time.monotonic() > end:
                return m
            last = count
            time.sleep(0.2)

    def stop(self, sample: Sample) -> None:
        sample.rss_peak_mb = core.proc_status(self.pid).get("VmHWM", 0) / 1024
        stop_proxy(self.proxy, self.variant)


def measure(lab: Lab, v: Variant, series: str, n: int, rec: Recorder, timeout: float, repeats: int, *,
            source: Path | None = None, kubeconfig: Path | None = None,
            last: Callable[[Run], None] | None = None) -> bool:
    """`repeats` cold starts of the proxy with n Services; records the median (peak RSS: the largest);
    `last` runs on the last start once it is programmed. False when a start did not finish."""
    samples: list[Sample] = []
    for k in range(repeats):
        with Run(lab, v, n, source=source, kubeconfig=kubeconfig) as run:
            got = run.program(timeout)
            if isinstance(got, str):
                rec.add(Measurement("programmed_s", series, v.name, n, None, "s", got))
                stop_proxy(run.proxy, v)
                return False
            if last is not None and k == repeats - 1:
                last(run)
            run.stop(got)
            samples.append(got)
    record(rec, v, series, n, samples)
    return True


def record(rec: Recorder, v: Variant, series: str, n: int, samples: Sequence[Sample],
           detail: Mapping[str, Any] | None = None) -> float:
    """The median of `samples` (peak RSS: the largest) as the series' programmed_s, sync_total_s and rss_mb
    at n; returns the median programmed time."""
    runs = [asdict(s) for s in samples]
    times = sorted(s.programmed_s for s in samples)
    med = statistics.median(times)
    spread = f", {len(times)} starts {times[0]:.2f}-{times[-1]:.2f} s"
    cpu = statistics.median(s.cpu_s for s in samples)
    syncs = statistics.median(s.syncs for s in samples)
    who = "kube-proxy" if v.upstream else "pyproxy"
    rec.add(Measurement("programmed_s", series, v.name, n, med, "s",
                        f"{who} CPU {cpu:.1f} s{spread if len(times) > 1 else ''}", {"runs": runs, **(detail or {})}))
    rec.add(Measurement("sync_total_s", series, v.name, n, statistics.median(s.sync_total_s for s in samples),
                        "s", f"{syncs:.0f} sync{'s' if syncs != 1 else ''}"))
    rec.add(Measurement("rss_mb", series, v.name, n, max(s.rss_peak_mb for s in samples), "MB"))
    return med


def warm_up(lab: Lab, rec: Recorder) -> None:
    """One throw-away start on an empty folder: bytecode compiled, files in the page cache, so the measured
    starts are alike (the first start after a source change otherwise pays for compiling pyproxy)."""
    rec.step("warm-up: one pyproxy start on an empty manifest folder")
    folder = lab.workdir / "empty"
    folder.mkdir()
    with Pyproxy(lab, folder, log_path=lab.workdir / "warm-up.log") as proxy:
        proxy.start()
        proxy.wait_healthy(30.0)
        proxy.terminate()
        proxy.cleanup()


# ---------------------------------------------------------------------------------------- the two sources


def manifest_runs(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, lab: Lab, v: Variant) -> set[int]:
    """The sizes at which `v` did not finish."""
    series = f"{v.name} (manifests)"
    for n in p["manifests"].get(v.name, []):
        repeats = repeats_of(p, v, n)
        rec.step(f"{series}: {n:,} services from a manifest file, {repeats} start(s)")
        folder = lab.workdir / f"manifests-{n}"
        if not folder.exists():
            folder.mkdir()
            items = objects(0, n, NAMESPACE_PREFIX, SLICE_V1)
            (folder / "services.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        if not measure(lab, v, series, n, rec, deadline.within(timeout_of(p, v), reserve=10), repeats,
                       source=folder):
            return {m for m in p["manifests"][v.name] if m >= n}
    return set()


CHANGED = "changed.json"
"""The file of an A/B folder holding only the last Service's IPv4 slice, the one endpoint change rewrites."""


def ab_folder(lab: Lab, n: int, dual_stack: bool) -> Path:
    """n Services x 10 endpoints (dual-stack: per family) as one `kind: List` file, but for the last
    Service's IPv4 slice, which is in CHANGED on its own (so a change re-reads that small file only)."""
    folder = lab.workdir / f"manifests-ab-{n}-{'dual' if dual_stack else 'ipv4'}"
    if not folder.exists():
        folder.mkdir()
        items = objects(0, n, NAMESPACE_PREFIX, SLICE_V1, dual_stack=dual_stack)
        items.remove(slice_of(n - 1, NAMESPACE_PREFIX, SLICE_V1))
        (folder / "services.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        write_changed(folder, n, core.ENDPOINTS)
    return folder


def write_changed(folder: Path, n: int, count: int) -> None:
    """The last Service's IPv4 slice with `count` endpoints, replaced at once (the source polls the folder
    and must never read half a file)."""
    tmp = folder.parent / f".{folder.name}-{CHANGED}"
    tmp.write_text(json.dumps(slice_of(n - 1, NAMESPACE_PREFIX, SLICE_V1, count)))
    os.replace(tmp, folder / CHANGED)


def manifest_change(run: Run, folder: Path, p: Mapping[str, Any]) -> list[dict[str, float]]:
    """One endpoint of the last Service's IPv4 slice removed, then restored, through its file. Per change:
    the sync's own duration (what pyproxy's sync-duration metric added, per sync), the syncs it took and ms
    from the write to the map (which includes up to one poll of the folder, 200 ms). /metrics is read only
    well after the sync: a scrape reads every frontend's counters (20,000 lookups at 10,000 dual-stack
    Services) and, run beside the sync, took its CPU (a 4 ms sync measured 40-55 ms)."""
    out = []
    want = core.ENDPOINTS
    try:
        for want in (core.ENDPOINTS - 1, core.ENDPOINTS):
            before = run.settled_metrics()
            time.sleep(1.2)  # past --min-sync-period (1 s): the change is a sync on its own
            t0 = time.time()
            write_changed(folder, run.n, want)
            at = run.progress.applied(run.n - 1, want, t0, float(p["change_timeout_s"]))
            if at is None:
                raise RuntimeError(f"{folder / CHANGED} with {want} endpoints not in the map within "
                                   f"{p['change_timeout_s']} s")
            time.sleep(1.0)
            after = run.settled_metrics()
            syncs = after.get(SYNC_COUNT, 0.0) - before.get(SYNC_COUNT, 0.0)
            sync_s = after.get(SYNC_SUM, 0.0) - before.get(SYNC_SUM, 0.0)
            out.append({"sync_ms": sync_s / max(syncs, 1.0) * 1000, "syncs": syncs, "applied_ms": (at - t0) * 1000})
    finally:
        if want != core.ENDPOINTS:  # the next start expects all 10, also after a failure
            write_changed(folder, run.n, core.ENDPOINTS)
    return out


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


DUAL_SERIES = {False: "bpf IPv4-only A/B (manifests)", True: "bpf dual-stack A/B (manifests)"}


def dual_stack_runs(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, lab: Lab) -> None:
    """Issue 15's bound: n dual-stack Services (RequireDualStack, 10 endpoints per family in two slices)
    programmed in bpf mode within 2x the time of n IPv4-only Services x 10 endpoints. The two run
    interleaved (IPv4-only, dual-stack, IPv4-only, ...) in one lab, so the machine's load drifts over both
    alike; each round's times and load average are kept, and the ratio is that of the medians. At
    `change_at` Services every start also makes one endpoint change through the manifest file (see
    manifest_change)."""
    v = VARIANTS["bpf"]
    for n in p["dual_stack"]:
        folders = {dual: ab_folder(lab, n, dual) for dual in (False, True)}
        samples: dict[bool, list[Sample]] = {False: [], True: []}
        changes: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        rounds: list[dict[str, Any]] = []
        for r in range(int(p["dual_stack_rounds"])):
            rec.step(f"dual-stack A/B at {n:,} services, round {r + 1}: IPv4-only, then dual-stack")
            row: dict[str, Any] = {"loadavg": loadavg()}
            for dual in (False, True):
                with Run(lab, v, n, source=folders[dual], dual_stack=dual) as run:
                    got = run.program(deadline.within(float(p["programmed_timeout_s"]), reserve=10))
                    if isinstance(got, str):
                        rec.add(Measurement("programmed_s", DUAL_SERIES[dual], v.name, n, None, "s", got))
                        stop_proxy(run.proxy, v)
                        return
                    if n == p["change_at"]:
                        changes[dual] += manifest_change(run, folders[dual], p)
                    run.stop(got)
                samples[dual].append(got)
                row["dual_stack_s" if dual else "ipv4_s"] = got.programmed_s
                row["dual_stack_cpu_s" if dual else "ipv4_cpu_s"] = got.cpu_s
            row["ratio"] = row["dual_stack_s"] / row["ipv4_s"]
            rounds.append(row)
            rec.note(f"dual-stack A/B at {n:,} Services, round {r + 1}: IPv4-only {row['ipv4_s']:.2f} s "
                     f"(CPU {row['ipv4_cpu_s']:.2f} s), dual-stack {row['dual_stack_s']:.2f} s "
                     f"(CPU {row['dual_stack_cpu_s']:.2f} s), {row['ratio']:.2f}x, load average "
                     f"{' '.join(f'{x:.2f}' for x in row['loadavg'])}")
        medians = {dual: record(rec, v, DUAL_SERIES[dual], n, samples[dual], {"rounds": rounds})
                   for dual in (False, True)}
        ratios = [row["ratio"] for row in rounds]
        loads = [row["loadavg"][0] for row in rounds]
        # pyproxy's CPU until programmed: what the wall-clock ratio would be on an idle machine's free core.
        cpu = {dual: statistics.median(s.cpu_s for s in samples[dual]) for dual in (False, True)}
        rec.add(Measurement(
            "dual_stack_ratio", "bpf dual-stack / IPv4-only (manifests, A/B)", v.name, n,
            medians[True] / medians[False], "x",
            f"{len(rounds)} rounds {min(ratios):.2f}-{max(ratios):.2f}x; CPU {cpu[True] / cpu[False]:.2f}x "
            f"({cpu[True]:.2f} / {cpu[False]:.2f} s); 1-min load {min(loads):.1f}-{max(loads):.1f}; issue 15 bound: 2x",
            {"rounds": rounds, "cpu_ratio": cpu[True] / cpu[False]}))
        for dual in (False, True):
            if changes[dual]:
                ms = sorted(c["sync_ms"] for c in changes[dual])
                applied = sorted(c["applied_ms"] for c in changes[dual])
                rec.add(Measurement(
                    "change_sync_ms", DUAL_SERIES[dual], v.name, n, statistics.median(ms), "ms",
                    f"{len(ms)} changes {ms[0]:.0f}-{ms[-1]:.0f} ms; file write to map median "
                    f"{statistics.median(applied):.0f} ms", {"changes": changes[dual]}))


def repeats_of(p: Mapping[str, Any], v: Variant, n: int) -> int:
    return int(p["netfilter_repeats" if v.netfilter else "repeats"].get(str(n), 1))


def timeout_of(p: Mapping[str, Any], v: Variant) -> float:
    return float(p["netfilter_timeout_s"] if v.netfilter else p["programmed_timeout_s"])


def change_latency(run: Run, kube: Kube, namespace: str, p: Mapping[str, Any], rec: Recorder, series: str) -> None:
    """One endpoint change at a time to the last Service: ms from the PUT to the dataplane (a BPF map
    lookup every ms; netfilter: the end of the first sync after the PUT that shows the change). At most
    `change_rounds` changes, fewer when they take longer than `change_cap_s` in all (at least one)."""
    n, index = run.n, run.n - 1
    latencies = []
    path = f"{kube.slice_path.replace('/endpointslices', f'/namespaces/{namespace}/endpointslices')}/svc-{index}-1"

    def put(endpoints: int) -> float:
        """Write the slice with `endpoints`; the wall-clock time the PUT was sent (after the GET it needs)."""
        body = slice_of(index, namespace, kube.slice_api_version, endpoints)
        body["metadata"]["resourceVersion"] = kube.api.request("GET", path)["metadata"]["resourceVersion"]
        sent = time.time()
        kube.api.request("PUT", path, body=body)
        return sent

    begun = time.monotonic()
    want = core.ENDPOINTS
    try:
        for r in range(int(p["change_rounds"])):
            if r and time.monotonic() - begun > float(p["change_cap_s"]):
                break
            want = core.ENDPOINTS - 1 if r % 2 == 0 else core.ENDPOINTS
            time.sleep(1.2)  # past --min-sync-period (1 s): each change is one on its own
            t0 = put(want)
            at = run.progress.applied(index, want, t0, float(p["change_timeout_s"]))
            if at is None:
                rec.add(Measurement("endpoint_change_ms", series, run.mode, n, None, "ms",
                                    f"change {r + 1} not applied within {p['change_timeout_s']} s"))
                return
            latencies.append((at - t0) * 1000)
    finally:
        if want != core.ENDPOINTS:  # leave the Service as the next dataplane expects it, also after a failure
            put(core.ENDPOINTS)
    s = sorted(latencies)
    rec.add(Measurement("endpoint_change_ms", series, run.mode, n, statistics.median(s), "ms",
                        f"max {s[-1]:.0f} ms, {len(s)} change{'s' if len(s) > 1 else ''}",
                        {"samples_ms": latencies, "p90_ms": core.percentile(s, 0.9)}))


API_ALONE = "API server alone: both lists, JSON decoded"
"""The floor of every "(API server)" figure: the two paged lists a proxy makes at start (Services and
EndpointSlices, 500 a page, in parallel), read and JSON-decoded by this process with nothing converted or
programmed, against the same API server on the same 2 cores."""


def time_lists(kube: Kube, rounds: int = 3) -> list[float]:
    """Seconds for both paged lists, `rounds` times."""
    def paged(path: str) -> None:
        query = {"limit": "500"}
        while True:
            token = (kube.api.request("GET", path, query).get("metadata") or {}).get("continue")
            if not token:
                return
            query["continue"] = token

    out = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(rounds):
            t0 = time.monotonic()
            list(pool.map(paged, ("/api/v1/services", kube.slice_path)))
            out.append(time.monotonic() - t0)
    return out


def api_runs(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, lab: Lab, variants: Sequence[Variant],
             unfinished: Mapping[str, set[int]]) -> None:
    """All `variants` against one API server: objects created once per size, each variant started on them
    in turn (upstream first); `unfinished`: the sizes each did not finish from manifests (not run here)."""
    rec.step("starting etcd + kube-apiserver")
    with tempfile.TemporaryDirectory(prefix="pyproxy-bench-") as tmp, \
            Cluster(Path(tmp), authorization_mode="AlwaysAllow") as cluster:
        kube = Kube(cluster.kubeconfig)
        bridge = bridge_into_netns(lab.node, cluster.apiserver_port)
        try:
            namespace = kube.namespace(NAMESPACE_PREFIX)
            register_node(kube.api, NODE_IP)
            kubeconfig = cluster.write_kubeconfig(lab.workdir / "kubeconfig", cluster.admin_token,
                                                  server="https://127.0.0.1:6443")
            created, rate = 0, None
            skipped = {v.name: set(unfinished.get(v.name, ())) for v in variants}
            for n in sorted({n for v in variants for n in p["api"].get(v.name, [])}):
                todo = 2 * (n - created)
                if rate and todo / rate > deadline.remaining() - 30:
                    for v in variants:
                        if n in p["api"].get(v.name, []):
                            rec.add(Measurement("programmed_s", f"{v.name} (API server)", v.name, n, None, "s",
                                                f"not run: creating {todo:,} objects takes ~{todo / rate:.0f} s, "
                                                f"{deadline.remaining():.0f} s left"))
                    return
                rec.step(f"creating {todo:,} objects through the API ({n:,} services in all)")
                t0 = time.monotonic()
                kube.create_many(objects(created, n, namespace, kube.slice_api_version), threads=16)
                rate = todo / (time.monotonic() - t0)
                rec.param(f"api_creates_per_s_to_{n}", round(rate))
                created = n
                lists = time_lists(kube)
                rec.add(Measurement("programmed_s", API_ALONE, "floor", n, statistics.median(lists), "s",
                                    f"{len(lists)} rounds {min(lists):.2f}-{max(lists):.2f} s", {"rounds_s": lists}))
                for v in variants:
                    if n not in p["api"].get(v.name, []):
                        continue
                    series = f"{v.name} (API server)"
                    if n in skipped[v.name]:
                        rec.add(Measurement("programmed_s", series, v.name, n, None, "s",
                                            "not run: did not finish from manifests or at a smaller size"))
                        continue
                    repeats = repeats_of(p, v, n)
                    rec.step(f"{series}: {n:,} services, {repeats} start(s) against the API server")
                    change = None
                    if n == p["change_at"]:
                        def change(run: Run, series: str = series) -> None:
                            rec.step(f"{series}: single endpoint changes at {run.n:,} services")
                            change_latency(run, kube, namespace, p, rec, series)
                    if not measure(lab, v, series, n, rec, deadline.within(timeout_of(p, v), reserve=20), repeats,
                                   kubeconfig=kubeconfig, last=change):
                        skipped[v.name] |= {m for m in p["api"][v.name] if m > n}
        finally:
            stop_process(bridge)
            kube.close()


NETFILTER = ["nftables", "iptables-legacy", "iptables-nft"]


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"manifests": {"bpf": [1000]},
                "api": {"kube-proxy iptables-legacy": [1000], "bpf": [1000], "nftables": [1000],
                        "iptables-legacy": [1000], "iptables-nft": [1000]},
                "change_at": 1000, "change_rounds": 2, "change_cap_s": 10, "change_timeout_s": 20,
                "repeats": {"1000": 2}, "netfilter_repeats": {}, "programmed_timeout_s": 40,
                # No dual-stack A/B: at a load of 7 its two starts and four changes left the API server runs no time
                # in the 95 s (every one "0 of 1,000 frontends after 0 s").
                "netfilter_timeout_s": 30, "dual_stack": [], "dual_stack_rounds": 1}
    return {"manifests": {"bpf": [1000, 10000, 50000], **{m: [1000, 10000] for m in NETFILTER}},
            "api": {"kube-proxy iptables-legacy": [1000, 10000], "kube-proxy iptables-nft": [1000, 10000],
                    # 50,000 in bpf mode from manifests only: creating 100,000 objects through this API
                    # server takes about 4 minutes (420/s), which the run's 25-minute bound cannot spare
                    # beside the IPVS guest part.
                    "bpf": [1000, 10000], **{m: [1000, 10000] for m in NETFILTER}},
            "change_at": 10000, "change_rounds": 10, "change_cap_s": 30, "change_timeout_s": 60,
            "repeats": {"1000": 3, "10000": 3}, "netfilter_repeats": {"1000": 2}, "programmed_timeout_s": 240,
            "netfilter_timeout_s": 40,
            # Issue 15: dual-stack within 2x IPv4-only, bpf mode, A/B rounds (dual_stack_runs). 10,000 only: its
            # three rounds took 270 s at a load average of 7 (1,000 another 50 s), in the part's 1,080.
            "dual_stack": [10000], "dual_stack_rounds": 3}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    rec.note("Netfilter dataplanes: 'programmed' is the end of the first sync (its own "
             "kubeproxy_sync_proxy_rules_last_timestamp_seconds) after which every expected ClusterIP has its "
             "10 endpoints in the kernel's rules (iptables-save -t nat / nft list, read once per sync); CPU "
             "includes iptables-restore/nft children. Netfilter runs are bounded by "
             f"{p['netfilter_timeout_s']} s; the node is reset (tables and conntrack flushed) between runs.")
    variants = [v for name, v in VARIANTS.items() if name in p["api"] or name in p["manifests"]]
    with Lab(0, prefix="pbn") as lab:
        warm_up(lab, rec)
        unfinished = {v.name: manifest_runs(p, rec, deadline, lab, v) for v in variants if v.name in p["manifests"]}
        dual_stack_runs(p, rec, deadline, lab)
        api_runs(p, rec, deadline, lab, [v for v in variants if v.name in p["api"]], unfinished)


PART = Part(
    name="controlplane",
    title="Control plane: empty to fully programmed, one endpoint change, peak RSS (every mode, upstream)",
    budget_s={True: 95.0, False: 1080.0},
    params=params,
    run=run,
    figures=(
        Figure("sync_time", "Control plane: empty to fully programmed vs Services, every mode and upstream", (
            Panel("programmed_s", "seconds (log)", "proxy start to every frontend programmed: API server",
                  logy=True, series="(API server)"),
            Panel("programmed_s", "seconds (log)", "the same from a manifest file (the proxy's own cost)",
                  logy=True, series="(manifests)"),
            Panel("sync_total_s", "seconds (log)", "time inside syncs (the proxy's own metric), API server",
                  logy=True, series="(API server)"),
        )),
    ),
    metrics={
        "programmed_s": "seconds from the proxy's start to every frontend programmed",
        "sync_total_s": "seconds inside syncs until then (kubeproxy_sync_proxy_rules_duration_seconds_sum)",
        "endpoint_change_ms": "one endpoint change, ms from the API write to the dataplane (median)",
        "rss_mb": "peak RSS of the proxy process (VmHWM), MB",
        "dual_stack_ratio": "dual-stack / IPv4-only, start to programmed (bpf, manifests, A/B rounds)",
        "change_sync_ms": "one endpoint change through a manifest file: the sync's own duration, ms (median)",
    },
)
