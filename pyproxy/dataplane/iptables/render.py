"""From desired state to one iptables-restore input: pure, no kernel.

The rules are upstream kube-proxy's (iptables mode, v1.2x), so a node moving between kube-proxy and pyproxy
sees the same chains under the same names. Per service port (`HASH` = upstream's hash of its name and protocol):

    nat     PREROUTING, OUTPUT -> KUBE-SERVICES, per frontend:
              ClusterIP: [mark for SNAT (--masquerade-all / --cluster-cidr),] -> KUBE-SVC-HASH
              external IP -> KUBE-EXT-HASH; load-balancer IP -> KUBE-FW-HASH (loadBalancerSourceRanges) or KUBE-EXT
              last: the node-port addresses -> KUBE-NODEPORTS: per nodePort -> KUBE-EXT-HASH
            KUBE-SVC-HASH: [affinity: -m recent --rcheck per endpoint,] one endpoint at random
                (`-m statistic --probability 1/(n-i)`, the last rule unconditional)
            KUBE-SEP-<hash>: hairpin (-s endpoint) -> KUBE-MARK-MASQ; [affinity: --set;] DNAT
            KUBE-EXT-HASH: externalTrafficPolicy Cluster: mark for SNAT, -> KUBE-SVC. Local: pods (--cluster-cidr)
                -> KUBE-SVC; the node's own traffic (`addrtype --src-type LOCAL`) marked, -> KUBE-SVC; the rest
                -> KUBE-SVL-HASH (this node's endpoints), or on through untranslated when it has none
            KUBE-FW-HASH: sources in the ranges -> KUBE-EXT; the rest goes on untranslated
            POSTROUTING -> KUBE-POSTROUTING: MASQUERADE what carries the mark
    filter  INPUT, FORWARD, OUTPUT (new connections) -> KUBE-SERVICES: REJECT ClusterIPs without endpoints
            INPUT, FORWARD (new connections) -> KUBE-EXTERNAL-SERVICES: REJECT the other frontends without
                endpoints, DROP those of externalTrafficPolicy Local without one on this node
            INPUT, FORWARD, OUTPUT (new connections) -> KUBE-PROXY-FIREWALL: DROP what is still addressed to a
                load-balancer IP with source ranges (its KUBE-FW chain let it through untranslated)
            INPUT -> KUBE-NODEPORTS: ACCEPT the healthCheckNodePorts
            FORWARD -> KUBE-FORWARD: accept what is marked for SNAT
    (REJECT with a TCP reset where upstream sends ICMP port-unreachable: see `_reject_with`.)

The drops are in filter, as upstream's, for two reasons: iptables refuses DROP in nat, and filter sees a flow
after DNAT, so a rule matching the frontend's own address catches exactly the flows no nat rule translated
(the short-circuited pod and node flows of a Local frontend are already DNATed and pass).

`render()` returns a `Plan`: the restore text, the `Applied` state that holds once it ran, and the UDP
conntrack entries to delete afterwards (model/conntrack.py plans them, as for every netfilter mode). A partial
sync (`changed` = Service keys) rewrites only those Services' chains, plus the chains that hold every
Service's rules (both KUBE-SERVICES, KUBE-NODEPORTS in nat and filter, KUBE-EXTERNAL-SERVICES,
KUBE-PROXY-FIREWALL), which are rewritten whole every time (as upstream) so a frontend's position never
depends on sync history. Chains of a Service that went, or of its endpoints or frontends that went, are
flushed and deleted (`-X` at the end, after the rules that jumped to them are gone). A full sync
(`changed=None`) also reconciles against what iptables-save shows: every per-service chain of ours (KUBE-SVC-,
-SEP-, -EXT-, -FW-, -SVL-) not wanted goes, and missing jumps from the built-in chains are inserted (never
duplicated).

iptables-restore applies each table's part as one transaction, so a failed sync leaves the previous rules.

IPv6 frontends get the same chains, written by `render(..., family=6)` for ip6tables-restore (as upstream's IPv6
proxier): addresses as /128, `--to-destination [addr]:port`, `--reject-with icmp6-port-unreachable` for what is
not TCP, --cluster-cidr's IPv6 CIDR, and endpoint chain names hashed from upstream's "[addr]:port".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from pyproxy.dataplane import netfilter as nf
from pyproxy.model.conntrack import Stale, stale_udp_states
from pyproxy.model.objects import IPV6, Protocol, family_of, join_host_port
from pyproxy.model.state import Backend, DesiredState, Frontend, FrontendKind, ServicePortState

SVC_PREFIX = "KUBE-SVC-"
SEP_PREFIX = "KUBE-SEP-"
EXT_PREFIX = "KUBE-EXT-"
FW_PREFIX = "KUBE-FW-"
SVL_PREFIX = "KUBE-SVL-"
SERVICE_PREFIXES = (SVC_PREFIX, SEP_PREFIX, EXT_PREFIX, FW_PREFIX, SVL_PREFIX)
"""The per-service chains (all in nat): a partial sync writes and removes them per Service."""

NODEPORTS_CHAIN = "KUBE-NODEPORTS"
EXTERNAL_SERVICES_CHAIN = "KUBE-EXTERNAL-SERVICES"
FIREWALL_CHAIN = "KUBE-PROXY-FIREWALL"
FIXED_CHAINS = frozenset({("nat", NODEPORTS_CHAIN), ("filter", NODEPORTS_CHAIN), ("filter", EXTERNAL_SERVICES_CHAIN),
                          ("filter", FIREWALL_CHAIN)})
"""(table, chain): the chains only this mode makes that hold every Service's rules, rewritten whole each sync."""

