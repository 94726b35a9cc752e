"""Issue 25 end to end, with real packets: a flow's life in the flow table under clients that stress it, in bpf
mode (TC, and with XDP on the client-facing devices) beside nftables mode, whose outcome (the kernel's conntrack)
is the one every mode must match. One test per row of the issue; in each, every mode gets a lab and a pyproxy of
its own and the modes run at the same time, side by side (their long waits overlap), each held to that outcome.

The lab is the two-node one (tests/twonode.py): node 1 runs pyproxy, with pods b1 and b2; pods r1 and r2 are behind
node2, which has no route to the clients, so a client outside the cluster reaching a NodePort or an external IP is
SNATed to a node address (externalTrafficPolicy Cluster). The clients are tests/flowstress.py's.

- A client whose first SYN-ACK is lost (dropped once per 4-tuple in its own namespace): its retransmitted SYN and
  the backend's retransmitted SYN-ACK cross, and the connection must still talk to one backend, end to end.
- A half-open flood: 5,000 SYNs from a second client that never answers, to a NodePort whose only endpoint is
  behind node2 (every flood flow holds an SNAT port, of 4,536); once the flood's flows have timed out, 20 real
  connections must all succeed, and after their SYN-received timeout `pyproxy inspect` must list none of them.
- DNS-like UDP: single exchanges from fresh source ports, paced, to a UDP NodePort whose endpoint is behind node2:
  at least 99.9 % answered (the flows of single exchanges must not hold their SNAT ports as long as streams do).

PYPROXY_LIFECYCLE_MODES (default bpf,bpf-xdp,nftables) picks the modes; PYPROXY_LIFECYCLE_STACK puts the node's
client-facing address on a stacked device (the lab's client_stack: bridge or macvlan here, vlan or bond where the
kernel has their drivers; default none, the plain veth), as `make lifecycle-test` runs each in turn.
PYPROXY_LIFECYCLE_UDP_SECONDS and PYPROXY_LIFECYCLE_UDP_RATE (60 s, 100 a second: the issue's) size the UDP test;
`make test` runs it for 48 s (see UDP_SECONDS), `make lifecycle-test` runs this file at full length.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import flowstress
import pytest
from flowstress import answered_pct, describe_windows, run_json
from labkit.netns import CLIENT2_IP, NODE_CLIENT2_IFNAME, NODE_CLIENT2_IP
from twonode import (
    EXTERNAL_IP,
    LOCAL_PODS,
    MANIFESTS,
    NODE_IP,
    NODE_NAME,
    REMOTE_DNS,
    REMOTE_HTTP,
    REMOTE_PODS,
    WEB_HTTP,
)

from pyproxy.dataplane.bpf.abi import DEFAULT_SNAT_PORTS

pytestmark = pytest.mark.root

T = TypeVar("T")


@dataclass(frozen=True)
class Mode:
    id: str
    mode: str
    """--proxy-mode."""
    xdp: bool
    """XDP also on the devices facing the clients (--xdp-devices)."""


ALL_MODES = (Mode("bpf", "bpf", False), Mode("bpf-xdp", "bpf", True), Mode("nftables", "nftables", False))
MODES = [m for m in ALL_MODES if m.id in os.environ.get("PYPROXY_LIFECYCLE_MODES", "bpf,bpf-xdp,nftables").split(",")]
STACK = os.environ.get("PYPROXY_LIFECYCLE_STACK") or None
"""The lab's client_stack for every test here (None: the plain veth uplink)."""
SNAT_PORTS = DEFAULT_SNAT_PORTS[1] - DEFAULT_SNAT_PORTS[0] + 1
"""The source ports bpf mode's SNAT gives out per node address, backend and protocol (4,536 by default)."""


