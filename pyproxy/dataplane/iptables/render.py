"""From desired state to one iptables-restore input: pure, no kernel.

The rules are upstream kube-proxy's (iptables mode, v1.20), so a node moving between kube-proxy and pyproxy
sees the same chains under the same names:

    nat     PREROUTING, OUTPUT -> KUBE-SERVICES: per frontend, [mark for SNAT,] jump to KUBE-SVC-<hash>
            KUBE-SVC-<hash>: [affinity: -m recent --rcheck per endpoint,] one endpoint at random
                (`-m statistic --probability 1/(n-i)`, the last rule unconditional)
            KUBE-SEP-<hash>: hairpin (-s endpoint) -> KUBE-MARK-MASQ; [affinity: --set;] DNAT
            POSTROUTING -> KUBE-POSTROUTING: MASQUERADE what carries the mark
    filter  INPUT, FORWARD, OUTPUT (new connections) -> KUBE-SERVICES: REJECT frontends without endpoints
                (TCP with a reset where upstream sends ICMP port-unreachable: see `_reject_with`)
            FORWARD -> KUBE-FORWARD: accept what is marked for SNAT

`render()` returns a `Plan`: the restore text, the `Applied` state that holds once it ran, and the UDP
conntrack entries to delete afterwards. A partial sync (`changed` = Service keys) rewrites only those
Services' chains, plus both KUBE-SERVICES chains, which are rewritten whole every time (as upstream) so a
frontend's position never depends on sync history. Chains of a Service that went, or of its endpoints that
went, are flushed and deleted (`-X` at the end, after the rules that jumped to them are gone). A full sync
(`changed=None`) also reconciles against what iptables-save shows: every KUBE-SVC-/KUBE-SEP- chain not
wanted goes, and missing jumps from the built-in chains are inserted (never duplicated).

iptables-restore applies each table's part as one transaction, so a failed sync leaves the previous rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from pyproxy.dataplane import netfilter as nf
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, DesiredState, Frontend, ServicePortState, rendered

SVC_PREFIX = "KUBE-SVC-"
SEP_PREFIX = "KUBE-SEP-"

PORTALS = "kubernetes service portals"
NEW_ONLY = ("-m", "conntrack", "--ctstate", "NEW")
# Upstream's order: each is inserted at the top of its chain, so in FORWARD, KUBE-FORWARD ends up first.
JUMPS = (
    *(nf.Jump("filter", chain, nf.SERVICES_CHAIN, PORTALS, NEW_ONLY) for chain in ("INPUT", "FORWARD", "OUTPUT")),
    *nf.MASQUERADE_JUMPS,
    nf.Jump("nat", "OUTPUT", nf.SERVICES_CHAIN, PORTALS),
    nf.Jump("nat", "PREROUTING", nf.SERVICES_CHAIN, PORTALS),
)


@dataclass(frozen=True)
class AppliedService:
    ports: tuple[ServicePortState, ...]
    """The frontends as last programmed (for conntrack: which endpoints left)."""
    chains: frozenset[str]
    """The KUBE-SVC-/KUBE-SEP- chains in nat that belong to this Service."""


Applied = Mapping[str, AppliedService]


@dataclass(frozen=True)
class ConntrackFlush:
    """UDP conntrack entries to delete: to `frontend` and DNATed to `endpoint_ip`, or (None) not DNATed
    at all (flows that started while the frontend had no endpoints)."""

    frontend: Frontend
    endpoint_ip: str | None


@dataclass(frozen=True)
class Plan:
    text: str
    applied: dict[str, AppliedService]
    flushes: tuple[ConntrackFlush, ...] = ()
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


def svc_chain(sp: ServicePortState) -> str:
    """Upstream's servicePortChainName: hash of servicePortName + lowercase protocol."""
    return SVC_PREFIX + nf.chain_hash(port_name(sp) + _proto(sp.frontend))


def sep_chain(sp: ServicePortState, backend: Backend) -> str:
    """Upstream's servicePortEndpointChainName: hash of servicePortName + protocol + "ip:port"."""
    return SEP_PREFIX + nf.chain_hash(port_name(sp) + _proto(sp.frontend) + str(backend))


def probability(n: int) -> str:
    """Upstream's computeProbability: 1/n with 10 decimals."""
    return f"{1.0 / n:0.10f}"


def is_mode_chain(table: str, chain: str) -> bool:
    """Chains only the iptables mode makes (for cleanup)."""
    return table == "nat" and chain.startswith((SVC_PREFIX, SEP_PREFIX))


def is_mode_rule(table: str, chain: str, body: str) -> bool:
    """Rules of the iptables mode in the shared KUBE-SERVICES chains that do not jump to one of its own chains
    (for cleanup): the rejections, and the masquerade marks, found by upstream's comments."""
    if chain != nf.SERVICES_CHAIN:
        return False
    return ("has no endpoints" in body) if table == "filter" else (' cluster IP"' in body)


# ----------------------------------------------------------------------------------------------- rules


def _match(fe: Frontend) -> str:
    p = _proto(fe)
    return f"-m {p} -p {p} -d {fe.ip}/32 --dport {fe.port}"


def _comment(text: str) -> str:
    return f'-m comment --comment "{text}"'


def _reject_with(sp: ServicePortState) -> str:
    """Upstream rejects with ICMP port-unreachable, which the kernel rate-limits per client (a burst of 6, then
    one a second), so past a few connects clients time out instead of failing fast. A TCP reset is not
    limited and fails a connect with the same ECONNREFUSED; UDP and SCTP keep the ICMP error."""
    return " --reject-with tcp-reset" if sp.frontend.protocol is Protocol.TCP else ""


