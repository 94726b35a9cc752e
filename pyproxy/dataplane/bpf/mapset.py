"""The maps of one load, by role (`Maps`), and the codecs that turn render's operations into bpf(2) batches: the
services, slots and backends maps of each family (`_Family`), the frontends' tables, the counters.

The struct formats here pack what abi.py mirrors as ctypes, for batches of many keys at once (faster than building a
ctypes object per key); tests/unit/test_bpf_codec.py checks that each codec's bytes are its abi.py struct's."""

from __future__ import annotations

import array
import ctypes
import errno
import ipaddress
import itertools
import logging
import operator
import socket
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pyproxy.dataplane.bpf import abi, clock
from pyproxy.dataplane.bpf.maps import BpfMap, PerCpuArray, PerCpuHash, create_inner_array, fd_of_map_id
from pyproxy.dataplane.bpf.render import (
    Applied,
    AppliedFrontend,
    Batch,
    FrontendKey,
    Op,
    affinity_members,
    epoch_batch,
    next_epoch,
    ports_batch,
)
from pyproxy.model import objects
from pyproxy.model.state import Backend

log = logging.getLogger(__name__)

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
