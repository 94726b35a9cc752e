"""The iptables dataplane backend: upstream kube-proxy's KUBE-* chains, one iptables-restore per sync, and one
ip6tables-restore for the IPv6 frontends (upstream's dual-stack kube-proxy runs one proxier per family: the same
chains in both). The IPv4 restore goes first; should the IPv6 one fail, IPv4 has switched already, the sync
fails, and the next one, full, repairs both (as for nat and filter below). A node whose ip6tables cannot be used
(no binaries, no IPv6 in the kernel) serves IPv4 only, saying so at start.

Each sync is one `iptables-restore --noflush` holding both tables (see render.py for what it writes), so the
kernel switches from the previous rules to the new ones in one step per table, and keeps the previous ones
when the restore fails. (nat comes first; should only the small filter part fail, nat has already switched,
and the next sync repairs both.) pyproxy keeps no state the rules do not show: a restarted pyproxy adopts
them as they are (traffic keeps flowing), and its first sync, always a full one, reconciles them against
iptables-save. After a failed sync the next one is full too, since what is applied is then unsure.

UDP conntrack entries of endpoints that left are deleted after the restore, as upstream: a UDP "flow" has
no end, so without that a client would keep talking to a removed backend. Failing to do so is logged only.
The plan is model/conntrack.py's and netfilter.clear_stale_udp runs it, as in the nftables and ipvs modes.
After a restart `applied` is empty, so the first sync clears no endpoint's flows (only never-DNATed ones):
endpoints that left while pyproxy was down keep their UDP flows until those time out (the rules left by the
previous run are not read back as endpoint lists).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from types import MappingProxyType

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import DataplaneError, ModeUnavailable
from pyproxy.dataplane.iptables.render import Applied, is_mode_chain, is_mode_rule, render
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.model.conntrack import Stale
from pyproxy.model.state import BOTH_FAMILIES, IPV4_ONLY, DesiredState

log = logging.getLogger(__name__)


@dataclass
class IptablesSettings:
    backend: str = "auto"
    """--iptables-backend: "legacy", "nft", or "auto" (what the `iptables` command on this node is)."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)


class IptablesDataplane:
    mode = "iptables"
    unserved: Mapping[str, str] = MappingProxyType({})  # it serves every Service it is given
    localhost_nodeports = False  # no NodePorts on 127.0.0.1, unlike upstream's iptables mode (docs/differences.md)

    def __init__(self, settings: IptablesSettings) -> None:
        self.settings = settings
        self.tools: nf.Tools | None = None
        self.tools6: nf.Tools | None = None
        """ip6tables of the same flavour; None when it cannot be used here."""
        self.ip_families = BOTH_FAMILIES
        """The IP families it renders: both, unless start() finds ip6tables unusable (then the proxier leaves out
        the IPv6 frontends)."""
        self.collector = nf.ConntrackMetrics()
        """The dataplane's own metrics (the conntrack reconciler's), for the proxier's registry."""
        self.applied: Applied = {}
        self.applied6: Applied = {}
        self._reconciled = False
        """Whether `applied` is known to match the kernel (a full sync succeeded, no sync failed since)."""

    def start(self) -> None:
        t = nf.usable_tools(self.settings.backend, self.settings.masquerade)
        if shutil.which("conntrack") is None:
            log.warning("conntrack not found: UDP flows to removed endpoints will not be cut off")
        self.tools = t
        try:
            self.tools6 = nf.tools(t.backend, 6)
            nf.check_usable(self.tools6)
        except ModeUnavailable as e:
            self.tools6, self.ip_families = None, IPV4_ONLY
            log.warning("iptables mode serves IPv4 only: %s", e)
        # Both backends' hooks run in the kernel: rules a run on the other backend left would keep translating
        # ClusterIPs to stale endpoints beside ours.
        others = [o for o in nf.installed_backends((4, 6)) if o.backend != t.backend]
        for line in nf.cleanup(is_mode_chain, is_mode_rule, backends=others):
            log.info("removed what the iptables mode left on the other backend: %s", line)
        kept = [c for c in nf.save(t, ("nat",))["nat"].chains if is_mode_chain("nat", c)]
        if kept:
            log.info("kept %d KUBE-SVC/SEP/EXT/SVL/FW/NODEPORTS chains of the previous run until the first sync",
                     len(kept))
        log.info("iptables mode on the %s backend (%s)", t.backend, t.restore)

    def stop(self) -> None:
        """Nothing to release: the rules stay, so traffic keeps flowing."""

    def chains(self) -> frozenset[nf.ChainRef]:
        """The shared chains this mode writes (its own chains, `is_mode_chain`, are no other mode's to remove)."""
        assert self.tools is not None, "start() first"
        return frozenset((self.tools.backend, table, chain) for table, chain in nf.SHARED_CHAINS)

    def housekeeping_due(self) -> bool:
        return False

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        assert self.tools is not None, "start() first"
        full = changed is None or not self._reconciled
        stale: list[Stale] = []
        for tools, family in ((self.tools, 4), (self.tools6, 6)):
            if tools is None:
                continue
            applied = self.applied if family == 4 else self.applied6
            saved = nf.save(tools) if full else None
            plan = render(desired, None if full else changed, applied, self.settings.masquerade, saved, family)
            try:
                nf.restore(tools, plan.text)
            except DataplaneError as e:
                self._reconciled = False
                raise DataplaneError(f"{tools.command}-{tools.backend}-restore failed, the previous rules stay: "
                                     f"{e}") from e
            if family == 4:
                self.applied = plan.applied
            else:
                self.applied6 = plan.applied
            stale += plan.stale_udp
            log.debug("%s IPv%d sync: %d chains written, %d removed, %d rules", "full" if full else "partial",
                      family, plan.written, plan.removed, plan.rules)
        self._reconciled = True
        nf.clear_stale_udp(stale, self.collector)


def cleanup(settings: IptablesSettings, shared: bool = True) -> list[str]:
    """Remove the iptables mode's chains and jumps from nat and filter, in both iptables backends; with
    `shared`, the shared ones (KUBE-SERVICES, KUBE-MARK-MASQ, ...) too unless another mode's rules use them."""
    return nf.cleanup(is_mode_chain, is_mode_rule, shared=shared)