PORTALS = "kubernetes service portals"
NEW_ONLY = ("-m", "conntrack", "--ctstate", "NEW")
NODEPORTS_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
# Upstream's order: each is inserted at the top of its chain, so in FORWARD, KUBE-PROXY-FIREWALL ends up first,
# then KUBE-FORWARD.
JUMPS = (
    *(nf.Jump("filter", chain, EXTERNAL_SERVICES_CHAIN, "kubernetes externally-visible service portals", NEW_ONLY)
      for chain in ("INPUT", "FORWARD")),
    nf.Jump("filter", "INPUT", NODEPORTS_CHAIN, "kubernetes health check service ports"),
    *(nf.Jump("filter", chain, nf.SERVICES_CHAIN, PORTALS, NEW_ONLY) for chain in ("INPUT", "FORWARD", "OUTPUT")),
    *nf.MASQUERADE_JUMPS,
    *(nf.Jump("filter", chain, FIREWALL_CHAIN, "kubernetes load balancer firewall", NEW_ONLY)
      for chain in ("INPUT", "OUTPUT", "FORWARD")),
    nf.Jump("nat", "OUTPUT", nf.SERVICES_CHAIN, PORTALS),
    nf.Jump("nat", "PREROUTING", nf.SERVICES_CHAIN, PORTALS),
)


@dataclass(frozen=True)
class AppliedService:
    ports: tuple[ServicePortState, ...]
    """The frontends as last programmed (for conntrack: which endpoints left)."""
    chains: frozenset[str]
    """The per-service chains (SERVICE_PREFIXES) in nat that belong to this Service."""


Applied = Mapping[str, AppliedService]


@dataclass(frozen=True)
class Plan:
    text: str
    applied: dict[str, AppliedService]
    stale_udp: tuple[Stale, ...] = ()
    """UDP conntrack entries to delete once the restore is in (model/conntrack.py's plan)."""
    written: int = 0
    """Chains written (created or rewritten)."""
    removed: int = 0
    """Chains deleted."""
    rules: int = 0
    """Rules written."""


# ---------------------------------------------------------------------------------------------- naming


def _proto(fe: Frontend) -> str:
    return fe.protocol.value.lower()


def port_name(sp: ServicePortState) -> str:
    return nf.service_port_name(sp.service, sp.port_name)


def _port_hash(sp: ServicePortState) -> str:
    """Upstream's portProtoHash: of servicePortName + lowercase protocol, shared by the port's chains."""
    return nf.chain_hash(port_name(sp) + _proto(sp.frontend))


def svc_chain(sp: ServicePortState) -> str:
    """Upstream's servicePortPolicyClusterChain: every endpoint of the port."""
    return SVC_PREFIX + _port_hash(sp)


def ext_chain(sp: ServicePortState) -> str:
    """Upstream's serviceExternalChainName: where the port's NodePorts, external and load-balancer IPs lead."""
    return EXT_PREFIX + _port_hash(sp)


def svl_chain(sp: ServicePortState) -> str:
    """Upstream's servicePortPolicyLocalChainName: this node's endpoints (externalTrafficPolicy Local)."""
    return SVL_PREFIX + _port_hash(sp)


