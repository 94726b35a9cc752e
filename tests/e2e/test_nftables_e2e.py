"""pyproxy --proxy-mode=nftables end to end: the CLI in a lab's node namespace, real traffic from the client.

What a user notices: who answers a ClusterIP (ready endpoints only, TCP and UDP, each port to its own target
port), how fast a change takes effect, a Service without endpoints refused at once, ClientIP affinity,
masquerading as upstream (hairpin; --masquerade-all and --cluster-cidr; external traffic by its
externalTrafficPolicy, pods and the node short-circuiting a Local one), a restart that keeps traffic
flowing, and `pyproxy cleanup` leaving nothing of ours. Every table lives in the lab's own namespaces.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import flowcases as fc
import pytest
from labkit import describe
from labkit.manifests import endpoint_slice, service
from scenarios import (
    DNS_IP,
    MULTI_IP,
    WEB_IP,
    WEB_PORTS,
    assert_core_traffic,
    dns,
    names,
    remove_b3,
    remove_web,
    start_web_and_dns,
    wait_gone,
    web,
    write_core_manifests,
)

pytestmark = pytest.mark.root

MODE = "nftables"
STICKY_IP = "10.96.0.30"


def sticky(ready: Mapping[str, bool | None], timeout: int = 60) -> list[str]:
    return [service("sticky", STICKY_IP, WEB_PORTS, affinity_seconds=timeout),
            endpoint_slice("sticky", ready, WEB_PORTS)]


def all_ready(env) -> dict[str, bool | None]:
    return {b.ip: True for b in env.lab.backends}


def table(env) -> dict | None:
    """pyproxy's table in the node namespace as `nft -j` lists it; None when there is none."""
    cp = env.lab.exec(env.lab.node, "nft", "-j", "list", "table", "ip", "pyproxy", check=False)
    return json.loads(cp.stdout) if cp.returncode == 0 else None


def rule_count(env) -> int:
    listing = table(env)
    return sum(1 for item in (listing or {}).get("nftables", []) if "rule" in item)


def udp_flows_to(env, vip: str, endpoint_ip: str) -> int:
    """UDP conntrack entries in the node for flows to `vip` DNATed to `endpoint_ip`."""
    out = env.lab.exec(env.lab.node, "conntrack", "-L", "-p", "udp", "--orig-dst", vip, "--dst-nat", endpoint_ip,
                       check=False).stdout
    return len(out.splitlines())


@pytest.mark.parametrize("distro", [False, True], ids=["plain", "distro"])
def test_clusterip_reaches_ready_backends_only(make_env, distro: bool, record_property) -> None:
    env = make_env(3, distro=distro)
    write_core_manifests(env)
    env.start(mode=MODE)
    record_property("nft_rules", rule_count(env))
    assert_core_traffic(env)
    # Traffic that is not to a frontend stays untouched: another port of a ClusterIP is not translated.
    other = env.probe("tcp", MULTI_IP, 91, 3, timeout=0.5)
    assert not other["replies"], describe(other)


def test_removed_endpoint_and_service(make_env, record_property) -> None:
    env = make_env(3)
    start_web_and_dns(env, mode=MODE)
    b3 = env.lab.backends[2]
    assert udp_flows_to(env, DNS_IP, b3.ip) > 0, "no UDP conntrack entries to b3 to begin with"
    elapsed = remove_b3(env)
    record_property("endpoint_removal_seconds", elapsed)
    assert elapsed is not None, "b3 still gets new flows 3 s after it left the EndpointSlice"
    # UDP flows have no end: the ones b3 had are deleted from conntrack, so their clients move on (upstream).
    assert udp_flows_to(env, DNS_IP, b3.ip) == 0, "UDP conntrack entries to the removed b3 remain"
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})
    env.assert_reaches("udp", DNS_IP, 53, {"b1:5353", "b2:5353"})

    gone = remove_web(env, 5.0)
    record_property("service_removal_seconds", gone)
    assert gone is not None, "the ClusterIP of a deleted Service still answers after 5 s"
    chains = [i["chain"]["name"] for i in table(env)["nftables"] if "chain" in i]
    assert not [c for c in chains if "default/web/" in c], f"chains of the deleted Service remain: {chains}"
    env.assert_no_checksum_errors()


