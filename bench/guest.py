"""IPVS beside the other modes: the latency part's scenario run inside the qemu guest (this kernel has no IPVS),
pyproxy's bpf, ipvs and nftables modes and upstream kube-proxy v1.20.2's ipvs mode in one boot.

The guest is emulated (TCG, tests/guest/run.py: /dev/kvm here cannot run a stock kernel), 10-50x slower
than the host, so its absolute numbers mean little; the ratios between modes measured in the same guest, on the
same emulated CPUs, within minutes of each other, do. The ratio tables divide by upstream's ipvs mode.

Host side (`run`): the lab API server (etcd + kube-apiserver, tests/cluster/cluster.py) with the Services and
EndpointSlices of the latency part (bench/latency.py: N Services x 10 endpoints, 5 `targets` spread over the set
pointing at the lab's 10 backends, the rest at unused addresses), the Node object upstream wants, and one guest
boot. qemu gets two more devices (tests/guest/run.py's qemu_args):
- a user-mode network restricted to one forward (`restrict=on`: the guest reaches nothing else):
  10.0.2.100:6443 in the guest is, per connection, a `socat` on the host to the API server's port;
- a 9p share, `ctl`: the run's parameters, an admin kubeconfig (server https://127.0.0.1:6443, the name the
  serving certificate has), the kube-proxy binary, and the `ready-N` files by which the host says that the
  objects of N Services are in the API server.

Guest side (`python -m bench.guest --inside /mnt/ctl`): one namespace lab (labkit, 10 backends running
bench/connload's server, built on the host: same Debian, same glibc), its node reaching the API server through
two socats (node 127.0.0.1:6443 -> guest 127.0.0.1:6443 -> 10.0.2.100:6443). At each size it asks the host for
the objects (an event line on the console), waits for `ready-N`, then runs every series in SERIES: start the
proxy (--kubeconfig, periodic resyncs off as in the latency part), wait until it has programmed all N
frontends (bpf: the pinned services map; the others: the kernel's rules listed after each sync, bench/rules.py,
`ipvsadm -Ln` for IPVS), wait until it is idle, two bench/connload runs (paced: latency p50/p99; closed
loop: conn/s, lab CPU per connection), stop it and reset the node (nft flush, IPVS services, kube-ipvs0,
ipsets, conntrack). "no proxy" is the floor: the client connects to the backends' own addresses.

Sizes: 1, 100 and 1,000 Services (quick: 1 Service, and only no proxy and the two IPVS modes). How fast TCG
runs depends much on the host: on one (Intel Xeon) the first sync of 1,000 Services took 139 s for kube-proxy
ipvs and 238 s for pyproxy ipvs, on another (AMD EPYC) 45 s and 67 s, the whole part 326 s. Where the budget
ends first, the cells not reached say so ("not run: N s of the budget left"); $PYPROXY_BENCH_GUEST_SERVICES
(e.g. 1,100) chooses other sizes.

Results stream to the host as JSON lines on the serial console (EVENT prefix) and go into the part's Recorder
as they come, so a guest stopped at the budget keeps what it measured; every cell it did not reach is recorded
with the reason. Bounded: qemu's wall-clock timeout is the part's budget minus a reserve, and the guest,
told the same end, stops starting series when too little of it is left.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import core
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder

GUEST_RUNNER = core.REPO / "tests" / "guest" / "run.py"
EVENT = "@@pyproxy-bench-guest "
API_GUEST_IP = "10.0.2.100"
"""Where the guest reaches the API server: qemu's guestfwd, answered by a socat on the host."""
GUEST_IP = "10.0.2.15"
CTL_TAG, CTL_MOUNT = "ctl", "/mnt/ctl"

