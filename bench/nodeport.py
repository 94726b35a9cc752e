"""New-connection latency and rate from an external client through a NodePort to endpoints on another node, so
the node both DNATs and SNATs (masquerade): every dataplane side by side, upstream kube-proxy v1.20.2's
iptables mode the anchor. The ClusterIP counterpart, whose method this part reuses, is bench/latency.py.

Set-up. A lab with `router="backends"`: the router namespace stands for node 2, and the 10 backends behind
it (connload servers on :8080) are node 2's pods. Node 2's route back to the client network (its default
route via this node) is removed: the client's address is unreachable from node 2, so a reply reaches the
client only if this node put its own address (10.198.0.1, on the node-2 link) as the source, as a real
cluster's pod network would only route pod and node addresses. The part checks that before measuring: two
hand-written nft rules on the node, the DNAT alone, get no answer through the NodePort; with the
masquerade rule beside it, they do. Those two rules are then measured as the floor (the least a
netfilter NAT of this path costs: conntrack, a DNAT and a masquerade), and flushed.

The Services are `type: NodePort`, externalTrafficPolicy Cluster, Service i on nodePort 30000 + i (so at most
2,768 of them, the API server's default range), created in the lab's real API server and followed by each
proxy through --kubeconfig. The client connects to the node's address on its own link, 10.200.0.1:<nodePort>,
of `targets` Services spread over the set (as in bench/latency.py). Each dataplane is started, waited for
until its ClusterIPs are programmed (the same checkers; NodePort rules are written in the same sync, and
bpf writes them in the same render), then probed through the NodePort: a dataplane that does not answer
there is reported "not served" and not run at larger sizes (every pyproxy mode serves NodePorts; upstream's do
too: the row is a guard against a broken run, not an expected outcome).
"bpf XDP" is bpf mode with the XDP program also on the client-facing device (--xdp-devices=to-client).

Load, CPU and the order of the series as in bench/latency.py (paced 1,000 conn/s for latency, closed loop of
4 for the rate and the lab's CPU per connection; the iptables-legacy ones last). One difference: all the
client's connections leave the node from one address, so the SNAT reuses source ports, and across runs
(conntrack is flushed between dataplanes) a reused port could meet a backend's TIME_WAIT of an earlier
connection and have its SYN answered wrongly and resent a second later. The backends therefore keep no
TIME_WAIT (net.ipv4.tcp_max_tw_buckets=0 in their namespaces; the servers close first, so only they would
hold it). Resent SYNs are counted per run all the same (in the notes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.cluster import Cluster
from labkit import Lab
from labkit.netns import NODE_CLIENT_IP

from bench import controlplane as cp
from bench import core, latency
from bench.core import Deadline, Figure, Panel, Part, Recorder
from bench.latency import LoadLab, Series, Size

NODE_PORT = 30000
"""Service i's nodePort is NODE_PORT + i."""
MAX_SERVICES = 32767 - NODE_PORT + 1
FLOOR = "floor: 2 nft rules, DNAT + masquerade"
# Those that leave nothing behind first, the iptables-legacy ones last (bench/latency.py's docstring).
ORDER = (FLOOR, "bpf", "bpf XDP", "nftables", "iptables-nft", "kube-proxy iptables-nft", "kube-proxy iptables-legacy",
         "iptables-legacy")
FLOOR_TABLE = "bench-floor"


def objects(first: int, last: int, namespace: str, slice_version: str,
            addresses: Mapping[int, Sequence[str]]) -> list[dict[str, Any]]:
    """bench/controlplane.py's Services first..last-1 and slices, the Services of type NodePort with
    externalTrafficPolicy Cluster on nodePort NODE_PORT + i."""
    if last > MAX_SERVICES:
        raise ValueError(f"{last:,} NodePort Services: the API server's range holds {MAX_SERVICES:,}")
    out = cp.objects(first, last, namespace, slice_version, addresses)
    for i, obj in zip(range(first, last), out[::2], strict=True):
        obj["spec"].update(type="NodePort", externalTrafficPolicy="Cluster")
        for port in obj["spec"]["ports"]:
            port["nodePort"] = NODE_PORT + i
    return out


