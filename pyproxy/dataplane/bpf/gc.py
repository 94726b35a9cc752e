"""Garbage collection of the connection-tracking maps (PYPROXY_MAP_CT, and PYPROXY_MAP_CT6 by the same rules with
the IPv6 layout, `IPV6`), each in a thread of the BPF dataplane.

The programs treat an expired entry as absent (bpf/include/pyproxy/ct.h) but leave it in the map: it goes when a
new flow overwrites it, when the LRU evicts it, or here. A pass reads the whole map with batched lookups, picks
the garbage, and deletes each of it that is still as it read it (a compare, then the delete):

- a FORWARD or REVERSE entry idle longer than its state's timeout (`conntrack.timeout_ticks`, the programs' own
  constants) plus `MARGIN_SECONDS`, unless the other entry of its flow is not (the programs keep a flow while
  either direction saw a packet within its timeout: a one-way stream refreshes one entry only);
- an AFFINITY entry idle longer than its Service's affinity timeout (the services map's `affinity_ticks`, the
  frontend found by the entry's daddr/dport/proto) plus the margin, or whose frontend is gone or has no affinity;
- a HAIRPIN entry (a socket hook's choice its pod's first packet takes, lb.h) idle longer than the shortest
  timeout plus the margin: its connect() never sent a packet.

Nothing is deleted that the programs would still use, so a restart (the map is pinned) keeps every live flow.

After the deletes, a pass given the backends map recounts each backend's open flows (`pyproxy_backend_info.active`,
which lc, sed and nq read) from what it read: the FORWARD entries of counted flows (CT_F_COUNTED) that are not
closed and were not deleted, and the sockets the socket hooks pointed at it and counted (the socket maps' entries
flagged SOCK_F_COUNTED, of this family: an IPv6 socket's IPv4-mapped backend counts for IPv4). The programs keep the
counts as flows open, close and go, and sockets connect and close, but never hear of an entry the LRU evicted or
this collector deleted: the recount corrects those. It writes only counts that differ, and a
flow opened or closed between the read and the write is lost to that write, so a count may be off by the flows
of that instant until the next pass (the schedulers read a count below 0 as 0).

How often: Cilium's rule, on the share of the map's capacity a pass deleted. The first pass runs `min_interval`
after start (once the first sync is done: it also clears what a stopped pyproxy left to expire); the interval
starts at `initial_interval` (60 s) and after each pass becomes:

- it deleted 25 % of the capacity or more: the interval shrinks to (1 - share) of itself (share capped at 0.9);
- else the map is filling (what the pass left is more than half the capacity, and more than the previous pass
  left): the interval halves;
- else it deleted less than 5 % of the capacity: the interval grows by half;
- the result is held within [`min_interval`, `max_interval`] (10 s, 300 s).

Metrics (`CtGcMetrics`): `pyproxy_bpf_ct_entries` (entries the last pass read), `pyproxy_bpf_ct_gc_deleted_total`,
`pyproxy_bpf_ct_gc_duration_seconds`.
"""

from __future__ import annotations

import array
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pyproxy.dataplane.bpf import abi, clock
from pyproxy.dataplane.bpf.conntrack import timeout_ticks
from pyproxy.dataplane.bpf.maps import BpfMap

log = logging.getLogger(__name__)

MARGIN_SECONDS = 2.0
"""How far past its timeout an entry must be before it is deleted (see `find_garbage` on why)."""
DELETE_CHUNK = 4096
"""Deletes between two looks at a stop request."""