FLOOR = "no proxy (guest)"
# Series in the order they run at each size: (series, mode).
# Series in the order they run at each size: the anchor and the other IPVS mode first (what this part is for;
# bpf and nftables are measured on the host too), so a run cut short by its budget loses those last.
SERIES = (
    (FLOOR, "floor"),
    ("kube-proxy ipvs (guest)", "kube-proxy ipvs"),
    ("ipvs (guest)", "ipvs"),
    ("bpf (guest)", "bpf"),
    ("nftables (guest)", "nftables"),
)
ANCHOR = "kube-proxy ipvs (guest)"
SIZES_ENV = "PYPROXY_BENCH_GUEST_SERVICES"
LOAD_METRICS = (("latency_p50_us", "us"), ("latency_p99_us", "us"), ("conn_per_s", "conn/s"))
NO_RESYNC = {"pyproxy": ["--sync-period=3600"],
             "upstream": ["--iptables-sync-period=1h", "--ipvs-sync-period=1h"]}


# ---------------------------------------------------------------------------------------------- parameters


def params(quick: bool) -> dict[str, Any]:
    """Sizes: 1, 100 and 1,000 Services (quick: 1), or those in $PYPROXY_BENCH_GUEST_SERVICES. The paced
    rate, 100/s, is what the guest sustains on the slower hosts beside its 300-750 conn/s closed-loop capacity
    (2,000-2,800 on the faster)."""
    common = {"targets": 5, "paced_threads": 2, "threads": 4, "smp": 2, "memory_mb": 3072, "rate": 100,
              "warmup_s": 0.5, "left_out": {}}
    if quick:
        why = "not run in the quick run (the IPVS pair only: each pyproxy start costs 5-40 s under emulation)"
        p = {**common, "services": [1], "seconds": 1.0, "program_timeout_s": 45, "idle_timeout_s": 8,
             "min_left_s": 8, "left_out": {s: why for s in ("bpf (guest)", "nftables (guest)")}}
    else:
        p = {**common, "services": [1, 100, 1000], "seconds": 2.0, "program_timeout_s": 150, "idle_timeout_s": 8,
             "min_left_s": 10}
    if os.environ.get(SIZES_ENV):
        p["services"] = [int(n) for n in os.environ[SIZES_ENV].split(",")]
    return p


# ---------------------------------------------------------------------------------------------- host side


def guest_runner() -> ModuleType:
    """tests/guest/run.py (a stdlib-only script, not a package module), loaded from its path."""
    spec = importlib.util.spec_from_file_location("pyproxy_guest_runner", GUEST_RUNNER)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {GUEST_RUNNER}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Console:
    """What qemu's serial console prints, line by line (written from run_in_guest's reader thread): event lines
    go to `events`, the rest to stderr (the harness's log)."""

    def __init__(self, events: queue.Queue[dict[str, Any] | None]) -> None:
        self.events = events
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            line = line.replace("\r", "")
            at = line.find(EVENT)
            if at < 0:
                sys.stderr.write(f"  guest| {line}\n")
                continue
            try:
                self.events.put(json.loads(line[at + len(EVENT):]))
            except ValueError:
                sys.stderr.write(f"  guest| (a cut event line) {line}\n")
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


class Objects:
    """The Services and EndpointSlices in the lab API server, grown size by size: the latency part's layout."""

    def __init__(self, kube: Any, namespace: str, targets: int) -> None:
        self.kube, self.namespace, self.targets = kube, namespace, targets
        self.created = 0
        self.real: set[int] = set()

    def grow(self, n: int) -> None:
        from bench import controlplane as cp
        from bench.latency import targets

        chosen = targets(n, self.targets)
        backends = [f"10.201.{b}.2" for b in range(1, core.ENDPOINTS + 1)]
        self.kube.create_many(cp.objects(self.created, n, self.namespace, self.kube.slice_api_version,
                                         {i: backends for i in chosen}), threads=16)
        for i in sorted(set(chosen) - self.real):
            if i < self.created:  # made for a smaller size with unused endpoints: now the lab's backends
                self.kube.replace(cp.slice_of(i, self.namespace, self.kube.slice_api_version, addresses=backends))
        self.real |= set(chosen)
        self.created = max(self.created, n)


