"""Per-packet cost of each scheduler (bpf/include/pyproxy/sched.h): BPF_PROG_TEST_RUN of the TC ingress program
on new flows to a Service programmed with that scheduler, and on its established flow, with the measured Services
alone and among 100,000. bench/packet.py's method (read its docstring): new flows one run per bpf(2) call beside
the floor measured the same way, established flows repeat N on a flow pinned to a backend equal to its own
ClusterIP:port, the datapath's counters verifying every run.

The per-endpoint counters (--bpf-endpoint-counters) are measured the same way: a second copy of the programs,
loaded with them on, shares the maps of the first (which are programmed with the counters' entries, as pyproxy
does with them on) and runs the random Service's new flows and established flow interleaved with the others, as
the series COUNTED. The first copy, loaded with them off, has no code for them at all (the verifier folds the
constant), so random beside COUNTED is what turning them on costs.

One Service per scheduler, all programmed at once, so the new flows of every scheduler are interleaved in chunks:
measured one scheduler after the other (reprogramming one Service), a shared machine's load changing in between
moved the schedulers' figures by 20-40 % against each other, more than the differences measured. The smallest
size is therefore those 9 Services, not 1; the lookups of a hash map with 9 entries cost what they cost with 1.

Each measured Service has 10 backends, itself among them; wrr, sed and nq get weights 1, 2, 3 over them (wrr with
equal weights is programmed as rr). lc, sed and nq compare all 10 on every new flow (PYPROXY_LEAST_SCAN is 256).
The other Services are random: a Maglev table (16,381 entries, 128 KB) for each of 100,000 Services would be
13 GB of tables.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
from collections.abc import Mapping
from typing import Any

from bench import core
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from bench.packet import (
    CLIENTS,
    PYPROXY_OBJECT,
    TC_ACT_OK,
    TCP,
    TCP_ACK,
    VERDICT_OBJECT,
    VERDICT_PROG,
    Flow,
    Loaded,
    TestRun,
    _delta,
    _expect,
    ct_key,
    frame,
    summary,
)
from pyproxy.dataplane.bpf import abi, loader
from pyproxy.dataplane.bpf.render import Applied, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

_BACKEND = struct.Struct("!4sHxx")  # struct pyproxy_backend: the endpoint counters' key
SCHEDULERS = tuple(abi.SCHED)
COUNTED = "random, endpoint counters on"
"""The random Service through the programs loaded with --bpf-endpoint-counters."""
WEIGHTED = frozenset({"wrr", "sed", "nq"})
FLOOR = "XDP verdict only (floor)"
MOVES = 40
"""Frontend addresses tried for a scheduler whose choice the flow cannot change (dh hashes the frontend's
address): each is a fresh chance that the choice is the self backend."""


def measured(sched: str, at: int) -> ServicePortState:
    """The Service measured with `sched`, at ClusterIP core.vip(at): 9 endpoints and itself."""
    vip = core.vip(at)
    backends = tuple(sorted([Backend(core.endpoint(at * core.ENDPOINTS + j), core.BACKEND_PORT)
                             for j in range(core.ENDPOINTS - 1)] + [Backend(vip, core.PORT)]))
    weights = tuple(sorted((b.ip, 1 + k % 3) for k, b in enumerate(backends))) if sched in WEIGHTED else ()
    name = f"bench/sched-{sched}"
    return ServicePortState(name, "", Frontend(vip, core.PORT, Protocol.TCP), backends, backends,
                            scheduler=sched, weights=weights)


def others(count: int) -> dict[str, tuple[ServicePortState, ...]]:
    out: dict[str, tuple[ServicePortState, ...]] = {}
    for i in range(count):
        backends = tuple(Backend(core.endpoint(i * core.ENDPOINTS + j), core.BACKEND_PORT)
                         for j in range(core.ENDPOINTS))
        out[f"bench/svc-{i}"] = (ServicePortState(f"bench/svc-{i}", "", Frontend(core.vip(i), core.PORT, Protocol.TCP),
                                                  backends, backends),)
    return out


class Node:
    """A fresh copy of the programs with n Services: n - len(SCHEDULERS) random ones and one per scheduler."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.dp = Loaded.load(PYPROXY_OBJECT)
        self.capacity = {name: loader.map_info(fd).max_entries for name, fd in self.dp.obj.maps.items()}
        self.applied = Applied()
        self.clients = 0

    def program(self, desired: Mapping[str, tuple[ServicePortState, ...]]) -> int:
        plan = render(self.applied, desired, self.capacity, endpoint_counters=True)
        for op in plan.ops:
            self.dp.maps.run(op)
        self.applied.commit(plan)
        return len(plan.ops)

    def flow(self, vip: str) -> Flow:
        self.clients += 1
        c = self.clients
        return Flow(str(CLIENTS + c), vip, 1024 + c % 60000, core.PORT, TCP)

    def pin(self, vip: str, tries: int) -> Flow | None:
        """A flow to `vip` the scheduler sent to the self backend (sent through TC), or None in `tries` flows."""
        tc = self.dp.obj.progs[abi.PROG_TC_INGRESS]
        want = (abi.be32(vip), abi.be16(core.PORT))
        for _ in range(tries):
            flow = self.flow(vip)
            TestRun(tc, frame(flow))(1)
            v = self.dp.maps.ct.get(ct_key(flow, abi.CT_FORWARD))
            if v is not None and (v.nat_addr, v.nat_port) == want:
                return flow
        return None

    def close(self) -> None:
        self.dp.close()


