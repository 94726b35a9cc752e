"""`pyproxy inspect` for the iptables mode (either iptables backend): the view (pyproxy/model/inspection.py) read
back from the kernel, namely the KUBE-* chains `iptables-save` and `ip6tables-save` show (IPv4's frontends in the
one, IPv6's in the other, each family read on its own: a dual-stack Service's chains have the same names in both),
the `recent` lists of ClientIP affinity (/proc/net/xt_recent) and the conntrack table. Nothing comes from pyproxy's
memory, so it answers the same whether pyproxy runs, stopped, or was upstream kube-proxy (the chains are
upstream's, render.py).

Where each part comes from:
- frontends: nat KUBE-SERVICES (`-d IP/32 (IPv6: /128) -p P --dport N -j KUBE-SVC-/SVL-/EXT-/FW-…`, named by the rule's
  comment, `ns/name:port cluster IP` and the like) and nat KUBE-NODEPORTS (`--dport N -j KUBE-EXT-…`, on every
  address KUBE-SERVICES sends to KUBE-NODEPORTS); a frontend without endpoints from filter KUBE-SERVICES and
  KUBE-EXTERNAL-SERVICES (`… has no endpoints` REJECT: refused; `… has no local endpoints` DROP: dropped);
- endpoints: the chain walk a new flow takes from the frontend's target, for a client outside the cluster:
  KUBE-FW (its `-s` ranges are the source ranges) -> KUBE-EXT (its first unconditional jump; the pod and
  node-local short circuits of externalTrafficPolicy Local are conditional and not followed; none: no local
  endpoint, dropped) -> KUBE-SVC or KUBE-SVL, whose `statistic --mode random --probability P` rules, in order,
  each take a new flow with their probability if no earlier one did, the last rule the rest -> KUBE-SEP's
  `DNAT --to-destination IP:PORT` (`[IP]:PORT` for IPv6);
- ClientIP affinity: KUBE-SVC's `recent --rcheck --seconds S --name KUBE-SEP-…` rules (S is the affinity), and
  the list of that name in /proc/net/xt_recent: one `src=CLIENT … last_seen: JIFFIES` line per client, whose
  time left is S less the jiffies since then (`jiffies_hz`);
- flows: `conntrack -L` (netfilter.ct_flows), the entries to a frontend, whose reply source is the endpoint.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import DataplaneError
from pyproxy.dataplane.iptables.render import (
    EXT_PREFIX,
    EXTERNAL_SERVICES_CHAIN,
    FW_PREFIX,
    NODEPORTS_CHAIN,
    SEP_PREFIX,
    SVC_PREFIX,
    SVL_PREFIX,
    is_mode_chain,
)
from pyproxy.model import inspection
from pyproxy.model.objects import IPV4, IPV6

RANDOM = "random"
"""The only scheduler of the iptables mode: `statistic --mode random`."""
RECENT_DIR = Path("/proc/net/xt_recent")
TIMER_LIST = Path("/proc/timer_list")
_NAME_SUFFIXES = (" cluster IP", " external IP", " loadbalancer IP")
_HZ_CHOICES = (100, 250, 300, 1000)


# ------------------------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class Rule:
    """One rule body of iptables-save, its options by name (the value after each; "!" before one negates it)."""

    options: Mapping[str, str]
    negated: frozenset[str] = frozenset()
    matches: tuple[str, ...] = ()
    """The `-m` modules it loads (comment, tcp, statistic, recent, addrtype…)."""

    @classmethod
    def parse(cls, body: str) -> Rule:
        words = shlex.split(body)
        options: dict[str, str] = {}
        negated: set[str] = set()
        matches: list[str] = []
        i, negate = 0, False
        while i < len(words):
            word = words[i]
            if word == "!":
                negate = True
                i += 1
                continue
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else ""
            if word == "-m":
                matches.append(value)
            elif word.startswith("-"):
                options.setdefault(word, value)
                if negate:
                    negated.add(word)
            negate = False
            i += 2 if value else 1
        return cls(options, frozenset(negated), tuple(matches))

    def get(self, name: str) -> str | None:
        return self.options.get(name)

    @property
    def target(self) -> str:
        return self.options.get("-j", "")

    @property
    def comment(self) -> str:
        return self.options.get("--comment", "")

    @property
    def conditional(self) -> bool:
        """Whether it takes only some packets of what reaches it (a source, a draw, an affinity list...)."""
        return bool({"-s", "--src-type", "--rcheck", "--probability"} & self.options.keys() or self.negated)

    @property
    def proto(self) -> str:
        return self.options.get("-p", "").upper()

    @property
    def dport(self) -> int | None:
        port = self.options.get("--dport", "")
        return int(port) if port.isdigit() else None

    @property
    def dst(self) -> str:
        """-d without its /32 (/128 for IPv6)."""
        return self.options.get("-d", "").removesuffix("/32").removesuffix("/128")


def _rules(table: nf.SavedTable, chain: str) -> list[Rule]:
    return [Rule.parse(body) for body in table.rules(chain)]


# ------------------------------------------------------------------------------------------ the chain walk


@dataclass
class _Policy:
    """What a frontend's chains give a new flow from outside the cluster."""

    endpoints: list[inspection.Endpoint] = field(default_factory=list)
    probabilities: list[float] = field(default_factory=list)
    recent: list[str] = field(default_factory=list)
    """The `recent` list of each endpoint, in the affinity rules' order."""
    affinity_sec: int = 0
    source_ranges: tuple[str, ...] = ()
    empty: str = "refused"


