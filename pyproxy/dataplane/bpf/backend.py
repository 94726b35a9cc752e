"""The BPF dataplane backend: loads the programs, keeps them on the managed devices, applies plans."""

from __future__ import annotations

import array
import ctypes
import errno
import ipaddress
import itertools
import logging
import operator
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import DataplaneError, MasqueradeSettings
from pyproxy.dataplane.bpf import abi, attach, bcc, cgroup, clock, devices, loader, maglev, snat
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.gc import IPV6, CtGarbageCollector, CtGcMetrics, CtGcSettings
from pyproxy.dataplane.bpf.maps import BpfMap, PerCpuArray, PerCpuHash, create_inner_array, fd_of_map_id
from pyproxy.dataplane.bpf.render import (
    Applied,
    AppliedFrontend,
    Batch,
    CapacityError,
    FrontendKey,
    Op,
    Plan,
    Scheduling,
    affinity_members,
    epoch_batch,
    next_epoch,
    ports_batch,
    render,
)
from pyproxy.dataplane.bpf.sockdestroy import SocketDestroyer
from pyproxy.model import objects
from pyproxy.model.state import BOTH_FAMILIES, Backend, DesiredState, ServicePortState

log = logging.getLogger(__name__)

DEFAULT_OBJECT = Path(os.environ.get("PYPROXY_BPF_OBJECT")
                      or Path(__file__).resolve().parents[3] / "bpf" / "build" / "pyproxy.bpf.o")
"""bpf/build/pyproxy.bpf.o; PYPROXY_BPF_OBJECT names another: the container image's (an installed wheel has no
bpf/build beside it), bench/restarts.py's with a changed map layout."""
DESTROYER_OBJECT = "sockdestroy.bpf.o"
"""bpf/sockdestroy.bpf.c's object, looked for beside BpfSettings.object_path (`make bpf` builds both; the image has
both in /usr/lib/pyproxy)."""
LOADERS = ("libbpf", "bcc")
"""--bpf-loader: libbpf loads the prebuilt object (`make bpf`); bcc compiles bpf/ at start with BCC (bcc.py), for
nodes where the prebuilt object does not fit. Never chosen automatically: bcc only when asked."""
XDP_MODES = ("native", "best-effort", "generic")
"""--bpf-xdp-mode's values (BpfSettings.xdp_mode)."""


@dataclass
class BpfSettings:
    object_path: Path = DEFAULT_OBJECT
    """The compiled programs (bpf/build/pyproxy.bpf.o, built by `make bpf`), for the libbpf loader."""
    loader: str = "libbpf"
    """--bpf-loader (LOADERS): what loads the programs and makes the maps. Both make the same maps under the same
    pins, so a restart with the other loader keeps every flow."""
    pin_path: Path = Path("/sys/fs/bpf/pyproxy")
    """Where maps are pinned; a bpffs is mounted there when none is."""
    devices: tuple[str, ...] = ()
    """Devices to attach to; empty means the device rule's (devices.py): every non-loopback Ethernet device,
    including later ones, but one of each stack of devices (a bridge, not its ports; a bond, not its slaves)."""
    xdp_devices: tuple[str, ...] = ()
    """Devices that get the XDP program (as xdp_mode says), whether or not they get TC (a bridge's port does not);
    a start removes pyproxy's XDP program from every other device."""
    xdp_mode: str = "best-effort"
    """--bpf-xdp-mode (XDP_MODES; Cilium's --bpf-lb-acceleration): native, the driver's XDP or none: a device
    whose driver refuses it (the program takes no multi-buffer frames, so e.g. a veth above an MTU of about 3,500)
    is an error naming the device and the kernel's reason, and keeps TC only; best-effort, native where the
    driver takes it, else generic XDP (skb mode: no faster than TC) with a warning saying why; generic, always
    skb mode."""
    max_entries: dict[str, int] = field(default_factory=dict)
    """--bpf-map-sizes: map capacities overriding abi.h's defaults, by map name (abi.RESIZABLE's values; the flag
    takes their short names). A capacity the kernel refuses fails the start, naming the map and the memory it
    needs; one too small for the Services leaves the Services that do not fit out (logged, an Event, the
    pyproxy_bpf_map_* metrics) while the others are served."""
    ct_timeouts: CtTimeouts = field(default_factory=CtTimeouts)
    """Idle timeouts of tracked flows by protocol and state (constants of the programs loaded at start)."""
    ct_gc: CtGcSettings = field(default_factory=CtGcSettings)
    """How often the connection-tracking map's expired entries are deleted (an interval that adapts, gc.py)."""
    socket_lb: bool = True
    """Socket load balancing for the processes below `cgroup_root` (the node's own and, on a real node, its pods'):
    cgroup hooks at connect() and UDP send/receive point their sockets at a backend (bpf/include/pyproxy/sock.h).
    Off: node processes do not reach Services (pods still do, by TC on their veths)."""
    socket_lb_hostns_only: bool = False
    """--bpf-socket-lb-hostns-only (config: bpf.socketLBHostNamespaceOnly; Cilium's socketLB.hostNamespaceOnly):
    the socket hooks translate the node's own network namespace only; every pod's connections keep their Service
    address at the socket (for service meshes and VMs that need the original destination) and are translated by TC
    on the pod's veth. Off: a pod's connection is translated at the socket wherever that gives what TC would."""
    cgroup_root: Path | None = None
    """The cgroup v2 directory the socket hooks go on; they act on every process in it and below. None: the root
    of the node's cgroup v2 hierarchy, mounted at /run/pyproxy/cgroup2 when the node has none."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    """--masquerade-all and --cluster-cidr, as every mode (ProxySettings sets the one shared policy); the
    masquerade bit means nothing here: SNAT is decided per flow in the programs."""
    snat_ports: tuple[int, int] = abi.DEFAULT_SNAT_PORTS
    """--bpf-snat-port-range: the source ports SNAT (masquerade) gives out, first and last. Kept out of the kernel's
    ephemeral range so no node socket shares one (snat.py); its size bounds the SNATed flows open at once from one
    node address to one backend address and port."""
    scheduler: str = "random"
    """--bpf-scheduler: how a new flow's backend is chosen for Services whose `pyproxy.io/scheduler` annotation
    names none (bpf/include/pyproxy/sched.h; README, "Schedulers")."""
    maglev_table_size: int = maglev.DEFAULT_TABLE_SIZE
    """--bpf-maglev-table-size: entries of each maglev frontend's lookup table, a prime of maglev.TABLE_SIZES.
    Larger spreads flows more evenly over many backends (each gets M/N entries, ±1) at 8 bytes per entry and
    frontend; keep it above 100 times the largest backend count."""
    endpoint_counters: bool = False
    """--bpf-endpoint-counters (config: bpf.endpointCounters): the programs also count the packets and bytes they
    send to each endpoint (address:port), for pyproxy_endpoint_packets_total and pyproxy_endpoint_bytes_total.
    Costs a hash lookup per forwarded packet (README, "Metrics"); off, the programs hold no trace of it (a
    constant of the programs loaded at start) and the map stays empty. Counts of endpoints that stay survive a
    restart."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each naming its flag (ProxySettings.validate). The
        timeouts check their signs themselves (CtTimeouts); here, that they fit the programs' tick counters
        at the fastest kernel clock (CONFIG_HZ=1000)."""
        out = [f"--xdp-devices names {dev}, which --devices leaves out" for dev in self.xdp_devices
               if self.devices and dev not in self.devices]
        out += [f"the capacity of map {name} must be 1..{2**32 - 1}, not {n}"
                for name, n in self.max_entries.items() if not 0 < n < 2**32]
        resizable = set(abi.RESIZABLE.values())
        out += [f"--bpf-map-sizes: {name} is not a map whose size can be set (those are "
                f"{', '.join(abi.RESIZABLE)})" for name in self.max_entries if name not in resizable]
        try:
            self.ct_timeouts.ticks(1000)
        except ValueError as e:
            out.append(str(e))
        lo, hi = self.snat_ports
        if not 1024 <= lo <= hi <= 65535:
            out.append(f"--bpf-snat-port-range must be FIRST-LAST within 1024-65535, not {lo}-{hi}")
        if self.xdp_mode not in XDP_MODES:
            out.append(f"--bpf-xdp-mode must be one of {', '.join(XDP_MODES)}, not {self.xdp_mode!r}")
        if self.loader not in LOADERS:
            out.append(f"--bpf-loader must be one of {', '.join(LOADERS)}, not {self.loader!r}")
        if self.scheduler not in abi.SCHED:
            out.append(f"--bpf-scheduler must be one of {', '.join(abi.SCHED)}, not {self.scheduler!r}")
        if self.maglev_table_size not in maglev.TABLE_SIZES:
            out.append(f"--bpf-maglev-table-size must be one of {', '.join(map(str, maglev.TABLE_SIZES))}, "
                       f"not {self.maglev_table_size}")
        return out


# The maps' keys and values as bytes, field by field as in abi.h (tests/unit/test_bpf_codec.py checks them
# against the ctypes structs), a whole batch at a time with map()/array(), whose loops run in C: building one
# ctypes structure per entry cost more than the kernel's work at a quarter million entries. "!" fields are in
# network order, "=" in host order; "x" is padding.
_SVC_KEY = struct.Struct("!4sHBB")  # pyproxy_svc_key: vip, port, proto, scope
# pyproxy_svc_value: svc_id, backend_count, flags, affinity_ticks, sched, table_size
_SVC_VALUE = struct.Struct("=IHHIBxH")
_BACKEND = struct.Struct("!4sHxx")  # pyproxy_backend: addr, port
_SLOT = struct.Struct("=4s2sH")  # pyproxy_slot: addr, port (network order bytes), weight
_BACKEND_INFO = struct.Struct("=Ixxxx")  # pyproxy_backend_info: flags (a new backend's active flows: 0)
_NAME = struct.Struct(f"{abi.NAME_LEN}s")  # pyproxy_svc_name, NUL-padded
_STATS = struct.Struct("=QQ")  # pyproxy_svc_stats: packets, bytes (16 bytes: the per-CPU stride too)
_SLOT_KEY = struct.Struct("=II")  # pyproxy_slot_key: svc_id, slot
_U32_KEY = struct.Struct("=I")  # the names map's key
_SRCRANGE_KEY = struct.Struct("=I4s4s")  # pyproxy_srcrange_key: prefixlen, svc_id (network order), addr
_U32 = "I"  # array typecode of a host-order u32: packs many slot keys' fields or names keys at once
_U64 = "Q"  # array typecode of a host-order u64: the port bitmap's words
assert array.array(_U32).itemsize == 4 and array.array(_U64).itemsize == 8
_ip, _port, _proto, _scope = (operator.itemgetter(i) for i in range(4))


@dataclass(frozen=True)
class _Family:
    """One address family's structs of the maps that hold an address (abi.h: IPv4's and their IPv6 twins)."""

    aton: Callable[[str], bytes]
    ntoa: Callable[[bytes], str]
    svc_key: struct.Struct  # pyproxy_svc_key / pyproxy_svc6_key: vip, port, proto, scope
    backend: struct.Struct  # pyproxy_backend / pyproxy_backend6: addr, port
    slot: struct.Struct  # pyproxy_slot / pyproxy_slot6: addr, port (network order bytes), weight
    srcrange_key: struct.Struct  # pyproxy_srcrange_key / _srcrange6_key: prefixlen, svc_id (network order), addr
    network: Callable[[str], ipaddress.IPv4Network | ipaddress.IPv6Network]
    entry: type[ctypes.Structure]  # a table's entry (abi.Backend / abi.Backend6)
    table_name: str
    affinity_key: struct.Struct  # pyproxy_affinity_key / _affinity6_key: svc_id, addr, port (network order bytes)


_V4 = _Family(socket.inet_aton, socket.inet_ntoa, _SVC_KEY, _BACKEND, _SLOT, _SRCRANGE_KEY, ipaddress.IPv4Network,
              abi.Backend, abi.TABLE_NAME, struct.Struct("=I4s2sxx"))
_V6 = _Family(lambda ip: socket.inet_pton(socket.AF_INET6, ip), lambda b: socket.inet_ntop(socket.AF_INET6, b),
              struct.Struct("!16sHBB"), struct.Struct("!16sHxx"), struct.Struct("=16s2sH"), struct.Struct("=I4s16s"),
              ipaddress.IPv6Network, abi.Backend6, abi.TABLE6_NAME, struct.Struct("=I16s2sxx"))


def _endpoints(items: Sequence[tuple], fam: _Family = _V4) -> bytes:
    """(ip, port) pairs as pyproxy_backend (pyproxy_backend6) structs."""
    return b"".join(map(fam.backend.pack, map(fam.aton, map(_ip, items)), map(_port, items)))


def _slot_values(items: Sequence[tuple], fam: _Family = _V4) -> bytes:
    """(ip, port, weight) triples as pyproxy_slot (pyproxy_slot6) structs."""
    ports = (p.to_bytes(2, "big") for p in map(_port, items))
    return b"".join(map(fam.slot.pack, map(fam.aton, map(_ip, items)), ports, map(_proto, items)))


def _svc_keys(keys: Sequence[tuple], fam: _Family = _V4) -> bytes:
    protos = map(abi.IPPROTO.__getitem__, map(_proto, keys))
    return b"".join(map(fam.svc_key.pack, map(fam.aton, map(_ip, keys)), map(_port, keys), protos,
                        map(_scope, keys)))


def _srcrange_keys(keys: Sequence[tuple], fam: _Family = _V4) -> bytes:
    """(svc_id, "a.b.c.d/n") -> pyproxy_srcrange_key: the frontend's id, then the range, as one LPM prefix."""
    out = []
    for svc_id, cidr in keys:
        net = fam.network(cidr)
        out.append(fam.srcrange_key.pack(32 + net.prefixlen, svc_id.to_bytes(4, "big"), net.network_address.packed))
    return b"".join(out)


