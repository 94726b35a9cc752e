"""Maglev lookup tables (pyproxy/dataplane/bpf/maglev.py): balance, determinism, weights, how few slots a
change of backends moves, and the deltas the loader writes."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Sequence

import pytest

from pyproxy.dataplane.bpf.maglev import DEFAULT_TABLE_SIZE, TABLE_SIZES, delta, offset_skip, table
from pyproxy.model.state import Backend


def pods(n: int, port: int = 8080) -> list[Backend]:
    """n pod addresses as a cluster hands them out, 50 to a node's /24."""
    return [Backend(f"10.244.{k // 50}.{k % 50 * 4 + 2}", port) for k in range(n)]


def owners(backends: Sequence[Backend], size: int, weights: Sequence[int] | None = None) -> list[Backend]:
    return [backends[i] for i in table(backends, size, weights)]


def excess_after_removal(backends: list[Backend], size: int, removed: int) -> float:
    """The fraction of the slots that changed backend, beyond those the removed backend owned."""
    old = owners(backends, size)
    rest = backends[:removed] + backends[removed + 1:]
    own = old.count(backends[removed])
    return (len(delta(old, owners(rest, size))) - own) / size


# -- sizes --------------------------------------------------------------------------------------------------


def test_the_sizes_are_ciliums_primes_that_fit_16_bits() -> None:
    assert TABLE_SIZES == (251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521)
    assert all(all(m % d for d in range(2, int(m**0.5) + 1)) for m in TABLE_SIZES)
    assert max(TABLE_SIZES) < 2**16
    assert DEFAULT_TABLE_SIZE == 16381


@pytest.mark.parametrize("size", [0, 1, 250, 16384, 65537, 131071])
def test_a_size_not_in_the_list_raises_naming_the_allowed_ones(size: int) -> None:
    with pytest.raises(ValueError, match=r"251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521"):
        table(pods(3), size)


def test_bad_backends_or_weights_raise() -> None:
    with pytest.raises(ValueError, match="twice"):
        table([*pods(2), pods(1)[0]], 251)
    with pytest.raises(ValueError, match="weights"):
        table(pods(3), 251, [1, 1])
    with pytest.raises(ValueError, match="weights"):
        table(pods(3), 251, [1, -1, 1])


def test_no_backend_or_none_with_weight_is_an_empty_table() -> None:
    assert table([], 251) == []
    assert table(pods(2), 251, [0, 0]) == []


# -- balance and determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "size"), [(1, 251), (3, 251), (10, 16381), (100, 16381), (1000, 16381),
                                         (100, 65521)])
def test_every_backend_gets_its_share_of_the_slots(n: int, size: int) -> None:
    counts = Counter(table(pods(n), size))
    assert sorted(counts) == list(range(n))
    # Each round every backend takes one slot, so the shares differ by one slot at most: within 4 % of M/N
    # even at 1,000 backends in 16,381 slots (16 or 17 each).
    assert max(counts.values()) - min(counts.values()) <= 1
    assert all(abs(c - size / n) <= max(1.0, 0.04 * size / n) for c in counts.values())


def test_the_table_is_the_same_for_every_order_of_the_backends_and_every_call() -> None:
    backends = pods(100)
    expected = owners(backends, DEFAULT_TABLE_SIZE)
    for seed in range(3):
        shuffled = backends[:]
        random.Random(seed).shuffle(shuffled)
        assert owners(shuffled, DEFAULT_TABLE_SIZE) == expected
    assert owners(backends, DEFAULT_TABLE_SIZE) == expected


def test_the_hash_is_pinned_so_every_node_and_version_computes_the_same_table() -> None:
    # Literal values: a change to the hash (or to how "ip:port" is spelled) would have every node rewrite every
    # table at upgrade and, while nodes differ, send a flow's packets to different backends.
    assert offset_skip(Backend("10.244.1.5", 8080), 16381) == (12584, 15536)
    assert offset_skip(Backend("fd00::5", 53), 65521) == (12916, 13808)
    three = [Backend("10.244.1.5", 8080), Backend("10.244.2.7", 8080), Backend("10.244.3.9", 8080)]
    assert table(three, 251)[:24] == [0, 1, 1, 0, 1, 0, 2, 1, 1, 0, 1, 2, 1, 1, 1, 0, 0, 2, 0, 0, 1, 0, 2, 1]


# -- weights ------------------------------------------------------------------------------------------------


def test_a_weight_two_backend_gets_twice_the_slots_and_weight_zero_none() -> None:
    backends = pods(100)
    weights = [2] * 20 + [0] * 10 + [1] * 70
    counts = Counter(table(backends, DEFAULT_TABLE_SIZE, weights))
    unit = DEFAULT_TABLE_SIZE / sum(weights)
    assert all(counts[k] == 0 for k in range(20, 30))
    for k in range(100):
        if weights[k]:
            assert counts[k] == pytest.approx(weights[k] * unit, rel=0.03), k