def _endpoint(nat: nf.SavedTable, sep: str) -> inspection.Endpoint | None:
    for rule in _rules(nat, sep):
        to = rule.get("--to-destination")
        if rule.target == "DNAT" and to:
            ip, port = inspection.split_host_port(to)
            return inspection.Endpoint(ip, int(port))
    return None


def _choice(nat: nf.SavedTable, chain: str, policy: _Policy) -> None:
    """A KUBE-SVC or KUBE-SVL chain: affinity rules, then the draw."""
    for rule in _rules(nat, chain):
        if not rule.target.startswith(SEP_PREFIX):
            continue
        if "--rcheck" in rule.options:
            policy.affinity_sec = int(rule.get("--seconds") or 0)
            policy.recent.append(rule.get("--name") or rule.target)
            continue
        endpoint = _endpoint(nat, rule.target)
        if endpoint is None:
            continue
        policy.endpoints.append(endpoint)
        probability = rule.get("--probability")
        policy.probabilities.append(float(probability) if probability else 1.0)
        if not rule.conditional:
            break


def policy_of(nat: nf.SavedTable, chain: str) -> _Policy:
    """The policy a frontend whose KUBE-SERVICES (or KUBE-NODEPORTS) rule jumps to `chain` applies."""
    policy = _Policy()
    seen: set[str] = set()
    while chain not in seen:
        seen.add(chain)
        rules = _rules(nat, chain)
        if chain.startswith(FW_PREFIX):
            # Sources outside these go on untranslated, for filter KUBE-PROXY-FIREWALL to drop.
            policy.source_ranges = tuple(r.options["-s"] for r in rules if "-s" in r.options
                                         and r.target.startswith(EXT_PREFIX))
            nxt = next((r.target for r in rules if r.target.startswith(EXT_PREFIX)), None)
        elif chain.startswith(EXT_PREFIX):
            nxt = next((r.target for r in rules if not r.conditional
                        and r.target.startswith((SVC_PREFIX, SVL_PREFIX))), None)
            if nxt is None:
                # externalTrafficPolicy Local without an endpoint here: filter KUBE-EXTERNAL-SERVICES drops it.
                policy.empty = "dropped"
        else:
            _choice(nat, chain, policy)
            nxt = None
        if nxt is None:
            break
        chain = nxt
    return policy


# ------------------------------------------------------------------------------------------ affinity lists


@dataclass(frozen=True)
class RecentEntry:
    client: str
    last_seen: int
    """In jiffies."""


def parse_recent(text: str) -> list[RecentEntry]:
    """A /proc/net/xt_recent/NAME file: `src=ADDR ttl: T last_seen: JIFFIES oldest_pkt: …` per address. The
    kernel writes an IPv6 ADDR in full (`%pI6`, fd00:0010:0200:0000:…): it is kept compressed, as every other
    reader writes addresses."""
    out = []
    for line in text.splitlines():
        m = re.match(r"src=(\S+) .*\blast_seen: (\d+)", line)
        if m:
            out.append(RecentEntry(str(ipaddress.ip_address(m.group(1))), int(m.group(2))))
    return out


