"""Garbage collection of the connection-tracking map on a loaded copy of the programs' maps: a pass deletes what
has expired and nothing the programs still use, whether the programs or the test wrote the entries; the thread
runs passes and stops promptly."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Load
from harness import CAPACITY, CLIENT, ROOT, TC_INGRESS, VIP, Dataplane, dnat, port_state
from packets import TCP, Flow
from prometheus_client import CollectorRegistry

from pyproxy.dataplane.bpf import abi, clock, gc
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.gc import CtGarbageCollector, CtGcMetrics, CtGcSettings
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

pytestmark = ROOT

FLOWS = 65536
EMULATED = "PYPROXY_TEST_EMULATED"
"""Set where the tests run under CPU emulation (the qemu guest: tests/e2e/conftest.py's guest_pytest)."""
PLAIN_VIP = "10.96.0.11"  # a Service without affinity
BE = Backend("10.0.1.1", 8080)


@pytest.fixture
def dp(load: Load) -> Iterator[Dataplane]:
    """A fresh, unpinned load with room for many flows; VIP has ClientIP affinity, PLAIN_VIP has none."""
    dataplane = Dataplane(load(None, max_entries={**CAPACITY, abi.MAP_CT: FLOWS}))
    dataplane.apply(port_state(TCP, (BE,), (), affinity=600))
    plain = ServicePortState("default/plain", "http", Frontend(PLAIN_VIP, 80, Protocol.TCP), (BE,), (BE,))
    dataplane.apply(plain, service="default/plain")
    yield dataplane
    dataplane.close()


def collector(dp: Dataplane, settings: CtGcSettings | None = None) -> CtGarbageCollector:
    """A collector on fds of its own, with the timeouts the object was loaded with (the loader's defaults)."""
    hz = clock.kernel_hz()
    return CtGarbageCollector(
        BpfMap(os.dup(dp.obj.maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue),
        BpfMap(os.dup(dp.obj.maps[abi.MAP_SERVICES]), abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue),
        capacity=dp.capacity[abi.MAP_CT], timeouts=CtTimeouts().ticks(hz), hz=hz, settings=settings,
        metrics=CtGcMetrics(),
    )


def client(i: int) -> bytes:
    return socket.inet_aton(f"172.{16 + (i >> 16)}.{i >> 8 & 255}.{i & 255}")


def fill(dp: Dataplane, flows: list[tuple[int, int, int, int | None, int | None]]) -> set[bytes]:
    """CT entries as the programs write them, for flows (client number, protocol, state, forward and reverse last
    seen; None: no such entry) from client port 40000 to VIP:80 on BE; their packed keys."""
    keys, values = [], []
    fe, be = (socket.inet_aton(VIP), struct.pack("!H", 80)), (socket.inet_aton(BE.ip), struct.pack("!H", BE.port))
    sport = struct.pack("!H", 40000)
    for i, proto, state, fwd_seen, rev_seen in flows:
        if fwd_seen is not None:
            keys.append(gc.CT_KEY.pack(client(i), fe[0], sport, fe[1], proto, abi.CT_FORWARD))
            values.append(gc.CT_VALUE.pack(*be, state, 0, 0, 1, fwd_seen))
        if rev_seen is not None:
            keys.append(gc.CT_KEY.pack(be[0], client(i), be[1], sport, proto, abi.CT_REVERSE))
            values.append(gc.CT_VALUE.pack(*fe, state, 0, 0, 1, rev_seen))
    dp.maps.ct.update_batch(b"".join(keys), b"".join(values), len(keys))
    return set(keys)


def affinity_entry(dp: Dataplane, i: int, vip: str, seen: int) -> bytes:
    key = gc.CT_KEY.pack(client(i), socket.inet_aton(vip), b"\0\0", struct.pack("!H", 80), TCP, abi.CT_AFFINITY)
    value = gc.CT_VALUE.pack(socket.inet_aton(BE.ip), struct.pack("!H", BE.port), 0, 0, 0, 0, seen)
    dp.maps.ct.put_raw(key, value)
    return key


def ct_keys(dp: Dataplane) -> set[bytes]:
    keys, _ = dp.maps.ct.items_raw()
    return {keys[i : i + gc.CT_KEY.size] for i in range(0, len(keys), gc.CT_KEY.size)}


def registry_of(c: CtGarbageCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(c.metrics)
    return registry


def test_a_pass_deletes_expired_flows_and_stale_affinity_and_keeps_every_live_flow(dp: Dataplane) -> None:
    hz, now = clock.kernel_hz(), clock.ticks_now()
    t = CtTimeouts().ticks(hz)
    day_ago, minute_ago = now - t.tcp_established - 60 * hz, now - 60 * hz
    EST, NEW, CLOSED = abi.CT_ST_ESTABLISHED, abi.CT_ST_NEW, abi.CT_ST_CLOSED
    expired = fill(dp, [(i, TCP, EST, day_ago, day_ago) for i in range(20_000)]
                   + [(i, TCP, CLOSED, minute_ago, minute_ago) for i in range(20_000, 24_000)]
                   + [(i, socket.IPPROTO_UDP, NEW, minute_ago, minute_ago) for i in range(24_000, 28_000)]
                   + [(i, TCP, NEW, day_ago, None) for i in range(28_000, 29_000)])  # the reverse entry was evicted
    live = fill(dp, [(i, TCP, EST, minute_ago, minute_ago) for i in range(30_000, 32_000)]  # idle, not expired
                + [(i, socket.IPPROTO_UDP, EST, now, day_ago) for i in range(32_000, 32_500)])  # one-way stream
    # Flows the programs made themselves, with their affinity entry.
    for sport in range(41000, 41010):
        assert dnat(dp, TC_INGRESS, Flow(CLIENT, VIP, sport, 80)) == BE
    by_programs = ct_keys(dp) - expired - live
    assert len(by_programs) == 21  # 10 flows x 2 entries, 1 affinity entry
    sticky = affinity_entry(dp, 1, VIP, now - 300 * hz)  # within the Service's 600 s
    stale = [affinity_entry(dp, 2, VIP, now - 700 * hz),  # past it
             affinity_entry(dp, 3, PLAIN_VIP, now),  # the Service has no affinity
             affinity_entry(dp, 4, "10.96.0.99", now)]  # no such frontend

    c = collector(dp)
    registry = registry_of(c)
    # Closed 1 s ago, written last: the pass must come within the 9 s their 10 s linger leaves (under emulation, on a
    # busy machine, 5 s ago written first was not enough).
    now = clock.ticks_now()
    live |= fill(dp, [(i, TCP, CLOSED, now - hz, now - hz) for i in range(32_500, 33_000)])
    before = ct_keys(dp)
    done = c.run_pass()
    assert ct_keys(dp) == live | by_programs | {sticky}
    assert done.seen == len(before) and done.deleted == len(expired) + len(stale)
    assert registry.get_sample_value("pyproxy_bpf_ct_entries") == len(before)
    assert registry.get_sample_value("pyproxy_bpf_ct_gc_deleted_total") == done.deleted
    assert registry.get_sample_value("pyproxy_bpf_ct_gc_duration_seconds_count") == 1

    # The programs still follow the flows they made: same backend, no new flow.
    new_flows = dp.counter("new_flow")
    assert dnat(dp, TC_INGRESS, Flow(CLIENT, VIP, 41000, 80), tcp_flags=0x10) == BE
    assert dp.counter("new_flow") == new_flows

    again = c.run_pass()
    assert again.deleted == 0 and ct_keys(dp) == live | by_programs | {sticky}
    assert registry.get_sample_value("pyproxy_bpf_ct_gc_deleted_total") == done.deleted
    assert registry.get_sample_value("pyproxy_bpf_ct_entries") == again.seen
    c.close()


def test_the_programs_entries_go_once_both_directions_expired(dp: Dataplane) -> None:
    flow = Flow(CLIENT, PLAIN_VIP, 42000, 80)
    assert dnat(dp, TC_INGRESS, flow) == BE  # a SYN: state NEW on both entries
    c = collector(dp)
    assert c.run_pass().deleted == 0
    (fwd, rev) = sorted(ct_keys(dp), key=lambda k: k[13])  # by direction
    old = clock.ticks_now() - (60 + 2 * gc.MARGIN_SECONDS + 1) * clock.kernel_hz()  # past tcp_new and the margin
    for key in (fwd, rev):
        value = bytearray(dp.maps.ct[abi.CtKey.from_buffer_copy(key)])
        value[16:24] = struct.pack("=Q", int(old))
        dp.maps.ct.put_raw(key, bytes(value))
    assert c.run_pass().deleted == 2 and ct_keys(dp) == set()
    c.close()


def test_the_thread_runs_passes_and_stops_promptly(dp: Dataplane) -> None:
    day_ago = clock.ticks_now() - CtTimeouts().ticks(clock.kernel_hz()).tcp_established * 2
    fill(dp, [(i, TCP, abi.CT_ST_ESTABLISHED, day_ago, day_ago) for i in range(1000)])
    c = collector(dp, CtGcSettings(initial_interval=0.05, min_interval=0.05, max_interval=0.2))
    registry = registry_of(c)
    c.start()
    deadline = time.monotonic() + 10
    while (registry.get_sample_value("pyproxy_bpf_ct_gc_duration_seconds_count") or 0) < 3:
        assert time.monotonic() < deadline, "no three passes within 10 s"
        time.sleep(0.02)
    assert registry.get_sample_value("pyproxy_bpf_ct_gc_deleted_total") == 2000
    assert ct_keys(dp) == set()
    assert c.interval > 0.05  # little deleted (2,000 of 65,536, then nothing): lengthened
    started = time.monotonic()
    c.stop()
    assert time.monotonic() - started < 1
    assert c.ct.fd == -1 and c.services.fd == -1  # its own fds are closed; the dataplane's are not
    assert len(dp.maps.ct.keys_list()) == 0


def test_a_full_map_of_the_default_size(load: Load) -> None:
    """PYPROXY_MAX_FLOWS entries (262,144), three quarters of them expired: one pass, timed. (Filled to the brim,
    the LRU may evict a few entries to make room, as it frees in batches per CPU: counts come from the map.)"""
    dataplane = Dataplane(load(None, max_entries={**CAPACITY, abi.MAP_CT: abi_max_flows()}))
    try:
        hz, now = clock.kernel_hz(), clock.ticks_now()
        day_ago = now - CtTimeouts().ticks(hz).tcp_established - 60 * hz
        pairs = dataplane.capacity[abi.MAP_CT] // 2
        EST = abi.CT_ST_ESTABLISHED
        expired = fill(dataplane, [(i, TCP, EST, day_ago, day_ago) for i in range(pairs) if i % 4])
        fill(dataplane, [(i, TCP, EST, now, now) for i in range(0, pairs, 4)])
        held = ct_keys(dataplane)
        assert len(held) > 0.99 * 2 * pairs
        c = collector(dataplane)
        done = c.run_pass()
        print(f"\nGC pass over {done.seen} entries, {done.deleted} deleted: {done.seconds:.3f} s")
        assert done.seen == len(held) and done.deleted == len(held & expired)
        assert ct_keys(dataplane) == held - expired
        fill(dataplane, [(i, TCP, EST, now, now) for i in range(pairs)])  # all live again
        quiet = c.run_pass()
        print(f"GC pass over {quiet.seen} live entries: {quiet.seconds:.3f} s")
        assert quiet.seen > 0.99 * 2 * pairs and quiet.deleted == 0
        # The host's bound; under CPU emulation (the qemu guest: test_guest_kernel.py) a pass is 10-30x slower.
        assert done.seconds < (120 if os.environ.get(EMULATED) else 10)
        c.close()
    finally:
        dataplane.close()


def abi_max_flows() -> int:
    """PYPROXY_MAX_FLOWS, the CT map's default capacity (abi.h)."""
    text = (Path(__file__).resolve().parents[2] / "bpf/include/pyproxy/abi.h").read_text()
    return int(text.split("#define PYPROXY_MAX_FLOWS", 1)[1].split()[0])


def test_a_pass_leaves_an_entry_a_new_flow_took_over_after_the_read(dp: Dataplane,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The race: a pass reads the map, then deletes what had expired; meanwhile a new flow may have taken one of those
    keys over (the SNAT allocator reuses an expired pair's port: snat.h), and deleting its entry would lose the new
    flow's translation. Each entry is read again before its delete and left when it changed."""
    hz, now = clock.kernel_hz(), clock.ticks_now()
    day_ago = now - CtTimeouts().ticks(hz).tcp_established - 60 * hz
    expired = sorted(fill(dp, [(i, TCP, abi.CT_ST_ESTABLISHED, day_ago, day_ago) for i in range(100)]))
    taken = expired[7]
    real = gc.find_garbage

    def racing(*args: object, **kwargs: object) -> object:
        picked = real(*args, **kwargs)  # type: ignore[arg-type]
        # Between the pass's read and its deletes, a new flow writes a live entry under one picked key.
        fresh = gc.CT_VALUE.pack(socket.inet_aton(BE.ip), struct.pack("!H", BE.port), abi.CT_ST_NEW, abi.CT_F_SNAT,
                                 1, 0, clock.ticks_now())
        dp.maps.ct.put_raw(taken, fresh)
        return picked

    monkeypatch.setattr(gc, "find_garbage", racing)
    c = collector(dp)
    try:
        done = c.run_pass()
    finally:
        c.close()
    left = ct_keys(dp) & set(expired)
    assert left == {taken}, f"the new flow's entry went, or expired ones stayed: {len(left)} left"
    assert done.deleted == len(expired) - 1
