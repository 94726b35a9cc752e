"""What the model needs to know of the node it runs on, as plain data: the proxier gathers it (the node's name
from --hostname-override, its addresses from the kernel, its primary address from the Node object) and the
model never reads the system itself.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The --nodeport-addresses value that means "the node's primary address" (upstream's, nftables mode's default).
PRIMARY = "primary"


@dataclass(frozen=True, slots=True)
class NodeInputs:
    name: str | None = None
    """This node's name: an endpoint whose nodeName equals it is local (externalTrafficPolicy Local). None: no
    endpoint is local."""
    nodeport_addresses: tuple[str, ...] = ()
    """The IPv4 addresses node ports are served on, as `select_nodeport_addresses` chose them. (): no node port
    frontends."""
    primary_ip: str | None = None
    """The node's primary IPv4 address (Node.primary_ipv4): a loadBalancerSourceRanges entry holding it also
    admits the load-balancer IPs as sources (upstream's allowFromNode: a VIP routed locally loops back with
    itself as the source)."""
    zone: str | None = None
    """The node's `topology.kubernetes.io/zone` label (Node.zone): topology-aware routing prefers endpoints
    hinted for it. None (or no Node object): no topology-aware routing."""


def select_nodeport_addresses(addresses: Iterable[str], setting: Sequence[str], primary: str | None) -> tuple[str, ...]:
    """The IPv4 addresses among `addresses` (the node's own) that node ports are served on, per
    --nodeport-addresses (`setting`), as upstream's NodePortAddresses chooses them, sorted:

    - () (unset): all of them, as upstream's iptables mode;
    - ("primary",): `primary`, i.e. its /32, as upstream turns it into;
    - CIDRs: those in one of the IPv4 CIDRs. As upstream, a family given no CIDR matches all its addresses: IPv6
      CIDRs alone, or "primary" without a primary IPv4 address, select every IPv4 address.

    Raises ValueError naming an entry that is neither a CIDR nor a lone "primary"."""
    if list(setting) == [PRIMARY]:
        setting = [f"{primary}/32"] if primary else []
    networks = []
    for entry in setting:
        try:
            if "/" not in entry:
                raise ValueError(entry)
            network = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ValueError(f"--nodeport-addresses: {entry!r} is not a CIDR (or a lone {PRIMARY!r})") from None
        if network.version == 4:
            networks.append(network)
    chosen = set()
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if ip.version == 4 and (not networks or any(ip in n for n in networks)):
            chosen.add(ip)
    return tuple(str(ip) for ip in sorted(chosen))