def jiffies_hz(jiffies: int, monotonic: float) -> int | None:
    """The kernel's HZ, from its jiffies now and the monotonic clock: jiffies start at INITIAL_JIFFIES, 300 s
    short of wrapping 32 bits, and count HZ a second (none of /proc says HZ, and CLK_TCK is USER_HZ). The HZ
    whose count of seconds since boot is nearest the clock's, if within 1% (the choices are 20% apart); None
    otherwise."""
    def error(hz: int) -> float:
        return abs((jiffies - (2**32 - 300 * hz)) / hz - monotonic) / max(monotonic, 1.0)

    best = min(_HZ_CHOICES, key=error)
    return best if error(best) < 0.01 else None


def read_jiffies(text: str) -> int | None:
    """The `jiffies: N` line of /proc/timer_list."""
    m = re.search(r"^jiffies: (\d+)$", text, re.MULTILINE)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Clock:
    """The kernel's jiffies now and its HZ (for the age of `recent` entries)."""

    jiffies: int
    hz: int

    def age(self, last_seen: int) -> float:
        return (self.jiffies - last_seen) / self.hz


def kernel_clock() -> Clock | None:
    try:
        jiffies = read_jiffies(TIMER_LIST.read_text())
    except OSError:
        return None
    hz = None if jiffies is None else jiffies_hz(jiffies, time.monotonic())
    return None if jiffies is None or hz is None else Clock(jiffies, hz)


def read_recent(names: Iterable[str]) -> dict[str, list[RecentEntry]]:
    """The `recent` lists of these names that exist (in this network namespace's /proc/net)."""
    out = {}
    for name in names:
        try:
            out[name] = parse_recent((RECENT_DIR / name).read_text())
        except OSError:
            continue
    return out


# ------------------------------------------------------------------------------------------------ view


def _name(comment: str) -> str:
    for suffix in _NAME_SUFFIXES:
        if comment.endswith(suffix):
            return comment.removesuffix(suffix)
    return comment


def _frontend(rule: Rule, ip: str, policy: _Policy, name: str, family: int) -> inspection.Frontend:
    return inspection.Frontend(
        ip=ip, port=rule.dport or 0, proto=rule.proto, name=name, service=name.partition(":")[0], scheduler=RANDOM,
        endpoints=tuple(policy.endpoints), affinity_sec=policy.affinity_sec, source_ranges=policy.source_ranges,
        empty=policy.empty, probabilities=tuple(policy.probabilities), node_family=family)


def _empty_frontends(filter_: nf.SavedTable) -> Iterator[inspection.Frontend]:
    for chain in (nf.SERVICES_CHAIN, EXTERNAL_SERVICES_CHAIN):
        for rule in _rules(filter_, chain):
            comment = rule.comment
            for suffix, empty in ((" has no endpoints", "refused"), (" has no local endpoints", "dropped")):
                if comment.endswith(suffix) and rule.dport is not None:
                    name = comment.removesuffix(suffix)
                    yield inspection.Frontend(rule.dst, rule.dport, rule.proto, name, name.partition(":")[0],
                                              RANDOM, empty=empty)


def view(saved: Mapping[str, nf.SavedTable], ct: Iterable[nf.CtEntry] = (),
         recent: Mapping[str, list[RecentEntry]] | None = None, clock: Clock | None = None,
         saved6: Mapping[str, nf.SavedTable] | None = None) -> inspection.View:
    """The view from iptables-save's nat and filter tables (and ip6tables-save's, `saved6`), the conntrack entries,
    and the `recent` lists by name (with the kernel's clock to age them; without it an entry counts as just
    seen)."""
    out = inspection.View(mode="iptables")
    for family, tables in ((IPV4, saved), (IPV6, saved6 or {})):
        _add_family(out, tables, family, recent or {}, clock)
    out.nodeport_ips.sort(key=lambda ip: (ipaddress.ip_address(ip).version, ipaddress.ip_address(ip)))
    out.flows = list(nf.ct_flows(out, ct))
    return out


