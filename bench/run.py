"""`make bench` / `make bench-quick`: run the benchmark parts, each bounded, and report them side by side.

    python -m bench.run [--quick] [--parts packet,controlplane] [--results DIR]

Each part (a module with a `PART`, see bench/core.py) runs in its own child process with its own time
budget; at the budget the harness sends SIGTERM (the part tears down its labs and processes), then SIGKILL,
and reports the part as "did not finish" with everything it had measured by then. The run writes
bench/results/<UTC timestamp>.json (machine facts, per part: parameters, status, numbers), the same tables
as Markdown beside it, a PNG per figure (bench/results/<timestamp>-<figure>.png, and a stable copy in
bench/plots/ for the README after a full run), and prints the tables at the end.

The whole run is bounded too (TOTAL_S: 38 minutes, quick 4): a part gets its own budget or what is left of
the run's, whichever is less, so the run ends in time even when a part before it took its whole budget.
Tables of a part with an anchor (ANCHORS: upstream kube-proxy's iptables mode) are followed by the same
numbers divided by the anchor's at each size.

A new part (lab modes, the IPVS guest, upstream kube-proxy) is one module and one line in PARTS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import controlplane, guest, latency, maglev, nodeport, packet, restarts, sched, sockpath, udpsnat
from bench.core import (
    REPO,
    BudgetExceeded,
    Deadline,
    Measurement,
    Part,
    Recorder,
    plural,
    raise_on_sigterm,
    read_events,
)

# The order they run in: the run's bound (TOTAL_S) cuts the last one short first (maglev, seconds of
# arithmetic, goes first so it never is; restarts, which has its own target, `make bench-restarts`, last).
PARTS: dict[str, Part] = {p.name: p for p in (maglev.PART, packet.PART, sockpath.PART, sched.PART, latency.PART,
                                               nodeport.PART, controlplane.PART, guest.PART, udpsnat.PART,
                                               restarts.PART)}
# Series every other series of the same part is divided by, in an extra table per metric.
ANCHORS = {"latency": controlplane.ANCHOR, "nodeport": controlplane.ANCHOR,
           "controlplane": f"{controlplane.ANCHOR} (API server)", "guest": guest.ANCHOR}
RESULTS = REPO / "bench" / "results"
PLOTS = REPO / "bench" / "plots"
# Seconds a part gets after SIGTERM to tear down before SIGKILL; counted in the run's bound.
GRACE = {True: 12.0, False: 30.0}
# What a part keeps of its budget for its own teardown (so it stops itself before the harness must).
RESERVE = {True: 8.0, False: 20.0}
# The whole run's bound, `make bench` (under 39 minutes) and `make bench-quick` (under 4), with room for
# the harness itself and the plots (udpsnat's budget, 240 s and 70 s, added to the 34 and 3 minutes before it).
TOTAL_S = {True: 240.0, False: 2280.0}
# A part with less than this left of the run's bound is not started.
MIN_PART_S = 20.0


# ----------------------------------------------------------------------------------------------- machine


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _git(*args: str) -> str:
    # Read-only: --no-optional-locks keeps `status` from refreshing (writing) the index.
    cp = subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=30, check=False)
    return cp.stdout.strip() if cp.returncode == 0 else ""


def machine_facts() -> dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown")
    meminfo = {line.split(":")[0]: line.split()[1] for line in _read("/proc/meminfo").splitlines() if ":" in line}
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "kernel": platform.release(),
        "kernel_version": platform.version(),
        "cpu_model": model,
        "cores": os.cpu_count(),
        "memory_gib": round(int(meminfo.get("MemTotal", "0")) / 2**20, 1),
        "clocksource": _read("/sys/devices/system/clocksource/clocksource0/current_clocksource").strip(),
        "python": platform.python_version(),
        "pyproxy_commit": commit,
        "pyproxy_dirty": dirty,
        "loadavg_start": _read("/proc/loadavg").split()[:3],
    }


def machine_line(m: Mapping[str, Any], run_id: str, quick: bool) -> str:
    commit = (m.get("pyproxy_commit") or "unknown")[:10] + ("+changes" if m.get("pyproxy_dirty") else "")
    return (f"{m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']} | "
            f"pyproxy {commit} | run {run_id}{' (quick)' if quick else ''}")


# ----------------------------------------------------------------------------------------------- parts


def child_main(name: str, quick: bool, events: Path, budget: float) -> int:
    """Inside the part's own process: run it, streaming its events to `events`."""
    raise_on_sigterm()
    part = PARTS[name]
    p = part.params(quick)
    with open(events, "a") as out:
        rec = Recorder(name, out)
        for key, value in p.items():
            rec.param(key, value)
        try:
            part.run(p, rec, Deadline(budget - RESERVE[quick]))
        except BudgetExceeded:
            return 3
        except Exception as exc:  # noqa: BLE001 - reported as the part's failure, with its traceback
            traceback.print_exc()
            out.write(json.dumps({"event": "error", "text": f"{type(exc).__name__}: {exc}"}) + "\n")
            return 1
    return 0