def test_no_endpoints_is_refused_quickly(make_env, record_property) -> None:
    env = make_env(2)
    none_ready = {b.ip: False for b in env.lab.backends}
    env.write("web.yaml", *web(none_ready))
    env.write("dns.yaml", *dns(none_ready))
    env.start(mode=MODE)
    # TCP is refused with a reset, which is not rate-limited: many connects fail at once.
    tcp = env.probe("tcp", WEB_IP, 80, 20, timeout=2.0)
    record_property("refused_tcp_connects_seconds", tcp["elapsed"])
    assert tcp["errors"] == {"refused": 20}, describe(tcp)
    assert tcp["elapsed"] < 1.0, f"20 refused connects took {tcp['elapsed']}s: not refused at once"
    # UDP is refused with ICMP port-unreachable, which the kernel rate-limits per client (a burst of 6, then
    # one a second; upstream's REJECT alike): 3 datagrams stay within the burst.
    udp = env.probe("udp", DNS_IP, 53, 3, timeout=2.0)
    assert udp["errors"] == {"refused": 3}, describe(udp)

    # Endpoints becoming ready turn the refusal into service.
    env.write("web.yaml", *web(all_ready(env)))
    assert env.poll(lambda: bool(env.probe("tcp", WEB_IP, 80, 3)["replies"]), deadline=5.0) is not None
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))


def test_session_affinity_sticks_to_one_backend(make_env) -> None:
    env = make_env(3)
    env.write("sticky.yaml", *sticky(all_ready(env)))
    env.write("web.yaml", *web(all_ready(env)))
    env.start(mode=MODE)
    result = env.probe("tcp", STICKY_IP, 80, 30)
    assert result["failures"] == 0 and len(result["replies"]) == 1, describe(result)
    # Without affinity, the same client is spread over every backend.
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    # The chosen backend leaving moves the client to another one, which then sticks.
    chosen = next(iter(result["replies"])).split(":")[0]
    rest = {b.ip: True for b in env.lab.backends if b.name != chosen}
    env.write("sticky.yaml", *sticky(rest))
    moved = env.poll(lambda: f"{chosen}:8080" not in env.probe("tcp", STICKY_IP, 80, 5)["replies"], deadline=5.0)
    assert moved is not None, f"{chosen} still answers after it left the EndpointSlice"
    again = env.probe("tcp", STICKY_IP, 80, 20)
    assert again["failures"] == 0 and len(again["replies"]) == 1, describe(again)


def test_hairpin_and_masquerade(make_env) -> None:
    env = make_env(3)
    env.write("web.yaml", *web(all_ready(env)))
    env.start(mode=MODE)
    b1 = env.lab.backends[0]
    # b1 reaching its own Service: when it picks itself, the reply must come back through the node, so the
    # node masquerades it (upstream's KUBE-MARK-MASQ for `-s <endpoint ip>`).
    hairpin = env.probe("tcp", WEB_IP, 80, 60, ns=b1.ns)
    assert hairpin["failures"] == 0 and "b1:8080" in hairpin["replies"], describe(hairpin)
    assert set(hairpin["seen_from"]) == {b1.ip, b1.node_ip}, hairpin["seen_from"]
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))  # the client itself keeps its address


@pytest.mark.parametrize("args", [["--masquerade-all"], ["--cluster-cidr=10.201.0.0/16"]], ids=["all", "cidr"])
def test_masquerade_settings(make_env, args: list[str]) -> None:
    env = make_env(2)
    env.write("web.yaml", *web(all_ready(env)))
    env.start(mode=MODE, args=args)
    result = env.probe("tcp", WEB_IP, 80, 30)
    assert result["failures"] == 0 and set(result["replies"]) == names(env, 8080), describe(result)
    # The client is outside the cluster CIDR (or everything is masqueraded): backends see the node's address.
    assert set(result["seen_from"]) == {b.node_ip for b in env.lab.backends}, result["seen_from"]


