"""One table of scheduler cases, the `pyproxy.io/scheduler` and `pyproxy.io/weights` annotations measured with
real connections: every mode that has schedulers runs it in a namespace lab against a running pyproxy. The
netfilter modes (iptables, nftables) have none (they pick at random whatever a Service asks) and do not run it;
ipvs runs it in the qemu guest (tests/guest_ipvs), bpf in the host's lab.

    lab = Lab(3, client_addresses=CLIENT_ADDRESSES)      # b1..b3 serving TCP 8080 (lab.start_servers)
    write the cluster: manifests()                        # one Service per scheduler, and one with affinity
    start pyproxy in `mode` on it
    wrong = mismatches(lab, mode, update=rewrite)         # [] = every case did what `mode` must

`update(text)` rewrites the manifest file the table was started on (the maglev case removes an endpoint and puts
it back); without it that half of the maglev case is not run. The node's default scheduler runs the same checks
on the same Services without their scheduler annotation: manifests(annotated=False), then for each scheduler X
of the mode a pyproxy with the node's default X (--ipvs-scheduler=X) and
mismatches(lab, mode, schedulers=[X], annotated=False).

What each scheduler must show a client (the expectations of issue 11), with the modes that run it in `MODES`:
- random: over many flows every backend answers (bpf only: IPVS has no uniform random choice; the ipvs mode
  uses its node's scheduler for such a Service and says so in its log);
- rr: per-backend counts of sequential new connections within one of each other;
- wrr (weights 3, 1, 0): counts proportional to the weights within one, weight 0 never;
- lc, sed, nq: while one backend holds connections that stay open, new flows go to the others only (nq: an
  idle backend first, sed and lc: the one with the fewest connections);
- sh (b3 of weight 0): one client address always lands on one backend, several addresses spread over more
  than one, none on b3;
- dh: every flow to the frontend lands on one backend (it hashes the destination, the same for all);
- maglev: a flow key, a fixed source address and port, always lands on one backend (bpf's Maglev hashes the
  5-tuple, IPVS's mh the source address: a fixed key is the same flow for both), keys spread over more than
  one backend; after one backend leaves, only the keys that were on it move;
- every scheduler with ClientIP affinity: each client address sticks to one backend, never one of weight 0.

Lab addressing as tests/flowcases.py's: backends bI at 10.201.I.2; the client's addresses `Lab.client_ips`
(10.200.0.2 and CLIENT_ADDRESSES more). Services at 10.96.30.0/24 (one per scheduler), 10.96.31.0/24 (the same
with ClientIP affinity), a witness Service at WITNESS_IP whose endpoint an update switches, so the table knows
the sync that applied it has run.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.manifests import Port, documents, endpoint_slice, service

from pyproxy.model.objects import SCHEDULER_ANNOTATION, SCHEDULERS, WEIGHTS_ANNOTATION

B1, B2, B3 = "10.201.1.2", "10.201.2.2", "10.201.3.2"
BACKENDS = (B1, B2, B3)
HTTP = Port("http", 80, 8080)
NAMES = {B1: "b1:8080", B2: "b2:8080", B3: "b3:8080"}
"""What each backend answers on HTTP's target port (labkit.traffic's reply)."""
WRR_WEIGHTS = {B1: 3, B2: 1, B3: 0}
WEIGHTS: Mapping[str, Mapping[str, int]] = {"wrr": WRR_WEIGHTS, "sh": {B3: 0}}
"""The Services' `pyproxy.io/weights` (1 for an endpoint not named). sh's quiesced b3: the clients a hash would
give it must go to another endpoint, never be refused (IPVS: sh-fallback)."""
CLIENT_ADDRESSES = 10
"""The client's addresses beyond its first that the lab must have (Lab(client_addresses=...))."""
WITNESS_IP = "10.96.30.100"
FLOW_PORTS = (40101, 40102)
"""The fixed source ports of the maglev case's flow keys."""
TIMEOUT = 2.0
"""Seconds a request may take: the IPVS guest is emulated."""
ALL_MODES = frozenset({"bpf", "ipvs"})
MODES: Mapping[str, frozenset[str]] = {name: ALL_MODES for name in SCHEDULERS} | {"random": frozenset({"bpf"})}
"""Which modes run each scheduler's case (the netfilter modes have no schedulers)."""


