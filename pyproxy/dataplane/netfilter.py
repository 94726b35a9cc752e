"""What the netfilter-based modes share (iptables, and ipvs for its masquerade rules), as upstream
kube-proxy: masquerade settings, `KUBE-*` chain naming, and running iptables-save/-restore against one of the
two iptables backends (legacy or nft).

Backends never import each other; both import this module. Its API is stable:

Tools (which binaries)
    `tools(backend, family=4)` -> `Tools(backend, save, restore, family)` for "legacy", "nft" or "auto" (=
    whatever the plain `iptables` command is, from `iptables --version`); family 6: the same flavour's
    ip6tables-save/-restore. ModeUnavailable when a binary is missing.
    `check_usable(tools)` -> ModeUnavailable when iptables-save cannot read nat/filter (no CAP_NET_ADMIN, no
    kernel tables). `usable_tools(backend, masquerade)` = both, after checking the masquerade bit: what a
    mode's start() calls. `installed_backends(families=(4,))` -> the backends whose binaries are here, per
    family (cleanup takes both families: the iptables mode writes ip6tables too).
Running them
    `run(argv, input=, timeout=)` -> stdout, DataplaneError with the command and its stderr otherwise.
    `save(tools, tables=("nat", "filter"))` -> {table: SavedTable}; `tables=None` reads only the tables that
    exist, loading no kernel module. `restore(tools, text)` runs `iptables-restore --noflush` (one atomic
    transaction per table). Both raise DataplaneError carrying the command's stderr; every call has a timeout.
    `conntrack_delete(*args)` runs `conntrack -D ...`, returns how many entries went (0 is not an error).
    `conntrack_list()` -> `CtEntry` per TCP and UDP entry of `conntrack -L` (`parse_conntrack(text)`);
    `ct_flows(view, entries)` -> the entries to a frontend of an inspection view, as its flows.
Stale UDP flows (every netfilter-based mode: iptables, nftables, ipvs)
    `conntrack_filter(stale)` -> the `conntrack -D` arguments of one `model.conntrack.Stale`;
    `clear_stale_udp(stales)` deletes them after a sync (failures are logged, never raised) and returns how many
    entries went. The plan itself (which flows) is model/conntrack.py's, the same for every mode.
Restore input
    `Chain(name, rules)`: a chain and its rule bodies (what follows `-A NAME`). `TableEdit` collects, per
    table, chains to write (declared = created or flushed, then filled), chains to remove (flushed, `-X` last)
    and jumps to insert; `restore_input({table: TableEdit})` -> the text for `restore()`.
    `Jump(table, chain, target, comment, match)`: a rule in a built-in chain leading to one of ours, inserted
    at the top as upstream; `jump.present(saved)` tells whether iptables-save already shows it.
Naming
    `service_port_name(service, port_name)` = upstream's ServicePortName.String(); `chain_hash(text)` =
    base32(sha256(text))[:16], the suffix of KUBE-SVC-/KUBE-SEP-/... chains.
Masquerade (from MasqueradeSettings)
    `masquerade_chains(m)` -> KUBE-MARK-MASQ and KUBE-POSTROUTING (nat); `forward_chain(m)` -> KUBE-FORWARD
    (filter); `MASQUERADE_JUMPS` -> the POSTROUTING and FORWARD jumps; `mark_masq_rule(m, match)` -> the rule
    body marking ClusterIP traffic `match`ed for SNAT per --masquerade-all / --cluster-cidr, or None.
Cleanup
    `cleanup(mode_chain, mode_rule, keep=, shared=)` removes one mode's chains and rules in both backends,
    and the shared chains (KUBE-SERVICES, KUBE-MARK-MASQ, KUBE-POSTROUTING, KUBE-FORWARD) once no rule of any
    mode uses them, but those in `keep` ((backend, table, chain) `ChainRef`s: the running mode's, kept even
    when empty). With `shared=False` it leaves every shared chain, for `cleanup_shared(keep)` to remove
    afterwards: what the mode starting up runs after the other modes' cleanups, so that a shared chain is
    reported as no one mode's and the running mode's stay.
    `mode_chain(table, chain)` says which chains only that mode makes (the iptables mode's: nat KUBE-SVC-, -SEP-,
    -EXT-, -SVL-, -FW-* and KUBE-NODEPORTS, filter KUBE-NODEPORTS, KUBE-EXTERNAL-SERVICES and KUBE-PROXY-FIREWALL,
    so another mode must not write into those); `mode_rule(table, chain, body)` which
    of its rules sit in shared chains without jumping to one of its own (found by their comments: the
    iptables mode claims `"<service> cluster IP"` in nat KUBE-SERVICES and `"<service> has no endpoints"` and
    `"<service> has no local endpoints"` in filter KUBE-SERVICES, so another mode must not write rules with
    those comments there).

Over 600 lines as the one module the netfilter backends share (backends never import each other, so what both
need is here, not in either).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client import Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pyproxy.dataplane import trace
from pyproxy.dataplane.base import DataplaneError, MasqueradeSettings, ModeUnavailable
from pyproxy.model import inspection
from pyproxy.model.conntrack import Stale
from pyproxy.model.objects import join_host_port

log = logging.getLogger(__name__)

BACKENDS = ("legacy", "nft")
TABLES = ("nat", "filter")
BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})

SERVICES_CHAIN = "KUBE-SERVICES"
MARK_MASQ_CHAIN = "KUBE-MARK-MASQ"
POSTROUTING_CHAIN = "KUBE-POSTROUTING"
FORWARD_CHAIN = "KUBE-FORWARD"
# (table, chain) of the chains every netfilter mode writes the same way.
SHARED_CHAINS = frozenset({("nat", SERVICES_CHAIN), ("nat", MARK_MASQ_CHAIN), ("nat", POSTROUTING_CHAIN),
                           ("filter", SERVICES_CHAIN), ("filter", FORWARD_CHAIN)})

SAVE_TIMEOUT = 30.0
RESTORE_TIMEOUT = 60.0
CONNTRACK_TIMEOUT = 10.0
# Seconds iptables-restore waits for the xtables lock that other iptables users on the node take.
LOCK_WAIT = "5"


# ------------------------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class Tools:
    backend: str
    """"legacy" or "nft"."""
    save: str
    restore: str
    family: int = 4
    """4: iptables-save/-restore; 6: ip6tables-save/-restore."""

    @property
    def command(self) -> str:
        """"iptables" or "ip6tables", as the binaries are named."""
        return "ip6tables" if self.family == 6 else "iptables"


def _which(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ModeUnavailable(f"{name} not found in PATH (install the iptables package)")
    return path


def detect_backend() -> str:
    """What the plain `iptables` command is here: "legacy" or "nft" (ModeUnavailable if neither)."""
    out = run([_which("iptables"), "--version"], timeout=SAVE_TIMEOUT)
    if "(nf_tables)" in out:
        return "nft"
    if "(legacy)" in out:
        return "legacy"
    # iptables before 1.8 has only the legacy backend and does not say so.
    if re.search(r"v1\.[0-7]\.", out):
        return "legacy"
    raise ModeUnavailable(f"cannot tell the iptables backend from `iptables --version`: {out.strip()!r}")


def tools(backend: str, family: int = 4) -> Tools:
    """The save/restore binaries of `backend` ("legacy", "nft", or "auto") for `family` (4, 6)."""
    if backend == "auto":
        try:
            backend = detect_backend()
        except DataplaneError as e:
            raise ModeUnavailable(str(e)) from e
    if backend not in BACKENDS:
        raise ModeUnavailable(f"unknown iptables backend {backend!r}: want auto, legacy or nft")
    command = "ip6tables" if family == 6 else "iptables"
    return Tools(backend, _which(f"{command}-{backend}-save"), _which(f"{command}-{backend}-restore"), family)


def installed_backends(families: Sequence[int] = (4,)) -> list[Tools]:
    """The backends whose binaries are installed, for each of `families`."""
    found = []
    for family in families:
        for backend in BACKENDS:
            try:
                found.append(tools(backend, family))
            except ModeUnavailable:
                continue
    return found


def check_usable(t: Tools) -> None:
    """ModeUnavailable unless iptables-save can read the nat and filter tables (needs CAP_NET_ADMIN and the
    kernel's tables for this backend)."""
    try:
        save(t)
    except DataplaneError as e:
        raise ModeUnavailable(f"iptables ({t.backend}) cannot be used here: {e}") from e


def usable_tools(backend: str, m: MasqueradeSettings) -> Tools:
    """The binaries of `backend`, checked to work here with these settings: ModeUnavailable otherwise."""
    t = tools(backend)
    try:
        mark(m)
    except ValueError as e:
        raise ModeUnavailable(str(e)) from e
    check_usable(t)
    return t


# -------------------------------------------------------------------------------------------- running


_ERROR_LINES = 12


def run(argv: Sequence[str], *, input: str | None = None, timeout: float) -> str:
    """stdout of `argv`; DataplaneError naming the command and its stderr when it fails or times out."""
    cmd = shlex.join(argv)
    try:
        cp = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise DataplaneError(f"{cmd}: no answer within {timeout:g}s") from e
    except OSError as e:
        raise DataplaneError(f"{cmd}: {e}") from e
    if cp.returncode != 0:
        # nft and iptables-restore quote the failing input; a huge transaction must not flood the log.
        lines = (cp.stderr or cp.stdout).strip().splitlines()
        more = f"\n… {len(lines) - _ERROR_LINES} more lines" if len(lines) > _ERROR_LINES else ""
        raise DataplaneError(f"{cmd} exited {cp.returncode}: " + "\n".join(lines[:_ERROR_LINES]) + more)
    return cp.stdout


@dataclass
class SavedTable:
    """One table as iptables-save shows it: every chain (built-in ones too) with its rule bodies in order."""

    chains: dict[str, list[str]] = field(default_factory=dict)

    def rules(self, chain: str) -> list[str]:
        return self.chains.get(chain, [])


def parse_save(text: str) -> dict[str, SavedTable]:
    tables: dict[str, SavedTable] = {}
    current: SavedTable | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("*"):
            current = tables.setdefault(line[1:], SavedTable())
        elif current is None or not line or line.startswith("#") or line.startswith("COMMIT"):
            continue
        elif line.startswith(":"):
            current.chains.setdefault(line[1:].split(" ", 1)[0], [])
        elif line.startswith("-A "):
            chain, _, body = line[3:].partition(" ")
            current.chains.setdefault(chain, []).append(body)
    return tables


def target(body: str) -> str | None:
    """The chain or target a rule body jumps to (`-j X` / `-g X`)."""
    words = body.split()
    for i, word in enumerate(words[:-1]):
        if word in ("-j", "-g", "--jump", "--goto"):
            return words[i + 1]
    return None


def save(t: Tools, tables: Sequence[str] | None = TABLES) -> dict[str, SavedTable]:
    """The tables as they are; `tables=None`: only those that exist (no kernel module gets loaded)."""
    if tables is None:
        return parse_save(run([t.save], timeout=SAVE_TIMEOUT))
    return {table: parse_save(run([t.save, "-t", table], timeout=SAVE_TIMEOUT)).get(table, SavedTable())
            for table in tables}


def restore(t: Tools, text: str, timeout: float = RESTORE_TIMEOUT) -> None:
    """Apply `text` without flushing anyone else's chains; each table's part is one atomic transaction."""
    try:
        run([t.restore, "-w", LOCK_WAIT, "--noflush"], input=text, timeout=timeout)
    except DataplaneError as e:
        # iptables-restore names only the line number: quote the line, which is what one needs to see.
        found = re.search(r"line:? (\d+)", str(e))
        lines = text.splitlines()
        if found and 0 < int(found.group(1)) <= len(lines):
            raise DataplaneError(f"{e}\n(line {found.group(1)}: {lines[int(found.group(1)) - 1]})") from e
        raise


def conntrack_delete(*args: str) -> int:
    """`conntrack -D ARGS`; the number of entries deleted. DataplaneError if conntrack is missing or fails."""
    path = shutil.which("conntrack")
    if path is None:
        raise DataplaneError("conntrack not found in PATH (install conntrack): stale UDP flows are kept")
    argv = [path, "-D", *args]
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=CONNTRACK_TIMEOUT)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise DataplaneError(f"{shlex.join(argv)}: {e}") from e
    # conntrack exits 1 when nothing matched; its summary line says how many entries went either way.
    found = re.search(r"(\d+) flow entries have been deleted", cp.stderr)
    if found:
        return int(found.group(1))
    raise DataplaneError(f"{shlex.join(argv)} exited {cp.returncode}: {cp.stderr.strip()}")


