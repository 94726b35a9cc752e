"""What `pyproxy inspect` shows, whatever the mode: a `View` of the frontends, flows and affinity entries a
dataplane holds (each mode's reader fills it from the kernel), filters over it, and the text of a view and of a
`Trace` (where a packet goes: pyproxy/dataplane/trace.py decides it, emulating the datapaths). Pure, so every case is
testable without root.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from pyproxy.model.objects import IPV4, IPV6, family_of, join_host_port

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
