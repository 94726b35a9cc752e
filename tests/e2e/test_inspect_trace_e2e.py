"""`pyproxy inspect trace` against real traffic, in bpf, nftables and iptables mode (both iptables backends): the
endpoint a held connection really uses, the sticky endpoint of a ClientIP-affinity Service, a new flow's choices,
and addresses no Service has."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import schedcases
from flowcases import B1, B2, LB_CLOSED_IP, MANIFESTS, NODE_NAME

from pyproxy.lab.netns import backend_ip

pytestmark = pytest.mark.root

WEB, STICKY, EMPTY = "10.96.20.1", "10.96.20.5", "10.96.20.3"


def _backend(name_port: str) -> str:
    """`b2:8080` (the lab server's answer) -> `10.201.2.2:8080`."""
    name, _, port = name_port.partition(":")
    return f"{backend_ip(int(name.removeprefix('b')))}:{port}"


def _trace(env: Any, src: str, dst: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(env.running.cli("inspect", "trace", src, dst, "-o", "json").stdout)
    return out


@pytest.mark.parametrize(("mode", "args"), [
    pytest.param("bpf", [], id="bpf"),
    pytest.param("nftables", [], id="nftables"),
    pytest.param("iptables", ["--iptables-backend=legacy"], id="iptables-legacy"),
    pytest.param("iptables", ["--iptables-backend=nft"], id="iptables-nft"),
])
def test_trace_answers_as_the_traffic_went(make_env: Callable, mode: str, args: list[str]) -> None:
    env = make_env(3)
    env.write("cluster.yaml", MANIFESTS)
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args])
    client = env.lab.client_ip
    holder = env.lab.popen(env.lab.client, sys.executable, "-m", "pyproxy.lab.traffic", "hold", WEB, "80",
                           "--count", "1", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    try:
        assert holder.stdout is not None
        held = _backend(json.loads(holder.stdout.readline())[0])

        # An established flow: found from the source alone, then traced by its port to the backend it uses.
        by_source = _trace(env, client, f"{WEB}:80/tcp")
        assert by_source["frontend"]["ip"] == WEB, by_source
        live = [f for f in by_source["flows"] if not f["ended"]]
        assert [f["backend"] for f in live] == [held], by_source
        port = live[0]["client_port"]
        established = _trace(env, f"{client}:{port}", f"{WEB}:80/tcp")
        assert (established["verdict"], established["backend"]) == ("established", held), established

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
    finally:
        holder.kill()
        holder.wait()


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
