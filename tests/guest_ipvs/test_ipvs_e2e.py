"""pyproxy's IPVS mode end to end, run INSIDE the qemu guest (tests/guest/run.py; host side:
tests/e2e/test_ipvs_guest.py): `python -m pyproxy run --proxy-mode=ipvs` in a lab's node namespace, with real
traffic from the client namespace to backends in their own namespaces.

One Lab serves the whole module (building one costs seconds of emulated CPU); every test starts its own
pyproxy on its own manifest folder and leaves through `pyproxy cleanup`, so each begins with no virtual server.
The draining test needs connections that stay open: each backend also runs HOLD_SERVER on HOLD_PORT, which
names itself (`bI:7070`) in answer to the first line and then echoes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import schedcases
import twonode
import udpswitch
from flowcases import IPV6_CASES, MANIFESTS, NODE_NAME, mismatches
from labkit import Lab, LabError, ProbeResult, Pyproxy, PyproxyError, describe, write_manifest
from labkit.manifests import Port, documents, endpoint_slice, service

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc/sys/net/ipv4/vs").exists(),
                                reason="runs as root in the IPVS guest (tests/guest/run.py)")

WEB_IP, DNS_IP, MULTI_IP, HOLD_IP, EMPTY_IP = "10.96.0.10", "10.96.0.53", "10.96.0.20", "10.96.0.30", "10.96.0.40"
EDGE_IP, EDGE_EXTERNAL_IP, EDGE_LB_IP = "10.96.0.50", "192.0.2.50", "203.0.113.50"
WEB_PORTS = [Port("http", 80, 8080)]
DNS_PORTS = [Port("dns", 53, 5353, "UDP")]
MULTI_PORTS = [Port("http", 80, 8080), Port("admin", 90, 9090)]
HOLD_PORT = 7070
HOLD_PORTS = [Port("hold", HOLD_PORT, HOLD_PORT)]
SYNC_ARGS = ["--sync-period=2", "--min-sync-period=0.2"]
STARTUP = 90.0  # seconds for pyproxy to be healthy under emulation
# Answers a connection's first line with `NAME:PORT peer:0` (a reply the lab's probe understands), then echoes.
HOLD_SERVER = """
import socket, sys, threading
name, port = sys.argv[1], int(sys.argv[2])
server = socket.create_server(("0.0.0.0", port))

def serve(conn):
    with conn:
        if conn.makefile("rb").readline():
            conn.sendall(f"{name}:{port} peer:0\\n".encode())
        while data := conn.recv(4096):
            conn.sendall(data)