class Host:
    """The host's half of the run: relays the guest's events into the Recorder, creates objects on request."""

    def __init__(self, rec: Recorder, ctl: Path, objects: Objects) -> None:
        self.rec, self.ctl, self.objects = rec, ctl, objects
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: set[tuple[str, str, int]] = set()
        self.last_step = "booting the guest"
        self.thread = threading.Thread(target=self._serve, name="guest-events", daemon=True)

    def _serve(self) -> None:
        while (ev := self.events.get()) is not None:
            kind = ev.pop("event", None)
            if kind == "measurement":
                m = self.rec.add(Measurement(**ev))
                self.seen.add((m.metric, m.series, m.services))
            elif kind == "step":
                self.last_step = ev["name"]
                self.rec.step(f"guest: {ev['name']}")
            elif kind == "note":
                self.rec.note(ev["text"])
            elif kind == "param":
                self.rec.param(ev["key"], ev["value"])
            elif kind == "want":
                self._provide(int(ev["services"]))

    def _provide(self, n: int) -> None:
        self.last_step = f"creating the objects of {core.plural(n, 'Service')} in the API server"
        self.rec.step(self.last_step)
        try:
            started = time.monotonic()
            self.objects.grow(n)
            self.rec.param(f"objects_created_s_at_{n}", round(time.monotonic() - started, 1))
            (self.ctl / f"ready-{n}").write_text("ok\n")
        except Exception as e:  # noqa: BLE001 - the guest is told why, and records it
            (self.ctl / f"failed-{n}").write_text(f"{type(e).__name__}: {e}"[:300])

    def fill_missing(self, p: Mapping[str, Any], why: str) -> None:
        """Every cell the guest did not record, recorded as not finished with `why`."""
        for n in p["services"]:
            for series, mode in SERIES:
                metrics = [*LOAD_METRICS, *([] if mode == "floor" else [("programmed_s", "s")])]
                for metric, unit in metrics:
                    if (metric, series, n) not in self.seen:
                        self.rec.add(Measurement(metric, series, mode, n, None, unit, why))


def qemu_args(ctl: Path, apiserver_port: int) -> list[str]:
    """A user-mode network with nothing but the forward to the API server, and the `ctl` share."""
    forward = f"guestfwd=tcp:{API_GUEST_IP}:6443-cmd:socat STDIO TCP:127.0.0.1:{apiserver_port}"
    return ["-netdev", f"user,id=n0,restrict=on,{forward}", "-device", "virtio-net-pci,netdev=n0",
            "-fsdev", f"local,id={CTL_TAG},path={ctl},security_model=none",
            "-device", f"virtio-9p-pci,fsdev={CTL_TAG},mount_tag={CTL_TAG}"]


