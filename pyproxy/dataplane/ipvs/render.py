"""From desired state to IPVS operations: pure, no kernel.

`render()` compares what the kernel holds (`Observed`: virtual servers with their real servers and connection
counts, the addresses on kube-ipvs0, the members of our ipsets) and what this process remembers (`Memory`:
which Service owns which virtual server, the ipset members each one accounts for, since when a real server
drains) with the desired frontends of the Services being synced, and returns a `Plan`: ordered operations plus
the memory that holds once they ran.

Upstream kube-proxy's IPVS semantics:

- one virtual server per frontend, NAT forwarding ("masq"), the Service's scheduler (`pyproxy.io/scheduler`,
  `scheduler()`: IPVS's own names, maglev as IPVS's mh) or else the configured one (--ipvs-scheduler; also for
  `random`, which IPVS has not: `Plan.fallbacks` names those Services for the log); ClientIP affinity makes
  it persistent with the affinity timeout. A changed scheduler or affinity edits the virtual server in place,
  a changed weight the real server: deleting either would end its established connections. Frontends are
  every kind the model gives: each ClusterIP, each external IP, each load-balancer IP, and a NodePort on each
  node address it is served on (the model's `NodeInputs.nodeport_addresses`, one frontend per address);
- real servers, weighted by the Service's `pyproxy.io/weights` (`ServicePortState.weight`: 1 unless named;
  IPVS's weight 0 quiesces a real server, as the annotation's 0 means: no new flows): a ClusterIP's
  `backends`; an external frontend's `external_backends` (with
  externalTrafficPolicy Cluster the same; with Local this node's). One virtual server serves every source, so
  unlike the netfilter modes IPVS cannot give pods and the node all endpoints while outside clients get this
  node's (upstream IPVS cannot either): with Local, pods and the node reach this node's endpoints too.
  A Local frontend without a local endpoint while the cluster has some gets all the `backends` (as upstream,
  kubernetes PR 97081: pods and the node still reach the Service) and its (address, port) goes into
  KUBE-NO-LOCAL-ENDPOINTS, whose filter rule drops new flows from outside the cluster: the model's drop, where
  upstream IPVS would forward them without SNAT and the endpoint's reply would never reach the client;
- internalTrafficPolicy Local: a ClusterIP's real servers are this node's endpoints (the model's `backends`);
  with none here while the cluster has some, its virtual server has none and its (address, port) goes into
  KUBE-NO-LOCAL-CLUSTER-IP, whose filter rule (INPUT, FORWARD) drops new flows from pods and outside before
  IPVS would refuse them (upstream IPVS refuses them: ip_vs_leave; its iptables and nftables proxiers drop
  them). The node's own flows are still refused: IPVS schedules them in its local-out hook, before filter;
- a frontend without usable endpoints keeps its virtual server with no real servers: the kernel answers every
  new connection with ICMP port unreachable (ip_vs_leave). The kernel sends a client only so many ICMP errors (a
  burst of six, then one a second: net.ipv4.icmp_ratelimit), so a client's later TCP flows would wait for their
  timeout instead: the frontend also goes into pyproxy's KUBE-NO-ENDPOINTS, whose filter rule answers new TCP
  flows with a reset before IPVS sees them, as the other modes' REJECT does;
- a real server that leaves drains (graceful termination): TCP ones go to weight 0 and are deleted once they
  have no active or inactive connections, or after `grace_seconds` (upstream's original 15 minutes), checked at
  every later sync; UDP and SCTP ones are deleted at once (upstream: there is no connection to wait for);
- IPv6 frontends (upstream's IPv6 proxier) are the same: IPv6 virtual and real servers, /128 addresses on
  kube-ipvs0, and the same sets of that family, named KUBE-6-* (`set_name`), which ip6tables' rules match;
- every ClusterIP, external IP and load-balancer IP is a /32 on the dummy device kube-ipvs0 (so the node
  accepts packets for it and IPVS sees them in LOCAL_IN); NodePort addresses are the node's own already and
  are never bound, nor is an external or load-balancer IP that is one of them (as upstream). The ipsets tell
  the iptables rules (backend.py) what each frontend is: KUBE-CLUSTER-IP, KUBE-EXTERNAL-IP /
  KUBE-EXTERNAL-IP-LOCAL (by policy), KUBE-LOAD-BALANCER (+ -LOCAL for Local policy, -FW and -SOURCE-CIDR for
  loadBalancerSourceRanges), KUBE-NODE-PORT-TCP/-UDP (+ -LOCAL-*; bitmaps of node ports, and for SCTP the
  hash:ip,port sets upstream uses), KUBE-IPVS-IPS (the bound addresses), KUBE-LOOP-BACK (endpoint
  ip,port,ip: the hairpin flows to masquerade) and pyproxy's KUBE-NO-LOCAL-ENDPOINTS (above).

Which virtual servers are ours: those this process made (`Memory.owners`), and any on an address of
kube-ipvs0 or listed in one of the frontend ipsets (a previous run's; upstream judges by kube-ipvs0's addresses
and flushes the rest); a NodePort one is known by its port in the node-port set of its protocol. A full sync
removes ours that nothing wants; a partial sync only touches the Services it is given (their virtual servers,
and the ipset members those account for), plus draining real servers anywhere. Virtual servers of anyone else
are never touched.

Order keeps traffic sane while the plan runs: ipset members are added first (the iptables rules accept, mark
and drop by them), virtual and real servers next, then the new addresses (an address becomes local only once
IPVS serves it); removals run last: addresses, then virtual servers, then ipset members.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field

from pyproxy.model.conntrack import Stale, UdpFrontend, UdpKey, stale_udp, udp_frontends
from pyproxy.model.objects import IPV4, IPV6, family_of
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

VSKey = tuple[str, int, str]
"""(address, port, "TCP" | "UDP" | "SCTP")."""

DUMMY_DEVICE = "kube-ipvs0"
CLUSTER_IP_SET = "KUBE-CLUSTER-IP"
LOOPBACK_SET = "KUBE-LOOP-BACK"
IPVS_IPS_SET = "KUBE-IPVS-IPS"
EXTERNAL_IP_SET = "KUBE-EXTERNAL-IP"
EXTERNAL_IP_LOCAL_SET = "KUBE-EXTERNAL-IP-LOCAL"
LOAD_BALANCER_SET = "KUBE-LOAD-BALANCER"
LOAD_BALANCER_LOCAL_SET = "KUBE-LOAD-BALANCER-LOCAL"
LOAD_BALANCER_FW_SET = "KUBE-LOAD-BALANCER-FW"
LOAD_BALANCER_SOURCE_CIDR_SET = "KUBE-LOAD-BALANCER-SOURCE-CIDR"
NO_LOCAL_SET = "KUBE-NO-LOCAL-ENDPOINTS"
"""pyproxy's own: externalTrafficPolicy Local frontends without a local endpoint while the cluster has some."""
NO_LOCAL_CLUSTER_IP_SET = "KUBE-NO-LOCAL-CLUSTER-IP"
"""pyproxy's own: internalTrafficPolicy Local ClusterIPs without a local endpoint while the cluster has some."""
NO_ENDPOINTS_SET = "KUBE-NO-ENDPOINTS"
"""pyproxy's own: frontends without a usable endpoint, whose new TCP flows a filter rule resets at once."""
NODE_PORT_SETS: Mapping[str, tuple[str, str]] = {
    "TCP": ("KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP"),
    "UDP": ("KUBE-NODE-PORT-UDP", "KUBE-NODE-PORT-LOCAL-UDP"),
    "SCTP": ("KUBE-NODE-PORT-SCTP-HASH", "KUBE-NODE-PORT-LOCAL-SCTP-HASH"),
}
"""Per protocol, the sets of every node port and of those with externalTrafficPolicy Local (upstream's names)."""
BITMAP_PORT = "bitmap:port"
SET_TYPES4: Mapping[str, str] = {
    CLUSTER_IP_SET: "hash:ip,port", LOOPBACK_SET: "hash:ip,port,ip", IPVS_IPS_SET: "hash:ip",
    EXTERNAL_IP_SET: "hash:ip,port", EXTERNAL_IP_LOCAL_SET: "hash:ip,port",
    LOAD_BALANCER_SET: "hash:ip,port", LOAD_BALANCER_LOCAL_SET: "hash:ip,port",
    LOAD_BALANCER_FW_SET: "hash:ip,port", LOAD_BALANCER_SOURCE_CIDR_SET: "hash:ip,port,net",
    NO_LOCAL_SET: "hash:ip,port", NO_LOCAL_CLUSTER_IP_SET: "hash:ip,port", NO_ENDPOINTS_SET: "hash:ip,port",
    # Upstream: bitmaps of ports for TCP and UDP (one member serves every node address); SCTP by address.
    **{name: BITMAP_PORT if proto != "SCTP" else "hash:ip,port" for proto, names in NODE_PORT_SETS.items()
       for name in names},
}
"""The IPv4 frontends' ipsets and their types, as upstream (but KUBE-NO-LOCAL-ENDPOINTS,
KUBE-NO-LOCAL-CLUSTER-IP and KUBE-NO-ENDPOINTS). The constants above are their names."""
MAX_SET_NAME = 31
"""ipset's longest set name (IPSET_MAXNAMELEN 32, with the NUL)."""