while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(3, prefix="ipvs") as lab:
        lab.start_servers(tcp=[8080, 9090], udp=[5353], timeout=60.0)
        for b in lab.backends:
            lab.popen(b.ns, sys.executable, "-c", HOLD_SERVER, b.name, str(HOLD_PORT), stdin=subprocess.DEVNULL,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield lab


def wait_healthy(proxy: Pyproxy) -> None:
    """proxy.wait_healthy(STARTUP), also when one of its /healthz checks overruns the lab's bound for it: under
    emulation on a busy host, starting the checking Python process alone can take that long."""
    end = time.monotonic() + STARTUP
    while True:
        try:
            proxy.wait_healthy(max(1.0, end - time.monotonic()))
            return
        except PyproxyError:
            raise
        except LabError as e:
            if not str(e).startswith("timed out") or time.monotonic() >= end:
                raise


class Env:
    def __init__(self, lab: Lab, source: Path) -> None:
        self.lab = lab
        self.source = source
        self.proxy: Pyproxy | None = None

    def write(self, name: str, *docs: str) -> None:
        write_manifest(self.source, name, documents(*docs))

    def remove(self, name: str) -> None:
        (self.source / name).unlink()

    def start(self, *args: str) -> Pyproxy:
        self.proxy = Pyproxy(self.lab, self.source, mode="ipvs", extra_args=[*SYNC_ARGS, *args],
                             log_path=self.source.parent / f"pyproxy-{time.monotonic_ns()}.log")
        self.proxy.start()
        wait_healthy(self.proxy)
        return self.proxy

    def node(self, *argv: str) -> str:
        return self.lab.exec(self.lab.node, *argv).stdout

    def ipvsadm(self) -> str:
        return self.node("ipvsadm", "-Ln")

    def real(self, address: str) -> tuple[int, int, int] | None:
        """(weight, active, inactive) of the real server `address` (ip:port) in `ipvsadm -Ln`."""
        for line in self.ipvsadm().splitlines():
            words = line.split()
            if words[:2] == ["->", address]:
                return int(words[3]), int(words[4]), int(words[5])
        return None

    def layout(self) -> list[str]:
        """`ipvsadm -Ln` without the connection counters, which change with every probe."""
        return [" ".join(line.split()[:4]) for line in self.ipvsadm().splitlines()]

    def probe(self, proto: str, ip: str, port: int, count: int = 30, ns: str | None = None) -> ProbeResult:
        return self.lab.probe(proto, ip, port, count, ns=ns)

    def reaches(self, proto: str, ip: str, port: int, expected: set[str], count: int = 30) -> ProbeResult:
        # 3 s, not the lab's 1 s: what is asked here is who answers, and an emulated guest on a busy 2-core host
        # can stall past a second (a CI rehearsal with two lab VMs beside it: 1 of 30 SYN-ACKs later than 1 s).
        result = self.lab.probe(proto, ip, port, count, timeout=3.0)
        assert result["failures"] == 0, f"{proto} {ip}:{port}: {describe(result)}"
        assert set(result["replies"]) == expected, f"{proto} {ip}:{port}: {describe(result)}"
        assert set(result["seen_from"]) == {self.lab.client_ip}, f"backends saw {result['seen_from']}"
        return result

    def eventually(self, check: Callable[[], bool], what: str, deadline: float = 60.0) -> None:
        end = time.monotonic() + deadline
        while not check():
            assert time.monotonic() < end, f"not within {deadline:g}s: {what}\n{self.ipvsadm()}"
            time.sleep(0.5)


@pytest.fixture
def env(lab: Lab, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Env]:
    source = tmp_path / "manifests"
    source.mkdir()
    e = Env(lab, source)
    yield e
    if e.proxy is not None:
        failed = getattr(request.node, "rep_call", None)
        e.proxy.close()  # kill if running, then `pyproxy cleanup`: the next test starts clean
        if failed is not None and failed.failed:
            print(f"\n===== pyproxy log =====\n{e.proxy.log_text()}")


def web(endpoints: dict[str, bool | None], ip: str = WEB_IP, name: str = "web") -> list[str]:
    return [service(name, ip, WEB_PORTS), endpoint_slice(name, endpoints, WEB_PORTS)]


def names(lab: Lab, port: int, which: range | None = None) -> set[str]:
    return {f"{b.name}:{port}" for i, b in enumerate(lab.backends) if which is None or i in which}


def ready(lab: Lab, which: range | None = None) -> dict[str, bool | None]:
    return {b.ip: True for i, b in enumerate(lab.backends) if which is None or i in which}


def test_only_ready_backends_answer_tcp_and_udp(env: Env) -> None:
    b1, b2, b3 = env.lab.backends
    some = {b1.ip: True, b2.ip: None, b3.ip: False}  # None: no conditions, which means ready
    env.write("web.yaml", *web(some))
    env.write("dns.yaml", service("dns", DNS_IP, DNS_PORTS), endpoint_slice("dns", some, DNS_PORTS))
    env.write("multi.yaml", service("multi", MULTI_IP, MULTI_PORTS),
              endpoint_slice("multi", ready(env.lab), MULTI_PORTS))
    env.start()
    env.reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})
    env.reaches("udp", DNS_IP, 53, {"b1:5353", "b2:5353"})
    env.reaches("tcp", MULTI_IP, 80, names(env.lab, 8080))
    env.reaches("tcp", MULTI_IP, 90, names(env.lab, 9090))
    table = env.ipvsadm()
    assert f"TCP  {WEB_IP}:80 rr" in table and f"UDP  {DNS_IP}:53 rr" in table, table
    assert "Masq" in table and "Route" not in table, table  # NAT forwarding, as kube-proxy
    link = env.node("ip", "-o", "addr", "show", "dev", "kube-ipvs0")
    assert {f"{ip}/32" for ip in (WEB_IP, DNS_IP, MULTI_IP)} <= set(link.split()), link
    members = env.node("ipset", "list", "KUBE-CLUSTER-IP")
    assert f"{WEB_IP},tcp:80" in members and f"{DNS_IP},udp:53" in members, members