# The CT map's key and value, field by field as in abi.h (tests/unit/test_bpf_gc.py checks them against the
# ctypes structs). Addresses and ports stay bytes: they are only compared and paired, never printed.
CT_KEY = struct.Struct("=4s4s2s2sBBxx")  # saddr, daddr, sport, dport, proto, dir
CT_VALUE = struct.Struct("=4s2sBBIIQ8x")  # nat_addr, nat_port, state, flags, svc_id, epoch, last_seen (seq_end, pad)
_CT_AGE = struct.Struct("=6sB9xQ8x")  # what a pass reads of a CT value: nat (addr and port), state, last_seen
_CT_OPEN = struct.Struct("=6sBB24x")  # what a recount reads of a CT value: nat (addr and port), state, flags
_BACKEND_KEY = struct.Struct("=6s2x")  # pyproxy_backend: addr and port as the CT value's nat holds them
_BACKEND_INFO = struct.Struct("=Ii")  # pyproxy_backend_info: flags, active
SVC_KEY = struct.Struct("=4s2sBx")  # vip, port, proto: as an affinity key's daddr, dport, proto
SVC_VALUE = struct.Struct("=IHHIxxxx")  # svc_id, backend_count, flags, affinity_ticks
_SOCK_KEY = struct.Struct("=8x6s2x")  # pyproxy_sock_key: the backend's addr and port (the cookie left out)
_SOCK_FLAGS = struct.Struct("=6xBx")  # pyproxy_sock_value: flags
_SOCK6_KEY = struct.Struct("=8x16s2s6x")  # pyproxy_sock6_key: the backend's addr, port
_SOCK6_FLAGS = struct.Struct("=18xBx")  # pyproxy_sock6_value: flags
_V4MAPPED = bytes(10) + b"\xff\xff"

Frontend = tuple[bytes, bytes, int]
"""(vip, port, proto) as the maps hold them (network-order bytes)."""


@dataclass(frozen=True)
class CtLayout:
    """How one family's CT, services and backends maps pack what a pass reads: the same fields at other widths."""

    ct_key: struct.Struct
    ct_age: struct.Struct
    ct_open: struct.Struct
    backend_key: struct.Struct
    svc_key: struct.Struct


IPV4 = CtLayout(CT_KEY, _CT_AGE, _CT_OPEN, _BACKEND_KEY, SVC_KEY)
IPV6 = CtLayout(
    struct.Struct("=16s16s2s2sBBxx"),  # pyproxy_ct6_key: saddr, daddr, sport, dport, proto, dir
    struct.Struct("=18sB13xQ"),  # pyproxy_ct6_value: nat (addr and port), state, last_seen
    struct.Struct("=18sBB20x"),  # pyproxy_ct6_value: nat, state, flags
    struct.Struct("=18s2x"),  # pyproxy_backend6: addr and port
    struct.Struct("=16s2sBx"),  # pyproxy_svc6_key: vip, port, proto
)
"""PYPROXY_MAP_CT6 and its services and backends maps (abi.h's IPv6 twins; tests/unit/test_bpf_gc.py checks them)."""


@dataclass(frozen=True)
class CtGcSettings:
    """When the connection-tracking map is garbage-collected (the rule is in pyproxy/dataplane/bpf/gc.py)."""

    initial_interval: float = 60.0
    """Seconds: the interval the rule starts from (the first pass adapts it), before any pass has said how fast
    the map fills."""
    min_interval: float = 10.0
    """The shortest interval, however much a pass deleted; also the delay of the first pass after start."""
    max_interval: float = 300.0
    """The longest interval, however little a pass deleted."""

    def __post_init__(self) -> None:
        if not 0 < self.min_interval <= self.initial_interval <= self.max_interval:
            raise ValueError(f"connection-tracking GC intervals must be 0 < min {self.min_interval} <= initial "
                             f"{self.initial_interval} <= max {self.max_interval}")


def next_interval(interval: float, settings: CtGcSettings, *, capacity: int, seen: int, deleted: int,
                  previous_left: int) -> float:
    """The interval after a pass that read `seen` entries and deleted `deleted` of a map of `capacity`, when the
    pass before it left `previous_left` (the rule in the module's docstring)."""
    share = deleted / capacity if capacity > 0 else 0.0
    left = seen - deleted
    if share >= 0.25:
        interval *= 1.0 - min(share, 0.9)
    elif left * 2 > capacity and left > previous_left:
        interval /= 2
    elif share < 0.05:
        interval *= 1.5
    return min(max(interval, settings.min_interval), settings.max_interval)


