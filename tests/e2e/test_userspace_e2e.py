"""The userspace mode with real packets: chosen by --proxy-mode=auto when no kernel mode can run, serving the whole
flow table (tests/flowcases.py) there; and its retry, which no kernel mode has: with one endpoint in three not
listening, every connection is served (over IPv4 and IPv6), where bpf and nftables refuse about a third; and its
local routes of both families across a stop, a restart and cleanup."""

from __future__ import annotations

import re

import pytest
from flowcases import MANIFESTS, NODE_NAME, mismatches
from labkit import describe
from labkit.manifests import Port, endpoint_slice, service
from labkit.netns import ipv6_of

pytestmark = pytest.mark.root

HTTP = Port("http", 80, 8080)
B1, B2, B3 = "10.201.1.2", "10.201.2.2", "10.201.3.2"
VIP, VIP6 = "10.96.50.1", "fd00:10:96:50::1"
OTHER, OTHER6 = "10.96.50.2", "fd00:10:96:50::2"


def test_auto_without_any_kernel_mode_runs_userspace_and_the_flow_table_passes(make_env, tmp_path) -> None:
    # Every kernel mode made unavailable as a node could lack it: no CAP_BPF or CAP_SYS_ADMIN (bpf), no nft,
    # iptables nor ipset in PATH (nftables, iptables, ipvs; this kernel has no IPVS either). CAP_NET_ADMIN stays:
    # the userspace mode needs it for the Service addresses.
    empty = tmp_path / "no-tools"
    empty.mkdir()
    wrapper = ["env", f"PATH={empty}", "/usr/sbin/capsh", "--drop=cap_bpf,cap_sys_admin,cap_perfmon", "--", "-c",
               'exec "$@"', "pyproxy"]
    env = make_env(3, distro=True)
    env.write("cluster.yaml", MANIFESTS)
    proxy = env.start(mode="auto", args=[f"--hostname-override={NODE_NAME}"], wrapper=wrapper)
    log = proxy.log_text()
    for mode in ("bpf", "ipvs", "nftables", "iptables"):
        assert re.search(rf"proxy mode {mode} skipped: .+", log), log
    assert "proxy mode userspace (chosen automatically)" in log, log
    assert 'pyproxy_proxy_mode{mode="userspace"} 1.0' in env.lab.http_get(env.lab.node, proxy.metrics_url)["body"]
    # Every answered flow takes a few wakeups of pyproxy's process (accept, connect, a copy each way): on this shared
    # 2-core machine at load 12 one flow in several hundred took over the table's 1 s (p99 40-100 ms, measured), which
    # the kernel modes, with no process on the path, do not. Hence 3 s a flow; refusals and drops are as in the table.
    wrong = mismatches(env.lab, "userspace", timeout=3.0)
    assert not wrong, "userspace (auto):\n" + "\n".join(wrong)


def _local_routes(env, family: str) -> list[str]:
    """The node's local routes of the userspace mode (proto 203) of `family` ("-4" or "-6"), one a line."""
    out = env.lab.exec(env.lab.node, "ip", family, "route", "show", "table", "local", "proto", "203").stdout
    return out.strip().splitlines()