def services_rules(desired: DesiredState, m: nf.MasqueradeSettings) -> tuple[list[str], list[str]]:
    """Bodies of nat KUBE-SERVICES and filter KUBE-SERVICES for every frontend, in a stable order."""
    nat: list[str] = []
    reject: list[str] = []
    for key in sorted(desired.services):
        for sp in rendered(desired.services[key]):
            match = _match(sp.frontend)
            if not sp.backends:
                reject.append(f"{_comment(port_name(sp) + ' has no endpoints')} {match} -j REJECT{_reject_with(sp)}")
                continue
            cluster_ip = f"{_comment(port_name(sp) + ' cluster IP')} {match}"
            masq = nf.mark_masq_rule(m, cluster_ip)
            if masq:
                nat.append(masq)
            nat.append(f"{cluster_ip} -j {svc_chain(sp)}")
    return nat, reject


def service_chains(sp: ServicePortState) -> list[nf.Chain]:
    """KUBE-SVC and its KUBE-SEP chains for a frontend with endpoints."""
    if not sp.backends:
        return []
    name = port_name(sp)
    comment = _comment(name)
    seps = [sep_chain(sp, b) for b in sp.backends]
    svc: list[str] = []
    if sp.session_affinity_seconds:
        svc += [f"{comment} -m recent --name {sep} --rcheck --seconds {sp.session_affinity_seconds} --reap -j {sep}"
                for sep in seps]
    n = len(seps)
    for i, sep in enumerate(seps):
        chance = f" -m statistic --mode random --probability {probability(n - i)}" if i < n - 1 else ""
        svc.append(f"{comment}{chance} -j {sep}")
    chains = [nf.Chain(svc_chain(sp), tuple(svc))]
    p = _proto(sp.frontend)
    for b, sep in zip(sp.backends, seps, strict=True):
        affinity = f" -m recent --name {sep} --set" if sp.session_affinity_seconds else ""
        chains.append(nf.Chain(sep, (
            # Hairpin: an endpoint reaching its own Service must see the reply come from the ClusterIP.
            f"{comment} -s {b.ip}/32 -j {nf.MARK_MASQ_CHAIN}",
            f"{comment}{affinity} -m {p} -p {p} -j DNAT --to-destination {b}",
        )))
    return chains


# ---------------------------------------------------------------------------------------------- conntrack


def _known(sp: ServicePortState) -> set[Backend]:
    return set(sp.known_backends) | set(sp.backends)


def udp_flushes(old: tuple[ServicePortState, ...], new: tuple[ServicePortState, ...]) -> list[ConntrackFlush]:
    """As upstream: a UDP endpoint that left drops its flows (else they keep going to it: UDP has no end), and
    a UDP frontend that gets its first endpoint drops the un-NATed flows begun while it had none."""
    before = {sp.frontend: sp for sp in old if sp.frontend.protocol is Protocol.UDP}
    flushes: list[ConntrackFlush] = []
    for sp in new:
        if sp.frontend.protocol is not Protocol.UDP:
            continue
        prev = before.pop(sp.frontend, None)
        if sp.backends and (prev is None or not prev.backends):
            flushes.append(ConntrackFlush(sp.frontend, None))
        if prev is not None:
            flushes += [ConntrackFlush(sp.frontend, b.ip) for b in sorted(_known(prev) - _known(sp))]
    for fe, prev in before.items():
        flushes += [ConntrackFlush(fe, b.ip) for b in sorted(_known(prev))]
    return flushes


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
           saved: Mapping[str, nf.SavedTable] | None = None) -> Plan:
    """The restore input for the Services in `changed` (None: all of them, reconciled against `saved`, the
    iptables-save output of nat and filter, which a full sync needs)."""
    if changed is None and saved is None:
        raise ValueError("a full sync needs the iptables-save output")
    out = _Builder()
    keys = set(desired.services) | set(applied) if changed is None else set(changed)
    new_applied = dict(applied)
    flushes: list[ConntrackFlush] = []
    for key in sorted(keys):
        ports = rendered(desired.services.get(key, ()))
        chains = [c for sp in ports for c in service_chains(sp)]
        for chain in chains:
            out.write(out.nat, chain)
        names = frozenset(c.name for c in chains)
        old = applied.get(key)
        if old and saved is None:
            # A full sync removes what iptables-save shows instead: `applied` may be wrong after a failure.
            for stale in sorted(old.chains - names):
                out.remove(stale)
        flushes += udp_flushes(old.ports if old else (), ports)
        if ports:
            new_applied[key] = AppliedService(ports, names)
        else:
            new_applied.pop(key, None)

    nat_rules, reject_rules = services_rules(desired, m)
    out.write(out.nat, nf.Chain(nf.SERVICES_CHAIN, tuple(nat_rules)))
    out.write(out.filter, nf.Chain(nf.SERVICES_CHAIN, tuple(reject_rules)))
    if saved is not None:
        _reconcile(out, saved, new_applied, m)
    text = nf.restore_input({"nat": out.nat, "filter": out.filter})
    rules = sum(1 for line in text.splitlines() if line.startswith(("-A ", "-I ")))
    return Plan(text, new_applied, tuple(flushes), out.written, out.removed, rules)


def _reconcile(out: _Builder, saved: Mapping[str, nf.SavedTable], applied: Applied,
               m: nf.MasqueradeSettings) -> None:
    """Full sync only: the fixed chains, the jumps into them, and no chain of ours that is not wanted."""
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
        if is_mode_chain("nat", chain) and chain not in wanted:
            out.remove(chain)