# ---------------------------------------------------------------------------------------------- node 2


def isolate_node2(lab: Lab) -> None:
    """Node 2 (the router) forgets its way back to the client network; its pods keep no TIME_WAIT."""
    assert lab.router is not None
    lab.exec(lab.router, "ip", "route", "del", "default")
    for b in lab.backends:
        lab.sysctl(b.ns, {"net.ipv4.tcp_max_tw_buckets": 0})


def floor_rules(lab: Lab, masquerade: bool) -> str:
    """The floor's nft table: the NodePorts DNATed to the 10 backends at random, and with `masquerade` the
    DNATed connections SNATed to the node's address on the way out, ports fully random as upstream's
    `--random-fully` (masquerade keeping the client's port resent a few SYNs per run: all the client's
    addresses use the same ports in turn)."""
    backends = ", ".join(f"{k} : {b.ip}" for k, b in enumerate(lab.backends))
    post = ("chain post {\n type nat hook postrouting priority srcnat;\n ct status dnat masquerade fully-random\n}\n"
            if masquerade else "")
    return (f"table ip {FLOOR_TABLE} {{\nchain pre {{\n type nat hook prerouting priority dstnat;\n"
            f" fib daddr type local tcp dport {NODE_PORT}-32767 "
            f"dnat to numgen random mod {len(lab.backends)} map {{ {backends} }} : {core.BACKEND_PORT}\n}}\n"
            f"{post}}}\n")


def probe(loadlab: LoadLab, addresses: Sequence[str]) -> dict[str, Any]:
    """A short connload run to the addresses: 4 threads paced at 40 connections/s for 0.3 s, so that three
    connections start inside the measured window (the first thread's, at once, starts before it): its counts.
    A connection whose SYN gets no answer gives up after connload's 2 s and counts as an error."""
    return loadlab.load(addresses, 4, 40, 0.3, 0.0, None)


def answers(result: Mapping[str, Any]) -> bool:
    return bool(result["requests"]) and not result["errors"]


def check_snat_needed(lab: Lab, loadlab: LoadLab, addresses: Sequence[str], rec: Recorder, n: int) -> None:
    """The DNAT alone gets no answer through the NodePort, the DNAT with masquerade does: else the scenario
    does not measure what it claims. Leaves the node as it was."""
    try:
        lab.exec(lab.node, "nft", "-f", "-", input=floor_rules(lab, masquerade=False))
        without = probe(loadlab, addresses)
        lab.exec(lab.node, "nft", "delete", "table", "ip", FLOOR_TABLE)
        lab.exec(lab.node, "nft", "-f", "-", input=floor_rules(lab, masquerade=True))
        with_snat = probe(loadlab, addresses)
    finally:
        cp.reset_node(lab, legacy=False)
    rec.param(f"snat_check_at_{n}", {"dnat_only": {k: without[k] for k in ("requests", "errors")},
                                     "dnat_and_masquerade": {k: with_snat[k] for k in ("requests", "errors")}})
    if without["requests"] or not without["errors"]:
        raise RuntimeError(f"the NodePort answered without SNAT, or was not probed ({without}): node 2 may "
                           "still route replies to the client itself")
    if not answers(with_snat):
        raise RuntimeError(f"the NodePort did not answer with DNAT + masquerade: {with_snat}")


