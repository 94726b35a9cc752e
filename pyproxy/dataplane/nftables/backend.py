"""The nftables dataplane backend: runs `nft` (no Python bindings), one `nft -f -` transaction per sync, which
writes both families' tables (`ip pyproxy`, `ip6 pyproxy`, as upstream's `ip kube-proxy` and `ip6 kube-proxy`):
each frontend goes to its family's table, rendered alike (render.py's `family`).

What the kernel holds is the truth: start() reads the table a previous run left and keeps it (traffic goes on
flowing through a restart), and every full sync lists the table again and reconciles it, so objects someone
removed come back and objects nobody wants go. Between full syncs the renderer works from `self.state`, the
state the last transaction left; a failed transaction changes nothing in the kernel (nft applies all or
nothing), and the next sync is a full one.

After a transaction, UDP conntrack entries of endpoints that left are deleted with the `conntrack` tool, as
upstream does: a UDP "connection" has no end, so without that a client would keep talking to an endpoint
that is gone. Failures there are logged, never fatal: the rules are already right. The plan is
model/conntrack.py's (the same for every netfilter mode) over the table's recorded known endpoints, which a
restarted pyproxy reads back: its first sync clears only endpoints the table knew and the new state lacks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import DataplaneError, ModeUnavailable
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.render import DIALECTS, base_commands, render
from pyproxy.dataplane.nftables.table import (
    FAMILIES,
    NO_ENDPOINT_NODEPORTS,
    NO_ENDPOINT_SERVICES,
    SERVICE_IPS,
    SERVICE_NODEPORTS,
    TABLE,
    TableState,
    parse_listing,
)
from pyproxy.model.objects import IPV4, family_of
from pyproxy.model.state import BOTH_FAMILIES, IPV4_ONLY, DesiredState, ServicePortState

log = logging.getLogger(__name__)

NFT_TIMEOUT = 60.0
# Upstream's requirement: a kernel this recent implies an nft (here and on the host) that handles its rules.
MIN_KERNEL = (5, 13)
# From 6.2 a chain no map element points to any more can be deleted in the same transaction.
SAME_TRANSACTION_DELETE_KERNEL = (6, 2)
# How long a chain stays flushed before it is deleted on older kernels (upstream: one second).
DEFERRED_DELETE_SECONDS = 1.0
_MISSING = "No such file or directory"


@dataclass
class NftablesSettings:
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    """--cluster-cidr, --masquerade-all, --iptables-masquerade-bit: shared by the netfilter modes."""


def kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of a `uname -r` string such as "6.1.0-18-amd64"; (0, 0) when it is not one."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def run_nft(args: Sequence[str], script: str | None = None) -> str:
    """`nft ARGS` (a script on stdin), bounded in time; its stdout, or DataplaneError with its stderr."""
    return nf.run(["nft", *args], input=script, timeout=NFT_TIMEOUT)


def read_table(family: int = IPV4) -> TableState:
    """The table of `family` (4, 6) as the kernel holds it; an empty state when there is none.

    Its chains, sets and maps (with elements), listed kind by kind for the whole family and kept to our table
    by parse_listing: `list table` (and even `list tables`) would list every rule too, which the state has no
    use for and which took 35 s at 10,000 Services (110,000 chains); these listings take about 3 s there.
    A table holding none of these counts as absent: a full sync adds it anyway."""
    nft_family = FAMILIES[family]
    items = [item for kind in ("chains", "sets", "maps")
             for item in json.loads(run_nft(["-j", "list", kind, nft_family])).get("nftables", [])]
    if not any(obj.get("table") == TABLE for item in items for obj in item.values() if isinstance(obj, dict)):
        return TableState()
    return parse_listing({"nftables": [{"table": {"family": nft_family, "name": TABLE}}, *items]}, nft_family)


def _frontend_count(state: TableState) -> int:
    maps = (SERVICE_IPS, NO_ENDPOINT_SERVICES, SERVICE_NODEPORTS, NO_ENDPOINT_NODEPORTS)
    return sum(len(state.elems(m)) for m in maps)


class NftablesDataplane:
    mode = "nftables"
    unserved: Mapping[str, str] = MappingProxyType({})  # it serves every Service it is given
    localhost_nodeports = False  # no NodePorts on 127.0.0.1: as upstream's nftables mode

    def __init__(self, settings: NftablesSettings) -> None:
        self.settings = settings
        self.ip_families = BOTH_FAMILIES
        """The IP families it renders: both, unless start() found the kernel without IPv6 nftables (then the
        proxier leaves out the IPv6 frontends)."""
        self.states = {family: TableState() for family in sorted(BOTH_FAMILIES)}
        """Each family's table, as the last transaction left it."""
        self.collector = nf.ConntrackMetrics()
        """The dataplane's own metrics (the conntrack reconciler's), for the proxier's registry."""
        self._need_full = True
        self._defer_deletes = False
        self._pending: dict[int, dict[str, float]] = {family: {} for family in self.states}
        """Per family, chains flushed but not yet deleted (kernels before 6.2) -> when (monotonic)."""

    def start(self) -> None:
        if shutil.which("nft") is None:
            raise ModeUnavailable("the nft command is not installed")
        release = os.uname().release
        version = kernel_version(release)
        if version < MIN_KERNEL:
            raise ModeUnavailable(f"kernel {release} is older than {MIN_KERNEL[0]}.{MIN_KERNEL[1]}, "
                                  f"which the nftables mode needs")
        masq = self.settings.masquerade
        try:
            state = read_table(IPV4)
            # What the first full sync will begin with, checked by the kernel but not committed.
            run_nft(["-c", "-f", "-"], "".join(c + "\n" for c in base_commands(state, masq)))
        except DataplaneError as e:
            raise ModeUnavailable(f"nft cannot program this network namespace: {e}") from e
        self.states[IPV4] = state
        try:
            state6 = read_table(6)
            run_nft(["-c", "-f", "-"], "".join(c + "\n" for c in base_commands(state6, masq, DIALECTS[6])))
            self.states[6] = state6
        except DataplaneError as e:
            # A kernel without IPv6 (ipv6.disable=1) or without its nftables families: IPv4 is served alone.
            self.ip_families = IPV4_ONLY
            log.warning("nftables mode serves IPv4 only: table ip6 %s cannot be written here: %s", TABLE, e)
        self._defer_deletes = version < SAME_TRANSACTION_DELETE_KERNEL
        for family, kept in self.states.items():
            if kept.present:
                log.info("kept table %s %s from the previous run: %d frontends, %d chains", FAMILIES[family], TABLE,
                         _frontend_count(kept), len(kept.chains))

    def stop(self) -> None:
        """Nothing to release: the table stays, and with it the traffic."""

    def housekeeping_due(self) -> bool:
        # Chains a partial sync flushed wait for the next transaction that deletes anyway (or a full sync):
        # a delete on its own costs nft a listing of every chain, and a flushed chain is harmless.
        return False

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        full = changed is None or self._need_full
        families = sorted(self.ip_families)
        if full:
            self.states = {f: _with_known(read_table(f), self.states[f]) if f in families else self.states[f]
                           for f in self.states}
            services = dict(desired.services)
        else:
            assert changed is not None
            services = {k: desired.services.get(k, ()) for k in changed}
        now = time.monotonic()
        plans = {}
        for family in families:
            pending = {c: now - t >= DEFERRED_DELETE_SECONDS for c, t in self._pending[family].items()}
            # A partial sync that only adds and flushes leaves deleting the chains it no longer wants to a later
            # sync: any `delete` makes nft list every chain of the table first (4.7 s for one Service at 10,000
            # Services, 0.2 s without). A flushed chain nothing points to is harmless meanwhile.
            plans[family] = render(self.states[family], of_family(services, family), self.settings.masquerade,
                                   full=full, pending=pending, defer_deletes=self._defer_deletes,
                                   lazy_deletes=not full, family=family,
                                   nodeport_ips=[ip for ip in desired.node.nodeport_addresses
                                                 if family_of(ip) == family])
        commands = sum(len(plan.commands) for plan in plans.values())
        try:
            run_nft(["-f", "-"], "".join(plan.script for plan in plans.values()))  # both tables, one transaction
        except DataplaneError as e:
            self._need_full = True
            raise DataplaneError(f"nftables {'full' if full else 'partial'} sync of {len(services)} services "
                                 f"({commands} commands) failed; the tables are as before: {e}") from e
        for family, plan in plans.items():
            self.states[family] = plan.state
            self._pending[family] = {c: self._pending[family].get(c, now) for c in plan.deferred}
        self._need_full = False
        log.debug("nft transaction: %d commands, %d rules, %.1f ms", commands,
                  sum(plan.rule_count for plan in plans.values()), (time.monotonic() - now) * 1000)
        nf.clear_stale_udp([stale for plan in plans.values() for stale in plan.stale_udp], self.collector)


