"""The socket path's cost per new connection: what the bpf socket hooks add to a node process's connect() to a
ClusterIP, with 1 to 10,000 Services (10 endpoints each) loaded.

The hooks run inside the caller's system call, so there is no packet to test-run: the figure is the kernel's own
accounting of each program (`kernel.bpf_stats_enabled`: run time and run count per program, read from
bpf_prog_info), over some 20,000 connect() calls, each to a ClusterIP chosen at random over every loaded
Service (a cold spread of hash buckets, as packet.py's new flows). Per connection: cgroup/connect4 (the
choice, the socket map's entry for getpeername) plus cgroup/sock_release where the object has it (the entry
and the least-connection count taken back at close). The wall time of a whole non-blocking connect() and
close() in the client beside it is the same path with the kernel's TCP set-up and the Python loop around it:
useful for proportions only.

Set-up: the maps are filled through render() -> Maps.run as packet.py's (its desired_state: the same Services);
the programs are attached (BPF links) to a fresh cgroup; the client is a process in that cgroup and in a scratch
network namespace, which the object is told is the node's (the hooks translate the node's calls), whose route
to every endpoint is a veth: each connect() sends one SYN that nothing answers, and close() ends it. The
module imports nothing the earlier layouts lack, so the same file measures an older checkout beside this one
(copy bench/ into its worktree and run it there: side by side means the same machine in the same hour).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from labkit.netns import scratch_node

from bench import core, packet
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from pyproxy.dataplane.bpf import libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi

CONNECT4, RELEASE = "pyproxy_connect4", "pyproxy_release"
ATTACH = {CONNECT4: 10, RELEASE: 34}
"""BPF_CGROUP_INET4_CONNECT and BPF_CGROUP_INET_SOCK_RELEASE (uapi/linux/bpf.h)."""
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")
SO_NETNS_COOKIE = 71
CLIENT = r"""
import json, socket, sys, time
targets = json.load(sys.stdin)
t0 = time.perf_counter_ns()
for ip, port in targets:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    s.connect_ex((ip, port))
    s.close()
print(json.dumps({"connections": len(targets), "ns": time.perf_counter_ns() - t0}))
"""
"""The client: one non-blocking TCP connect() and close() per target, timed as a whole."""


class _ProgStats(ctypes.Structure):
    """struct bpf_prog_info up to run_cnt (uapi/linux/bpf.h, natural alignment)."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
                ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16),
                ("ifindex", ctypes.c_uint32), ("gpl_compatible", ctypes.c_uint32), ("netns_dev", ctypes.c_uint64),
                ("netns_ino", ctypes.c_uint64), ("nr_jited_ksyms", ctypes.c_uint32),
                ("nr_jited_func_lens", ctypes.c_uint32), ("jited_ksyms", ctypes.c_uint64),
                ("jited_func_lens", ctypes.c_uint64), ("btf_id", ctypes.c_uint32),
                ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
                ("nr_func_info", ctypes.c_uint32), ("nr_line_info", ctypes.c_uint32), ("line_info", ctypes.c_uint64),
                ("jited_line_info", ctypes.c_uint64), ("nr_jited_line_info", ctypes.c_uint32),
                ("line_info_rec_size", ctypes.c_uint32), ("jited_line_info_rec_size", ctypes.c_uint32),
                ("nr_prog_tags", ctypes.c_uint32), ("prog_tags", ctypes.c_uint64), ("run_time_ns", ctypes.c_uint64),
                ("run_cnt", ctypes.c_uint64)]


def prog_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program, as the kernel counts them while bpf_stats_enabled is 1."""
    info = _ProgStats()
    size = ffi.new("uint32_t *", ctypes.sizeof(info))
    libbpf.check(libbpf.lib().bpf_obj_get_info_by_fd(fd, ffi.cast("void *", ctypes.addressof(info)), size),
                 "bpf_obj_get_info_by_fd")
    return int(info.run_time_ns), int(info.run_cnt)


@contextlib.contextmanager
def bpf_stats() -> Iterator[None]:
    old = STATS_SYSCTL.read_text().strip()
    STATS_SYSCTL.write_text("1")
    try:
        yield
    finally:
        STATS_SYSCTL.write_text(old)


def cgroup2_mount() -> Path:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified in the hybrid layout)."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    raise FileNotFoundError("no cgroup v2 hierarchy is mounted")


@contextlib.contextmanager
def attached(progs: Mapping[str, int]) -> Iterator[Path]:
    """A fresh cgroup with `progs` (name -> fd) attached through BPF links, removed on exit."""
    cgroup = cgroup2_mount() / f"pyproxy-bench-sock-{os.getpid()}-{random.randrange(1 << 24):06x}"
    cgroup.mkdir()
    links: list[int] = []
    try:
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name, prog in progs.items():
                link = libbpf.lib().bpf_link_create(prog, fd, ATTACH[name], ffi.NULL)
                libbpf.check(link, f"attaching {name} to {cgroup}")
                links.append(link)
        finally:
            os.close(fd)
        yield cgroup
    finally:
        for link in links:
            os.close(link)
        cgroup.rmdir()


def netns_cookie(netns: str) -> int:
    """The network namespace cookie of `netns` (what the hooks compare with the node's)."""
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                          f"import socket; s = socket.socket(); print(int.from_bytes("
                          f"s.getsockopt(socket.SOL_SOCKET, {SO_NETNS_COOKIE}, 8), 'little'))"],
                         capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout)


