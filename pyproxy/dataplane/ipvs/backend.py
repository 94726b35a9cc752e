"""The IPVS dataplane backend (`--proxy-mode=ipvs`): upstream kube-proxy's IPVS proxier.

Per sync: know what the kernel holds (virtual and real servers with their connection counts, kube-ipvs0's
addresses, our ipsets), let render.py plan, run the plan; on a full sync also rewrite the iptables rules
(they depend on the settings only, never on Services: they match the ipsets). A full sync reads all of the
kernel's state; a partial one re-reads only the virtual servers it syncs and those with draining real
servers, and takes the rest from what the last sync left (render.after): one netlink dump per virtual server
is what makes reading slow. What is where:

- IPVS (netlink, kernel.py): a virtual server per frontend (ClusterIP, external IP, load-balancer IP, and a
  NodePort on each node address it is served on), real servers = the frontend's endpoints, graceful termination
  of the ones that leave (render.py);
- kube-ipvs0: every ClusterIP, external IP and load-balancer IP as a /32 (IPv6: /128; the device stays down, and
  an address there is local all the same: seen on Debian's 6.1), so the node takes packets for them into LOCAL_IN,
  where IPVS is (node addresses are the node's already);
- upstream's ipsets (render.py says which; the IPv6 frontends' are upstream's IPv6 proxier's KUBE-6-* sets) and,
  through netfilter.py (iptables-restore; ip6tables-restore for the IPv6 sets, the same rules), upstream's rules
  over them:
    nat KUBE-SERVICES (from PREROUTING and OUTPUT): mark for SNAT ClusterIP traffic per --masquerade-all /
      --cluster-cidr, externalTrafficPolicy Cluster traffic to external IPs (and, through KUBE-LOAD-BALANCER
      and KUBE-NODE-PORT, to load-balancer IPs and node ports), and the node's own flows to any external
      frontend; then ACCEPT every frontend (no other nat rule may touch what IPVS translates);
    nat KUBE-POSTROUTING: masquerade hairpin flows (KUBE-LOOP-BACK dst,dst,src) and marked packets;
    filter KUBE-IPVS-FIREWALL (from INPUT and FORWARD, before IPVS's LOCAL_IN hook; upstream's IPVS mode calls it
      KUBE-PROXY-FIREWALL, a name the iptables mode here holds, whose start would otherwise remove it as the
      ipvs mode's leftover, and the other way round): drop sources outside a
      load balancer's loadBalancerSourceRanges (KUBE-SOURCE-RANGES-FIREWALL), and new flows from outside the
      cluster to an externalTrafficPolicy Local frontend this node has no endpoint for;
    filter KUBE-IPVS-FILTER (from INPUT): reject new connections to an address of kube-ipvs0 on a port that is
      no frontend's: the address is local, so the node's own listeners would otherwise answer there (upstream
      issue 72236);
    filter KUBE-FORWARD: accept marked traffic, drop conntrack-INVALID;
- sysctls net.ipv4.vs.conntrack=1 (iptables must see IPVS flows to masquerade them; IPVS's sysctls serve both
  families), expire_nodest_conn=1, expire_quiescent_template=1, ip_forward=1, as upstream (IPv6 forwarding, which
  IPv6 real servers' replies need, is the node's, as upstream: no mode here writes it).
- after the ops, the UDP conntrack entries of endpoints that left (and the never-DNATed ones of frontends that got
  their first endpoint) are deleted with `conntrack -D`, planned by model/conntrack.py as in the other netfilter
  modes: a UDP real server is deleted at once, but the conntrack entry of a client that keeps sending would
  otherwise keep its flow on it. The old state is the kernel's real servers plus the not-ready endpoints the last
  sync knew, so after a restart only endpoints the adopted virtual servers list and the new state lacks go.

A frontend without usable endpoints keeps its virtual server with no real server: the kernel answers a new
connection with ICMP port unreachable, so clients see "connection refused" at once (as upstream IPVS mode).
The node's own flows to a frontend are IPVS's too: its local-out hook translates them, after nat OUTPUT marked
them for SNAT.

Not atomic: IPVS has no transactions. A failing step raises DataplaneError naming it; what ran stays, and
because every sync starts from what the kernel really holds, the next one (the proxier retries) completes it.
Restart: start() changes nothing but sysctls; the first sync (always full) adopts the previous run's virtual
servers as they are, so established and new connections keep flowing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from pyroute2 import IPVS
from pyroute2.netlink.exceptions import NetlinkError

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import DataplaneError, ModeUnavailable
from pyproxy.dataplane.ipvs import kernel
from pyproxy.dataplane.ipvs.render import (
    BITMAP_PORT,
    CLUSTER_IP_SET,
    DUMMY_DEVICE,
    EXTERNAL_IP_LOCAL_SET,
    EXTERNAL_IP_SET,
    IPVS_IPS_SET,
    LOAD_BALANCER_FW_SET,
    LOAD_BALANCER_LOCAL_SET,
    LOAD_BALANCER_SET,
    LOAD_BALANCER_SOURCE_CIDR_SET,
    LOOPBACK_SET,
    NO_ENDPOINTS_SET,
    NO_LOCAL_CLUSTER_IP_SET,
    NO_LOCAL_SET,
    NODE_PORT_SETS,
    SET_TYPES,
    AddressOp,
    Memory,
    Observed,
    Op,
    Options,
    RealOp,
    SetOp,
    VirtualOp,
    VSKey,
    after,
    ours,
    render,
    set_name,
    sets_of,
    vs_key,
)
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.model.objects import IPV4, IPV6, family_of, join_host_port
from pyproxy.model.state import BOTH_FAMILIES, IPV4_ONLY, DesiredState

log = logging.getLogger(__name__)

IPVS_FILTER_CHAIN = "KUBE-IPVS-FILTER"
NODE_PORT_CHAIN, LOAD_BALANCER_CHAIN = "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"  # nat
FIREWALL_CHAIN, SOURCE_RANGES_CHAIN = "KUBE-IPVS-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL"  # filter
MODE_CHAINS = frozenset({("filter", IPVS_FILTER_CHAIN), ("nat", NODE_PORT_CHAIN), ("nat", LOAD_BALANCER_CHAIN),
                         ("filter", FIREWALL_CHAIN), ("filter", SOURCE_RANGES_CHAIN)})
"""(table, chain) of the chains only this mode writes (upstream's IPVS proxier's names)."""
JUMPS = (
    nf.Jump("nat", "PREROUTING", nf.SERVICES_CHAIN, "kubernetes service portals"),
    nf.Jump("nat", "OUTPUT", nf.SERVICES_CHAIN, "kubernetes service portals"),
    nf.Jump("filter", "INPUT", IPVS_FILTER_CHAIN, "kubernetes ipvs access filter"),
    *nf.MASQUERADE_JUMPS,
    # Inserted last, so first in INPUT: source ranges and the Local drop act before anything accepts.
    nf.Jump("filter", "INPUT", FIREWALL_CHAIN, "kube-proxy firewall rules"),
    nf.Jump("filter", "FORWARD", FIREWALL_CHAIN, "kube-proxy firewall rules"),
)


@dataclass
class IpvsSettings:
    scheduler: str = "rr"
    """--ipvs-scheduler: rr, wrr, lc, wlc, sh, dh, ... (passed to the kernel as is): the scheduler of every
    Service that names none of IPVS's (pyproxy.io/scheduler, render.scheduler)."""
    iptables_backend: str = "auto"
    """Which iptables the masquerade rules go to, as IptablesSettings.backend."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    graceful_termination_seconds: float = 900.0
    """How long a removed TCP real server may drain (weight 0) before it is deleted even with connections
    left; upstream's original bound (rsGracefulDeletePeriod, 15 minutes)."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each naming its flag (ProxySettings.validate)."""
        out = [] if self.scheduler else ["--ipvs-scheduler must name a scheduler (rr, wrr, lc, ...)"]
        if not self.graceful_termination_seconds >= 0:
            out.append(f"the IPVS graceful termination period must not be negative, not "
                       f"{self.graceful_termination_seconds}s")
        return out


