"""What the proxier needs from a dataplane backend."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.registry import Collector

from pyproxy.model.state import DesiredState


@dataclass
class MasqueradeSettings:
    cluster_cidr: str | None = None
    """--cluster-cidr's IPv4 CIDR: traffic to an IPv4 ClusterIP from outside this range is masqueraded (upstream);
    None: no such rule, so clients keep their source address."""
    cluster_cidr6: str | None = None
    """--cluster-cidr's IPv6 CIDR (upstream's flag takes one per family, comma-separated): the same for IPv6
    ClusterIPs. None: no such rule for IPv6."""
    masquerade_all: bool = False
    """--masquerade-all: SNAT all traffic sent to a ClusterIP."""
    masquerade_bit: int = 14
    """--iptables-masquerade-bit: the fwmark bit (0-31) that marks a packet for SNAT (upstream: 14)."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each naming its flag."""
        out = []
        if not 0 <= self.masquerade_bit <= 31:
            out.append(f"--iptables-masquerade-bit must be 0..31, not {self.masquerade_bit}")
        if self.cluster_cidr is not None:
            try:
                ipaddress.IPv4Network(self.cluster_cidr, strict=False)
            except ValueError:
                out.append(f"--cluster-cidr must be an IPv4 CIDR such as 10.244.0.0/16 and/or an IPv6 one, "
                           f"comma-separated, not {self.cluster_cidr!r}")
        if self.cluster_cidr6 is not None:
            try:
                ipaddress.IPv6Network(self.cluster_cidr6, strict=False)
            except ValueError:
                out.append(f"--cluster-cidr: {self.cluster_cidr6!r} is not an IPv6 CIDR such as fd00:10:244::/56")
        return out

    def set_cluster_cidrs(self, text: str) -> list[str]:
        """Take --cluster-cidr's value, one CIDR or a comma-separated pair of one per family (upstream's), into
        `cluster_cidr` and `cluster_cidr6`; what is wrong with it, one line each (an entry that is no CIDR is kept
        as the IPv4 one, for `problems` to name)."""
        v4: list[str] = []
        v6: list[str] = []
        for cidr in (c.strip() for c in text.split(",")):
            try:
                (v4 if ipaddress.ip_network(cidr, strict=False).version == 4 else v6).append(cidr)
            except ValueError:
                v4.append(cidr)
        out = []
        if len(v4) > 1 or len(v6) > 1:
            out.append(f"--cluster-cidr {text!r} holds {len(v4)} IPv4 and {len(v6)} IPv6 CIDRs; at most one of each")
        self.cluster_cidr = v4[0] if v4 else None
        self.cluster_cidr6 = v6[0] if v6 else None
        return out

    def cluster_cidr_of(self, family: int) -> str | None:
        """The cluster CIDR of `family` (4 or 6): that family's ClusterIPs masquerade what comes from outside it."""
        return self.cluster_cidr6 if family == 6 else self.cluster_cidr


class DataplaneError(RuntimeError):
    """Applying failed; the message says what, and the dataplane still holds its last good state."""


class ModeUnavailable(RuntimeError):
    """This proxy mode cannot run on this node (kernel feature, tool or capability missing); the message
    says what is missing. `--proxy-mode=auto` moves on to the next mode; an explicit mode fails."""


class Dataplane(Protocol):
    """What the proxier needs of a backend, every one of which has each of these (no attribute is optional)."""

    mode: str
    """The --proxy-mode this backend implements ("bpf", "nftables"…)."""

    # Read-only for the proxier (properties, so a backend may hold a narrower type).
    @property
    def ip_families(self) -> frozenset[int]:
        """The IP families it renders (model.state.IPV4_ONLY or BOTH_FAMILIES), known once `start` returned: the
        proxier gives it the desired state without the other family's frontends (model.state.FamilyFilter), with one
        log line per sync that left some out."""

    @property
    def unserved(self) -> Mapping[str, str]:
        """Services it holds no rules for though they are desired, by key, with why (bpf: a full map); the proxier
        reports each once (a log line and an Event). Empty for the backends that serve everything they are given."""

    @property
    def localhost_nodeports(self) -> bool:
        """Whether it serves NodePorts on 127.0.0.1 to the node's own processes (upstream's localhostNodePorts),
        known once `start` returned: bpf with socket load balancing, whose hooks see a connect() to loopback. The
        proxier then offers the loopback address to --nodeport-addresses when --iptables-localhost-nodeports is
        on."""

    @property
    def collector(self) -> Collector | None:
        """Its own metrics (bpf: the maps and the connection-tracking collector; the netfilter modes: conntrack
        clean-ups), which the proxier registers beside its own; None: none."""

    def start(self) -> None:
        """Take over the kernel state (adopting what a previous run left), ready to apply. Raises
        ModeUnavailable, having changed nothing, when the mode cannot work here."""

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        """Program the kernel: only the Services in `changed`, or everything when it is None. Raises
        DataplaneError, leaving every Service either as before or as desired, never in between."""

    def housekeeping_due(self) -> bool:
        """True while the backend has work of its own that comes due with time rather than with a change
        (IPVS: real servers draining, deleted once their connections are gone): a periodic sync then calls
        `apply` with no changed Service, which does that work."""

    def stop(self) -> None:
        """Release pyproxy's handles; what is programmed stays, so traffic keeps flowing."""