def conntrack_filter(stale: Stale) -> list[str]:
    """The `conntrack -D` arguments deleting `stale`'s entries, and no others."""
    # conntrack's family is IPv4 unless told: an IPv6 frontend's entries need `-f ipv6`.
    family = ["-f", "ipv6"] if stale.family == 6 else []
    args = [*family, "-p", "udp", *(["--orig-dst", stale.ip] if stale.ip else []), "--orig-port-dst", str(stale.port)]
    if stale.endpoint is not None:
        # The endpoint's port too: the same pod may serve another port of this frontend's address that stays.
        return [*args, "--dst-nat", stale.endpoint.ip, "--reply-port-src", str(stale.endpoint.port)]
    if not stale.ip:
        raise ValueError(f"untranslated entries need the frontend's address: {stale}")
    # Never DNATed: the reply would come from the frontend's address itself. Upstream deletes every entry to the
    # frontend here, which also took live flows when kube-proxy restarted and saw each frontend as new (122740).
    return [*args, "--reply-src", stale.ip]


class CtEntry(NamedTuple):
    """One `conntrack -L` line: the original direction's tuple, and where its reply comes from (a DNATed
    flow's endpoint)."""

    proto: str  # "TCP" | "UDP"
    src: str
    sport: int
    dst: str
    dport: int
    reply_src: str
    reply_sport: int
    state: str  # TCP's state; a UDP flow's "assured" (replied to and seen again) or "unreplied" or "replied"
    expires_sec: int


