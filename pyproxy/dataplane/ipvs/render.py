"""From desired state to IPVS operations: pure, no kernel.

`render()` compares what the kernel holds (`Observed`: virtual servers with their real servers and connection
counts, the addresses on kube-ipvs0, the members of our ipsets) and what this process remembers (`Memory`:
which Service owns which virtual server, since when a real server drains) with the desired frontends of the
Services being synced, and returns a `Plan`: ordered operations plus the memory that holds once they ran.

Upstream kube-proxy's IPVS semantics:

- one virtual server per frontend (ClusterIP:port/protocol), NAT forwarding ("masq"), the configured scheduler;
  ClientIP affinity makes it persistent with the affinity timeout;
- real servers are the ready endpoints, weight 1. A Service without ready endpoints keeps its virtual server
  with no real servers: the kernel then answers every new connection with ICMP port unreachable (ip_vs_leave),
  so a client gets "connection refused" at once, as the other modes' REJECT gives;
- a real server that leaves drains (graceful termination): TCP ones go to weight 0 and are deleted once they
  have no active or inactive connections, or after `grace_seconds` (upstream's original 15 minutes), checked at
  every later sync; UDP and SCTP ones are deleted at once (upstream: there is no connection to wait for);
- every ClusterIP is a /32 on the dummy device kube-ipvs0 (so the node accepts packets for it and IPVS sees
  them in LOCAL_IN); the ipsets KUBE-CLUSTER-IP (ip,port) and KUBE-IPVS-IPS (ip) list the frontends and
  addresses for the iptables rules, KUBE-LOOP-BACK (endpoint ip,port,ip) the hairpin flows to masquerade.

Which virtual servers are ours: those this process made (`Memory.owners`), and any on an address of
kube-ipvs0 or listed in KUBE-CLUSTER-IP (a previous run's; upstream judges by kube-ipvs0's addresses too). A full
sync removes ours that nothing wants; a partial sync only touches the Services it is given, plus draining real
servers anywhere. Virtual servers of anyone else are never touched.

Order keeps traffic sane while the plan runs: ipset members are added first (the iptables rules accept and
mark by them), virtual and real servers next, then the new addresses (a ClusterIP becomes local only once IPVS
serves it); removals run last: addresses, then virtual servers, then ipset members.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pyproxy.model.state import Backend, Frontend, ServicePortState, rendered

VSKey = tuple[str, int, str]
"""(ClusterIP, port, "TCP" | "UDP" | "SCTP")."""

DUMMY_DEVICE = "kube-ipvs0"
CLUSTER_IP_SET = "KUBE-CLUSTER-IP"
LOOPBACK_SET = "KUBE-LOOP-BACK"
IPVS_IPS_SET = "KUBE-IPVS-IPS"
SET_TYPES = {CLUSTER_IP_SET: "hash:ip,port", LOOPBACK_SET: "hash:ip,port,ip", IPVS_IPS_SET: "hash:ip"}
"""Our ipsets and their types, as upstream."""

WEIGHT = 1
"""Every ready endpoint's weight (upstream); 0 marks a draining one."""
# Upstream drains only protocols with connections to wait for.
GRACEFUL_PROTOCOLS = frozenset({"TCP"})


@dataclass(frozen=True)
class Real:
    weight: int
    active: int = 0
    inactive: int = 0


@dataclass(frozen=True)
class Virtual:
    scheduler: str
    timeout: int = 0
    """Persistence (ClientIP affinity) in seconds; 0 = not persistent."""
    reals: Mapping[Backend, Real] = field(default_factory=dict)