def pinned(node: Node, k: int, sched: str) -> Flow:
    """A flow of the Service measured with `sched` (the k-th of SCHEDULERS) established to its self backend; the
    Service moves to another address (one of MOVES of its own) when its flows cannot reach it there."""
    first = node.n - len(SCHEDULERS) + k
    for at in [first, *range(node.n + k * MOVES, node.n + (k + 1) * MOVES - 1)]:
        if at != first:
            node.program({f"bench/sched-{sched}": (measured(sched, at),)})
        flow = node.pin(core.vip(at), 3 * core.ENDPOINTS)
        if flow is not None:
            return flow
    raise RuntimeError(f"{sched}: no flow picked the self backend at {MOVES} frontend addresses")


def endpoint_packets(node: Node, sched: str) -> int:
    """The packets the endpoint counters map holds for the endpoints of the Service measured with `sched`."""
    total = 0
    for fe in node.applied.frontends.values():
        if fe.service == f"bench/sched-{sched}":
            for b in fe.known:
                per_cpu = node.dp.maps.epstats.get(_BACKEND.pack(socket.inet_aton(b.ip), b.port))
                total += sum(v.packets for v in per_cpu or ())
    return total


def measure_size(n: int, p: Mapping[str, Any], rec: Recorder, verdict: loader.LoadedObject,
                 deadline: Deadline) -> None:
    rec.step(f"{core.plural(n, 'service')}: loading the object and filling the maps through render() -> Maps.run")
    node = Node(n)
    counted = loader.LoadedObject(None)
    try:
        first = n - len(SCHEDULERS)
        ops = node.program({**others(first), **{f"bench/sched-{s}": (measured(s, first + k),)
                                                for k, s in enumerate(SCHEDULERS)}})
        rec.log(f"{ops:,} ops")
        tc = node.dp.obj.progs[abi.PROG_TC_INGRESS]
        flows = {s: pinned(node, k, s) for k, s in enumerate(SCHEDULERS)}
        est_runs = {s: TestRun(tc, frame(f, tcp_flags=TCP_ACK)) for s, f in flows.items()}
        counted = loader.load(PYPROXY_OBJECT, None, adopt=node.dp.obj.maps, endpoint_counters=True)
        counted_tc = counted.progs[abi.PROG_TC_INGRESS]
        est_runs[COUNTED] = TestRun(counted_tc, frame(flows["random"], tcp_flags=TCP_ACK))
        series = (*SCHEDULERS, COUNTED)
        floor = TestRun(verdict.progs[VERDICT_PROG], frame(flows["random"], tcp_flags=TCP_ACK))
        repeat, rounds, singles = int(p["repeat"]), int(p["rounds"]), int(p["single_runs"])
        new: dict[str, list[float]] = {s: [] for s in series}
        est: dict[str, list[float]] = {s: [] for s in series}
        est_rep: dict[str, list[float]] = {s: [] for s in series}
        floors: list[float] = []
        floor_rep: list[float] = []
        rec.step(f"{core.plural(n, 'service')}: {rounds} rounds of repeat={repeat:,} on each established flow")
        before = node.dp.counters()
        counted_before = endpoint_packets(node, "random")
        for run in (floor, *est_runs.values()):
            run(repeat)  # not recorded: warms caches and the CPU's clock, as bench/packet.py's first round
        for _ in range(rounds):
            floor_rep.append(float(floor(repeat)[1]))
            for s, run in est_runs.items():
                retval, ns = run(repeat)
                if retval != TC_ACT_OK:
                    raise RuntimeError(f"{s}: established verdict {retval}")
                est_rep[s].append(float(ns))
        rec.step(f"{core.plural(n, 'service')}: {singles:,} single runs each of new flows and the established flow "
                 "per scheduler, and the floor")
        frames = {s: [frame(node.flow(flows[s if s in flows else "random"].dst)) for _ in range(singles)]
                  for s in series}
        progs = {s: counted_tc if s == COUNTED else tc for s in series}
        chunk = 250
        for c, start in enumerate(range(0, singles, chunk)):
            size = min(chunk, singles - start)
            floors.extend(float(floor(1)[1]) for _ in range(size))
            # Each chunk starts at another series, so none always follows the floor or the lookups of another.
            for s in series[c % len(series):] + series[:c % len(series)]:
                new[s].extend(float(TestRun(progs[s], data)(1)[1]) for data in frames[s][start:start + chunk])
                est[s].extend(float(est_runs[s](1)[1]) for _ in range(size))
            if deadline.expired():
                raise RuntimeError("out of time")
        per = len(series)
        _expect(f"{core.plural(n, 'service')}", _delta(before, node.dp.counters()),
                {"new_flow": per * singles, "established": per * ((rounds + 1) * repeat + singles)})
        # Only the copy with the counters on counted per endpoint: every one of its packets, none of the others'.
        _expect("endpoint counters", {"packets": endpoint_packets(node, "random") - counted_before},
                {"packets": singles + (rounds + 1) * repeat + singles})
        record(rec, n, new, est, est_rep, floors, floor_rep)
    finally:
        counted.close()
        node.close()