def _affinity_keys(keys: Sequence[tuple], fam: _Family = _V4) -> bytes:
    """(svc_id, ip, port) -> pyproxy_affinity_key (pyproxy_affinity6_key)."""
    return b"".join([fam.affinity_key.pack(svc_id, fam.aton(ip), port.to_bytes(2, "big")) for svc_id, ip, port in keys])


def _cidr_order(cidr: str) -> tuple[int, int, int]:
    net = ipaddress.ip_network(cidr)
    return net.version, int(net.network_address), net.prefixlen


def _u32s(items: Iterable[int]) -> bytes:
    return array.array(_U32, items).tobytes()


def _names(values: Sequence[tuple]) -> bytes:
    return b"".join([_NAME.pack(v[0].encode()[: abi.NAME_LEN - 1]) for v in values])


Codec = Callable[[Sequence[tuple]], bytes]
"""Packs the keys (or values) of a batch of ops on one map."""
KEY_CODECS: dict[str, Codec] = {
    abi.MAP_SERVICES: _svc_keys,
    abi.MAP_SLOTS: lambda keys: _u32s(itertools.chain.from_iterable(keys)),  # (svc_id, slot)
    abi.MAP_BACKENDS: _endpoints,
    abi.MAP_NAMES: lambda keys: _u32s(map(_ip, keys)),  # (svc_id,)
    abi.MAP_EPOCH: lambda keys: _u32s(map(_ip, keys)),  # (0,)
    abi.MAP_PORTS: lambda keys: _u32s(map(_ip, keys)),  # (word,)
    abi.MAP_SRCRANGES: _srcrange_keys,
    abi.MAP_AFFINITY: _affinity_keys,
    abi.MAP_SERVICES6: lambda keys: _svc_keys(keys, _V6),
    abi.MAP_SLOTS6: lambda keys: _u32s(itertools.chain.from_iterable(keys)),  # (svc_id, slot)
    abi.MAP_BACKENDS6: lambda keys: _endpoints(keys, _V6),
    abi.MAP_SRCRANGES6: lambda keys: _srcrange_keys(keys, _V6),
    abi.MAP_AFFINITY6: lambda keys: _affinity_keys(keys, _V6),
}
VALUE_CODECS: dict[str, Codec] = {
    abi.MAP_SERVICES: lambda values: b"".join(itertools.starmap(_SVC_VALUE.pack, values)),
    abi.MAP_SLOTS: _slot_values,
    abi.MAP_BACKENDS: lambda values: b"".join(map(_BACKEND_INFO.pack, map(_ip, values))),  # (flags,)
    abi.MAP_NAMES: _names,
    abi.MAP_EPOCH: lambda values: _u32s(map(_ip, values)),  # (epoch,)
    abi.MAP_PORTS: lambda values: array.array(_U64, map(_ip, values)).tobytes(),  # (bits,)
    abi.MAP_SRCRANGES: lambda values: _u32s(map(_ip, values)),  # (0,): the value is unused
    abi.MAP_SLOTS6: lambda values: _slot_values(values, _V6),
    abi.MAP_BACKENDS6: lambda values: b"".join(map(_BACKEND_INFO.pack, map(_ip, values))),  # (flags,)
    abi.MAP_SRCRANGES6: lambda values: _u32s(map(_ip, values)),
    abi.MAP_AFFINITY: lambda values: _u32s(map(_ip, values)),  # (0,): the value is unused
    abi.MAP_AFFINITY6: lambda values: _u32s(map(_ip, values)),
}


