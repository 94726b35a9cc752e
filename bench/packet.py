"""Per-packet cost in the kernel: BPF_PROG_TEST_RUN on pyproxy's XDP and TC ingress programs, beside the
verdict-only XDP program (bench/build/verdict.bpf.o), the machine's floor, with 1 to 100,000 Services loaded.

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
- IPv6: every Service is dual-stack (an IPv6 ClusterIP and 10 IPv6 backends beside the IPv4 ones, written by
  the same render()), and the measured one's IPv6 flow is pinned to its own IPv6 ClusterIP the same way. Its
  packets go in through the IPv4 entry points, as on a device, so the tail call to the IPv6 programs is in the
  figure; each IPv6 row's note gives its ratio to the IPv4 row of the same size.
- Caveat: one hot packet per run keeps the few hash buckets it touches in cache; real traffic to 100,000
  Services misses the cache more often. Spreading the new flows over every Service shows part of that.
"""

from __future__ import annotations

import contextlib
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

from labkit.netns import NetnsThread, scratch_node

from bench import core
from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi
from pyproxy.dataplane.bpf.mapset import Maps
from pyproxy.dataplane.bpf.render import Applied, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

sys.path.insert(0, str(core.REPO / "tests" / "priv"))
from packets import TCP, TCP_ACK, TCP_SYN, Flow, decode, frame, pseudo_header_sum  # noqa: E402 - the project's frame builder
from packets6 import frame6  # noqa: E402 - its IPv6 twin

PYPROXY_OBJECT = core.REPO / "bpf" / "build" / "pyproxy.bpf.o"
VERDICT_OBJECT = core.REPO / "bench" / "build" / "verdict.bpf.o"
STEPS_OBJECT = core.REPO / "bench" / "build" / "steps.bpf.o"
VERDICT_PROG = "pyproxy_verdict"
XDP_PASS, TC_ACT_OK = 2, 0
CLIENT = "192.168.1.10"
NOT_A_SERVICE = "10.250.0.1"
CLIENTS = ipaddress.IPv4Address("172.16.0.0")  # new flows: one client address each
CLIENT6 = "fd00:c::10"
# The NodePort: served on the node's address NODE_ADDR; the endpoints are reached through another device whose
# address, SNAT_ADDR, is what the node's routing picks as the source toward them (see nodeport_netns).
NODE_ADDR, NODE_PORT = "10.200.0.1", 30000
SNAT_ADDR, NEXT_HOP = "10.198.0.1", "10.198.0.2"


class TestRun:
    """BPF_PROG_TEST_RUN of one program on one packet, buffers allocated once."""

    def __init__(self, prog_fd: int, data: bytes, ctx: bytes = b"") -> None:
        self.prog_fd = prog_fd
        self.data = data
        self._in = ffi.new("uint8_t[]", data)
        self._out = ffi.new("uint8_t[]", len(data) + 256)
        self.opts = ffi.new("struct bpf_test_run_opts *")
        self.opts.sz = ffi.sizeof("struct bpf_test_run_opts")
        self.opts.data_in = self._in
        self.opts.data_size_in = len(data)
        self.opts.data_out = self._out
        if ctx:
            self._ctx = ffi.new("uint8_t[]", ctx)
            self.opts.ctx_in = self._ctx
            self.opts.ctx_size_in = len(ctx)

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
    def load(cls, path: Path, max_entries: dict[str, int] | None = None) -> Loaded:
        obj = loader.load(path, None, max_entries)
        # Maps owns (closes) its fds, and so does the object: give Maps its own.
        return cls(obj, Maps({n: os.dup(fd) for n, fd in obj.maps.items()}))

    def close(self) -> None:
        self.maps.close()
        self.obj.close()

    def counters(self) -> dict[str, int]:
        return {name: sum(v.value for v in self.maps.counters.get(i)) for i, name in enumerate(abi.COUNTERS)}


