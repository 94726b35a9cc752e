"""What `pyproxy inspect` shows, whatever the mode: a `View` of the frontends, flows and affinity entries a
dataplane holds (each mode's reader fills it from the kernel), filters over it, and `trace`: where a packet
from SRC to DST:PORT/PROTO goes, decided from the view alone, as the datapath decides (bpf/include/pyproxy/lb.h,
the nftables table's verdict maps and chains, the iptables mode's KUBE-* chains; IPVS's schedulers run in the
kernel, so there the trace names the candidates and the rule). Pure, so every case is testable without root.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from pyproxy.model.objects import IPV4, IPV6, family_of, join_host_port

_PROTO_NUMBER = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}

ANY_NODE_ADDRESS = ""
"""A frontend's `ip` when it is a NodePort served on every address of `View.nodeport_ips` of its family
(`Frontend.node_family`): nftables' one element per port, where bpf writes one frontend per node address."""


@dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int
    weight: int = 1
    active: int | None = None
    """Open flows, where the scheduler counts them (lc, sed, nq); None: not counted."""

    def __str__(self) -> str:
        return join_host_port(self.ip, self.port)


@dataclass(frozen=True)
class Frontend:
    ip: str
    port: int
    proto: str
    """"TCP" or "UDP"."""
    name: str
    """The Service port it serves, as the dataplane names it."""
    service: str
    """ns/name."""
    scheduler: str
    endpoints: tuple[Endpoint, ...] = ()
    node: bool = False
    """bpf: an entry only the node's own sockets see (scope node, or host: a NodePort on 127.0.0.1), never a
    packet."""
    affinity_sec: int = 0
    source_ranges: tuple[str, ...] = ()
    empty: str = "refused"
    """What a new flow gets while there is no endpoint: "refused" or "dropped" (no local endpoint of a
    Service whose traffic policy keeps it on this node)."""
    table: tuple[str, ...] = ()
    """The scheduler's table (wrr's round, Maglev's lookup table), ip:port per entry."""
    probabilities: tuple[float, ...] = ()
    """Per endpoint, in order, where the dataplane draws by rules (iptables' `statistic --mode random`): the
    chance its rule takes a new flow that no earlier rule took (the last one's 1)."""
    rule: str = ""
    """How the dataplane picks, in words, where the pick happens out of the trace's reach (IPVS's schedulers run
    in the kernel, on state no reader sees): the trace then names the endpoints of weight > 0 and this rule."""
    packets: int | None = None
    bytes: int | None = None
    node_family: int = IPV4
    """On ANY_NODE_ADDRESS: the family of the node addresses it is served on (IPV6 from an IPv6 table or
    ip6tables). A dual-stack NodePort has one such frontend per family, each with its family's endpoints."""

    @property
    def family(self) -> int:
        return family_of(self.ip) if self.ip else self.node_family

    @property
    def address(self) -> str:
        """ip:port/PROTO, [ip]:port/PROTO for IPv6; `*` for ANY_NODE_ADDRESS ([*] for the IPv6 one)."""
        if self.ip:
            return f"{join_host_port(self.ip, self.port)}/{self.proto}"
        return f"{'[*]' if self.node_family == IPV6 else '*'}:{self.port}/{self.proto}"


@dataclass(frozen=True)
class Flow:
    proto: str
    client: str
    client_port: int
    frontend: str
    frontend_port: int
    backend: str
    """ip:port ([ip]:port for IPv6)."""
    service: str
    """The name of the frontend it was made for."""
    state: str
    idle_sec: float | None = None
    expires_sec: float | None = None
    snat: str | None = None
    """ip:port ([ip]:port) the flow leaves the node from when masqueraded (bpf), if known."""
    ended: bool = False
    """Over (a TCP flow closed, or in TIME_WAIT): its next packet, a new connection's, is scheduled afresh."""


@dataclass(frozen=True)
class Affinity:
    """A ClientIP affinity entry: `client` goes on to `backend` while `remaining_sec` > 0."""

    proto: str
    client: str
    frontend: str
    frontend_port: int
    backend: str
    service: str
    remaining_sec: float


@dataclass
class View:
    mode: str
    frontends: list[Frontend] = field(default_factory=list)
    flows: list[Flow] = field(default_factory=list)
    affinities: list[Affinity] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    nodeport_ips: list[str] = field(default_factory=list)
    source: str = ""
    """Where the reader found it (the commands and files it read), when that is not the mode alone."""


