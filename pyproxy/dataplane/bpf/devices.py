"""The device rule: which devices of the node get pyproxy's TC programs (and XDP), as a pure function of the devices
and their addresses, so a frame crosses one pyproxy TC ingress program wherever one serves every frame (README, "The
device rule").

A frame received on a bridge port runs the port's TC ingress and then, as the bridge's own frame, the bridge's; the
same for a macvlan or a VLAN over its lower device and a bond over its slaves. Without `--devices`:

- every Ethernet device but loopback gets TC ingress and egress, except
- a port of a bridge and a slave of a bond: the bridge, the bond gets them. One exception: a veth port of a bridge
  that may hold pods (cni0-like: the bridge's subnet overlaps the cluster CIDR, or no cluster CIDR tells, or the
  bridge has no address) keeps them too: a pod's reply to another pod of the same bridge is bridged port to port
  and never passes the bridge's egress, so only the client pod's veth can reverse-translate it (the bridge's own
  ingress then finds the request already marked, abi.h PYPROXY_TC_TRANSLATED);
- the parent of VLANs that holds no address of its own: the VLANs get them. A tagged frame always reaches its VLAN
  device; the parent sees only the frames of its own (untagged) segment, to which no node address belongs.

The lower device of a macvlan (or macvtap, ipvlan, ipvtap) keeps its programs beside its upper device's: a frame to
the lower device's own MAC address never reaches the macvlan, and the lower device answers ARP for every address of
the node (arp_ignore 0, the default; measured: a client on the link resolved the macvlan's address to the lower
device's MAC in about half the labs), while frames between macvlans of one lower device never pass it; an ipvlan in
L3S mode runs no TC ingress of its own. The mark makes the second pass a no-op.

`--devices` given: exactly those (the mark keeps a second pass a no-op). `--xdp-devices` get XDP whatever the TC
rule says (XDP runs at the driver, under any stacking: a bridge port is where it belongs).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pyproxy.dataplane.netlink import Link

STACKED_KINDS = frozenset({"vlan", "macvlan", "macvtap", "ipvlan", "ipvtap"})
"""Kinds of device stacked over a lower one (IFLA_LINK) whose frames that lower device's TC ingress sees first."""
LOWER_LEFT_TO_UPPER = frozenset({"vlan"})
"""Of those, the kinds whose lower device, without an address of its own, is left to them (see above)."""
AGGREGATES = frozenset({"bond"})
"""Masters whose slaves' frames reach them through the slave's TC ingress first, as a bridge's ports' do."""

NOT_ETHERNET = "not an Ethernet device"
NOT_IN_DEVICES = "not in --devices"
UNSTACKED = frozenset({NOT_ETHERNET, NOT_IN_DEVICES})
"""The reasons a device gets no TC programs that have nothing to do with stacking (every such device has one)."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Verdict:
    """What one device gets, and why (the log's words)."""

    tc: bool
    xdp: bool
    why: str
    """For a device without TC programs, why not ("a port of bridge br0"); for one with them, why where it is not
    plain ("" for an Ethernet device on its own)."""


def _networks(interfaces: Iterable[str]) -> list[Network]:
    return [ipaddress.ip_interface(i).network for i in interfaces]


def _may_hold_pods(bridge: Link, addresses: Mapping[int, Sequence[str]], cluster: Sequence[Network]) -> str:
    """Why a bridge's veth ports may be pods' ("" when they cannot: its subnets are all outside the cluster
    CIDR)."""
    subnets = _networks(addresses.get(bridge.index, ()))
    if not cluster:
        return "no --cluster-cidr tells a pod bridge from another"
    if not subnets:
        return f"{bridge.name} holds no address, its pods' gateway may be elsewhere"
    pods = [str(n) for n in subnets if any(n.version == c.version and n.overlaps(c) for c in cluster)]
    return f"{bridge.name}'s subnet {pods[0]} holds pods (--cluster-cidr)" if pods else ""


def _tc(link: Link, by_index: Mapping[int, Link], uppers: Mapping[int, list[Link]],
        addresses: Mapping[int, Sequence[str]], cluster: Sequence[Network]) -> tuple[bool, str]:
    if not link.ether:
        return False, NOT_ETHERNET
    master = by_index.get(link.master) if link.master else None
    master_kind = master.kind if master is not None else link.slave_kind
    master_name = master.name if master is not None else f"ifindex {link.master}"
    if master_kind in AGGREGATES:
        return False, f"a slave of {master_kind} {master_name}"
    if master_kind == "bridge":
        if link.kind != "veth":
            return False, f"a port of bridge {master_name}"
        why = _may_hold_pods(master, addresses, cluster) if master is not None else "pyproxy does not see it"
        if not why:
            return False, f"a port of bridge {master_name}, whose subnets hold no pod (--cluster-cidr)"
        return True, (f"a veth port of bridge {master_name}, which may hold pods ({why}): a pod's reply to another "
                      f"pod there is bridged port to port, past {master_name}'s egress")
    above = uppers.get(link.index, [])
    if not above:
        return True, ""
    names = ", ".join(f"{up.kind} {up.name}" for up in above)
    if any(up.kind not in LOWER_LEFT_TO_UPPER for up in above):
        return True, f"the lower device of {names}, which keeps its programs too: frames to its own MAC stay on it"
    if addresses.get(link.index):
        return True, f"the lower device of {names}, with an address of its own: its untagged frames stay on it"
    return False, f"the lower device of {names}, with no address of its own"


def plan(links: Sequence[Link], addresses: Mapping[int, Sequence[str]], *, devices: Sequence[str] = (),
         xdp_devices: Sequence[str] = (), cluster_cidrs: Sequence[str] = ()) -> dict[int, Verdict]:
    """Each device's verdict, by ifindex. `addresses`: ifindex -> the addresses the device holds ("ip/prefix"; only
    those of its own: IPv4 ones and global IPv6 ones, not the link-local address every device gets); `devices`,
    `xdp_devices`: --devices and --xdp-devices; `cluster_cidrs`: --cluster-cidr, either family."""
    if devices:
        return {lk.index: Verdict(lk.name in devices, lk.name in xdp_devices,
                                  "" if lk.name in devices else NOT_IN_DEVICES) for lk in links}
    by_index = {lk.index: lk for lk in links}
    uppers: dict[int, list[Link]] = {}
    for lk in links:
        if lk.kind in STACKED_KINDS and lk.link in by_index:
            uppers.setdefault(lk.link, []).append(lk)
    cluster = _networks(cluster_cidrs)
    out = {}
    for lk in links:
        tc, why = _tc(lk, by_index, uppers, addresses, cluster)
        out[lk.index] = Verdict(tc, lk.ether and lk.name in xdp_devices, why)
    return out
