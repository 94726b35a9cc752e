"""Per-packet cost in the kernel: BPF_PROG_TEST_RUN on pyproxy's XDP and TC ingress programs, beside the
verdict-only XDP program (bpf/build/verdict.bpf.o), the machine's floor, with 1 to 100,000 Services loaded.

The maps are filled through the real control-plane path: a desired state -> render() -> Maps.run(op), one
bpf(2) call per key, exactly what `pyproxy run` does (measured: about 5 us per map operation, 2.3 million
operations and about 25 s for 100,000 Services x 10 backends; fast enough, so no batched shortcut is used).
Each size gets a freshly loaded, unpinned copy of bpf/build/pyproxy.bpf.o.

Method, and why (BPF_PROG_TEST_RUN with a repeat count runs the program again and again on one buffer that
it does NOT reset between repeats):
- DNAT rewrites the destination in that buffer, so repeats 2..N of a naive run see a packet to the backend,
  which is no frontend: they measure the "not a service" path, not load balancing (checked: with 100,000
  repeats the counters show one new flow and nothing else). So:
- Established flow, repeat N: the measured Service has itself (its ClusterIP:port) among its 10 backends,
  and its flow is pinned to that backend through the datapath (a test packet creates the CT entry; entries
  that picked another backend are deleted and the packet resent). DNAT then rewrites the destination to the
  same address and port, which costs what any rewrite costs (same lookups, same checksum arithmetic), and
  every repeat is an established-flow hit; the counters verify exactly N "established" per run.
- New flow: one test run per bpf(2) call (repeat 1), over distinct flows (client address and port) spread
  uniformly over all loaded Services: the kernel copies a fresh packet for every call, and each is a CT
  miss that creates the flow (the counters verify one "new_flow" per call). A single run's reported
  duration includes the test harness' timer overhead (two clock reads, bottom-half disable/enable), so the
  floor and the established flow are measured the same way beside it, and new flows are compared with that
  floor; the difference to it is the program's own cost.
- Caveat: one hot packet per run keeps the few hash buckets it touches in cache; real traffic to 100,000
  Services misses the cache more often. Spreading the new flows over every Service shows part of that.
"""

from __future__ import annotations

import ipaddress
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import core
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.dataplane.bpf.backend import Maps
from pyproxy.dataplane.bpf.libbpf import ffi
from pyproxy.dataplane.bpf.render import Applied, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

sys.path.insert(0, str(core.REPO / "tests" / "priv"))
from packets import TCP, TCP_ACK, TCP_SYN, Flow, decode, frame, pseudo_header_sum  # noqa: E402 - the project's frame builder

PYPROXY_OBJECT = core.REPO / "bpf" / "build" / "pyproxy.bpf.o"
VERDICT_OBJECT = core.REPO / "bpf" / "build" / "verdict.bpf.o"
STEPS_OBJECT = core.REPO / "bench" / "build" / "steps.bpf.o"
VERDICT_PROG = "pyproxy_verdict"
XDP_PASS, TC_ACT_OK = 2, 0
CLIENT = "192.168.1.10"
NOT_A_SERVICE = "10.250.0.1"
CLIENTS = ipaddress.IPv4Address("172.16.0.0")  # new flows: one client address each


class TestRun:
    """BPF_PROG_TEST_RUN of one program on one packet, buffers allocated once."""

    def __init__(self, prog_fd: int, data: bytes) -> None:
        self.prog_fd = prog_fd
        self.data = data
        self._in = ffi.new("uint8_t[]", data)
        self._out = ffi.new("uint8_t[]", len(data) + 256)
        self.opts = ffi.new("struct bpf_test_run_opts *")
        self.opts.sz = ffi.sizeof("struct bpf_test_run_opts")
        self.opts.data_in = self._in
        self.opts.data_size_in = len(data)
        self.opts.data_out = self._out

    def __call__(self, repeat: int) -> tuple[int, int]:
        """(verdict, ns per run as the kernel measured it)."""
        self.opts.repeat = repeat
        self.opts.data_size_out = len(self._out)
        libbpf.check(libbpf.lib().bpf_prog_test_run_opts(self.prog_fd, self.opts), "BPF_PROG_TEST_RUN")
        return int(self.opts.retval), int(self.opts.duration)

    def output(self) -> bytes:
        """The frame as the program left it (without the metadata an XDP test run puts in front of it)."""
        out = bytes(ffi.buffer(self._out, self.opts.data_size_out))
        return out[len(out) - len(self.data) :]