def share_kube_proxy(ctl: Path) -> str:
    """kube-proxy into the share (a hard link when it can be); "" or why upstream cannot run."""
    from cluster.cluster import cache_dir

    from bench import upstream

    path = cache_dir() / f"kube-proxy-{upstream.VERSION}"
    if not path.exists():
        return f"not run: no {path} (make kube-proxy)"
    target = ctl / path.name
    try:
        os.link(path, target)
    except OSError:
        shutil.copy2(path, target)
    return ""


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    from cluster.cluster import Cluster

    from bench import controlplane as cp
    from bench.latency import build_tool
    from bench.upstream import register_node

    rec.note("Inside a qemu guest under TCG emulation (Debian 6.1 kernel, 2 emulated CPUs on the 2 host cores): "
             "absolute numbers are 10-50x those of a real machine and mean little; the ratios between modes in "
             "the same boot do. Latency from the paced run, conn/s from the closed loop; programmed = from the "
             "proxy's start (Python start-up under emulation included) to all frontends in the kernel. Ratio "
             "tables divide by upstream kube-proxy v1.20.2 ipvs mode in the same guest.")
    runner = guest_runner()
    rec.step("guest image (tests/guest/build-image.sh; at once when cached)")
    image = runner.build_image()
    build_tool()
    kernel = (image / "kernel.version").read_text().strip() if (image / "kernel.version").exists() else "?"
    rec.param("guest_kernel", kernel)
    with tempfile.TemporaryDirectory(prefix="pyproxy-bench-guest-") as tmp:
        ctl = Path(tmp) / "ctl"
        ctl.mkdir()
        skip = {}
        if why := share_kube_proxy(ctl):
            skip[ANCHOR] = why
        rec.step("etcd + kube-apiserver started")
        with Cluster(Path(tmp) / "cluster", authorization_mode="AlwaysAllow") as cluster:
            kube = cp.Kube(cluster.kubeconfig)
            try:
                namespace = kube.namespace(cp.NAMESPACE_PREFIX)
                register_node(kube.api, cp.NODE_IP)
                cluster.write_kubeconfig(ctl / "kubeconfig", cluster.admin_token, server="https://127.0.0.1:6443")
                host = Host(rec, ctl, Objects(kube, namespace, int(p["targets"])))
                boot(p, rec, deadline, runner, image, host, ctl, cluster.apiserver_port, skip)
            finally:
                kube.close()
                keep = os.environ.get("PYPROXY_BENCH_GUEST_LOGS")  # where to keep the proxies' logs, for a look
                if keep and (ctl / "logs").is_dir():
                    shutil.copytree(ctl / "logs", keep, dirs_exist_ok=True)


def boot(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, runner: ModuleType, image: Path, host: Host,
         ctl: Path, apiserver_port: int, skip: Mapping[str, str]) -> None:
    """One guest boot running the guest side; its events relayed as they come, the cells it missed filled."""
    timeout = deadline.within(3600.0, reserve=3.0)
    (ctl / "params.json").write_text(json.dumps({**p, "end_wall": time.time() + timeout - 4.0, "skip": skip}))
    rec.step(f"guest boot (qemu, TCG), bounded at {timeout:.0f} s")
    host.thread.start()
    command = (f"mkdir -p {CTL_MOUNT} && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 {CTL_TAG} "
               f"{CTL_MOUNT} && python -m bench.guest --inside {CTL_MOUNT}")
    result = None
    try:
        result = runner.run_in_guest(command, timeout=timeout, smp=int(p["smp"]), memory_mb=int(p["memory_mb"]),
                                     env={"PYPROXY_CACHE": CTL_MOUNT}, echo=Console(host.events), image=image,
                                     qemu_args=qemu_args(ctl, apiserver_port))
    finally:
        host.events.put(None)
        host.thread.join(timeout=60)
    rec.param("guest_seconds", result.seconds)
    rec.param("guest_exit", result.returncode)
    if result.returncode == 0:
        host.fill_missing(p, "the guest recorded nothing (see the log)")
        return
    tail = [line for line in result.output.strip().splitlines() if EVENT not in line][-3:]
    why = (f"the guest ran out of time (qemu stopped after {result.seconds:.0f} s) during: {host.last_step}"
           if result.returncode == 124 else f"the guest exited {result.returncode} during: {host.last_step}")
    rec.note(f"{why}; its last output: {' | '.join(tail)[-600:]}")
    host.fill_missing(p, why)


# ---------------------------------------------------------------------------------------------- guest side


