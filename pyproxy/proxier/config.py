"""Settings of `pyproxy run`, shaped like upstream's KubeProxyConfiguration. The CLI and the config file
only map onto these dataclasses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pyproxy.dataplane.bpf.backend import BpfSettings
from pyproxy.dataplane.iptables.backend import IptablesSettings
from pyproxy.dataplane.ipvs.backend import IpvsSettings
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.backend import NftablesSettings
from pyproxy.k8s.client import ConnectionSettings


@dataclass
class ProxySettings:
    mode: str = "auto"
    """--proxy-mode: which dataplane programs the kernel; auto takes the first of bpf, ipvs, nftables,
    iptables that can run here."""
    source: Path | None = None
    """--source: a manifest file or folder; without it, the Kubernetes API."""
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    """--kubeconfig / --master (clientConnection in KubeProxyConfiguration); neither: in-cluster."""
    hostname_override: str | None = None
    """--hostname-override: the name of the own Node; default: this host's name, lowercased."""
    healthz_bind_address: str = "0.0.0.0:10256"
    """--healthz-bind-address: /healthz and /livez (upstream's port)."""
    metrics_bind_address: str = "127.0.0.1:10249"
    """--metrics-bind-address: Prometheus /metrics (upstream's port)."""
    min_sync_period: float = 1.0
    """--min-sync-period: seconds between two syncs at the least; bursts coalesce into one."""
    sync_period: float = 30.0
    """--sync-period: seconds between syncs at the most; such a periodic sync applies what changed."""
    full_sync_period: float = 3600.0
    """Seconds between full syncs, which rewrite every Service and reconcile with the kernel (upstream's
    FullSyncPeriod, one hour; also after a failed sync). At 10,000 Services a full sync costs the netfilter
    modes seconds of CPU, too much for every --sync-period."""
    bpf: BpfSettings = field(default_factory=BpfSettings)
    """The BPF dataplane's own settings."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    """--cluster-cidr, --masquerade-all, --iptables-masquerade-bit: shared by the netfilter modes."""
    iptables: IptablesSettings = field(default_factory=IptablesSettings)
    nftables: NftablesSettings = field(default_factory=NftablesSettings)
    ipvs: IpvsSettings = field(default_factory=IpvsSettings)

    def __post_init__(self) -> None:
        # One masquerade policy for every mode, as upstream's single set of flags.
        for mode in (self.iptables, self.nftables, self.ipvs):
            mode.masquerade = self.masquerade


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