def fw_chain(sp: ServicePortState) -> str:
    """Upstream's serviceFirewallChainName: loadBalancerSourceRanges."""
    return FW_PREFIX + _port_hash(sp)


def _host(ip: str) -> str:
    """An address as a one-address network: /32, or /128 for IPv6."""
    return f"{ip}/128" if family_of(ip) == IPV6 else f"{ip}/32"


def _endpoint(b: Backend) -> str:
    """"ip:port", an IPv6 address in brackets (upstream's endpoint string, net.JoinHostPort; DNAT's form)."""
    return join_host_port(b.ip, b.port)


def sep_chain(sp: ServicePortState, backend: Backend) -> str:
    """Upstream's servicePortEndpointChainName: hash of servicePortName + protocol + "ip:port"."""
    return SEP_PREFIX + nf.chain_hash(port_name(sp) + _proto(sp.frontend) + _endpoint(backend))


def probability(n: int) -> str:
    """Upstream's computeProbability: 1/n with 10 decimals."""
    return f"{1.0 / n:0.10f}"


def is_mode_chain(table: str, chain: str) -> bool:
    """Chains only the iptables mode makes (for cleanup)."""
    return (table == "nat" and chain.startswith(SERVICE_PREFIXES)) or (table, chain) in FIXED_CHAINS


def is_mode_rule(table: str, chain: str, body: str) -> bool:
    """Rules of the iptables mode in the shared KUBE-SERVICES chains that do not jump to one of its own chains
    (for cleanup): the rejections, and the masquerade marks, found by upstream's comments."""
    if chain != nf.SERVICES_CHAIN:
        return False
    if table == "filter":
        return "has no endpoints" in body or "has no local endpoints" in body
    return ' cluster IP"' in body


# ----------------------------------------------------------------------------------------------- rules


def _match(fe: Frontend) -> str:
    p = _proto(fe)
    return f"-m {p} -p {p} -d {_host(fe.ip)} --dport {fe.port}"


def _comment(text: str) -> str:
    return f'-m comment --comment "{text}"'


def _reject_with(sp: ServicePortState) -> str:
    """Upstream rejects with ICMP port-unreachable, which the kernel rate-limits per client (a burst of 6, then
    one a second), so past a few connects clients time out instead of failing fast. A TCP reset is not
    limited and fails a connect with the same ECONNREFUSED; UDP and SCTP keep the ICMP error (ICMPv6's for IPv6,
    which is also ip6tables' default, written out as ip6tables-save shows it)."""
    if sp.frontend.protocol is Protocol.TCP:
        return " --reject-with tcp-reset"
    return " --reject-with icmp6-port-unreachable" if sp.family == 6 else ""


@dataclass
class SharedRules:
    """Bodies of the chains that hold every Service's rules, in a stable order."""

    services: list[str] = field(default_factory=list)
    """nat KUBE-SERVICES."""
    nodeports: dict[str, str] = field(default_factory=dict)
    """nat KUBE-NODEPORTS: one rule per service port (by its KUBE-EXT chain), whatever its node addresses."""
    reject: list[str] = field(default_factory=list)
    """filter KUBE-SERVICES."""
    external: list[str] = field(default_factory=list)
    """filter KUBE-EXTERNAL-SERVICES."""
    firewall: list[str] = field(default_factory=list)
    """filter KUBE-PROXY-FIREWALL."""
    health: dict[int, str] = field(default_factory=dict)
    """filter KUBE-NODEPORTS, by healthCheckNodePort."""

    def add(self, sp: ServicePortState, m: nf.MasqueradeSettings, local: bool = False) -> None:
        """`local`: a ClusterIP frontend goes to KUBE-SVL (`internal_local`)."""
        name, match = port_name(sp), _match(sp.frontend)
        if sp.health_check_node_port is not None:
            self.health.setdefault(sp.health_check_node_port, f"{_comment(sp.service + ' health check node port')} "
                                   f"-m tcp -p tcp --dport {sp.health_check_node_port} -j ACCEPT")
        if sp.kind is FrontendKind.CLUSTER_IP:
            if sp.drop:
                # internalTrafficPolicy Local, no endpoint here while the cluster has some: from pods (FORWARD)
                # and the node (OUTPUT) alike, as upstream.
                self.reject.append(f"{_comment(name + ' has no local endpoints')} {match} -j DROP")
                return
            if not sp.backends:
                self.reject.append(f"{_comment(name + ' has no endpoints')} {match} -j REJECT{_reject_with(sp)}")
                return
            cluster_ip = f"{_comment(name + ' cluster IP')} {match}"
            masq = nf.mark_masq_rule(m, cluster_ip, sp.family)
            if masq:
                self.services.append(masq)
            self.services.append(f"{cluster_ip} -j {svl_chain(sp) if local else svc_chain(sp)}")
            return
        if not sp.backends:
            self.external.append(f"{_comment(name + ' has no endpoints')} {match} -j REJECT{_reject_with(sp)}")
        elif not sp.external_backends:
            # externalTrafficPolicy Local without an endpoint here: what KUBE-EXT did not short-circuit (pods,
            # the node) is still addressed to the frontend; the client waits and its load balancer tries another
            # node.
            self.external.append(f"{_comment(name + ' has no local endpoints')} {match} -j DROP")
        if sp.source_ranges:
            self.firewall.append(f"{_comment(f'{name} traffic not accepted by {fw_chain(sp)}')} {match} -j DROP")
        if not sp.backends:
            return
        if sp.kind is FrontendKind.NODE_PORT:
            p = _proto(sp.frontend)
            self.nodeports.setdefault(ext_chain(sp), f"{_comment(name)} -m {p} -p {p} --dport {sp.frontend.port} "
                                                     f"-j {ext_chain(sp)}")
        elif sp.kind is FrontendKind.EXTERNAL_IP:
            self.services.append(f"{_comment(name + ' external IP')} {match} -j {ext_chain(sp)}")
        else:
            target = fw_chain(sp) if sp.source_ranges else ext_chain(sp)
            self.services.append(f"{_comment(name + ' loadbalancer IP')} {match} -j {target}")