def test_restart_keeps_traffic_and_cleanup_removes_the_table(make_env, record_property) -> None:
    env = make_env(3)
    env.write("web.yaml", *web(all_ready(env)))
    env.write("dns.yaml", *dns(all_ready(env)))
    proxy = env.start(mode=MODE)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    before = table(env)
    assert before is not None

    assert proxy.terminate(10.0) == 0
    # SIGTERM leaves the table: traffic keeps flowing while no pyproxy runs.
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))

    # A change made while it was down, then a second instance: it adopts the table and applies the change.
    b1, b2, _ = env.lab.backends
    env.write("web.yaml", *web({b1.ip: True, b2.ip: True}))
    start = time.monotonic()
    proxy.start()
    proxy.wait_healthy(20.0)
    record_property("restart_healthy_seconds", round(time.monotonic() - start, 3))
    assert proxy.wait_for_log("kept table ip pyproxy", 5.0), "the second instance did not adopt the table"
    gone = wait_gone(env, "tcp", WEB_IP, 80, "b3:8080", 5.0)
    assert gone is not None, "the change made while pyproxy was down was not applied"
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))

    assert proxy.terminate(10.0) == 0
    out = proxy.cleanup().stdout
    assert "pyproxy" in out, f"cleanup did not report the table: {out!r}"
    assert table(env) is None, "table ip pyproxy is still there after cleanup"
    after = env.probe("tcp", WEB_IP, 80, 3, timeout=0.5)
    assert not after["replies"], f"the ClusterIP still answers after cleanup: {describe(after)}"


def test_external_traffic_is_snated_with_cluster_policy_and_keeps_the_client_with_local(make_env) -> None:
    """Who the endpoint sees (upstream's semantics): externalTrafficPolicy Cluster SNATs every external flow to
    the node, so replies from another node's endpoint would come back through it; Local keeps the client's own
    address; pods (with --cluster-cidr) short-circuit a Local Service with no endpoint here to every endpoint,
    keeping their address; the node's own connections are masqueraded."""
    env = make_env(3, distro=True)
    env.write_raw("cluster.yaml", fc.MANIFESTS)
    env.start(mode=MODE, args=[f"--hostname-override={fc.NODE_NAME}", "--cluster-cidr=10.201.0.0/16"])
    node_side = {b.node_ip for b in env.lab.backends[:2]}
    for ip, port in ((fc.NODE_IP, 30080), (fc.LB_IP, 80), (fc.EXTERNAL_IP, 80)):
        cluster = env.probe("tcp", ip, port, 30)
        assert cluster["failures"] == 0 and set(cluster["replies"]) == {"b1:8080", "b2:8080"}, describe(cluster)
        assert set(cluster["seen_from"]) == node_side, (ip, port, cluster["seen_from"])
    local = env.probe("tcp", fc.NODE_IP, 30082, 30)
    assert local["failures"] == 0 and set(local["replies"]) == {"b1:8080"}, describe(local)
    assert set(local["seen_from"]) == {env.lab.client_ip}, local["seen_from"]
    b3 = env.lab.backends[2]
    pod = env.probe("tcp", fc.NODE_IP, 30083, 30, ns=b3.ns)
    assert pod["failures"] == 0 and set(pod["replies"]) == {"b1:8080", "b2:8080"}, describe(pod)
    assert set(pod["seen_from"]) == {b3.ip}, pod["seen_from"]
    outside = env.probe("tcp", fc.NODE_IP, 30083, 4, timeout=0.5)
    assert not outside["replies"] and not outside["errors"].get("refused"), describe(outside)  # dropped
    env.assert_no_checksum_errors()