# --------------------------------------------------------------------------------------------- iptables


def _set_match(name: str, flags: str) -> str:
    return f"-m set --match-set {name} {flags}"


_NOT_FROM_NODE = "-m addrtype ! --src-type LOCAL"
"""Sources that are not the node itself: the node's own flows to external frontends are always masqueraded (the
model's rule; their source may be an address of kube-ipvs0, which an endpoint on another node cannot answer)."""


def _node_port_rules(family: int) -> list[str]:
    """nat KUBE-NODE-PORT, per protocol: Local node ports keep the client's address, the others are marked for
    SNAT (upstream's rules; SCTP's sets hold address and port)."""
    rules = []
    for proto, names in NODE_PORT_SETS.items():
        every, local = (set_name(name, family) for name in names)
        flags = "dst" if SET_TYPES[every] == BITMAP_PORT else "dst,dst"
        p = f"-p {proto.lower()}"
        rules.append(f'{p} -m comment --comment "Kubernetes nodeport {proto} port with externalTrafficPolicy=local" '
                     f"{_set_match(local, flags)} {_NOT_FROM_NODE} -j RETURN")
        rules.append(f'{p} -m comment --comment "Kubernetes nodeport {proto} port for masquerade purpose" '
                     f"{_set_match(every, flags)} -j {nf.MARK_MASQ_CHAIN}")
    return rules