class EventOut:
    """The guest's Recorder output: each event one console line, written in one piece (under PIPE_BUF, so the
    guest's log lines on stderr never cut it)."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            os.write(1, (EVENT + line + "\n").encode())
        return len(text)

    def flush(self) -> None:
        pass


def ipvs_counts(text: str) -> dict[str, int]:
    """`ipvsadm -Ln` as {ClusterIP: real servers} for every virtual server on port 80/TCP."""
    out: dict[str, int] = {}
    vip = None
    for line in text.splitlines():
        if m := re.match(r"^TCP\s+(\d+\.\d+\.\d+\.\d+):80\s", line):
            vip = m.group(1)
            out[vip] = 0
        elif line.startswith(("TCP", "UDP", "SCTP")):
            vip = None
        elif vip is not None and line.strip().startswith("->"):
            out[vip] += 1
    return out


RESET = """
for dev in $(ls /sys/class/net); do tc qdisc del dev "$dev" clsact 2>/dev/null; done
nft flush ruleset
ipvsadm -C
ip link del kube-ipvs0 2>/dev/null
ipset destroy 2>/dev/null
conntrack -F 2>/dev/null
exit 0
"""
"""The node reset after every proxy, in one shell (each process costs a lot under emulation; `pyproxy cleanup`,
a Python start, some 20 s): the BPF mode's TC programs (the lab's node has no other qdisc), every netfilter
table (nftables mode, and the iptables-nft rules of both ipvs modes), IPVS services, kube-ipvs0, ipsets,
conntrack. The BPF pins go in `reset_node`."""


def reset_node(lab: Any) -> None:
    lab.exec(lab.node, "sh", "-c", RESET, timeout=120)
    pins = Path(lab.pin_path)
    for pin in pins.glob("pyproxy_*") if pins.is_dir() else []:
        pin.unlink()


def guest_pyproxy(lab: Any, *args: Any, **kwargs: Any) -> Any:
    """pyproxy as the lab runs it, its `cleanup` being `reset_node` (made here: labkit is imported late)."""
    from labkit import Pyproxy

    class GuestPyproxy(Pyproxy):
        def cleanup(self) -> subprocess.CompletedProcess[str]:
            reset_node(self.lab)
            self._cleaned = True
            return subprocess.CompletedProcess([], 0, "", "")

    return GuestPyproxy(lab, *args, **kwargs)


class GuestRun:
    """The guest's half: one lab, every size, every series."""

    def __init__(self, p: Mapping[str, Any], ctl: Path, rec: Recorder, deadline: Deadline) -> None:
        self.p, self.ctl, self.rec, self.deadline = p, ctl, rec, deadline
        self.kubeconfig = ctl / "kubeconfig"
        self.skip: dict[str, str] = {**p["left_out"], **p["skip"]}

    def not_run(self, series: str, mode: str, n: int, why: str) -> None:
        metrics = [*LOAD_METRICS, *([] if mode == "floor" else [("programmed_s", "s")])]
        for metric, unit in metrics:
            self.rec.add(Measurement(metric, series, mode, n, None, unit, why))

    def wait_objects(self, n: int) -> str:
        """Ask the host for n Services' objects; "" once they are there, else why not."""
        os.write(1, (EVENT + json.dumps({"event": "want", "services": n}) + "\n").encode())
        while not (self.ctl / f"ready-{n}").exists():
            if (self.ctl / f"failed-{n}").exists():
                return f"not run: the host could not create the objects: {(self.ctl / f'failed-{n}').read_text()}"
            if self.deadline.remaining() < float(self.p["min_left_s"]):
                return f"not run: the objects of {n:,} Services were not there in time"
            time.sleep(0.2)
        return ""

    def run(self) -> None:
        from cluster.cluster import bridge_into_netns, stop_process
        from labkit import Lab

        self.rec.step("network to the API server, lab of 10 backends")
        # Importing the benchmark's modules (the kubernetes client among them) takes some 10 s of emulated CPU:
        # on the other CPU while the lab is built, which mostly waits for `ip` commands.
        imports = threading.Thread(target=importlib.import_module, args=("bench.latency",), daemon=True)
        imports.start()
        forward = api_forward()
        try:
            with Lab(core.ENDPOINTS, prefix="pbg") as lab:
                imports.join()
                from bench.latency import LoadLab, targets

                loadlab = LoadLab(lab)
                bridge = bridge_into_netns(lab.node, 6443, timeout=60.0)
                try:
                    for n in self.p["services"]:
                        chosen = targets(n, int(self.p["targets"]))
                        self.rec.param(f"targets_at_{n}", chosen)
                        self.rec.step(f"waiting for the objects of {n:,} Services")
                        why = self.wait_objects(n)
                        for series, mode in SERIES:
                            reason = why or self.skip.get(series, "")
                            if not reason and self.deadline.remaining() < float(self.p["min_left_s"]):
                                reason = f"not run: {self.deadline.remaining():.0f} s of the budget left"
                            if reason:
                                self.not_run(series, mode, n, reason)
                                continue
                            self.rec.step(f"{series} @ {n:,} services")
                            self.series(lab, loadlab, series, mode, n, chosen)
                finally:
                    stop_process(bridge)
        finally:
            stop_process(forward)

    def series(self, lab: Any, loadlab: Any, series: str, mode: str, n: int, chosen: Sequence[int]) -> None:
        from bench.latency import Size, two_loads

        size = Size(self.rec, n)
        if mode == "floor":
            paced, closed = two_loads(self.p, loadlab, [f"{b.ip}:{core.BACKEND_PORT}" for b in lab.backends], None)
            size.record(series, mode, paced, closed)
            return
        try:
            why = self.measure(lab, loadlab, series, mode, n, [f"{core.vip(i)}:{core.PORT}" for i in chosen], size)
        except Exception as e:  # noqa: BLE001 - a mode that cannot run here is a result, with its error
            why = f"not run (failed): {e}"[:700]
            self.skip[series] = why  # the same error again at a larger size: not worth the guest's time
        if why:
            self.not_run(series, mode, n, why)
            self.skip.setdefault(series, f"not run: did not finish at {n:,} Services")

    def measure(self, lab: Any, loadlab: Any, series: str, mode: str, n: int, addresses: Sequence[str],
                size: Any) -> str:
        """Start the proxy of `mode`, wait until programmed and idle, load it, stop it: why it did not finish."""
        from labkit.proxy import METRICS_PORT

        from bench import controlplane as cp
        from bench import rules
        from bench.latency import two_loads, wait_idle
        from bench.upstream import HOSTNAME, KubeProxy

        log_path = self.ctl / "logs" / f"{mode.replace(' ', '-')}-{n}.log"
        log_path.parent.mkdir(exist_ok=True)
        if mode == "kube-proxy ipvs":
            proxy: Any = KubeProxy(lab, self.kubeconfig, backend="nft", mode="ipvs", log_path=log_path,
                                   extra_args=NO_RESYNC["upstream"])
        else:
            proxy = guest_pyproxy(lab, None, log_path=log_path, mode=mode, extra_args=[
                f"--kubeconfig={self.kubeconfig}", f"--hostname-override={HOSTNAME}", *NO_RESYNC["pyproxy"]])
        if mode in cp.PROGRESS:
            progress: Any = cp.PROGRESS[mode](lab, n)
        else:  # IPVS: the virtual servers, listed after each sync
            vips = [core.vip(i) for i in range(n)]
            progress = rules.SyncProgress(
                lab, vips, lambda: ipvs_counts(lab.exec(lab.node, "ipvsadm", "-Ln", timeout=120).stdout), METRICS_PORT)
        try:
            proxy.start()
            started = time.monotonic()
            timeout = self.deadline.within(float(self.p["program_timeout_s"]), reserve=float(self.p["min_left_s"]))
            while progress.poll() < n:
                if proxy.proc.poll() is not None:
                    raise RuntimeError(f"{mode} exited with {proxy.proc.returncode}: {last_error(proxy.log_tail(40))}")
                if time.monotonic() - started > timeout:
                    return f"not programmed within {timeout:.0f} s ({progress.poll():,} of {n:,} frontends)"
                time.sleep(0.1)
            programmed = time.monotonic() - started
            self.rec.add(Measurement("programmed_s", series, mode, n, programmed, "s"))
            idle = wait_idle([proxy.proc.pid], self.deadline.within(float(self.p["idle_timeout_s"])))
            paced, closed = two_loads(self.p, loadlab, addresses, proxy.proc.pid)
            paced["idle_wait_s"] = round(idle, 2)
            size.record(series, mode, paced, closed)
            return ""
        finally:
            progress.close()
            if proxy.proc is not None:
                proxy.terminate()
                with contextlib.suppress(ProcessLookupError):  # and whatever it still runs (iptables-restore, nft)
                    os.killpg(proxy.proc.pid, signal.SIGKILL)
            if isinstance(proxy, KubeProxy):
                reset_node(lab)
            else:
                proxy.cleanup()
            proxy.close()


