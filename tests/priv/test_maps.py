"""The BPF backend's batched map writes on real maps: what render() plans lands in the kernel exactly, reads
back the same after a restart, and the batch calls keep their edge cases (absent keys, a full map)."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import Load

from pyproxy.dataplane.bpf import abi, libbpf
from pyproxy.dataplane.bpf.maps import MapFullError, lookup_batch, update_batch
from pyproxy.dataplane.bpf.mapset import Maps
from pyproxy.dataplane.bpf.render import NO_MASQUERADE, Applied, Scheduling, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

CAPACITY = {abi.MAP_SERVICES: 4096, abi.MAP_SLOTS: 8192, abi.MAP_BACKENDS: 8192, abi.MAP_STATS: 4096,
            abi.MAP_NAMES: 4096, abi.MAP_CT: 1024}


@pytest.fixture
def maps(load: Load) -> Iterator[Maps]:
    obj = load(None, max_entries=CAPACITY)
    m = Maps({name: os.dup(fd) for name, fd in obj.maps.items()})
    yield m
    m.close()
    obj.close()


def desired(n: int, backends: int, first: int = 0) -> dict[str, tuple[ServicePortState, ...]]:
    out: dict[str, tuple[ServicePortState, ...]] = {}
    for i in range(first, first + n):
        ready = tuple(sorted(Backend(f"10.{128 + i // 200}.{i % 200}.{j}", 8080) for j in range(backends)))
        name = f"bench/svc-{i}"
        fe = Frontend(f"10.100.{i // 250}.{i % 250}", 80, Protocol.TCP)
        out[name] = (ServicePortState(name, "http", fe, ready, ready, 10800 if i % 7 == 0 else 0),)
    return out


def program(maps: Maps, applied: Applied, want: dict[str, tuple[ServicePortState, ...]]) -> int:
    plan = render(applied, want, CAPACITY)
    maps.run_batches(plan.batches)
    applied.commit(plan)
    return len(plan.ops)


def test_a_batched_cold_start_reads_back_as_planned_and_replans_to_nothing(maps: Maps) -> None:
    applied = Applied()
    program(maps, applied, desired(500, 5))
    assert len(maps.slots.keys_list()) == 2500 and len(maps.backends.keys_list()) == 2500
    back = maps.read_applied()  # as a restarted pyproxy sees it
    assert back.frontends.keys() == applied.frontends.keys()
    for key, fe in applied.frontends.items():
        assert (back.frontends[key].svc_id, back.frontends[key].name, back.frontends[key].backends,
                back.frontends[key].affinity_sec) == (fe.svc_id, fe.name, fe.backends, fe.affinity_sec)
    assert back == applied
    assert program(maps, back, desired(500, 5)) == 0


def test_a_restart_mends_an_affinity_map_that_lost_entries_or_kept_stale_ones(maps: Maps) -> None:
    """The affinity map holds the slots of each frontend with ClientIP affinity (every 7th here). One that does not
    (new with an upgrade, resized, a plan stopped halfway) is made to at start, from what the restart reads back."""
    applied = Applied()
    program(maps, applied, desired(50, 3))

    def held() -> set[bytes]:
        return {bytes(k) for k in maps.affinity.keys_list()}

    want = {bytes(abi.AffinityKey(fe.svc_id, abi.Backend(abi.be32(b.ip), abi.be16(b.port))))
            for fe in applied.frontends.values() if fe.affinity_sec for b in fe.backends}
    assert len(want) == 8 * 3 and held() == want
    lost = next(iter(maps.affinity.keys_list()))
    del maps.affinity[lost]
    maps.affinity[abi.AffinityKey(999, abi.Backend(abi.be32("10.0.0.1"), abi.be16(80)))] = ctypes.c_uint32(0)
    maps.sync_affinity(maps.read_applied())
    assert held() == want


def test_shrinking_and_removing_in_batches_leaves_exactly_the_rest(maps: Maps) -> None:
    applied = Applied()
    program(maps, applied, desired(300, 4))
    program(maps, applied, {**desired(100, 2), **{f"bench/svc-{i}": () for i in range(100, 300)}})
    assert maps.read_applied() == applied
    assert len(maps.services.keys_list()) == 100 and len(maps.slots.keys_list()) == 200
    assert len(maps.names.keys_list()) == 100


def test_a_batch_delete_skips_absent_keys(maps: Maps) -> None:
    keys = [abi.SlotKey(1, i) for i in range(6)]
    for k in keys[::2]:
        maps.slots[k] = abi.Backend(abi.be32("10.0.0.1"), abi.be16(80))
    maps.slots.delete_batch(b"".join(bytes(k) for k in keys), len(keys))  # absent: 1, 3 and 5
    assert maps.slots.keys_list() == []


def test_a_full_map_in_a_batch_is_a_map_full_error(maps: Maps) -> None:
    n = CAPACITY[abi.MAP_NAMES] + 1
    keys = b"".join(bytes(ctypes.c_uint32(i)) for i in range(n))
    with pytest.raises(MapFullError, match=abi.MAP_NAMES):
        maps.names.update_batch(keys, bytes(ctypes.sizeof(abi.SvcName)) * n, n)


def test_resetting_many_ids_zeroes_each_on_every_cpu(maps: Maps) -> None:
    raw = bytes([0xFF]) * (maps.stats._stride * maps.stats.ncpus)  # every counter of a CPU's value at its max
    update_batch(maps.stats.fd, "stats", bytes(ctypes.c_uint32(3)) + bytes(ctypes.c_uint32(9)), raw * 2, 2, 4,
                 len(raw))
    assert all(s.packets == 2**64 - 1 for s in maps.stats.get(9))
    maps.stats.reset(3, 9)
    assert all(s.packets == 0 and s.bytes == 0 for i in (3, 9) for s in maps.stats.get(i))


def test_reading_back_one_key_at_a_time_gives_the_same(maps: Maps, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel has no batch lookups, read_applied() falls back to one lookup per key."""
    applied = Applied()
    program(maps, applied, desired(50, 3))
    monkeypatch.setattr("pyproxy.dataplane.bpf.maps.lookup_batch", lambda *args, **kwargs: None)
    assert maps.read_applied() == applied