def service_ip(scheduler: str) -> str:
    return f"10.96.30.{SCHEDULERS.index(scheduler) + 1}"


def sticky_ip(scheduler: str) -> str:
    return f"10.96.31.{SCHEDULERS.index(scheduler) + 1}"


def manifests(annotated: bool = True, *, removed: Mapping[str, str] | None = None, witness: str = B1) -> str:
    """The table's cluster: per scheduler `sched-X` and `sticky-X` (ClientIP affinity), each with b1..b3 (but
    `removed`: scheduler -> an endpoint left out), annotated with X unless not `annotated` (the node's default
    then decides), and with its WEIGHTS either way. The witness Service's one endpoint is `witness`."""
    docs = []
    for name in SCHEDULERS:
        notes = {SCHEDULER_ANNOTATION: name} if annotated else {}
        if name in WEIGHTS:
            notes[WEIGHTS_ANNOTATION] = ",".join(f"{ip}={w}" for ip, w in WEIGHTS[name].items())
        endpoints: dict[str, bool | None] = {ip: True for ip in BACKENDS if ip != (removed or {}).get(name)}
        docs += [service(f"sched-{name}", service_ip(name), [HTTP], annotations=notes),
                 endpoint_slice(f"sched-{name}", endpoints, [HTTP]),
                 service(f"sticky-{name}", sticky_ip(name), [HTTP], affinity_seconds=600, annotations=notes),
                 endpoint_slice(f"sticky-{name}", {ip: True for ip in BACKENDS}, [HTTP])]
    docs += [service("sched-witness", WITNESS_IP, [HTTP]), endpoint_slice("sched-witness", {witness: True}, [HTTP])]
    return documents(*docs)


@dataclass(frozen=True)
class Run:
    lab: Any
    """A started labkit.Lab with CLIENT_ADDRESSES more client addresses and servers on TCP 8080."""
    annotated: bool
    update: Callable[[str], None] | None
    seen: list[str] = field(default_factory=list)
    """Every probe's answers and duration, for the caller's log."""

    def probe(self, ip: str, count: int, *, sources: Sequence[str] = (),
              source_ports: Sequence[int] = ()) -> dict[str, Any]:
        result: dict[str, Any] = self.lab.probe("tcp", ip, 80, count, timeout=TIMEOUT, max_failures=3,
                                                sources=sources, source_ports=source_ports)
        self.seen.append(f"{ip}: {count} flows in {result['elapsed']}s, {result['replies']}"
                         + (f", failed {result['errors']}" if result["failures"] else ""))
        return result


def _failed(result: Mapping[str, Any]) -> list[str]:
    return [f"{result['failures']} of {result['count']} flows failed: {result['errors']}"] if result["failures"] else []


def _counts(result: Mapping[str, Any]) -> dict[str, int]:
    return {NAMES[ip]: result["replies"].get(NAMES[ip], 0) for ip in BACKENDS}


def check_random(run: Run, ip: str) -> list[str]:
    result = run.probe(ip, 30)
    # Uniform: a backend misses all 30 flows with probability 3 * (2/3)^30, about 1e-5.
    missing = [n for n, c in _counts(result).items() if not c]
    return _failed(result) or ([f"no flow reached {missing}: {result['replies']}"] if missing else [])


def check_rr(run: Run, ip: str) -> list[str]:
    result = run.probe(ip, 10 * len(BACKENDS))
    counts = _counts(result)
    uneven = max(counts.values()) - min(counts.values()) > 1
    return _failed(result) or ([f"counts differ by more than 1: {counts}"] if uneven else [])


