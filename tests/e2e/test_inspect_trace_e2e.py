"""`pyproxy inspect trace` against real traffic, in bpf, nftables and iptables mode (both iptables backends): the
endpoint a held connection really uses, the sticky endpoint of a ClientIP-affinity Service, a new flow's choices,
and addresses no Service has; over IPv4, and over IPv6 with dual-stack Services in a lab with IPv6 addresses."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import schedcases
from flowcases import (
    B1,
    B1_6,
    B2,
    B2_6,
    B3_6,
    HTTP,
    LB6_CLOSED_IP,
    LB6_OPEN_IP,
    LB_CLOSED_IP,
    MANIFESTS,
    NODE_IP,
    NODE_IP6,
    NODE_NAME,
)
from labkit.manifests import endpoint_slice, service
from labkit.netns import backend_ip, ipv6_of

from pyproxy.model.objects import join_host_port

pytestmark = pytest.mark.root

WEB, STICKY, EMPTY = "10.96.20.1", "10.96.20.5", "10.96.20.3"


def _backend(name_port: str, family: int = 4) -> str:
    """`b2:8080` (the lab server's answer) -> `10.201.2.2:8080`, or over IPv6 `[fd00:10:201:2::2]:8080`."""
    name, _, port = name_port.partition(":")
    ip = backend_ip(int(name.removeprefix("b")))
    return join_host_port(ipv6_of(ip) if family == 6 else ip, int(port))


@contextlib.contextmanager
def _holding(env: Any, ip: str) -> Iterator[str]:
    """One TCP connection from the client to ip:80, held open meanwhile: the answer of the backend it reached."""
    holder = env.lab.popen(env.lab.client, sys.executable, "-m", "labkit.traffic", "hold", ip, "80",
                           "--count", "1", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    try:
        assert holder.stdout is not None
        yield json.loads(holder.stdout.readline())[0]
    finally:
        holder.kill()
        holder.wait()


def _trace(env: Any, src: str, dst: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(env.running.cli("inspect", "trace", src, dst, "-o", "json").stdout)
    return out


def _the_held_flow(env: Any, client: str, vip: str, held: str, spellings: Sequence[str] = ()) -> int:
    """The client's established flow to vip:80: found from its address alone (as each of `spellings`), then traced
    by its port, to `held`, the backend the connection really uses; its port."""
    dst = f"{join_host_port(vip, 80)}/tcp"
    live = []
    for source in spellings or (client,):
        by_source = _trace(env, source, dst)
        assert by_source["frontend"]["ip"] == vip, by_source
        live = [f for f in by_source["flows"] if not f["ended"]]
        assert [f["backend"] for f in live] == [held], by_source
    port: int = live[0]["client_port"]
    established = _trace(env, join_host_port(client, port), dst)
    assert (established["verdict"], established["backend"]) == ("established", held), established
    return port


MODES = [
    pytest.param("bpf", [], id="bpf"),
    pytest.param("nftables", [], id="nftables"),
    pytest.param("iptables", ["--iptables-backend=legacy"], id="iptables-legacy"),
    pytest.param("iptables", ["--iptables-backend=nft"], id="iptables-nft"),
]


@pytest.mark.parametrize(("mode", "args"), MODES)
def test_trace_answers_as_the_traffic_went(make_env: Callable, mode: str, args: list[str]) -> None:
    env = make_env(3)
    env.write("cluster.yaml", MANIFESTS)
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args])
    client = env.lab.client_ip
    with _holding(env, WEB) as answer:
        held = _backend(answer)

        port = _the_held_flow(env, client, WEB, held)

        # A new flow: either ready endpoint, by the mode's scheduler (random: nftables' numgen, bpf's default).
        fresh = _trace(env, f"{client}:1", f"{WEB}:80/tcp")
        assert fresh["verdict"] == "dnat" and not fresh["flows"], fresh
        assert {f"{e['ip']}:{e['port']}" for e in fresh["new_flow"]["candidates"]} == {f"{B1}:8080", f"{B2}:8080"}
        assert fresh["backend"] is None and set(fresh["new_flow"]["shares"]) == {f"{B1}:8080", f"{B2}:8080"}
        if mode == "iptables":
            # The draw as the statistic rules state it, read back from iptables-save.
            assert fresh["frontend"]["probabilities"] == [0.5, 1.0], fresh
            assert "probability (0.5, then 1)" in fresh["new_flow"]["why"], fresh
            assert set(fresh["new_flow"]["shares"].values()) == {0.5}, fresh

        # ClientIP affinity: the endpoint every connection got is the one a new flow is pinned to.
        result = env.probe("tcp", STICKY, 80, 5)
        assert result["failures"] == 0 and len(result["replies"]) == 1, result
        sticky = _backend(next(iter(result["replies"])))
        pinned = _trace(env, client, f"{STICKY}:80/tcp")
        assert (pinned["verdict"], pinned["backend"]) == ("dnat", sticky), pinned
        assert pinned["affinity"]["backend"] == sticky and pinned["frontend"]["affinity_sec"] == 600, pinned

        # Addresses that are no frontend: the packet is left alone.
        for dst in ("10.96.99.99:80/tcp", f"{WEB}:81/tcp", f"{WEB}:80/udp", f"{B1}:8080/tcp"):
            other = _trace(env, client, dst)
            assert (other["verdict"], other["frontend"]) == ("not a Service", None), other

        # No endpoint: refused; a source outside loadBalancerSourceRanges: dropped.
        assert _trace(env, client, f"{EMPTY}:80/tcp")["verdict"] == "refused"
        assert _trace(env, client, f"{LB_CLOSED_IP}:80/tcp")["verdict"] == "dropped"

        # The other views: filtered, as JSON and as text.
        web = json.loads(env.running.cli("inspect", "--service", "default/web", "-o", "json").stdout)
        if mode == "iptables":
            assert web["source"].startswith(args[0].replace("--iptables-backend=", "iptables-")), web
        assert web["mode"] == mode and {f["service"] for f in web["frontends"]} == {"default/web"}, web
        assert held in {f["backend"] for f in web["flows"]}, web
        one = json.loads(env.running.cli("inspect", "--frontend", f"{STICKY}:80", "-o", "json").stdout)
        assert [(f["ip"], f["port"]) for f in one["frontends"]] == [(STICKY, 80)], one
        text = env.running.cli("inspect", "trace", f"{client}:{port}", f"{WEB}:80/tcp").stdout
        assert "established: follows its" in text and held in text, text


def test_trace_names_the_endpoint_the_hash_schedulers_give(make_env: Callable) -> None:
    """bpf's sh, dh and Maglev decide by a hash the trace computes as the datapath does: the endpoint it names for
    a source (and port) is the one real connections from there got."""
    env = make_env(3, client_addresses=schedcases.CLIENT_ADDRESSES)
    env.write_raw("cluster.yaml", schedcases.manifests(annotated=True))
    env.start()
    sources = env.lab.client_ips[:4]  # each trace is a pyproxy run: enough addresses that the hash spreads them
    for scheduler, ports in (("sh", ()), ("dh", ()), ("maglev", schedcases.FLOW_PORTS)):
        ip = schedcases.service_ip(scheduler)
        result = env.probe("tcp", ip, 80, len(sources) * max(1, len(ports)), sources=sources, source_ports=ports)
        assert result["failures"] == 0, result
        for source, answers in result["by_source"].items():
            assert len(answers) == 1, f"{scheduler} {source}: {answers}"
            traced = _trace(env, source, f"{ip}:80/tcp")
            assert traced["frontend"]["scheduler"] == scheduler, traced
            assert traced["new_flow"]["chosen"] == _backend(next(iter(answers))), f"{scheduler} {source}: {traced}"


# ------------------------------------------------------------------------------------------------ IPv6

WEB6, DUAL, DUAL6, EMPTY6 = "fd00:10:96::1", "10.96.20.30", "fd00:10:96::30", "fd00:10:96::3"
STICKY6 = "fd00:10:96::40"
# A ClientIP-affinity Service of IPv6 (flowcases has none): bpf's CT6 affinity entries, nftables' ip6 affinity sets
# (the endpoint's colons written as dots in their names) and ip6tables' `recent` lists.
STICKY6_DOCS = (service("sticky6", STICKY6, [HTTP], cluster_ips=[STICKY6], affinity_seconds=600),
                endpoint_slice("sticky6", {B1_6: True, B2_6: True, B3_6: True}, [HTTP]))


@pytest.mark.parametrize(("mode", "args"), MODES)
def test_trace_and_inspect_follow_ipv6_and_dual_stack_flows(make_env: Callable, mode: str, args: list[str]) -> None:
    """The same questions of IPv6 flows (an IPv6 Service, a dual-stack one, its dual-stack NodePort), answered from
    each mode's IPv6 state: bpf's svc6 and CT6 maps, the ip6 pyproxy table, ip6tables' chains."""
    env = make_env(3, ipv6=True)
    env.write("cluster.yaml", MANIFESTS, *STICKY6_DOCS)
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args])
    client6 = ipv6_of(env.lab.client_ip)
    with _holding(env, WEB6) as answer:
        held = _backend(answer, 6)

        # The source given bare or in brackets.
        port = _the_held_flow(env, client6, WEB6, held, spellings=(client6, f"[{client6}]"))
        text = env.running.cli("inspect", "trace", f"[{client6}]:{port}", f"[{WEB6}]:80/tcp").stdout
        assert f"[{client6}]:{port} -> [{WEB6}]:80/tcp: established: follows its" in text and held in text, text

        # A new flow: either ready IPv6 endpoint (b3 is not ready).
        fresh = _trace(env, f"[{client6}]:1", f"[{WEB6}]:80/tcp")
        both = {f"[{B1_6}]:8080", f"[{B2_6}]:8080"}
        assert fresh["verdict"] == "dnat" and set(fresh["new_flow"]["shares"]) == both, fresh

        # ClientIP affinity over IPv6: the endpoint every connection got is the one a new flow is pinned to.
        result = env.probe("tcp", STICKY6, 80, 5)
        assert result["failures"] == 0 and len(result["replies"]) == 1, result
        sticky = _backend(next(iter(result["replies"])), 6)
        pinned = _trace(env, client6, f"[{STICKY6}]:80/tcp")
        assert (pinned["verdict"], pinned["backend"]) == ("dnat", sticky), pinned
        assert pinned["affinity"]["client"] == client6 and pinned["affinity"]["backend"] == sticky, pinned

        # Dual-stack: each family's frontend has its family's endpoints, on the ClusterIPs and the NodePorts.
        for src, dst, only in ((client6, f"[{DUAL6}]:80/tcp", f"[{B2_6}]:8080"),
                               (env.lab.client_ip, f"{DUAL}:80/tcp", f"{B1}:8080"),
                               (client6, f"[{NODE_IP6}]:30094/tcp", f"[{B2_6}]:8080"),
                               (env.lab.client_ip, f"{NODE_IP}:30094/tcp", f"{B1}:8080")):
            got = _trace(env, src, dst)
            assert (got["verdict"], got["backend"]) == ("dnat", only), got
        result = env.probe("tcp", DUAL6, 80, 2)
        assert set(result["replies"]) == {"b2:8080"}, result
        assert f"[{B2_6}]:8080" in {f["backend"] for f in _trace(env, client6, f"[{DUAL6}]:80/tcp")["flows"]}

        # No endpoint, source ranges, and addresses no frontend has.
        assert _trace(env, client6, f"[{EMPTY6}]:80/tcp")["verdict"] == "refused"
        assert _trace(env, client6, f"[{LB6_CLOSED_IP}]:80/tcp")["verdict"] == "dropped"
        assert _trace(env, client6, f"[{LB6_OPEN_IP}]:80/tcp")["verdict"] == "dnat"
        for dst in (f"[{WEB6}]:81/tcp", "[fd00:10:96::99]:80/tcp", f"[{B1_6}]:8080/tcp"):
            other = _trace(env, client6, dst)
            assert (other["verdict"], other["frontend"]) == ("not a Service", None), other

        # `pyproxy inspect`: both families' frontends of the dual-stack Service, addresses in [addr]:port form.
        dual = json.loads(env.running.cli("inspect", "--service", "default/dual", "-o", "json").stdout)
        assert sorted((f["ip"], tuple(f"{e['ip']}:{e['port']}" for e in f["endpoints"])) for f in dual["frontends"]) \
            == [(DUAL, (f"{B1}:8080",)), (DUAL6, (f"{B2_6}:8080",))], dual
        one = json.loads(env.running.cli("inspect", "--frontend", f"[{WEB6}]:80/tcp", "-o", "json").stdout)
        assert [(f["ip"], f["port"]) for f in one["frontends"]] == [(WEB6, 80)], one
        assert held in {f["backend"] for f in one["flows"]}, one
        report = env.running.cli("inspect").stdout
        for line in (f"[{DUAL6}]:80/TCP", f"[{B2_6}]:8080", f"TCP [{client6}]:{port} -> [{WEB6}]:80", f"{DUAL}:80/TCP"):
            assert line in report, report
