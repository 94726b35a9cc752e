"""From desired state to one `nft -f` transaction: pure, no kernel.

The ruleset is upstream kube-proxy's nftables mode (1.29+), in tables of pyproxy's own (`ip pyproxy` and, as
upstream's `ip6 kube-proxy`, `ip6 pyproxy` for IPv6 frontends, so it never collides with a kube-proxy on the same
node). Each family's table is rendered alike by `render(..., family=)` (`Dialect`: `ip6 saddr`, `ipv6_addr`,
`dnat to [addr]:port`); a frontend goes to its own family's table, with its family's endpoints (the model's):

- `nat-prerouting`/`nat-output` (priority dstnat) jump to `services`, which looks the packet's
  `daddr . l4proto . dport` up in the verdict map `service-ips` (ClusterIPs, external IPs, load-balancer IPs),
  and for a destination in the set `nodeport-ips` (the node addresses NodePorts are served on, from the node
  inputs) its `l4proto . dport` in `service-nodeports`: O(1) however many Services there are.
  A ClusterIP's element leads to `service-HASH-ns/name/proto/port`, which picks an endpoint at random with
  `numgen` rules (ClientIP affinity first: `ip saddr @affinity-… goto endpoint-…`, one timed set per endpoint;
  see endpoint_choice() for why not upstream's literal vmap), and
  `endpoint-HASH-…__ip/port` marks hairpin traffic for masquerade and DNATs.
- The other frontends' elements lead to the port's `external-…` chain, as upstream's. externalTrafficPolicy
  Cluster: mark for masquerade (replies from another node's endpoint must come back here), then the service
  chain. Local: with --cluster-cidr, pods go to the service chain unmasqueraded (upstream's "short circuit"); the
  node's own traffic (`fib saddr type local`) is marked and goes there too; the rest, clients outside the
  cluster, goes to `local-…` (this node's endpoints; the service chain itself when they are all of them) keeping
  its source address, or is dropped when the node has none while the cluster has some. Upstream drops that case
  from a `no-endpoint-*` element checked after DNAT; pyproxy checks those maps before DNAT (below), where a drop
  would also hit the short-circuited pods and the node, so the drop is the external chain's last rule instead.
- `firewall-ips` (checked from `firewall-check`, jumped to from filter-prerouting and filter-output for new
  flows, before DNAT) sends a load-balancer IP with loadBalancerSourceRanges to its port's `firewall-…` chain,
  which drops sources outside the ranges. NodePorts, external IPs and the ClusterIP are not affected.
- A Service without ready endpoints has its frontends in `no-endpoint-services` (a NodePort: in
  `no-endpoint-nodeports`, looked up on `nodeport-ips`) instead, whose verdict `goto reject-chain` refuses the
  packet, so a client fails at once with ECONNREFUSED. Upstream answers
  ICMP port-unreachable to everything; pyproxy answers TCP with a reset, because the kernel rate-limits ICMP
  errors per client (a burst of 6, then one a second): past that, upstream's refused connects turn into
  timeouts, while resets are not limited. UDP and SCTP still get ICMP port-unreachable.
  Upstream checks that map from filter chains on input, forward and output (priority dstnat-10, before DNAT
  sees the packet); pyproxy checks it on prerouting and output. Rejecting in prerouting needs kernel 5.9 (this
  mode needs 5.13) and refuses the packet before routing, so it also works on a node with no route for the
  Service range, where the packet would otherwise die with host-unreachable and never reach forward.
  Upstream's `cluster-ips-check` (reject other ports of a ClusterIP) is left out: traffic that is not to a
  frontend stays untouched here.
- `mark-for-masquerade` sets the masquerade bit; `nat-postrouting` (priority srcnat) jumps to `masquerading`,
  which masquerades marked packets. The service chain marks ClusterIP traffic from outside `cluster_cidr`, or
  all of it with `masquerade_all`; the external chains mark as said above.

A transaction replaces what it rewrites rather than flushing the table: a chain is flushed if it exists and
added with its rules (`add chain NAME { rule; … }`); map elements are deleted and added, one command per map
for all of them; what is no longer wanted is deleted last. nft applies the whole file atomically, so no
packet ever sees a table without rules. A full sync rewrites every chain and diffs the maps against the
kernel's listing; a partial sync touches only the chains, sets and elements of the Services it is given,
found by their names (see table.py). Adds are shaped so that nft need not list the table's chains first (see
_chain_with_rules): only deletes make it do so.

Kernels before 6.2 notice only a moment after a transaction that a chain is no longer referenced by a map
element, so deleting it in the same transaction fails with EBUSY. With `defer_deletes`, stale chains are
flushed and returned as `Plan.deferred`; a later render deletes those its caller marks as old enough in
`pending` (upstream waits a second).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.table import (
    AFFINITY_PREFIX,
    ENDPOINT_PREFIX,
    ENDPOINT_SEP,
    EXTERNAL_PREFIX,
    FAMILIES,
    FIREWALL_IPS,
    FIREWALL_PREFIX,
    LOCAL_PREFIX,
    NO_ENDPOINT_NODEPORTS,
    NO_ENDPOINT_SERVICES,
    NODEPORT_IPS,
    SERVICE_IPS,
    SERVICE_NODEPORTS,
    SERVICE_PREFIX,
    TABLE,
    Elem,
    ElemKey,
    Hook,
    TableState,
    elem_owner,
    owner,
)
from pyproxy.model.conntrack import Stale, UdpFrontend, UdpKey, stale_udp, udp_frontends
from pyproxy.model.objects import join_host_port
from pyproxy.model.state import Backend, FrontendKind, ServicePortState

# nft's object names are at most 256 bytes; prefixes ("endpoint-", …) stay within 16 (as upstream).
NAME_BASE_MAX = 256 - 16
# nft refuses element comments longer than this.
COMMENT_MAX = 128

SERVICES_CHAIN = "services"
ENDPOINTS_CHECK_CHAIN = "service-endpoints-check"
FIREWALL_CHECK_CHAIN = "firewall-check"
REJECT_CHAIN = "reject-chain"
MARK_MASQ_CHAIN = "mark-for-masquerade"
MASQUERADING_CHAIN = "masquerading"

# Numeric priorities: nft 1.0.6 accepts `dstnat` only on prerouting. dstnat = -100, srcnat = 100.
BASE_CHAINS: Mapping[str, Hook] = {
    "filter-prerouting": Hook("filter", "prerouting", -110),
    "filter-output": Hook("filter", "output", -110),
    "nat-prerouting": Hook("nat", "prerouting", -100),
    "nat-output": Hook("nat", "output", -100),
    "nat-postrouting": Hook("nat", "postrouting", 100),
}


class Dialect(NamedTuple):
    """What differs between the family's tables: the table's family, the address match (`ip saddr`, `ip6
    saddr`), the address type of maps and sets, and how `dnat to` writes an address with a port."""

    family: int
    """4 or 6 (model.objects.IPV4, IPV6)."""
    table: str
    """The table's family: "ip" or "ip6"."""
    addr: str
    """The address match's protocol: "ip" or "ip6"."""
    addr_type: str
    """"ipv4_addr" or "ipv6_addr"."""

    def to(self, b: Backend) -> str:
        """`dnat to`'s argument: an IPv6 address in brackets before its port, as nft writes it."""
        return join_host_port(b.ip, b.port)


