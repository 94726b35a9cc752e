"""Settings of `pyproxy run`, shaped like upstream's KubeProxyConfiguration. The CLI and the config file
only map onto these dataclasses."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pyproxy.dataplane.bpf.settings import BpfSettings
from pyproxy.dataplane.iptables.backend import IptablesSettings
from pyproxy.dataplane.ipvs.backend import IpvsSettings
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.backend import NftablesSettings
from pyproxy.dataplane.userspace.backend import UserspaceSettings
from pyproxy.k8s.client import ConnectionSettings
from pyproxy.model.node import select_nodeport_addresses

WINDOWS_MODES = ("kernelspace", "winuserspace")
"""Upstream's Windows proxy modes: a known name, so asking for one says why it cannot be."""


def windows_only(mode: str) -> str:
    """Why `mode`, one of WINDOWS_MODES, cannot run."""
    what = "the Windows kernel's HNS load balancer" if mode == "kernelspace" else "a userspace proxy for Windows"
    return f"{mode} is upstream's Windows mode ({what}); pyproxy runs on Linux only (its last fallback: userspace)"


@dataclass
class LogSettings:
    """-v and --logging-format (KubeProxyConfiguration's `logging` block)."""

    verbosity: int = 2
    """-v: info lines of this verbosity and below are logged, as upstream's klog levels (0: only what every
    operator needs; 2: sync summaries; 5 and more: debug). Upstream's default is 0; pyproxy's 2 puts a line per
    sync in the log, which an operator comparing with kube-proxy's `-v=2` DaemonSets expects."""
    format: str = "text"
    """--logging-format: text, or json (one object a line with upstream's keys: ts, v, msg, ...)."""


