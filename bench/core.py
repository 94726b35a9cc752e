"""What every benchmark part shares: its interface, what it measures, and how it reports.

A part is a module with one `PART` (see `Part`): parameters for the quick and the full run, a time budget
for each, the figures its numbers go into, and `run(params, rec, deadline)`. The harness (bench/run.py)
runs each part in a child process and ends it at its budget; the part streams every number to its
`Recorder` the moment it has it, so a part stopped at its budget keeps everything it finished and the
report says which step was still running ("did not finish").

Numbers are `Measurement`s: one value of one metric for one series (a line on a plot, a row in a table:
"XDP established", "bpf (API server)", later "iptables", "kube-proxy iptables") at one number of Services.
A value of None means the step did not finish; its note says why.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]

# The scale every part loads: N Services, each one TCP port with ENDPOINTS ready endpoints.
ENDPOINTS = 10
PORT, BACKEND_PORT = 80, 8080


def vip(i: int) -> str:
    """Service i's ClusterIP: 10.100.0.0 + i, inside the lab API server's 10.96.0.0/12 and clear of its own
    `kubernetes` Service (10.96.0.1)."""
    return str(ipaddress.IPv4Address("10.100.0.0") + i)


def endpoint(k: int) -> str:
    """Endpoint k's address, 10.128.0.0 + k: Service i has endpoints i*ENDPOINTS .. i*ENDPOINTS + ENDPOINTS-1."""
    return str(ipaddress.IPv4Address("10.128.0.0") + k)


def vip6(i: int) -> str:
    """Service i's IPv6 ClusterIP (a dual-stack Service's second one): fd00:100:: + i."""
    return str(ipaddress.IPv6Address("fd00:100::") + i)


def endpoint6(k: int) -> str:
    """Endpoint k's IPv6 address, fd00:128:: + k (endpoint's twin)."""
    return str(ipaddress.IPv6Address("fd00:128::") + k)


@dataclass(frozen=True)
class Measurement:
    metric: str
    """What is measured, e.g. "ns_per_packet", "programmed_s", "rss_mb"."""
    series: str
    """One line of a plot and one row of the table."""
    mode: str
    """The dataplane (or the reference) it belongs to: "bpf", "floor", later "nftables", "kube-proxy iptables"."""
    services: int
    value: float | None
    """None: did not finish (the note says why)."""
    unit: str
    note: str = ""
    """Shown beside the value in the table, e.g. "5.7x floor"."""
    detail: Mapping[str, Any] = field(default_factory=dict)
    """More numbers behind the value (spread, counts, the raw samples' summary)."""


@dataclass(frozen=True)
class Panel:
    """One plot: a metric against the number of Services, one line per series."""

    metric: str
    ylabel: str
    title: str = ""
    logy: bool = False
    series: str = ""
    """Only the series whose name contains this (e.g. "(API server)"); it is left out of their labels."""
    exclude: str = ""
    """Not the series whose name contains this (those another panel of the figure shows)."""

    def shows(self, m: Measurement) -> bool:
        return m.metric == self.metric and self.series in m.series and not (self.exclude and self.exclude in m.series)


@dataclass(frozen=True)
class Figure:
    name: str
    """File stem: bench/plots/<name>.png."""
    title: str
    panels: tuple[Panel, ...]
    xlabel: str = "Services (10 endpoints each)"
    """What the x axis counts (every panel's: a Measurement's `services`)."""


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    budget_s: Mapping[bool, float]
    """Seconds the part may take, by `quick`; the harness stops it then."""
    params: Callable[[bool], dict[str, Any]]
    """The parameters of a quick (True) or full (False) run; recorded with the results."""
    run: Callable[[Mapping[str, Any], Recorder, Deadline], None]
    figures: tuple[Figure, ...] = ()
    metrics: Mapping[str, str] = field(default_factory=dict)
    """Metric -> the heading of its table, in the order the tables are printed."""
    size_word: str = "Service"
    """What a Measurement's `services` counts, in the tables' headings ("Service", "backend"; a unit with a "/",
    "exchanges/s", is not made plural)."""
    summary: Callable[[Sequence[Mapping[str, Any]]], list[str]] | None = None
    """More Markdown after the part's tables, from its measurements (as the results hold them): e.g. a table of
    where each series crosses a threshold."""
    needs_root: bool = True
    """False for a part that only computes (no lab, no BPF): a run of such parts alone needs no root."""


class Deadline:
    """A point in time on the monotonic clock; parts derive each step's own bound from it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def within(self, seconds: float, reserve: float = 0.0) -> float:
        """A step's bound: `seconds`, or what is left of the part's budget minus `reserve`, whichever is less."""
        return max(0.0, min(seconds, self.remaining() - reserve))


class Recorder:
    """Streams a part's events as JSON lines (parameters, notes, steps, measurements) to a file the harness
    reads back, flushed one by one; also logs progress on stderr."""

    def __init__(self, part: str, out: IO[str] | None) -> None:
        self.part = part
        self._out = out
        self.measurements: list[Measurement] = []

    def _emit(self, event: str, **body: Any) -> None:
        if self._out is not None:
            self._out.write(json.dumps({"event": event, **body}) + "\n")
            self._out.flush()

    def log(self, text: str) -> None:
        print(f"[{self.part} {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    def step(self, name: str) -> None:
        """The step now running: what the report names if the budget ends it."""
        self.log(name)
        self._emit("step", name=name)

    def note(self, text: str) -> None:
        """A caveat or method note that belongs with the numbers."""
        self._emit("note", text=text)

    def param(self, key: str, value: Any) -> None:
        self._emit("param", key=key, value=value)

    def add(self, m: Measurement) -> Measurement:
        self.measurements.append(m)
        self._emit("measurement", **asdict(m))
        shown = "did not finish" if m.value is None else f"{m.value:,.4g} {m.unit}"
        self.log(f"{m.metric} {m.series} @ {plural(m.services, 'service')}: {shown} {m.note}".rstrip())
        return m


def plural(n: int, word: str) -> str:
    if "/" in word:  # a unit: "25 exchanges/s"
        return f"{n:,} {word}"
    return f"{n:,} {word}{'' if n == 1 else 's'}"


class BudgetExceeded(BaseException):
    """Raised in a part's process when the harness ends it (SIGTERM), so its `with` blocks tear down labs,
    clusters and pyproxy processes before it exits. A BaseException: `except Exception` does not swallow it."""


def raise_on_sigterm() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise BudgetExceeded(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def read_events(path: Path) -> dict[str, Any]:
    """A part's event file, folded: params, notes, measurements and the last step started."""
    out: dict[str, Any] = {"params": {}, "notes": [], "measurements": [], "last_step": None}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        kind = ev.pop("event", None)
        if kind == "param":
            out["params"][ev["key"]] = ev["value"]
        elif kind == "note":
            out["notes"].append(ev["text"])
        elif kind == "step":
            out["last_step"] = ev["name"]
        elif kind == "measurement":
            out["measurements"].append(ev)
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of already sorted values, nearest rank."""
    if not sorted_values:
        raise ValueError("no values")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in kB from /proc/PID/status, plus the process's CPU time in clock ticks
    (utime + stime, /proc/PID/stat); {} when the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return {}
    out = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0])
    fields = stat.rsplit(")", 1)[1].split()
    out["cpu_ticks"] = int(fields[11]) + int(fields[12])
    return out


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