def start_side_by_side(make_env: Callable[..., Any], prepare: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """A two-node lab per mode of MODES, `prepare(env)` run on it, then pyproxy started in that mode on
    twonode.MANIFESTS (started one after the other: only the main thread may start processes, see Lab.popen)."""
    envs = {}
    for m in MODES:
        env = make_env(LOCAL_PODS, remote_backends=REMOTE_PODS, second_client=True, distro=True, client_stack=STACK)
        env.write("cluster.yaml", MANIFESTS)
        if prepare is not None:
            prepare(env)
        env.start(mode=m.mode, args=[f"--hostname-override={NODE_NAME}"],
                  xdp_devices=[env.lab.node_client_lower_ifname, NODE_CLIENT2_IFNAME] if m.xdp else None)
        envs[m.id] = env
    return envs


def side_by_side(envs: Mapping[str, Any], run: Callable[[Any], T]) -> dict[str, T]:
    """run(env) for every mode's env at the same time, each in a thread; the results by mode id."""
    with ThreadPoolExecutor(len(envs)) as pool:
        futures = {mode: pool.submit(run, env) for mode, env in envs.items()}
        return {mode: f.result() for mode, f in futures.items()}


Judge = Callable[[dict[str, Any]], tuple[str, list[str]]]
"""One mode's outcome -> (its summary line, what it got wrong)."""


def run_and_judge(record_property: Callable[[str, object], None], name: str, envs: Mapping[str, Any],
                  run: Callable[[Any], dict[str, Any]], judge: Judge) -> None:
    """run(env) side by side, every mode's numbers printed (and kept as the junit property `name`), then each
    mode's outcome judged: the assertion names every mode's summary and what each got wrong."""
    started = time.monotonic()
    outcomes = side_by_side(envs, run)
    record_property(name, json.dumps(outcomes))
    for mode, outcome in outcomes.items():
        print(f"\n{name} {mode}: {json.dumps(outcome)}")
    verdicts = {mode: judge(outcome) for mode, outcome in outcomes.items()}
    summary = "\n".join(f"{mode}: {line}" for mode, (line, _) in verdicts.items())
    print(f"\n{name}, {time.monotonic() - started:.0f} s side by side:\n{summary}")
    wrong = [f"{mode}: {problem}" for mode, (_, problems) in verdicts.items() for problem in problems]
    assert not wrong, summary + "\n" + "\n".join(wrong)


def inspect_json(env: Any) -> dict[str, Any]:
    """`pyproxy inspect -o json` in the node (not through Pyproxy.cli, which copies its output, thousands of flows
    here, into the log a failure prints)."""
    out = env.lab.python(env.lab.node, "-m", "pyproxy", "inspect", "-o", "json",
                         f"--bpf-pin-path={env.running.pin_path}", timeout=120).stdout
    view: dict[str, Any] = json.loads(out)
    return view


def counters(view: Mapping[str, Any], *names: str) -> dict[str, int]:
    """bpf mode's datapath counters from an inspect view (none in the netfilter modes)."""
    return {n: view.get("counters", {}).get(n, 0) for n in names}


# ----------------------------------------------------------------------------------------------- lost SYN-ACK

CONNECTIONS = 60
TARGETS = {"NodePort": (NODE_IP, WEB_HTTP.node_port), "external IP": (EXTERNAL_IP, WEB_HTTP.port)}
"""twonode's `web`: endpoints b1, b2 (this node) and r1, r2 (node2), externalTrafficPolicy Cluster."""


def test_a_lost_first_synack_still_gives_one_backend_end_to_end(make_env, record_property) -> None:
    """Each connection's first SYN-ACK is dropped in the client's namespace; 60 connections at once to the NodePort,
    then 60 to the external IP: every one answered twice by the same backend and closed without a reset."""
    envs = start_side_by_side(make_env)

    def run(env: Any) -> dict[str, Any]:
        for argv in flowstress.iptables_argvs(flowstress.LOST_SYNACK_RULES):
            env.lab.exec(env.lab.client, *argv)
        out: dict[str, Any] = {}
        for name, (ip, port) in TARGETS.items():
            out[name] = run_json(env.lab, env.lab.client, "connect", ip, str(port), "--count", str(CONNECTIONS),
                                 "--hold", "1.5", "--timeout", "10", timeout=60)
        listing = env.lab.exec(env.lab.client, *flowstress.counters_argv(flowstress.LOST_SYNACK_CHAIN)).stdout
        out["synacks_dropped"] = flowstress.parse_counters(listing)[0]
        if env.proxy.mode == "bpf":
            out["counters"] = counters(inspect_json(env), "ct_reopened", "rebalanced", "snat", "snat_no_port")
        return out

    def judge(out: dict[str, Any]) -> tuple[str, list[str]]:
        line = "; ".join(f"{name} {out[name]['whole']}/{CONNECTIONS} whole {out[name]['errors'] or ''}"
                         for name in TARGETS) + f"; first SYN-ACKs dropped {out['synacks_dropped']}"
        wrong = [f"{name}: {out[name]['whole']} of {CONNECTIONS} talked to one backend end to end, errors "
                 f"{out[name]['errors']}, first failures {out[name]['failed'][:3]}"
                 for name in TARGETS if out[name]["whole"] != CONNECTIONS]
        # The scenario itself: a SYN-ACK lost for every connection (more where a mode sent some untranslated).
        if out["synacks_dropped"] < len(TARGETS) * CONNECTIONS:
            wrong.append(f"only {out['synacks_dropped']} SYN-ACKs dropped: the lab did not lose each first one")
        return line + (f"; {out['counters']}" if "counters" in out else ""), wrong

    run_and_judge(record_property, "lost_synack", envs, run, judge)


# ------------------------------------------------------------------------------------------ half-open flood

FLOOD_SYNS = 5000
FLOOD_FIRST_PORT = 20000
FLOOD_RATE = 2500
REAL_AFTER_FLOOD = 20
SYN_RECV_TIMEOUT_S = 60.0
"""How long a half-open flow (SYN-ACK seen, the client's ACK not) lasts: the kernel's nf_conntrack_tcp_timeout_syn_recv,
and bpf mode's default (--bpf-ct-tcp-syn-recv-timeout). The test waits out the defaults, as a user meets them."""
FLOOD_WAIT_S = SYN_RECV_TIMEOUT_S + 15.0
"""From the flood's end to the real connections: 75 s, the issue's."""


def _flood_flows(view: Mapping[str, Any]) -> dict[str, Any]:
    """What an inspect view lists of the flood's flows (from client2, source ports of the flood)."""
    last = FLOOD_FIRST_PORT + FLOOD_SYNS - 1
    flows = [f for f in view.get("flows", [])
             if f["client"] == CLIENT2_IP and FLOOD_FIRST_PORT <= f["client_port"] <= last]
    idle = [f["idle_sec"] for f in flows if f.get("idle_sec") is not None]
    return {"listed": len(flows), "states": dict(Counter(f["state"] for f in flows)),
            "idle_s": [min(idle), max(idle)] if idle else None}


def _prepare_flood(env: Any) -> None:
    # The flooder answers nothing (no reset for a SYN-ACK it never asked for) and counts the SYN-ACKs.
    for argv in flowstress.iptables_argvs(flowstress.FLOOD_RULES):
        env.lab.exec(env.lab.client2, *argv)
    # r1 answers every SYN with a SYN cookie, as a server does once a flood has filled its queue (here from the
    # 257th SYN on): it then keeps no half-open connection and resends no SYN-ACK, so each flood flow's last
    # packet is its one SYN-ACK and its SYN-received timeout runs from the flood (else the queue's first 256
    # would resend theirs for 31 s and be collected a pass later). The real connections complete as usual.
    env.lab.sysctl(env.lab.remote_backends[0].ns, {"net.ipv4.tcp_syncookies": 2})


def test_a_half_open_flood_does_not_hold_the_snat_ports(make_env, record_property) -> None:
    """5,000 SYNs from client2 (never completed) to a NodePort whose only endpoint is behind node2; 75 s after the
    flood 20 connections from the client to it must all talk to r1 end to end; after the flood's SYN-received
    timeout (from its last SYN-ACK), inspect lists no flow of the flood."""
    envs = start_side_by_side(make_env, _prepare_flood)
    port = REMOTE_HTTP.node_port

    def run(env: Any) -> dict[str, Any]:
        lab, out = env.lab, {}
        out["flood"] = run_json(lab, lab.client2, "syn-flood", NODE_CLIENT2_IP, str(port), "--count", str(FLOOD_SYNS),
                                "--first-port", str(FLOOD_FIRST_PORT), "--rate", str(FLOOD_RATE), timeout=60)
        flood_end = time.monotonic()
        synacks, last_synack = 0, flood_end
        while time.monotonic() < flood_end + FLOOD_WAIT_S:  # the SYN-ACKs the flooder drops, and when the last came
            n = flowstress.parse_counters(lab.exec(lab.client2, *flowstress.counters_argv("INPUT")).stdout)[0]
            if n != synacks:
                synacks, last_synack = n, time.monotonic()
            time.sleep(min(2.0, max(0.0, flood_end + FLOOD_WAIT_S - time.monotonic())))
        out["synacks_to_flooder"] = synacks
        out["last_synack_s"] = round(last_synack - flood_end, 1)
        out["real"] = run_json(lab, lab.client, "connect", NODE_IP, str(port), "--count", str(REAL_AFTER_FLOOD),
                               "--hold", "0.2", "--timeout", "5", timeout=60)
        # The flood's flows have timed out (their last packet, a SYN-ACK, + the timeout): the programs treat them
        # as absent, and so does inspect, whether or not the collector has deleted them yet (its next pass may be
        # 90 s away); the kernel's conntrack drops an expired entry itself.
        time.sleep(max(0.0, last_synack + SYN_RECV_TIMEOUT_S + 1.0 - time.monotonic()))
        view = inspect_json(env)
        out["after_timeout"] = _flood_flows(view)
        if env.proxy.mode == "bpf":
            out["counters"] = counters(view, "snat", "snat_no_port", "ct_reopened")
        return out

    def judge(out: dict[str, Any]) -> tuple[str, list[str]]:
        real, left = out["real"], out["after_timeout"]
        line = (f"{real['whole']}/{REAL_AFTER_FLOOD} real connections whole {real['errors'] or ''} 75 s after "
                f"{out['flood']['sent']} SYNs ({out['synacks_to_flooder']} SYN-ACKs to the flooder, the last "
                f"{out['last_synack_s']} s after the flood); inspect after the timeout: {left}"
                + (f"; {out['counters']}" if "counters" in out else ""))
        wrong = []
        if real["whole"] != REAL_AFTER_FLOOD or set(real["backends"]) != {"r1:8080"}:
            wrong.append(f"{real['whole']} of {REAL_AFTER_FLOOD} real connections talked to r1 end to end: "
                         f"{real['backends']} {real['errors']} {real['failed'][:3]}")
        if left["listed"]:
            wrong.append(f"inspect still lists {left['listed']} flows of the flood after their timeout: {left}")
        return line, wrong

    run_and_judge(record_property, "half_open_flood", envs, run, judge)


# ---------------------------------------------------------------------------------------------- DNS-like UDP

UDP_SECONDS = float(os.environ.get("PYPROXY_LIFECYCLE_UDP_SECONDS", "60"))
"""`make test` sets 48: at 100 a second, 4,800 single exchanges, still more than the 4,536 SNAT ports today's code
keeps 120 s per replied flow (gone after 45.4 s: about 5.5 % of the exchanges go unanswered, so it fails as the full
run does), while a single exchange's 30 s hold keeps 3,000 of them busy (the 32 random tries of an allocation then
all miss once in 500,000 flows). A higher rate for fewer seconds would save little: with single exchanges held 30 s
the tries stay clear of misses only below about 115 a second, where 45 s are needed to fill the pool."""
UDP_RATE = float(os.environ.get("PYPROXY_LIFECYCLE_UDP_RATE", "100"))
ANSWERED_MIN_PCT = 99.9


def test_dns_like_udp_single_exchanges_through_snat(make_env, record_property) -> None:
    """UDP_RATE single exchanges a second, each from a fresh source port, for UDP_SECONDS to a UDP NodePort whose
    only endpoint (r1) is behind node2: at least 99.9 % answered, by r1, from the NodePort's address."""
    envs = start_side_by_side(make_env)

    def run(env: Any) -> dict[str, Any]:
        out = run_json(env.lab, env.lab.client, "udp-paced", NODE_IP, str(REMOTE_DNS.node_port), "--rate",
                       str(UDP_RATE), "--seconds", str(UDP_SECONDS), "--timeout", "2", timeout=UDP_SECONDS + 60)
        if env.proxy.mode == "bpf":
            out["counters"] = counters(inspect_json(env), "snat", "snat_no_port")
        return out

    def judge(out: dict[str, Any]) -> tuple[str, list[str]]:
        pct = answered_pct(out["sent"], out["answered"])
        line = (f"{out['answered']}/{out['sent']} answered ({pct:.4g} %), {describe_windows(out)}; errors "
                f"{out['errors']}; sends late by {out['late_ms']} ms" + (f"; {out['counters']}" if "counters" in out
                                                                        else ""))
        wrong = [f"{pct:.4g} % answered, want at least {ANSWERED_MIN_PCT} %"] if pct < ANSWERED_MIN_PCT else []
        if set(out["backends"]) - {"r1:5353"}:
            wrong.append(f"answered by {out['backends']}, want r1:5353 only")
        return line, wrong

    print(f"\nDNS-like UDP: {UDP_RATE:g}/s for {UDP_SECONDS:g} s, {UDP_RATE * min(UDP_SECONDS, 120.0):.0f} single "
          f"exchanges within 120 s against {SNAT_PORTS} SNAT ports")
    run_and_judge(record_property, "dns_like_udp", envs, run, judge)