def test_round_robin_spreads_evenly_and_the_scheduler_is_configurable(env: Env) -> None:
    env.write("web.yaml", *web(ready(env.lab)))
    proxy = env.start()
    result = env.reaches("tcp", WEB_IP, 80, names(env.lab, 8080), count=30)
    assert sorted(result["replies"].values()) == [10, 10, 10], describe(result)
    assert proxy.terminate(20.0) == 0
    # sh hashes the client's address: every connection of the one client lands on one backend.
    env.start("--ipvs-scheduler=sh")
    env.eventually(lambda: f"{WEB_IP}:80 sh" in env.ipvsadm(), "scheduler sh applied to the kept virtual server")
    result = env.probe("tcp", WEB_IP, 80, 20)
    assert result["failures"] == 0 and len(result["replies"]) == 1, describe(result)


def test_no_endpoints_is_refused_at_once(env: Env) -> None:
    env.write("empty.yaml", service("empty", EMPTY_IP, WEB_PORTS + DNS_PORTS),
              endpoint_slice("empty", {}, WEB_PORTS + DNS_PORTS))
    env.start()
    # Few probes: the node's ICMP rate limit (a burst of 6, then 1 per second per client) would turn more
    # of them into timeouts, with any mode that rejects.
    tcp = env.probe("tcp", EMPTY_IP, 80, 3)
    assert tcp["errors"] == {"refused": 3} and tcp["elapsed"] < 2.0, describe(tcp)
    udp = env.probe("udp", EMPTY_IP, 53, 3)
    assert udp["errors"] == {"refused": 3}, describe(udp)
    assert f"TCP  {EMPTY_IP}:80 rr" in env.ipvsadm()


def test_session_affinity_sticks_to_one_backend(env: Env) -> None:
    env.write("sticky.yaml", service("sticky", WEB_IP, WEB_PORTS, affinity_seconds=600),
              endpoint_slice("sticky", ready(env.lab), WEB_PORTS))
    env.start()
    first: dict = {}

    def answered() -> bool:
        # Once in a busy run (18 minutes of guest under TCG beside other tests) the very first SYN after the
        # sync met an ICMP unreachable; stickiness, not that first packet, is what this test is about.
        nonlocal first
        first = env.probe("tcp", WEB_IP, 80, 1)
        return first["failures"] == 0

    env.eventually(answered, "the sticky Service answers", deadline=10.0)
    env.reaches("tcp", WEB_IP, 80, set(first["replies"]), count=20)
    assert f"{WEB_IP}:80 rr persistent 600" in env.ipvsadm()