def of_family(services: Mapping[str, Sequence[ServicePortState]], family: int
              ) -> dict[str, tuple[ServicePortState, ...]]:
    """The frontends of `family` of each Service (every Service stays, with () when it has none of that family:
    in a partial sync that is what removes its objects from that family's table)."""
    return {key: tuple(st for st in states if st.frontend.family == family) for key, states in services.items()}


def _with_known(kernel: TableState, memory: TableState) -> TableState:
    """The kernel's state, plus the not-ready endpoints `memory` knew for frontends the kernel still has."""
    keys = {k for m in (SERVICE_IPS, NO_ENDPOINT_SERVICES, SERVICE_NODEPORTS, NO_ENDPOINT_NODEPORTS)
            for k in kernel.elems(m)}
    known = dict(kernel.known)
    for key in keys & set(memory.known):
        known[key] = known.get(key, frozenset()) | memory.known[key]
    return replace(kernel, known=known)


def cleanup(settings: NftablesSettings) -> list[str]:
    """Delete pyproxy's tables (both families) in this network namespace; what went, one line per thing."""
    if shutil.which("nft") is None:
        raise ModeUnavailable("the nft command is not installed")
    gone = []
    for nft_family in FAMILIES.values():
        try:
            run_nft(["delete", "table", nft_family, TABLE])
        except DataplaneError as e:
            # No such table; or, for ip6, a kernel without IPv6 nftables, which holds none either.
            if _MISSING in str(e) or nft_family != FAMILIES[IPV4]:
                continue
            raise
        gone.append(f"nftables table {nft_family} {TABLE}")
    return gone