def rule_edits(m: MasqueradeSettings, family: int = IPV4) -> dict[str, nf.TableEdit]:
    """The chains this mode writes (as upstream's IPVS proxier), without the jumps into them: iptables' for the
    IPv4 frontends, ip6tables' (`family` 6) for the IPv6 ones, the same rules over that family's ipsets (upstream's
    IPv6 proxier's KUBE-6-* sets). They match the ipsets only, so they depend on the settings, never on Services."""

    def match(name: str, flags: str) -> str:
        return _set_match(set_name(name, family), flags)

    cluster_ip = match(CLUSTER_IP_SET, "dst,dst")
    marking = nf.mark_masq_rule(
        m, f'-m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" {cluster_ip}',
        family)
    if marking is None:
        # Upstream: without a cluster CIDR, node-originated traffic whose source picked a ClusterIP of
        # kube-ipvs0 (VIP to VIP) is masqueraded, else the reply would go to the VIP itself.
        marking = f"{match(CLUSTER_IP_SET, 'src,dst')} -j {nf.MARK_MASQ_CHAIN}"
    mark_masq, postrouting = nf.masquerade_chains(m)
    hairpin = ('-m comment --comment "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose" '
               f"{match(LOOPBACK_SET, 'dst,dst,src')} -j MASQUERADE")
    load_balancer = match(LOAD_BALANCER_SET, "dst,dst")
    external, external_local = match(EXTERNAL_IP_SET, "dst,dst"), match(EXTERNAL_IP_LOCAL_SET, "dst,dst")
    nat, flt = nf.TableEdit(), nf.TableEdit()
    # Upstream's first rule here, `-s 127.0.0.0/8 -j RETURN`, is left out: it matches none of our sets, so
    # cleanup could not tell it from another mode's rule in this shared chain; without it a localhost flow to a
    # node port's number on 127.0.0.1 (no virtual server there) is only marked, and masqueraded to itself.
    nat.write(nf.Chain(nf.SERVICES_CHAIN, (
        f'-m comment --comment "Kubernetes service lb portal" {load_balancer} -j {LOAD_BALANCER_CHAIN}',
        marking,
        # externalTrafficPolicy Cluster: replies from another node's endpoint must come back through this node.
        '-m comment --comment "Kubernetes service external ip + port for masquerade and filter purpose" '
        f"{external} -j {nf.MARK_MASQ_CHAIN}",
        f"{external_local} -m addrtype --src-type LOCAL -j {nf.MARK_MASQ_CHAIN}",
        # No other nat rule may touch what IPVS translates. (Upstream accepts external IPs from off the machine
        # or when they are local; pyproxy always binds them to kube-ipvs0, so they are always local.)
        f"{external} -j ACCEPT",
        f"{external_local} -j ACCEPT",
        f"{cluster_ip} -j ACCEPT",
        f"{load_balancer} -j ACCEPT",
        # Last, unlike upstream: only a local destination that is no other frontend can be a node port, so a
        # ClusterIP or load-balancer port that happens to be some node port's number is not marked by its rules.
        f"-m addrtype --dst-type LOCAL -j {NODE_PORT_CHAIN}",
    )))
    nat.write(nf.Chain(LOAD_BALANCER_CHAIN, (
        f"{match(LOAD_BALANCER_LOCAL_SET, 'dst,dst')} {_NOT_FROM_NODE} -j RETURN",
        f"-j {nf.MARK_MASQ_CHAIN}",
    )))
    nat.write(nf.Chain(NODE_PORT_CHAIN, tuple(_node_port_rules(family))))
    nat.write(mark_masq)
    nat.write(nf.Chain(postrouting.name, (hairpin, *postrouting.rules)))
    flt.write(nf.forward_chain(m))
    # Before IPVS (its LOCAL_IN hook runs after filter INPUT): sources outside loadBalancerSourceRanges are
    # dropped, and so are new flows from outside the cluster to a Local frontend this node has no endpoint for
    # (render.py); pods (by --cluster-cidr) and the node reach every endpoint there.
    cidr = m.cluster_cidr_of(family)
    pods = f" ! -s {cidr}" if cidr else ""
    flt.write(nf.Chain(FIREWALL_CHAIN, (
        '-m comment --comment "Kubernetes service load balancer ip + port for load balancer with sourceRange" '
        f"{match(LOAD_BALANCER_FW_SET, 'dst,dst')} -j {SOURCE_RANGES_CHAIN}",
        '-m comment --comment "externalTrafficPolicy Local without a local endpoint" -m conntrack --ctstate NEW '
        f"{match(NO_LOCAL_SET, 'dst,dst')}{pods} {_NOT_FROM_NODE} -j DROP",
        # internalTrafficPolicy Local without a local endpoint: every source this chain sees (render.py; the
        # node's own flows IPVS takes in its local-out hook first, and refuses).
        '-m comment --comment "internalTrafficPolicy Local without a local endpoint" -m conntrack --ctstate NEW '
        f"{match(NO_LOCAL_CLUSTER_IP_SET, 'dst,dst')} -j DROP",
        # IPVS refuses these with ICMP, which the kernel rate-limits per client (render.py).
        '-m comment --comment "has no endpoints" -p tcp -m conntrack --ctstate NEW '
        f"{match(NO_ENDPOINTS_SET, 'dst,dst')} -j REJECT --reject-with tcp-reset",
    )))
    flt.write(nf.Chain(SOURCE_RANGES_CHAIN, (
        f"{match(LOAD_BALANCER_SOURCE_CIDR_SET, 'dst,dst,src')} -j RETURN",
        "-j DROP",
    )))
    # The node's own listeners must not answer on a frontend's address (upstream issue 72236): only the
    # frontends pass, other new flows to an address of kube-ipvs0 are rejected.
    flt.write(nf.Chain(IPVS_FILTER_CHAIN, (
        *(f"{match(name, 'dst,dst')} -j RETURN"
          for name in (LOAD_BALANCER_SET, CLUSTER_IP_SET, EXTERNAL_IP_SET, EXTERNAL_IP_LOCAL_SET)),
        f"-m conntrack --ctstate NEW {match(IPVS_IPS_SET, 'dst')} -j REJECT",
    )))
    return {"nat": nat, "filter": flt}