V4 = Dialect(4, FAMILIES[4], "ip", "ipv4_addr")
V6 = Dialect(6, FAMILIES[6], "ip6", "ipv6_addr")
DIALECTS = {4: V4, 6: V6}

_NODEPORT_MAP_TYPE = "inet_proto . inet_service : verdict"
MAPS: Mapping[str, tuple[str, str]] = {
    SERVICE_IPS: ("", "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
    SERVICE_NODEPORTS: (_NODEPORT_MAP_TYPE, "NodePort traffic"),
    NO_ENDPOINT_SERVICES: ("", "vmap to reject packets to services with no endpoints"),
    NO_ENDPOINT_NODEPORTS: (_NODEPORT_MAP_TYPE, "vmap to reject packets to service nodeports with no endpoints"),
    FIREWALL_IPS: ("", "destinations that are subject to LoadBalancerSourceRanges"),
}
"""Name -> (type, comment); "": keyed by the family's address, protocol and port (`_map_type`). Keys of the
node-port maps are `proto . port`: ElemKeys with "" for the address."""


def _map_type(name: str, d: Dialect) -> str:
    return MAPS[name][0] or f"{d.addr_type} . inet_proto . inet_service : verdict"


def _nodeport_ips_spec(d: Dialect) -> str:
    return f'type {d.addr_type}; comment "IPs that accept NodePort traffic";'


def _lookup(d: Dialect) -> str:
    return f"{d.addr} daddr . meta l4proto . th dport vmap @"


def _nodeport_lookup(d: Dialect) -> str:
    return f"{d.addr} daddr @{NODEPORT_IPS} meta l4proto . th dport vmap @"


def fixed_chains(masq: MasqueradeSettings, d: Dialect = V4) -> dict[str, tuple[str, ...]]:
    """The chains every sync keeps as they are, base chains first, with their rules."""
    mark = masquerade_mark(masq.masquerade_bit)
    checks = (f"ct state new jump {FIREWALL_CHECK_CHAIN}", f"ct state new jump {ENDPOINTS_CHECK_CHAIN}")
    lookup, nodeport_lookup = _lookup(d), _nodeport_lookup(d)
    return {
        "filter-prerouting": checks,
        "filter-output": checks,
        "nat-prerouting": (f"jump {SERVICES_CHAIN}",),
        "nat-output": (f"jump {SERVICES_CHAIN}",),
        "nat-postrouting": (f"jump {MASQUERADING_CHAIN}",),
        SERVICES_CHAIN: (lookup + SERVICE_IPS, nodeport_lookup + SERVICE_NODEPORTS),
        ENDPOINTS_CHECK_CHAIN: (lookup + NO_ENDPOINT_SERVICES, nodeport_lookup + NO_ENDPOINT_NODEPORTS),
        FIREWALL_CHECK_CHAIN: (lookup + FIREWALL_IPS,),
        # `reject`: ICMP port unreachable in `ip`, ICMPv6 port unreachable in `ip6` (nft's default per family).
        REJECT_CHAIN: ("meta l4proto tcp reject with tcp reset", "reject"),
        MARK_MASQ_CHAIN: (f"mark set mark or {mark}",),
        MASQUERADING_CHAIN: (f"mark and {mark} == 0 return", f"mark set mark xor {mark}", "masquerade fully-random"),
    }


def masquerade_mark(bit: int) -> str:
    if not 0 <= bit <= 31:
        raise ValueError(f"masquerade bit {bit} is not 0-31")
    return f"{1 << bit:#010x}"


# ------------------------------------------------------------------------------------------------- names


def _hashed(base: str) -> str:
    """HASH-base, as upstream: the hash keeps names unique if truncated and tells similar ones apart."""
    digest = base64.b32encode(hashlib.sha256(base.encode()).digest()).decode()[:8]
    name = f"{digest}-{base}"
    return name if len(name) <= NAME_BASE_MAX else name[: NAME_BASE_MAX - 3] + "..."


def _port_base(sp: ServicePortState) -> str:
    return f"{sp.service}/{sp.frontend.protocol.value.lower()}/{sp.port_name}"


def service_chain(sp: ServicePortState) -> str:
    return SERVICE_PREFIX + _hashed(_port_base(sp))


def _endpoint_base(sp: ServicePortState, b: Backend) -> str:
    # nft names cannot hold a colon: an IPv6 address is written with dots instead, as upstream's
    # servicePortEndpointChainNameBase does (table.endpoint_of reads it back).
    return f"{_port_base(sp)}{ENDPOINT_SEP}{b.ip.replace(':', '.')}/{b.port}"


def endpoint_chain(sp: ServicePortState, b: Backend) -> str:
    return ENDPOINT_PREFIX + _hashed(_endpoint_base(sp, b))


def affinity_set(sp: ServicePortState, b: Backend) -> str:
    return AFFINITY_PREFIX + _hashed(_endpoint_base(sp, b))


def external_chain(sp: ServicePortState) -> str:
    return EXTERNAL_PREFIX + _hashed(_port_base(sp))


def local_chain(sp: ServicePortState) -> str:
    return LOCAL_PREFIX + _hashed(_port_base(sp))


def firewall_chain(sp: ServicePortState) -> str:
    return FIREWALL_PREFIX + _hashed(_port_base(sp))


def elem_key(sp: ServicePortState) -> ElemKey:
    """A frontend's key in the verdict maps: a NodePort's is its protocol and port (on any of `nodeport-ips`)."""
    fe = sp.frontend
    return ("" if sp.kind is FrontendKind.NODE_PORT else fe.ip, fe.protocol.value.lower(), fe.port)


# ------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    commands: tuple[str, ...]
    state: TableState
    """What the table holds once the commands ran."""
    stale_udp: tuple[Stale, ...] = ()
    """UDP conntrack entries to delete once the transaction is in (model/conntrack.py's plan)."""
    deferred: frozenset[str] = frozenset()
    """Stale chains left flushed but not deleted (defer_deletes)."""

    @property
    def script(self) -> str:
        return "".join(c + "\n" for c in self.commands)

    @property
    def rule_count(self) -> int:
        return sum(c.count("; ") - 2 * ("{ type " in c) if c.startswith("add chain ") else c.startswith("add rule ")
                   for c in self.commands)


@dataclass
class _Port:
    """The chains (endpoints first, the service chain last) and affinity sets of one service port."""

    chains: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sets: dict[str, int] = field(default_factory=dict)


@dataclass
class _Wanted:
    ports: list[_Port] = field(default_factory=list)
    elements: dict[str, dict[ElemKey, Elem]] = field(default_factory=lambda: {m: {} for m in MAPS})
    known: dict[ElemKey, frozenset[Backend]] = field(default_factory=dict)

    def chains(self) -> set[str]:
        return {name for p in self.ports for name in p.chains}

    def sets(self) -> set[str]:
        return {name for p in self.ports for name in p.sets}


def _t(kind: str, name: str, rest: str = "", d: Dialect = V4) -> str:
    return f"{kind} {d.table} {TABLE} {name}{' ' + rest if rest else ''}"


def _hook_spec(h: Hook) -> str:
    return f"{{ type {h.type} hook {h.hook} priority {h.priority}; policy accept; }}"


def base_commands(state: TableState, masq: MasqueradeSettings, d: Dialect = V4) -> list[str]:
    """The table of `d`'s family, its base and helper chains and maps, all rewritten. Also the dry run of
    start()."""
    cmds = [f'add table {d.table} {TABLE} {{ comment "rules for pyproxy"; }}']
    for name, hook in BASE_CHAINS.items():
        if name in state.chains and state.chains[name] != hook:
            cmds.append(_t("delete chain", name, d=d))  # a hook or priority cannot change in place
        cmds.append(_t("add chain", name, _hook_spec(hook), d))
    chains = fixed_chains(masq, d)
    cmds += [_t("add chain", name, d=d) for name in chains if name not in BASE_CHAINS]
    cmds += [_t("add map", name, f"{{ {_map_spec(name, d)} }}", d) for name in MAPS]
    cmds.append(_t("add set", NODEPORT_IPS, f"{{ {_nodeport_ips_spec(d)} }}", d))
    for name, rules in chains.items():
        cmds.append(_t("flush chain", name, d=d))
        cmds.append(_chain_with_rules(name, rules, BASE_CHAINS.get(name), d))
    return cmds


def _chain_with_rules(name: str, rules: Iterable[str], hook: Hook | None = None, d: Dialect = V4) -> str:
    """`add chain NAME { rule; … }`: unlike `add rule`, nft needs no listing of the table's chains for it,
    which it would fetch from the kernel first, in seconds at 100,000 chains (the dump is quadratic)."""
    spec = f"type {hook.type} hook {hook.hook} priority {hook.priority}; policy accept; " if hook else ""
    return _t("add chain", name, "{ " + spec + "".join(r + "; " for r in rules) + "}", d)


def _map_spec(name: str, d: Dialect = V4) -> str:
    return f'type {_map_type(name, d)}; comment "{MAPS[name][1]}";'


def nodeport_ips_commands(ips: Iterable[str], d: Dialect = V4) -> list[str]:
    """`nodeport-ips` made to hold exactly `ips` (of `d`'s family)."""
    ips = sorted(ips)
    spec = _nodeport_ips_spec(d)
    cmds = [_t("add set", NODEPORT_IPS, f"{{ {spec} }}", d), _t("flush set", NODEPORT_IPS, d=d)]
    if ips:
        cmds.append(_t("add set", NODEPORT_IPS, f"{{ {spec} elements = {{ {', '.join(ips)} }} }}", d))
    return cmds


def _port_objects(states: Sequence[ServicePortState], masq: MasqueradeSettings, wanted: _Wanted,
                  d: Dialect = V4) -> _Port:
    """The chains and sets of the frontends of one service port (all its frontends share its endpoints and
    policy, but internalTrafficPolicy Local gives its ClusterIPs this node's only), and their map elements,
    added to `wanted`."""
    external = next((st for st in states if st.kind.external), None)  # the policy of the external frontends
    # The port's cluster-wide endpoints are the external frontends' `backends`; a ClusterIP's differ from them
    # only with internalTrafficPolicy Local, and a port with ClusterIPs only has no other.
    sp = external or states[0]
    port = _Port()
    proto = sp.frontend.protocol.value.lower()
    ranges = next((st.source_ranges for st in states if st.source_ranges), ())
    if ranges:
        port_fw = firewall_chain(sp)
    # Upstream's internal traffic chain: the service chain, or with internalTrafficPolicy Local (when this
    # node's endpoints are not all of them) the local chain, which eTP=Local's external chain may share.
    internal = next((st for st in states if st.kind is FrontendKind.CLUSTER_IP), None)
    local_internal = internal is not None and internal.backends and internal.backends != sp.backends
    internal_chain = local_chain(sp) if local_internal else service_chain(sp)
    for st in states:
        key, node_port = elem_key(st), st.kind is FrontendKind.NODE_PORT
        if st.source_ranges:
            wanted.elements[FIREWALL_IPS][key] = Elem(f"goto {port_fw}")
        wanted.known[key] = frozenset(st.known_backends) | frozenset(st.backends)
        if not st.backends:
            comment = st.display_name[:COMMENT_MAX]  # the owner, `ns/name`, comes first and fits
            reject_map = NO_ENDPOINT_NODEPORTS if node_port else NO_ENDPOINT_SERVICES
            # internalTrafficPolicy Local, no endpoint here while the cluster has some: upstream's drop verdict.
            wanted.elements[reject_map][key] = Elem("drop" if st.drop else f"goto {REJECT_CHAIN}", comment)
        else:
            chain = external_chain(sp) if st.kind.external else internal_chain
            wanted.elements[SERVICE_NODEPORTS if node_port else SERVICE_IPS][key] = Elem(f"goto {chain}")
    if ranges:
        port.chains[port_fw] = (f"{d.addr} saddr != {{ {', '.join(ranges)} }} drop",)
    endpoints = {b for st in states for b in (*st.backends, *st.external_backends)}
    if not endpoints:
        return port
    affinity = sp.session_affinity_seconds
    for b in sorted(endpoints):
        rules = [f"{d.addr} saddr {b.ip} jump {MARK_MASQ_CHAIN}"]  # hairpin: an endpoint reaching itself
        if affinity:
            port.sets[affinity_set(sp, b)] = affinity
            rules.append(f"update @{affinity_set(sp, b)} {{ {d.addr} saddr }}")
        rules.append(f"meta l4proto {proto} dnat to {d.to(b)}")
        port.chains[endpoint_chain(sp, b)] = tuple(rules)
    rules = []
    cluster_cidr = masq.cluster_cidr_of(d.family)
    for st in states:
        if st.kind is not FrontendKind.CLUSTER_IP:
            continue
        match = f"{d.addr} daddr {st.frontend.ip} {proto} dport {st.frontend.port}"
        if masq.masquerade_all:
            rules.append(f"{match} jump {MARK_MASQ_CHAIN}")
        elif cluster_cidr:
            rules.append(f"{match} {d.addr} saddr != {cluster_cidr} jump {MARK_MASQ_CHAIN}")
    if sp.backends:
        port.chains[service_chain(sp)] = tuple(([] if local_internal else rules) + _choice(sp, sp.backends, d))
    if external:
        port.chains.update(_external_chains(external, masq, d))
    if local_internal:
        # The ClusterIPs' masquerade rules go with them (they match only a ClusterIP destination, so external
        # traffic sharing the chain passes them), as upstream writes them into the internal traffic chain.
        assert internal is not None
        port.chains[local_chain(sp)] = tuple(rules + _choice(sp, internal.backends, d))
    return port


def _choice(sp: ServicePortState, backends: Sequence[Backend], d: Dialect = V4) -> list[str]:
    """A policy chain's rules: affinity first, then a random endpoint among `backends`."""
    rules = []
    if sp.session_affinity_seconds:
        rules += [f"{d.addr} saddr @{affinity_set(sp, b)} goto {endpoint_chain(sp, b)}" for b in backends]
    return rules + endpoint_choice([endpoint_chain(sp, b) for b in backends])


def _external_chains(sp: ServicePortState, masq: MasqueradeSettings, d: Dialect = V4) -> dict[str, tuple[str, ...]]:
    """Upstream's `external-…` chain, where traffic to the port's NodePorts, external and load-balancer IPs goes,
    and for externalTrafficPolicy Local the `local-…` chain of this node's endpoints it leads to (the service
    chain itself when those are all the endpoints)."""
    cluster = service_chain(sp)
    if sp.masquerade:  # externalTrafficPolicy Cluster: replies must come back through this node
        return {external_chain(sp): (f"jump {MARK_MASQ_CHAIN}", f"goto {cluster}")}
    chains: dict[str, tuple[str, ...]] = {}
    rules = []
    if cluster_cidr := masq.cluster_cidr_of(d.family):
        # Upstream's "short circuit": pods reach every endpoint, keeping their address, as if they had gone out
        # to the load balancer and come back in.
        rules.append(f"{d.addr} saddr {cluster_cidr} goto {cluster}")
    # The node's own traffic: every endpoint, masqueraded (its source is a node address, maybe the VIP itself).
    rules += [f"fib saddr type local jump {MARK_MASQ_CHAIN}", f"fib saddr type local goto {cluster}"]
    if not sp.external_backends:
        rules.append("drop")  # no local endpoint while the cluster has some: the client waits for another node
    elif tuple(sp.external_backends) == tuple(sp.backends):
        rules.append(f"goto {cluster}")
    else:
        chains[local_chain(sp)] = tuple(_choice(sp, sp.external_backends, d))
        rules.append(f"goto {local_chain(sp)}")
    chains[external_chain(sp)] = tuple(rules)
    return chains


def endpoint_choice(chains: Sequence[str]) -> list[str]:
    """Rules that go to one of `chains` picked uniformly at random: rule i of n goes to chain i with
    probability 1/(n-i) (`numgen random mod n-i 0`), so each is picked with probability 1/n, as iptables'
    `statistic --probability` chain does. Not upstream's one `numgen random mod n vmap { 0 : goto …, … }`:
    that literal map is an anonymous set in the kernel, and a transaction creating thousands of them grows
    quadratically (5,000 Services: 22 s; 10,000: over a minute), while these rules grow linearly. A new
    flow walks at most n rules, once (NAT chains see only a flow's first packet)."""
    n = len(chains)
    return [f"numgen random mod {n - i} 0 goto {c}" for i, c in enumerate(chains[:-1])] + [f"goto {chains[-1]}"]


def _collect(services: Mapping[str, Iterable[ServicePortState]], masq: MasqueradeSettings, d: Dialect) -> _Wanted:
    wanted = _Wanted()
    by_port: dict[str, list[ServicePortState]] = {}
    for service in sorted(services):
        # Unique: the model decided which Service serves a frontend.
        for sp in services[service]:
            by_port.setdefault(service_chain(sp), []).append(sp)
    wanted.ports = [_port_objects(states, masq, wanted, d) for states in by_port.values()]
    return wanted


def _port_commands(port: _Port, state: TableState, d: Dialect) -> list[str]:
    """Sets, then chains, each created with its rules (flushed first if it exists)."""
    cmds = [_t("flush chain", name, d=d) for name in port.chains if name in state.chains]
    for name, timeout in port.sets.items():
        if name in state.sets and state.sets[name] == timeout:
            continue
        if name in state.sets:
            # A set's timeout cannot change in place on every kernel; its users were flushed just above.
            cmds.append(_t("delete set", name, d=d))
        cmds.append(_t("add set", name, f"{{ type {d.addr_type}; flags dynamic,timeout; timeout {timeout}s; }}", d))
    cmds += [_chain_with_rules(name, rules, d=d) for name, rules in port.chains.items()]
    return cmds


def _key_text(key: ElemKey) -> str:
    return f"{key[0]} . {key[1]} . {key[2]}" if key[0] else f"{key[1]} . {key[2]}"


def _elem_text(key: ElemKey, e: Elem) -> str:
    comment = f' comment "{e.comment}"' if e.comment else ""
    return f"{_key_text(key)}{comment} : {e.verdict}"


def _element_commands(old: Mapping[str, Mapping[ElemKey, Elem]], new: Mapping[str, Mapping[ElemKey, Elem]],
                      d: Dialect) -> list[str]:
    """Deletes of elements gone or changed, then adds of new or changed ones (nft cannot replace a value)."""
    deletes, adds = [], []
    for m in MAPS:
        gone = [k for k, e in old[m].items() if new[m].get(k) != e]
        added = [(k, e) for k, e in new[m].items() if old[m].get(k) != e]
        if gone:
            deletes.append(_t("delete element", m, "{ " + ", ".join(_key_text(k) for k in gone) + " }", d))
        if added:
            # Inside the map's declaration rather than `add element`, for which nft would fetch the chains.
            elements = ", ".join(_elem_text(k, e) for k, e in added)
            adds.append(_t("add map", m, f"{{ {_map_spec(m, d)} elements = {{ {elements} }} }}", d))
    return deletes + adds


def _old_udp(old_served: Mapping[ElemKey, Elem], old_known: Mapping[ElemKey, frozenset[Backend]], family: int
             ) -> dict[UdpKey, UdpFrontend]:
    """The UDP frontends as the table of `family` held them (read back after a restart too: the table records
    each frontend's known endpoints, so endpoints that left while pyproxy was down are cleared as well).
    `old_served`: the elements of `service-ips` and `service-nodeports` in scope (their keys never collide)."""
    return {(vip, port, family): UdpFrontend(served=(vip, proto, port) in old_served,
                                             known=old_known.get((vip, proto, port), frozenset()))
            for vip, proto, port in set(old_known) | set(old_served) if proto == "udp"}


def render(state: TableState, services: Mapping[str, Iterable[ServicePortState]], masq: MasqueradeSettings, *,
           full: bool, pending: Mapping[str, bool] | None = None, defer_deletes: bool = False,
           lazy_deletes: bool = False, nodeport_ips: Iterable[str] = (), family: int = 4) -> Plan:
    """Plan one transaction. `full`: `services` is every Service, and whatever else the table holds goes.
    Otherwise `services` holds the changed Services only (an empty iterable: the Service is gone), and only
    their objects are touched. `pending`: chains an earlier plan deferred -> whether they may go now.
    `lazy_deletes`: stale chains are deferred (as with `defer_deletes`) unless the transaction deletes
    something else anyway: any delete makes nft list every chain of the table first, which costs seconds at
    100,000 chains, so a sync that only adds and flushes stays small. `nodeport_ips`: the node addresses
    NodePorts are served on (`NodeInputs.nodeport_addresses`), the contents of `nodeport-ips`, written when a
    full sync runs or they changed. `family`: the table rendered (4: `ip pyproxy`, 6: `ip6 pyproxy`); `state`,
    `services` and `nodeport_ips` are that family's (the caller splits the desired state by family)."""
    d = DIALECTS[family]
    pending = pending or {}
    nodeport_set = frozenset(nodeport_ips)
    services = {k: tuple(v) for k, v in services.items()}
    wanted = _collect(services, masq, d)

    def in_scope(o: str | None) -> bool:
        return full or o in services

    fixed = fixed_chains(masq, d)
    cmds = base_commands(state, masq, d) if full else []
    if full or nodeport_set != state.nodeport_ips:
        cmds += nodeport_ips_commands(nodeport_set, d)
    for port in wanted.ports:
        cmds += _port_commands(port, state, d)

    old_elems = {m: {k: e for k, e in state.elems(m).items() if in_scope(elem_owner(m, e))} for m in MAPS}
    cmds += _element_commands(old_elems, wanted.elements, d)

    wanted_chains = wanted.chains() | set(fixed)
    stale_chains = sorted(c for c in state.chains if c not in wanted_chains and (in_scope(owner(c)) or c in pending))
    stale_sets = sorted(s for s in state.sets if s not in wanted.sets() and s != NODEPORT_IPS and in_scope(owner(s)))
    stale_maps = sorted(state.maps - set(MAPS)) if full else []
    other_deletes = any(c.startswith("delete ") for c in cmds) or stale_sets or stale_maps
    deleted = [c for c in stale_chains if (not defer_deletes or pending.get(c, False))
               and (not lazy_deletes or other_deletes)]
    cmds += [_t("flush chain", c, d=d) for c in stale_chains if c not in pending]
    cmds += [_t("delete set", s, d=d) for s in stale_sets] + [_t("delete map", m, d=d) for m in stale_maps]
    cmds += [_t("delete chain", c, d=d) for c in deleted]

    scope_keys = {k for m in (SERVICE_IPS, NO_ENDPOINT_SERVICES, SERVICE_NODEPORTS, NO_ENDPOINT_NODEPORTS)
                  for k in old_elems[m]}
    old_known = {k: v for k, v in state.known.items() if k in scope_keys}
    after = replace(_after(state, wanted, fixed, old_elems, deleted, stale_sets, stale_maps, full),
                    nodeport_ips=nodeport_set)
    old_served = {**old_elems[SERVICE_IPS], **old_elems[SERVICE_NODEPORTS]}
    new_udp = udp_frontends(st for states in services.values() for st in states)
    return Plan(commands=tuple(cmds), state=after,
                stale_udp=tuple(stale_udp(_old_udp(old_served, old_known, family), new_udp)),
                deferred=frozenset(stale_chains) - frozenset(deleted))


def _after(state: TableState, wanted: _Wanted, fixed: Mapping[str, tuple[str, ...]],
           old_elems: Mapping[str, Mapping[ElemKey, Elem]], deleted: Iterable[str], stale_sets: Iterable[str],
           stale_maps: Iterable[str], full: bool) -> TableState:
    chains = dict(state.chains)
    for c in deleted:
        chains.pop(c, None)
    if full:
        chains.update({name: BASE_CHAINS.get(name) for name in fixed})
    chains.update({name: None for name in wanted.chains()})
    sets = {s: t for s, t in state.sets.items() if s not in set(stale_sets)}
    if full:
        sets[NODEPORT_IPS] = None
    for p in wanted.ports:
        sets.update(p.sets)
    elements = {}
    for m in set(state.elements) | set(MAPS):
        kept = {k: e for k, e in state.elems(m).items() if k not in old_elems.get(m, {})}
        elements[m] = {**kept, **wanted.elements.get(m, {})}
    scope = {k for m in old_elems.values() for k in m}
    known = {k: v for k, v in state.known.items() if k not in scope}
    known.update(wanted.known)
    maps = (state.maps - frozenset(stale_maps)) | (frozenset(MAPS) if full else frozenset())
    return TableState(present=state.present or full, chains=chains, sets=sets, maps=maps,
                      elements={m: e for m, e in elements.items() if m in maps}, known=known)