def set_name(name: str, family: int) -> str:
    """The set `name` (an IPv4 set, SET_TYPES4) of `family`'s frontends. Upstream's IPv6 proxier names its sets
    KUBE-6-..., cut to ipset's 31 characters (KUBE-6-LOAD-BALANCER-SOURCE-CID): both families' sets live in one
    kernel table, and an `inet6` set holds IPv6 members only."""
    return name if family == IPV4 else name.replace("KUBE-", "KUBE-6-", 1)[:MAX_SET_NAME]


SET_FAMILIES: Mapping[str, int] = {set_name(name, family): family for family in (IPV4, IPV6) for name in SET_TYPES4}
"""Every ipset of ours (both families') -> the family of its members."""
SET_TYPES: Mapping[str, str] = {set_name(name, family): kind for family in (IPV4, IPV6)
                                for name, kind in SET_TYPES4.items()}
"""Every ipset of ours (both families') -> its type."""


def sets_of(families: Set[int]) -> dict[str, str]:
    """The ipsets (name -> type) of `families`' frontends."""
    return {name: SET_TYPES[name] for name, family in SET_FAMILIES.items() if family in families}


FRONTEND_SETS = frozenset({CLUSTER_IP_SET, EXTERNAL_IP_SET, EXTERNAL_IP_LOCAL_SET, LOAD_BALANCER_SET})
"""The sets that list every ClusterIP, external IP and load-balancer frontend (ip,proto:port): the IPv4 ones'
names (set_name gives the IPv6 ones')."""