def frontends_with_affinity(keys: bytes, values: bytes, layout: CtLayout = IPV4) -> dict[Frontend, int]:
    """The services map (packed, as `BpfMap.items_raw` reads it) -> the affinity timeout, in ticks, of each
    frontend with ClientIP affinity."""
    return {
        key: ticks
        for key, (_, _, flags, ticks) in zip(layout.svc_key.iter_unpack(keys), SVC_VALUE.iter_unpack(values),
                                             strict=True)
        if flags & abi.SVC_F_AFFINITY
    }


def _flow_id(saddr: bytes, daddr: bytes, sport: bytes, dport: bytes, proto: bytes, direction: int,
             nat: bytes) -> bytes:
    """(client, frontend, backend, protocol) of the flow a FORWARD or REVERSE entry belongs to: both entries of a
    flow give the same bytes, as ct.h pairs them (pyproxy_ct_peer)."""
    if direction == abi.CT_FORWARD:
        return saddr + sport + daddr + dport + nat + proto
    return daddr + dport + nat + saddr + sport + proto


def find_garbage(
    keys: bytes,
    values: bytes,
    affinity: Mapping[Frontend, int],
    timeouts: abi.CtTimeoutTicks,
    now: int,
    margin: int,
    layout: CtLayout = IPV4,
) -> array.array:
    """The indexes of the CT entries (packed, as `BpfMap.items_raw` reads them) to delete at tick `now`.

    The read and the deletes are not atomic: a packet may refresh an entry in between, or a new flow take its key
    over (a new connection on its ports, the SNAT allocator reusing an expired pair's port). Only entries idle for
    longer than their timeout plus `margin` (and whose flow's other entry is too) are picked: at the read the
    programs already treated them as absent, so no live flow can be hit; and the pass reads each entry again just
    before deleting it and leaves it when it changed (`CtGarbageCollector.run_pass`), so what a new flow wrote is
    kept but for the microseconds between that read and the delete. `margin` covers the difference between
    `clock.ticks_now()` and the kernel's jiffies (times(2) counts in 10 ms), so an entry the programs would keep
    is never picked.

    An AFFINITY entry is read before the services map (`CtGarbageCollector.run_pass`): the programs make one only
    for a frontend with affinity, so when that frontend has none at the later read, the entry is no use.

    At a quarter million entries this is a few tenths of a second and about 12 MB at most: one scan picks the
    expired entries, and only when there are some, a second scan looks for live entries of the same flows."""
    # The oldest last_seen an entry may have and be kept, by protocol and state (as ct.h's pyproxy_ct_timeout).
    tcp = [now - timeout_ticks(timeouts, socket.IPPROTO_TCP, state) - margin for state in range(256)]
    other = [now - timeout_ticks(timeouts, socket.IPPROTO_UDP, state) - margin for state in range(256)]
    protos = [bytes((p,)) for p in range(256)]
    garbage = array.array("I")
    expired = array.array("I")
    expired_flows: set[bytes] = set()
    entries = zip(layout.ct_key.iter_unpack(keys), layout.ct_age.iter_unpack(values), strict=True)
    for i, ((saddr, daddr, sport, dport, proto, direction), (nat, state, last_seen)) in enumerate(entries):
        if direction == abi.CT_FORWARD or direction == abi.CT_REVERSE:
            if last_seen < (tcp if proto == socket.IPPROTO_TCP else other)[state]:
                expired.append(i)
                expired_flows.add(_flow_id(saddr, daddr, sport, dport, protos[proto], direction, nat))
        elif direction == abi.CT_AFFINITY:
            ticks = affinity.get((daddr, dport, proto))
            if ticks is None or now - last_seen > ticks + margin:
                garbage.append(i)
        elif direction == abi.CT_HAIRPIN and now - last_seen > timeouts.shortest + margin:
            garbage.append(i)
        # else: not a kind this version knows, left alone
    if not expired:
        return garbage
    # Flows with an expired entry whose other entry is live: a one-way stream refreshes one direction only.
    kept: set[bytes] = set()
    entries = zip(layout.ct_key.iter_unpack(keys), layout.ct_age.iter_unpack(values), strict=True)
    for (saddr, daddr, sport, dport, proto, direction), (nat, state, last_seen) in entries:
        if (direction == abi.CT_FORWARD or direction == abi.CT_REVERSE) and (
            last_seen >= (tcp if proto == socket.IPPROTO_TCP else other)[state]
        ):
            flow = _flow_id(saddr, daddr, sport, dport, protos[proto], direction, nat)
            if flow in expired_flows:
                kept.add(flow)
    if not kept:
        garbage.extend(expired)
        return garbage
    for i in expired:
        saddr, daddr, sport, dport, proto, direction = layout.ct_key.unpack_from(keys, i * layout.ct_key.size)
        nat = layout.ct_age.unpack_from(values, i * layout.ct_age.size)[0]
        if _flow_id(saddr, daddr, sport, dport, protos[proto], direction, nat) not in kept:
            garbage.append(i)
    return garbage