def _of_family(states: Iterable[ServicePortState], family: int) -> tuple[ServicePortState, ...]:
    return tuple(st for st in states if st.frontend.family == family)


def shared_rules(desired: DesiredState, m: nf.MasqueradeSettings, family: int = 4) -> SharedRules:
    out = SharedRules()
    for key in sorted(desired.services):
        states = _of_family(desired.services[key], family)
        local = {(sp.port_name, sp.frontend.protocol) for group in by_port(states) if (sp := internal_local(group))}
        for sp in states:
            out.add(sp, m, (sp.port_name, sp.frontend.protocol) in local)
    # Last, as upstream: a node-port address's other ports (and a ClusterIP's) must not reach KUBE-NODEPORTS
    # before their own rules. Only the addresses the model chose (--nodeport-addresses, never loopback), rather
    # than upstream's `addrtype --dst-type LOCAL`, which would also take 127.0.0.1 (it needs route_localnet).
    out.services += [f"{_comment(NODEPORTS_COMMENT)} -d {_host(ip)} -j {NODEPORTS_CHAIN}"
                     for ip in desired.node.nodeport_addresses if family_of(ip) == family]
    return out


def by_port(states: Iterable[ServicePortState]) -> list[list[ServicePortState]]:
    """A Service's frontends grouped by service port (name and protocol: what its chains' hash covers), in order:
    they share endpoints and policy, so one set of chains serves them all."""
    ports: dict[tuple[str, Protocol], list[ServicePortState]] = {}
    for sp in states:
        ports.setdefault((sp.port_name, sp.frontend.protocol), []).append(sp)
    return list(ports.values())


def internal_local(states: Sequence[ServicePortState]) -> ServicePortState | None:
    """The ClusterIP frontend of one service port's frontends (`by_port`) when its endpoints are not the port's
    cluster-wide ones (the external frontends' `backends`): internalTrafficPolicy Local with an endpoint here,
    but not every one. Its traffic then goes to KUBE-SVL, upstream's internal traffic chain, not KUBE-SVC."""
    cluster = next((st for st in states if st.kind.external), states[0])
    internal = next((st for st in states if st.kind is FrontendKind.CLUSTER_IP), None)
    if internal is not None and internal.backends and internal.backends != cluster.backends:
        return internal
    return None


def _choice(sp: ServicePortState, backends: Sequence[Backend], names: Mapping[Backend, str]) -> tuple[str, ...]:
    """A policy chain's rules (KUBE-SVC, KUBE-SVL): affinity first, then one of `backends` at random; `names`
    names their KUBE-SEP chains (hashing is most of a cold start's cost: once per endpoint)."""
    comment = _comment(port_name(sp))
    seps = [names[b] for b in backends]
    rules: list[str] = []
    if sp.session_affinity_seconds:
        rules += [f"{comment} -m recent --name {sep} --rcheck --seconds {sp.session_affinity_seconds} --reap -j {sep}"
                  for sep in seps]
    n = len(seps)
    for i, sep in enumerate(seps):
        chance = f" -m statistic --mode random --probability {probability(n - i)}" if i < n - 1 else ""
        rules.append(f"{comment}{chance} -j {sep}")
    return tuple(rules)


