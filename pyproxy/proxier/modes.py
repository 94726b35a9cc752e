"""Which dataplane runs: `--proxy-mode=auto` tries each in turn, an explicit mode must work or pyproxy stops.

Auto's order is fastest first: bpf (the kernel loads and attaches the programs, and pyproxy may), ipvs (the
kernel has IPVS), nftables (kernel 5.13 or later and `nft` works), iptables. A mode is only "available" when
its own `start()` succeeded, because only that proves it: a kernel may have BPF but refuse this process
(capabilities, lockdown), or have nf_tables but an `nft` too old. Each skipped mode is logged with its reason.

Starting one mode removes what the others left in this network namespace, as upstream does when switching
modes: two dataplanes translating the same ClusterIP would fight, and leftover rules of a mode that no longer
runs would keep serving stale endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pyproxy.dataplane.base import Dataplane, ModeUnavailable
from pyproxy.dataplane.bpf import backend as bpf
from pyproxy.dataplane.bpf.loader import BpfUnavailable
from pyproxy.dataplane.iptables import backend as iptables
from pyproxy.dataplane.ipvs import backend as ipvs
from pyproxy.dataplane.nftables import backend as nftables
from pyproxy.proxier.config import ProxySettings

log = logging.getLogger(__name__)

AUTO = "auto"
AUTO_ORDER = ("bpf", "ipvs", "nftables", "iptables")
MODES = (AUTO, *AUTO_ORDER)


class NoModeAvailable(RuntimeError):
    """No dataplane can run here (auto), or the one asked for cannot; the message says why for each."""


@dataclass(frozen=True)
class _Mode:
    make: Callable[[ProxySettings], Dataplane]
    cleanup: Callable[[ProxySettings], list[str]]


def _table() -> dict[str, _Mode]:
    return {
        "bpf": _Mode(lambda s: bpf.BpfDataplane(s.bpf), lambda s: bpf.cleanup(s.bpf.pin_path)),
        "ipvs": _Mode(lambda s: ipvs.IpvsDataplane(s.ipvs), lambda s: ipvs.cleanup(s.ipvs)),
        "nftables": _Mode(lambda s: nftables.NftablesDataplane(s.nftables), lambda s: nftables.cleanup(s.nftables)),
        "iptables": _Mode(lambda s: iptables.IptablesDataplane(s.iptables), lambda s: iptables.cleanup(s.iptables)),
    }


def _try_start(mode: str, settings: ProxySettings) -> Dataplane:
    """The mode's dataplane, started; ModeUnavailable when it cannot run here."""
    dataplane = _table()[mode].make(settings)
    try:
        dataplane.start()
    except ModeUnavailable:
        raise
    except (BpfUnavailable, OSError) as e:  # EPERM from bpf(), tc or a bpffs mount: not for this process
        raise ModeUnavailable(str(e)) from e
    return dataplane


def start_dataplane(settings: ProxySettings) -> Dataplane:
    """Start the mode settings ask for (auto: the first that works); raises NoModeAvailable."""
    candidates = AUTO_ORDER if settings.mode == AUTO else (settings.mode,)
    if settings.mode not in MODES:
        raise NoModeAvailable(f"--proxy-mode={settings.mode}: not one of {', '.join(MODES)}")
    reasons = []
    for mode in candidates:
        try:
            dataplane = _try_start(mode, settings)
        except ModeUnavailable as e:
            reasons.append(f"{mode}: {e}")
            if settings.mode == AUTO:
                log.info("proxy mode %s skipped: %s", mode, e)
            continue
        log.info("proxy mode %s%s", mode, " (chosen automatically)" if settings.mode == AUTO else "")
        for line in cleanup(settings, keep=mode):
            log.info("removed what proxy mode %s left: %s", *line.split(": ", 1))
        return dataplane
    if settings.mode == AUTO:
        raise NoModeAvailable("no proxy mode can run here: " + "; ".join(reasons))
    raise NoModeAvailable(f"--proxy-mode={settings.mode} cannot run here: {reasons[0].split(': ', 1)[1]}")


def cleanup(settings: ProxySettings, keep: str | None = None) -> list[str]:
    """Remove what every mode but `keep` made in this network namespace: "mode: what" per removed thing.
    A mode whose tools are missing has nothing to remove; its failure is logged, the others still run."""
    done: list[str] = []
    for mode, entry in _table().items():
        if mode == keep:
            continue
        try:
            done += [f"{mode}: {line}" for line in entry.cleanup(settings)]
        except ModeUnavailable as e:
            log.debug("nothing of %s to clean up: %s", mode, e)
        except (OSError, RuntimeError) as e:
            log.warning("cleanup of what proxy mode %s made failed: %s", mode, e)
    return done