def count_open(keys: bytes, values: bytes, deleted: Iterable[int], layout: CtLayout = IPV4) -> dict[bytes, int]:
    """The open counted flows per backend (its address and port, as 6 bytes) in the CT entries read (packed, as
    `BpfMap.items_raw` reads them), but the entries at the indexes `deleted`."""
    gone = set(deleted)
    counts: dict[bytes, int] = {}
    entries = zip(layout.ct_key.iter_unpack(keys), layout.ct_open.iter_unpack(values), strict=True)
    for i, ((_, _, _, _, _, direction), (nat, state, flags)) in enumerate(entries):
        if (direction == abi.CT_FORWARD and flags & (abi.CT_F_COUNTED | abi.CT_F_SNAT) == abi.CT_F_COUNTED
                and state not in abi.CT_ST_OVER and i not in gone):
            counts[nat] = counts.get(nat, 0) + 1
    return counts


def count_snat_ports(keys: bytes, values: bytes, deleted: Iterable[int],
                     layout: CtLayout = IPV4) -> tuple[int, int]:
    """SNAT ports held in the CT entries read but those at the indexes `deleted`: in all, and the most held for one
    node address, backend and protocol (what the SNAT range bounds: snat.h finds no port when it is full). Each
    held port is one SNAT pair, counted by its FORWARD entry, keyed backend -> node address and port."""
    gone = set(deleted)
    per_backend: dict[tuple[bytes, bytes, bytes, int], int] = {}
    entries = zip(layout.ct_key.iter_unpack(keys), layout.ct_open.iter_unpack(values), strict=True)
    for i, ((saddr, daddr, sport, _, proto, direction), (_, _, flags)) in enumerate(entries):
        if direction == abi.CT_FORWARD and flags & abi.CT_F_SNAT and i not in gone:
            where = (daddr, saddr, sport, proto)
            per_backend[where] = per_backend.get(where, 0) + 1
    return sum(per_backend.values()), max(per_backend.values(), default=0)


def count_sockets(socks: tuple[bytes, bytes], socks6: tuple[bytes, bytes], layout: CtLayout = IPV4
                  ) -> dict[bytes, int]:
    """The connections the socket hooks counted per backend of `layout`'s family (its address and port, as
    `count_open` keys them), from the socket maps' entries (PYPROXY_MAP_SOCKS and SOCKS6, packed as `items_raw`
    reads them): those flagged SOCK_F_COUNTED. An IPv6 socket's IPv4-mapped backend is an IPv4 one."""
    counts: dict[bytes, int] = {}
    if layout is IPV4:
        for (be,), (flags,) in zip(_SOCK_KEY.iter_unpack(socks[0]), _SOCK_FLAGS.iter_unpack(socks[1]), strict=True):
            if flags & abi.SOCK_F_COUNTED:
                counts[be] = counts.get(be, 0) + 1
    for (addr, port), (flags,) in zip(_SOCK6_KEY.iter_unpack(socks6[0]), _SOCK6_FLAGS.iter_unpack(socks6[1]),
                                      strict=True):
        if not flags & abi.SOCK_F_COUNTED or (addr[:12] == _V4MAPPED) != (layout is IPV4):
            continue
        be = addr[12:] + port if layout is IPV4 else addr + port
        counts[be] = counts.get(be, 0) + 1
    return counts