def _external_chains(sp: ServicePortState, m: nf.MasqueradeSettings, seps: Mapping[Backend, str]
                     ) -> list[nf.Chain]:
    """KUBE-EXT for the port's external frontends (`sp` is one of them: they share the policy), and KUBE-SVL for
    externalTrafficPolicy Local."""
    name, cluster = port_name(sp), svc_chain(sp)
    if sp.masquerade:  # externalTrafficPolicy Cluster: replies from another node's endpoint must come back here
        return [nf.Chain(ext_chain(sp), (
            f"{_comment(f'masquerade traffic for {name} external destinations')} -j {nf.MARK_MASQ_CHAIN}",
            f"-j {cluster}",
        ))]
    rules = []
    if cidr := m.cluster_cidr_of(sp.family):
        # Upstream's "short circuit": pods reach every endpoint, keeping their address, as if they had gone out
        # to the load balancer and come back in.
        rules.append(f"{_comment(f'pod traffic for {name} external destinations')} -s {cidr} -j {cluster}")
    # The node's own traffic: every endpoint, masqueraded (its source is a node address, maybe the VIP itself).
    local = "-m addrtype --src-type LOCAL"
    rules += [f"{_comment(f'masquerade LOCAL traffic for {name} external destinations')} {local} "
              f"-j {nf.MARK_MASQ_CHAIN}",
              f"{_comment(f'route LOCAL traffic for {name} external destinations')} {local} -j {cluster}"]
    chains = []
    if sp.external_backends:
        rules.append(f"-j {svl_chain(sp)}")
        chains.append(nf.Chain(svl_chain(sp), _choice(sp, sp.external_backends, seps)))
    # Else the flow goes on untranslated, and filter KUBE-EXTERNAL-SERVICES drops it.
    return [nf.Chain(ext_chain(sp), tuple(rules)), *chains]


def port_chains(states: Sequence[ServicePortState], m: nf.MasqueradeSettings) -> list[nf.Chain]:
    """The chains of one service port's frontends (`by_port`): none without endpoints (its frontends are
    rejected or dropped in filter); else KUBE-SVC, a KUBE-SEP per endpoint, and with external frontends
    KUBE-EXT, for a Local policy (external or internal) KUBE-SVL, and with source ranges KUBE-FW."""
    external = next((st for st in states if st.kind.external), None)
    # The port's cluster-wide endpoints: the external frontends' `backends`; a ClusterIP's differ from them only
    # with internalTrafficPolicy Local.
    sp = external or states[0]
    # With Local, this node's endpoints may be serving-and-terminating ones the cluster-wide choice leaves out.
    endpoints = sorted({b for st in states for b in (*st.backends, *st.external_backends)})
    if not endpoints:
        return []
    seps = {b: sep_chain(sp, b) for b in endpoints}
    chains = [nf.Chain(svc_chain(sp), _choice(sp, sp.backends, seps))] if sp.backends else []
    comment = _comment(port_name(sp))
    p = _proto(sp.frontend)
    for b, sep in seps.items():
        affinity = f" -m recent --name {sep} --set" if sp.session_affinity_seconds else ""
        chains.append(nf.Chain(sep, (
            # Hairpin: an endpoint reaching its own Service must see the reply come from the Service's address.
            f"{comment} -s {_host(b.ip)} -j {nf.MARK_MASQ_CHAIN}",
            f"{comment}{affinity} -m {p} -p {p} -j DNAT --to-destination {_endpoint(b)}",
        )))
    internal = internal_local(states)
    if internal is not None and (external is None or external.masquerade):
        # KUBE-SVL for the ClusterIP alone (with externalTrafficPolicy Local too, _external_chains writes it
        # from `external_backends`: this node's endpoints, the same ones).
        chains.append(nf.Chain(svl_chain(sp), _choice(sp, internal.backends, seps)))
    if external is None:
        return chains
    chains += _external_chains(external, m, seps)
    ranges = next((st.source_ranges for st in states if st.source_ranges), ())
    if ranges:
        # Only sources in the ranges go on; the rest leaves untranslated, for filter KUBE-PROXY-FIREWALL to drop.
        fw_comment = _comment(f"{port_name(sp)} loadbalancer IP")
        chains.append(nf.Chain(fw_chain(sp), tuple(f"{fw_comment} -s {r} -j {ext_chain(sp)}" for r in ranges)))
    return chains


