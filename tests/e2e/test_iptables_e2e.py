"""pyproxy --proxy-mode=iptables end to end, on both iptables backends (legacy and nft), in a namespace lab.

What a user would notice: who answers a ClusterIP (ready endpoints only, TCP and UDP, a two-port Service), how
fast a removed endpoint or Service stops getting flows, a Service without endpoints refused at once, ClientIP
affinity, a UDP flow moved off an endpoint that left (conntrack), a restart that keeps traffic and adds no
duplicate rule, and `pyproxy cleanup` leaving nothing of ours but everything of others.

The refusal test runs in the distro lab: iptables rejects in the filter table, which only sees packets the
node can route, and only the distro lab's node has a default route (a real node always does). TCP is refused
with a reset, which is not rate-limited; UDP with ICMP, which the kernel limits per client (a burst of 6, then
one a second), so the test sends only 3 datagrams.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from labkit import describe
from labkit.manifests import Port, endpoint_slice, service
from labkit.netns import NODE_CLIENT_IP
from scenarios import (
    DNS_IP,
    DNS_PORTS,
    WEB_IP,
    WEB_PORTS,
    all_ready,
    assert_core_traffic,
    dns,
    names,
    remove_b3,
    remove_web,
    start_web_and_dns,
    web,
    write_core_manifests,
)

pytestmark = pytest.mark.root

MODE = "iptables"
BACKENDS = ["legacy", "nft"]
EMPTY_IP, STICKY_IP, LB_CLUSTER_IP = "10.96.0.30", "10.96.0.40", "10.96.0.50"
LB_PORTS = [Port("http", 80, 8080, node_port=30080)]
NODE = "lab-node"


def start(env, backend: str):
    return env.start(mode=MODE, args=[f"--iptables-backend={backend}"])


def save(env, backend: str) -> str:
    return env.lab.exec(env.lab.node, f"iptables-{backend}-save").stdout


def kube_rules(env, backend: str) -> list[str]:
    return [line for line in save(env, backend).splitlines() if line.startswith("-A ") and "KUBE-" in line]


@pytest.mark.parametrize("backend", BACKENDS)
def test_clusterip_reaches_ready_backends_only(make_env, backend: str, record_property) -> None:
    env = make_env(3)
    write_core_manifests(env)
    start(env, backend)
    assert_core_traffic(env)
    rules = kube_rules(env, backend)
    record_property("kube_rules", len(rules))
    assert any(line.startswith("-A KUBE-SVC-") for line in rules), rules
    other = "nft" if backend == "legacy" else "legacy"
    assert kube_rules(env, other) == [], f"rules written to iptables-{other} too"


def test_auto_backend_is_what_iptables_is(make_env) -> None:
    env = make_env(2)
    env.write("web.yaml", *web(all_ready(env)))
    proxy = env.start(mode=MODE)
    version = env.lab.exec(env.lab.node, "iptables", "--version").stdout
    backend = "nft" if "nf_tables" in version else "legacy"
    assert proxy.wait_for_log(f"{backend} backend", 5.0), proxy.log_tail()
    assert kube_rules(env, backend)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))


@pytest.mark.parametrize("backend", BACKENDS)
def test_removed_endpoint_and_service_stop_getting_new_connections(make_env, backend: str,
                                                                   record_property) -> None:
    env = make_env(3)
    start_web_and_dns(env, mode=MODE, args=[f"--iptables-backend={backend}"])
    elapsed = remove_b3(env)
    record_property("endpoint_removal_seconds", elapsed)
    assert elapsed is not None, "b3 still gets new connections 3 s after it left the EndpointSlice"
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})
    env.assert_reaches("udp", DNS_IP, 53, {"b1:5353", "b2:5353"})

    elapsed = remove_web(env, 3.0)
    record_property("service_removal_seconds", elapsed)
    assert elapsed is not None, "the ClusterIP of a removed Service still answers after 3 s"
    assert not any("web:http" in line for line in kube_rules(env, backend)), "chains of the removed Service"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_endpoints_is_refused_quickly(make_env, backend: str, record_property) -> None:
    env = make_env(2, distro=True)
    env.write("web.yaml", service("web", EMPTY_IP, WEB_PORTS), endpoint_slice("web", {}, WEB_PORTS))
    env.write("dns.yaml", service("dns", EMPTY_IP, DNS_PORTS), endpoint_slice("dns", {}, DNS_PORTS))
    start(env, backend)
    tcp = env.probe("tcp", EMPTY_IP, 80, 20, timeout=2.0)
    record_property("refused_tcp_connects_seconds", tcp["elapsed"])
    assert tcp["errors"] == {"refused": 20}, describe(tcp)
    assert tcp["elapsed"] < 1.0, f"20 refused connects took {tcp['elapsed']}s: not refused at once"
    udp = env.probe("udp", EMPTY_IP, 53, 3, timeout=2.0)
    assert udp["errors"] == {"refused": 3}, describe(udp)

    # The first endpoint turns the rejection into service.
    b1 = env.lab.backends[0]
    env.write("web.yaml", service("web", EMPTY_IP, WEB_PORTS), endpoint_slice("web", {b1.ip: True}, WEB_PORTS))
    assert env.poll(lambda: env.probe("tcp", EMPTY_IP, 80, 1)["replies"] == {"b1:8080": 1}, 3.0) is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_session_affinity_sticks_to_one_backend(make_env, backend: str) -> None:
    env = make_env(3)
    env.write("sticky.yaml", service("sticky", STICKY_IP, WEB_PORTS, affinity_seconds=600),
              endpoint_slice("sticky", all_ready(env), WEB_PORTS))
    env.write("web.yaml", *web(all_ready(env)))
    start(env, backend)
    sticky = env.probe("tcp", STICKY_IP, 80, 30)
    assert sticky["failures"] == 0 and len(sticky["replies"]) == 1, describe(sticky)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))  # no affinity: still spread


@pytest.mark.parametrize("backend", BACKENDS)
def test_hairpin_is_masqueraded(make_env, backend: str) -> None:
    env = make_env(2)
    b1 = env.lab.backends[0]
    env.write("web.yaml", *web({b1.ip: True}))
    start(env, backend)
    # b1 reaching its own Service and picked: without SNAT it would answer itself directly, not via the node.
    result = env.lab.probe("tcp", WEB_IP, 80, 5, ns=b1.ns)
    assert result["replies"] == {"b1:8080": 5}, describe(result)
    assert set(result["seen_from"]) == {b1.node_ip}, result["seen_from"]
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080"})  # from outside: the client's own address


@pytest.mark.parametrize(("flags", "client_masqueraded", "pod_masqueraded"), [
    (["--masquerade-all"], True, True),
    (["--cluster-cidr=10.201.0.0/16"], True, False),  # the backends' range: the lab's "pods"
], ids=["masquerade-all", "cluster-cidr"])
def test_masquerade_flags(make_env, flags: list[str], client_masqueraded: bool, pod_masqueraded: bool) -> None:
    env = make_env(2)
    b1, b2 = env.lab.backends
    env.write("web.yaml", *web({b2.ip: True}))
    env.start(mode=MODE, args=["--iptables-backend=nft", *flags])
    from_client = env.probe("tcp", WEB_IP, 80, 5)
    assert from_client["replies"] == {"b2:8080": 5}, describe(from_client)
    assert set(from_client["seen_from"]) == {b2.node_ip if client_masqueraded else env.lab.client_ip}
    from_pod = env.lab.probe("tcp", WEB_IP, 80, 5, ns=b1.ns)
    assert from_pod["replies"] == {"b2:8080": 5}, describe(from_pod)
    assert set(from_pod["seen_from"]) == {b2.node_ip if pod_masqueraded else b1.ip}


EXT_PORTS = [Port("http", 80, 8080, node_port=30090)]
LOCAL_PORTS = [Port("http", 80, 8080, node_port=30091)]
ELSEWHERE_PORTS = [Port("http", 80, 8080, node_port=30092)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_external_frontends_masquerade_and_short_circuit_as_upstream(make_env, backend: str) -> None:
    """Who the endpoints see, per source and externalTrafficPolicy (the flow table checks who answers):
    Cluster SNATs every flow to a node address; Local keeps an external client's address and limits it to this
    node's endpoint; pods (--cluster-cidr) reach every endpoint keeping theirs; the node's own processes reach
    external IPs, load-balancer IPs and NodePorts on the OUTPUT path, masqueraded."""
    env = make_env(3, distro=True)  # a default route: the node's own flows to an external IP need one
    b1, b2, b3 = env.lab.backends
    elsewhere = {b1.ip: "other-node", b2.ip: "other-node"}
    env.write("ext.yaml",
              service("ext", "10.96.0.60", EXT_PORTS, type="LoadBalancer", external_ips=["192.0.2.20"],
                      load_balancer_ips=["203.0.113.20"]),
              endpoint_slice("ext", {b2.ip: True}, EXT_PORTS),
              service("local", "10.96.0.61", LOCAL_PORTS, type="NodePort", external_traffic_policy="Local",
                      external_ips=["192.0.2.21"]),
              endpoint_slice("local", {b1.ip: True, b2.ip: True}, LOCAL_PORTS, node_names={**elsewhere, b1.ip: NODE}),
              service("elsewhere", "10.96.0.62", ELSEWHERE_PORTS, type="NodePort", external_traffic_policy="Local"),
              endpoint_slice("elsewhere", {b2.ip: True}, ELSEWHERE_PORTS, node_names=elsewhere))
    env.start(mode=MODE, args=[f"--iptables-backend={backend}", "--cluster-cidr=10.201.0.0/16",
                               f"--hostname-override={NODE}"])

    def seen(ip: str, port: int, ns: object = None) -> tuple[dict[str, int], set[str]]:
        result = env.lab.probe("tcp", ip, port, 8, ns=ns)
        assert result["failures"] == 0, describe(result)
        return result["replies"], set(result["seen_from"])

    assert seen("192.0.2.20", 80) == ({"b2:8080": 8}, {b2.node_ip})  # Cluster: SNATed, from the client too
    assert seen(NODE_CLIENT_IP, 30090) == ({"b2:8080": 8}, {b2.node_ip})
    assert seen(NODE_CLIENT_IP, 30091) == ({"b1:8080": 8}, {env.lab.client_ip})  # Local: this node's, unSNATed
    replies, sources = seen("192.0.2.21", 80, b3.ns)  # a pod: every endpoint, its own address
    assert set(replies) == {"b1:8080", "b2:8080"} and sources == {b3.ip}, (replies, sources)
    assert seen(NODE_CLIENT_IP, 30092, b3.ns) == ({"b2:8080": 8}, {b3.ip})  # no local endpoint: short circuit
    for ip, port in (("192.0.2.20", 80), ("203.0.113.20", 80), (NODE_CLIENT_IP, 30090), (NODE_CLIENT_IP, 30092)):
        assert seen(ip, port, env.lab.node) == ({"b2:8080": 8}, {b2.node_ip}), (ip, port)  # the node: SNATed


# A UDP "flow" from one socket: `find NAME` sends from fresh sockets until NAME answers and keeps that socket;
# `send` sends on it again. One reply name (or the error) per line.
UDP_FLOW = """
import socket, sys
sock = None
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "find":
        for _ in range(200):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.0); s.connect((sys.argv[1], 53))
            s.send(b"probe\\n")
            try:
                name = s.recv(2048).split()[0].decode()
            except OSError:
                name = "timeout"
            if name.startswith(cmd[1] + ":"):
                sock = s
                break
            s.close()
    else:
        sock.send(b"probe\\n")
        try:
            name = sock.recv(2048).split()[0].decode()
        except OSError as e:
            name = type(e).__name__
    print(name, flush=True)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_udp_flow_leaves_an_endpoint_that_left(make_env, backend: str, record_property) -> None:
    env = make_env(3)
    env.write("dns.yaml", *dns(all_ready(env)))
    start(env, backend)
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))
    flow = env.lab.popen(env.lab.client, sys.executable, "-c", UDP_FLOW, DNS_IP, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert flow.stdin is not None and flow.stdout is not None

    def ask(cmd: str) -> str:
        flow.stdin.write(cmd + "\n")
        flow.stdin.flush()
        return flow.stdout.readline().strip()

    try:
        assert ask("find b3") == "b3:5353"
        assert ask("send") == "b3:5353"  # the same flow stays on its backend
        b1, b2, _ = env.lab.backends
        env.write("dns.yaml", *dns({b1.ip: True, b2.ip: True}))
        # b3's server still answers: only a deleted conntrack entry moves this flow off it.
        start_time = time.monotonic()
        elapsed = env.poll(lambda: ask("send") in ("b1:5353", "b2:5353"), deadline=5.0, interval=0.1)
        record_property("udp_flow_moved_seconds", elapsed)
        assert elapsed is not None, f"the UDP flow still reaches b3 {time.monotonic() - start_time:.1f}s later"
    finally:
        flow.stdin.close()
        flow.wait(timeout=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_restart_keeps_traffic_and_adds_no_duplicate(make_env, backend: str, record_property) -> None:
    env = make_env(3)
    env.write("web.yaml", *web(all_ready(env)))
    env.write("dns.yaml", *dns(all_ready(env)))
    proxy = start(env, backend)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    before = sorted(kube_rules(env, backend))

    assert proxy.terminate(10.0) == 0
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))  # the rules outlive the process
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))

    second = start(env, backend)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    assert sorted(kube_rules(env, backend)) == before, "the second instance changed or duplicated rules"
    # It adopted the first one's chains and keeps them up to date.
    b1, b2, _ = env.lab.backends
    env.write("web.yaml", *web({b1.ip: True, b2.ip: True}))
    assert env.poll(lambda: set(env.probe("tcp", WEB_IP, 80, 20)["replies"]) == {"b1:8080", "b2:8080"},
                    5.0) is not None
    assert second.running