def record(rec: Recorder, n: int, new: Mapping[str, list[float]], est: Mapping[str, list[float]],
           est_rep: Mapping[str, list[float]], floors: list[float], floor_rep: list[float]) -> None:
    floor = statistics.median(floors)
    rec.add(Measurement("sched_new", FLOOR, "floor", n, floor, "ns", detail=summary(floors)))
    rec.add(Measurement("sched_est_single", FLOOR, "floor", n, floor, "ns", detail=summary(floors)))
    rec.add(Measurement("sched_est", FLOOR, "floor", n, statistics.median(floor_rep), "ns", detail=summary(floor_rep)))
    random_new = statistics.median(new["random"])
    for sched in new:
        value = statistics.median(new[sched])
        rec.add(Measurement("sched_new", sched, "bpf", n, value, "ns", f"+{value - floor:.0f} ns over the floor",
                            summary(new[sched])))
        alone = 100 * ((value - floor) / (random_new - floor) - 1)
        rec.add(Measurement("sched_new_vs_random", sched, "bpf", n, 100 * (value / random_new - 1), "%",
                            f"program alone (less the floor): {alone:+.1f} %"))
        value = statistics.median(est[sched])
        rec.add(Measurement("sched_est_single", sched, "bpf", n, value, "ns", f"+{value - floor:.0f} ns over the floor",
                            summary(est[sched])))
        value = statistics.median(est_rep[sched])
        rec.add(Measurement("sched_est", sched, "bpf", n, value, "ns", detail=summary(est_rep[sched])))


def params(quick: bool) -> dict[str, Any]:
    # The smallest size is the measured Services alone, one per scheduler.
    if quick:
        return {"services": [len(SCHEDULERS), 10000], "repeat": 200_000, "rounds": 2, "single_runs": 1500}
    return {"services": [len(SCHEDULERS), 100000], "repeat": 1_000_000, "rounds": 5, "single_runs": 10000}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    if os.geteuid() != 0:
        raise PermissionError("BPF_PROG_TEST_RUN and map creation need root")
    for path in (PYPROXY_OBJECT, VERDICT_OBJECT):
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: run `make bpf bench-tools`")
    rec.note(f"TC ingress; one Service per scheduler ({len(SCHEDULERS)}), 10 backends each, itself among them; "
             "wrr, sed, nq weighted 1, 2, 3; lc, sed, nq compare all 10 backends per new flow. The smallest size "
             "is those Services alone; at 100,000 the other 99,991 are random: a Maglev table (16,381 entries, "
             "128 KB) for each of 100,000 Services would be 13 GB of tables. New "
             "flow: one run per bpf(2) call, distinct flows, the schedulers interleaved in chunks beside the floor "
             "measured the same way; established: the flow pinned to the self backend, repeat N (as "
             "bench/packet.py's) and single runs. Counters verified. \"random, endpoint counters on\": the random "
             "Service through a second copy of the programs loaded with --bpf-endpoint-counters, on the same maps, "
             "interleaved with the others.")
    verdict = loader.load(VERDICT_OBJECT, None)
    try:
        for n in p["services"]:
            measure_size(int(n), p, rec, verdict, deadline)
    finally:
        verdict.close()


PART = Part(
    name="sched",
    title="Per-packet cost of each scheduler (BPF_PROG_TEST_RUN, TC ingress)",
    budget_s={True: 90.0, False: 360.0},
    params=params,
    run=run,
    figures=(
        Figure("sched", "Schedulers: TC ns per packet, one Service with 10 backends per scheduler", (
            Panel("sched_new", "ns per packet (median)", "new flow, one run per call"),
            Panel("sched_new_vs_random", "% over random", "new flow vs random's"),
            Panel("sched_est", "ns per packet (median)", "established flow, repeat N"),
        )),
    ),
    metrics={
        "sched_new": "TC new flow to the Service with that scheduler, ns per packet, one run per call (median)",
        "sched_new_vs_random": "new flow, % more ns per packet than random's at the same size",
        "sched_est": "TC established flow, ns per packet, repeat N (median of rounds)",
        "sched_est_single": "TC established flow, ns per packet, one run per call (median)",
    },
)
