"""The iptables dataplane backend: upstream kube-proxy's KUBE-* chains, one iptables-restore per sync.

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
from collections.abc import Set
from dataclasses import dataclass, field

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import DataplaneError
from pyproxy.dataplane.iptables.render import Applied, is_mode_chain, is_mode_rule, render
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.model.state import IPV4_ONLY, DesiredState

log = logging.getLogger(__name__)


@dataclass
class IptablesSettings:
    backend: str = "auto"
    """--iptables-backend: "legacy", "nft", or "auto" (what the `iptables` command on this node is)."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)


class IptablesDataplane:
    mode = "iptables"
    ip_families = IPV4_ONLY
    """The IP families it renders (the proxier leaves out the others' frontends): IPv4 only,
    its ip6tables rules are not written yet."""

    def __init__(self, settings: IptablesSettings) -> None:
        self.settings = settings
        self.tools: nf.Tools | None = None
        self.collector = nf.ConntrackMetrics()
        """The dataplane's own metrics (the conntrack reconciler's), for the proxier's registry."""
        self.applied: Applied = {}
        self._reconciled = False
        """Whether `applied` is known to match the kernel (a full sync succeeded, no sync failed since)."""

    def start(self) -> None:
        t = nf.usable_tools(self.settings.backend, self.settings.masquerade)
        if shutil.which("conntrack") is None:
            log.warning("conntrack not found: UDP flows to removed endpoints will not be cut off")
        self.tools = t
        # Both backends' hooks run in the kernel: rules a run on the other backend left would keep translating
        # ClusterIPs to stale endpoints beside ours.
        others = [o for o in nf.installed_backends() if o.backend != t.backend]
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
        saved = nf.save(self.tools) if full else None
        plan = render(desired, None if full else changed, self.applied, self.settings.masquerade, saved)
        try:
            nf.restore(self.tools, plan.text)
        except DataplaneError as e:
            self._reconciled = False
            raise DataplaneError(f"iptables-{self.tools.backend}-restore failed, the previous rules stay: {e}") from e
        self.applied = plan.applied
        self._reconciled = True
        log.debug("%s sync: %d chains written, %d removed, %d rules", "full" if full else "partial",
                  plan.written, plan.removed, plan.rules)
        nf.clear_stale_udp(plan.stale_udp, self.collector)


def cleanup(settings: IptablesSettings, shared: bool = True) -> list[str]:
    """Remove the iptables mode's chains and jumps from nat and filter, in both iptables backends; with
    `shared`, the shared ones (KUBE-SERVICES, KUBE-MARK-MASQ, ...) too unless another mode's rules use them."""
    return nf.cleanup(is_mode_chain, is_mode_rule, shared=shared)