# The backend driven directly in the node: a sync the kernel refuses (an affinity timeout xt_recent cannot hold)
# raises, keeps every rule as it was, and the next sync, partial as asked, runs as a full one and succeeds.
FAILING_SYNC = """
import sys
from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import DataplaneError
from pyproxy.dataplane.iptables.backend import IptablesDataplane, IptablesSettings
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, DesiredState, Frontend, ServicePortState

def state(affinity):
    b = (Backend("10.201.1.2", 8080),)
    return DesiredState({"d/web": (ServicePortState("d/web", "", Frontend("10.96.0.10", 80, Protocol.TCP), b, b,
                                                    affinity),)})

dp = IptablesDataplane(IptablesSettings(backend=sys.argv[1]))
dp.start()
dp.apply(state(0), None)
before = nf.save(dp.tools)
try:
    dp.apply(state(2**40), {"d/web"})
    print("no error")
except DataplaneError as e:
    print("refused:", "--seconds 1099511627776" in str(e), nf.save(dp.tools) == before)
dp.apply(state(0), {"d/web"})
print("recovered:", nf.save(dp.tools) == before)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_sync_keeps_the_previous_rules(make_env, backend: str) -> None:
    env = make_env(1)
    out = env.lab.python(env.lab.node, "-c", FAILING_SYNC, backend).stdout.split("\n")
    assert out[:2] == ["refused: True True", "recovered: True"], out
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080"})


@pytest.mark.parametrize("backend", BACKENDS)
def test_cleanup_removes_ours_and_leaves_everyone_elses(make_env, backend: str) -> None:
    env = make_env(2)
    env.write("web.yaml", *web(all_ready(env)))
    env.write("empty.yaml", service("empty", EMPTY_IP, WEB_PORTS), endpoint_slice("empty", {}, WEB_PORTS))
    # Every per-service chain kind: KUBE-EXT (and KUBE-NODEPORTS), KUBE-SVL (Local, b1 on this node), KUBE-FW.
    b1 = env.lab.backends[0]
    env.write("lb.yaml", service("lb", LB_CLUSTER_IP, LB_PORTS, type="LoadBalancer", external_traffic_policy="Local",
                                 health_check_node_port=32100, load_balancer_ips=["203.0.113.10"],
                                 external_ips=["192.0.2.10"], source_ranges=["198.51.100.0/24"]),
              endpoint_slice("lb", {b1.ip: True}, LB_PORTS, node_names={b1.ip: NODE}))
    ipt = f"iptables-{backend}"
    node = env.lab.node
    # Someone else's rules, in the chains ours jump from and in a chain of their own.
    env.lab.exec(node, ipt, "-t", "nat", "-N", "OTHER")
    env.lab.exec(node, ipt, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "5555", "-j", "OTHER")
    env.lab.exec(node, ipt, "-t", "filter", "-A", "FORWARD", "-p", "tcp", "--dport", "5555", "-j", "ACCEPT")
    # With the masquerade rules too, which KUBE-SERVICES holds besides the jumps.
    proxy = env.start(mode=MODE, args=[f"--iptables-backend={backend}", "--cluster-cidr=10.201.0.0/16",
                                       f"--hostname-override={NODE}"])
    env.probe("tcp", WEB_IP, 80, 3)
    assert any("KUBE-MARK-MASQ" in line for line in kube_rules(env, backend) if "cluster IP" in line)
    made = [line.split()[0][1:] for line in save(env, backend).splitlines() if line.startswith(":KUBE-")]
    assert {"KUBE-NODEPORTS", "KUBE-EXTERNAL-SERVICES", "KUBE-PROXY-FIREWALL"} <= set(made), made
    assert all(any(c.startswith(prefix) for c in made) for prefix in ("KUBE-EXT-", "KUBE-SVL-", "KUBE-FW-")), made
    assert proxy.terminate(10.0) == 0
    out = proxy.cleanup().stdout
    assert "KUBE-SERVICES" in out, out
    assert env.netfilter_leftovers() == []
    after = save(env, backend)
    assert ":OTHER" in after and "-A PREROUTING -p tcp -m tcp --dport 5555 -j OTHER" in after, after
    assert "-A FORWARD -p tcp -m tcp --dport 5555 -j ACCEPT" in after, after
    gone = env.probe("tcp", WEB_IP, 80, 3, timeout=0.5)
    assert not gone["replies"], f"the ClusterIP still answers after cleanup: {describe(gone)}"
    assert "KUBE-" not in proxy.cleanup().stdout  # a second cleanup finds nothing
