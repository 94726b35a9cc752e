"""The device rule (pyproxy/dataplane/bpf/devices.py) as a pure function of a node's devices: which get pyproxy's TC
programs and XDP, and the reason the log gives, for the stacks real nodes have (a bridge over the NIC, a bond, VLANs,
macvlans, a CNI bridge of pods' veths) and `--devices`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pyproxy.dataplane.bpf.devices import Verdict, plan
from pyproxy.dataplane.netlink import Link

_next = iter(range(2, 1000))


def link(name: str, kind: str = "", *, master: Link | None = None, on: Link | None = None, ether: bool = True) -> Link:
    """A device as netlink lists it: `master` the bridge or bond it is enslaved to, `on` the device it is stacked on."""
    return Link(index=next(_next), name=name, kind=kind, ether=ether, up=True, master=master.index if master else 0,
                slave_kind=master.kind if master else "", link=on.index if on else 0)


def verdicts(links: Sequence[Link], addresses: Mapping[str, Sequence[str]] = {}, **kw: object) -> dict[str, Verdict]:
    by_name = {lk.name: lk.index for lk in links}
    result = plan(links, {by_name[n]: a for n, a in addresses.items()}, **kw)  # type: ignore[arg-type]
    return {lk.name: result[lk.index] for lk in links}


def tc(v: Mapping[str, Verdict]) -> set[str]:
    return {name for name, verdict in v.items() if verdict.tc}


def test_plain_devices_each_get_tc_and_a_device_that_is_no_ethernet_gets_nothing() -> None:
    eth0, eth1, veth = link("eth0"), link("eth1"), link("lxc1", "veth")
    tun = link("wg0", "wireguard", ether=False)
    v = verdicts([eth0, eth1, veth, tun], {"eth0": ["192.0.2.10/24"]})
    assert tc(v) == {"eth0", "eth1", "lxc1"}
    assert v["eth0"] == Verdict(True, False, "") and v["eth1"].why == ""  # an address or none: no stack, no matter
    assert v["wg0"] == Verdict(False, False, "not an Ethernet device")


def test_a_bridge_over_the_nic_gets_the_programs_and_its_port_none() -> None:
    br0 = link("br0", "bridge")
    eth0 = link("eth0", master=br0)
    v = verdicts([br0, eth0], {"br0": ["192.0.2.10/24"]})
    assert tc(v) == {"br0"}
    assert v["eth0"].why == "a port of bridge br0"


def test_a_bond_gets_the_programs_and_its_slaves_none() -> None:
    bond0 = link("bond0", "bond")
    eth0, eth1 = link("eth0", master=bond0), link("eth1", master=bond0)
    v = verdicts([eth0, eth1, bond0], {"bond0": ["192.0.2.10/24"]})
    assert tc(v) == {"bond0"}
    assert v["eth0"].why == v["eth1"].why == "a slave of bond bond0"


def test_vlans_over_a_nic_without_an_address_get_them_instead_of_the_nic() -> None:
    eth0 = link("eth0")
    v100, v200 = link("eth0.100", "vlan", on=eth0), link("eth0.200", "vlan", on=eth0)
    v = verdicts([eth0, v100, v200], {"eth0.100": ["10.0.100.5/24"], "eth0.200": ["10.0.200.5/24"]})
    assert tc(v) == {"eth0.100", "eth0.200"}
    assert v["eth0"].why == "the lower device of vlan eth0.100, vlan eth0.200, with no address of its own"


def test_a_vlan_parent_with_an_address_of_its_own_keeps_them_beside_its_vlan() -> None:
    # Untagged traffic to eth0's own address passes only eth0's TC; a tagged frame passes both, which the mark makes
    # safe. An IPv6 address counts as the caller lists it (global ones only: every device has a link-local one).
    eth0 = link("eth0")
    vlan = link("eth0.100", "vlan", on=eth0)
    for own in (["192.0.2.10/24"], ["2001:db8::10/64"]):
        v = verdicts([eth0, vlan], {"eth0": own, "eth0.100": ["10.0.100.5/24"]})
        assert tc(v) == {"eth0", "eth0.100"}
        assert v["eth0"].why == "the lower device of vlan eth0.100, with an address of its own: its untagged frames " \
                                "stay on it"


def test_a_macvlan_lower_device_keeps_them_beside_the_macvlan_even_without_an_address() -> None:
    # A frame to the lower device's own MAC never reaches the macvlan, and the lower device answers ARP for the
    # macvlan's address too (arp_ignore 0): both get the programs, the mark keeps the second pass a no-op. So does a
    # lower device that carries a macvlan beside VLANs.
    eth0 = link("eth0")
    mv, vlan = link("mv0", "macvlan", on=eth0), link("eth0.100", "vlan", on=eth0)
    v = verdicts([eth0, mv], {"mv0": ["192.0.2.10/24"]})
    assert tc(v) == {"eth0", "mv0"}
    assert v["eth0"].why == "the lower device of macvlan mv0, which keeps its programs too: frames to its own MAC " \
                            "stay on it"
    assert tc(verdicts([eth0, mv, vlan], {"mv0": ["192.0.2.10/24"]})) == {"eth0", "mv0", "eth0.100"}
    assert v["mv0"] == Verdict(True, False, "")
    # An ipvlan's lower device alike (in L3S mode the ipvlan runs no TC ingress of its own).
    ipvl = link("ipvl0", "ipvlan", on=eth0)
    assert tc(verdicts([eth0, ipvl], {"ipvl0": ["192.0.2.11/24"]})) == {"eth0", "ipvl0"}


def test_a_macvlan_whose_lower_device_is_in_another_namespace_changes_nothing_here() -> None:
    # netlink gives such a macvlan's lower device as 0 (IFLA_LINK_NETNSID: not an index of this namespace).
    eth0 = link("eth0")
    pod_side = Link(index=next(_next), name="mv-pod", kind="macvlan", ether=True, up=True)
    assert tc(verdicts([eth0, pod_side])) == {"eth0", "mv-pod"}


def test_a_veth_whose_peer_is_here_is_no_stack() -> None:
    a = link("veth-a", "veth")
    b = link("veth-b", "veth", on=a)  # a veth's IFLA_LINK is its peer
    assert tc(verdicts([a, b])) == {"veth-a", "veth-b"}


def test_a_vlan_over_a_bond_under_a_bridge_gets_one_device_of_the_stack() -> None:
    # eth0, eth1 -> bond0 -> bond0.10 -> br10 holding the address: only br10 gets TC.
    br10, bond0 = link("br10", "bridge"), link("bond0", "bond")
    eth0, eth1 = link("eth0", master=bond0), link("eth1", master=bond0)
    vlan = link("bond0.10", "vlan", on=bond0, master=br10)
    v = verdicts([br10, bond0, eth0, eth1, vlan], {"br10": ["192.0.2.10/24"]})
    assert tc(v) == {"br10"}
    assert v["bond0.10"].why == "a port of bridge br10"
    assert v["bond0"].why == "the lower device of vlan bond0.10, with no address of its own"


def test_pods_veths_on_a_cni_bridge_keep_their_programs_beside_the_bridge() -> None:
    # cni0 holds the pods' gateway; a reply from one pod to another there is bridged port to port and never passes
    # cni0's egress, so the client pod's veth must reverse-translate it.
    cni0 = link("cni0", "bridge")
    pods = [link(f"veth{i}", "veth", master=cni0) for i in range(3)]
    for cidrs in ((), ("10.244.0.0/16",), ("10.244.0.0/16", "fd00:10:244::/56")):
        v = verdicts([cni0, *pods], {"cni0": ["10.244.1.1/24"]}, cluster_cidrs=cidrs)
        assert tc(v) == {"cni0", "veth0", "veth1", "veth2"}, cidrs
        assert v["veth0"].why.startswith("a veth port of bridge cni0, which may hold pods ("), v["veth0"]
        assert "bridged port to port" in v["veth0"].why
    with_cidr = verdicts([cni0, *pods], {"cni0": ["10.244.1.1/24"]}, cluster_cidrs=("10.244.0.0/16",))
    assert "cni0's subnet 10.244.1.0/24 holds pods (--cluster-cidr)" in with_cidr["veth1"].why
    without = verdicts([cni0, *pods], {"cni0": ["10.244.1.1/24"]})
    assert "no --cluster-cidr tells a pod bridge from another" in without["veth1"].why


def test_a_bridge_holding_the_pods_subnet_and_the_nic_keeps_the_veths_but_not_the_nic() -> None:
    # A flat network: the node's NIC and its pods on one bridge, pods' addresses from the node's subnet.
    br0 = link("br0", "bridge")
    eth0, pod = link("eth0", master=br0), link("veth1", "veth", master=br0)
    v = verdicts([br0, eth0, pod], {"br0": ["192.168.1.10/24"]}, cluster_cidrs=("192.168.1.128/25",))
    assert tc(v) == {"br0", "veth1"}
    assert v["eth0"].why == "a port of bridge br0"


def test_veth_ports_of_a_bridge_outside_the_cluster_cidr_are_left_to_the_bridge() -> None:
    # A bridge whose subnets are all outside --cluster-cidr holds no pod: its veths (a lab's NIC, containers that
    # are no pods) are ports like any other. Without a cluster CIDR, or with a bridge of no address (its pods'
    # gateway may be elsewhere), they keep their programs: nothing says they are not pods'.
    br0 = link("br0", "bridge")
    nic = link("to-client", "veth", master=br0)
    v = verdicts([br0, nic], {"br0": ["10.200.0.1/24", "fd00:10:200::1/64"]},
                 cluster_cidrs=("10.201.0.0/16", "fd00:10:201::/48"))
    assert tc(v) == {"br0"}
    assert v["to-client"].why == "a port of bridge br0, whose subnets hold no pod (--cluster-cidr)"
    assert tc(verdicts([br0, nic], {"br0": ["10.200.0.1/24"]})) == {"br0", "to-client"}
    bare = verdicts([br0, nic], cluster_cidrs=("10.201.0.0/16",))
    assert tc(bare) == {"br0", "to-client"} and "br0 holds no address" in bare["to-client"].why
    # An IPv6 cluster CIDR says nothing of IPv4 subnets, and the other way round.
    assert tc(verdicts([br0, nic], {"br0": ["10.201.0.1/16"]}, cluster_cidrs=("fd00:10:201::/48",))) == {"br0"}


def test_xdp_goes_where_xdp_devices_say_even_on_a_bridge_port() -> None:
    br0 = link("br0", "bridge")
    eth0 = link("eth0", master=br0)
    v = verdicts([br0, eth0], {"br0": ["192.0.2.10/24"]}, xdp_devices=("eth0",))
    assert v["eth0"] == Verdict(False, True, "a port of bridge br0") and v["br0"] == Verdict(True, False, "")


def test_devices_given_are_exactly_the_devices_with_programs() -> None:
    br0 = link("br0", "bridge")
    eth0, eth1 = link("eth0", master=br0), link("eth1")
    v = verdicts([br0, eth0, eth1], {"br0": ["192.0.2.10/24"]}, devices=("br0", "eth0"), xdp_devices=("eth0",))
    assert v == {"br0": Verdict(True, False, ""), "eth0": Verdict(True, True, ""),
                 "eth1": Verdict(False, False, "not in --devices")}
