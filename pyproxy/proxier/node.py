"""This node as the model needs it (`NodeInputs`): its name, the addresses NodePorts are served on, its primary
address, its zone; gathered here from the settings, the kernel and the Node object, and handed to the proxier whenever
it changes (a change recomputes every Service).

- The name: --hostname-override, else the host name, lowercased (upstream's rule; `config.node_name`).
- The node's addresses: every IPv4 address of pyproxy's network namespace, read from netlink and followed
  (`netlink.AddressWatcher`), but loopback ones (upstream's iptables mode also serves NodePorts on 127.0.0.1
  under localhostNodePorts, which pyproxy does not) and those on IPVS mode's kube-ipvs0, which hold ClusterIPs
  (upstream's IPVS mode leaves them out too). --nodeport-addresses picks among them
  (`select_nodeport_addresses`).
- The primary address: the Node object's (`Node.primary_ipv4`) when following the API server and it has one;
  else the first IPv4 address of the device the default route leaves by, which is what the node's InternalIP
  usually is.
- The zone: the Node object's `topology.kubernetes.io/zone` label (`Node.zone`), for topology-aware routing;
  none until a source delivers the Node.
"""

from __future__ import annotations

import logging
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
        list_addresses: Callable[[], list[netlink.Address]] = netlink.list_ipv4_addresses,
        default_device: Callable[[], str | None] = netlink.default_route_device,
        watcher: Callable[[Callable[[], None]], Watcher] = netlink.AddressWatcher,
    ) -> None:
        self._setting = tuple(setting)
        self._on_change = on_change
        self._list = list_addresses
        self._default_device = default_device
        self._make_watcher = watcher
        self._watcher: Watcher | None = None
        self._lock = threading.Lock()
        self._node_primary: str | None = None
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

    def set_from_node(self, primary: str | None, zone: str | None) -> None:
        """What the Node object says: its primary IPv4 address (None: it names none, the default route decides)
        and its zone label (None: none)."""
        with self._lock:
            if (primary, zone) == (self._node_primary, self._zone):
                return
            self._node_primary, self._zone = primary, zone
        self.refresh()

    def refresh(self) -> None:
        """Read the kernel again; hand the model new inputs if they changed."""
        with self._lock:
            addresses = [a for a in self._list() if not a.loopback and a.device != DUMMY_DEVICE]
            primary = self._node_primary
            if primary is None:
                device = self._default_device()
                primary = next((a.ip for a in addresses if a.device == device), None)
            chosen = select_nodeport_addresses((a.ip for a in addresses), self._setting, primary)
            inputs = NodeInputs(self.inputs.name, chosen, primary, self._zone)
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
            log.warning("NodePorts use no node address: the node has no IPv4 address (loopback aside)")
        elif self._setting == (PRIMARY,) and primary is None:
            log.warning("NodePorts use no node address (%s): the node has no primary IPv4 address (no Node "
                        "address, no default route)", setting)
        else:
            log.warning("NodePorts use no node address (%s): it chooses none of the node's addresses %s", setting,
                        ", ".join(addresses))
