"""Maglev lookup tables (pyproxy/dataplane/bpf/maglev.py): what building one costs the proxy, and how many of a
Service's flows a backend leaving moves. Arithmetic only: no lab, no BPF, no root.

For N backends (pod addresses as a cluster hands them out, 10.244.x.y:8080, 50 to a node's /24) and each table
size M: the build time of the table, the median of `runs` builds (plain, and with weights 1 and 2 alternating,
Cilium's weighted population); then, for `removals` backends spread over the sorted list, the table of the
other N - 1 and how many slots changed backend, as a fraction of M: in total, and beyond the slots the leaving
backend owned (its own flows must move; any other moved flow is Maglev's excess over a perfect consistent
hash). The expected total is about 1/N plus that excess. The numbers are the mean over the removals, their
range in the detail. The tests (tests/unit/test_maglev.py) pin the excess at 100 backends.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder
from pyproxy.dataplane.bpf import maglev
from pyproxy.model.state import Backend

IDEAL = "1/N: the leaving backend's own"


def pods(n: int) -> list[Backend]:
    """n pod addresses, 50 to a node's /24, sorted as the model's backends are."""
    return sorted(Backend(f"10.244.{k // 50}.{k % 50 * 4 + 2}", 8080) for k in range(n))


def build_ms(backends: list[Backend], size: int, weights: list[int] | None, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        maglev.table(backends, size, weights)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def moved_on_removal(backends: list[Backend], size: int, removed: int) -> tuple[float, float]:
    """(all slots that changed backend, those beyond the removed backend's own), as fractions of `size`."""
    old = [backends[i] for i in maglev.table(backends, size)]
    rest = backends[:removed] + backends[removed + 1:]
    changed = len(maglev.delta(old, [rest[i] for i in maglev.table(rest, size)]))
    return changed / size, (changed - old.count(backends[removed])) / size


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "n": len(values)}


def run_size(p: Mapping[str, Any], rec: Recorder, n: int, size: int) -> None:
    series = f"M={size:,}"
    backends = pods(n)
    rec.step(f"building tables of {n:,} backends, M={size:,}")
    plain = build_ms(backends, size, None, int(p["runs"]))
    rec.add(Measurement("build_ms", series, "bpf", n, statistics.median(plain), "ms", detail=spread(plain)))
    weighted = build_ms(backends, size, [1 + k % 2 for k in range(n)], int(p["runs"]))
    rec.add(Measurement("build_ms", f"{series} weighted", "bpf", n, statistics.median(weighted), "ms",
                        detail=spread(weighted)))
    rec.step(f"one of {n:,} backends leaving, M={size:,}")
    chosen = sorted({k * n // int(p["removals"]) for k in range(int(p["removals"]))})
    total, excess = zip(*(moved_on_removal(backends, size, r) for r in chosen), strict=True)
    rec.add(Measurement("moved_pct", series, "bpf", n, 100 * statistics.mean(total), "%",
                        note=f"1/N = {100 / n:.3g} %", detail={**spread([100 * t for t in total]), "removed": chosen}))
    if size == p["table_sizes"][0]:
        # The least any table can move: the leaving backend's own flows (a grey dashed line on the plot).
        rec.add(Measurement("moved_pct", IDEAL, "floor", n, 100 / n, "%"))
    rec.add(Measurement("excess_pct", series, "bpf", n, 100 * statistics.mean(excess), "%",
                        detail={**spread([100 * e for e in excess]), "removed": chosen}))


def params(quick: bool) -> dict[str, Any]:
    if quick:
        return {"backends": [10, 100, 1000], "table_sizes": [maglev.DEFAULT_TABLE_SIZE], "runs": 3, "removals": 5}
    return {"backends": [10, 100, 1000], "table_sizes": [maglev.DEFAULT_TABLE_SIZE, 32749, 65521], "runs": 7,
            "removals": 20}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    rec.note("Maglev tables computed in Python (pyproxy/dataplane/bpf/maglev.py), no numpy: build time is the "
             "median of the runs (weighted: weights 1 and 2 alternating); moved = slots whose backend changed "
             "when one backend leaves, % of M, mean over the removals; excess = moved beyond the leaving "
             "backend's own slots (a perfect consistent hash: 0).")
    for size in p["table_sizes"]:
        for n in p["backends"]:
            if deadline.expired():
                return
            run_size(p, rec, int(n), int(size))


PART = Part(
    name="maglev",
    title="Maglev lookup tables: build time and slots moved when a backend leaves",
    # Quick: about 2 s; full (3 sizes, 20 removals): about 15 s.
    budget_s={True: 30.0, False: 90.0},
    params=params,
    run=run,
    figures=(
        Figure("maglev", "Maglev lookup tables in Python (pyproxy/dataplane/bpf/maglev.py)", (
            Panel("build_ms", "milliseconds", "build one table (median)", logy=True),
            Panel("moved_pct", "% of the slots", "slots moved when one backend leaves", logy=True),
            Panel("excess_pct", "% of the slots", "moved beyond the leaving backend's own"),
        ), xlabel="backends of the Service"),
    ),
    metrics={
        "build_ms": "build one table, ms, median",
        "moved_pct": "slots that change backend when one backend leaves, % of M",
        "excess_pct": "slots that change backend beyond the leaving backend's own, % of M",
    },
    size_word="backend",
    needs_root=False,
)