@dataclass
class Loaded:
    obj: loader.LoadedObject
    maps: Maps

    @classmethod
    def load(cls, path: Path) -> Loaded:
        obj = loader.load(path, None)
        # Maps owns (closes) its fds, and so does the object: give Maps its own.
        return cls(obj, Maps({n: os.dup(fd) for n, fd in obj.maps.items()}))

    def close(self) -> None:
        self.maps.close()
        self.obj.close()

    def counters(self) -> dict[str, int]:
        return {name: sum(v.value for v in self.maps.counters.get(i)) for i, name in enumerate(abi.COUNTERS)}


def desired_state(n: int) -> dict[str, tuple[ServicePortState, ...]]:
    """n Services with one TCP port and 10 ready backends each. The last one, the measured Service, has
    itself (ClusterIP:80) as one of its backends (see the module's docstring)."""
    out: dict[str, tuple[ServicePortState, ...]] = {}
    for i in range(n):
        backends = [Backend(core.endpoint(i * core.ENDPOINTS + j), core.BACKEND_PORT) for j in range(core.ENDPOINTS)]
        if i == n - 1:
            backends[-1] = Backend(core.vip(i), core.PORT)
        ordered = tuple(sorted(backends))
        name = f"bench/svc-{i}"
        out[name] = (ServicePortState(name, "", Frontend(core.vip(i), core.PORT, Protocol.TCP), ordered, ordered),)
    return out


def populate(dp: Loaded, n: int) -> dict[str, float]:
    capacity = {name: loader.map_info(fd).max_entries for name, fd in dp.obj.maps.items()}
    t0 = time.perf_counter()
    desired = desired_state(n)
    t1 = time.perf_counter()
    plan = render(Applied(), desired, capacity)
    t2 = time.perf_counter()
    for op in plan.ops:
        dp.maps.run(op)
    t3 = time.perf_counter()
    return {"build_s": t1 - t0, "render_s": t2 - t1, "write_s": t3 - t2, "ops": len(plan.ops),
            "us_per_op": (t3 - t2) / max(1, len(plan.ops)) * 1e6}


def ct_key(flow: Flow, direction: int) -> abi.CtKey:
    return abi.CtKey(abi.be32(flow.src), abi.be32(flow.dst), abi.be16(flow.sport), abi.be16(flow.dport),
                     flow.proto, direction)


def pin_to_self(dp: Loaded, xdp: TestRun, flow: Flow, tries: int = 300) -> int:
    """Send the flow's packet until the datapath picked the Service itself as its backend; returns the
    number of packets it took."""
    fwd = ct_key(flow, abi.CT_FORWARD)
    want = (abi.be32(flow.dst), abi.be16(flow.dport))
    for attempt in range(1, tries + 1):
        xdp(1)
        v = dp.maps.ct.get(fwd)
        if v is not None and (v.nat_addr, v.nat_port) == want:
            return attempt
        if v is not None:
            rev = abi.CtKey(v.nat_addr, abi.be32(flow.src), v.nat_port, abi.be16(flow.sport), flow.proto,
                            abi.CT_REVERSE)
            dp.maps.ct.pop(rev, None)
            dp.maps.ct.pop(fwd, None)
    raise RuntimeError(f"the measured flow never picked its self backend in {tries} packets")