def is_mode_chain(table: str, chain: str) -> bool:
    return (table, chain) in MODE_CHAINS


def is_mode_rule(table: str, chain: str, body: str) -> bool:
    """A rule of this mode in a shared chain: it matches one of our ipsets, of either family (the jump to
    KUBE-NODE-PORT goes with that chain)."""
    return any(f"--match-set {name} " in body for name in SET_TYPES)


# --------------------------------------------------------------------------------------------- dataplane


class IpvsDataplane:
    mode = "ipvs"
    unserved: Mapping[str, str] = MappingProxyType({})  # it serves every Service it is given
    localhost_nodeports = False  # no NodePorts on 127.0.0.1: as upstream's ipvs mode

    def __init__(self, settings: IpvsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.ip_families = BOTH_FAMILIES
        """The IP families it renders: both, unless start() finds ip6tables unusable (then the proxier leaves out
        the IPv6 frontends). IPVS and ipset serve IPv6 wherever the kernel has IPv6; the rules need ip6tables."""
        self.memory = Memory()
        self.collector = nf.ConntrackMetrics()
        """The dataplane's own metrics (the conntrack reconciler's), for the proxier's registry."""
        self.tools: nf.Tools | None = None
        self.tools6: nf.Tools | None = None
        """ip6tables of the same flavour; None when it cannot be used here."""
        self._clock = clock
        self._fallbacks: dict[str, str] = {}
        """Service -> the scheduler IPVS has not that it asks for, as last logged: said once, not every sync."""
        self._last: Observed | None = None
        """What the kernel holds after the last successful sync. A partial sync re-reads only the virtual
        servers it syncs (and those with draining real servers) and takes the rest from here: reading every
        one is what makes a sync slow. Full syncs and syncs after a failure read everything."""

    def start(self) -> None:
        kernel.open_ipvs().close()
        kernel.check_sysctls()
        kernel.check_ipset()
        t = nf.tools(self.settings.iptables_backend)
        try:
            nf.mark(self.settings.masquerade)
        except ValueError as e:
            raise ModeUnavailable(str(e)) from e
        nf.check_usable(t)
        try:
            t6 = nf.tools(t.backend, 6)
            nf.check_usable(t6)
        except ModeUnavailable as e:
            t6, self.ip_families = None, IPV4_ONLY
            log.warning("ipvs mode serves IPv4 only: %s", e)
        kernel.write_sysctls()
        self.tools, self.tools6 = t, t6
        with netlink.rtnl() as ipr:
            kept = len(netlink.host_addresses(ipr, DUMMY_DEVICE))
        if kept:
            log.info("kept %d ClusterIPs on %s from the previous run until the first sync", kept, DUMMY_DEVICE)
        log.info("ipvs mode, scheduler %s, iptables %s backend", self.settings.scheduler, t.backend)

    def stop(self) -> None:
        """Nothing to release (sockets live for one sync); virtual servers, addresses, sets and rules stay, so
        traffic flows on."""

    def chains(self) -> frozenset[nf.ChainRef]:
        """The netfilter chains this mode writes (rule_edits), which other modes' cleanups must leave."""
        assert self.tools is not None, "start() first"
        return frozenset((self.tools.backend, table, chain)
                         for table, edit in rule_edits(self.settings.masquerade).items() for chain in edit.declared)

    def housekeeping_due(self) -> bool:
        return bool(self.memory.draining_since)  # deleted once drained, or after the grace period

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        assert self.tools is not None, "start() first"
        full = changed is None
        keys = set(desired.services) | set(self.memory.owners.values()) if full else set(changed or ())
        # A socket per sync: pyroute2's synchronous sockets belong to the thread that first used them, and
        # syncs run on the proxier's runner thread, not on the one that called start().
        try:
            ipvs = kernel.open_ipvs()
        except ModeUnavailable as e:
            raise DataplaneError(str(e)) from e
        with ipvs:
            self._sync(ipvs, desired, keys, full)

    def _sync(self, ipvs: IPVS, desired: DesiredState, keys: set[str], full: bool) -> None:
        fresh = None
        if not full:
            fresh = {vs_key(st.frontend) for k in keys for st in desired.services.get(k, ())}
            fresh |= {key for key, svc in self.memory.owners.items() if svc in keys}
            fresh |= {key for key, _ in self.memory.draining_since}
        observed = self._observe(ipvs, fresh)
        plan = render(observed, self.memory, {k: desired.services.get(k, ()) for k in keys}, full=full,
                      options=Options(self.settings.scheduler, self.settings.graceful_termination_seconds),
                      now=self._clock(), node_addresses=desired.node.nodeport_addresses)
        try:
            self._run(ipvs, plan.ops)
            if full:
                self._write_rules()
        except DataplaneError:
            # Keep knowing who owns what was made: the retry is a partial sync of the same Services.
            self.memory = Memory(owners={**self.memory.owners, **plan.memory.owners},
                                 members={**self.memory.members, **plan.memory.members},
                                 draining_since={**self.memory.draining_since, **plan.memory.draining_since},
                                 known={**self.memory.known, **plan.memory.known})
            self._last = None
            raise
        self.memory = plan.memory
        self._last = after(observed, plan.ops)
        self._log_fallbacks(keys, plan.fallbacks)
        # After the real servers went: no new flow can pick a deleted one while its entries are deleted.
        nf.clear_stale_udp(plan.stale_udp, self.collector)
        if plan.ops:
            log.debug("%s sync: %d IPVS/address/ipset operations", "full" if full else "partial", len(plan.ops))

    def _log_fallbacks(self, synced: Set[str], fallbacks: Mapping[str, str]) -> None:
        for service in sorted(synced):
            asked = fallbacks.get(service)
            if asked is None:
                self._fallbacks.pop(service, None)
            elif self._fallbacks.get(service) != asked:
                self._fallbacks[service] = asked
                log.info("Service %s asks for the %s scheduler, which IPVS has not: its virtual servers use "
                         "--ipvs-scheduler=%s", service, asked, self.settings.scheduler)

    # -- kernel ----------------------------------------------------------------------------------

    def _observe(self, ipvs: IPVS, fresh: set[VSKey] | None) -> Observed:
        """The kernel's state: all of it read (`fresh` None), or the last sync's with `fresh` re-read."""
        try:
            if fresh is None or self._last is None:
                virtuals = kernel.read_virtuals(ipvs)
                with netlink.rtnl() as ipr:
                    addresses = netlink.host_addresses(ipr, DUMMY_DEVICE)
                return Observed(virtuals, addresses, kernel.read_sets())
            known = dict(self._last.virtuals)
            for key in fresh:
                found = kernel.read_virtual(ipvs, key)
                if found is None:
                    known.pop(key, None)
                else:
                    known[key] = found
            return replace(self._last, virtuals=known)
        except (NetlinkError, OSError) as e:
            raise DataplaneError(f"reading IPVS state failed: {e}") from e

    def _run(self, ipvs: IPVS, ops: Iterable[Op]) -> None:
        ops = list(ops)
        set_ops = [op for op in ops if isinstance(op, SetOp)]
        # Sets first (creating them when missing): rules and the next steps rely on the members being there.
        kernel.change_sets(adds=[(op.name, op.entry) for op in set_ops if op.verb == "add"],
                           create=sets_of(self.ip_families))
        with netlink.rtnl() as ipr:
            index: int | None = None
            for op in ops:
                if isinstance(op, SetOp):
                    continue
                try:
                    if isinstance(op, AddressOp):
                        index = index if index is not None else netlink.ensure_dummy(ipr, DUMMY_DEVICE)
                        netlink.set_host_address(ipr, index, op.verb, op.ip)
                    else:
                        _run_ipvs(ipvs, op)
                except (NetlinkError, OSError) as e:
                    raise DataplaneError(f"{describe(op)} failed: {e}") from e
        dels = [(op.name, op.entry) for op in set_ops if op.verb == "del"]
        if dels:
            kernel.change_sets(dels=dels, create=sets_of(self.ip_families))

    def _write_rules(self) -> None:
        """iptables' rules, then ip6tables' (the same over the IPv6 sets). Should the second restore fail, the
        sync fails and the next one, full, writes both again."""
        for tools, family in ((self.tools, IPV4), (self.tools6, IPV6)):
            if tools is None:
                continue
            edits = rule_edits(self.settings.masquerade, family)
            saved = nf.save(tools)
            for jump in JUMPS:
                if not jump.present(saved):
                    edits[jump.table].insert(jump)
            try:
                nf.restore(tools, nf.restore_input(edits))
            except DataplaneError as e:
                raise DataplaneError(f"{tools.command}-{tools.backend}-restore failed, the previous rules stay: "
                                     f"{e}") from e


def _run_ipvs(ipvs: IPVS, op: VirtualOp | RealOp) -> None:
    if isinstance(op, VirtualOp):
        if op.verb == "del":
            kernel.delete_virtual(ipvs, op.key)
        else:
            kernel.put_virtual(ipvs, op.verb, op.key, op.scheduler, op.timeout)
    elif op.verb == "del":
        kernel.delete_real(ipvs, op.key, op.backend)
    else:
        kernel.put_real(ipvs, op.verb, op.key, op.backend, op.weight)


def describe(op: Op) -> str:
    """One line for a log or an error."""
    if isinstance(op, VirtualOp):
        extra = f" (scheduler {op.scheduler}, persistence {op.timeout}s)" if op.verb != "del" else ""
        return f"IPVS {op.verb} virtual server {_key(op.key)}{extra}"
    if isinstance(op, RealOp):
        extra = f" weight {op.weight}" if op.verb != "del" else ""
        return f"IPVS {op.verb} real server {op.backend} of {_key(op.key)}{extra}"
    if isinstance(op, AddressOp):
        return f"{op.verb} address {op.ip}/{128 if family_of(op.ip) == IPV6 else 32} on {DUMMY_DEVICE}"
    return f"ipset {op.verb} {op.name} {op.entry}"


def _key(key: tuple[str, int, str]) -> str:
    """address:port/protocol, an IPv6 address in brackets ([fd00::1]:80/TCP, as ipvsadm prints it)."""
    return f"{join_host_port(key[0], key[1])}/{key[2]}"


# ---------------------------------------------------------------------------------------------- cleanup


def cleanup(settings: IpvsSettings, shared: bool = True) -> list[str]:
    """Remove what IPVS mode made here: its virtual servers (those on kube-ipvs0's addresses or listed in our
    frontend ipsets, NodePorts by their port in the node-port sets: render.ours; unlike upstream, which flushes
    every virtual server, others' are left alone), its iptables rules and chains (with `shared`, shared ones
    once unused), its ipsets and kube-ipvs0."""
    done: list[str] = []
    sets = _read_sets_or_none()
    with netlink.rtnl() as ipr:
        addresses = netlink.host_addresses(ipr, DUMMY_DEVICE)
        try:
            ipvs = kernel.open_ipvs()
        except ModeUnavailable:
            ipvs = None  # no IPVS here: no virtual server can be ours
        if ipvs is not None:
            with ipvs:
                observed = Observed(kernel.read_virtuals(ipvs), addresses, sets or {})
                for key in sorted(ours(observed, Memory())):
                    kernel.delete_virtual(ipvs, key)
                    done.append(f"IPVS virtual server {_key(key)}")
        done += nf.cleanup(is_mode_chain, is_mode_rule, shared=shared)
        for name in sorted(sets or {}):
            kernel.destroy_set(name)
            done.append(f"ipset {name}")
        if netlink.delete_link(ipr, DUMMY_DEVICE):
            done.append(f"device {DUMMY_DEVICE}")
    return done


def _read_sets_or_none() -> dict[str, frozenset[str]] | None:
    """Our sets, or None where ipset cannot be used (not installed, no ip_set in the kernel): none of ours."""
    try:
        kernel.ipset_path()
        return kernel.read_sets()
    except (ModeUnavailable, DataplaneError):
        return None
