"""`pyproxy inspect trace`: where a packet from SRC to DST:PORT/PROTO goes, decided from an inspection View alone
as each mode's datapath decides (bpf/include/pyproxy/lb.h and sched.h's hashes, the nftables table's verdict maps
and chains, the iptables mode's KUBE-* chains; IPVS's schedulers run in the kernel, so there the trace names the
candidates and the rule). The datapaths' emulation, so it lives beside them, not in the model; pure, so every case
is testable without root (tests/unit/test_inspect_trace.py; tests/e2e/test_inspect_trace_e2e.py against real
traffic)."""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace

from pyproxy.model.inspection import (
    ANY_NODE_ADDRESS,
    Affinity,
    Endpoint,
    Frontend,
    NewFlow,
    Trace,
    View,
    parse_flow,
)
from pyproxy.model.objects import family_of, join_host_port

_PROTO_NUMBER = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}


def _words(ip: str) -> list[int]:
    """An address as the datapath's u32 words hold it: its network-order bytes, four at a time, read in this host's
    order (IPv4's one word, struct pyproxy_in6's four)."""
    packed = ipaddress.ip_address(ip).packed
    return [int.from_bytes(packed[i:i + 4], sys.byteorder) for i in range(0, len(packed), 4)]


def _u32(ip: str) -> int:
    """An address as the schedulers hash it: IPv4's u32, an IPv6 address folded to 32 bits (parse6.h's
    pyproxy_in6_fold, the XOR of its words)."""
    out = 0
    for w in _words(ip):
        out ^= w
    return out


def _u16(port: int) -> int:
    return int(struct.unpack("=H", struct.pack("!H", port))[0])