def parse_conntrack(text: str) -> list[CtEntry]:
    """`conntrack -L`'s lines (its default format) as entries; lines of other protocols are skipped."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 4 or words[0] not in ("tcp", "udp") or not words[2].isdigit():
            continue
        # The original tuple's key=value pairs come first, the reply's repeat the same keys.
        orig: dict[str, str] = {}
        reply: dict[str, str] = {}
        for word in words[3:]:
            key, eq, value = word.partition("=")
            if eq:
                (reply if key in orig else orig).setdefault(key, value)
        if not {"src", "dst", "sport", "dport"} <= orig.keys() or not {"src", "sport"} <= reply.keys():
            continue
        state = words[3] if "=" not in words[3] else (
            "unreplied" if "[UNREPLIED]" in words else "assured" if "[ASSURED]" in words else "replied")
        out.append(CtEntry(words[0].upper(), orig["src"], int(orig["sport"]), orig["dst"], int(orig["dport"]),
                           reply["src"], int(reply["sport"]), state.lower(), int(words[2])))
    return out


ENDED_TCP_STATES = frozenset({"time_wait", "close"})
"""Conntrack states of a TCP flow that is over: a new connection on the same ports is scheduled afresh."""


def ct_flows(view: inspection.View, ct: Iterable[CtEntry]) -> Iterator[inspection.Flow]:
    """The conntrack entries of flows to a frontend of `view`, DNATed or not (a refused one is never confirmed):
    what `pyproxy inspect` shows as flows in the modes that DNAT with netfilter (nftables, iptables)."""
    for e in ct:
        fe = trace.frontend_of(view, e.dst, e.dport, e.proto)
        if fe is None:
            continue
        yield inspection.Flow(e.proto, e.src, e.sport, e.dst, e.dport, join_host_port(e.reply_src, e.reply_sport),
                              fe.name, e.state, expires_sec=e.expires_sec,
                              ended=e.proto == "TCP" and e.state in ENDED_TCP_STATES)


def conntrack_list() -> list[CtEntry]:
    """The kernel's TCP and UDP conntrack entries of this network namespace, of both families (`-L` without `-f`
    dumps IPv4's and IPv6's alike); DataplaneError if conntrack is missing or fails."""
    path = shutil.which("conntrack")
    if path is None:
        raise DataplaneError("conntrack not found in PATH (install conntrack): flows are not shown")
    return [e for proto in ("tcp", "udp")
            for e in parse_conntrack(run([path, "-L", "-p", proto], timeout=CONNTRACK_TIMEOUT))]


_conntrack_missing_logged = False


class ConntrackMetrics(Collector):
    """Upstream's conntrack reconciler series for the stale UDP flows a netfilter mode deletes after a sync:
    kubeproxy_conntrack_reconciler_deleted_entries_total and kubeproxy_conntrack_reconciler_sync_duration_seconds
    (observed for each sync that had stale flows to delete; one with none runs no conntrack command)."""

    def __init__(self) -> None:
        self.deleted = Counter("kubeproxy_conntrack_reconciler_deleted_entries",
                               "Cumulative conntrack flows deleted by conntrack reconciler", registry=None)
        self.duration = Histogram("kubeproxy_conntrack_reconciler_sync_duration_seconds",
                                  "ReconcileConntrackFlowsLatency latency in seconds",
                                  buckets=tuple(0.001 * 2**i for i in range(15)), registry=None)

    def collect(self) -> Iterator[Metric]:
        yield from self.deleted.collect()
        yield from self.duration.collect()


def clear_stale_udp(stales: Iterable[Stale], metrics: ConntrackMetrics | None = None) -> int:
    """Delete the entries of `stales` (after the rules that stop new ones are in); how many went. Failures
    are logged: a sync whose rules went in has succeeded, and the next change plans again."""
    stales = list(stales)
    if not stales:
        return 0
    start = time.monotonic()
    total = _clear_stale_udp(stales)
    if metrics is not None:
        metrics.deleted.inc(total)
        metrics.duration.observe(time.monotonic() - start)
    return total


def _clear_stale_udp(stales: list[Stale]) -> int:
    global _conntrack_missing_logged
    if shutil.which("conntrack") is None:
        if not _conntrack_missing_logged:
            log.warning("conntrack not found in PATH (install conntrack): UDP flows to removed endpoints stay")
            _conntrack_missing_logged = True
        return 0
    total = 0
    for stale in stales:
        try:
            n = conntrack_delete(*conntrack_filter(stale))
        except DataplaneError as e:
            log.warning("deleting stale UDP conntrack entries (%s) failed: %s", stale, e)
            continue
        total += n
        if n:
            log.info("deleted %d UDP conntrack entries: %s", n, stale)
    return total


# ------------------------------------------------------------------------------------------ restore input


@dataclass(frozen=True)
class Chain:
    name: str
    rules: tuple[str, ...] = ()
    """Rule bodies: what follows `-A NAME` in iptables-restore input."""


@dataclass(frozen=True)
class Jump:
    """A rule in a built-in chain that sends packets into one of ours (upstream's iptablesJumpChains)."""

    table: str
    chain: str
    target: str
    comment: str
    match: tuple[str, ...] = ()

    def rule(self) -> str:
        return " ".join([*self.match, "-m", "comment", "--comment", f'"{self.comment}"', "-j", self.target])

    def present(self, saved: Mapping[str, SavedTable]) -> bool:
        table = saved.get(self.table)
        return table is not None and any(
            target(body) == self.target and self.comment in body for body in table.rules(self.chain))


@dataclass
class TableEdit:
    """One table's part of an iptables-restore input."""

    declared: list[str] = field(default_factory=list)
    inserted: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def write(self, chain: Chain) -> None:
        """Create or flush `chain`, then fill it."""
        self.declared.append(chain.name)
        self.rules.extend(f"-A {chain.name} {body}" for body in chain.rules)

    def remove(self, name: str) -> None:
        """Flush and delete `name` (after every other line, so rules that jumped to it are gone by then)."""
        self.declared.append(name)
        self.removed.append(name)

    def insert(self, jump: Jump) -> None:
        """Put `jump` at the top of its chain (so of two jumps inserted into one chain, the later is first)."""
        self.inserted.append(f"-I {jump.chain} 1 {jump.rule()}")

    def delete_rule(self, chain: str, body: str) -> None:
        self.rules.append(f"-D {chain} {body}")

    def __bool__(self) -> bool:
        return bool(self.declared or self.inserted or self.rules or self.removed)


def restore_input(edits: Mapping[str, TableEdit]) -> str:
    lines: list[str] = []
    for table, edit in edits.items():
        if not edit:
            continue
        lines.append(f"*{table}")
        lines.extend(f":{name} - [0:0]" for name in dict.fromkeys(edit.declared))
        lines.extend(edit.inserted)
        lines.extend(edit.rules)
        lines.extend(f"-X {name}" for name in edit.removed)
        lines.append("COMMIT")
    return "\n".join(lines) + "\n" if lines else ""


# ---------------------------------------------------------------------------------------------- naming


def service_port_name(service: str, port_name: str) -> str:
    """Upstream's ServicePortName.String(): "ns/name:port", or "ns/name" for an unnamed port."""
    return f"{service}:{port_name}" if port_name else service


def chain_hash(text: str) -> str:
    """Upstream's chain-name suffix: the first 16 characters of base32(sha256(text))."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


# ------------------------------------------------------------------------------------------- masquerade


def mark(m: MasqueradeSettings) -> str:
    """The masquerade fwmark, as iptables-save prints it (bit 14: 0x4000)."""
    if not 0 <= m.masquerade_bit <= 31:
        raise ValueError(f"--iptables-masquerade-bit must be 0..31, not {m.masquerade_bit}")
    return f"{1 << m.masquerade_bit:#x}"


def masquerade_chains(m: MasqueradeSettings) -> tuple[Chain, Chain]:
    """KUBE-MARK-MASQ (sets the mark) and KUBE-POSTROUTING (SNATs what carries it), both in nat."""
    value = mark(m)
    return (
        Chain(MARK_MASQ_CHAIN, (f"-j MARK --or-mark {value}",)),
        Chain(POSTROUTING_CHAIN, (
            f"-m mark ! --mark {value}/{value} -j RETURN",
            # Clear the mark so a packet that traverses the stack again is not masqueraded twice.
            f"-j MARK --xor-mark {value}",
            '-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully',
        )),
    )


def forward_chain(m: MasqueradeSettings) -> Chain:
    """KUBE-FORWARD (filter): forward what was marked for SNAT even under a DROP policy, and drop packets
    conntrack calls INVALID, which NAT cannot translate (upstream)."""
    value = mark(m)
    return Chain(FORWARD_CHAIN, (
        "-m conntrack --ctstate INVALID -j DROP",
        f'-m comment --comment "kubernetes forwarding rules" -m mark --mark {value}/{value} -j ACCEPT',
    ))


MASQUERADE_JUMPS = (
    Jump("nat", "POSTROUTING", POSTROUTING_CHAIN, "kubernetes postrouting rules"),
    Jump("filter", "FORWARD", FORWARD_CHAIN, "kubernetes forwarding rules"),
)


def mark_masq_rule(m: MasqueradeSettings, match: str, family: int = 4) -> str | None:
    """The body of the rule that marks ClusterIP traffic (`match`) of `family` for SNAT: all of it with
    --masquerade-all, what comes from outside --cluster-cidr's CIDR of that family, or None (no such rule)."""
    if m.masquerade_all:
        return f"{match} -j {MARK_MASQ_CHAIN}"
    if cidr := m.cluster_cidr_of(family):
        return f"{match} ! -s {cidr} -j {MARK_MASQ_CHAIN}"
    return None


# ---------------------------------------------------------------------------------------------- cleanup

ModeChain = Callable[[str, str], bool]
"""(table, chain) -> whether the chain is one only this mode makes."""
ModeRule = Callable[[str, str, str], bool]
"""(table, chain, rule body) -> whether a rule in a shared chain is this mode's."""
ChainRef = tuple[str, str, str]
"""(iptables backend, table, chain): a chain the running mode writes, which no other mode's cleanup removes."""


def _unused_shared(saved: Mapping[str, SavedTable], gone: set[tuple[str, str]],
                   is_ours: Callable[[str, str, str], bool]) -> set[tuple[str, str]]:
    """The shared chains no remaining rule uses: KUBE-SERVICES when it would be empty; KUBE-MARK-MASQ when
    nothing jumps to it any more; KUBE-POSTROUTING and KUBE-FORWARD (which only act on its mark) with it."""
    present = {(t, c) for t, c in SHARED_CHAINS if c in saved.get(t, SavedTable()).chains}
    unused = {(t, c) for t, c in present
              if c == SERVICES_CHAIN and all(is_ours(t, c, body) for body in saved[t].rules(c))}
    nat = saved.get("nat", SavedTable())
    marking = [body for chain, bodies in nat.chains.items()
               if chain not in BUILTIN_CHAINS and ("nat", chain) not in gone | unused
               for body in bodies if target(body) == MARK_MASQ_CHAIN and not is_ours("nat", chain, body)]
    if not marking:
        unused |= {(t, c) for t, c in present if c != SERVICES_CHAIN}
    return unused


def removal_plan(saved: Mapping[str, SavedTable], mode_chain: ModeChain, mode_rule: ModeRule,
                 keep: Collection[tuple[str, str]] = ()) -> tuple[dict[str, TableEdit], list[str]]:
    """What to remove of one mode in `saved`: the restore edits, and one line per removed thing saying why.
    The (table, chain)s in `keep` are the running mode's: never removed, though the mode's rules in them go."""
    own = {(table, chain) for table, st in saved.items() for chain in st.chains if mode_chain(table, chain)}
    gone = own - set(keep)

    def is_ours(table: str, chain: str, body: str) -> bool:
        return (table, target(body)) in gone or mode_rule(table, chain, body)

    gone |= _unused_shared(saved, gone, is_ours) - set(keep)
    edits: dict[str, TableEdit] = {}
    done: list[str] = []
    for table, st in saved.items():
        edit = edits.setdefault(table, TableEdit())
        for chain, bodies in st.chains.items():
            if (table, chain) in gone:
                continue
            for body in bodies:
                if (table, target(body)) in gone or mode_rule(table, chain, body):
                    why = "jumps to a removed chain" if (table, target(body)) in gone else "the mode's rule"
                    edit.delete_rule(chain, body)
                    done.append(f"{table} rule in {chain}: {body} ({why})")
        for chain in st.chains:
            if (table, chain) in gone:
                why = "the mode's own chain" if (table, chain) in own else "shared, and no rule left uses it"
                edit.remove(chain)
                done.append(f"{table} chain {chain} ({why})")
    return edits, done


def cleanup(mode_chain: ModeChain, mode_rule: ModeRule, backends: Iterable[Tools] | None = None,
            keep: Collection[ChainRef] = (), shared: bool = True) -> list[str]:
    """Remove one mode's chains and rules from every installed iptables backend (a node may have run either), in
    both families (iptables and ip6tables), and with `shared` the shared chains once unused, but those in `keep`
    (the running mode's, in either family); "<command>-<backend> <what> (<why>)" per removed thing."""
    done: list[str] = []
    for t in installed_backends((4, 6)) if backends is None else backends:
        try:
            saved = save(t, tables=None)
        except DataplaneError:
            continue  # this backend's tables cannot be read here (e.g. no legacy iptables in the kernel)
        kept = {(table, chain) for backend, table, chain in keep if backend == t.backend}
        kept |= set() if shared else SHARED_CHAINS
        edits, removed = removal_plan({k: v for k, v in saved.items() if k in TABLES}, mode_chain, mode_rule, kept)
        if removed:
            restore(t, restore_input(edits))
            done += [f"{t.command}-{t.backend} {line}" for line in removed]
    return done


def cleanup_shared(keep: Collection[ChainRef] = ()) -> list[str]:
    """Remove the shared chains no rule uses any more (after the modes' own cleanups with `shared=False`), but
    those in `keep`; as `cleanup`. Shared chains are no one mode's, so this says what left them: no mode."""
    return cleanup(lambda _table, _chain: False, lambda _table, _chain, _body: False, keep=keep)