def recount(backends: BpfMap, counts: Mapping[bytes, int], layout: CtLayout = IPV4) -> int:
    """Writes each backend's open-flow count where the map's differs; returns how many were written."""
    keys, values = backends.items_raw()
    fix_keys, fix_values = [], []
    size = layout.backend_key.size
    for (nat,), key, (flags, active) in zip(layout.backend_key.iter_unpack(keys),
                                            (keys[i : i + size] for i in range(0, len(keys), size)),
                                            _BACKEND_INFO.iter_unpack(values), strict=True):
        n = counts.get(nat, 0)
        if n != active:
            fix_keys.append(key)
            fix_values.append(_BACKEND_INFO.pack(flags, n))
    if fix_keys:
        backends.update_batch(b"".join(fix_keys), b"".join(fix_values), len(fix_keys))
    return len(fix_keys)


class CtGcMetrics(Collector):
    """The collector's metrics; a prometheus Collector the proxier registers next to its own."""

    def __init__(self, map_name: str = "ct", what: str = "") -> None:
        """`map_name`: "ct" (PYPROXY_MAP_CT), or "ct6" for the IPv6 map's collector (`what`: "IPv6 ")."""
        # Not registered anywhere: `collect` hands them to whichever registry registers this collector.
        self.entries = Gauge(f"pyproxy_bpf_{map_name}_entries",
                             f"{what}Connection-tracking entries read by the last GC pass", registry=None)
        self.deleted = Counter(f"pyproxy_bpf_{map_name}_gc_deleted", f"{what}Connection-tracking entries deleted by GC",
                               registry=None)
        self.duration = Histogram(f"pyproxy_bpf_{map_name}_gc_duration_seconds",
                                  f"Duration of a{'n' if what else ''} {what}connection-tracking GC pass",
                                  buckets=tuple(0.001 * 2**i for i in range(15)), registry=None)
        snat = map_name.replace("ct", "snat")
        self.snat_in_use = Gauge(f"pyproxy_bpf_{snat}_ports_in_use",
                                 f"{what}SNAT ports held by flows after the last GC pass, in all", registry=None)
        self.snat_busiest = Gauge(f"pyproxy_bpf_{snat}_ports_in_use_max",
                                  f"{what}SNAT ports held for the busiest node address, backend and protocol after "
                                  "the last GC pass: new flows to it find no port when it reaches the range's size",
                                  registry=None)

    def collect(self) -> Iterator[Metric]:
        for m in (self.entries, self.deleted, self.duration, self.snat_in_use, self.snat_busiest):
            yield from m.collect()


@dataclass(frozen=True)
class GcPass:
    """What one pass did."""

    seen: int
    """Entries read."""
    deleted: int
    """Entries deleted (keys handed to the kernel; one the LRU evicted meanwhile counts too)."""
    seconds: float
    """From the first read to the last delete: also the longest an entry waited between its read and its delete."""


