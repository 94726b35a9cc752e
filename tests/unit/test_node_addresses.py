"""The node's addresses reach the model: read through a fake of the kernel, filtered by --nodeport-addresses,
followed when they change (each change recomputes every Service), the primary address from the Node object."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.dataplane.netlink import Address
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import ZONE_LABEL, Node, Protocol, Service, ServicePort
from pyproxy.model.state import FrontendKind
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.node import NodeAddresses
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth


class FakeKernel:
    """The node's addresses and default-route device, and the watcher's callback to say they changed."""

    def __init__(self, *addresses: Address, default: str | None = "eth0", default6: str | None = None) -> None:
        self.addresses = list(addresses)
        self.default = default
        self.default6 = default6
        self.notify: Callable[[], None] | None = None
        self.started = self.stopped = False

    def default_device(self, family: int) -> str | None:
        return self.default if family == socket.AF_INET else self.default6

    def watcher(self, on_change: Callable[[], None]) -> FakeKernel:
        self.notify = on_change
        return self

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def change(self, *addresses: Address) -> None:
        self.addresses = list(addresses)
        assert self.notify is not None, "not subscribed"
        self.notify()


ETH0 = Address("eth0", "10.0.0.5", False)
ETH1 = Address("eth1", "192.168.1.5", False)
LO = Address("lo", "127.0.0.1", True)
IPVS = Address("kube-ipvs0", "10.96.0.10", False)


def tracked(kernel: FakeKernel, setting: tuple[str, ...] = (), name: str = "node-a", localhost: bool = False
            ) -> tuple[NodeAddresses, list[NodeInputs]]:
    seen: list[NodeInputs] = []
    tracker = NodeAddresses(name, setting, seen.append, list_addresses=lambda: list(kernel.addresses),
                            default_device=kernel.default_device, watcher=kernel.watcher, localhost=localhost)
    tracker.start()
    return tracker, seen


@pytest.mark.parametrize(("setting", "chosen"), [
    ((), ("10.0.0.5", "192.168.1.5")),  # unset: every node address but loopback ones and kube-ipvs0's
    (("192.168.0.0/16",), ("192.168.1.5",)),
    (("172.16.0.0/12",), ()),
    (("primary",), ("10.0.0.5",)),  # the default-route device's first address, without a Node
    (("fd00::/8",), ("10.0.0.5", "192.168.1.5")),  # as upstream: a family given no CIDR matches all
])
def test_nodeport_addresses_filter_the_nodes_own(setting: tuple[str, ...], chosen: tuple[str, ...]) -> None:
    kernel = FakeKernel(LO, ETH0, ETH1, IPVS)
    tracker, seen = tracked(kernel, setting)
    assert kernel.started
    assert seen == [NodeInputs("node-a", chosen, "10.0.0.5")]
    tracker.stop()
    assert kernel.stopped


LO6 = Address("lo", "::1", True)


@pytest.mark.parametrize(("setting", "chosen"), [
    ((), ("10.0.0.5", "127.0.0.1", "192.168.1.5")),  # unset: loopback too, as upstream's localhostNodePorts
    (("127.0.0.0/8",), ("127.0.0.1",)),
    (("10.0.0.0/8",), ("10.0.0.5",)),  # a CIDR without 127.0.0.1: not served there
    (("primary",), ("10.0.0.5",)),
])
def test_localhost_nodeports_add_127_0_0_1_where_the_setting_holds_it(setting: tuple[str, ...],
                                                                      chosen: tuple[str, ...]) -> None:
    """--iptables-localhost-nodeports where the mode serves it (bpf's socket hooks): 127.0.0.1 is a node-port
    address when --nodeport-addresses is unset or holds it (upstream's ContainsIPv4Loopback); ::1 never."""
    tracker, seen = tracked(FakeKernel(LO, LO6, ETH0, ETH1, IPVS), setting, localhost=True)
    assert seen == [NodeInputs("node-a", chosen, "10.0.0.5")]
    tracker.stop()


def test_an_address_change_is_handed_over_once_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    kernel = FakeKernel(ETH0)
    with caplog.at_level("INFO", logger="pyproxy.proxier.node"):
        tracker, seen = tracked(kernel)
        kernel.change(ETH0, ETH1)
        kernel.change(ETH0, ETH1)  # a route or an address of no interest: nothing new
        kernel.change()
    assert [i.nodeport_addresses for i in seen] == [("10.0.0.5",), ("10.0.0.5", "192.168.1.5"), ()]
    assert [r.getMessage() for r in caplog.records] == [
        "NodePorts use node addresses 10.0.0.5 (--nodeport-addresses unset: every node address)",
        "NodePorts use node addresses 10.0.0.5, 192.168.1.5 (--nodeport-addresses unset: every node address)",
        "NodePorts use no node address: the node has no address (loopback aside)",
    ]


ETH0_V6 = Address("eth0", "2001:db8::5", False)
ETH0_LINK = Address("eth0", "fe80::1", False)
ETH1_V6 = Address("eth1", "fd00:1::5", False)
LO_V6 = Address("lo", "::1", True)


@pytest.mark.parametrize(("setting", "chosen", "primary6"), [
    # Unset: every address of both families, IPv4 first, but loopback and link-local ones.
    ((), ("10.0.0.5", "2001:db8::5", "fd00:1::5"), "2001:db8::5"),
    # "primary": each family's primary address (IPv6: the first global one of its default route's device).
    (("primary",), ("10.0.0.5", "2001:db8::5"), "2001:db8::5"),
    # A family given no CIDR matches all its addresses, as upstream.
    (("fd00::/8",), ("10.0.0.5", "fd00:1::5"), "2001:db8::5"),
    (("10.0.0.0/8", "2001:db8::/32"), ("10.0.0.5", "2001:db8::5"), "2001:db8::5"),
])
def test_ipv6_node_addresses_serve_node_ports_per_family(setting: tuple[str, ...], chosen: tuple[str, ...],
                                                        primary6: str) -> None:
    kernel = FakeKernel(LO, LO_V6, ETH0, ETH0_LINK, ETH0_V6, ETH1_V6, default6="eth0")
    _, seen = tracked(kernel, setting)
    assert seen == [NodeInputs("node-a", chosen, "10.0.0.5", None, primary6)]


def test_the_node_objects_primary_ipv6_address_wins_over_the_default_route() -> None:
    kernel = FakeKernel(ETH0, ETH0_V6, ETH1_V6, default6="eth0")
    tracker, seen = tracked(kernel, ("primary",))
    tracker.set_from_node(None, None, "fd00:1::5")
    assert seen[-1] == NodeInputs("node-a", ("10.0.0.5", "fd00:1::5"), "10.0.0.5", None, "fd00:1::5")


def test_the_node_objects_primary_address_wins_over_the_default_route() -> None:
    kernel = FakeKernel(ETH0, ETH1)
    tracker, seen = tracked(kernel, ("primary",))
    tracker.set_from_node("192.168.1.5", None)
    assert seen[-1] == NodeInputs("node-a", ("192.168.1.5",), "192.168.1.5")
    tracker.set_from_node(None, None)
    assert seen[-1] == NodeInputs("node-a", ("10.0.0.5",), "10.0.0.5")
    assert len(seen) == 3


def test_addresses_none_of_which_is_chosen_are_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="pyproxy.proxier.node"):
        tracked(FakeKernel(ETH0, ETH1), ("172.16.0.0/12",))
    assert caplog.records[0].getMessage() == ("NodePorts use no node address (--nodeport-addresses=172.16.0.0/12): "
                                              "it chooses none of the node's addresses 10.0.0.5, 192.168.1.5")


def _proxier() -> tuple[Proxier, FakeDataplane]:
    dp = FakeDataplane()
    return Proxier(dp, min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("fake"),
                   health=ProxyHealth(sync_period=30), node_name="node-a"), dp


WEB = Service("default", "web", "NodePort", ("10.96.0.10",), (ServicePort("http", 80, Protocol.TCP, 8080, 30080),))


def node_ports(p: Proxier) -> list[str]:
    return sorted(str(sp.frontend) for sp in p.desired.services["default/web"] if sp.kind is FrontendKind.NODE_PORT)


def test_the_node_addresses_reach_the_desired_state_and_a_change_resyncs_every_service() -> None:
    p, dp = _proxier()
    kernel = FakeKernel(ETH0)
    tracker = NodeAddresses("node-a", ("10.0.0.0/8", "192.168.0.0/16"), p.set_node_inputs,
                            list_addresses=lambda: list(kernel.addresses), default_device=kernel.default_device,
                            watcher=kernel.watcher)
    p.node_addresses = tracker
    tracker.start()
    p.set_service("default/web", WEB)
    p.mark_synced()
    p.sync()
    assert node_ports(p) == ["10.0.0.5:30080/TCP"]
    kernel.change(ETH0, ETH1, Address("eth2", "172.16.0.5", False))  # from the watcher's thread, in pyproxy
    p.sync()
    assert node_ports(p) == ["10.0.0.5:30080/TCP", "192.168.1.5:30080/TCP"]
    assert dp.applies[-1][1] == {"default/web"}, "the node change reaches the dataplane as a change of web"
    assert p.desired.node == NodeInputs("node-a", ("10.0.0.5", "192.168.1.5"), "10.0.0.5")
    # The Node object (API source) names another primary address: the model gets it.
    p.set_node(Node("node-a", addresses=(("InternalIP", "192.168.1.5"),)))
    p.sync()
    assert p.desired.node.primary_ip == "192.168.1.5"
    # ... and a zone label (topology-aware routing): every Service is recomputed with it.
    p.set_node(Node("node-a", labels=((ZONE_LABEL, "z1"),), addresses=(("InternalIP", "192.168.1.5"),)))
    p.sync()
    assert p.desired.node.zone == "z1"
