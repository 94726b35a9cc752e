"""Issue 26's first two rows on a lab that models a node: 8 pods of the node, their client processes inside the
cgroup pyproxy's socket hooks are attached to (`Lab(pods_in_cgroup=True)`, as every pod is below a real node's root
cgroup), 6 connections each to a Service of 4 endpoints with sessionAffinity ClientIP, and to one with the
`pyproxy.io/scheduler: sh` annotation. Upstream keys both by the pod's address: every pod keeps one endpoint and the
8 spread over the 4. bpf mode with the pods' connections translated at their sockets (each pod its own client, by
its network namespace), with --bpf-socket-lb-hostns-only (every pod's connection left to TC on its veth), and
nftables beside them as upstream's semantics for affinity (the netfilter modes choose at random whatever the
scheduler annotation says: sh is upstream's IPVS scheduler, which this kernel lacks).
"""

from __future__ import annotations

import pytest
from scenarios import WEB_PORTS

from pyproxy.lab import describe
from pyproxy.lab.manifests import endpoint_slice, service
from pyproxy.lab.netns import Lab
from pyproxy.lab.traffic import ProbeResult

pytestmark = pytest.mark.root

ENDPOINTS, PODS, CONNECTIONS = 4, 8, 6
ROWS = {"affinity": ("10.96.0.41", {"affinity_seconds": 600}),
        "sh": ("10.96.0.42", {"annotations": {"pyproxy.io/scheduler": "sh"}})}


def manifests(lab: Lab) -> list[str]:
    ips = [b.ip for b in lab.backends[:ENDPOINTS]]
    out = []
    for name, (vip, kwargs) in ROWS.items():
        out += [service(name, vip, WEB_PORTS, **kwargs), endpoint_slice(name, dict.fromkeys(ips, True), WEB_PORTS)]
    return out


def one_endpoint(result: ProbeResult) -> str:
    """The endpoint that answered every connection of a pod (fails naming what happened otherwise)."""
    assert result["failures"] == 0 and len(result["replies"]) == 1, describe(result)
    return next(iter(result["replies"]))


@pytest.mark.parametrize("mode, args", [
    pytest.param("bpf", [], id="bpf"),
    pytest.param("bpf", ["--bpf-socket-lb-hostns-only"], id="bpf-hostns-only"),
    pytest.param("nftables", [], id="nftables"),
])
def test_every_pod_keeps_its_own_endpoint_and_the_pods_spread(make_env, mode: str, args: list[str]) -> None:
    env = make_env(ENDPOINTS + PODS, pods_in_cgroup=True)
    assert all(env.lab.in_cgroup(b.ns) for b in env.lab.backends) and not env.lab.in_cgroup(env.lab.client)
    env.write("rows.yaml", *manifests(env.lab))
    env.start(mode=mode, args=args)
    pods = env.lab.backends[ENDPOINTS:]
    for row, (vip, _) in ROWS.items():
        if mode == "nftables" and row == "sh":
            continue
        chosen = {pod.name: one_endpoint(env.probe("tcp", vip, 80, CONNECTIONS, ns=pod.ns)) for pod in pods}
        print(f"{mode} {' '.join(args)} {row}: {len(set(chosen.values()))} endpoints for {PODS} pods: {chosen}")
        assert len(set(chosen.values())) > 1, f"{row}: every pod on one endpoint: {chosen}"
        # Each pod keeps its endpoint in a second round too.
        again = {pod.name: one_endpoint(env.probe("tcp", vip, 80, CONNECTIONS, ns=pod.ns)) for pod in pods}
        assert again == chosen, f"{row}: pods moved: {chosen} then {again}"
    if mode == "bpf":
        # Which path served the pods: their sockets (every connection of both rounds of both rows), or TC.
        at_socket = env.metrics()["pyproxy_bpf_datapath_events_total{event=sock_lb}"]
        assert at_socket == (0 if args else 2 * len(ROWS) * PODS * CONNECTIONS), at_socket