class Tables:
    """PYPROXY_MAP_TABLES: service id -> its table, an array map of its own (maps.h). Writes a plan's table ops:
    "new" makes an empty array of a size, the "put"s that follow fill it (or change entries of the array in place)
    and then a new array takes its frontend's place in the outer map; "del" takes a frontend's table out. The
    arrays' fds are kept, so a delta costs no lookup of the outer map."""

    def __init__(self, fd: int, name: str = abi.MAP_TABLES, fam: _Family = _V4) -> None:
        self.fam = fam
        """The family of its frontends (MAP_TABLES6: IPv6, its entries struct pyproxy_backend6)."""
        self.outer: BpfMap = BpfMap(fd, name, ctypes.c_uint32, ctypes.c_uint32)
        self.arrays: dict[int, BpfMap] = {}
        """Service id -> its table in the outer map."""
        self._pending: dict[int, BpfMap] = {}
        """Service id -> a new table being filled, not yet in the outer map."""

    def new(self, keys: Iterable[tuple], values: Iterable[tuple]) -> None:
        for (svc_id,), (size,) in zip(keys, values, strict=True):
            fd = create_inner_array(self.fam.table_name, ctypes.sizeof(self.fam.entry), size)
            self._pending[svc_id] = BpfMap(fd, self.fam.table_name, ctypes.c_uint32, self.fam.entry)

    def put(self, keys: Sequence[tuple], values: Sequence[tuple]) -> None:
        by_table: dict[int, tuple[list[int], list[tuple]]] = {}
        for (svc_id, i), b in zip(keys, values, strict=True):
            entries = by_table.setdefault(svc_id, ([], []))
            entries[0].append(i)
            entries[1].append(b)
        for svc_id, (indexes, backends) in by_table.items():
            table = self._pending.get(svc_id) or self.arrays.get(svc_id)
            if table is None:
                raise OSError(errno.ENOENT, f"BPF map {self.outer.name}: no table for service id {svc_id}")
            table.update_batch(_u32s(indexes), _endpoints(backends, self.fam), len(indexes))
        for svc_id, table in self._pending.items():
            self.outer.put_raw(_U32_KEY.pack(svc_id), _U32_KEY.pack(table.fd))
            old = self.arrays.pop(svc_id, None)
            if old is not None:
                old.close()
            self.arrays[svc_id] = table
        self._pending.clear()

    def delete(self, keys: Iterable[tuple]) -> None:
        for (svc_id,) in keys:
            self.outer.delete_raw(_U32_KEY.pack(svc_id))
            old = self.arrays.pop(svc_id, None)
            if old is not None:
                old.close()

    def read(self) -> dict[int, tuple[Backend, ...]]:
        """Every frontend's table, as a restarted pyproxy finds them (and their fds, kept for later deltas)."""
        keys, values = self.outer.items_raw()
        out = {}
        for (svc_id,), (map_id,) in zip(_U32_KEY.iter_unpack(keys), _U32_KEY.iter_unpack(values), strict=True):
            table = BpfMap(fd_of_map_id(map_id, f"the table of service id {svc_id}"), self.fam.table_name,
                           ctypes.c_uint32, self.fam.entry)
            old = self.arrays.pop(svc_id, None)
            if old is not None:
                old.close()
            self.arrays[svc_id] = table
            indexes, backends = table.items_raw()
            entries = sorted(zip(_U32_KEY.iter_unpack(indexes), self.fam.backend.iter_unpack(backends), strict=True))
            out[svc_id] = tuple(Backend(self.fam.ntoa(addr), port) for _, (addr, port) in entries)
        return out

    def close(self) -> None:
        for table in (*self.arrays.values(), *self._pending.values()):
            table.close()
        self.arrays.clear()
        self._pending.clear()
        self.outer.close()