IPVS_SCHEDULERS: Mapping[str, str] = {"rr": "rr", "wrr": "wrr", "lc": "lc", "sed": "sed", "nq": "nq", "sh": "sh",
                                      "dh": "dh", "maglev": "mh"}
"""The model's schedulers (objects.SCHEDULERS) IPVS has -> IPVS's name for it; `random` it has not."""
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
    members: Mapping[VSKey, frozenset[tuple[str, str]]] = field(default_factory=dict)
    """The (ipset, member) pairs each virtual server's frontend accounts for, its address on kube-ipvs0 as a
    KUBE-IPVS-IPS member: what a partial sync keeps for the Services it does not sync."""
    draining_since: Mapping[tuple[VSKey, Backend], float] = field(default_factory=dict)
    known: Mapping[VSKey, frozenset[Backend]] = field(default_factory=dict)
    """UDP virtual servers: every endpoint flows may be DNATed to as last synced, not-ready ones too (no real
    server shows those): whose entries go when they leave. Empty after a restart: the kernel's real servers
    alone then say which endpoints left."""


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
    fallbacks: Mapping[str, str] = field(default_factory=dict)
    """Service key -> the scheduler it asks for that IPVS has not, of the Services synced now: their virtual
    servers got the configured scheduler instead (the backend says so in its log, once per Service)."""
    stale_udp: tuple[Stale, ...] = ()
    """UDP conntrack entries to delete once the ops ran (model/conntrack.py's plan, as the other netfilter
    modes'): IPVS keeps a conntrack entry per flow (net.ipv4.vs.conntrack=1), which keeps a client's datagrams
    going to a deleted real server."""