@dataclass
class ProxySettings:
    mode: str = "auto"
    """--proxy-mode: which dataplane serves the Services; auto takes the first of bpf, ipvs, nftables,
    iptables, userspace that can run here."""
    source: Path | None = None
    """--source: a manifest file or folder; without it, the Kubernetes API."""
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    """--kubeconfig / --master (clientConnection in KubeProxyConfiguration); neither: in-cluster."""
    hostname_override: str | None = None
    """--hostname-override: the name of the own Node; default: this host's name, lowercased."""
    nodeport_addresses: tuple[str, ...] = ()
    """--nodeport-addresses: the node addresses NodePorts are served on: CIDRs of either family (a node address
    in one of them; a family given none: all its addresses, as upstream), or "primary" (the node's primary
    address of each family: the Node object's, else the first address of that family's default-route device).
    Empty, as upstream's iptables mode: every address of the node (loopback and IPv6 link-local ones aside)."""
    localhost_nodeports: bool = True
    """--iptables-localhost-nodeports (config: iptables.localhostNodePorts; upstream's, default true): NodePorts are
    also served on 127.0.0.1 to the node's own processes, when --nodeport-addresses is unset or holds 127.0.0.1.
    bpf mode serves them (its socket hooks: --bpf-socket-lb); the other modes do not (docs/differences.md)."""
    healthz_bind_address: str = "0.0.0.0:10256"
    """--healthz-bind-address: /healthz and /livez (upstream's port)."""
    metrics_bind_address: str = "127.0.0.1:10249"
    """--metrics-bind-address: Prometheus /metrics (upstream's port)."""
    min_sync_period: float = 1.0
    """--min-sync-period: seconds between two syncs at the least; bursts coalesce into one. 0: no pause."""
    sync_period: float = 30.0
    """--sync-period: seconds between syncs at the most; such a periodic sync applies what changed. Positive
    and at least --min-sync-period, as upstream (0 would sync without a pause; a config file's 0s means
    upstream's default, which a config loader must apply before these settings)."""
    full_sync_period: float = 3600.0
    """Seconds between full syncs, which rewrite every Service and reconcile with the kernel (upstream's
    FullSyncPeriod, one hour; also after a failed sync). At 10,000 Services a full sync costs the netfilter
    modes seconds of CPU, too much for every --sync-period."""
    bpf: BpfSettings = field(default_factory=BpfSettings)
    """The BPF dataplane's own settings."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    """--cluster-cidr, --masquerade-all (every mode), --iptables-masquerade-bit (the netfilter modes)."""
    iptables: IptablesSettings = field(default_factory=IptablesSettings)
    nftables: NftablesSettings = field(default_factory=NftablesSettings)
    ipvs: IpvsSettings = field(default_factory=IpvsSettings)
    userspace: UserspaceSettings = field(default_factory=UserspaceSettings)
    logging: LogSettings = field(default_factory=LogSettings)

    def __post_init__(self) -> None:
        # One masquerade policy for every mode, as upstream's single set of flags.
        for mode in (self.iptables, self.nftables, self.ipvs, self.bpf, self.userspace):
            mode.masquerade = self.masquerade

    def problems(self) -> list[str]:
        """What is wrong with these settings (every mode's), one line each naming its flag; empty when none."""
        out = []
        if self.mode in WINDOWS_MODES:
            out.append(f"--proxy-mode: {windows_only(self.mode)}")
        if not self.sync_period > 0:
            out.append(f"--sync-period must be positive, not {format_duration(self.sync_period)} "
                       "(0 would sync without a pause, spinning a core)")
        if not self.min_sync_period >= 0:
            out.append(f"--min-sync-period must not be negative, not {format_duration(self.min_sync_period)}")
        elif self.sync_period > 0 and self.sync_period < self.min_sync_period:
            out.append(f"--sync-period ({format_duration(self.sync_period)}) must not be shorter than "
                       f"--min-sync-period ({format_duration(self.min_sync_period)})")
        if not self.full_sync_period > 0:
            out.append(f"the full sync period must be positive, not {format_duration(self.full_sync_period)}")
        try:
            select_nodeport_addresses((), self.nodeport_addresses, None)
        except ValueError as e:
            out.append(str(e))
        for flag, address in (("--healthz-bind-address", self.healthz_bind_address),
                              ("--metrics-bind-address", self.metrics_bind_address)):
            try:
                parse_address(address)
            except ValueError as e:
                out.append(f"{flag}: {e}")
        return (out + self.masquerade.problems() + self.ipvs.problems() + self.bpf.problems()
                + self.userspace.problems())

    def validate(self) -> None:
        """SettingError naming every wrong setting: what a start checks before it changes anything."""
        problems = self.problems()
        if problems:
            raise SettingError(problems)


class SettingError(ValueError):
    """Settings no mode can run with; the message names each wrong one by its flag."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0}
_NUMBER = r"(?:\d+\.?\d*|\.\d+)"
_DURATION_PART = re.compile(rf"({_NUMBER})(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds, from a Go duration as upstream's flags and config file take them ("24h0m0s", "1h30m",
    "250ms", "-1s", "0") or from plain seconds ("30", "0.5"); ValueError otherwise. The sign is kept: whether
    a value may be negative or zero is the setting's rule (`ProxySettings.problems`)."""
    s = text.strip()
    sign, body = (-1.0, s[1:]) if s[:1] == "-" else (1.0, s[1:] if s[:1] == "+" else s)
    if re.fullmatch(_NUMBER, body):
        return sign * float(body)
    if body and re.fullmatch(rf"(?:{_DURATION_PART.pattern})+", body):
        return sign * sum(float(n) * _DURATION_UNITS[unit] for n, unit in _DURATION_PART.findall(body))
    raise ValueError(f"not a duration: {text!r} (want e.g. 30s, 1h0m0s, 250ms, or seconds)")


def format_duration(seconds: float) -> str:
    """A duration as Go prints one ("1h0m0s", "2m0s", "30s", "250ms", "0s"), for messages."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{round(seconds * 1000, 6):g}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{round(secs, 6):g}s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    return f"{int(hours)}h{text}" if hours else text


def parse_address(addr: str) -> tuple[str, int]:
    """"host:port" (IPv6 hosts in brackets) -> (host, port); port 0 means any free port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"invalid bind address {addr!r}: want host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def node_name(settings: ProxySettings) -> str:
    """The own Node's name, as upstream derives it."""
    name = settings.hostname_override or os.uname().nodename
    return name.strip().lower()