class Maps:
    """The program's maps as mappings (also used read-only by `pyproxy inspect`). Plans give affinity timeouts
    in seconds; the services map holds them in ticks of the kernel's clock (`hz` per second, clock.py)."""

    def __init__(self, fds: dict[str, int]) -> None:
        self.hz = clock.kernel_hz()
        self._values: dict[str, Codec] = {**VALUE_CODECS, abi.MAP_SERVICES: self._svc_values,
                                          abi.MAP_SERVICES6: self._svc_values}
        self.services: BpfMap = BpfMap(fds[abi.MAP_SERVICES], abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue)
        self.slots: BpfMap = BpfMap(fds[abi.MAP_SLOTS], abi.MAP_SLOTS, abi.SlotKey, abi.Slot)
        self.tables = Tables(fds[abi.MAP_TABLES])
        self.cursors: BpfMap = BpfMap(fds[abi.MAP_CURSORS], abi.MAP_CURSORS, ctypes.c_uint32, abi.Cursor)
        self.backends: BpfMap = BpfMap(fds[abi.MAP_BACKENDS], abi.MAP_BACKENDS, abi.Backend, abi.BackendInfo)
        self.ct: BpfMap = BpfMap(fds[abi.MAP_CT], abi.MAP_CT, abi.CtKey, abi.CtValue)
        self.names: BpfMap = BpfMap(fds[abi.MAP_NAMES], abi.MAP_NAMES, ctypes.c_uint32, abi.SvcName)
        self.epoch: BpfMap = BpfMap(fds[abi.MAP_EPOCH], abi.MAP_EPOCH, ctypes.c_uint32, ctypes.c_uint32)
        self.hpin: BpfMap = BpfMap(fds[abi.MAP_HPIN], abi.MAP_HPIN, ctypes.c_uint32, ctypes.c_uint64)
        self.frags: BpfMap = BpfMap(fds[abi.MAP_FRAGS], abi.MAP_FRAGS, abi.FragKey, abi.FragValue)
        self.socks: BpfMap = BpfMap(fds[abi.MAP_SOCKS], abi.MAP_SOCKS, abi.SockKey, abi.SockValue)
        self.sockflows: BpfMap = BpfMap(fds[abi.MAP_SOCKFLOWS], abi.MAP_SOCKFLOWS, abi.SockKey, abi.SockflowValue)
        self.sockanswers: BpfMap = BpfMap(fds[abi.MAP_SOCKANS], abi.MAP_SOCKANS, abi.SockKey, abi.SockValue)
        self.ports: BpfMap = BpfMap(fds[abi.MAP_PORTS], abi.MAP_PORTS, ctypes.c_uint32, ctypes.c_uint64)
        self.srcranges: BpfMap = BpfMap(fds[abi.MAP_SRCRANGES], abi.MAP_SRCRANGES, abi.SrcRangeKey, ctypes.c_uint32)
        self.devaddrs: BpfMap = BpfMap(fds[abi.MAP_DEVADDRS], abi.MAP_DEVADDRS, ctypes.c_uint32, ctypes.c_uint32)
        self.affinity: BpfMap = BpfMap(fds[abi.MAP_AFFINITY], abi.MAP_AFFINITY, abi.AffinityKey, ctypes.c_uint32)
        self.stats: PerCpuArray = PerCpuArray(fds[abi.MAP_STATS], abi.MAP_STATS, abi.SvcStats)
        self.counters: PerCpuArray = PerCpuArray(fds[abi.MAP_COUNTERS], abi.MAP_COUNTERS, ctypes.c_uint64)
        self.refusals: PerCpuArray = PerCpuArray(fds[abi.MAP_REFUSALS], abi.MAP_REFUSALS, abi.RefusalBucket)
        self.epstats: PerCpuHash = PerCpuHash(fds[abi.MAP_EPSTATS], abi.MAP_EPSTATS, abi.Backend, abi.SvcStats)
        self.epstats6: PerCpuHash = PerCpuHash(fds[abi.MAP_EPSTATS6], abi.MAP_EPSTATS6, abi.Backend6, abi.SvcStats)
        # IPv6 (abi.h): the twins of the maps above that hold an address, and the program arrays of the IPv6
        # programs (filled by the loader, read here only by cleanup and the ABI test).
        self.services6: BpfMap = BpfMap(fds[abi.MAP_SERVICES6], abi.MAP_SERVICES6, abi.Svc6Key, abi.SvcValue)
        self.slots6: BpfMap = BpfMap(fds[abi.MAP_SLOTS6], abi.MAP_SLOTS6, abi.SlotKey, abi.Slot6)
        self.backends6: BpfMap = BpfMap(fds[abi.MAP_BACKENDS6], abi.MAP_BACKENDS6, abi.Backend6, abi.BackendInfo)
        self.ct6: BpfMap = BpfMap(fds[abi.MAP_CT6], abi.MAP_CT6, abi.Ct6Key, abi.Ct6Value)
        self.frags6: BpfMap = BpfMap(fds[abi.MAP_FRAGS6], abi.MAP_FRAGS6, abi.Frag6Key, abi.FragValue)
        self.srcranges6: BpfMap = BpfMap(fds[abi.MAP_SRCRANGES6], abi.MAP_SRCRANGES6, abi.SrcRange6Key,
                                         ctypes.c_uint32)
        self.tables6 = Tables(fds[abi.MAP_TABLES6], abi.MAP_TABLES6, _V6)
        self.socks6: BpfMap = BpfMap(fds[abi.MAP_SOCKS6], abi.MAP_SOCKS6, abi.Sock6Key, abi.Sock6Value)
        self.sockflows6: BpfMap = BpfMap(fds[abi.MAP_SOCKFLOWS6], abi.MAP_SOCKFLOWS6, abi.Sock6Key,
                                         abi.Sockflow6Value)
        self.sockanswers6: BpfMap = BpfMap(fds[abi.MAP_SOCKANS6], abi.MAP_SOCKANS6, abi.Sock6Key, abi.Sock6Value)
        self.devaddrs6: BpfMap = BpfMap(fds[abi.MAP_DEVADDRS6], abi.MAP_DEVADDRS6, ctypes.c_uint32, abi.In6)
        self.affinity6: BpfMap = BpfMap(fds[abi.MAP_AFFINITY6], abi.MAP_AFFINITY6, abi.Affinity6Key, ctypes.c_uint32)
        self.jump6: BpfMap = BpfMap(fds[abi.MAP_JUMP6], abi.MAP_JUMP6, ctypes.c_uint32, ctypes.c_uint32)
        self.xjump6: BpfMap = BpfMap(fds[abi.MAP_XJUMP6], abi.MAP_XJUMP6, ctypes.c_uint32, ctypes.c_uint32)
        self.by_name: dict[str, BpfMap] = {
            m.name: m
            for m in (self.services, self.slots, self.tables.outer, self.backends, self.ct, self.names, self.epoch,
                      self.hpin, self.frags, self.socks, self.sockflows, self.sockanswers, self.ports, self.srcranges,
                      self.cursors, self.devaddrs, self.affinity, self.services6, self.slots6, self.backends6, self.ct6,
                      self.frags6, self.srcranges6, self.tables6.outer, self.socks6, self.sockflows6, self.sockanswers6,
                      self.devaddrs6, self.affinity6, self.jump6, self.xjump6)
        }

    def _svc_values(self, values: Sequence[tuple]) -> bytes:
        """(svc_id, count, flags, affinity seconds, sched, table size) -> pyproxy_svc_value with the affinity in
        ticks."""
        return VALUE_CODECS[abi.MAP_SERVICES]([(i, n, f, sec * self.hz, s, t) for i, n, f, sec, s, t in values])

    def close(self) -> None:
        self.tables.close()
        self.tables6.close()
        for m in self.by_name.values():
            m.close()
        self.stats.close()
        self.counters.close()
        self.refusals.close()
        self.epstats.close()
        self.epstats6.close()

    def run(self, op: Op) -> None:
        """One op, one bpf(2) call: for callers that program a few entries (a big plan: run_batches)."""
        if op.verb == "reset":
            self.stats.reset(op.key[0])
            return
        if op.map in (abi.MAP_TABLES, abi.MAP_TABLES6):
            self._run_tables(op.map, op.verb, [op.key], [op.value] if op.value is not None else None)
            return
        if op.map in (abi.MAP_EPSTATS, abi.MAP_EPSTATS6):
            self._run_epstats(op.map, op.verb, [op.key])
            return
        m = self.by_name[op.map]
        key = KEY_CODECS[op.map]((op.key,))
        if op.verb == "put":
            assert op.value is not None
            m.put_raw(key, self._values[op.map]((op.value,)))
        else:
            m.delete_raw(key)

    def run_batches(self, batches: Iterable[Batch]) -> None:
        """Run batches in order, each with one bpf(2) call: the kernel applies a batch entry by entry, in
        order, so the datapath sees the same sequence as with one call per op."""
        for verb, name, keys, values in batches:
            if verb == "reset":
                self.stats.reset(*(key[0] for key in keys))
                continue
            if name in (abi.MAP_TABLES, abi.MAP_TABLES6):
                self._run_tables(name, verb, keys, values)
                continue
            if name in (abi.MAP_EPSTATS, abi.MAP_EPSTATS6):
                self._run_epstats(name, verb, keys)
                continue
            m = self.by_name[name]
            packed = KEY_CODECS[name](keys)
            if verb == "put":
                assert values is not None
                m.update_batch(packed, self._values[name](values), len(keys))
            else:
                m.delete_batch(packed, len(keys))

    def _run_epstats(self, name: str, verb: str, keys: Sequence[tuple]) -> None:
        """A backend's counters: "put" writes them zeroed (render's only value), "del" removes them."""
        m, fam = (self.epstats6, _V6) if name == abi.MAP_EPSTATS6 else (self.epstats, _V4)
        if verb == "put":
            m.put_zeros(_endpoints(keys, fam), len(keys))
        else:
            m.delete_batch(_endpoints(keys, fam), len(keys))

    def endpoint_stats(self) -> dict[Backend, tuple[int, int]]:
        """Every backend's counted packets and bytes, summed over CPUs. Unpacked with struct, the whole map at once:
        a scrape reads it, and it holds an entry per endpoint."""
        out = {}
        for m, fam in ((self.epstats, _V4), (self.epstats6, _V6)):
            keys, values = m.items_raw()
            counts = _STATS.iter_unpack(values)  # each key's CPUs one after the other (the stride: the struct's size)
            for addr, port in fam.backend.iter_unpack(keys):
                packets = octets = 0
                for n, size in itertools.islice(counts, m.ncpus):
                    packets += n
                    octets += size
                out[Backend(fam.ntoa(addr), port)] = (packets, octets)
        return out

    def sync_endpoint_stats(self, applied: Applied, on: bool) -> None:
        """Make the per-endpoint counters map hold what plans keep it at (render: an entry per backend of
        `applied` when `on`, else none), for when it may not: a new map, counters turned on or off since the last
        run, a plan that stopped halfway. Entries of backends that stay keep their counts."""
        for m, fam, family in ((self.epstats, _V4, objects.IPV4), (self.epstats6, _V6, objects.IPV6)):
            held = set(m.keys_raw())
            wanted = {_endpoints([b], fam) for b in applied.backend_refs if b.family == family} if on else set()
            missing, stale = sorted(wanted - held), sorted(held - wanted)
            if missing:
                m.put_zeros(b"".join(missing), len(missing))
            if stale:
                m.delete_batch(b"".join(stale), len(stale))

    def sync_affinity(self, applied: Applied) -> None:
        """Make the affinity maps hold what plans keep them at (render.affinity_members: the slots of each frontend
        with ClientIP affinity), for when they may not: a new map (an upgrade, a resize), a plan that stopped
        halfway. Entries are added before stale ones go, as a plan orders them."""
        wanted: tuple[set[bytes], set[bytes]] = (set(), set())
        for key, fe in applied.frontends.items():
            six = objects.family_of(key[0]) == objects.IPV6
            wanted[six].update(_affinity_keys([(fe.svc_id, *b)], _V6 if six else _V4) for b in affinity_members(fe))
        for m, keys in zip((self.affinity, self.affinity6), wanted, strict=True):
            raw, size = m.items_raw()[0], ctypes.sizeof(m.key_type)
            held = {raw[i:i + size] for i in range(0, len(raw), size)}
            missing, stale = sorted(keys - held), sorted(held - keys)
            if missing:
                m.update_batch(b"".join(missing), _u32s([0] * len(missing)), len(missing))
            if stale:
                m.delete_batch(b"".join(stale), len(stale))

    def _run_tables(self, name: str, verb: str, keys: Sequence[tuple], values: Sequence[tuple] | None) -> None:
        tables = self.tables6 if name == abi.MAP_TABLES6 else self.tables
        if verb == "new":
            assert values is not None
            tables.new(keys, values)
        elif verb == "put":
            assert values is not None
            tables.put(keys, values)
        else:
            tables.delete(keys)

    def read_applied(self) -> Applied:
        """Rebuild what is applied from the maps (after a restart, or after a failed apply)."""
        # Whole maps in a few batched lookups: one bpf(2) call per key made this take seconds at 10,000 Services,
        # and it runs at every restart and after every failed sync.
        keys, values = self.names.items_raw()
        names = {
            svc_id: name.split(b"\0", 1)[0]
            for (svc_id,), (name,) in zip(_U32_KEY.iter_unpack(keys), _NAME.iter_unpack(values), strict=True)
        }
        frontends: dict[FrontendKey, AppliedFrontend] = {}
        for fam, services, slots_map, tables_map, srcranges in (
            (_V4, self.services, self.slots, self.tables, self.srcranges),
            (_V6, self.services6, self.slots6, self.tables6, self.srcranges6),
        ):
            frontends.update(self._read_frontends(fam, names, services, slots_map, tables_map, srcranges))
        refs: dict[Backend, int] = {}
        for f in frontends.values():
            for b in f.known:
                refs[b] = refs.get(b, 0) + 1
        # Backends no frontend references (e.g. not-ready ones) stay known with no references: the
        # first full sync either re-references them or removes them.
        for fam, backends in ((_V4, self.backends), (_V6, self.backends6)):
            for addr, port in fam.backend.iter_unpack(backends.items_raw()[0]):
                refs.setdefault(Backend(fam.ntoa(addr), port), 0)
        epoch = self.epoch.get(ctypes.c_uint32(0))
        return Applied(frontends=frontends, backend_refs=refs, epoch=int(epoch.value) if epoch is not None else 0)

    def _read_frontends(self, fam: _Family, names: Mapping[int, bytes], services: BpfMap, slots_map: BpfMap,
                        tables_map: Tables, srcranges: BpfMap) -> dict[FrontendKey, AppliedFrontend]:
        """One family's frontends as the maps hold them (read_applied)."""
        keys, values = slots_map.items_raw()
        slots = dict(zip(_SLOT_KEY.iter_unpack(keys), fam.slot.iter_unpack(values), strict=True))
        tables = tables_map.read()
        ranges: dict[int, list[str]] = {}
        keys, _ = srcranges.items_raw()
        for prefixlen, svc_id, addr in fam.srcrange_key.iter_unpack(keys):
            ranges.setdefault(int.from_bytes(svc_id, "big"), []).append(f"{fam.ntoa(addr)}/{prefixlen - 32}")
        frontends: dict[FrontendKey, AppliedFrontend] = {}
        keys, values = services.items_raw()
        for (vip, port, proto, scope), (svc_id, count, flags, ticks, sched, table_size) in zip(
            fam.svc_key.iter_unpack(keys), _SVC_VALUE.iter_unpack(values), strict=True
        ):
            raw_name = names.get(svc_id)
            # The names map is not held by the programs, so a restart under `ip netns exec` may not find it;
            # a placeholder owner is then renamed in place by the first full sync.
            name = raw_name.decode(errors="replace") if raw_name is not None else f"?/svc-{svc_id}"
            held = [slot for slot in (slots.get((svc_id, i)) for i in range(count)) if slot is not None]
            backends = tuple(Backend(fam.ntoa(addr), int.from_bytes(port, "big")) for addr, port, _ in held)
            # Weight 0 is an entry written before weights: 1.
            weights = tuple(w or 1 for _, _, w in held)
            table = tables.get(svc_id, ())
            frontends[(fam.ntoa(vip), port, abi.PROTO_NAME.get(proto, str(proto)), scope)] = AppliedFrontend(
                svc_id=svc_id,
                name=name,
                service=name.split(":", 1)[0],
                backends=backends,
                known=backends,
                affinity_sec=ticks // self.hz if flags & abi.SVC_F_AFFINITY else 0,
                flags=flags & ~abi.SVC_F_AFFINITY,
                source_ranges=tuple(sorted(ranges.get(svc_id, ()), key=_cidr_order)),
                sched=sched,
                weights=weights if any(w != 1 for w in weights) else (),
                # A table of another size than the entry says (a plan stopped halfway) reads as none: the next sync
                # writes it whole.
                table=table if len(table) == table_size else (),
            )
        return frontends

    def bump_epoch(self, applied: Applied) -> None:
        """A new backends epoch, for when the maps may have lost backends without one (a previous run or a
        plan that stopped between its deletions and its bump): every flow checks its backend once more."""
        epoch = next_epoch(applied.epoch)
        self.run_batches([epoch_batch(epoch)])
        applied.epoch = epoch

    def write_ports(self, applied: Applied) -> None:
        """The whole endpoint-port bitmap from `applied`'s backends, for when the map may not match them (a new
        map, one of another version, a plan that stopped halfway)."""
        self.run_batches([ports_batch(applied)])


