"""Issue 16 end to end, with real packets: a Service flow that ended must not capture the next connection on the
same ports, in every mode (bpf on TC, bpf with XDP on the client-facing device, nftables, iptables); and path-MTU
discovery and big UDP datagrams work through a ClusterIP when a router with a smaller MTU is on the way.

The clients and the echo server are tests/e2e/ct_traffic.py, run inside the lab's namespaces. One backend, so
the backend a client reaches directly is the one that served its Service connection.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import ct_traffic
import pytest
from ct_traffic import run_json
from labkit.manifests import Port, endpoint_slice, service
from labkit.traffic import READY_LINE
from scenarios import WEB_IP, web

pytestmark = pytest.mark.root

MODES = [
    pytest.param("bpf", False, id="bpf"),
    pytest.param("bpf", True, id="bpf-xdp"),
    pytest.param("nftables", False, id="nftables"),
    pytest.param("iptables", False, id="iptables"),
]

ECHO_IP = "10.96.16.10"
ECHO_PORT = 7070  # ct_traffic's server, TCP and UDP: the client closes first
ECHO_PORTS = [Port("tcp", 80, ECHO_PORT), Port("udp", 53, ECHO_PORT, "UDP")]
SOAK_SECONDS = float(os.environ.get("PYPROXY_SOAK_SECONDS", "15"))
SOAK_PORTS = range(42000, 42020)  # 20 source ports: each comes back every 20 steps
ROUTER_LINK_MTU = 1400  # node <-> router
EDGE_ROUTE_MTU = 1280  # the router's route to the hosts behind it, and the node's to those on its other side
BULK_BYTES = 1 << 20
BIG_DATAGRAM = 4096


def start_echo_servers(env) -> None:
    """ct_traffic's server on ECHO_PORT in every backend (torn down with the lab)."""
    procs = [env.lab.popen(b.ns, sys.executable, str(ct_traffic.SCRIPT), "serve", "--name", b.name,
                           "--port", str(ECHO_PORT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE) for b in env.lab.backends]
    for proc in procs:
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if line != READY_LINE:
            proc.kill()
            raise AssertionError(f"echo server did not start: {line!r} {proc.communicate(timeout=5)[1].decode()}")


def start(make_env, mode: str, xdp: bool, **lab_kwargs):
    """A lab with one backend running the lab's servers and ct_traffic's, Services `web` (TCP 80 -> 8080)
    and `ct-echo` (TCP 80, UDP 53 -> 7070) on it, pyproxy in `mode` (XDP on the client-facing device)."""
    env = make_env(1, **lab_kwargs)
    start_echo_servers(env)
    b1 = env.lab.backends[0]
    env.write("web.yaml", *web({b1.ip: True}))
    env.write("echo.yaml", service("ct-echo", ECHO_IP, ECHO_PORTS),
              endpoint_slice("ct-echo", {b1.ip: True}, ECHO_PORTS))
    env.start(mode=mode, xdp_devices=[env.lab.node_client_ifname] if xdp else None)
    if xdp:
        link = env.lab.exec(env.lab.node, "ip", "-d", "link", "show", "dev", env.lab.node_client_ifname).stdout
        assert "prog/xdp" in link, f"--xdp-devices did not attach XDP:\n{link}"
    return env


# ------------------------------------------------------------------------------------------- the reproduction


@pytest.mark.parametrize("mode, xdp", MODES)
def test_a_closed_service_connection_does_not_capture_a_direct_one_on_its_ports(make_env, mode, xdp) -> None:
    """Issue 16 as filed: from a fixed source port, the Service (answered, closed), then the backend's own
    address from the same port: it must answer too. TCP with either side closing first, UDP; 3 ports each."""
    env = start(make_env, mode, xdp)
    b1 = env.lab.backends[0]
    cases = {  # name -> (proto, Service, the backend directly, source ports)
        "tcp, client closes first": ("tcp", f"{ECHO_IP}:80", f"{b1.ip}:{ECHO_PORT}", "41001-41003"),
        "tcp, server closes first": ("tcp", f"{WEB_IP}:80", f"{b1.ip}:8080", "41011-41013"),
        "udp": ("udp", f"{ECHO_IP}:53", f"{b1.ip}:{ECHO_PORT}", "41021-41023"),
    }
    summary, wrong = {}, []
    for name, (proto, svc, direct, ports) in cases.items():
        result = run_json(env.lab, env.lab.client, "pair", "--proto", proto, "--service", svc, "--direct", direct,
                          "--ports", ports, "--timeout", "3", timeout=60)
        poisoned = sum(1 for r in result["results"] if r["service"]["ok"] and not r["direct"]["ok"])
        summary[name] = {"poisoned": f"{poisoned}/{len(result['results'])}",
                         "service_failed": sum(1 for r in result["results"] if not r["service"]["ok"]),
                         "direct_seconds": [r["direct"].get("elapsed") for r in result["results"]]}
        for r in result["results"]:
            for kind in ("service", "direct"):
                rec = r[kind]
                if not rec["ok"] or not rec["reply"].startswith(f"{b1.name}:") \
                        or not rec["seen"].startswith(f"{env.lab.client_ip}:"):
                    wrong.append(f"{name}: port {r['port']} {kind} -> {rec}")
    print(f"\n{mode}{'+xdp' if xdp else ''}: {json.dumps(summary)}")
    assert not wrong, f"{mode}{' xdp' if xdp else ''}: {summary}\n" + "\n".join(wrong)
    env.assert_no_checksum_errors()


# ------------------------------------------------------------------------------------------------ the soak


@pytest.mark.parametrize("mode, xdp", MODES)
def test_soak_alternating_service_and_direct_connections(make_env, mode, xdp, record_property) -> None:
    """For PYPROXY_SOAK_SECONDS (15; `make soak`: 60) one client alternates Service and direct exchanges with
    the same backend, TCP and UDP, from 20 source ports in turn (every 4-tuple reused): 0 may fail."""
    env = start(make_env, mode, xdp)
    b1 = env.lab.backends[0]
    # The client reuses a TCP 4-tuple once its TIME_WAIT is older than tcp_tw_reuse_delay (1 s), as clients
    # that set net.ipv4.tcp_tw_reuse=1 do; the default (2) allows it on loopback only.
    env.lab.sysctl(env.lab.client, {"net.ipv4.tcp_tw_reuse": 1})
    result = run_json(env.lab, env.lab.client, "soak", "--tcp-service", f"{ECHO_IP}:80",
                      "--tcp-direct", f"{b1.ip}:{ECHO_PORT}", "--udp-service", f"{ECHO_IP}:53",
                      "--udp-direct", f"{b1.ip}:{ECHO_PORT}", "--ports", f"{SOAK_PORTS[0]}-{SOAK_PORTS[-1]}",
                      "--seconds", str(SOAK_SECONDS), "--timeout", "1", timeout=SOAK_SECONDS + 60)
    total = result["total"]
    record_property("soak", json.dumps(result))
    print(f"\n{mode}{'+xdp' if xdp else ''} soak {result['seconds']} s: attempted {total['attempted']}, "
          f"failed {total['failed']}, ports reused {total['port_reused']} (same 4-tuple {total['tuple_reused']}), "
          f"refused by the kernel {total['port_refused']}, {result['rate_per_s']}/s; "
          f"per kind {json.dumps(result['per_kind'])}; errors {result['errors']}")
    assert total["failed"] == 0, f"{total['failed']} failed: {result['errors']}; first: {result['first_failures']}"
    # It did soak: every kind ran, and ran again on the 4-tuples of earlier rounds.
    assert all(k["attempted"] >= 2 * len(SOAK_PORTS) and k["tuple_reused"] > 0
               for k in result["per_kind"].values()), result
    env.assert_no_checksum_errors()


# ------------------------------------------------------------------------------------ path MTU and big UDP


def narrow_edges(lab) -> None:
    """Routes with EDGE_ROUTE_MTU to the hosts beyond the router and to those on the node's other side, so
    each direction meets a smaller MTU twice: at the node-router link (ROUTER_LINK_MTU) and then at the edge.
    Only the routes shrink, not the client's or backends' links: their MSS stays 1460 and TCP must learn the
    path MTU from "fragmentation needed" errors, sent by the node and by the router about Service flows."""
    backend_routes = [(f"10.201.{b.index}.0/24", b.node_ifname) for b in lab.backends]
    client_routes = [("10.200.0.0/24", "to-client")]
    beyond_router, beside_node = ((client_routes, backend_routes) if lab.router_side == "client"
                                  else (backend_routes, client_routes))
    for ns, routes in ((lab.router, beyond_router), (lab.node, beside_node)):
        for prefix, dev in routes:
            lab.exec(ns, "ip", "route", "change", prefix, "dev", dev, "mtu", str(EDGE_ROUTE_MTU))


def counters(lab) -> dict[str, dict[str, int]]:
    """ICMP and fragment counters per namespace (nstat's names)."""
    names = {"client": lab.client, "node": lab.node, "router": lab.router, "b1": lab.backends[0].ns}
    keys = ("IcmpOutDestUnreachs", "IcmpInDestUnreachs", "IcmpInErrors", "IpFragCreates", "IpReasmOKs",
            "IpReasmFails")
    return {role: {k: c.get(k, 0) for k in keys} for role, ns in names.items()
            for c in [lab.net_counters(ns)]}


def measure(lab, run):
    """run()'s result and how `counters` changed meanwhile: {role: {counter: increase}} (increases only)."""
    before = counters(lab)
    result = run()
    after = counters(lab)
    return result, {role: {k: v - before[role][k] for k, v in after[role].items() if v != before[role][k]}
                    for role in after}


def cached_pmtu(lab, ns: str, dst: str) -> int | None:
    """The path MTU `ns` learned for `dst` ("fragmentation needed" it accepted), from `ip route get`."""
    fields = lab.exec(ns, "ip", "route", "get", dst).stdout.split()
    return int(fields[fields.index("mtu") + 1]) if "mtu" in fields else None


@pytest.mark.parametrize("side", ["backends", "client"])
@pytest.mark.parametrize("mode, xdp", MODES)
def test_path_mtu_discovery_and_big_udp_through_a_cluster_ip(make_env, mode, xdp, side, record_property) -> None:
    """A router between the node and the backends (or the client), MTUs 1400 then 1280 on each direction's way:
    1 MB each way over TCP through the ClusterIP and 4 KB UDP datagrams (fragments) both ways arrive whole,
    after "fragmentation needed" errors from the node and the router taught both ends the path MTU."""
    env = start(make_env, mode, xdp, router=side, router_mtu=ROUTER_LINK_MTU)
    lab, b1 = env.lab, env.lab.backends[0]
    narrow_edges(lab)
    for ns in (lab.client, b1.ns):  # DF on TCP segments: path-MTU discovery on, as Linux has it by default
        assert lab.exec(ns, "sysctl", "-n", "net.ipv4.ip_no_pmtu_disc").stdout.strip() == "0"
    started = time.monotonic()
    udp, frags = measure(lab, lambda: run_json(lab, lab.client, "udp-big", f"{ECHO_IP}:53", str(BIG_DATAGRAM),
                                               "--timeout", "2", timeout=30))
    transfers, icmp, pmtu = {}, {}, {}
    # Each transfer starts with nothing learned: a path MTU one end has cached shrinks the MSS it advertises,
    # and the next connection would never send a segment too big for the path.
    for name, sender, receiver_ip in (("download", b1.ns, lab.client_ip), ("upload", lab.client, ECHO_IP)):
        for ns in (lab.client, b1.ns):
            lab.exec(ns, "ip", "route", "flush", "cache")
        transfers[name], icmp[name] = measure(lab, lambda name=name: run_json(
            lab, lab.client, "get" if name == "download" else "put", f"{ECHO_IP}:80", str(BULK_BYTES),
            "--timeout", "10", timeout=30))
        pmtu[name] = cached_pmtu(lab, sender, receiver_ip)
    get, put = transfers["download"], transfers["upload"]
    report = {"download_s": get["elapsed"], "upload_s": put["elapsed"], "udp": udp["datagrams"],
              "udp_counters": frags, "tcp_counters": icmp, "pmtu": pmtu, "upload_tcp_info": put.get("tcp_info"),
              "total_s": round(time.monotonic() - started, 2)}
    record_property("pmtu", json.dumps(report))
    print(f"\n{mode}{'+xdp' if xdp else ''} router on the {side} side: {json.dumps(report)}")

    problems = []
    if not udp["ok"]:
        problems.append(f"4 KB UDP through {ECHO_IP}:53: {udp['datagrams']}")
    count = len(udp["datagrams"])
    for role in ("client", "b1"):  # each datagram went as fragments and was put together at its receiver
        if frags[role].get("IpFragCreates", 0) < 2 * count or frags[role].get("IpReasmOKs", 0) < count:
            problems.append(f"{role}: datagrams not sent or received as fragments: {frags[role]}")
    for name, result in (("download", get), ("upload", put)):
        if not result["ok"]:
            problems.append(f"1 MB {name}: {result}")
    # Each direction met two smaller MTUs: the node and the router each sent "fragmentation needed" about it,
    # and the sender learned the smallest (for the upload: from errors about its Service flow, translated).
    for name in ("download", "upload"):
        for role in ("node", "router"):
            if icmp[name][role].get("IcmpOutDestUnreachs", 0) < 1:
                problems.append(f"{name}: the {role} sent no destination-unreachable: path MTU not exercised")
        if pmtu[name] != EDGE_ROUTE_MTU:
            problems.append(f"{name}: the sender's path MTU is {pmtu[name]}, want {EDGE_ROUTE_MTU}")
    assert not problems, f"{mode} xdp={xdp} router on the {side} side:\n" + "\n".join(problems) + f"\n{report}"
    env.assert_no_checksum_errors()