def _hold(lab: Lab) -> subprocess.Popen[str]:
    """A client connection to HOLD_IP that stays open; it prints the backend's name, then sends each stdin
    line through the connection and prints its echo; it resets the connection when stdin closes."""
    code = (
        "import socket, struct, sys\n"
        f"s = socket.create_connection(('{HOLD_IP}', {HOLD_PORT}), timeout=10)\n"
        "f = s.makefile('rb')\n"
        "s.sendall(b'hello\\n')\n"
        "print(f.readline().decode().split()[0], flush=True)\n"
        "for line in sys.stdin:\n"
        "    s.sendall(line.encode())\n"
        "    print(f.readline().decode().strip(), flush=True)\n"
        # At EOF, close with a reset: IPVS forgets a reset connection in 10 s, a FIN-closed one in 2 minutes.
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))\n"
        "s.close()\n"
    )
    return lab.popen(lab.client, sys.executable, "-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)


def _ask(holder: subprocess.Popen[str], line: str) -> str:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write(line + "\n")
    holder.stdin.flush()
    return holder.stdout.readline().strip()


def test_removed_endpoint_drains_then_disappears(env: Env) -> None:
    env.write("hold.yaml", service("hold", HOLD_IP, HOLD_PORTS), endpoint_slice("hold", ready(env.lab), HOLD_PORTS))
    env.start()
    holder = _hold(env.lab)
    assert holder.stdout is not None
    name = holder.stdout.readline().strip().split(":")[0]
    assert name in {b.name for b in env.lab.backends}, f"no answer: {holder.stderr.read() if holder.stderr else ''}"
    held = next(b for b in env.lab.backends if b.name == name)
    others = {b.ip: True for b in env.lab.backends if b is not held}
    env.write("hold.yaml", service("hold", HOLD_IP, HOLD_PORTS), endpoint_slice("hold", others, HOLD_PORTS))
    real = f"{held.ip}:{HOLD_PORT}"
    def draining() -> bool:
        state = env.real(real)
        return state is not None and state[0] == 0 and state[1] + state[2] == 1

    env.eventually(draining, f"{real} drained to weight 0, its connection kept")
    # Draining: the open connection still works, new ones go elsewhere only.
    assert _ask(holder, "still there") == "still there"
    fresh = env.probe("tcp", HOLD_IP, HOLD_PORT, 12)
    assert fresh["failures"] == 0 and f"{name}:{HOLD_PORT}" not in fresh["replies"], describe(fresh)
    assert env.real(real) is not None
    # Once its last connection is closed (and IPVS forgot it), the next sync deletes the real server.
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(timeout=10)
    env.eventually(lambda: env.real(real) is None, f"{real} deleted after draining", deadline=60.0)


def _inspect(env: Env, *args: str) -> str:
    assert env.proxy is not None
    return env.proxy.cli("inspect", *args, timeout=120.0).stdout  # a Python start is seconds under emulation


def _trace(env: Env, src: str, dst: str) -> dict:
    out: dict = json.loads(_inspect(env, "trace", src, dst, "-o", "json"))
    return out


def test_inspect_answers_as_the_traffic_went(env: Env) -> None:
    """`pyproxy inspect` read back from IPVS: the real server a held connection uses (IPVS's connection table),
    the one a persistent virtual server pins the client to (its template), a new flow's candidates and rule, an
    address no virtual server has. Prints the raw tables it read (`-s`), the unit tests' captured input."""
    sticky_ip = "10.96.0.60"
    env.write("hold.yaml", service("hold", HOLD_IP, HOLD_PORTS), endpoint_slice("hold", ready(env.lab), HOLD_PORTS))
    env.write("sticky.yaml", service("sticky", sticky_ip, WEB_PORTS, affinity_seconds=600),
              endpoint_slice("sticky", ready(env.lab), WEB_PORTS))
    env.start()
    client = env.lab.client_ip
    env.eventually(lambda: env.probe("tcp", sticky_ip, 80, 1)["failures"] == 0, "the sticky Service answers", 10.0)
    sticky = env.reaches("tcp", sticky_ip, 80, set(env.probe("tcp", sticky_ip, 80, 1)["replies"]), count=5)
    holder = _hold(env.lab)
    try:
        assert holder.stdout is not None
        name = holder.stdout.readline().strip().split(":")[0]
        held = f"{next(b for b in env.lab.backends if b.name == name).ip}:{HOLD_PORT}"
        for raw in ("cat /proc/net/ip_vs_conn", "ipvsadm -Lnc", "ipvsadm -Ln", "ipset save"):
            print(f"===== {raw}\n{env.node('sh', '-c', raw)}")

        by_source = _trace(env, client, f"{HOLD_IP}:{HOLD_PORT}/tcp")
        assert by_source["frontend"]["scheduler"] == "rr", by_source
        live = [f for f in by_source["flows"] if not f["ended"]]
        assert [f["backend"] for f in live] == [held], by_source
        established = _trace(env, f"{client}:{live[0]['client_port']}", f"{HOLD_IP}:{HOLD_PORT}/tcp")
        assert (established["verdict"], established["backend"]) == ("established", held), established

        every = {f"{b.ip}:{HOLD_PORT}" for b in env.lab.backends}
        fresh = _trace(env, f"{client}:1", f"{HOLD_IP}:{HOLD_PORT}/tcp")
        assert fresh["verdict"] == "dnat" and fresh["backend"] is None and not fresh["flows"], fresh
        assert {f"{e['ip']}:{e['port']}" for e in fresh["new_flow"]["candidates"]} == every, fresh
        assert "round robin" in fresh["why"] and set(fresh["new_flow"]["shares"]) == every, fresh

        pinned_to = f"{next(b for b in env.lab.backends if f'{b.name}:8080' in sticky['replies']).ip}:8080"
        pinned = _trace(env, client, f"{sticky_ip}:80/tcp")
        assert (pinned["verdict"], pinned["backend"]) == ("dnat", pinned_to), pinned
        assert pinned["affinity"]["backend"] == pinned_to and pinned["frontend"]["affinity_sec"] == 600, pinned

        for dst in ("10.96.99.99:80/tcp", f"{HOLD_IP}:81/tcp", f"{HOLD_IP}:{HOLD_PORT}/udp"):
            other = _trace(env, client, dst)
            assert (other["verdict"], other["frontend"]) == ("not a Service", None), other

        listing = json.loads(_inspect(env, "--frontend", f"{HOLD_IP}:{HOLD_PORT}", "-o", "json"))
        assert listing["mode"] == "ipvs" and [f["ip"] for f in listing["frontends"]] == [HOLD_IP], listing
        assert held in {f["backend"] for f in listing["flows"]}, listing
        print(_inspect(env))
    finally:
        holder.kill()
        holder.wait()


def test_removed_service_stops_answering(env: Env) -> None:
    env.write("web.yaml", *web(ready(env.lab)))
    env.write("dns.yaml", service("dns", DNS_IP, DNS_PORTS), endpoint_slice("dns", ready(env.lab), DNS_PORTS))
    env.start()
    env.reaches("tcp", WEB_IP, 80, names(env.lab, 8080))
    env.remove("web.yaml")
    env.eventually(lambda: f"{WEB_IP}:80" not in env.ipvsadm(), "web's virtual server removed")
    gone = env.probe("tcp", WEB_IP, 80, 3)
    assert gone["replies"] == {} and gone["failures"] == 3, describe(gone)
    assert WEB_IP not in env.node("ip", "-o", "addr", "show", "dev", "kube-ipvs0")
    env.reaches("udp", DNS_IP, 53, names(env.lab, 5353))  # the other Service is untouched


def test_hairpin_is_masqueraded(env: Env) -> None:
    env.write("web.yaml", *web(ready(env.lab)))
    env.start()
    b1 = env.lab.backends[0]
    result = env.probe("tcp", WEB_IP, 80, 30, ns=b1.ns)
    assert result["failures"] == 0 and set(result["replies"]) == names(env.lab, 8080), describe(result)
    # b1 reaching itself through the ClusterIP sees the node's address (KUBE-LOOP-BACK); the others see b1.
    assert set(result["seen_from"]) == {b1.node_ip, b1.ip}, result["seen_from"]


def test_restart_keeps_traffic_and_cleanup_leaves_nothing(env: Env) -> None:
    env.write("web.yaml", *web(ready(env.lab)))
    # Every kind of frontend, with every set and rule of theirs in use: cleanup must remove them all.
    edge_ports = [Port("http", 80, 8080, node_port=30090), Port("dns", 53, 5353, "UDP", node_port=30091)]
    env.write("edge.yaml", service("edge", EDGE_IP, edge_ports, type="LoadBalancer", external_ips=[EDGE_EXTERNAL_IP],
                                   load_balancer_ips=[EDGE_LB_IP], source_ranges=["10.0.0.0/8"],
                                   external_traffic_policy="Local", health_check_node_port=30092),
              endpoint_slice("edge", ready(env.lab), edge_ports,
                             node_names={env.lab.backends[0].ip: NODE_NAME, env.lab.backends[1].ip: "other"}))
    proxy = env.start(f"--hostname-override={NODE_NAME}")
    env.reaches("tcp", WEB_IP, 80, names(env.lab, 8080))
    node_ip = env.lab.backends[0].node_ip
    env.eventually(lambda: f"TCP  {node_ip}:30090 rr" in env.ipvsadm(), "a NodePort virtual server per node address")
    before = env.layout()
    assert f"TCP {EDGE_LB_IP}:80 rr" in before and f"UDP {EDGE_EXTERNAL_IP}:53 rr" in before, before  # one space
    assert proxy.terminate(20.0) == 0
    env.reaches("tcp", WEB_IP, 80, names(env.lab, 8080))  # rules stay while pyproxy is down
    proxy = env.start(f"--hostname-override={NODE_NAME}")
    env.reaches("tcp", WEB_IP, 80, names(env.lab, 8080))
    assert env.layout() == before  # adopted as it was, nothing re-created
    assert proxy.terminate(20.0) == 0
    assert "KUBE-NODE-PORT-TCP" in env.node("ipset", "list", "-n")
    proxy.cleanup()
    assert env.layout()[3:] == [], env.ipvsadm()  # the three header lines only
    assert env.lab.exec(env.lab.node, "ip", "link", "show", "kube-ipvs0", check=False).returncode != 0
    assert "KUBE-" not in env.node("ipset", "list", "-n")
    saved = env.node("iptables-save")
    assert "KUBE-" not in saved, saved
    gone = env.probe("tcp", WEB_IP, 80, 2)
    assert gone["replies"] == {}, describe(gone)


def test_restarts_under_traffic_break_no_connection(env: Env) -> None:
    """pyproxy stopped (SIGTERM) and started again, then killed and started again, while 6 long-lived connections
    exchange a line every 100 ms and new connections keep coming: none breaks and none fails. A restart adopts
    the previous run's virtual servers, addresses and sets; a real server deleted and re-added on the way would
    end its established connections (net.ipv4.vs.expire_nodest_conn)."""
    env.write("web.yaml", *web(ready(env.lab)))
    proxy = env.start()
    with env.lab.under_traffic([(WEB_IP, 80)], [(WEB_IP, 80)]) as traffic:
        assert proxy.terminate(20.0) == 0
        proxy = env.start()
        time.sleep(3)  # a few syncs of the new run
        proxy.kill()
        proxy = env.start()
        time.sleep(3)
    held = traffic.held
    assert traffic.failures == {}, f"new connections failed: {traffic.failures}"
    assert traffic.count >= 20, traffic.probes
    assert held["broken"] == [] and held["exchanges"] > 0, held


# bpf mode too: this guest's kernel is Debian's 6.1, the oldest pyproxy supports (README, "Kernel requirements"), and
# the table sends real packets through the BPF programs there (SNAT included), which tests/priv's test runs do not.
# ipvs runs the IPv6 table too, in the same lab given IPv6 beside IPv4 (tests/e2e/test_flowcases.py's `ipv6=True`):
# one lab and one pyproxy start for both families, which under emulation cost about a minute each.
@pytest.mark.parametrize("mode", ["ipvs", "bpf"])
def test_the_flow_table_agrees(tmp_path: Path, mode: str) -> None:
    """tests/flowcases.py, the table every mode runs, in a lab like a real node (as test_flowcases.py); for ipvs
    also IPV6_CASES, through IPv6 virtual servers, the KUBE-6-* ipsets and ip6tables' rules."""
    ipv6 = mode == "ipvs"
    with Lab(3, prefix="ipvsft", distro=True, ipv6=ipv6) as lab:
        lab.start_servers(tcp=[8080, 9090], udp=[5353], timeout=60.0)
        # Several cases expect ICMP port unreachable in quick succession; the node's per-client ICMP rate limit
        # (a burst of 6, then 1 a second) would turn some into timeouts, whichever mode rejects.
        lab.sysctl(lab.node, {"net.ipv4.icmp_ratelimit": 0, **({"net.ipv6.icmp.ratelimit": 0} if ipv6 else {})})
        write_manifest(tmp_path, "cluster.yaml", MANIFESTS)
        with Pyproxy(lab, tmp_path, mode=mode, extra_args=[*SYNC_ARGS, f"--hostname-override={NODE_NAME}"],
                     log_path=tmp_path / "pyproxy.log") as proxy:
            proxy.start()
            wait_healthy(proxy)
            wrong = mismatches(lab, mode) + (mismatches(lab, mode, IPV6_CASES) if ipv6 else [])
            assert not wrong, "\n".join(wrong) + f"\n{proxy.log_tail()}"
            if ipv6:
                _ipv6_is_served_as_it_reads(lab, proxy)


def _ipv6_is_served_as_it_reads(lab: Lab, proxy: Pyproxy) -> None:
    # The node's own flow to an IPv6 Service without endpoints is refused, once its SYN is retransmitted (flowcases:
    # IPVS's first ICMPv6 error is lost to the connecting socket's lock).
    refused = lab.probe("tcp", "fd00:10:96::3", 80, 2, timeout=3.0, ns="node")
    assert refused["errors"] == {"refused": 2} and not refused["replies"], refused
    # `pyproxy inspect` lists the IPv6 virtual servers it reads from the kernel, with their real servers.
    listing = json.loads(proxy.cli("inspect", "-o", "json", timeout=120.0).stdout)
    by_name = {fe["name"]: fe for fe in listing["frontends"]}
    web6 = by_name.get("[fd00:10:96::1]:80/TCP")
    assert web6 is not None and web6["endpoints"], sorted(by_name)
    assert all(":" in e["ip"] for e in web6["endpoints"]), web6
    narrowed = json.loads(proxy.cli("inspect", "--frontend", "[fd00:10:96::1]:80", "-o", "json", timeout=120.0).stdout)
    assert [fe["name"] for fe in narrowed["frontends"]] == ["[fd00:10:96::1]:80/TCP"], narrowed


NODE_DEFAULTS = ("rr", "wrr", "lc", "sh", "dh", "sed", "nq")
"""The --ipvs-scheduler values the scheduler table runs with on unannotated Services."""


def test_the_scheduler_table_agrees(tmp_path: Path) -> None:
    """tests/schedcases.py: every scheduler a Service may ask for, then the node's default (--ipvs-scheduler)
    for each of NODE_DEFAULTS on the same Services without the annotation. One pyproxy per default, each
    adopting the last one's virtual servers: the changed scheduler is an edit (ipvsadm shows it applied) that
    keeps a connection open through all of them. Measured in the guest: the annotated table 30 s (56 s with
    the host busy), each default 11-13 s with pyproxy's start (12-25 s busy); the test 140-230 s."""
    wrong: list[str] = []
    seen: list[str] = []

    def update(text: str) -> None:
        write_manifest(tmp_path, "cluster.yaml", text)

    with Lab(3, prefix="ipvssc", client_addresses=schedcases.CLIENT_ADDRESSES) as lab:
        lab.start_servers(tcp=[8080], timeout=60.0)
        update(schedcases.manifests())
        args = [*SYNC_ARGS, "--ipvs-scheduler=rr"]
        with Pyproxy(lab, tmp_path, mode="ipvs", extra_args=args, log_path=tmp_path / "pyproxy.log") as proxy:
            proxy.start()
            wait_healthy(proxy)
            started = time.monotonic()
            wrong += schedcases.mismatches(lab, "ipvs", update=update, seen=seen)
            seen.append(f"annotated table: {time.monotonic() - started:.1f}s")
            table = lab.exec(lab.node, "ipvsadm", "-Ln").stdout
            assert f"{schedcases.service_ip('maglev')}:80 mh" in table, table
            # sh and mh read back with their fallback flag, as written: no edit at every sync.
            read = lab.python(lab.node, "-c", "from pyproxy.dataplane.ipvs import kernel\n"
                              "print(sorted({v.scheduler for v in kernel.read_virtuals(kernel.open_ipvs()).values()}))")
            assert read.stdout.split() == ["['dh',", "'lc',", "'mh',", "'nq',", "'rr',", "'sed',", "'sh',", "'wrr']"], \
                read.stdout
            # IPVS has no random choice: the node's scheduler, said once per Service, not at every sync.
            assert f"{schedcases.service_ip('random')}:80 rr" in table, table
            for name in ("default/sched-random", "default/sticky-random"):
                assert proxy.log_text().count(f"Service {name} asks for the random scheduler") == 1, proxy.log_tail()
            assert proxy.terminate(20.0) == 0
            update(schedcases.manifests(annotated=False))
            holder = lab.popen(lab.client, sys.executable, "-m", "labkit.traffic", "hold",
                               schedcases.service_ip("rr"), "80", "--count", "1", stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert holder.stdin is not None and holder.stdout is not None
            held = json.loads(holder.stdout.readline())[0]
            for default in NODE_DEFAULTS:
                restarted = Pyproxy(lab, tmp_path, mode="ipvs", extra_args=[*SYNC_ARGS, f"--ipvs-scheduler={default}"],
                                    log_path=tmp_path / f"pyproxy-{default}.log")
                started = time.monotonic()
                restarted.start()
                wait_healthy(restarted)
                table = lab.exec(lab.node, "ipvsadm", "-Ln").stdout
                assert f"{schedcases.service_ip(default)}:80 {default}" in table, table
                wrong += schedcases.mismatches(lab, "ipvs", schedulers=[default], annotated=False, seen=seen)
                holder.stdin.write(f"keep {held}\n")
                holder.stdin.flush()
                # Answered through the same connection: the scheduler's edit left it alone.
                assert json.loads(holder.stdout.readline()) == [held], f"the connection held to {held} ended"
                seen.append(f"--ipvs-scheduler={default}: {time.monotonic() - started:.1f}s with the start")
                assert restarted.terminate(20.0) == 0
            holder.stdin.close()
    print("\n".join(seen))
    assert not wrong, "\n".join(wrong + seen)


@pytest.mark.xfail("ipvs" in twonode.PENDING_MODES, strict=True, raises=AssertionError,
                   reason="ipvs does not serve all of issue 10 yet (twonode.PENDING_MODES)")
def test_the_two_node_table_agrees(tmp_path: Path) -> None:
    """Issue 10's acceptance (tests/twonode.py) as tests/e2e/test_twonode.py runs it for the other modes. The
    kernel's ICMP rate limit is left as it is: a flow to a Service without endpoints must be refused at once."""
    with Lab(twonode.LOCAL_PODS, prefix="ipvs2n", remote_backends=twonode.REMOTE_PODS, second_client=True,
             distro=True) as lab:
        lab.start_servers(tcp=[8080, 9090], udp=[5353], timeout=60.0)
        write_manifest(tmp_path, "cluster.yaml", twonode.MANIFESTS)
        with Pyproxy(lab, tmp_path, mode="ipvs", extra_args=[*SYNC_ARGS, f"--hostname-override={twonode.NODE_NAME}"],
                     log_path=tmp_path / "pyproxy.log") as proxy:
            proxy.start()
            wait_healthy(proxy)
            wrong = twonode.mismatches(lab, "ipvs")
            assert not wrong, "\n".join(wrong) + f"\n{proxy.log_tail()}"


def test_a_udp_client_on_a_fixed_port_follows_a_replaced_endpoint(env: Env) -> None:
    """tests/udpswitch.py as on the host (tests/e2e/test_udp_endpoint_switch.py): IPVS deletes the UDP real
    server at once, and pyproxy deletes the flow's conntrack entries, as upstream. On the guest's kernel (Debian
    6.1) IPVS alone already moves the flow (expire_nodest_conn=1: checked by turning the deletion off, which still
    passed, 0.5-0.6 s), so this guards the behaviour in ipvs mode, not the deletion; the unit tests in
    tests/unit/test_ipvs_render.py guard the plan. Looser bound than the host's: the guest is emulated.
    Measured: 0.30-0.36 s from the manifest change, as soon as new flows."""
    b1, b2 = env.lab.backends[0].ip, env.lab.backends[1].ip
    port = Port("dns", 53, 5353, "UDP", node_port=30054)
    svc = service("dns-switch", "10.96.0.54", [port], type="NodePort")
    env.write("dns.yaml", svc, endpoint_slice("dns-switch", {b1: True}, [port]))
    env.start()
    node_ip = env.lab.backends[0].node_ip
    env.eventually(lambda: f"UDP  {node_ip}:30054 rr" in env.ipvsadm(), "the NodePort's virtual server")
    targets = {"cluster-ip": ("10.96.0.54", 53, 40053), "node-port": (node_ip, 30054, 40054)}
    timings = udpswitch.measure(env.lab, targets, lambda: env.write(
        "dns.yaml", svc, endpoint_slice("dns-switch", {b2: True}, [port])), watch=8.0)
    print(f"\nipvs: {udpswitch.describe(timings)}")
    for target, (applied, switched) in timings.items():
        assert switched - applied <= 3.0, f"{target}: fixed-port flow reached b2 {switched - applied:.2f}s late"