class BpfCollector(Collector):
    """The BPF dataplane's own metrics: the connection-tracking collector's, how full the maps the control plane
    fills are (`pyproxy_bpf_map_entries{map}` against `pyproxy_bpf_map_capacity{map}`; a map that is full leaves
    Services out, counted by `pyproxy_bpf_services_unserved`), each frontend's packets and bytes from the stats map
    (`service_traffic_families`: one series per frontend; the maps count nothing per endpoint) and the programs'
    event counters (`pyproxy_bpf_datapath_events_total{event}`, abi.COUNTERS), all read at scrape time."""

    def __init__(self, dataplane: BpfDataplane) -> None:
        self.gc = CtGcMetrics()
        self.gc6 = CtGcMetrics("ct6", "IPv6 ")
        self._dataplane = dataplane

    def collect(self) -> Iterator[Metric]:
        yield from self.gc.collect()
        yield from self.gc6.collect()
        entries = GaugeMetricFamily("pyproxy_bpf_map_entries", "Entries of a BPF map as pyproxy last programmed it",
                                    labels=["map"])
        capacity = GaugeMetricFamily("pyproxy_bpf_map_capacity", "Entries a BPF map holds at most (max_entries)",
                                     labels=["map"])
        for name, (n, cap) in sorted(self._dataplane.map_usage().items()):
            entries.add_metric([name], n)
            capacity.add_metric([name], cap)
        yield entries
        yield capacity
        yield GaugeMetricFamily("pyproxy_bpf_services_unserved", "Services not programmed because a BPF map is full",
                                value=len(self._dataplane.unserved))
        yield from service_traffic_families(self._dataplane.traffic())
        yield from endpoint_traffic_families(self._dataplane.endpoint_traffic())
        events = CounterMetricFamily("pyproxy_bpf_datapath_events", "Events of the BPF programs, summed over CPUs "
                                     "(abi.COUNTERS: new_flow, no_backend, ct_full, ...)", labels=["event"])
        for name, n in self._dataplane.datapath_counters().items():
            events.add_metric([name], n)
        yield events


class FrontendTraffic(NamedTuple):
    """What the stats map counted for one frontend (a services map entry) since its service id was given."""

    service: str
    """namespace/name"""
    port: str
    """The Service port's name ("" when unnamed)."""
    frontend: str
    """address:port/PROTO, " (node)" for the node-scope entry of an externalTrafficPolicy Local frontend."""
    packets: int
    bytes: int


