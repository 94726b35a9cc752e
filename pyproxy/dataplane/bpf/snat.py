"""Keeping the node's own sockets off the source ports BPF SNAT gives out (bpf/include/pyproxy/snat.h).

A backend's reply to an SNATed flow arrives at a node address and an SNAT port, and the ingress program takes
every such packet whose flow it knows. A node socket using the same port toward the same backend would lose its
replies to it; the kernel picks such ports only from its ephemeral range (net.ipv4.ip_local_port_range), so the
SNAT range is kept out of it: by default it lies above it, and where a node's ephemeral range covers it,
pyproxy adds it to net.ipv4.ip_local_reserved_ports, which the kernel then skips (as Cilium does for NodePorts).
A socket that binds one of the ports explicitly is the operator's choice; only its flows to a backend's exact
address and port could meet an SNATed flow.

And the node addresses SNAT gives out, on kernels whose bpf_fib_lookup cannot name one (no BPF_FIB_LOOKUP_SRC:
mainline before 6.7, kernel.py): `DeviceAddresses` keeps the devices map (abi.MAP_DEVADDRS) holding each device's
primary IPv4 address, read from netlink and followed, which the programs read for the device their route lookup
names (snat.h). Where the kernel names the address itself, the map stays empty and nothing follows addresses.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from pyproxy.dataplane import netlink
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.maps import BpfMap

log = logging.getLogger(__name__)

SYSCTL = Path("/proc/sys/net/ipv4")


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """ip_local_reserved_ports' form, "1000,2000-2005" (empty: none), as inclusive ranges."""
    out = []
    for part in text.replace("\n", "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.append((int(lo), int(hi or lo)))
    return out


def format_ranges(ranges: list[tuple[int, int]]) -> str:
    return ",".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in ranges)


def uncovered(ports: tuple[int, int], ephemeral: tuple[int, int], reserved: list[tuple[int, int]]) -> bool:
    """Whether the kernel may give a node socket one of `ports`: some port is in the ephemeral range and not
    reserved."""
    lo, hi = max(ports[0], ephemeral[0]), min(ports[1], ephemeral[1])
    return any(not any(r_lo <= p <= r_hi for r_lo, r_hi in reserved) for p in range(lo, hi + 1))


def reserve(ports: tuple[int, int], sysctl: Path = SYSCTL) -> str | None:
    """Adds `ports` to ip_local_reserved_ports when the ephemeral range reaches them unreserved; returns what it
    did, for the log (None: nothing to do)."""
    ephemeral = tuple(int(x) for x in (sysctl / "ip_local_port_range").read_text().split())
    reserved_file = sysctl / "ip_local_reserved_ports"
    reserved = parse_ranges(reserved_file.read_text())
    if not uncovered(ports, (ephemeral[0], ephemeral[1]), reserved):
        return None
    reserved_file.write_text(format_ranges([*reserved, ports]) + "\n")
    return (f"SNAT ports {ports[0]}-{ports[1]} overlap the ephemeral port range {ephemeral[0]}-{ephemeral[1]}: "
            f"added them to net.ipv4.ip_local_reserved_ports")


def _be32(ip: str) -> ctypes.c_uint32:
    return ctypes.c_uint32(abi.be32(ip))


def write_device_addresses(devaddrs: BpfMap, wanted: dict[int, str]) -> bool:
    """Make the devices map hold `wanted` (ifindex -> address): new and changed entries first, then the removed
    ones, so a device keeps an address throughout. Whether anything changed. The IPv6 devices map
    (abi.MAP_DEVADDRS6, struct pyproxy_in6 values) the same way."""
    six = devaddrs.value_type is abi.In6
    have = {int(k.value): abi.ip6_of(v) if six else abi.ip_of(int(v.value)) for k, v in devaddrs.items()}
    changed = False
    for index, ip in wanted.items():
        if have.get(index) != ip:
            devaddrs[ctypes.c_uint32(index)] = abi.in6(ip) if six else _be32(ip)
            changed = True
    for index in have.keys() - wanted.keys():
        del devaddrs[ctypes.c_uint32(index)]
        changed = True
    return changed


class DeviceAddresses:
    """Follows the node's addresses into the devices map (netlink.AddressWatcher; each event reads them all again:
    they come in bursts). `list_addresses` reads the kernel (tests replace it)."""

    def __init__(self, devaddrs: BpfMap,
                 list_addresses: Callable[[], dict[int, str]] = netlink.primary_ipv4_by_device,
                 devaddrs6: BpfMap | None = None,
                 list_addresses6: Callable[[], dict[int, str]] = netlink.primary_ipv6_by_device) -> None:
        self._map = devaddrs
        self._list = list_addresses
        self._map6 = devaddrs6
        """The IPv6 devices map (abi.MAP_DEVADDRS6), followed beside the IPv4 one; None: not followed."""
        self._list6 = list_addresses6
        self._lock = threading.Lock()
        self._watcher: netlink.AddressWatcher | None = None

    def start(self) -> None:
        """Subscribe, write what is there, then follow."""
        families = (socket.AF_INET,) if self._map6 is None else (socket.AF_INET, socket.AF_INET6)
        self._watcher = netlink.AddressWatcher(self.refresh, families)
        self.refresh()
        self._watcher.start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        with self._lock:
            self._map.close()
            if self._map6 is not None:
                self._map6.close()

    def refresh(self) -> None:
        """Read the addresses, write what changed. Called by the watcher's thread too: a failure is logged, and the
        next event (or a restart) tries again."""
        with self._lock:
            if self._map.fd < 0:
                return
            try:
                wanted = self._list()
                changed = write_device_addresses(self._map, wanted)
                wanted6 = self._list6() if self._map6 is not None else {}
                if self._map6 is not None:
                    changed |= write_device_addresses(self._map6, wanted6)
            except OSError as e:
                log.error("cannot update the SNAT source addresses by device: %s", e)
                return
            if changed:
                shown = [f"ifindex {i}: {ip}" for table in (wanted, wanted6) for i, ip in sorted(table.items())]
                log.info("SNAT source addresses by device (this kernel has no BPF_FIB_LOOKUP_SRC): %s",
                         ", ".join(shown) or "none")

