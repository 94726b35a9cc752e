"""Per-packet cost of each scheduler (bpf/include/pyproxy/sched.h): BPF_PROG_TEST_RUN of the TC ingress program
on new flows to one Service programmed with that scheduler, and on its established flow, at 1 and 100,000
Services. bench/packet.py's method (read its docstring): new flows one run per bpf(2) call beside the floor
measured the same way, established flows repeat N on a flow pinned to a backend equal to its own ClusterIP:port,
the datapath's counters verifying every run.

The measured Service has 10 backends, itself among them; wrr, sed and nq get weights 1, 2, 3 over them (wrr with
equal weights is programmed as rr). lc, sed and nq compare all 10 on every new flow (PYPROXY_LEAST_SCAN is 256).
The other Services are random: a Maglev table each at 100,000 Services would be 1.6 G entries, beyond
MAP_TABLES (1,048,576: 64 tables of 16,381).

One Service carries one scheduler at a time, so the schedulers are measured one after the other, the measured
Service reprogrammed through render() in between (one Service's delta). A pass takes every scheduler once; the
run makes several passes and pools them, so a drift of the machine's speed during the run spreads over all
schedulers instead of landing on whichever ran then. The floor is measured in the same chunks as each
scheduler's flows and the note beside each number gives its cost over that floor.
"""

from __future__ import annotations

import os
import statistics
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

SCHEDULERS = tuple(abi.SCHED)
WEIGHTED = frozenset({"wrr", "sed", "nq"})
FLOOR = "XDP verdict only (floor)"
MOVES = 40
"""Frontend addresses tried for a scheduler whose choice the flow cannot change (dh hashes the frontend's
address): each is a fresh chance that the choice is the self backend."""


def measured(n: int, sched: str, at: int) -> ServicePortState:
    """The measured Service (the last of n) at ClusterIP core.vip(at), with `sched`: 9 endpoints and itself."""
    vip = core.vip(at)
    backends = tuple(sorted([Backend(core.endpoint(at * core.ENDPOINTS + j), core.BACKEND_PORT)
                             for j in range(core.ENDPOINTS - 1)] + [Backend(vip, core.PORT)]))
    weights = tuple(sorted((b.ip, 1 + k % 3) for k, b in enumerate(backends))) if sched in WEIGHTED else ()
    name = f"bench/svc-{n - 1}"
    return ServicePortState(name, "", Frontend(vip, core.PORT, Protocol.TCP), backends, backends,
                            scheduler=sched, weights=weights)


def others(n: int) -> dict[str, tuple[ServicePortState, ...]]:
    out: dict[str, tuple[ServicePortState, ...]] = {}
    for i in range(n - 1):
        backends = tuple(Backend(core.endpoint(i * core.ENDPOINTS + j), core.BACKEND_PORT)
                         for j in range(core.ENDPOINTS))
        out[f"bench/svc-{i}"] = (ServicePortState(f"bench/svc-{i}", "", Frontend(core.vip(i), core.PORT, Protocol.TCP),
                                                  backends, backends),)
    return out