@dataclass(frozen=True)
class NewFlow:
    """What a new flow would get."""

    verdict: str
    """"dnat", "refused" or "dropped"."""
    why: str
    candidates: tuple[Endpoint, ...] = ()
    """The endpoints it could get."""
    chosen: str | None = None
    """The endpoint it would get, where that is decided by now (affinity, a hash, the least loaded)."""
    shares: dict[str, float] = field(default_factory=dict)
    """The chance of each candidate, where the scheduler draws (random, wrr, Maglev without the source port)."""


@dataclass(frozen=True)
class Trace:
    mode: str
    source: str
    destination: str
    verdict: str
    """"not a Service" (the packet is left alone), "established" (follows its flow), or the new flow's."""
    why: str
    frontend: Frontend | None = None
    backend: str | None = None
    """Where the packet goes: the established flow's backend, or the new flow's when decided."""
    flows: tuple[Flow, ...] = ()
    """The flows of the source to the frontend (of its port only, when the source has one)."""
    affinity: Affinity | None = None
    new_flow: NewFlow | None = None


# ------------------------------------------------------------------------------------------------ parsing


def split_host_port(text: str) -> tuple[str, str]:
    """ADDR:PORT or [ADDR6]:PORT -> (ADDR, PORT); ADDR, [ADDR6] or a bare ADDR6 -> (ADDR, ""): the port's text
    unchecked. An IPv6 address with a port goes in brackets (upstream's net.SplitHostPort)."""
    if text.startswith("["):
        addr, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"expected [IPv6 address] or [IPv6 address]:PORT, not {text!r}")
        return addr, rest[1:]
    if text.count(":") > 1:
        return text, ""
    addr, _, port = text.partition(":")
    return addr, port


def _address(addr: str, text: str) -> str:
    """The address in its canonical form (IPv6 compressed, as every reader writes it)."""
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        raise ValueError(f"{text!r}: {addr!r} is not an IPv4 or IPv6 address") from None


def parse_source(text: str) -> tuple[str, int | None]:
    """ADDR or ADDR:PORT; an IPv6 ADDR bare or in brackets, in brackets before a port ([fd00::2]:40000)."""
    addr, port = split_host_port(text)
    ip = _address(addr, text)
    if not port:
        return ip, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"source port must be 1..65535, not {port!r}")
    return ip, int(port)


def parse_destination(text: str) -> tuple[str, int, str]:
    """ADDR:PORT[/PROTO], PROTO tcp (the default) or udp; an IPv6 ADDR in brackets ([fd00:10:96::1]:80/tcp)."""
    addr, _, proto = text.partition("/")
    host, port = split_host_port(addr)
    ip = _address(host, text)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected ADDR:PORT/PROTO, such as 10.96.0.10:80/tcp or [fd00:10:96::1]:80/tcp, "
                         f"not {text!r}")
    proto = (proto or "tcp").upper()
    if proto not in ("TCP", "UDP"):
        raise ValueError(f"protocol must be tcp or udp, not {proto.lower()!r}")
    return ip, int(port), proto


def parse_flow(source: str, destination: str) -> tuple[str, int | None, str, int, str]:
    """(src, sport, dst, dport, proto) of `inspect trace`'s SRC and DST, both of one family (a packet's are)."""
    src, sport = parse_source(source)
    dst, dport, proto = parse_destination(destination)
    if family_of(src) != family_of(dst):
        raise ValueError(f"{source} and {destination} are of two IP families: a packet's source and destination "
                         "are both IPv4 or both IPv6")
    return src, sport, dst, dport, proto


# ------------------------------------------------------------------------------------------------ filters


def filtered(view: View, service: str | None = None, frontend: str | None = None) -> View:
    """The view narrowed to the frontends of Service `service` (ns/name) and/or at `frontend` (IP:PORT or
    [IPv6]:PORT, with /PROTO or not), and to their flows and affinity entries."""
    fes = view.frontends
    if service is not None:
        fes = [f for f in fes if service in (f.service, f.name)]
    if frontend is not None:
        addr, _, proto = frontend.partition("/")
        host, port = split_host_port(addr)
        ip = _address(host, frontend)
        fes = [f for f in fes if f.ip in (ip, ANY_NODE_ADDRESS) and str(f.port) == port
               and (not proto or f.proto == proto.upper())
               and (f.ip or (ip in view.nodeport_ips and f.family == family_of(ip)))]
    if fes is view.frontends:
        return view
    names = {f.name for f in fes}
    keys = {(f.ip, f.port, f.proto, f.family) for f in fes}

    def kept(ip: str, port: int, proto: str, name: str) -> bool:
        return name in names if frontend is None else (ip, port, proto, family_of(ip)) in keys or (
            (ANY_NODE_ADDRESS, port, proto, family_of(ip)) in keys and ip in view.nodeport_ips)

    return replace(view, frontends=fes,
                   flows=[f for f in view.flows if kept(f.frontend, f.frontend_port, f.proto, f.service)],
                   affinities=[a for a in view.affinities if kept(a.frontend, a.frontend_port, a.proto, a.service)])