def _add_family(out: inspection.View, saved: Mapping[str, nf.SavedTable], family: int,
                recent: Mapping[str, list[RecentEntry]], clock: Clock | None) -> None:
    """The frontends, affinity entries and node-port addresses of one family's tables (chain names repeat across
    the families, so each is walked on its own)."""
    nat = saved.get("nat", nf.SavedTable())
    policies: dict[str, _Policy] = {}
    keys: set[tuple[str, int, str]] = set()
    nodeport_ips: list[str] = []

    def add(fe: inspection.Frontend, chain: str) -> None:
        out.frontends.append(fe)
        keys.add((fe.ip, fe.port, fe.proto))
        pol = policies[chain]
        for name in pol.recent:
            for entry in recent.get(name, ()):
                backend = _endpoint(nat, name)
                age = clock.age(entry.last_seen) if clock is not None else 0.0
                if backend is not None:
                    out.affinities.append(inspection.Affinity(fe.proto, entry.client, fe.ip, fe.port, str(backend),
                                                              fe.name, fe.affinity_sec - age))

    for rule in _rules(nat, nf.SERVICES_CHAIN):
        if rule.target == NODEPORTS_CHAIN and rule.dst:
            nodeport_ips.append(rule.dst)
        elif rule.target.startswith((SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX)) and rule.dport is not None:
            policy = policies.setdefault(rule.target, policy_of(nat, rule.target))
            add(_frontend(rule, rule.dst, policy, _name(rule.comment), family), rule.target)
    for rule in _rules(nat, NODEPORTS_CHAIN):
        if rule.target.startswith(EXT_PREFIX) and rule.dport is not None:
            policy = policies.setdefault(rule.target, policy_of(nat, rule.target))
            add(_frontend(rule, inspection.ANY_NODE_ADDRESS, policy, rule.comment, family), rule.target)
    node_ports = {(port, proto) for ip, port, proto in keys if ip == inspection.ANY_NODE_ADDRESS}
    for fe in _empty_frontends(saved.get("filter", nf.SavedTable())):
        # A NodePort's filter rules (one per node address) repeat what its KUBE-NODEPORTS frontend says.
        on_node_port = (fe.port, fe.proto) in node_ports and fe.ip in nodeport_ips
        if (fe.ip, fe.port, fe.proto) not in keys and not on_node_port:
            keys.add((fe.ip, fe.port, fe.proto))
            out.frontends.append(fe)
    out.nodeport_ips += nodeport_ips


def is_ours(saved: Mapping[str, nf.SavedTable]) -> bool:
    """Whether these tables hold the iptables mode's chains (the ipvs mode writes only shared ones)."""
    return any(is_mode_chain(table, chain) for table, st in saved.items() for chain in st.chains)


def read(flows: bool = True) -> inspection.View | None:
    """The view of the iptables backend whose tables (iptables', ip6tables' or both) hold the mode's chains, or None
    when neither backend's do."""
    by_backend: dict[str, list[nf.Tools]] = {}
    for tools in nf.installed_backends((IPV4, IPV6)):
        by_backend.setdefault(tools.backend, []).append(tools)
    for backend, family_tools in by_backend.items():
        saved: dict[int, dict[str, nf.SavedTable]] = {}
        for tools in family_tools:
            try:
                tables = nf.save(tools, tables=None)
            except DataplaneError:
                continue  # this backend's tables of this family cannot be read here
            if is_ours(tables):
                saved[tools.family] = tables
        if not saved:
            continue
        nats = [tables.get("nat", nf.SavedTable()) for tables in saved.values()]
        names = {r.get("--name") or "" for nat in nats for chain in nat.chains
                 if chain.startswith((SVC_PREFIX, SVL_PREFIX)) for r in _rules(nat, chain) if "--rcheck" in r.options}
        try:
            ct = nf.conntrack_list() if flows else []
        except DataplaneError:
            ct = []
        found = view(saved.get(IPV4, {}), ct, read_recent(sorted(names - {""})), kernel_clock(), saved.get(IPV6))
        commands = " and ".join(f"{'ip6tables' if family == IPV6 else 'iptables'}-{backend}-save"
                                for family in sorted(saved))
        found.source = (f"{commands} (nat, filter)" + (", conntrack -L" if flows else "")
                        + (f", {RECENT_DIR}" if names - {""} else ""))
        return found
    return None