def _traffic_families(prefix: str, where: str, packets_help: str,
                      traffic: Iterable[tuple[str, str, str, int, int]]) -> Iterator[Metric]:
    """`prefix`_packets_total and `prefix`_bytes_total{namespace,service,port,`where`} of (namespace/name, port
    name, `where`, packets, bytes) rows."""
    labels = ["namespace", "service", "port", where]
    packets = CounterMetricFamily(f"{prefix}_packets", packets_help + " (replies not counted); a socket hook's "
                                  "connection counts 1", labels=labels)
    octets = CounterMetricFamily(f"{prefix}_bytes", "Bytes of those packets as the device had them (frames "
                                 "with their link-layer header; 0 for a socket hook's connection)", labels=labels)
    for service, port, place, n, size in traffic:
        namespace, _, name = service.partition("/")
        packets.add_metric([namespace, name, port, place], n)
        octets.add_metric([namespace, name, port, place], size)
    yield packets
    yield octets


def service_traffic_families(traffic: Iterable[FrontendTraffic]) -> Iterator[Metric]:
    """pyproxy_service_packets_total and pyproxy_service_bytes_total{namespace,service,port,frontend}: one series
    per frontend (a Service port has one per ClusterIP, NodePort address, external and load-balancer IP)."""
    return _traffic_families("pyproxy_service", "frontend", "Client-to-Service packets the BPF programs sent to a "
                             "frontend's endpoints", traffic)


class EndpointTraffic(NamedTuple):
    """What the per-endpoint counters map counted for one backend address:port since it became an endpoint."""

    service: str
    """namespace/name of the Service port it is labelled with: of those whose endpoint it is, the first in order
    (namespace, name, port name). Its counts are the backend's, whichever Service port's traffic it was."""
    port: str
    """That Service port's name ("" when unnamed)."""
    endpoint: str
    """address:port"""
    packets: int
    bytes: int


def endpoint_traffic_families(traffic: Iterable[EndpointTraffic]) -> Iterator[Metric]:
    """pyproxy_endpoint_packets_total and pyproxy_endpoint_bytes_total{namespace,service,port,endpoint}: one series
    per endpoint address:port that was sent traffic (--bpf-endpoint-counters)."""
    return _traffic_families("pyproxy_endpoint", "endpoint", "Client-to-Service packets the BPF programs sent to "
                             "one endpoint address:port, over every Service port it serves", traffic)


def _port_name(fe: AppliedFrontend) -> str:
    """The Service port's name of a frontend ("" when unnamed)."""
    return fe.name[len(fe.service) + 1:] if fe.name.startswith(fe.service + ":") else ""


def endpoint_owners(frontends: Iterable[AppliedFrontend]) -> dict[Backend, tuple[str, str, str]]:
    """Backend -> the Service port (namespace, name, port name) its series is labelled with: the first, in that
    order, of those that have it as an endpoint (ready or not)."""
    owners: dict[Backend, tuple[str, str, str]] = {}
    for fe in frontends:
        namespace, _, name = fe.service.partition("/")
        owner = (namespace, name, _port_name(fe))
        for b in fe.known:
            cur = owners.get(b)
            if cur is None or owner < cur:
                owners[b] = owner
    return owners