def check_wrr(run: Run, ip: str) -> list[str]:
    rounds = 8
    per_round = sum(WRR_WEIGHTS.values())
    result = run.probe(ip, rounds * per_round)
    counts = _counts(result)
    # Where the sequence starts is the scheduler's state: one flow more or less than a whole number of rounds.
    off = {NAMES[b]: (counts[NAMES[b]], rounds * w) for b, w in WRR_WEIGHTS.items()
           if abs(counts[NAMES[b]] - rounds * w) > (1 if w else 0)}
    return _failed(result) or ([f"counts {counts}, not the weights' {WRR_WEIGHTS} (seen, expected): {off}"]
                               if off else [])


def _hold(run: Run, ip: str, count: int) -> tuple[subprocess.Popen[str], list[str | None]]:
    holder = run.lab.popen(run.lab.client, sys.executable, "-m", "labkit.traffic", "hold", ip, "80",
                           "--count", str(count), "--timeout", str(TIMEOUT), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return holder, _answer(holder, 60.0)


def _answer(holder: subprocess.Popen[str], deadline: float) -> list[str | None]:
    assert holder.stdout is not None
    ready, _, _ = select.select([holder.stdout], [], [], deadline)
    line = holder.stdout.readline() if ready else ""
    return list(json.loads(line)) if line else []


def check_least(run: Run, ip: str) -> list[str]:
    """lc, sed and nq: a backend that holds open connections gets no new flow while another has none."""
    holder, answers = _hold(run, ip, 6)
    try:
        named = [a for a in answers if a]
        if len(named) != 6:
            return [f"holding 6 connections: answered {answers}"]
        busy = Counter(named).most_common(1)[0][0]
        assert holder.stdin is not None
        holder.stdin.write(f"keep {busy}\n")
        holder.stdin.flush()
        kept = _answer(holder, 30.0)
        if not kept or any(k != busy for k in kept):
            return [f"the connections held to {busy} did not stay open: {kept}"]
        result = run.probe(ip, 20)
        if busy in result["replies"]:
            return [f"{result['replies'][busy]} of 20 new flows went to {busy}, which holds {len(kept)} "
                    f"connections while the others hold none: {result['replies']}"]
        return _failed(result)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()  # resets the held connections
        holder.wait(timeout=30)


def _one_each(result: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Per source (address, or address:port) its one backend; a problem for each source that saw more."""
    where, problems = {}, []
    for key, answers in result["by_source"].items():
        if len(answers) != 1 or "failed" in answers:
            problems.append(f"{key} reached {answers}")
        else:
            where[key] = next(iter(answers))
    return where, problems


def _quiesced(scheduler: str, result: Mapping[str, Any]) -> list[str]:
    """A problem when a flow reached an endpoint of weight 0."""
    zero = {NAMES[b] for b, w in WEIGHTS.get(scheduler, {}).items() if not w}
    reached = {n: c for n, c in result["replies"].items() if n in zero}
    return [f"flows reached {reached}, of weight 0"] if reached else []


def check_sh(run: Run, ip: str) -> list[str]:
    sources = run.lab.client_ips
    result = run.probe(ip, 3 * len(sources), sources=sources)
    where, problems = _one_each(result)
    if not problems and len(set(where.values())) < 2:
        problems.append(f"{len(sources)} client addresses all went to {set(where.values())}")
    return problems + _quiesced("sh", result)


def check_dh(run: Run, ip: str) -> list[str]:
    result = run.probe(ip, 12, sources=run.lab.client_ips[:4])
    return _failed(result) or ([f"flows reached {result['replies']}, not one backend"]
                               if len(result["replies"]) != 1 else [])


def _wait_witness(run: Run, name: str, deadline: float = 60.0) -> list[str]:
    end = time.monotonic() + deadline
    while True:
        result = run.probe(WITNESS_IP, 3)
        if set(result["replies"]) == {name} and not result["failures"]:
            return []
        if time.monotonic() >= end:
            return [f"the update was not applied within {deadline:g}s: the witness answers {result['replies']}"]
        time.sleep(0.5)


def check_maglev(run: Run, ip: str) -> list[str]:
    sources = run.lab.client_ips
    keys = len(sources) * len(FLOW_PORTS)
    before, problems = _one_each(run.probe(ip, 2 * keys, sources=sources, source_ports=FLOW_PORTS))
    if problems:
        return problems
    if len(set(before.values())) < 2:
        return [f"{keys} flow keys all went to {set(before.values())}"]
    if run.update is None:
        return []
    # The backend with the most keys leaves: the most flows that must move, and the others' must not.
    gone_name = Counter(before.values()).most_common(1)[0][0]
    gone = next(b for b, n in NAMES.items() if n == gone_name)
    run.update(manifests(run.annotated, removed={"maglev": gone}, witness=B2))
    problems = _moved(run, ip, before, gone_name)
    run.update(manifests(run.annotated))
    return problems + _wait_witness(run, NAMES[B1])


def _moved(run: Run, ip: str, before: Mapping[str, str], gone_name: str) -> list[str]:
    """What went wrong once `gone_name` left (the witness tells when): a key that was elsewhere moved, or one
    that was on it still reaches it or no backend."""
    problems = _wait_witness(run, NAMES[B2])
    if problems:
        return problems
    after, problems = _one_each(run.probe(ip, len(before), sources=run.lab.client_ips, source_ports=FLOW_PORTS))
    moved = {k: (b, after.get(k)) for k, b in before.items() if b != gone_name and after.get(k) != b}
    if moved:
        problems.append(f"after {gone_name} left, flows that were elsewhere moved (before, after): {moved}")
    stayed = [k for k, b in before.items() if b == gone_name and after.get(k) == gone_name]
    if stayed:
        problems.append(f"flows still reach {gone_name} after it left: {stayed}")
    return problems


def check_sticky(run: Run, scheduler: str, ip: str) -> list[str]:
    sources = run.lab.client_ips[:3]
    result = run.probe(ip, 5 * len(sources), sources=sources)
    return _one_each(result)[1] + _quiesced(scheduler, result)


CHECKS: Mapping[str, Callable[[Run, str], list[str]]] = {
    "random": check_random, "rr": check_rr, "wrr": check_wrr, "lc": check_least, "sed": check_least,
    "nq": check_least, "sh": check_sh, "dh": check_dh, "maglev": check_maglev,
}


def mismatches(lab: Any, mode: str, *, schedulers: Iterable[str] | None = None, annotated: bool = True,
               update: Callable[[str], None] | None = None, seen: list[str] | None = None) -> list[str]:
    """Run the cases of `schedulers` (default: every one `mode` runs, `MODES`) with real flows in `lab` (a
    started labkit.Lab with CLIENT_ADDRESSES more client addresses, servers on TCP 8080, and pyproxy in
    `mode` on `manifests(annotated)`; with `annotated` False, on the node's default scheduler, which must be
    the one case's named). What went wrong, one line each: [] when all did what they must. `seen` gets a line
    per probe (its answers per backend and how long it took)."""
    run = Run(lab, annotated, update, seen if seen is not None else [])
    wrong = []
    chosen = [s for s in SCHEDULERS if mode in MODES[s]] if schedulers is None else list(schedulers)
    # maglev last: it rewrites the manifests, and waits for them to be put back.
    for name in sorted(chosen, key=lambda s: s == "maglev"):
        which = "annotated" if annotated else "the node's default"
        wrong += [f"{name} ({which}) {service_ip(name)}: {p}" for p in CHECKS[name](run, service_ip(name))]
        wrong += [f"{name} ({which}) with ClientIP affinity {sticky_ip(name)}: {p}"
                  for p in check_sticky(run, name, sticky_ip(name))]
    return wrong
