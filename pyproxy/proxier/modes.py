"""Which dataplane runs: `--proxy-mode=auto` tries each in turn, an explicit mode must work or pyproxy stops.

Auto's order is fastest first: bpf (the kernel loads and attaches the programs, and pyproxy may), ipvs (the
kernel has IPVS), nftables (kernel 5.13 or later and `nft` works), iptables, and last userspace (a proxy in
pyproxy's own process: it needs neither netfilter nor BPF, only CAP_NET_ADMIN for the Service addresses' local
routes). A mode is only "available" when its own `start()` succeeded, because only that proves it: a kernel may
have BPF but refuse this process (capabilities, lockdown), or have nf_tables but an `nft` too old. Each skipped
mode is logged with its reason.

Starting one mode removes what the others left in this network namespace, as upstream does when switching
modes: two dataplanes translating the same ClusterIP would fight, and leftover rules of a mode that no longer
runs would keep serving stale endpoints. It never touches the chains of the mode that starts (the iptables
and ipvs modes share KUBE-SERVICES and the masquerade chains), and logs each thing it removed and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import Dataplane, ModeUnavailable
from pyproxy.dataplane.bpf import backend as bpf
from pyproxy.dataplane.bpf.loader import BpfUnavailable
from pyproxy.dataplane.iptables import backend as iptables
from pyproxy.dataplane.ipvs import backend as ipvs
from pyproxy.dataplane.nftables import backend as nftables
from pyproxy.dataplane.userspace import backend as userspace
from pyproxy.proxier.config import WINDOWS_MODES, ProxySettings, format_duration, windows_only

log = logging.getLogger(__name__)

AUTO = "auto"
AUTO_ORDER = ("bpf", "ipvs", "nftables", "iptables", "userspace")
MODES = (AUTO, *AUTO_ORDER)


class Honoured(NamedTuple):
    flag: str
    get: Callable[[ProxySettings], object]
    modes: frozenset[str]
    """The modes that act on the setting."""


_BPF = frozenset({"bpf"})
_NETFILTER = frozenset({"ipvs", "nftables", "iptables"})
# Every setting that only some modes act on, and which. A mode started with one of the others away from its
# default warns, naming it (settings every mode acts on are not listed: the sources, syncs, servers, the pin
# path, which every mode's start cleans up). The one place to change when a mode learns a setting.
HONOURED_BY = (
    Honoured("--devices", lambda s: s.bpf.devices, _BPF),
    Honoured("--xdp-devices", lambda s: s.bpf.xdp_devices, _BPF),
    Honoured("--bpf-xdp-mode", lambda s: s.bpf.xdp_mode, _BPF),
    Honoured("--bpf-socket-lb", lambda s: s.bpf.socket_lb, _BPF),
    Honoured("--bpf-socket-lb-hostns-only", lambda s: s.bpf.socket_lb_hostns_only, _BPF),
    Honoured("--cgroup-root", lambda s: s.bpf.cgroup_root, _BPF),
    Honoured("--iptables-localhost-nodeports", lambda s: s.localhost_nodeports, _BPF),
    Honoured("--bpf-snat-port-range", lambda s: s.bpf.snat_ports, _BPF),
    Honoured("--bpf-scheduler", lambda s: s.bpf.scheduler, _BPF),
    Honoured("--bpf-loader", lambda s: s.bpf.loader, _BPF),
    Honoured("--bpf-maglev-table-size", lambda s: s.bpf.maglev_table_size, _BPF),
    Honoured("--bpf-map-sizes", lambda s: s.bpf.max_entries, _BPF),
    Honoured("--bpf-endpoint-counters", lambda s: s.bpf.endpoint_counters, _BPF),
    Honoured("--conntrack-tcp-timeout-established", lambda s: s.bpf.ct_timeouts.tcp_established, _BPF),
    Honoured("--conntrack-tcp-timeout-close-wait", lambda s: s.bpf.ct_timeouts.tcp_closing, _BPF),
    Honoured("--conntrack-udp-timeout", lambda s: s.bpf.ct_timeouts.udp_new, _BPF),
    Honoured("--conntrack-udp-timeout-stream", lambda s: s.bpf.ct_timeouts.udp_established, _BPF),
    Honoured("--bpf-ct-tcp-syn-timeout", lambda s: s.bpf.ct_timeouts.tcp_new, _BPF),
    Honoured("--bpf-ct-tcp-syn-recv-timeout", lambda s: s.bpf.ct_timeouts.tcp_syn_recv, _BPF),
    Honoured("--bpf-ct-tcp-time-wait-timeout", lambda s: s.bpf.ct_timeouts.tcp_time_wait, _BPF),
    Honoured("--bpf-ct-tcp-close-timeout", lambda s: s.bpf.ct_timeouts.tcp_closed, _BPF),
    Honoured("--iptables-masquerade-bit", lambda s: s.masquerade.masquerade_bit, _NETFILTER),
    Honoured("--iptables-backend", lambda s: s.iptables.backend, frozenset({"ipvs", "iptables"})),
    Honoured("--ipvs-scheduler", lambda s: s.ipvs.scheduler, frozenset({"ipvs"})),
    Honoured("--udp-timeout", lambda s: s.userspace.udp_idle_timeout, frozenset({"userspace"})),
)


def unhonoured(settings: ProxySettings, mode: str) -> list[str]:
    """One line per setting given (away from its default) that `mode` does not act on."""
    defaults = ProxySettings()
    out = []
    for h in HONOURED_BY:
        value = h.get(settings)
        if mode not in h.modes and value != h.get(defaults):
            shown = ",".join(value) if isinstance(value, tuple) else \
                format_duration(value) if isinstance(value, float) else value
            others = ", ".join(m for m in AUTO_ORDER if m in h.modes)
            out.append(f"{mode} mode does not honour {h.flag} (set to {shown}): only the {others} "
                       f"mode{'s' if len(h.modes) > 1 else ''} do{'' if len(h.modes) > 1 else 'es'}")
    return out


class NoModeAvailable(RuntimeError):
    """No dataplane can run here (auto), or the one asked for cannot; the message says why for each."""


@dataclass(frozen=True)
class _Mode:
    make: Callable[[ProxySettings], Dataplane]
    cleanup: Callable[[ProxySettings], list[str]]
    """Remove what the mode made here, leaving the netfilter chains the modes share (see `cleanup`)."""


def _table() -> dict[str, _Mode]:
    return {
        "bpf": _Mode(lambda s: bpf.BpfDataplane(s.bpf), lambda s: bpf.cleanup(s.bpf.pin_path)),
        "ipvs": _Mode(lambda s: ipvs.IpvsDataplane(s.ipvs), lambda s: ipvs.cleanup(s.ipvs, shared=False)),
        "nftables": _Mode(lambda s: nftables.NftablesDataplane(s.nftables), lambda s: nftables.cleanup(s.nftables)),
        "iptables": _Mode(lambda s: iptables.IptablesDataplane(s.iptables),
                          lambda s: iptables.cleanup(s.iptables, shared=False)),
        "userspace": _Mode(lambda s: userspace.UserspaceDataplane(s.userspace),
                           lambda s: userspace.cleanup(s.userspace)),
    }


SHARED = "netfilter"
"""Who `cleanup` says left the shared netfilter chains: no one mode (the iptables and ipvs modes write them)."""


def _chains(dataplane: Dataplane) -> frozenset[nf.ChainRef]:
    """The netfilter chains a running mode writes, which another mode's cleanup must not remove even when
    they are empty (the iptables mode's filter KUBE-SERVICES, while every Service has endpoints)."""
    if isinstance(dataplane, iptables.IptablesDataplane | ipvs.IpvsDataplane):
        return dataplane.chains()
    return frozenset()


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
    if settings.mode in WINDOWS_MODES:
        raise NoModeAvailable(f"--proxy-mode={settings.mode}: {windows_only(settings.mode)}")
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
        log.info("Using %s Proxier", mode)  # upstream's line (server_linux.go), e.g. "Using iptables Proxier"
        for line in unhonoured(settings, mode):
            log.warning("%s", line)
        for line in cleanup(settings, keep=mode, chains=_chains(dataplane)):
            other, what = line.split(": ", 1)
            who = "the netfilter modes" if other == SHARED else f"proxy mode {other}"
            log.info("removed what %s left (%s runs now): %s", who, mode, what)
        return dataplane
    if settings.mode == AUTO:
        raise NoModeAvailable("no proxy mode can run here: " + "; ".join(reasons))
    raise NoModeAvailable(f"--proxy-mode={settings.mode} cannot run here: {reasons[0].split(': ', 1)[1]}")


def cleanup(settings: ProxySettings, keep: str | None = None, chains: Collection[nf.ChainRef] = ()) -> list[str]:
    """Remove what every mode but `keep` made in this network namespace: "mode: what (why)" per removed thing.
    The netfilter chains the modes share go last, once no rule uses them, as "netfilter: ..." (`SHARED`),
    but `chains`: those the running mode writes, which stay even when empty. A mode whose tools are missing
    has nothing to remove; its failure is logged, the others still run."""
    done: list[str] = []
    cleanups = [(mode, entry.cleanup) for mode, entry in _table().items() if mode != keep]
    for mode, remove in [*cleanups, (SHARED, lambda _s: nf.cleanup_shared(chains))]:
        try:
            done += [f"{mode}: {line}" for line in remove(settings)]
        except ModeUnavailable as e:
            log.debug("nothing of %s to clean up: %s", mode, e)
        except (OSError, RuntimeError) as e:
            log.warning("cleanup of what proxy mode %s made failed: %s", mode, e)
    return done
