"""This node as the model needs it (`NodeInputs`): its name, the addresses NodePorts are served on, its primary
address, its zone; gathered here from the settings, the kernel and the Node object, and handed to the proxier whenever
it changes (a change recomputes every Service).

- The name: --hostname-override, else the host name, lowercased (upstream's rule; `config.node_name`).
- The node's addresses: every IPv4 and IPv6 address of pyproxy's network namespace, read from netlink and
  followed (`netlink.AddressWatcher`), but loopback ones and those on IPVS mode's kube-ipvs0, which hold
  ClusterIPs (upstream's IPVS mode leaves them out too). --nodeport-addresses picks among them
  (`select_nodeport_addresses`). With `localhost` (--iptables-localhost-nodeports, where the mode serves it) the
  IPv4 loopback addresses are candidates too, as upstream's localhostNodePorts: unset or a CIDR holding 127.0.0.1
  picks 127.0.0.1, "primary" does not. IPv6 never: upstream has no localhost NodePorts for ::1.
- The primary address of each family: the Node object's (`Node.primary_ip`) when following the API server and
  it has one; else the first address of that family of the device that family's default route leaves by, which
  is what the node's InternalIP usually is (IPv6: its first global one, link-local ones aside).
- The zone: the Node object's `topology.kubernetes.io/zone` label (`Node.zone`), for topology-aware routing;
  none until a source delivers the Node.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from pyproxy.dataplane import netlink
from pyproxy.dataplane.ipvs.render import DUMMY_DEVICE
from pyproxy.model.node import PRIMARY, NodeInputs, select_nodeport_addresses

log = logging.getLogger(__name__)


class Watcher(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class NodeAddresses:
    """Follows the node's addresses and calls `on_change(inputs)` with new `NodeInputs` when what the model
    gets changes (from the watcher's thread, or the caller's for `start` and `set_from_node`). The kernel is read
    through `list_addresses`, `default_device` and `watcher`, which tests replace."""

    def __init__(
        self,
        name: str,
        setting: Sequence[str],
        on_change: Callable[[NodeInputs], None],
        *,
        list_addresses: Callable[[], list[netlink.Address]] = netlink.list_addresses,
        default_device: Callable[[int], str | None] = netlink.default_route_device,
        watcher: Callable[[Callable[[], None]], Watcher] = lambda on_change: netlink.AddressWatcher(
            on_change, (socket.AF_INET, socket.AF_INET6)),
        localhost: bool = False,
    ) -> None:
        self._setting = tuple(setting)
        self._localhost = localhost
        self._on_change = on_change
        self._list = list_addresses
        self._default_device = default_device
        self._make_watcher = watcher
        self._watcher: Watcher | None = None
        self._lock = threading.Lock()
        self._node_primary: str | None = None
        self._node_primary6: str | None = None
        self._zone: str | None = None
        self.inputs = NodeInputs(name=name)
        """What the model was last given."""
        self._logged: tuple[str, ...] | None = None

    def start(self) -> NodeInputs:
        """Subscribe, read the addresses once (handing them over) and follow them; returns what was read."""
        self._watcher = self._make_watcher(self.refresh)
        self.refresh()
        self._watcher.start()
        return self.inputs

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    def set_from_node(self, primary: str | None, zone: str | None, primary6: str | None = None) -> None:
        """What the Node object says: its primary IPv4 and IPv6 addresses (None: it names none, the default route
        of that family decides) and its zone label (None: none)."""
        with self._lock:
            if (primary, primary6, zone) == (self._node_primary, self._node_primary6, self._zone):
                return
            self._node_primary, self._node_primary6, self._zone = primary, primary6, zone
        self.refresh()

    def _primary(self, given: str | None, family: int, addresses: list[netlink.Address]) -> str | None:
        """The Node's primary address of `family` (socket.AF_*), else the first of that family on its default
        route's device."""
        if given is not None:
            return given
        device = self._default_device(family)
        version = 6 if family == socket.AF_INET6 else 4
        return next((a.ip for a in addresses if a.device == device
                     and ipaddress.ip_address(a.ip).version == version
                     and not ipaddress.ip_address(a.ip).is_link_local), None)

    def refresh(self) -> None:
        """Read the kernel again; hand the model new inputs if they changed."""
        with self._lock:
            listed = self._list()
            addresses = [a for a in listed if not a.loopback and a.device != DUMMY_DEVICE]
            primary = self._primary(self._node_primary, socket.AF_INET, addresses)
            primary6 = self._primary(self._node_primary6, socket.AF_INET6, addresses)
            candidates = [a.ip for a in addresses]
            if self._localhost:
                candidates += [a.ip for a in listed if a.ip.startswith("127.")]
            chosen = select_nodeport_addresses(candidates, self._setting, primary, primary6)
            inputs = NodeInputs(self.inputs.name, chosen, primary, self._zone, primary6)
            if inputs == self.inputs:
                return
            self.inputs = inputs
            if chosen != self._logged:
                self._logged = chosen
                self._log(chosen, [a.ip for a in addresses], primary)
            # Under the lock: two refreshes (the watcher's, the Node's) hand over in the order they read.
            self._on_change(inputs)

    def _log(self, chosen: tuple[str, ...], addresses: list[str], primary: str | None) -> None:
        setting = f"--nodeport-addresses={','.join(self._setting)}" if self._setting else \
            "--nodeport-addresses unset: every node address"
        if chosen:
            log.info("NodePorts use node addresses %s (%s)", ", ".join(chosen), setting)
        elif not addresses:
            log.warning("NodePorts use no node address: the node has no address (loopback aside)")
        elif self._setting == (PRIMARY,) and primary is None:
            log.warning("NodePorts use no node address (%s): the node has no primary IPv4 address (no Node "
                        "address, no default route)", setting)
        else:
            log.warning("NodePorts use no node address (%s): it chooses none of the node's addresses %s", setting,
                        ", ".join(addresses))