@dataclass(frozen=True)
class Observed:
    """What the kernel holds now (read by the backend before every sync)."""

    virtuals: Mapping[VSKey, Virtual] = field(default_factory=dict)
    addresses: frozenset[str] = frozenset()
    """The addresses on kube-ipvs0."""
    ipsets: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Members of our ipsets, as `ipset save` prints them."""


@dataclass(frozen=True)
class Memory:
    """What the kernel cannot tell: which Service owns a virtual server, and since when a real server drains."""

    owners: Mapping[VSKey, str] = field(default_factory=dict)
    draining_since: Mapping[tuple[VSKey, Backend], float] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    scheduler: str = "rr"
    grace_seconds: float = 900.0


@dataclass(frozen=True)
class VirtualOp:
    verb: str  # "add" | "set" | "del"
    key: VSKey
    scheduler: str = ""
    timeout: int = 0


@dataclass(frozen=True)
class RealOp:
    verb: str  # "add" | "set" | "del"
    key: VSKey
    backend: Backend
    weight: int = 0


@dataclass(frozen=True)
class AddressOp:
    verb: str  # "add" | "del"
    ip: str


@dataclass(frozen=True)
class SetOp:
    verb: str  # "add" | "del"
    name: str
    entry: str


Op = VirtualOp | RealOp | AddressOp | SetOp


@dataclass(frozen=True)
class Plan:
    ops: tuple[Op, ...]
    memory: Memory


def vs_key(fe: Frontend) -> VSKey:
    return (fe.ip, fe.port, fe.protocol.value)


def cluster_entry(key: VSKey) -> str:
    """The KUBE-CLUSTER-IP member of a frontend, as `ipset save` prints it."""
    return f"{key[0]},{key[2].lower()}:{key[1]}"


def loopback_entry(key: VSKey, b: Backend) -> str:
    """The KUBE-LOOP-BACK member of an endpoint: a packet from it to itself is hairpin traffic."""
    return f"{b.ip},{key[2].lower()}:{b.port},{b.ip}"


def ours(observed: Observed, memory: Memory) -> set[VSKey]:
    listed = observed.ipsets.get(CLUSTER_IP_SET, frozenset())
    return {k for k in observed.virtuals
            if k in memory.owners or k[0] in observed.addresses or cluster_entry(k) in listed}


@dataclass
class _Reals:
    """The real-server part of a plan for one virtual server."""

    ops: list[RealOp] = field(default_factory=list)
    after: dict[Backend, Real] = field(default_factory=dict)
    draining: dict[Backend, float] = field(default_factory=dict)


def _reconcile_reals(key: VSKey, current: Mapping[Backend, Real], wanted: Iterable[Backend] | None,
                     since: Mapping[tuple[VSKey, Backend], float], options: Options, now: float) -> _Reals:
    """Real-server ops for `key`. `wanted` None: the Service is not being synced, so only draining real
    servers (weight 0, which only this proxy sets) are looked at."""
    r = _Reals()
    want = tuple(wanted) if wanted is not None else None
    for b in want or ():
        cur = current.get(b)
        if cur is None:
            r.ops.append(RealOp("add", key, b, WEIGHT))
        elif cur.weight != WEIGHT:
            r.ops.append(RealOp("set", key, b, WEIGHT))  # back before it finished draining
        r.after[b] = Real(WEIGHT)
    for b, cur in current.items():
        if want is not None and b in want:
            continue
        if want is None and cur.weight != 0:
            r.after[b] = cur
            continue
        started = since.get((key, b), now)
        if (key[2] not in GRACEFUL_PROTOCOLS or cur.active + cur.inactive == 0
                or now - started >= options.grace_seconds):
            r.ops.append(RealOp("del", key, b))
            continue
        if cur.weight != 0:
            r.ops.append(RealOp("set", key, b, 0))
        r.after[b] = Real(0, cur.active, cur.inactive)
        r.draining[b] = started
    return r


def render(observed: Observed, memory: Memory, desired: Mapping[str, Iterable[ServicePortState]], *,
           full: bool, options: Options, now: float) -> Plan:
    """Plan the changes for the Services in `desired` (Service key -> its frontends; an empty iterable means
    the Service is gone), or, with `full`, for everything of ours (`desired` then holds every Service)."""
    mine = ours(observed, memory)
    # Unique: the model decided which Service serves a frontend.
    claims = {vs_key(st.frontend): (service, st) for service in sorted(desired) for st in rendered(desired[service])}
    scope = mine if full else {k for k in mine if memory.owners.get(k) in desired}
    gone = (scope - claims.keys()) & observed.virtuals.keys()

    virtual_ops: list[VirtualOp] = []
    real_ops: list[RealOp] = []
    reals_after: dict[VSKey, Mapping[Backend, Real]] = {}
    draining: dict[tuple[VSKey, Backend], float] = {}
    owners = {k: s for k, s in memory.owners.items() if k in mine and k not in gone}

    for key in sorted(claims):
        service, st = claims[key]
        cur = observed.virtuals.get(key)
        if cur is None:
            virtual_ops.append(VirtualOp("add", key, options.scheduler, st.session_affinity_seconds))
        elif (cur.scheduler, cur.timeout) != (options.scheduler, st.session_affinity_seconds):
            virtual_ops.append(VirtualOp("set", key, options.scheduler, st.session_affinity_seconds))
        r = _reconcile_reals(key, cur.reals if cur else {}, st.backends, memory.draining_since, options, now)
        real_ops += r.ops
        reals_after[key] = r.after
        draining.update({(key, b): t for b, t in r.draining.items()})
        owners[key] = service

    for key in sorted(mine - claims.keys() - gone):
        # Not synced now (partial sync) but ours: only its draining real servers may be due.
        r = _reconcile_reals(key, observed.virtuals[key].reals, None, memory.draining_since, options, now)
        real_ops += r.ops
        reals_after[key] = r.after
        draining.update({(key, b): t for b, t in r.draining.items()})

    addresses = {key[0] for key in reals_after}
    sets_after = {
        CLUSTER_IP_SET: {cluster_entry(k) for k in reals_after},
        LOOPBACK_SET: {loopback_entry(k, b) for k, reals in reals_after.items() for b in reals},
        IPVS_IPS_SET: addresses,
    }
    set_adds, set_dels = [], []
    for name, entries in sets_after.items():
        have = observed.ipsets.get(name, frozenset())
        set_adds += [SetOp("add", name, e) for e in sorted(entries - have)]
        set_dels += [SetOp("del", name, e) for e in sorted(have - entries)]

    ops: list[Op] = [*set_adds, *virtual_ops, *real_ops]
    ops += [AddressOp("add", ip) for ip in sorted(addresses - observed.addresses)]
    ops += [AddressOp("del", ip) for ip in sorted(observed.addresses - addresses)]
    ops += [VirtualOp("del", key) for key in sorted(gone)]
    ops += set_dels
    return Plan(tuple(ops), Memory(owners=owners, draining_since=draining))


def after(observed: Observed, ops: Iterable[Op]) -> Observed:
    """What the kernel holds once `ops` ran on `observed` (connection counts as they were read)."""
    virtuals = {k: (v.scheduler, v.timeout, dict(v.reals)) for k, v in observed.virtuals.items()}
    addresses = set(observed.addresses)
    ipsets = {name: set(members) for name, members in observed.ipsets.items()}
    for op in ops:
        if isinstance(op, VirtualOp):
            if op.verb == "del":
                virtuals.pop(op.key, None)
            else:
                virtuals[op.key] = (op.scheduler, op.timeout, virtuals.get(op.key, ("", 0, {}))[2])
        elif isinstance(op, RealOp):
            reals = virtuals[op.key][2]
            if op.verb == "del":
                reals.pop(op.backend, None)
            else:
                old = reals.get(op.backend, Real(0))
                reals[op.backend] = Real(op.weight, old.active, old.inactive)
        elif isinstance(op, AddressOp):
            (addresses.add if op.verb == "add" else addresses.discard)(op.ip)
        else:
            members = ipsets.setdefault(op.name, set())
            (members.add if op.verb == "add" else members.discard)(op.entry)
    return Observed({k: Virtual(s, t, r) for k, (s, t, r) in virtuals.items()}, frozenset(addresses),
                    {name: frozenset(m) for name, m in ipsets.items()})