def desired_state(n: int) -> dict[str, tuple[ServicePortState, ...]]:
    """n dual-stack Services with one TCP port and 10 ready backends each, per family. The last one, the
    measured Service, has itself (ClusterIP:80, IPv4 and IPv6) as one of its backends (see the module's
    docstring)."""
    out: dict[str, tuple[ServicePortState, ...]] = {}
    for i in range(n):
        name = f"bench/svc-{i}"
        out[name] = ()
        for family, vip, endpoint in (("", core.vip, core.endpoint), ("v6", core.vip6, core.endpoint6)):
            backends = [Backend(endpoint(i * core.ENDPOINTS + j), core.BACKEND_PORT) for j in range(core.ENDPOINTS)]
            if i == n - 1:
                backends[-1] = Backend(vip(i), core.PORT)
            ordered = tuple(sorted(backends))
            out[name] += (ServicePortState(name, family, Frontend(vip(i), core.PORT, Protocol.TCP), ordered, ordered),)
    # The measured Service is also a NodePort with externalTrafficPolicy Cluster (DNAT and SNAT), to its
    # 10 endpoints proper (its NodePort rows are single runs: no self backend needed).
    name = f"bench/svc-{n - 1}"
    real = tuple(sorted(Backend(core.endpoint((n - 1) * core.ENDPOINTS + j), core.BACKEND_PORT)
                        for j in range(core.ENDPOINTS)))
    out[name] += (ServicePortState(name, "", Frontend(NODE_ADDR, NODE_PORT, Protocol.TCP), real, real,
                                   kind=FrontendKind.NODE_PORT, external_backends=real, masquerade=True),)
    return out


def map_sizes(n: int) -> dict[str, int] | None:
    """Capacities for n dual-stack Services where the defaults (abi.h) are too small: both families' frontends
    count in the names map and the service ids (which index stats, cursors, tables), and render's capacity
    check counts them, and their backends, against the IPv4 maps too. None: the defaults hold them."""
    services = max(131072, 1 << (2 * n + 1).bit_length())  # and the NodePort
    backends = max(1048576, 1 << (2 * n * core.ENDPOINTS).bit_length())
    if (services, backends) == (131072, 1048576):
        return None
    return {**{m: services for m in (abi.MAP_SERVICES, abi.MAP_NAMES, abi.MAP_STATS, abi.MAP_CURSORS,
                                     abi.MAP_TABLES)},
            abi.MAP_BACKENDS: backends}


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


def ct6_key(flow: Flow, direction: int) -> abi.Ct6Key:
    return abi.Ct6Key(abi.in6(flow.src), abi.in6(flow.dst), abi.be16(flow.sport), abi.be16(flow.dport),
                      flow.proto, direction)


def pin_to_self(dp: Loaded, xdp: TestRun, flow: Flow, tries: int = 300) -> int:
    """Send the flow's packet until the datapath picked the Service itself as its backend; returns the
    number of packets it took. Either family: an IPv6 flow's entries are in the IPv6 flow map."""
    v6 = ":" in flow.dst
    ct, key, addr = (dp.maps.ct6, ct6_key, abi.in6) if v6 else (dp.maps.ct, ct_key, abi.be32)
    fwd = key(flow, abi.CT_FORWARD)
    want = (bytes(addr(flow.dst)), abi.be16(flow.dport)) if v6 else (addr(flow.dst), abi.be16(flow.dport))
    for attempt in range(1, tries + 1):
        xdp(1)
        v = ct.get(fwd)
        got = None if v is None else (bytes(v.nat_addr) if v6 else v.nat_addr, v.nat_port)
        if got == want:
            return attempt
        if v is not None:
            rev = (abi.Ct6Key if v6 else abi.CtKey)(v.nat_addr, addr(flow.src), v.nat_port, abi.be16(flow.sport),
                                                     flow.proto, abi.CT_REVERSE)
            ct.pop(rev, None)
            ct.pop(fwd, None)
    raise RuntimeError(f"the measured flow never picked its self backend in {tries} packets")


def xdp_leaves_to_tc(data: bytes) -> bool:
    """The frame's L4 checksum field equals its pseudo-header sum, which XDP cannot tell from a
    CHECKSUM_PARTIAL packet: the XDP program passes it untouched to TC (1 frame in 65,536)."""
    d = decode(data)
    return d.l4_csum == pseudo_header_sum(d.flow.src, d.flow.dst, d.flow.proto, d.l4_len)