def vs_key(fe: Frontend) -> VSKey:
    return (fe.ip, fe.port, fe.protocol.value)


def cluster_entry(key: VSKey) -> str:
    """The KUBE-CLUSTER-IP member of a frontend, as `ipset save` prints it."""
    return f"{key[0]},{key[2].lower()}:{key[1]}"


def loopback_entry(key: VSKey, b: Backend) -> str:
    """The KUBE-LOOP-BACK member of an endpoint: a packet from it to itself is hairpin traffic."""
    return f"{b.ip},{key[2].lower()}:{b.port},{b.ip}"


def node_port_entry(key: VSKey) -> str:
    """The member of a NodePort in its protocol's node-port sets: the port (a bitmap), for SCTP ip,proto:port."""
    return cluster_entry(key) if SET_TYPES[NODE_PORT_SETS[key[2]][0]] != BITMAP_PORT else str(key[1])


def source_cidr_entry(key: VSKey, cidr: str) -> str:
    """A KUBE-LOAD-BALANCER-SOURCE-CIDR member, as `ipset save` prints it: the network normalised, a /32
    without its length."""
    net = ipaddress.ip_network(cidr.strip(), strict=False)
    return f"{cluster_entry(key)},{net.network_address if net.prefixlen == net.max_prefixlen else net}"


def scheduler(st: ServicePortState, default: str) -> str:
    """The IPVS scheduler of a frontend's virtual server: the Service's when IPVS has it, else `default`."""
    return IPVS_SCHEDULERS.get(st.scheduler, default)


def real_servers(st: ServicePortState) -> tuple[Backend, ...]:
    """The real servers of a frontend's virtual server (see the module's docstring), and its quiesced endpoints
    (weight 0: no new flows, IPVS's own way)."""
    if st.kind.external and st.external_backends:
        return st.external_backends + st.quiesced
    return st.backends + st.quiesced


def members(key: VSKey, st: ServicePortState, node_addresses: Set[str] = frozenset()) -> frozenset[tuple[str, str]]:
    """The (ipset, member) pairs of one frontend, as upstream's proxier puts them (its address on kube-ipvs0 as
    a KUBE-IPVS-IPS member), KUBE-NO-LOCAL-ENDPOINTS for a Local one the node has no endpoint for,
    KUBE-NO-LOCAL-CLUSTER-IP for an internalTrafficPolicy Local ClusterIP the model drops, and KUBE-NO-ENDPOINTS
    for one without any usable endpoint.
    `node_addresses`: the node's own, never bound (upstream binds an external or load-balancer IP only when it
    is no node address: KUBE-IPVS-FILTER would otherwise reject the node's own services on it, ssh included)."""
    entry = cluster_entry(key)
    local = st.kind.external and not st.masquerade  # externalTrafficPolicy Local
    family = family_of(key[0])
    out: set[tuple[str, str]] = set()

    def add(name: str, member: str) -> None:
        out.add((set_name(name, family), member))

    if st.kind is FrontendKind.NODE_PORT:
        every, local_set = NODE_PORT_SETS[key[2]]
        add(every, node_port_entry(key))
        if local:
            add(local_set, node_port_entry(key))
    else:
        if st.kind is FrontendKind.CLUSTER_IP or key[0] not in node_addresses:
            add(IPVS_IPS_SET, key[0])
        if st.kind is FrontendKind.CLUSTER_IP:
            add(CLUSTER_IP_SET, entry)
        elif st.kind is FrontendKind.EXTERNAL_IP:
            add(EXTERNAL_IP_LOCAL_SET if local else EXTERNAL_IP_SET, entry)
        else:
            add(LOAD_BALANCER_SET, entry)
            if local:
                add(LOAD_BALANCER_LOCAL_SET, entry)
            if st.source_ranges:
                add(LOAD_BALANCER_FW_SET, entry)
                for r in st.source_ranges:
                    add(LOAD_BALANCER_SOURCE_CIDR_SET, source_cidr_entry(key, r))
    if local and st.backends and not st.external_backends:
        add(NO_LOCAL_SET, entry)
    if st.drop:
        add(NO_LOCAL_CLUSTER_IP_SET, entry)
    elif not real_servers(st):
        add(NO_ENDPOINTS_SET, entry)
    return frozenset(out)