def _error_of(events: Path) -> str:
    for line in reversed(events.read_text().splitlines() if events.exists() else []):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "error":
            return str(ev["text"])
    return ""


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the part's process group (it tears down its labs), SIGKILL after `grace` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_part(part: Part, quick: bool, workdir: Path, budget: float) -> dict[str, Any]:
    events = workdir / f"{part.name}.jsonl"
    argv = [sys.executable, "-m", "bench.run", "--child", part.name, "--events", str(events),
            "--budget", f"{part.name}={budget}"]
    if quick:
        argv.append("--quick")
    started = time.monotonic()
    print(f"== {part.title}: budget {budget:.0f} s", file=sys.stderr, flush=True)
    # Its own session: the whole group can be signalled; stdout goes to our stderr, keeping stdout for tables.
    proc = subprocess.Popen(argv, cwd=REPO, stdout=sys.stderr, start_new_session=True)
    finished = True
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        finished = False
        stop_group(proc, GRACE[quick])
    except BaseException:  # Ctrl-C: the part (its own session, so it got no SIGINT) still tears down
        stop_group(proc, GRACE[quick])
        raise
    seconds = time.monotonic() - started
    folded = read_events(events)
    if not finished or proc.returncode == 3:
        status = f"did not finish within its budget of {budget:.0f} s (running: {folded['last_step']})"
    elif proc.returncode != 0:
        status = f"failed (exit {proc.returncode}): {_error_of(events) or 'see the log above'}"
    else:
        status = "ok"
    return {"title": part.title, "status": status, "seconds": round(seconds, 1), "budget_s": budget,
            "loadavg_end": _read("/proc/loadavg").split()[:3], **folded}


# ----------------------------------------------------------------------------------------------- report


def _cell(m: Mapping[str, Any]) -> str:
    if m["value"] is None:
        if m["note"].startswith(("not run", "not served")):
            return str(m["note"])
        return f"did not finish{': ' + m['note'] if m['note'] else ''}"
    v = float(m["value"])
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{text} {m['unit']}" + (f" ({m['note']})" if m["note"] else "")


def markdown(result: Mapping[str, Any]) -> str:
    out = [f"# pyproxy benchmark, run {result['run']}{' (quick)' if result['quick'] else ''}", "",
           f"Machine: {result['machine_line']}; load average at the start "
           f"{' '.join(result['machine'].get('loadavg_start', []))} (a shared machine adds noise).", ""]
    for name, pr in result["parts"].items():
        part = PARTS[name]
        out += [f"## {pr['title']}", "", f"Status: {pr['status']}, {pr['seconds']:.0f} s "
                f"(budget {pr['budget_s']:.0f} s). Parameters: {json.dumps(pr['params'])}", ""]
        ms = pr["measurements"]
        for metric in [*part.metrics, *sorted({m["metric"] for m in ms} - set(part.metrics))]:
            rows = [m for m in ms if m["metric"] == metric]
            if not rows:
                continue
            sizes = sorted({m["services"] for m in rows})
            series = list(dict.fromkeys(m["series"] for m in rows))
            out += [f"### {part.metrics.get(metric, metric)}", "",
                    "| series | " + " | ".join(plural(s, part.size_word) for s in sizes) + " |",
                    "|---|" + "---|" * len(sizes)]
            for s in series:
                cells = {m["services"]: _cell(m) for m in rows if m["series"] == s}
                out.append(f"| {s} | " + " | ".join(cells.get(n, "") for n in sizes) + " |")
            out.append("")
            out += ratio_table(rows, ANCHORS.get(name), sizes, series, part.size_word)
        if part.summary is not None:
            out += part.summary(ms)
        out += [f"- {note}" for note in pr["notes"]]
        out.append("")
    return "\n".join(out)