def last_error(log: str) -> str:
    """The proxy's log lines that say what went wrong (else its last lines), for the series' note."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error|fail|cannot|refus|denied|invalid", line, re.I)]
    return " | ".join((errors or lines)[-3:])


def api_forward() -> subprocess.Popen[bytes]:
    """The guest's NIC up (the only network it has: qemu's restricted one) and 127.0.0.1:6443 forwarded to
    the API server's forward, so the lab's usual bridge into the node (cluster.cluster.bridge_into_netns)
    reaches it."""
    subprocess.run(["modprobe", "virtio_net"], check=True, timeout=60)
    for _ in range(100):
        # The one with a device behind it: `dummy` (loaded for IPVS) has made a dummy0 too.
        nics = sorted(n.name for n in Path("/sys/class/net").iterdir() if (n / "device").exists())
        if nics:
            break
        time.sleep(0.1)
    else:
        raise RuntimeError("no network interface in the guest (virtio_net)")
    for argv in (["ip", "link", "set", nics[0], "up"], ["ip", "addr", "add", f"{GUEST_IP}/24", "dev", nics[0]]):
        subprocess.run(argv, check=True, timeout=30)
    try:
        socket.create_connection((API_GUEST_IP, 6443), timeout=20).close()
    except OSError as e:
        raise RuntimeError(f"the API server's forward {API_GUEST_IP}:6443 does not answer on {nics[0]}: {e}") from e
    return subprocess.Popen(["socat", "TCP-LISTEN:6443,bind=127.0.0.1,fork,reuseaddr", f"TCP:{API_GUEST_IP}:6443"],
                            stdin=subprocess.DEVNULL, start_new_session=True)


def inside(ctl: Path) -> int:
    p = json.loads((ctl / "params.json").read_text())
    rec = Recorder("guest-inside", EventOut())  # type: ignore[arg-type]
    deadline = Deadline(max(0.0, float(p["end_wall"]) - time.time()))
    rec.param("guest_budget_s", round(deadline.remaining()))
    GuestRun(p, ctl, rec, deadline).run()
    return 0


PART = Part(
    name="guest",
    title="IPVS side by side: every mode and upstream kube-proxy ipvs in one qemu guest (TCG emulation)",
    budget_s={True: 130.0, False: 480.0},
    params=params,
    run=run,
    figures=(
        Figure("guest", "In the qemu guest under TCG emulation (10-50x slower): compare the modes, not the numbers", (
            Panel("latency_p50_us", "microseconds", "p50 of one new connection (paced)"),
            Panel("conn_per_s", "connections/s", "closed loop, 4 in flight"),
            Panel("programmed_s", "seconds", "start to programmed (Python start-up included)"),
        )),
    ),
    metrics={
        "latency_p50_us": "p50 latency of one new TCP connection, us, paced (guest, TCG)",
        "latency_p99_us": "p99 latency, us, paced (guest, TCG)",
        "conn_per_s": "new connections per second, closed loop, 4 in flight (guest, TCG)",
        "programmed_s": "from the proxy's start to all frontends programmed, s (guest, TCG)",
        "lab_cpu_us_per_conn": "lab CPU per connection (client + servers + ksoftirqd), us (guest, TCG)",
    },
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guest", description="the guest side of the guest part")
    ap.add_argument("--inside", type=Path, required=True, help="the ctl share (params.json, kubeconfig)")
    args = ap.parse_args(argv)
    with contextlib.suppress(BrokenPipeError):
        return inside(args.inside)
    return 1


if __name__ == "__main__":
    sys.exit(main())