class CtGarbageCollector:
    """Collects one CT map: `run_pass()` once, or `start()` a thread that runs passes until `stop()`. It owns the
    two maps it is given (fds of its own: closed by `close()`/`stop()`) and shares nothing else with the
    dataplane, so it never waits for a sync nor makes one wait."""

    def __init__(
        self,
        ct: BpfMap,
        services: BpfMap,
        *,
        capacity: int,
        timeouts: abi.CtTimeoutTicks,
        hz: int,
        settings: CtGcSettings | None = None,
        metrics: CtGcMetrics | None = None,
        backends: BpfMap | None = None,
        socks: tuple[BpfMap, BpfMap] | None = None,
        layout: CtLayout = IPV4,
    ) -> None:
        self.ct = ct
        self.layout = layout
        """The family of the maps given (IPV4, IPV6)."""
        self.services = services
        self.backends = backends
        """The backends map, whose open-flow counts a pass recounts (None: no recount)."""
        self.socks = socks
        """PYPROXY_MAP_SOCKS and SOCKS6, whose counted sockets the recount adds (None: no socket is counted)."""
        self.capacity = capacity
        self.timeouts = timeouts
        self.hz = hz
        self.settings = settings or CtGcSettings()
        self.metrics = metrics or CtGcMetrics()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval = self.settings.initial_interval
        """The wait before the next pass (after the first one)."""

    def run_pass(self) -> GcPass:
        """One pass over the map (the module's docstring says what goes)."""
        start = time.monotonic()
        now = clock.ticks_now()  # before the read: an entry refreshed during it looks younger, never older
        keys, values = self.ct.items_raw()
        # After the CT read: see find_garbage.
        affinity = frontends_with_affinity(*self.services.items_raw(), layout=self.layout)
        garbage = find_garbage(keys, values, affinity, self.timeouts, now, int(MARGIN_SECONDS * self.hz),
                               layout=self.layout)
        size, vsize = self.layout.ct_key.size, self.layout.ct_age.size  # ct_age spans the whole value
        gone = array.array("I")
        for n, i in enumerate(garbage):
            if n % DELETE_CHUNK == 0 and self._stop.is_set():
                break
            key = keys[i * size : (i + 1) * size]
            # Read again just before the delete, and delete only what is still as the pass read it: between the
            # pass's read and here, a new flow may have taken the key over (the SNAT allocator reuses an expired
            # pair's port, snat.h), and deleting its entry would lose that flow's translation.
            if self.ct.get_raw(key) == values[i * vsize : (i + 1) * vsize]:
                self.ct.delete_raw(key)
                gone.append(i)
        if self.backends is not None and not self._stop.is_set():
            counts = count_open(keys, values, gone, self.layout)
            if self.socks is not None:
                held = count_sockets(self.socks[0].items_raw(), self.socks[1].items_raw(), self.layout)
                for be, n in held.items():
                    counts[be] = counts.get(be, 0) + n
            recount(self.backends, counts, self.layout)
        in_use, busiest = count_snat_ports(keys, values, gone, self.layout)
        self.metrics.snat_in_use.set(in_use)
        self.metrics.snat_busiest.set(busiest)
        deleted = len(gone)
        done = GcPass(seen=len(keys) // size, deleted=deleted, seconds=time.monotonic() - start)
        self.metrics.entries.set(done.seen)
        self.metrics.deleted.inc(done.deleted)
        self.metrics.duration.observe(done.seconds)
        return done

    # -- the thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="bpf-ct-gc", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (a pass in progress stops between two delete batches) and release the maps."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("connection-tracking GC did not stop within %.0f s; leaving its maps open", timeout)
                return
        self.close()

    def close(self) -> None:
        self.ct.close()
        self.services.close()
        if self.backends is not None:
            self.backends.close()
        for m in self.socks or ():
            m.close()

    def _loop(self) -> None:
        delay, left = self.settings.min_interval, 0
        while not self._stop.wait(delay):
            try:
                done = self.run_pass()
            except OSError as e:
                log.warning("connection-tracking GC pass failed: %s", e)
                delay = self.interval
                continue
            self.interval = next_interval(self.interval, self.settings, capacity=self.capacity, seen=done.seen,
                                          deleted=done.deleted, previous_left=left)
            left = done.seen - done.deleted
            delay = self.interval
            log.debug("connection-tracking GC: %d of %d entries deleted in %.3f s; next pass in %.0f s",
                      done.deleted, done.seen, done.seconds, delay)