# ------------------------------------------------------------------------------------------------ trace


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


# ------------------------------------------------------------------------------------------------ text


def _endpoint_text(fe: Frontend, e: Endpoint) -> str:
    out = str(e)
    if any(x.weight != 1 for x in fe.endpoints):
        out += f" weight {e.weight}"
    if e.active is not None:
        out += f" ({e.active} open)"
    return out


def _width(least: int, values: Iterable[str]) -> int:
    """A column's width: `least`, or its widest value's (IPv6 addresses), so the columns stay aligned."""
    return max([least, *map(len, values)])


def report(view: View, flows: bool = True) -> str:
    """The view as `pyproxy inspect` prints it."""
    lines = [f"read from: {view.source}", ""] if view.source else []
    rows = [(fe.name, fe.address + (" node" if fe.node else ""), fe.scheduler + (f"/{len(fe.table)}" if fe.table
                                                                                    else ""),
             "-" if fe.packets is None else str(fe.packets), "-" if fe.bytes is None else str(fe.bytes),
             ", ".join(_endpoint_text(fe, e) for e in fe.endpoints) or f"(none: {fe.empty})")
            for fe in sorted(view.frontends, key=lambda f: (f.name, f.ip, f.port))]
    fw = _width(26, (r[1] for r in rows))
    lines.append(f"{'SERVICE':40} {'FRONTEND':{fw}} {'SCHED':12} {'PACKETS':>9} {'BYTES':>11}  BACKENDS")
    for name, frontend, sched, pkts, byts, backends in rows:
        lines.append(f"{name:40} {frontend:{fw}} {sched:12} {pkts:>9} {byts:>11}  {backends}")
    if view.counters:
        lines.append("")
        lines.append("datapath: " + ", ".join(f"{n}={c}" for n, c in view.counters.items()))
    if flows:
        lines.append("")
        flow_rows = [(f"{f.proto} {join_host_port(f.client, f.client_port)} -> "
                      f"{join_host_port(f.frontend, f.frontend_port)}",
                      f.backend + (f" from {f.snat}" if f.snat else ""), f.service, f.state,
                      "-" if f.idle_sec is None else f"{f.idle_sec:.1f}s") for f in view.flows]
        cw, bw = _width(48, (r[0] for r in flow_rows)), _width(22, (r[1] for r in flow_rows))
        lines.append(f"{'FLOW (client -> frontend)':{cw}} {'BACKEND':{bw}} {'SERVICE':30} {'STATE':12} IDLE")
        for flow, backend, service, state, idle in flow_rows:
            lines.append(f"{flow:{cw}} {backend:{bw}} {service:30} {state:12} {idle}")
    return "\n".join(lines)


def trace_text(t: Trace) -> str:
    lines = [f"{t.source} -> {t.destination}: {t.verdict}: {t.why}"]
    if t.frontend is not None:
        fe = t.frontend
        policy = [f"scheduler {fe.scheduler}"]
        if fe.affinity_sec:
            policy.append(f"ClientIP affinity {fe.affinity_sec}s")
        if fe.source_ranges:
            policy.append(f"source ranges {', '.join(fe.source_ranges)}")
        lines.append(f"frontend: {fe.name} at {fe.address} ({'; '.join(policy)})")
        lines.append("endpoints: " + (", ".join(_endpoint_text(fe, e) for e in fe.endpoints) or "none"))
    for f in t.flows:
        lines.append(f"flow: {f.proto.lower()} {join_host_port(f.client, f.client_port)} -> {f.backend} ({f.state}"
                     + (", ended)" if f.ended else ")"))
    if t.affinity is not None:
        lines.append(f"affinity: {t.affinity.client} -> {t.affinity.backend} "
                     f"({t.affinity.remaining_sec:.0f}s left)")
    nf = t.new_flow
    if nf is not None and t.verdict == "established":
        lines.append(f"a new flow: {nf.verdict}: {nf.why}")
    if nf is not None and nf.verdict == "dnat":
        if nf.chosen:
            lines.append(f"a new flow gets: {nf.chosen}")
        elif nf.shares:
            lines.append("a new flow gets one of: " + ", ".join(f"{e} ({s:.0%})" for e, s in nf.shares.items()))
        else:
            lines.append("a new flow gets one of: " + ", ".join(map(str, nf.candidates)))
    return "\n".join(lines)