def mix32(h: int) -> int:
    """sched.h's pyproxy_mix32 (murmur3's finalizer)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def flow_hash(saddr: str, daddr: str, sport: int, dport: int, proto: str) -> int:
    """sched.h's pyproxy_flow_hash, or for IPv6 lb6.h's pyproxy_lb6_flow_hash (every word of the source, the
    destination folded): what Maglev indexes its table with."""
    first, *rest = _words(saddr)
    h = mix32(first ^ 0x9E3779B9)
    for w in rest:
        h = mix32(h ^ w)
    h = mix32(h ^ _u32(daddr))
    h = mix32(h ^ ((_u16(sport) << 16) | _u16(dport)))
    return mix32(h ^ _PROTO_NUMBER[proto])


def _shares(entries: Iterable[str]) -> dict[str, float]:
    counts: dict[str, int] = {}
    for e in entries:
        counts[e] = counts.get(e, 0) + 1
    total = sum(counts.values())
    return {e: round(n / total, 4) for e, n in sorted(counts.items())}


def _least(fe: Frontend) -> tuple[list[Endpoint], str]:
    """The endpoints lc, sed or nq would choose among now (sched.h's pyproxy_pick_least)."""
    eps = fe.endpoints
    if fe.scheduler == "nq":
        idle = [e for e in eps if not e.active]
        if idle:
            return idle, "nq: an idle endpoint, whatever its weight"
    if fe.scheduler == "lc":
        loads = {e: (e.active or 0, 1) for e in eps}
        how = "lc: the fewest open flows"
    else:
        loads = {e: ((e.active or 0) + 1, e.weight) for e in eps}
        how = f"{fe.scheduler}: the least (open flows + 1) / weight"
    best = min(n / d for n, d in loads.values())
    return [e for e, (n, d) in loads.items() if n / d == best], how


def _scheduled(fe: Frontend, src: str, sport: int | None, dst: str, dport: int) -> NewFlow:
    eps = fe.endpoints
    if fe.rule:
        able = tuple(e for e in eps if e.weight > 0)
        if not able:
            return NewFlow("refused", f"{fe.scheduler}: every endpoint has weight 0 (no new flows)")
        weights = sum(e.weight for e in able) if fe.scheduler == "wrr" else len(able)
        shares = {str(e): round((e.weight if fe.scheduler == "wrr" else 1) / weights, 4) for e in able} \
            if fe.scheduler in ("rr", "wrr") else {}
        return NewFlow("dnat", f"{fe.scheduler}: {fe.rule}", able, str(able[0]) if len(able) == 1 else None, shares)
    if len(eps) == 1:
        return NewFlow("dnat", f"{fe.scheduler}: its only endpoint", eps, str(eps[0]))
    sched = fe.scheduler
    n = len(eps)
    if sched == "sh":
        chosen = eps[mix32(_u32(src)) % n]
        return NewFlow("dnat", "sh: the hash of the source address", eps, str(chosen))
    if sched == "dh":
        chosen = eps[mix32(_u32(dst)) % n]
        return NewFlow("dnat", "dh: the hash of the destination address", eps, str(chosen))
    if sched == "maglev" and fe.table:
        if sport is not None:
            chosen_entry = fe.table[flow_hash(src, dst, sport, dport, fe.proto) % len(fe.table)]
            return NewFlow("dnat", f"maglev: the flow's hash in a table of {len(fe.table)}", eps, chosen_entry)
        return NewFlow("dnat", f"maglev: the flow's hash (its source port decides) in a table of {len(fe.table)}",
                       eps, shares=_shares(fe.table))
    if sched == "wrr" and fe.table:
        return NewFlow("dnat", f"wrr: the next turn of a round of {len(fe.table)}", eps, shares=_shares(fe.table))
    if sched in ("lc", "sed", "nq"):
        best, how = _least(fe)
        return NewFlow("dnat", how + (" (ties broken at random)" if len(best) > 1 else ""), tuple(best),
                       str(best[0]) if len(best) == 1 else None)
    if fe.probabilities and len(fe.probabilities) == n:
        left, shares = 1.0, {}
        for e, p in zip(eps, fe.probabilities, strict=True):
            shares[str(e)] = round(left * p, 4)
            left *= 1 - p
        rules = ", then ".join(f"{p:.4g}" for p in fe.probabilities)
        return NewFlow("dnat", f"{sched}: one of {n} by rules tried in turn, each taking a new flow with its "
                               f"probability ({rules})", eps, shares=shares)
    if sched == "rr":
        return NewFlow("dnat", "rr: the next endpoint in turn", eps, shares=_shares(map(str, eps)))
    # random, nftables' numgen, and a table scheduler whose table is being written: a uniform draw.
    return NewFlow("dnat", f"{sched}: one of {n} at random", eps, shares=_shares(map(str, eps)))


def _in_ranges(ip: str, ranges: Sequence[str]) -> bool:
    """Whether `ip` is in one of `ranges` (those of the other family hold none of it)."""
    addr = ipaddress.ip_address(ip)
    return any(addr in ipaddress.ip_network(r, strict=False) for r in ranges)


def new_flow(view: View, fe: Frontend, src: str, sport: int | None, dst: str) -> tuple[NewFlow, Affinity | None]:
    """What a new flow from src(:sport) to `fe` at `dst` gets, in the datapath's order (lb.h): source ranges,
    then no endpoint, then ClientIP affinity, then the scheduler."""
    if fe.source_ranges and not _in_ranges(src, fe.source_ranges):
        return NewFlow("dropped", f"{src} is outside the source ranges {', '.join(fe.source_ranges)}"), None
    if not fe.endpoints:
        why = "no local endpoint" if fe.empty == "dropped" else "no endpoint"
        return NewFlow(fe.empty, why), None
    if fe.affinity_sec:
        endpoints = {str(e) for e in fe.endpoints}
        for a in view.affinities:
            if (a.client, a.frontend, a.frontend_port, a.proto) == (src, dst, fe.port, fe.proto) \
                    and a.remaining_sec > 0 and a.backend in endpoints:
                return NewFlow("dnat", f"ClientIP affinity: {src} was sent to {a.backend} (for "
                                       f"{a.remaining_sec:.0f}s more)", fe.endpoints, a.backend), a
    flow = _scheduled(fe, src, sport, dst, fe.port)
    if fe.affinity_sec:
        flow = replace(flow, why=flow.why + f"; then ClientIP affinity keeps {src} there for {fe.affinity_sec}s")
    return flow, None


def frontend_of(view: View, dst: str, dport: int, proto: str) -> Frontend | None:
    """The frontend a packet to dst:dport/proto reaches (the datapath's first lookup), if any."""
    found = None
    for fe in view.frontends:
        if fe.node or (fe.port, fe.proto) != (dport, proto):
            continue
        if fe.ip == dst:
            return fe
        if fe.ip == ANY_NODE_ADDRESS and dst in view.nodeport_ips and fe.node_family == family_of(dst):
            found = fe
    return found


def trace(view: View, source: str, destination: str) -> Trace:
    """Where a packet from `source` (ADDR or ADDR:PORT) to `destination` (ADDR:PORT/PROTO) goes. Without a
    source port: the source's flows to the frontend, and what a new flow of it would get."""
    src, sport, dst, dport, proto = parse_flow(source, destination)
    where = f"{join_host_port(dst, dport)}/{proto.lower()}"
    fe = frontend_of(view, dst, dport, proto)
    if fe is None:
        return Trace(view.mode, source, where, "not a Service",
                     f"no frontend at {where}: the packet is left alone")
    flows = tuple(f for f in view.flows if (f.proto, f.client, f.frontend, f.frontend_port) ==
                  (proto, src, dst, dport) and (sport is None or f.client_port == sport))
    nf, affinity = new_flow(view, fe, src, sport, dst)
    endpoints = {str(e) for e in fe.endpoints}
    if sport is not None:
        for f in flows:
            if f.ended:
                why = f"its flow to {f.backend} has ended ({f.state}): a new connection starts a new one"
            elif f.service != fe.name:
                why = f"its flow belongs to {f.service}: the next packet starts a new one"
            elif f.backend not in endpoints:
                why = f"its flow's backend {f.backend} is no longer an endpoint: the next packet starts a new one"
            else:
                return Trace(view.mode, source, where, "established",
                             f"follows its {f.state} flow to {f.backend}", fe, f.backend, flows, affinity, nf)
            nf = replace(nf, why=f"{why}; {nf.why}")
    return Trace(view.mode, source, where, nf.verdict, nf.why, fe, nf.chosen, flows, affinity, nf)