def test_a_batch_lookup_reads_a_map_larger_than_one_chunk(maps: Maps) -> None:
    program(maps, Applied(), desired(300, 5))
    got = lookup_batch(maps.slots.fd, "slots", 8, 8, chunk=64)
    assert got is not None
    keys, values = got
    assert len(keys) == len(values) == 1500 * 8
    assert len({keys[i:i + 8] for i in range(0, len(keys), 8)}) == 1500


def test_ops_run_one_by_one_program_the_same_as_batches(maps: Maps) -> None:
    applied = Applied()
    for want in (desired(40, 3), {**desired(20, 2), **{f"bench/svc-{i}": () for i in range(20, 40)}}):
        plan = render(applied, want, CAPACITY)
        for op in plan.ops:  # as bench/packet.py programs
            maps.run(op)
        applied.commit(plan)
        assert maps.read_applied() == applied


class _NoBatchLib:
    """libbpf as on a kernel without batch operations: every batch call fails with EINVAL, nothing done."""

    def __init__(self, lib: object) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> object:
        if name.endswith("_batch"):
            return lambda *args: -errno.EINVAL
        return getattr(self._lib, name)


def test_without_batch_operations_plans_run_one_call_per_entry(maps: Maps, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libbpf, "_lib", _NoBatchLib(libbpf.lib()))
    applied = Applied()
    program(maps, applied, desired(30, 3))
    program(maps, applied, {**desired(10, 2), **{f"bench/svc-{i}": () for i in range(10, 30)}})
    assert maps.read_applied() == applied
    assert len(maps.slots.keys_list()) == 20


def test_schedulers_weights_and_tables_read_back_as_planned(maps: Maps) -> None:
    """A restart finds each frontend's scheduler, its slots' weights and its table (an array of its own in the
    map of maps), and replans to nothing; a resized table is a new array."""
    applied = Applied()
    want = desired(6, 4)
    names = sorted(want)
    annotated = {
        names[0]: replace(want[names[0]][0], scheduler="maglev"),
        names[1]: replace(want[names[1]][0], scheduler="wrr", weights=((want[names[1]][0].backends[0].ip, 3),)),
        names[2]: replace(want[names[2]][0], scheduler="lc"),
    }
    want = {**want, **{k: (v,) for k, v in annotated.items()}}
    scheduling = Scheduling(table_size=1021)
    plan = render(applied, want, CAPACITY, NO_MASQUERADE, scheduling)
    maps.run_batches(plan.batches)
    applied.commit(plan)
    back = maps.read_applied()
    assert back == applied
    for key, fe in applied.frontends.items():
        got = back.frontends[key]
        assert (got.sched, got.weights, got.table) == (fe.sched, fe.weights, fe.table), fe.name
    assert sorted(len(f.table) for f in back.frontends.values()) == [0, 0, 0, 0, 6, 1021]  # wrr: 3+1+1+1 turns
    again = render(back, want, CAPACITY, NO_MASQUERADE, scheduling)
    assert again.batches == ()
    # Another table size: a new array replaces the old one, read back whole.
    bigger = render(back, want, CAPACITY, NO_MASQUERADE, Scheduling(table_size=2039))
    maps.run_batches(bigger.batches)
    back.commit(bigger)
    assert maps.read_applied() == back
