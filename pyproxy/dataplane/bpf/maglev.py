"""Maglev lookup tables for the bpf `maglev` scheduler: pure computation, no I/O.

The datapath picks a new flow's backend as `table[svc, hash(flow) % M]`; this module computes the table
(Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load Balancer", NSDI 2016, the population
of section 3.4, and Cilium's pkg/maglev for sizes and weights) and the slots a change rewrites.

Every node must compute the same table for the same backends, and a restarted proxy the table it left in the
map, so that a flow keeps its backend whichever node or process sees its next packet. Hence a backend's
permutation comes from a blake2b digest of its "ip:port" (not `hash()`, which is salted per process),
the backends are taken in sorted order whatever order the caller passes them in, and weights are counted in
integers (no float rounding to differ between machines).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
from collections.abc import Sequence

from pyproxy.model.state import Backend

TABLE_SIZES = (251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521)
"""The sizes a table may have: primes (the population needs M prime so every skip walks all M slots), Cilium's
list. It stops at 65521 because the datapath keeps M in a 16-bit field."""
DEFAULT_TABLE_SIZE = 16381
"""Cilium's default. Measured (tests/unit/test_maglev.py, bench/maglev.py): when one of 100 backends leaves,
1.3 % of the slots move beyond the leaving backend's own; at 32749 slots 0.8 %."""


def _check_size(size: int) -> None:
    if size not in TABLE_SIZES:
        raise ValueError(f"Maglev table size {size!r}: want one of {', '.join(map(str, TABLE_SIZES))}")


def offset_skip(backend: Backend, size: int) -> tuple[int, int]:
    """Where `backend`'s permutation of a table of `size` slots starts and the step it walks by (1..size-1).

    Two independent 64-bit halves of one blake2b digest of "ip:port", so offset and skip are uncorrelated
    (the paper's h1 and h2) and the same on every machine and Python version."""
    digest = hashlib.blake2b(str(backend).encode(), digest_size=16, person=b"pyproxy-maglev").digest()
    h1 = int.from_bytes(digest[:8], "little")
    h2 = int.from_bytes(digest[8:], "little")
    return h1 % size, h2 % (size - 1) + 1


def table(backends: Sequence[Backend], size: int = DEFAULT_TABLE_SIZE,
          weights: Sequence[int] | None = None) -> list[int]:
    """The Maglev lookup table: entry i is the index in `backends` of the backend that owns slot i.

    `backends` may come in any order (the table is the same for every order of the same set) but must not
    repeat one. `weights`, one per backend, share the slots out in proportion (Cilium's weighted Maglev); a
    backend of weight 0 owns no slot. No backend (or none of weight > 0): an empty table. Raises ValueError
    for a size not in TABLE_SIZES, duplicate backends or weights that do not match the backends."""
    _check_size(size)
    if len(set(backends)) != len(backends):
        raise ValueError("Maglev table: a backend is listed twice")
    if weights is not None and (len(weights) != len(backends) or any(w < 0 for w in weights)):
        raise ValueError(f"Maglev table: {len(backends)} backends want as many weights >= 0, got {list(weights)}")
    # The turn order is the backends' sorted order, so the caller's order changes nothing; weight-0 backends
    # take no turn at all (their permutations would otherwise claim slots on the first round).
    order = [k for k in sorted(range(len(backends)), key=backends.__getitem__) if weights is None or weights[k]]
    if not order:
        return []
    starts = [offset_skip(backends[k], size) for k in order]
    position = [s for s, _ in starts]
    skip = [s for _, s in starts]
    entry = [-1] * size
    # With equal weights Cilium's counters never pass a turn on: the plain population gives the same table.
    # (Cilium weighs only when weight sum / count > 1, as its weights default to 100; here they default to 1,
    # so unequal weights are always weighed.)
    if weights is None or len({weights[k] for k in order}) == 1:
        _populate(entry, order, position, skip, size)
    else:
        _populate_weighted(entry, order, position, skip, size, [weights[k] for k in order])
    return entry


def _populate(entry: list[int], order: list[int], position: list[int], skip: list[int], size: int) -> None:
    """The paper's population: the backends in turn each take the next free slot of their permutation."""
    filled = 0
    while True:
        for i, owner in enumerate(order):
            _claim(entry, position, skip, i, owner, size)
            filled += 1
            if filled == size:
                return


def _populate_weighted(entry: list[int], order: list[int], position: list[int], skip: list[int], size: int,
                       weight: list[int]) -> None:
    """Cilium's weighted population: turn n falls to backend n mod count unless it has taken its share of
    n + 1 turns (`(n + 1) * weight < counter`, the counter advanced by the weight sum per slot taken), and
    then to the next backend in turn order that has not.

    The same choices as Cilium's loop, which walks the backends one by one and at 1,000 backends of unequal
    weights spends about 100 ms doing so: a backend's counter only moves when it takes a slot, so the first
    turn it may take one again is known then ("ready"); the backends whose ready turn has come are kept in
    turn order and the next one from n mod count is found by bisection."""
    count = len(order)
    total = sum(weight)
    # Cilium starts a counter at weight / count and compares it truncated to an integer; the additions are
    # whole, so the integer part alone gives the same comparisons.
    counter = [w // count for w in weight]
    waiting = [(_ready(c, w), i) for i, (c, w) in enumerate(zip(counter, weight, strict=True))]
    heapq.heapify(waiting)
    eligible: list[int] = []
    for n in range(size):
        while waiting and waiting[0][0] <= n:
            bisect.insort(eligible, heapq.heappop(waiting)[1])
        # Never empty: the shares of n + 1 turns sum to more than the n turns taken so far.
        k = bisect.bisect_left(eligible, n % count)
        i = eligible.pop(k if k < len(eligible) else 0)
        counter[i] += total
        heapq.heappush(waiting, (_ready(counter[i], weight[i]), i))
        _claim(entry, position, skip, i, order[i], size)


def _claim(entry: list[int], position: list[int], skip: list[int], i: int, owner: int, size: int) -> None:
    """The i-th backend in turn order takes the next free slot of its permutation (offset + j * skip mod size),
    walking on from where it stopped last (`position`): a slot it passed was taken and stays taken."""
    c, s = position[i], skip[i]
    while entry[c] >= 0:
        c += s
        if c >= size:
            c -= size
    entry[c] = owner
    c += s
    position[i] = c - size if c >= size else c


def _ready(counter: int, weight: int) -> int:
    """The first turn n at which (n + 1) * weight >= counter."""
    return max(0, -(-counter // weight) - 1)


def delta(old: Sequence[Backend | None] | None, new: Sequence[Backend]) -> list[tuple[int, Backend]]:
    """The (slot, backend) pairs to write to turn the table `old` into `new`, both one backend per slot
    (`[backends[i] for i in table(backends, size)]`): the slots whose backend changed, or every slot of
    `new` when there was no table (None) or it had another size."""
    if old is None or len(old) != len(new):
        return list(enumerate(new))
    return [(slot, b) for slot, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