def test_equal_weights_are_no_weights() -> None:
    assert table(pods(10), 1021, [3] * 10) == table(pods(10), 1021)


def cilium_population(backends: Sequence[Backend], size: int, weights: Sequence[int]) -> list[int]:
    """Cilium's pkg/maglev loop as written there (float counters, one backend at a time), the reference the
    faster weighted population must agree with slot for slot."""
    order = [k for k in sorted(range(len(backends)), key=backends.__getitem__) if weights[k]]
    count, total = len(order), sum(weights[k] for k in order)
    counter = [weights[k] / count for k in order]
    perm = [offset_skip(backends[k], size) for k in order]
    taken = [0] * count
    entry = [-1] * size
    for n in range(size):
        i = n % count
        while (n + 1) * weights[order[i]] < int(counter[i]):
            i = (i + 1) % count
        counter[i] += total
        offset, skip = perm[i]
        while entry[c := (offset + taken[i] * skip) % size] >= 0:
            taken[i] += 1
        entry[c] = order[i]
        taken[i] += 1
    return entry


@pytest.mark.parametrize(("n", "size", "seed"), [(5, 251, 0), (30, 1021, 1), (100, 4093, 2), (300, 16381, 3)])
def test_weighted_tables_are_ciliums(n: int, size: int, seed: int) -> None:
    rnd = random.Random(seed)
    weights = [rnd.choice([0, 1, 1, 2, 3, 10, 100]) for _ in range(n)]
    weights[0] = 7  # at least one not zero, and not all equal
    assert table(pods(n), size, weights) == cilium_population(pods(n), size, weights)


# -- disruption ---------------------------------------------------------------------------------------------


def test_removing_one_of_100_backends_moves_at_most_1_2_percent_more_at_32749_slots() -> None:
    # The acceptance bound, for every one of the 100 backends leaving: met from 32,749 slots (M >= 300 N).
    backends = pods(100)
    excess = [excess_after_removal(backends, 32749, r) for r in range(100)]
    assert max(excess) <= 0.012, max(excess)
    assert statistics.mean(excess) == pytest.approx(0.0083, abs=0.001)


def test_removing_one_of_100_backends_at_the_default_size_moves_about_1_3_percent_more() -> None:
    # Measured, not wished: at 16,381 slots (M = 164 N) Maglev's excess is 1.29 % on average (1.16-1.43 %
    # over the 100 backends), above the 1.2 % bound that 32,749 slots meet. It is the population's, not the
    # hash's: other hashes of the same backends give 1.29-1.38 %. Pinned so a change that makes it worse shows.
    backends = pods(100)
    excess = [excess_after_removal(backends, DEFAULT_TABLE_SIZE, r) for r in range(100)]
    assert statistics.mean(excess) == pytest.approx(0.0129, abs=0.0005)
    assert max(excess) <= 0.0145


def test_the_removed_backends_slots_go_to_the_others_evenly() -> None:
    backends = pods(100)
    old = owners(backends, DEFAULT_TABLE_SIZE)
    rest = backends[1:]
    counts = Counter(table(rest, DEFAULT_TABLE_SIZE))
    assert max(counts.values()) - min(counts.values()) <= 1
    assert old.count(backends[0]) in (163, 164)


def test_adding_one_backend_moves_about_1_over_n() -> None:
    backends = pods(101)
    old = owners(backends[:100], DEFAULT_TABLE_SIZE)
    new = owners(backends, DEFAULT_TABLE_SIZE)
    moved = delta(old, new)
    taken = sum(1 for _, b in moved if b == backends[100])
    assert taken / DEFAULT_TABLE_SIZE == pytest.approx(1 / 101, rel=0.01)
    # The slots moving between the old backends: the same excess as a removal (adding is a removal undone).
    assert (len(moved) - taken) / DEFAULT_TABLE_SIZE <= 0.0145


# -- deltas -------------------------------------------------------------------------------------------------


def test_a_first_table_is_written_whole() -> None:
    new = owners(pods(3), 251)
    assert delta(None, new) == list(enumerate(new))


def test_an_unchanged_table_writes_nothing() -> None:
    assert delta(owners(pods(10), 1021), owners(list(reversed(pods(10))), 1021)) == []


def test_a_change_writes_only_the_slots_whose_backend_changed() -> None:
    old = owners(pods(10), 1021)
    new = owners(pods(9), 1021)
    changed = delta(old, new)
    assert changed == [(i, new[i]) for i in range(1021) if old[i] != new[i]]
    assert 0 < len(changed) < 1021


def test_unknown_slots_or_another_size_are_written_whole() -> None:
    new = owners(pods(3), 251)
    assert delta([None] * 251, new) == list(enumerate(new))
    assert delta(owners(pods(3), 509), new) == list(enumerate(new))