def floor(p: Mapping[str, Any], lab: Lab, loadlab: LoadLab,
          addresses: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The floor's two runs on the hand-written rules, then the node reset."""
    lab.exec(lab.node, "nft", "-f", "-", input=floor_rules(lab, masquerade=True))
    try:
        return latency.two_loads(p, loadlab, addresses, None)
    finally:
        cp.reset_node(lab, legacy=False)


def served(loadlab: LoadLab, addresses: Sequence[str]) -> Callable[[cp.Proxy], str]:
    """The `Series.served` check: two probes through the NodePort, a second apart."""
    def check(proxy: cp.Proxy) -> str:
        result: dict[str, Any] = {}
        for attempt in range(2):
            if attempt:
                time.sleep(1.0)
            result = probe(loadlab, addresses)
            if answers(result):
                return ""
        return f"not served: no answer through the NodePort ({result['errors']:,} probe connections failed)"
    return check


# ---------------------------------------------------------------------------------------------- the part


def run_size(p: Mapping[str, Any], rec: Recorder, deadline: Deadline, cluster: Cluster, n: int,
             skip: dict[str, str]) -> None:
    size = Size(rec, n, floor=FLOOR, floor_label="the 2-rule floor")
    chosen = latency.targets(n, int(p["targets"]))
    rec.param(f"targets_at_{n}", chosen)
    addresses = [f"{NODE_CLIENT_IP}:{NODE_PORT + i}" for i in chosen]
    with latency.lab_session(cluster, Lab(10, prefix="pnp", router="backends")) as (lab, loadlab, kubeconfig):
        isolate_node2(lab)
        rec.step(f"checking that the NodePort needs SNAT @ {n:,} services")
        check_snat_needed(lab, loadlab, addresses, rec, n)
        latency.run_series(p, rec, deadline, size, Series(
            lab, loadlab, kubeconfig, addresses, lambda: floor(p, lab, loadlab, addresses),
            served=served(loadlab, addresses), order=ORDER), skip)


def params(quick: bool) -> dict[str, Any]:
    common = {"series": list(ORDER), "targets": 5, "rate": 1000, "paced_threads": 2, "threads": 4,
              "upstream_nft_max": 1000}
    if quick:
        return {**common, "services": [1], "seconds": 0.6, "warmup_s": 0.3, "program_timeout_s": 20,
                "idle_timeout_s": 5, "min_left_s": 8}
    return {**common, "services": [1, 1000], "seconds": 1.5, "warmup_s": 0.5, "program_timeout_s": 30,
            "idle_timeout_s": 15, "min_left_s": 15}


def run(p: Mapping[str, Any], rec: Recorder, deadline: Deadline) -> None:
    rec.note("External client -> node 10.200.0.1:nodePort (type NodePort, externalTrafficPolicy Cluster) -> "
             "endpoints on node 2, which has no route back to the client: DNAT and SNAT on the node (checked "
             "per size: the DNAT alone gets no answer). Latency from the paced run (1,000 new connections/s); "
             "conn/s and CPU from the closed loop (4 in flight); lab CPU = client + 10 servers + ksoftirqd per "
             "connection, the dataplane's share its excess over the 2-rule nft floor. Ratio tables divide by "
             "upstream kube-proxy v1.20.2 iptables-legacy. 'not served': the dataplane programmed its "
             "ClusterIPs but did not answer through the NodePort (bpf: until its datapath has SNAT).")
    latency.on_api(p, rec, objects, lambda cluster, n, skip: run_size(p, rec, deadline, cluster, n, skip))


PART = Part(
    name="nodeport",
    title="New connections through a NodePort from an external client to another node (DNAT + SNAT)",
    # Full: 101 s measured with four of the eight series not served (each then costs only its start and probe);
    # about 150 s expected once all are served.
    budget_s={True: 80.0, False: 200.0},
    params=params,
    run=run,
    figures=(
        Figure("nodeport_conn", "External client -> NodePort -> endpoint on another node (DNAT + SNAT), "
               "namespace lab", (
                   Panel("latency_p50_us", "microseconds", "p50 of one new connection (paced, 1,000 conn/s)"),
                   Panel("conn_per_s", "connections/s", "closed loop, 4 in flight, 2 cores"),
                   Panel("lab_cpu_us_per_conn", "microseconds of CPU", "lab CPU per connection (closed loop)"),
               )),
    ),
    metrics={
        "latency_p50_us": "p50 latency of one new TCP connection through the NodePort, us, paced",
        "latency_p99_us": "p99 latency, us, paced at 1,000 conn/s",
        "conn_per_s": "new connections per second through the NodePort, closed loop (4 in flight)",
        "lab_cpu_us_per_conn": "lab CPU per connection (client + servers + ksoftirqd), us, closed loop",
        "translation_core_pct": "the dataplane's CPU over the 2-rule floor, % of a core at 1,000 conn/s",
    },
)