class BpfDataplane:
    mode = "bpf"
    ip_families = BOTH_FAMILIES
    """The IP families it renders: both, IPv6 frontends to the IPv6 maps (render.by_family). A class attribute: the
    bpf tracer (tests/tracers/bpf.py) reads it without building a backend."""

    def __init__(self, settings: BpfSettings) -> None:
        self.settings = settings
        self._obj: loader.LoadedObject | None = None
        self.maps: Maps | None = None
        self.applied = Applied()
        self._capacity: dict[str, int] = {}
        self._watcher: netlink.LinkWatcher | None = None
        self._devaddrs: snat.DeviceAddresses | None = None
        self._gc: CtGarbageCollector | None = None
        self._gc6: CtGarbageCollector | None = None
        self._destroyer: SocketDestroyer | None = None
        """bpf/sockdestroy.bpf.c, once the socket hooks are attached on a kernel that has bpf_sock_destroy (6.5)."""
        self.collector = BpfCollector(self)
        """The dataplane's own metrics, for the proxier's registry (a prometheus Collector)."""
        self.unserved: dict[str, str] = {}
        """Services left out because a map is full -> why (`_apply_what_fits`)."""
        self.localhost_nodeports = False
        """True once the socket hooks are attached: their connect() and sendmsg() hooks serve 127.0.0.1's NodePorts
        (render.py gives those frontends the services map's PYPROXY_SVC_SCOPE_HOST only, which no packet meets)."""
        self._lock = threading.Lock()
        self._owners: tuple[Applied | None, int, dict[Backend, tuple[str, str, str]]] = (None, -1, {})
        """endpoint_owners() of an Applied at a generation: a scrape recomputes it only after a plan was applied."""
        self.attached: dict[str, int] = {}
        """Managed device name -> ifindex: the devices with the TC programs."""
        self._links: dict[int, netlink.Link] = {}
        self._addresses: dict[int, list[str]] = {}
        """The node's devices and their own addresses, as the watcher last told: what the device rule reads."""
        self._verdicts: dict[int, tuple[str, devices.Verdict]] = {}
        """ifindex -> its name and the device rule's verdict, as applied."""

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        s = self.settings
        # Before anything is changed: what BCC lacks here, and ClockError where the tick rate cannot be told.
        if s.loader == "bcc" and (problem := bcc.missing()):
            raise bcc.BccUnavailable(f"--bpf-loader=bcc: {problem}")
        timeouts = s.ct_timeouts.ticks(clock.kernel_hz())
        loader.ensure_bpffs(s.pin_path)
        try:
            reserved = snat.reserve(s.snat_ports)
        except OSError as e:
            log.warning("cannot keep node sockets off the SNAT ports %d-%d: %s", *s.snat_ports, e)
        else:
            if reserved:
                log.info("%s", reserved)
        adopt = self._previous_maps()
        try:
            if s.loader == "bcc":
                self._obj = bcc.load(s.pin_path, s.max_entries, adopt, timeouts, s.snat_ports,
                                     s.masquerade.cluster_cidr, s.endpoint_counters,
                                     cluster_cidr6=s.masquerade.cluster_cidr6,
                                     socket_lb_hostns_only=s.socket_lb_hostns_only)
            else:
                self._obj = loader.load(s.object_path, s.pin_path, s.max_entries, adopt, timeouts, s.snat_ports,
                                        s.masquerade.cluster_cidr, s.endpoint_counters,
                                        cluster_cidr6=s.masquerade.cluster_cidr6,
                                        socket_lb_hostns_only=s.socket_lb_hostns_only)
            log.info("BPF programs loaded by %s", s.loader)
        finally:
            for fd in adopt.values():
                os.close(fd)
        # Maps owns its fds and the object owns its own: duplicate, so each closes only what it has.
        self.maps = Maps({n: os.dup(fd) for n, fd in self._obj.maps.items()})
        self._capacity = {n: loader.map_info(fd).max_entries for n, fd in self._obj.maps.items()}
        self.applied = self.maps.read_applied()
        self.maps.bump_epoch(self.applied)
        self.maps.write_ports(self.applied)
        self.maps.sync_endpoint_stats(self.applied, s.endpoint_counters)
        self.maps.sync_affinity(self.applied)
        if self.applied.frontends:
            log.info("kept %d frontends from the previous run", len(self.applied.frontends))
        if not self._obj.kernel_flags & abi.KERNEL_FIB_SRC:
            # Before any device is attached: SNAT finds its source address from the first packet on.
            self._devaddrs = snat.DeviceAddresses(
                BpfMap(os.dup(self._obj.maps[abi.MAP_DEVADDRS]), abi.MAP_DEVADDRS, ctypes.c_uint32, ctypes.c_uint32),
                devaddrs6=BpfMap(os.dup(self._obj.maps[abi.MAP_DEVADDRS6]), abi.MAP_DEVADDRS6, ctypes.c_uint32,
                                 abi.In6))
            self._devaddrs.start()
        # Subscribe before listing so a device created in between is not missed.
        self._watcher = netlink.LinkWatcher(self._on_link, self._reread)
        self._read_devices()
        self._watcher.start()
        self._attach_socket_hooks()
        # The new programs are attached: the flows the old ones recorded meanwhile are copied too, the old pins go.
        loader.retire_old_layouts(s.pin_path, self._obj.maps)
        # Its own fds: it runs beside syncs and device events and takes none of their locks.
        self._gc = CtGarbageCollector(
            BpfMap(os.dup(self._obj.maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue),
            BpfMap(os.dup(self._obj.maps[abi.MAP_SERVICES]), abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue),
            capacity=self._capacity[abi.MAP_CT], timeouts=timeouts, hz=clock.kernel_hz(), settings=s.ct_gc,
            metrics=self.collector.gc,
            backends=BpfMap(os.dup(self._obj.maps[abi.MAP_BACKENDS]), abi.MAP_BACKENDS, abi.Backend, abi.BackendInfo),
            socks=self._socket_maps(),
        )
        self._gc.start()
        # IPv6 flows by the same rules, in metrics of their own (pyproxy_bpf_ct6_*).
        self._gc6 = CtGarbageCollector(
            BpfMap(os.dup(self._obj.maps[abi.MAP_CT6]), abi.MAP_CT6, abi.Ct6Key, abi.Ct6Value),
            BpfMap(os.dup(self._obj.maps[abi.MAP_SERVICES6]), abi.MAP_SERVICES6, abi.Svc6Key, abi.SvcValue),
            capacity=self._capacity[abi.MAP_CT6], timeouts=timeouts, hz=clock.kernel_hz(), settings=s.ct_gc,
            backends=BpfMap(os.dup(self._obj.maps[abi.MAP_BACKENDS6]), abi.MAP_BACKENDS6, abi.Backend6,
                            abi.BackendInfo),
            socks=self._socket_maps(),
            layout=IPV6,
            metrics=self.collector.gc6,
        )
        self._gc6.start()

    def _socket_maps(self) -> tuple[BpfMap, BpfMap]:
        """PYPROXY_MAP_SOCKS and SOCKS6 on fds of their own, for a collector's recount (the sockets counted)."""
        assert self._obj is not None
        return (BpfMap(os.dup(self._obj.maps[abi.MAP_SOCKS]), abi.MAP_SOCKS, abi.SockKey, abi.SockValue),
                BpfMap(os.dup(self._obj.maps[abi.MAP_SOCKS6]), abi.MAP_SOCKS6, abi.Sock6Key, abi.Sock6Value))

    def _attach_socket_hooks(self) -> None:
        """Make the socket hooks what the settings say (cgroup.py): on the chosen cgroup, or nowhere."""
        assert self._obj is not None
        s = self.settings
        if not s.socket_lb:
            for line in cgroup.detach(s.pin_path):
                log.info("detached %s: socket load balancing is off", line)
            return
        root = s.cgroup_root
        if root is None:
            try:
                root = cgroup.default_root()
            except loader.BpfUnavailable as e:
                log.warning("node processes will not reach Services: %s", e)
                return
        cgroup.attach(self._obj.progs, root, s.pin_path)
        self.localhost_nodeports = True
        path = s.object_path.with_name(DESTROYER_OBJECT)
        try:
            self._destroyer = SocketDestroyer.load(path, self._obj.maps)
        except (loader.BpfUnavailable, OSError) as e:
            log.warning("a node process's connected UDP socket will keep an endpoint that left (moving it needs "
                        "bpf_sock_destroy, kernel 6.5, and %s): %s", path, e)

    def stop(self) -> None:
        if self._destroyer:
            self._destroyer.close()
        if self._gc:
            self._gc.stop()
        if self._gc6:
            self._gc6.stop()
        if self._watcher:
            self._watcher.stop()
        if self._devaddrs:
            self._devaddrs.stop()
        if self.maps:
            self.maps.close()
        if self._obj:
            self._obj.close()

    def _previous_maps(self) -> dict[str, int]:
        """Maps held by a previous run's programs still attached here (see loader's docstring), by their full
        names: the kernel keeps 15 characters, and pyproxy_epoch_v1 was never adopted under its cut name."""
        return attach.maps_in_use()

    # -- devices ---------------------------------------------------------------------------------

    def _on_link(self, link: netlink.Link, present: bool) -> None:
        """A device came, changed (enslaved, released, renamed) or went: the rule is worked out again for all, since
        one device's change can change another's verdict (a port's bridge, a VLAN's parent)."""
        with self._lock:
            if present:
                self._links[link.index] = link
            else:
                self._links.pop(link.index, None)
            self._sync_devices()

    def _read_devices(self) -> None:
        """The devices and their addresses from the kernel, then the rule for all (at start: a failure fails it)."""
        with self._lock:
            self._links = {lk.index: lk for lk in netlink.list_links()}
            self._addresses = netlink.own_addresses()
            self._sync_devices()

    def _reread(self) -> None:
        """_read_devices for the watcher: when an address of a device's own came or went (the rule reads them), and
        when events were lost."""
        try:
            self._read_devices()
        except OSError as e:  # the next event reads them again; the watcher thread must live on
            log.warning("cannot list the node's devices and addresses: %s", e)

    def _sync_devices(self) -> None:
        """Make every device hold what the device rule says, acting only where its verdict changed (or on a device
        seen for the first time, which may hold what an earlier run left)."""
        s = self.settings
        cidrs = [c for c in (s.masquerade.cluster_cidr, s.masquerade.cluster_cidr6) if c]
        verdicts = devices.plan(list(self._links.values()), self._addresses, devices=s.devices,
                                xdp_devices=s.xdp_devices, cluster_cidrs=cidrs)
        for index in self._verdicts.keys() - verdicts.keys():
            name = self._verdicts.pop(index)[0]
            if self.attached.pop(name, None) is not None:
                log.info("device %s removed", name)
        for index, verdict in verdicts.items():
            link = self._links[index]
            before = self._verdicts.get(index)
            if before == (link.name, verdict):
                continue
            if before is not None and before[0] != link.name:
                self.attached.pop(before[0], None)
                before = None  # renamed: said again under its new name
            try:
                self._apply_verdict(link, verdict, before[1] if before else None)
            except OSError as e:
                log.error("cannot attach to device %s: %s", link.name, e)
                continue  # tried again at the next event
            self._verdicts[index] = (link.name, verdict)

    def _apply_verdict(self, link: netlink.Link, v: devices.Verdict, before: devices.Verdict | None) -> None:
        assert self._obj is not None
        progs = self._obj.progs
        why = f": {v.why}" if v.why else ""
        if v.tc and (before is None or not before.tc):
            attach.attach_tc(link.index, attach.INGRESS, progs[abi.PROG_TC_INGRESS])
            attach.attach_tc(link.index, attach.EGRESS, progs[abi.PROG_TC_EGRESS])
            self.attached[link.name] = link.index
            log.info("attached to device %s (ifindex %d)%s", link.name, link.index, why)
        elif not v.tc and (before is None or before.tc):
            self.attached.pop(link.name, None)
            removed = self._detach(link, v.why, attach.TC_HOOKS)
            if not removed and v.why not in devices.UNSTACKED:
                # A device of a stack: said even where nothing was there to go (the other reasons are said only
                # when programs go: every device without programs would repeat them).
                log.info("no tc programs on %s: %s", link.name, v.why)
        elif before is not None and v.why != before.why:
            log.info("device %s: %s", link.name, v.why or "an Ethernet device of its own")
        if v.xdp and (before is None or not before.xdp):
            self._attach_xdp(link, progs[abi.PROG_XDP])
        elif not v.xdp and (before is None or before.xdp):
            self._detach(link, "not in --xdp-devices", attach.XDP_HOOKS)

    def _attach_xdp(self, link: netlink.Link, prog_fd: int) -> None:
        """XDP on `link` as --bpf-xdp-mode says. A refusal is said with the device's MTU and the kernel's reason:
        the usual one is a driver's limit on the frame size XDP takes without multi-buffer support."""
        mode = self.settings.xdp_mode
        if mode != "generic":
            try:
                attach.attach_xdp(link.index, prog_fd, "native")
                log.info("XDP (native) on %s", link.name)
                return
            except OSError as e:
                why = f"{e.strerror} (MTU {link.mtu})"
                if mode == "native":
                    log.error("no XDP on %s: the driver refused native XDP: %s; --bpf-xdp-mode=native, so the "
                              "device keeps TC only (best-effort would fall back to generic XDP)", link.name, why)
                    return
                log.warning("native XDP refused on %s: %s; falling back to generic XDP, no faster than TC "
                            "(--bpf-xdp-mode=native makes this an error)", link.name, why)
        try:
            attach.attach_xdp(link.index, prog_fd, "generic")
            log.info("XDP (generic) on %s", link.name)
        except OSError as e:
            log.error("no XDP on %s: %s; the device keeps TC only", link.name, e.strerror)

    def _detach(self, link: netlink.Link, why: str, hooks: Iterable[str] | None = None) -> list[str]:
        """Make `link` hold none of our programs on `hooks` (default: any), saying what went and why: a start
        leaves exactly the programs its settings ask for, whatever an earlier run with other settings left.
        Returns the hooks a program was removed from."""
        try:
            removed = attach.detach(link.index, hooks)
        except OSError as e:
            log.error("cannot detach pyproxy's programs from device %s (%s): %s", link.name, why, e)
            return []
        if removed:
            log.info("detached %s from %s: %s", ", ".join(removed), link.name, why)
        return removed

    # -- sync ------------------------------------------------------------------------------------

    def housekeeping_due(self) -> bool:
        return False  # nothing here waits for time: the kernel expires flows itself

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        assert self.maps is not None
        keys = set(changed) if changed is not None else set(desired.services) | self.applied.by_service.keys()
        # A Service left out for want of room is tried again at every sync, whatever changed: room may have come.
        keys |= self.unserved.keys()
        wanted = {k: desired.services.get(k, ()) for k in keys}
        try:
            self._apply(self._render(wanted))
        except CapacityError:
            self._apply_what_fits(wanted)
        else:
            self._served(keys)

    def _render(self, wanted: Mapping[str, Iterable[ServicePortState]]) -> Plan:
        return render(self.applied, wanted, self._capacity, self.settings.masquerade,
                      Scheduling(self.settings.scheduler, self.settings.maglev_table_size),
                      self.settings.endpoint_counters)

    def _apply(self, plan: Plan) -> None:
        assert self.maps is not None
        for line in plan.skipped:
            log.warning("not served: %s", line)
        try:
            self.maps.run_batches(plan.batches)
        except OSError as e:
            # Re-read the truth so the next sync plans from what the kernel really holds; the plan may have
            # removed backends without its epoch bump.
            self.applied = self.maps.read_applied()
            self.maps.bump_epoch(self.applied)
            self.maps.write_ports(self.applied)
            self.maps.sync_endpoint_stats(self.applied, self.settings.endpoint_counters)
            self.maps.sync_affinity(self.applied)
            raise DataplaneError(f"programming the BPF maps failed: {e}") from e
        released = plan.epoch != self.applied.epoch
        self.applied.commit(plan)
        if released and self._destroyer:
            self._destroy_stale_sockets()

    def _destroy_stale_sockets(self) -> None:
        """After a plan that removed endpoints: the node's connected UDP sockets pointed at one are destroyed, so
        their owners open new ones, balanced afresh (sockdestroy.py). A failure costs only that move."""
        assert self._destroyer is not None
        try:
            moved = self._destroyer.run()
        except OSError as e:
            log.warning("cannot move connected UDP sockets off endpoints that left: %s", e)
            return
        if moved:
            log.info("destroyed %d connected UDP socket(s) of the node pointed at endpoints that left", moved)

    def _apply_what_fits(self, wanted: Mapping[str, Iterable[ServicePortState]]) -> None:
        """The maps cannot hold every Service of `wanted`: apply them one by one, those that free room first
        (removed ones, then those already served, in name order, then new ones), and leave each that does not fit
        as it was (a Service already served keeps its last state: its traffic never stops). Each left out is
        logged once, until it fits (`unserved`)."""
        served = self.applied.by_service
        order = sorted(wanted, key=lambda k: (bool(tuple(wanted[k])), k not in served, k))
        for key in order:
            try:
                plan = self._render({key: wanted[key]})
            except CapacityError as e:
                if key not in self.unserved:
                    log.error("Service %s not programmed: %s", key, e)
                self.unserved[key] = str(e)
                continue
            self._apply(plan)
            self._served([key])

    def _served(self, keys: Iterable[str]) -> None:
        for key in keys:
            if self.unserved.pop(key, None) is not None:
                log.info("Service %s programmed: the BPF maps have room for it again", key)

    def traffic(self) -> list[FrontendTraffic]:
        """Per frontend as last applied, the stats map's packets and bytes summed over CPUs ([] when not started)."""
        maps, frontends = self.maps, list(self.applied.frontends.items())
        if maps is None:
            return []
        out = []
        try:
            for (ip, port, proto, scope), fe in frontends:
                per_cpu = maps.stats.get(fe.svc_id)
                port_name = _port_name(fe)
                where = f"{ip}:{port}/{proto}" + (" (node)" if scope == abi.SVC_SCOPE_NODE else "")
                out.append(FrontendTraffic(fe.service, port_name, where, sum(v.packets for v in per_cpu),
                                           sum(v.bytes for v in per_cpu)))
        except OSError as e:  # stopped (maps closed) while scraped
            log.debug("reading the stats map: %s", e)
            return []
        return sorted(out)

    def endpoint_traffic(self) -> list[EndpointTraffic]:
        """Per endpoint that was sent a packet, its counts summed over CPUs, labelled with a Service port it serves
        as last applied ([] when not started or the counters are off)."""
        maps, applied = self.maps, self.applied
        if maps is None or not self.settings.endpoint_counters:
            return []
        of, generation, owners = self._owners
        if of is not applied or generation != applied.generation:
            generation = applied.generation  # before the frontends: a plan committed meanwhile recomputes next time
            owners = endpoint_owners(list(applied.frontends.values()))
            self._owners = (applied, generation, owners)
        try:
            counts = maps.endpoint_stats()
        except OSError as e:  # stopped (maps closed) while scraped
            log.debug("reading the endpoint counters map: %s", e)
            return []
        out = []
        for b, (packets, octets) in counts.items():
            owner = owners.get(b)
            if packets and owner is not None:
                namespace, name, port = owner
                out.append(EndpointTraffic(f"{namespace}/{name}", port, f"{b.ip}:{b.port}", packets, octets))
        return sorted(out)

    def datapath_counters(self) -> dict[str, int]:
        """abi.COUNTERS name -> the programs' count, summed over CPUs ({} when not started)."""
        maps = self.maps
        if maps is None:
            return {}
        try:
            return {n: sum(v.value for v in maps.counters.get(i)) for i, n in enumerate(abi.COUNTERS)}
        except OSError as e:
            log.debug("reading the counters map: %s", e)
            return {}

    def map_usage(self) -> dict[str, tuple[int, int]]:
        """Map name -> (entries, capacity) of the maps the control plane fills, as last applied."""
        a = self.applied
        counters = self.settings.endpoint_counters
        backends = len(a.backend_refs) - a.backends6
        held = {abi.MAP_SERVICES: len(a.frontends) - a.frontends6, abi.MAP_SLOTS: a.slots - a.slots6,
                abi.MAP_BACKENDS: backends, abi.MAP_STATS: a.max_id() + 1,
                abi.MAP_EPSTATS: backends if counters else 0,
                abi.MAP_SERVICES6: a.frontends6, abi.MAP_SLOTS6: a.slots6, abi.MAP_BACKENDS6: a.backends6,
                abi.MAP_EPSTATS6: a.backends6 if counters else 0,
                abi.MAP_AFFINITY: a.affinity - a.affinity6, abi.MAP_AFFINITY6: a.affinity6}
        return {name: (n, self._capacity[name]) for name, n in held.items() if name in self._capacity}


def cleanup(pin_path: Path) -> list[str]:
    """Remove every program, pin and qdisc pyproxy's BPF mode made in this namespace; returns what went."""
    done = [f"programs on {lk.name} ({', '.join(hooks)})" for lk in netlink.list_links()
            if (hooks := attach.detach(lk.index))]
    if pin_path.exists():
        done += cgroup.detach(pin_path)
        for pin in sorted(pin_path.iterdir()):
            if pin.name.startswith(abi.MAP_PREFIX):
                pin.unlink()
                done.append(f"pin {pin}")
        if loader.is_mountpoint(pin_path):
            loader.unmount(pin_path)
            done.append(f"bpffs at {pin_path}")
        if not any(pin_path.iterdir()):
            pin_path.rmdir()
    return done