def ratio_table(rows: Sequence[Mapping[str, Any]], anchor: str | None, sizes: Sequence[int],
                series: Sequence[str], size_word: str = "Service") -> list[str]:
    """The rows divided by the anchor series' value at the same size (none when it has no value there)."""
    base = {m["services"]: m["value"] for m in rows if m["series"] == anchor and m["value"]}
    if not base:
        return []
    out = [f"Ratio to {anchor} at the same number of {size_word}s:", "",
           "| series | " + " | ".join(plural(s, size_word) for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    lines = []
    for s in series:
        values = {m["services"]: m["value"] for m in rows if m["series"] == s}
        cells = [f"{values[n] / base[n]:.2g}x" if values.get(n) is not None and n in base else "" for n in sizes]
        if s != anchor and any(cells):
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return [*out, *lines, ""] if lines else []


def write_plots(result: Mapping[str, Any], folder: Path, stable: bool) -> list[Path]:
    """A PNG per figure beside the run's JSON in `folder`; with `stable`, also copied to bench/plots/."""
    try:
        from bench import plots
    except ImportError as exc:  # matplotlib is in the `bench` extra
        print(f"no plots: {exc} (pip install -e '.[bench]')", file=sys.stderr)
        return []
    written = []
    for name, pr in result["parts"].items():
        ms = [Measurement(**m) for m in pr["measurements"]]
        for fig in PARTS[name].figures:
            path = folder / f"{result['run']}-{fig.name}.png"
            if plots.render(fig, ms, result["machine_line"], path):
                written.append(path)
                stable_path = PLOTS / f"{fig.name}.png"
                if stable or not stable_path.exists():
                    PLOTS.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, stable_path)
                    written.append(stable_path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, under 4 minutes in all")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                    help="override a part's time budget (e.g. to see how a part reports 'did not finish')")
    ap.add_argument("--replot", type=Path, metavar="RUN.json",
                    help="only redraw the plots and reprint the tables of a finished run")
    ap.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    budgets = {name: part.budget_s[args.quick] for name, part in PARTS.items()}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--budget {item!r}: want PART=SECONDS with PART one of {', '.join(PARTS)}")
        budgets[name] = float(seconds)
    if args.child:
        return child_main(args.child, args.quick, args.events, budgets[args.child])
    if args.replot:
        done = json.loads(args.replot.read_text())
        args.replot.with_suffix(".md").write_text(markdown(done) + "\n")
        print(markdown(done))
        print("plots: " + ", ".join(str(p) for p in write_plots(done, args.replot.parent, stable=not done["quick"])))
        return 0
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    if os.geteuid() != 0 and any(PARTS[n].needs_root for n in names):
        print("bench: needs root (BPF, network namespaces)", file=sys.stderr)
        return 2

    started = datetime.now(UTC)
    run_id = started.strftime("%Y%m%dT%H%M%SZ")
    machine = machine_facts()
    result: dict[str, Any] = {"run": run_id, "quick": args.quick, "started": started.isoformat(),
                              "machine": machine, "machine_line": machine_line(machine, run_id, args.quick),
                              "parts": {}}
    workdir = args.results / f".{run_id}"
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        for name in names:
            left = TOTAL_S[args.quick] - (time.monotonic() - t0) - GRACE[args.quick]
            if left < MIN_PART_S:
                result["parts"][name] = {"title": PARTS[name].title, "seconds": 0.0, "budget_s": 0.0,
                                         "status": f"not run: {max(0.0, left):.0f} s left of the run's bound "
                                                   f"of {TOTAL_S[args.quick]:.0f} s",
                                         **read_events(workdir / "none")}
                continue
            result["parts"][name] = run_part(PARTS[name], args.quick, workdir, min(budgets[name], left))
    finally:
        result["seconds"] = round(time.monotonic() - t0, 1)
        path = args.results / f"{run_id}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        shutil.rmtree(workdir, ignore_errors=True)
    table = markdown(result)
    (args.results / f"{run_id}.md").write_text(table + "\n")
    # The README's plots come from full runs kept in bench/results/, not from a scratch folder's.
    plots_written = write_plots(result, args.results, stable=not args.quick and args.results.resolve() == RESULTS)
    print(table)
    plots_named = ", ".join(os.path.relpath(p, REPO) for p in plots_written)
    print(f"results: {os.path.relpath(path, REPO)}; plots: {plots_named}")
    print(f"total {result['seconds']:.0f} s")
    return 0 if all(pr["status"] == "ok" for pr in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