def ours(observed: Observed, memory: Memory) -> set[VSKey]:
    def listed(k: VSKey) -> bool:
        family = family_of(k[0])
        if any(cluster_entry(k) in observed.ipsets.get(set_name(name, family), ()) for name in FRONTEND_SETS):
            return True
        # A NodePort: not on kube-ipvs0; its port (SCTP: address and port) is in our node-port set of its family.
        node_ports = NODE_PORT_SETS.get(k[2])
        return (node_ports is not None
                and node_port_entry(k) in observed.ipsets.get(set_name(node_ports[0], family), ()))

    return {k for k in observed.virtuals if k in memory.owners or k[0] in observed.addresses or listed(k)}


@dataclass
class _Reals:
    """The real-server part of a plan for one virtual server."""

    ops: list[RealOp] = field(default_factory=list)
    after: dict[Backend, Real] = field(default_factory=dict)
    draining: dict[Backend, float] = field(default_factory=dict)


def _reconcile_reals(key: VSKey, current: Mapping[Backend, Real], wanted: Mapping[Backend, int] | None,
                     since: Mapping[tuple[VSKey, Backend], float], options: Options, now: float) -> _Reals:
    """Real-server ops for `key`; `wanted`: endpoint -> weight. `wanted` None: the Service is not being synced,
    so only draining real servers (those `since` knows: a wanted one may have weight 0 too) are looked at."""
    r = _Reals()
    for b, weight in (wanted or {}).items():
        cur = current.get(b)
        if cur is None:
            r.ops.append(RealOp("add", key, b, weight))
        elif cur.weight != weight:
            # Also one back before it finished draining. An edit: its established connections stay.
            r.ops.append(RealOp("set", key, b, weight))
        r.after[b] = Real(weight, cur.active, cur.inactive) if cur else Real(weight)
    for b, cur in current.items():
        if wanted is not None and b in wanted:
            continue
        if wanted is None and (cur.weight != 0 or (key, b) not in since):
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
           full: bool, options: Options, now: float, node_addresses: Iterable[str] = ()) -> Plan:
    """Plan the changes for the Services in `desired` (Service key -> its frontends; an empty iterable means
    the Service is gone), or, with `full`, for everything of ours (`desired` then holds every Service).
    `node_addresses`: the node's addresses the model knows (`NodeInputs.nodeport_addresses`), which are never
    bound to kube-ipvs0; the model recomputes every Service when they change, so each is synced then."""
    node_set = frozenset(node_addresses)
    mine = ours(observed, memory)
    # Unique: the model decided which Service serves a frontend.
    claims = {vs_key(st.frontend): (service, st) for service in sorted(desired)
              for st in desired[service]}
    scope = mine if full else {k for k in mine if memory.owners.get(k) in desired}
    gone = (scope - claims.keys()) & observed.virtuals.keys()

    virtual_ops: list[VirtualOp] = []
    real_ops: list[RealOp] = []
    reals_after: dict[VSKey, Mapping[Backend, Real]] = {}
    draining: dict[tuple[VSKey, Backend], float] = {}
    owners = {k: s for k, s in memory.owners.items() if k in mine and k not in gone}
    accounted = {k: m for k, m in memory.members.items() if k in mine and k not in gone}
    fallbacks: dict[str, str] = {}

    for key in sorted(claims):
        service, st = claims[key]
        sched = scheduler(st, options.scheduler)
        if st.scheduler and st.scheduler not in IPVS_SCHEDULERS:
            fallbacks[service] = st.scheduler
        cur = observed.virtuals.get(key)
        if cur is None:
            virtual_ops.append(VirtualOp("add", key, sched, st.session_affinity_seconds))
        elif (cur.scheduler, cur.timeout) != (sched, st.session_affinity_seconds):
            virtual_ops.append(VirtualOp("set", key, sched, st.session_affinity_seconds))
        wanted = {b: st.weight(b) for b in real_servers(st)}
        r = _reconcile_reals(key, cur.reals if cur else {}, wanted, memory.draining_since, options, now)
        real_ops += r.ops
        reals_after[key] = r.after
        draining.update({(key, b): t for b, t in r.draining.items()})
        owners[key] = service
        accounted[key] = members(key, st, node_set)

    for key in sorted(mine - claims.keys() - gone):
        # Not synced now (partial sync) but ours: only its draining real servers may be due.
        r = _reconcile_reals(key, observed.virtuals[key].reals, None, memory.draining_since, options, now)
        real_ops += r.ops
        reals_after[key] = r.after
        draining.update({(key, b): t for b, t in r.draining.items()})

    # What every virtual server kept accounts for: this sync's frontends, and what the last sync recorded for
    # the others (a partial sync is not given their Services).
    sets_after: dict[str, set[str]] = {name: set() for name in SET_TYPES}
    for key in reals_after:
        for name, entry in accounted.get(key, ()):
            sets_after[name].add(entry)
    for family in (IPV4, IPV6):
        sets_after[set_name(LOOPBACK_SET, family)] = {
            loopback_entry(k, b) for k, reals in reals_after.items() if family_of(k[0]) == family for b in reals}
    addresses = sets_after[IPVS_IPS_SET] | sets_after[set_name(IPVS_IPS_SET, IPV6)]
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
    known = {k: v for k, v in memory.known.items() if k in mine and k not in scope}
    known.update({key: frozenset((*st.known_backends, *st.backends, *st.external_backends))
                  for key, (_, st) in claims.items() if key[2] == "UDP"})
    stale = stale_udp(_udp_before(observed, memory, scope), udp_frontends(st for _, st in claims.values()))
    return Plan(tuple(ops), Memory(owners=owners, members={k: m for k, m in accounted.items() if k in reals_after},
                                   draining_since=draining, known=known), fallbacks, tuple(stale))


def _udp_before(observed: Observed, memory: Memory, scope: Set[VSKey]) -> dict[UdpKey, UdpFrontend]:
    """The UDP frontends in `scope` as the kernel holds them (their real servers), with the not-ready endpoints
    `memory` knew. A NodePort's virtual servers (one per node address; a port in our node-port set on an address
    not on kube-ipvs0) merge into one by port, as model/conntrack.py keys them."""
    out: dict[UdpKey, UdpFrontend] = {}
    for key in sorted(k for k in scope if k[2] == "UDP" and k in observed.virtuals):
        reals = observed.virtuals[key].reals
        family = family_of(key[0])
        node_ports = observed.ipsets.get(set_name(NODE_PORT_SETS["UDP"][0], family), frozenset())
        node_port = key[0] not in observed.addresses and node_port_entry(key) in node_ports
        ukey = ("" if node_port else key[0], key[1], family)
        mine = UdpFrontend(served=any(r.weight for r in reals.values()),
                           known=frozenset(reals) | memory.known.get(key, frozenset()),
                           addresses=frozenset({key[0]}))
        out[ukey] = out[ukey] | mine if ukey in out else mine
    return out


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
