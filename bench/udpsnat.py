"""UDP single exchanges through SNAT (issue 25): the rate of DNS-like traffic a NodePort whose endpoint is on
another node carries before its answers start to fail, bpf and nftables mode side by side.

Set-up. Per mode a two-node lab of its own (labkit.Lab with remote_backends=1, distro=True): the client
outside the cluster, node 1 running pyproxy as lab-node, the pod r1 behind node2 (lab-node-2), which has no route
to the client: every exchange is DNATed to r1 and SNATed to node 1's address on the node2 link. One Service, type
NodePort, UDP 53 -> r1:5353 (the lab's echo server), externalTrafficPolicy Cluster. The modes' labs are started
one after the other and then ramped at the same time (what is measured is a share answered, not a speed: the
clients' pacing is checked instead, below).

Load (tests/flowstress.py udp-paced, run in the client): single exchanges, one query and its answer, each from a
source port fresh in the whole ramp (never reused, so every query is a new flow: what DNS clients behind a NAT
send), paced at a fixed rate; a query without its answer within `timeout_s` counts as failed. The rate rises in
steps of `step_s` seconds (`rates`), each step a client run of its own, the flows of earlier steps still held by
the dataplane (a ramp, not separate trials: what the flow table holds at a step is what the earlier steps left in
it). A step answered below `stop_below_pct` ends the mode's ramp. For each step: the share answered; the rate at
which answers start to fail is the first step under 99.9 % (the summary table), the threshold lying between it
and the step before.

What bounds it in bpf mode: the SNAT ports (--bpf-snat-port-range, 4,536 by default) per node address, backend and
protocol, each held while its flow lives (today a replied UDP flow lives 120 s, --conntrack-udp-timeout-stream;
the kernel keeps a single exchange 30 s). A flow that finds no free port in 32 random tries is dropped (counter
snat_no_port, in each step's detail). So the rate at which bpf fails depends on what the ramp's earlier steps
still hold: this ramp's number, not a sustained rate (sustained, a pool of P ports held H seconds a flow carries
under about 0.8 P / H a second: 30/s at 120 s, 120/s at 30 s). With 15 s steps the full ramp tells the two holds
apart: held 120 s, the ports of every step so far add up (2,700 after the 70/s step, 4,200 after the 100/s one:
misses begin there); held 30 s, only the last two steps' count (2,550 at 100/s, 3,600 at 140/s, where the 32
tries may first miss, 5,100 at 200/s: out of ports). nftables SNATs with the kernel's NAT, which keeps the
client's source port where it is free: fresh client ports never run out.
The client is Python: a step whose sends lagged their schedule (late_ms in its detail) offered less than its rate
at the time; the notes say where that happened.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowstress import answered_pct, run_json
from labkit import Lab, Pyproxy, write_manifest
from labkit.manifests import Port, documents, endpoint_slice, service
from labkit.netns import NODE_CLIENT_IP, REMOTE_NODE_NAME, remote_backend_ip

from bench.core import Deadline, Figure, Measurement, Panel, Part, Recorder

NODE_NAME = "lab-node"
SERVICE_IP = "10.96.25.53"
DNS = Port("dns", 53, 5353, "UDP", node_port=30153)
MODES = ("bpf", "nftables")
ANSWERED_MIN_PCT = 99.9
FIRST_PORT = 1024
"""The ramp's source ports run from here up, each used once (55,500 in the full ramp)."""
LATE_MS = 100.0
"""A step whose sends were this late (p99) did not offer its rate: noted."""


def manifests() -> str:
    r1 = remote_backend_ip(1)
    return documents(service("dns-remote", SERVICE_IP, [DNS], type="NodePort"),
                     endpoint_slice("dns-remote", {r1: True}, [DNS], node_names={r1: REMOTE_NODE_NAME}))


def bpf_counters(proxy: Pyproxy) -> dict[str, int]:
    view = json.loads(proxy.lab.python(proxy.lab.node, "-m", "pyproxy", "inspect", "--no-flows", "-o", "json",
                                       f"--bpf-pin-path={proxy.pin_path}", timeout=60).stdout)
    return {k: int(view["counters"].get(k, 0)) for k in ("snat", "snat_no_port")}


def served(lab: Lab) -> None:
    """Until the NodePort answers (the proxy's first sync), bounded."""
    for _ in range(20):
        if not lab.probe("udp", NODE_CLIENT_IP, DNS.node_port, 3, timeout=0.5)["failures"]:
            return
    raise RuntimeError("the NodePort does not answer")


@contextlib.contextmanager
def mode_lab(mode: str) -> Iterator[tuple[Lab, Pyproxy]]:
    """A lab of its own with pyproxy in `mode` serving the NodePort; both gone at the end."""
    with Lab(0, prefix="pus", remote_backends=1, distro=True) as lab:
        lab.start_servers(udp=[DNS.backend_port])
        source = lab.workdir / "manifests"
        source.mkdir()
        write_manifest(source, "dns.yaml", manifests())
        proxy = Pyproxy(lab, source, log_path=lab.workdir / "pyproxy.log", mode=mode,
                        extra_args=[f"--hostname-override={NODE_NAME}"])
        try:
            proxy.start()
            proxy.wait_healthy(30.0)
            served(lab)
            yield lab, proxy
        finally:
            proxy.close()


