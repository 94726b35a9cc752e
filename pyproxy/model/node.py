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
    """The addresses node ports are served on, of both families (IPv4 first), as `select_nodeport_addresses` chose
    them. (): no node port frontends. A Service gets node ports of a family only if it has a ClusterIP of it.
    127.0.0.1 among them (localhostNodePorts, where the mode serves it): frontends only the node's own processes
    reach (`ServicePortState.node_only`)."""
    primary_ip: str | None = None
    """The node's primary IPv4 address (Node.primary_ipv4): a loadBalancerSourceRanges entry holding it also
    admits the load-balancer IPs as sources (upstream's allowFromNode: a VIP routed locally loops back with
    itself as the source)."""
    zone: str | None = None
    """The node's `topology.kubernetes.io/zone` label (Node.zone): topology-aware routing prefers endpoints
    hinted for it. None (or no Node object): no topology-aware routing."""
    primary_ipv6: str | None = None
    """The node's primary IPv6 address (Node.primary_ipv6): the same for the IPv6 source ranges."""


def select_nodeport_addresses(addresses: Iterable[str], setting: Sequence[str], primary: str | None,
                              primary6: str | None = None) -> tuple[str, ...]:
    """The addresses among `addresses` (the node's own, of both families) that node ports are served on, per
    --nodeport-addresses (`setting`), as upstream's NodePortAddresses chooses them per family, sorted, IPv4 first:

    - () (unset): all of them, as upstream's iptables mode;
    - ("primary",): `primary` and `primary6` (the primary IPv4 and IPv6 addresses), i.e. their /32 and /128, as
      upstream turns it into;
    - CIDRs: those in one of the CIDRs of their family. As upstream, a family given no CIDR matches all its
      addresses: IPv6 CIDRs alone select every IPv4 address, and "primary" without a primary address of a family
      selects every address of that family.

    IPv6 link-local addresses (fe80::/10) are never chosen: one is the same on every link, so a frontend on it
    would not say which link it serves (upstream's iptables mode matches them by `addrtype LOCAL`; its nftables
    mode, whose default is "primary", does not).

    Raises ValueError naming an entry that is neither a CIDR nor a lone "primary"."""
    if list(setting) == [PRIMARY]:
        setting = [*([f"{primary}/32"] if primary else []), *([f"{primary6}/128"] if primary6 else [])]
    networks: dict[int, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {4: [], 6: []}
    for entry in setting:
        try:
            if "/" not in entry:
                raise ValueError(entry)
            network = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ValueError(f"--nodeport-addresses: {entry!r} is not a CIDR (or a lone {PRIMARY!r})") from None
        networks[network.version].append(network)
    chosen: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if ip.is_link_local and ip.version == 6:
            continue
        mine = networks[ip.version]
        if not mine or any(ip in n for n in mine):
            chosen.add(ip)
    return tuple(str(ip) for ip in sorted(chosen, key=lambda ip: (ip.version, ip)))