def new_flow_frames(count: int, first_client: int, target: Callable[[], tuple[str, int]]) -> list[bytes]:
    """`count` SYNs of distinct flows (one client address each, from CLIENTS + first_client on), each to
    the frontend (address, port) `target()` picks; frames XDP would leave to TC are skipped, so every one is
    load balanced."""
    out: list[bytes] = []
    c = first_client
    while len(out) < count:
        addr, port = target()
        data = frame(Flow(str(CLIENTS + c), addr, 1024 + c % 60000, port, TCP))
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
    "xdp_est6": ("XDP established flow, IPv6", "bpf"),
    "tc_est6": ("TC established flow, IPv6", "bpf"),
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
    sizes = map_sizes(n)
    dp = Loaded.load(PYPROXY_OBJECT, sizes)
    steps = loader.LoadedObject(None)
    try:
        pop = populate(dp, n)
        rec.add(Measurement("populate_s", "render() + Maps.run, one bpf(2) call per key", "bpf", n,
                            pop["render_s"] + pop["write_s"], "s",
                            f"{pop['ops']:,} ops, {pop['us_per_op']:.1f} us/op"
                            + (f"; maps resized: {', '.join(f'{k} {v:,}' for k, v in sizes.items())}" if sizes else ""),
                            pop))
        progs = dp.obj.progs
        est_flow = Flow(CLIENT, core.vip(n - 1), 40000, core.PORT, TCP)
        est_pkt = frame(est_flow, tcp_flags=TCP_ACK)
        # The IPv6 twin: the measured Service's IPv6 frontend, in through the IPv4 entry points (their tail call
        # to the IPv6 programs included, as on a device).
        est_flow6 = Flow(CLIENT6, core.vip6(n - 1), 40000, core.PORT, TCP)
        est_pkt6 = frame6(est_flow6, tcp_flags=TCP_ACK)
        # Not a Service: a segment of some other connection, and a SYN to a port endpoints listen on, which also
        # looks for an old Service flow on its ports (bpf/include/pyproxy/ct.h, pyproxy_ct_untrack).
        miss_pkt = frame(Flow(CLIENT, NOT_A_SERVICE, 40001, core.PORT, TCP), tcp_flags=TCP_ACK)
        miss_syn_pkt = frame(Flow(CLIENT, NOT_A_SERVICE, 40001, core.BACKEND_PORT, TCP), tcp_flags=TCP_SYN)
        runs = {
            "floor": TestRun(verdict.progs[VERDICT_PROG], est_pkt),
            "xdp_est": TestRun(progs[abi.PROG_XDP], est_pkt),
            "tc_est": TestRun(progs[abi.PROG_TC_INGRESS], est_pkt),
            "xdp_est6": TestRun(progs[abi.PROG_XDP], est_pkt6),
            "tc_est6": TestRun(progs[abi.PROG_TC_INGRESS], est_pkt6),
            "xdp_miss": TestRun(progs[abi.PROG_XDP], miss_pkt),
            "tc_miss": TestRun(progs[abi.PROG_TC_INGRESS], miss_pkt),
            "xdp_miss_syn": TestRun(progs[abi.PROG_XDP], miss_syn_pkt),
            "tc_miss_syn": TestRun(progs[abi.PROG_TC_INGRESS], miss_syn_pkt),
        }
        steps = loader.load(STEPS_OBJECT, None, sizes, adopt=dp.obj.maps)
        runs.update((name, TestRun(steps.progs[name], est_pkt)) for name in STEPS if name in steps.progs)
        tries = pin_to_self(dp, runs["xdp_est"], est_flow)
        tries6 = pin_to_self(dp, runs["xdp_est6"], est_flow6)
        verdict_ok = {"floor": XDP_PASS, "xdp_est": XDP_PASS, "xdp_miss": XDP_PASS, "tc_est": TC_ACT_OK,
                      "xdp_est6": XDP_PASS, "tc_est6": TC_ACT_OK,
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
                want = {"established": repeat} if "_est" in key or key == "step6_decision" else {}
                _expect(f"{key} x{repeat}", got, want)
                if retval != verdict_ok[key]:
                    raise RuntimeError(f"{key}: verdict {retval}, expected {verdict_ok[key]}")
                per_round[key].append(float(ns))
        for key, pkt in (("xdp_est", est_pkt), ("xdp_est6", est_pkt6)):
            if runs[key].output() != pkt:
                raise RuntimeError(f"{key}: the self-DNAT was not idempotent: repeats would not see the same packet")
        floor = statistics.median(per_round["floor"])
        for key, values in per_round.items():
            if key not in SERIES_REPEAT:
                continue
            series, mode = SERIES_REPEAT[key]
            value = statistics.median(values)
            note = "" if key == "floor" else f"{value / floor:.1f}x floor"
            extra: dict[str, float] = {"pin_packets": tries6 if key.endswith("6") else tries}
            if key.endswith("_est6"):
                extra["ipv6_over_ipv4"] = value / statistics.median(per_round[key[:-1]])
                note += f", {extra['ipv6_over_ipv4']:.2f}x IPv4"
            rec.add(Measurement("ns_per_packet", series, mode, n, value, "ns", note,
                                {**summary(values), "repeat": repeat, **extra}))
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
        def any_service() -> tuple[str, int]:
            return core.vip(rng.randrange(n)), core.PORT

        def measured() -> tuple[str, int]:
            return core.vip(n - 1), core.PORT

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
            record_single(rec, n, series, mode, values, None if key == "floor" else floor1)

        rec.step(f"{core.plural(n, 'service')}: {singles:,} single runs each of the NodePort paths")
        with nodeport_netns() as (thread, ifindex):
            paths = thread.call(nodeport_samples, dp, singles, ifindex["np-client"], ifindex["np-node2"])
        for key, series in NODEPORT.items():
            if isinstance(paths, str):
                rec.add(Measurement("ns_per_packet_single", series, "bpf", n, None, "ns", paths))
            else:
                record_single(rec, n, series, "bpf", paths[key], floor1)
    finally:
        steps.close()
        dp.close()


def record_single(rec: Recorder, n: int, series: str, mode: str, values: list[float], floor: float | None) -> None:
    s = summary(values)
    note = "" if floor is None else f"{s['median'] / floor:.1f}x floor, +{s['median'] - floor:.0f} ns"
    rec.add(Measurement("ns_per_packet_single", series, mode, n, s["median"], "ns", note, s))


# ---------------------------------------------------------------------------------------------- NodePort paths

NP = "NodePort: "
NODEPORT = {
    "xdp_np_new": f"{NP}XDP new flow (DNAT, SNAT chosen)",
    "tc_np_new": f"{NP}TC new flow (DNAT, SNAT chosen)",
    "eg_np_new": f"{NP}TC egress, new flow (SNAT written)",
    "tc_np_est": f"{NP}TC established flow",
    "eg_np_est": f"{NP}TC egress, established flow (SNAT)",
    "tc_np_reply": f"{NP}TC reply to the node (reverse SNAT)",
    "eg_np_reply": f"{NP}TC egress, reply to the client (reverse DNAT)",
}
"""The NodePort rows of ns_per_packet_single: a NodePort with externalTrafficPolicy Cluster, the client outside
the cluster, so the node DNATs at ingress and SNATs at egress toward the endpoint (bpf/include/pyproxy/snat.h),
and the endpoint's replies are translated back at ingress (to the client) and egress (from the frontend)."""
ENDPOINT_NET = "10.128.0.0/12"
"""Every core.endpoint() of up to 100,000 Services x 10."""


def nodeport_netns() -> contextlib.AbstractContextManager[tuple[NetnsThread, dict[str, int]]]:
    """A thread inside a private network namespace set up as a node: NODE_ADDR on the client's device, SNAT_ADDR
    on node 2's with the route to every endpoint through it. A BPF test run's packet belongs to the calling
    thread's namespace, so the datapath's route lookup for SNAT (bpf_fib_lookup) sees this node, not the
    machine's own routing."""
    return scratch_node("benchpkt", [("np-client", f"{NODE_ADDR}/24"), ("np-node2", f"{SNAT_ADDR}/24")],
                        [(ENDPOINT_NET, NEXT_HOP, "np-node2")])


class Unserved(Exception):
    """The datapath does not translate a NodePort path as it should: the rows say why instead of a number."""


def translated(run: TestRun, want: Callable[[Flow], bool], what: str) -> Flow:
    """One run of `run`; the flow its output carries, which must satisfy `want`."""
    run(1)
    out = decode(run.output()).flow
    if not want(out):
        raise Unserved(f"{what}: the datapath left {out}")
    return out


def nodeport_samples(dp: Loaded, singles: int, client_dev: int, node2_dev: int) -> dict[str, list[float]] | str:
    """`singles` single runs of each NodePort path (NODEPORT), in this thread's network namespace (whose devices
    toward the client and node 2 are `client_dev` and `node2_dev`); or why
    there is no number: the NodePort is not in the services map, or a path does not translate as it should."""
    if dp.maps.services.get(abi.SvcKey(abi.be32(NODE_ADDR), abi.be16(NODE_PORT), TCP, 0)) is None:
        return "not served: the NodePort is not in the services map"
    progs = dp.obj.progs
    xdp, tc, egress = progs[abi.PROG_XDP], progs[abi.PROG_TC_INGRESS], progs[abi.PROG_TC_EGRESS]
    # The client's side and node 2's (the endpoints'): where packets arrive and leave in each direction.
    from_client, to_node2 = libbpf.skb_ctx(client_dev, client_dev), libbpf.skb_ctx(client_dev, node2_dev)
    from_node2, to_client = libbpf.skb_ctx(node2_dev, node2_dev), libbpf.skb_ctx(node2_dev, client_dev)
    out: dict[str, list[float]] = {k: [] for k in NODEPORT}
    try:
        # One established flow, followed through all four translations; its runs are repeated below.
        est = Flow("192.168.7.10", NODE_ADDR, 40000, NODE_PORT, TCP)
        syn = TestRun(tc, frame(est), from_client)
        dnat = translated(syn, lambda f: f.dst != NODE_ADDR and f.src == est.src, "ingress DNAT of a NodePort SYN")
        snat = translated(TestRun(egress, syn.output(), to_node2),
                          lambda f: f.src == SNAT_ADDR and f.dst == dnat.dst, "egress SNAT toward the endpoint")
        back = Flow(snat.dst, SNAT_ADDR, snat.dport, snat.sport, TCP)
        reply_in = TestRun(tc, frame(back, tcp_flags=TCP_SYN | TCP_ACK), from_node2)
        translated(reply_in, lambda f: (f.dst, f.dport) == (est.src, est.sport), "ingress reverse SNAT of the reply")
        reply_out = TestRun(egress, reply_in.output(), to_client)
        translated(reply_out, lambda f: (f.src, f.sport) == (NODE_ADDR, NODE_PORT), "egress reverse DNAT of the reply")
        runs = {"tc_np_est": TestRun(tc, frame(est, tcp_flags=TCP_ACK), from_client),
                "tc_np_reply": TestRun(tc, frame(back, tcp_flags=TCP_ACK), from_node2)}
        runs["tc_np_est"](1)
        runs["eg_np_est"] = TestRun(egress, runs["tc_np_est"].output(), to_node2)
        runs["tc_np_reply"](1)
        runs["eg_np_reply"] = TestRun(egress, runs["tc_np_reply"].output(), to_client)

        def nodeport() -> tuple[str, int]:
            return NODE_ADDR, NODE_PORT

        frames = {key: new_flow_frames(singles, (8 + k) * singles, nodeport)
                  for k, key in enumerate(("xdp_np_new", "tc_np_new"))}
        before = dp.counters()
        chunk = 250
        for start in range(0, singles, chunk):
            for data in frames["xdp_np_new"][start:start + chunk]:
                out["xdp_np_new"].append(float(TestRun(xdp, data)(1)[1]))
            for data in frames["tc_np_new"][start:start + chunk]:
                ingress = TestRun(tc, data, from_client)
                out["tc_np_new"].append(float(ingress(1)[1]))
                out["eg_np_new"].append(float(TestRun(egress, ingress.output(), to_node2)(1)[1]))
            for key, run in runs.items():
                out[key].extend(float(run(1)[1]) for _ in range(min(chunk, singles - start)))
        new = _delta(before, dp.counters()).get("new_flow", 0)
        if new != 2 * singles:
            raise Unserved(f"{2 * singles:,} new NodePort flows counted {new:,} new_flow")
        translated(runs["eg_np_est"], lambda f: f.src == SNAT_ADDR, "egress SNAT of the established flow")
        translated(runs["eg_np_reply"], lambda f: (f.src, f.sport, f.dst) == (NODE_ADDR, NODE_PORT, est.src),
                   "egress reverse DNAT of the established reply")
    except Unserved as e:
        return f"failed: {e}"
    return out


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
            Panel("ns_per_packet_single", "ns per packet (median)", "one run per call: new flows, established",
                  exclude=NP),
            Panel("ns_per_packet_single", "ns per packet (median)",
                  "NodePort, externalTrafficPolicy Cluster (DNAT + SNAT): one run per call", series=NP),
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