def ramp(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, mode: str, lab: Lab, proxy: Pyproxy,
         lock: threading.Lock) -> None:
    """One mode's ramp, a Measurement per step (`lock` around the recorder: the modes ramp at the same time)."""
    port = FIRST_PORT
    before = bpf_counters(proxy) if mode == "bpf" else {}
    step_s = float(p["step_s"])
    for rate in p["rates"]:
        if deadline.remaining() < step_s + p["timeout_s"] + 3:  # the step, its last answers, the client's start
            with lock:
                rec.add(Measurement("answered_pct", mode, mode, rate, None, "%", "out of time"))
            return
        with lock:
            rec.step(f"{mode}: {rate} single exchanges/s for {step_s:g} s")
        out = run_json(lab, lab.client, "udp-paced", NODE_CLIENT_IP, str(DNS.node_port), "--rate", str(rate),
                       "--seconds", str(step_s), "--timeout", str(p["timeout_s"]), "--first-port", str(port),
                       "--last-port", "65535", "--window", str(step_s), timeout=step_s + 60)
        port = out["ports"][1] + 1
        pct = answered_pct(out["sent"], out["answered"])
        detail = {k: out[k] for k in ("sent", "answered", "errors", "late_ms", "seconds")}
        if mode == "bpf":
            after = bpf_counters(proxy)
            detail["counters"] = {k: after[k] - before[k] for k in after}
            before = after
        late = out["late_ms"]["p99"] > LATE_MS
        with lock:
            if late:
                rec.note(f"{mode} at {rate}/s: the client's sends lagged (p99 {out['late_ms']['p99']} ms)")
            rec.add(Measurement("answered_pct", mode, mode, rate, round(pct, 3), "%",
                                f"{out['answered']:,}/{out['sent']:,}" + (", client lagged" if late else ""), detail))
            rec.add(Measurement("answered_per_s", mode, mode, rate, round(out["answered"] / step_s, 1), "/s"))
        if pct < p["stop_below_pct"]:
            return


def summary(measurements: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rate at which each mode's answers start to fail: a Markdown table."""
    out = [f"Where answers start to fail (first step under {ANSWERED_MIN_PCT} %):", "",
           "| mode | answers start to fail at | answered there | last step all but 0.1 % answered |",
           "|---|---|---|---|"]
    ramped = {m["series"] for m in measurements if m["metric"] == "answered_pct"}
    for mode in [*(m for m in MODES if m in ramped), *sorted(ramped - set(MODES))]:
        steps = sorted((m["services"], m["value"]) for m in measurements
                       if m["metric"] == "answered_pct" and m["series"] == mode and m["value"] is not None)
        failing = next(((r, v) for r, v in steps if v < ANSWERED_MIN_PCT), None)
        passing = [r for r, v in steps if v >= ANSWERED_MIN_PCT and (failing is None or r < failing[0])]
        top = steps[-1][0] if steps else 0
        first = f"{failing[0]:,}/s" if failing else f"none up to {top:,}/s"
        there = f"{failing[1]:.4g} %" if failing else ""
        out.append(f"| {mode} | {first} | {there} | {f'{passing[-1]:,}/s' if passing else 'none'} |")
    return [*out, ""]


def params(quick: bool) -> dict[str, Any]:
    common = {"modes": list(MODES), "timeout_s": 2.0, "stop_below_pct": 50.0}
    if quick:
        return {**common, "rates": [100, 200, 400, 800], "step_s": 5.0}
    # About x1.4 a step up to 400 (even on the plots' log axis), then doubling.
    return {**common, "rates": [25, 35, 50, 70, 100, 140, 200, 280, 400, 800, 1600], "step_s": 15.0}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    rec.note(f"External client -> node 10.200.0.1:{DNS.node_port}/udp (NodePort, externalTrafficPolicy Cluster) -> "
             f"r1 behind node 2 (no route back to the client: DNAT and SNAT on the node). Single UDP exchanges, "
             f"each from a fresh source port, paced, in rising steps of {p['step_s']:g} s (the flows of earlier "
             f"steps still held), a {p['timeout_s']:g} s answer timeout; a mode's ramp ends after a step answered "
             f"under {p['stop_below_pct']:g} %. bpf's SNAT pool: 4,536 ports per node address, backend and protocol.")
    lock = threading.Lock()
    with contextlib.ExitStack() as stack:
        # Started one after the other (only the main thread may start the labs' processes, Lab.popen), then
        # ramped at the same time, each mode its own lab, node and client.
        labs = {mode: stack.enter_context(mode_lab(mode)) for mode in p["modes"]}
        with ThreadPoolExecutor(len(labs)) as pool:
            for done in [pool.submit(ramp, p, rec, deadline, mode, *labs[mode], lock) for mode in labs]:
                done.result()


PART = Part(
    name="udpsnat",
    title="UDP single exchanges through SNAT: the rate at which answers start to fail",
    # The modes ramp at the same time. Full: nftables runs all 11 steps (about 180 s), bpf stops after 125/s
    # today; with the two labs and pyproxies (some 12 s), about 200 s. Quick: 4 steps of 5 s (about 45 s).
    budget_s={True: 70.0, False: 240.0},
    params=params,
    run=run,
    figures=(
        Figure("udp_snat", "Single UDP exchanges from fresh source ports through a NodePort to another node (SNAT), "
               "namespace lab", (
                   Panel("answered_pct", "% answered", "share of each step's exchanges answered (rising rate)"),
                   Panel("answered_per_s", "answered exchanges/s", "answers a second (offered: the x axis)", logy=True),
               ), xlabel="offered rate (single exchanges/s, each step's own)"),
    ),
    metrics={"answered_pct": "share of the step's single exchanges answered, %, by offered rate",
             "answered_per_s": "answered single exchanges a second, by offered rate"},
    size_word="exchanges/s",
    summary=summary,
)