class Node:
    """A fresh copy of the programs with n Services, the last one reprogrammed at will."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.dp = Loaded.load(PYPROXY_OBJECT)
        self.capacity = {name: loader.map_info(fd).max_entries for name, fd in self.dp.obj.maps.items()}
        self.applied = Applied()
        self.clients = 0

    def program(self, desired: Mapping[str, tuple[ServicePortState, ...]]) -> int:
        plan = render(self.applied, desired, self.capacity)
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
            fwd = ct_key(flow, abi.CT_FORWARD)
            v = self.dp.maps.ct.get(fwd)
            if v is not None and (v.nat_addr, v.nat_port) == want:
                return flow
        return None

    def close(self) -> None:
        self.dp.close()


def schedule(node: Node, sched: str, at: dict[str, int]) -> Flow:
    """Program the measured Service with `sched` and pin an established flow to its self backend, moving the
    Service to another address (remembered in `at`) when its flows cannot reach it there."""
    start = at.get(sched, node.n - 1)
    for k in range(MOVES):
        here = start + k
        node.program({f"bench/svc-{node.n - 1}": (measured(node.n, sched, here),)})
        flow = node.pin(core.vip(here), 3 * core.ENDPOINTS)
        if flow is not None:
            at[sched] = here
            return flow
    raise RuntimeError(f"{sched}: no flow picked the self backend at {MOVES} frontend addresses")


def measure_size(n: int, p: Mapping[str, Any], rec: Recorder, verdict: loader.LoadedObject,
                 deadline: Deadline) -> None:
    rec.step(f"{core.plural(n, 'service')}: loading the object and filling the maps through render() -> Maps.run")
    node = Node(n)
    try:
        ops = node.program({**others(n), f"bench/svc-{n - 1}": (measured(n, "random", n - 1),)})
        rec.log(f"{ops:,} ops")
        tc = node.dp.obj.progs[abi.PROG_TC_INGRESS]
        repeat, rounds, passes = int(p["repeat"]), int(p["rounds"]), int(p["passes"])
        singles = int(p["single_runs"]) // passes
        new: dict[str, list[float]] = {s: [] for s in SCHEDULERS}
        est: dict[str, list[float]] = {s: [] for s in SCHEDULERS}
        est_rep: dict[str, list[float]] = {s: [] for s in SCHEDULERS}
        floors: dict[str, list[float]] = {s: [] for s in SCHEDULERS}
        floor_rep: list[float] = []
        at: dict[str, int] = {}
        for k in range(passes):
            for sched in SCHEDULERS:
                rec.step(f"{core.plural(n, 'service')}: pass {k + 1}/{passes}, {sched}")
                flow = schedule(node, sched, at)
                est_pkt = frame(flow, tcp_flags=TCP_ACK)
                est_run, floor = TestRun(tc, est_pkt), TestRun(verdict.progs[VERDICT_PROG], est_pkt)
                frames = [frame(node.flow(flow.dst)) for _ in range(singles)]
                est_run(repeat)  # not recorded: warms the caches after the reprogramming
                before = node.dp.counters()
                for _ in range(rounds):
                    floor_rep.append(float(floor(repeat)[1]))
                    retval, ns = est_run(repeat)
                    if retval != TC_ACT_OK:
                        raise RuntimeError(f"{sched}: established verdict {retval}")
                    est_rep[sched].append(float(ns))
                chunk = 250
                for start in range(0, singles, chunk):
                    part = frames[start:start + chunk]
                    floors[sched].extend(float(floor(1)[1]) for _ in part)
                    new[sched].extend(float(TestRun(tc, data)(1)[1]) for data in part)
                    est[sched].extend(float(est_run(1)[1]) for _ in part)
                _expect(f"{sched} at {n:,}", _delta(before, node.dp.counters()),
                        {"new_flow": singles, "established": rounds * repeat + singles})
                if deadline.expired():
                    raise RuntimeError("out of time")
        record(rec, n, new, est, est_rep, floors, floor_rep)
    finally:
        node.close()


def record(rec: Recorder, n: int, new: Mapping[str, list[float]], est: Mapping[str, list[float]],
           est_rep: Mapping[str, list[float]], floors: Mapping[str, list[float]], floor_rep: list[float]) -> None:
    all_floors = [v for values in floors.values() for v in values]
    floor1 = statistics.median(all_floors)
    rec.add(Measurement("sched_new", FLOOR, "floor", n, floor1, "ns", detail=summary(all_floors)))
    rec.add(Measurement("sched_est_single", FLOOR, "floor", n, floor1, "ns", detail=summary(all_floors)))
    rec.add(Measurement("sched_est", FLOOR, "floor", n, statistics.median(floor_rep), "ns", detail=summary(floor_rep)))
    random_new = statistics.median(new["random"]) - statistics.median(floors["random"])
    for sched in SCHEDULERS:
        own_floor = statistics.median(floors[sched])
        value = statistics.median(new[sched])
        rec.add(Measurement("sched_new", sched, "bpf", n, value, "ns", f"+{value - own_floor:.0f} ns over the floor",
                            {**summary(new[sched]), "floor": own_floor}))
        value = statistics.median(est[sched])
        rec.add(Measurement("sched_est_single", sched, "bpf", n, value, "ns", f"+{value - own_floor:.0f} ns",
                            {**summary(est[sched]), "floor": own_floor}))
        value = statistics.median(est_rep[sched])
        rec.add(Measurement("sched_est", sched, "bpf", n, value, "ns", detail=summary(est_rep[sched])))
        cost = statistics.median(new[sched]) - own_floor
        rec.add(Measurement("sched_new_vs_random", sched, "bpf", n, 100 * (cost / random_new - 1), "%",
                            f"{cost:.0f} ns over the floor vs random's {random_new:.0f}"))


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"services": [1, 10000], "repeat": 200_000, "rounds": 2, "single_runs": 1500, "passes": 1}
    return {"services": [1, 100000], "repeat": 1_000_000, "rounds": 3, "single_runs": 9000, "passes": 3}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    if os.geteuid() != 0:
        raise PermissionError("BPF_PROG_TEST_RUN and map creation need root")
    for path in (PYPROXY_OBJECT, VERDICT_OBJECT):
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: run `make bpf`")
    rec.note("TC ingress, one Service with 10 backends (itself among them) programmed with each scheduler in turn; "
             "wrr, sed, nq weighted 1, 2, 3; lc, sed, nq compare all 10 backends per new flow. At 100,000 "
             "Services the other 99,999 are random: a Maglev table (16,381 entries) for each would be 1.6 G "
             "entries, MAP_TABLES holds 1,048,576. New flow: one run per bpf(2) call, distinct flows, beside the "
             "floor measured the same way; established: the flow pinned to the self backend, repeat N (as "
             "bench/packet.py's) and single runs. Passes over all schedulers pooled; counters verified.")
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
            Panel("sched_new_vs_random", "% over random", "new flow's cost over the floor vs random's"),
            Panel("sched_est", "ns per packet (median)", "established flow, repeat N"),
        )),
    ),
    metrics={
        "sched_new": "TC new flow to the Service with that scheduler, ns per packet, one run per call (median)",
        "sched_new_vs_random": "new flow's cost over the floor, % more than random's at the same size",
        "sched_est": "TC established flow, ns per packet, repeat N (median of rounds)",
        "sched_est_single": "TC established flow, ns per packet, one run per call (median)",
    },
)