# ----------------------------------------------------------------------------------------------- render


@dataclass
class _Builder:
    nat: nf.TableEdit = field(default_factory=nf.TableEdit)
    filter: nf.TableEdit = field(default_factory=nf.TableEdit)
    written: int = 0
    removed: int = 0

    def write(self, edit: nf.TableEdit, chain: nf.Chain) -> None:
        edit.write(chain)
        self.written += 1

    def remove(self, name: str) -> None:
        self.nat.remove(name)
        self.removed += 1


def render(desired: DesiredState, changed: Set[str] | None, applied: Applied, m: nf.MasqueradeSettings,
           saved: Mapping[str, nf.SavedTable] | None = None, family: int = 4) -> Plan:
    """The restore input for the Services in `changed` (None: all of them, reconciled against `saved`, the
    iptables-save output of nat and filter, which a full sync needs), for the frontends of `family`: 4 for
    iptables-restore, 6 for ip6tables-restore (`applied` and `saved` are then that family's)."""
    if changed is None and saved is None:
        raise ValueError("a full sync needs the iptables-save output")
    out = _Builder()
    keys = set(desired.services) | set(applied) if changed is None else set(changed)
    new_applied = dict(applied)
    old_ports: list[ServicePortState] = []
    new_ports: list[ServicePortState] = []
    for key in sorted(keys):
        ports = _of_family(desired.services.get(key, ()), family)
        chains = [c for states in by_port(ports) for c in port_chains(states, m)]
        for chain in chains:
            out.write(out.nat, chain)
        names = frozenset(c.name for c in chains)
        old = applied.get(key)
        if old and saved is None:
            # A full sync removes what iptables-save shows instead: `applied` may be wrong after a failure.
            for stale in sorted(old.chains - names):
                out.remove(stale)
        # Nothing applied yet (the first sync after a start) plans no endpoint's flows: see model/conntrack.py.
        old_ports += old.ports if old else ()
        new_ports += ports
        if ports:
            new_applied[key] = AppliedService(ports, names)
        else:
            new_applied.pop(key, None)

    rules = shared_rules(desired, m, family)
    out.write(out.nat, nf.Chain(nf.SERVICES_CHAIN, tuple(rules.services)))
    out.write(out.nat, nf.Chain(NODEPORTS_CHAIN, tuple(rules.nodeports.values())))
    out.write(out.filter, nf.Chain(nf.SERVICES_CHAIN, tuple(rules.reject)))
    out.write(out.filter, nf.Chain(EXTERNAL_SERVICES_CHAIN, tuple(rules.external)))
    out.write(out.filter, nf.Chain(FIREWALL_CHAIN, tuple(rules.firewall)))
    out.write(out.filter, nf.Chain(NODEPORTS_CHAIN, tuple(rules.health[port] for port in sorted(rules.health))))
    if saved is not None:
        _reconcile(out, saved, new_applied, m)
    text = nf.restore_input({"nat": out.nat, "filter": out.filter})
    count = sum(1 for line in text.splitlines() if line.startswith(("-A ", "-I ")))
    return Plan(text, new_applied, tuple(stale_udp_states(old_ports, new_ports)), out.written, out.removed, count)


def _reconcile(out: _Builder, saved: Mapping[str, nf.SavedTable], applied: Applied,
               m: nf.MasqueradeSettings) -> None:
    """Full sync only: the fixed chains, the jumps into them, and no per-service chain of ours that is not
    wanted."""
    mark_masq, postrouting = nf.masquerade_chains(m)
    out.write(out.nat, mark_masq)
    out.write(out.nat, postrouting)
    out.write(out.filter, nf.forward_chain(m))
    for jump in JUMPS:
        if not jump.present(saved):
            (out.nat if jump.table == "nat" else out.filter).insert(jump)
    wanted = {c for svc in applied.values() for c in svc.chains}
    nat = saved.get("nat", nf.SavedTable())
    for chain in sorted(nat.chains):
        if chain.startswith(SERVICE_PREFIXES) and chain not in wanted:
            out.remove(chain)