def test_a_connection_to_an_endpoint_that_does_not_listen_is_retried_on_the_next(make_env) -> None:
    """Issue 14's measure: 100 new connections to a Service of three endpoints, one of which (b3) does not listen.
    The kernel modes choose once, at the SYN, and the client gets b3's reset; the userspace proxy connects to b3,
    is refused, and connects to the next endpoint instead. The Service is dual-stack: the same over IPv6 in
    userspace mode, and its local routes of both families stay across a stop, are adopted by the next start, and
    go when the Service (its IPv6 half) or the mode (cleanup) does."""
    env = make_env(3, ipv6=True)
    dual = service("web", VIP, [HTTP], cluster_ips=[VIP, VIP6])
    env.write("web.yaml", dual, endpoint_slice("web", {B1: True, B2: True, B3: True}, [HTTP], name="web-v4"),
              endpoint_slice("web", {ipv6_of(b): True for b in (B1, B2, B3)}, [HTTP], name="web-v6"))
    env.lab.stop_servers([b for b in env.lab.backends if b.name == "b3"])
    failed: dict[str, int] = {}
    results = {}
    for mode in ("bpf", "nftables", "userspace"):
        proxy = env.start(mode=mode)
        result = env.probe("tcp", VIP, 80, 100, timeout=3.0)
        failed[mode] = result["failures"]
        results[mode] = describe(result)
        if mode == "userspace":
            result6 = env.probe("tcp", VIP6, 80, 100, timeout=3.0)
            failed["userspace IPv6"] = result6["failures"]
            results["userspace IPv6"] = describe(result6)
            assert set(result6["replies"]) == {"b1:8080", "b2:8080"}, describe(result6)
        assert proxy.terminate() == 0, proxy.log_tail()
    # The userspace mode's dataplane is its process: stopped, it serves nothing, but its local routes stay, so
    # the ClusterIPs are refused (not routed away) until the next start; cleanup removes them.
    for vip in (VIP, VIP6):
        after = env.probe("tcp", vip, 80, 4, timeout=0.5)
        assert set(after["errors"]) == {"refused"} and after["failures"] == 4, f"{vip}: {describe(after)}"
    assert [r.split()[1] for r in _local_routes(env, "-4")] == [VIP]
    assert [r.split()[1] for r in _local_routes(env, "-6")] == [VIP6]
    # Restarted with the Service made IPv4-only meanwhile and another dual-stack one added: the start adopts both
    # routes, its first sync removes the IPv6 one and adds the other Service's, and serves the IPv4 ClusterIP.
    env.write("web.yaml", service("web", VIP, [HTTP]), endpoint_slice("web", {B1: True}, [HTTP], name="web-v4"),
              service("other", OTHER, [HTTP], cluster_ips=[OTHER, OTHER6]))
    proxy = env.start(mode="userspace")
    assert proxy.wait_for_log("kept the local routes of 2 Service addresses from the previous run"), proxy.log_tail()
    assert env.poll(lambda: [r.split()[1] for r in _local_routes(env, "-6")] == [OTHER6], 10.0) is not None, (
        _local_routes(env, "-6"))
    assert [r.split()[1] for r in _local_routes(env, "-4")] == [VIP, OTHER]
    served = env.probe("tcp", VIP, 80, 10, timeout=3.0)
    assert set(served["replies"]) == {"b1:8080"} and not served["failures"], describe(served)
    assert proxy.terminate() == 0, proxy.log_tail()
    env.running.cleanup()
    assert not _local_routes(env, "-4") and not _local_routes(env, "-6")
    print("\nnew connections failed, of 100, one endpoint of three not listening: "
          + ", ".join(f"{mode} {n}" for mode, n in failed.items()))
    assert failed["userspace"] == 0, results["userspace"]
    assert failed["userspace IPv6"] == 0, results["userspace IPv6"]
    # Each kernel-mode flow picks b3 with a chance of 1 in 3: none in 100 would happen once in 4e17 runs.
    assert failed["bpf"] > 0 and failed["nftables"] > 0, results


def test_a_node_without_ipv6_on_lo_serves_ipv4_and_says_so(make_env) -> None:
    """IPv6 off in the node's network namespace (`lo` takes no IPv6 route then): the mode starts, serves the IPv4
    half of a dual-stack Service, adds no IPv6 route, and says at start that it serves IPv4 only."""
    env = make_env(2, ipv6=True)
    env.lab.exec(env.lab.node, "sysctl", "-qw", "net.ipv6.conf.lo.disable_ipv6=1")
    env.write("web.yaml", service("web", VIP, [HTTP], cluster_ips=[VIP, VIP6]),
              endpoint_slice("web", {B1: True}, [HTTP], name="web-v4"),
              endpoint_slice("web", {ipv6_of(B1): True}, [HTTP], name="web-v6"))
    proxy = env.start(mode="userspace")
    assert proxy.wait_for_log("userspace mode serves IPv4 only: IPv6 is disabled on lo"), proxy.log_tail()
    served = env.probe("tcp", VIP, 80, 10, timeout=3.0)
    assert set(served["replies"]) == {"b1:8080"} and not served["failures"], describe(served)
    assert [r.split()[1] for r in _local_routes(env, "-4")] == [VIP] and not _local_routes(env, "-6")
    assert proxy.terminate() == 0, proxy.log_tail()