def connect_round(netns: str, cgroup: Path, targets: list[tuple[str, int]]) -> dict[str, int]:
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", CLIENT], input=json.dumps(targets),
                         capture_output=True, text=True, check=True, timeout=300, preexec_fn=join)
    result: dict[str, int] = json.loads(out.stdout)
    return result


def measure_size(n: int, p: Mapping[str, Any], rec: Recorder, netns: str, cookie: int) -> None:
    rec.step(f"{n:,} Services")
    kwargs: dict[str, Any] = {"host_netns": cookie} if "host_netns" in inspect.signature(loader.load).parameters else {}
    obj = loader.load(packet.PYPROXY_OBJECT, None, packet.map_sizes(n), **kwargs)
    dp = packet.Loaded(obj, packet.Maps({name: os.dup(fd) for name, fd in obj.maps.items()}))
    try:
        filled = packet.populate(dp, n)
        rec.log(f"{n:,} Services: {filled['ops']:,} map operations in {filled['write_s']:.1f}s")
        progs = {name: obj.progs[name] for name in ATTACH if name in obj.progs}
        rng = random.Random(n)
        # Not the last Service: one of its backends is its own ClusterIP (packet.py's pinned flow), unroutable here.
        services = max(1, n - 1)
        per: dict[str, list[float]] = {name: [] for name in progs}
        wall: list[float] = []
        with attached(progs) as cgroup, bpf_stats():
            connect_round(netns, cgroup, [(core.vip(0), core.PORT)] * 200)  # warm the interpreter and the path
            for _ in range(p["rounds"]):
                targets = [(core.vip(rng.randrange(services)), core.PORT) for _ in range(p["connections"])]
                before = {name: prog_stats(fd) for name, fd in progs.items()}
                got = connect_round(netns, cgroup, targets)
                for name, fd in progs.items():
                    t, c = (a - b for a, b in zip(prog_stats(fd), before[name], strict=True))
                    if c < len(targets):
                        raise RuntimeError(f"{name} ran {c} times for {len(targets)} connections")
                    per[name].append(t / c)
                wall.append(got["ns"] / got["connections"])
        total = [sum(vals) for vals in zip(*per.values(), strict=True)]
        rec.add(Measurement("sock_ns_per_connection", "socket hooks, per connection (all programs)", "bpf", n,
                            statistics.median(total), "ns", " + ".join(progs), {"rounds": total}))
        for name, vals in per.items():
            rec.add(Measurement("sock_ns_per_connection", f"cgroup program {name}", "bpf", n,
                                statistics.median(vals), "ns", "", {"rounds": vals}))
        rec.add(Measurement("sock_us_per_connect", "connect() + close(), non-blocking, in the client", "bpf", n,
                            statistics.median(wall) / 1000, "us", "", {"rounds": wall}))
    finally:
        dp.close()


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"services": [1, 1000, 10000], "connections": 5000, "rounds": 3}
    return {"services": [1, 1000, 10000], "connections": 20000, "rounds": 5}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    if os.geteuid() != 0:
        raise PermissionError("loading BPF, cgroups and network namespaces need root")
    if not packet.PYPROXY_OBJECT.exists():
        raise FileNotFoundError(f"{packet.PYPROXY_OBJECT} missing: run `make bpf`")
    rec.note("Per connection, as the kernel accounts each program (bpf_stats_enabled): a node process's "
             "non-blocking connect() to a ClusterIP drawn at random over every loaded Service, then close(); "
             "the hooks on a cgroup of their own, the client in it (its network namespace the node's).")
    with scratch_node("benchsock", [("sk-node2", f"{packet.SNAT_ADDR}/24")],
                      [(packet.ENDPOINT_NET, packet.NEXT_HOP, "sk-node2")]) as (thread, _):
        cookie = netns_cookie(thread.netns)
        for n in p["services"]:
            if deadline.expired():
                rec.log(f"out of time before {n:,} Services")
                break
            measure_size(int(n), p, rec, thread.netns, cookie)


PART = Part(
    name="sockpath",
    title="The socket path's cost per new connection (bpf socket hooks)",
    budget_s={True: 90.0, False: 300.0},
    params=params,
    run=run,
    figures=(Figure("sock_ns_per_connection", "bpf socket hooks: ns per connection vs Services", (
        Panel("sock_ns_per_connection", "ns per connection (median of rounds)",
              "a node process's connect() to a ClusterIP, and its close()"),)),),
    metrics={
        "sock_ns_per_connection": "ns per connection in the socket hooks (kernel's program accounting)",
        "sock_us_per_connect": "us per non-blocking connect() and close() in the client (Python loop included)",
    },
)