def xdp_leaves_to_tc(data: bytes) -> bool:
    """The frame's L4 checksum field equals its pseudo-header sum, which XDP cannot tell from a
    CHECKSUM_PARTIAL packet: the XDP program passes it untouched to TC (1 frame in 65,536)."""
    d = decode(data)
    return d.l4_csum == pseudo_header_sum(d.flow.src, d.flow.dst, d.flow.proto, d.l4_len)


def new_flow_frames(count: int, first_client: int, service: Callable[[], int]) -> list[bytes]:
    """`count` SYNs of distinct flows (one client address each, from CLIENTS + first_client on), each to
    the Service `service()` picks; frames XDP would leave to TC are skipped, so every one is load balanced."""
    out: list[bytes] = []
    c = first_client
    while len(out) < count:
        data = frame(Flow(str(CLIENTS + c), core.vip(service()), 1024 + c % 60000, core.PORT, TCP))
        c += 1
        if not xdp_leaves_to_tc(data):
            out.append(data)
    return out


def _delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _expect(what: str, got: Mapping[str, int], want: Mapping[str, int]) -> None:
    if dict(got) != dict(want):
        raise RuntimeError(f"{what}: datapath counters moved by {got}, expected {want}: the measurement would "
                           "not be what it claims")


def summary(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {"median": statistics.median(s), "mean": statistics.fmean(s), "min": s[0],
            "p99": core.percentile(s, 0.99), "max": s[-1], "n": len(s)}


SERIES_REPEAT = {  # key -> (series, mode)
    "floor": ("XDP verdict only (floor)", "floor"),
    "xdp_est": ("XDP established flow", "bpf"),
    "tc_est": ("TC established flow", "bpf"),
    "xdp_miss": ("XDP not a Service", "bpf"),
    "tc_miss": ("TC not a Service", "bpf"),
    "xdp_miss_syn": ("XDP not a Service, SYN to an endpoint port", "bpf"),
    "tc_miss_syn": ("TC not a Service, SYN to an endpoint port", "bpf"),
}
# The profile of the established XDP path: bench/steps.bpf.c's cumulative programs (each one step more than
# the one before), between the floor and the production program.
STEPS = {
    "floor": "0 verdict only (floor)",
    "step1_parse": "1 parse Ethernet/IPv4/TCP, checksum form",
    "step2_frontend": "2 + frontend lookup (hash)",
    "step3_clock": "3 + clock (jiffies), backends epoch (array)",
    "step4_flow": "4 + flow lookup (LRU hash)",
    "step5_backend": "5 + follow the flow (expiry, epoch compare)",
    "step6_decision": "6 + last_seen and state, two per-CPU counters",
    "xdp_est": "7 + rewrite, checksums (= XDP established flow)",
}
SERIES_SINGLE = {
    "floor": ("XDP verdict only (floor)", "floor"),
    "xdp_new": ("XDP new flow, any Service", "bpf"),
    "tc_new": ("TC new flow, any Service", "bpf"),
    "xdp_new_hot": ("XDP new flow, one Service", "bpf"),
    "tc_new_hot": ("TC new flow, one Service", "bpf"),
    "xdp_est": ("XDP established flow", "bpf"),
    "tc_est": ("TC established flow", "bpf"),
}


def measure_size(n: int, p: Mapping[str, Any], rec: Recorder, verdict: loader.LoadedObject) -> None:
    rec.step(f"{core.plural(n, 'service')}: loading the object and filling the maps through render() -> Maps.run")
    dp = Loaded.load(PYPROXY_OBJECT)
    steps = loader.LoadedObject(None)
    try:
        pop = populate(dp, n)
        rec.add(Measurement("populate_s", "render() + Maps.run, one bpf(2) call per key", "bpf", n,
                            pop["render_s"] + pop["write_s"], "s",
                            f"{pop['ops']:,} ops, {pop['us_per_op']:.1f} us/op", pop))
        progs = dp.obj.progs
        est_flow = Flow(CLIENT, core.vip(n - 1), 40000, core.PORT, TCP)
        est_pkt = frame(est_flow, tcp_flags=TCP_ACK)
        # Not a Service: a segment of some other connection, and a SYN to a port endpoints listen on, which also
        # looks for an old Service flow on its ports (bpf/include/pyproxy/ct.h, pyproxy_ct_untrack).
        miss_pkt = frame(Flow(CLIENT, NOT_A_SERVICE, 40001, core.PORT, TCP), tcp_flags=TCP_ACK)
        miss_syn_pkt = frame(Flow(CLIENT, NOT_A_SERVICE, 40001, core.BACKEND_PORT, TCP), tcp_flags=TCP_SYN)
        runs = {
            "floor": TestRun(verdict.progs[VERDICT_PROG], est_pkt),
            "xdp_est": TestRun(progs[abi.PROG_XDP], est_pkt),
            "tc_est": TestRun(progs[abi.PROG_TC_INGRESS], est_pkt),
            "xdp_miss": TestRun(progs[abi.PROG_XDP], miss_pkt),
            "tc_miss": TestRun(progs[abi.PROG_TC_INGRESS], miss_pkt),
            "xdp_miss_syn": TestRun(progs[abi.PROG_XDP], miss_syn_pkt),
            "tc_miss_syn": TestRun(progs[abi.PROG_TC_INGRESS], miss_syn_pkt),
        }
        steps = loader.load(STEPS_OBJECT, None, adopt=dp.obj.maps)
        runs.update((name, TestRun(steps.progs[name], est_pkt)) for name in STEPS if name in steps.progs)
        tries = pin_to_self(dp, runs["xdp_est"], est_flow)
        verdict_ok = {"floor": XDP_PASS, "xdp_est": XDP_PASS, "xdp_miss": XDP_PASS, "tc_est": TC_ACT_OK,
                      "tc_miss": TC_ACT_OK, "xdp_miss_syn": XDP_PASS, "tc_miss_syn": TC_ACT_OK,
                      **{name: XDP_PASS for name in steps.progs}}

        rec.step(f"{core.plural(n, 'service')}: {p['rounds']} rounds of repeat={p['repeat']:,}")
        repeat = int(p["repeat"])
        per_round: dict[str, list[float]] = {k: [] for k in runs}
        # One round not recorded: the first size measured otherwise reads 10-20% high everywhere, the verdict-only
        # floor included (caches and the CPU's clock still warming up).
        for run in runs.values():
            run(repeat)
        for _ in range(int(p["rounds"])):
            for key, run in runs.items():
                before = dp.counters()
                retval, ns = run(repeat)
                got = _delta(before, dp.counters())
                want = {"established": repeat} if key.endswith("_est") or key == "step6_decision" else {}
                _expect(f"{key} x{repeat}", got, want)
                if retval != verdict_ok[key]:
                    raise RuntimeError(f"{key}: verdict {retval}, expected {verdict_ok[key]}")
                per_round[key].append(float(ns))
        if runs["xdp_est"].output() != est_pkt:
            raise RuntimeError("the self-DNAT was not idempotent: repeats would not see the same packet")
        floor = statistics.median(per_round["floor"])
        for key, values in per_round.items():
            if key not in SERIES_REPEAT:
                continue
            series, mode = SERIES_REPEAT[key]
            value = statistics.median(values)
            rec.add(Measurement("ns_per_packet", series, mode, n, value, "ns",
                                "" if key == "floor" else f"{value / floor:.1f}x floor",
                                {**summary(values), "repeat": repeat, "pin_packets": tries}))
        previous = None
        for key, series in STEPS.items():
            value = statistics.median(per_round[key])
            note = "" if previous is None else f"{value - previous:+.0f} ns"
            rec.add(Measurement("ns_per_packet_steps", series, "floor" if key == "floor" else "bpf", n, value, "ns",
                                note, summary(per_round[key])))
            previous = value

        singles = int(p["single_runs"])
        rec.step(f"{core.plural(n, 'service')}: {singles:,} single runs each of new flows, established flow and floor")
        rng = random.Random(n)
        # Every flow distinct (its own client address), to a Service drawn uniformly from all n ("any"), or
        # all to the measured one ("one": the Service's state stays in cache, as with a single Service).
        new_runs = {"xdp_new": abi.PROG_XDP, "tc_new": abi.PROG_TC_INGRESS, "xdp_new_hot": abi.PROG_XDP,
                    "tc_new_hot": abi.PROG_TC_INGRESS}
        def any_service() -> int:
            return rng.randrange(n)

        def measured() -> int:
            return n - 1

        new_frames = {key: new_flow_frames(singles, k * 2 * singles, measured if key.endswith("_hot") else any_service)
                      for k, key in enumerate(new_runs)}
        samples: dict[str, list[float]] = {k: [] for k in SERIES_SINGLE}
        before = dp.counters()
        chunk = 250
        for start in range(0, singles, chunk):
            for key in SERIES_SINGLE:
                if key in new_runs:
                    for data in new_frames[key][start:start + chunk]:
                        samples[key].append(float(TestRun(progs[new_runs[key]], data)(1)[1]))
                else:
                    run = runs[key]
                    samples[key].extend(float(run(1)[1]) for _ in range(min(chunk, singles - start)))
        _expect("single runs", _delta(before, dp.counters()), {"new_flow": len(new_runs) * singles,
                                                                           "established": 2 * singles})
        floor1 = statistics.median(samples["floor"])
        for key, values in samples.items():
            series, mode = SERIES_SINGLE[key]
            s = summary(values)
            note = "" if key == "floor" else f"{s['median'] / floor1:.1f}x floor, +{s['median'] - floor1:.0f} ns"
            rec.add(Measurement("ns_per_packet_single", series, mode, n, s["median"], "ns", note, s))
    finally:
        steps.close()
        dp.close()


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"services": [1, 1000, 10000], "repeat": 200_000, "rounds": 5, "single_runs": 2000}
    return {"services": [1, 1000, 10000, 100000], "repeat": 1_000_000, "rounds": 7, "single_runs": 10000}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    if os.geteuid() != 0:
        raise PermissionError("BPF_PROG_TEST_RUN and map creation need root")
    for path in (PYPROXY_OBJECT, VERDICT_OBJECT, STEPS_OBJECT):
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: run `make bpf bench-tools`")
    rec.note("Established flow: repeat N on one packet whose flow is pinned (through the datapath) to a "
             "backend equal to its own ClusterIP:port, so DNAT leaves the packet as it was and every repeat is "
             "a CT hit; counters verified. New flow: one run per bpf(2) call over distinct flows spread over "
             "all Services, compared with the floor measured the same way (a single run's time includes the "
             "test harness' timer overhead). Maps filled through render() -> Maps.run, one syscall per key.")
    verdict = loader.load(VERDICT_OBJECT, None)
    try:
        for n in p["services"]:
            measure_size(int(n), p, rec, verdict)
    finally:
        verdict.close()


PART = Part(
    name="packet",
    title="Per-packet cost in the kernel (BPF_PROG_TEST_RUN)",
    budget_s={True: 60.0, False: 420.0},
    params=params,
    run=run,
    figures=(
        Figure("ns_per_packet", "BPF per-packet cost vs Services (BPF_PROG_TEST_RUN)", (
            Panel("ns_per_packet", "ns per packet", "repeat N on one packet: established flow, not a Service"),
            Panel("ns_per_packet_single", "ns per packet (median)", "one run per call: new flows, established"),
            Panel("ns_per_packet_steps", "ns per packet", "established XDP path, cumulative steps (profile)"),
        )),
    ),
    metrics={
        "ns_per_packet": "ns per packet, BPF_PROG_TEST_RUN repeat N (median of rounds)",
        "ns_per_packet_single": "ns per packet, one run per call (median): new flows vs established vs floor",
        "ns_per_packet_steps": "profile of the XDP established flow: cumulative steps (bench/steps.bpf.c), "
                               "ns per packet, repeat N, and what each step adds",
        "populate_s": "seconds to fill the maps through render() -> Maps.run (packet test setup)",
    },
)
