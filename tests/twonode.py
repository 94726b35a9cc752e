"""Issue 10's acceptance as a flow table for the two-node lab: what a cluster of two nodes and clients outside it
must see, with real packets, whatever the proxy mode. tests/e2e/test_twonode.py runs it against every mode this
kernel has; `mismatches(lab, mode)` is all a runner needs, so the IPVS guest can run it as it runs
tests/flowcases.py (whose FlowCase, outcomes and runner this table reuses).

The lab (labkit.Lab(2, remote_backends=2, second_client=True, distro=True)): node 1 runs pyproxy as
NODE_NAME, with pods b1 and b2 (10.201.I.2); node2 (REMOTE_NODE_NAME, no pyproxy) has pods r1 and r2
(10.202.J.2) and NO route to the clients' networks, so a remote endpoint can only answer a client outside the
cluster whose flow the node SNATed to one of its own addresses; the client (10.200.0.2) and client2 (10.200.1.2)
are outside the cluster, each on its own link to the node. Every pod runs the lab's servers on TCP 8080 and 9090
and UDP 5353, whose replies name the pod and the source address it saw.

Why a second client rather than two Services as tests/flowcases.py does: loadBalancerSourceRanges is a check
of the source, so the same load-balancer IP answering one client and not the other is what shows it, and a mode
that serves no load-balancer IP at all cannot pass the "left out" case by accident.

Every case states the intended behaviour (upstream kube-proxy's, as its own proxier tests encode it): no `by_mode`
exceptions for modes that do not render some frontends yet. test_twonode.py marks those modes as expected to
fail until they do. The one deliberate difference is the userspace mode's (flowcases.PROXIED): a proxy, its
endpoints see the node, where a case expects the source's own address.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flowcases import NO_ANSWER, PROXIED, REFUSED, FlowCase, answered_by, describe_case, results, sticky
from labkit.manifests import Port, documents, endpoint_slice, service
from labkit.netns import NODE_CLIENT_IP, REMOTE_NODE_NAME, backend_ip, nonzero_checksum_errors, remote_backend_ip

NODE_NAME = "lab-node"
"""pyproxy's --hostname-override: the nodeName of b1's and b2's endpoints."""
LOCAL_PODS, REMOTE_PODS = 2, 2
NODE_IP = NODE_CLIENT_IP
"""Where the clients send NodePort traffic (the node's address on the first client's link)."""
B1, B2, R1, R2 = backend_ip(1), backend_ip(2), remote_backend_ip(1), remote_backend_ip(2)
NODES = {B1: NODE_NAME, B2: NODE_NAME, R1: REMOTE_NODE_NAME, R2: REMOTE_NODE_NAME}
EXTERNAL_IP = "192.0.2.40"
WEB_LB, FENCED_LB, LOCAL_LB, ELSEWHERE_LB, EMPTY_LB = (f"203.0.113.{i}" for i in range(40, 45))
WEB_HTTP, WEB_DNS = Port("http", 80, 8080, node_port=30180), Port("dns", 53, 5353, "UDP", node_port=30153)
REMOTE_HTTP, REMOTE_DNS = Port("http", 80, 8080, node_port=30181), Port("dns", 53, 5353, "UDP", node_port=30151)
FENCED_HTTP, LOCAL_HTTP = Port("http", 80, 8080, node_port=30182), Port("http", 80, 8080, node_port=30183)
ELSEWHERE_HTTP, STICKY_HTTP = Port("http", 80, 8080, node_port=30184), Port("http", 80, 8080, node_port=30185)
SELF_HTTP = Port("http", 80, 8080)
EMPTY_HTTP, EMPTY_DNS = Port("http", 80, 8080, node_port=30186), Port("dns", 53, 5353, "UDP", node_port=30156)
LOCAL_HEALTH, ELSEWHERE_HEALTH = 32183, 32184
PENDING_MODES: frozenset[str] = frozenset()
"""The runs (mode ids of tests/e2e/test_twonode.py, and "ipvs" in the guest) that do not do all of this yet and are
expected to fail, strictly (a run that passes while listed fails): none now, every mode does it all."""
CLIENT_RANGE = "10.200.0.0/24"
"""Holds the first client, not client2 (10.200.1.2)."""

WEB_IP, REMOTE_IP, SELF_IP, EMPTY_IP = "10.96.40.1", "10.96.40.2", "10.96.40.7", "10.96.40.8"
ALL_HTTP = ("b1:8080", "b2:8080", "r1:8080", "r2:8080")


def _slice(name: str, ips: tuple[str, ...], ports: list[Port]) -> str:
    """A slice of ready endpoints, each with its node's name."""
    return endpoint_slice(name, dict.fromkeys(ips, True), ports, node_names={ip: NODES[ip] for ip in ips})


MANIFESTS = documents(
    # Endpoints on both nodes, every external frontend kind, externalTrafficPolicy Cluster (the default).
    service("web", WEB_IP, [WEB_HTTP, WEB_DNS], type="LoadBalancer", external_ips=[EXTERNAL_IP],
            load_balancer_ips=[WEB_LB]),
    _slice("web", (B1, B2, R1, R2), [WEB_HTTP, WEB_DNS]),
    service("remote-only", REMOTE_IP, [REMOTE_HTTP, REMOTE_DNS], type="NodePort"),
    _slice("remote-only", (R1,), [REMOTE_HTTP, REMOTE_DNS]),
    service("fenced", "10.96.40.3", [FENCED_HTTP], type="LoadBalancer", load_balancer_ips=[FENCED_LB],
            source_ranges=[CLIENT_RANGE]),
    _slice("fenced", (B1, R1), [FENCED_HTTP]),
    # externalTrafficPolicy Local with a health check node port: one endpoint here and one on node 2; then only
    # one on node 2.
    service("local", "10.96.40.4", [LOCAL_HTTP], type="LoadBalancer", external_traffic_policy="Local",
            health_check_node_port=LOCAL_HEALTH, load_balancer_ips=[LOCAL_LB]),
    _slice("local", (B1, R1), [LOCAL_HTTP]),
    service("local-elsewhere", "10.96.40.5", [ELSEWHERE_HTTP], type="LoadBalancer", external_traffic_policy="Local",
            health_check_node_port=ELSEWHERE_HEALTH, load_balancer_ips=[ELSEWHERE_LB]),
    _slice("local-elsewhere", (R1,), [ELSEWHERE_HTTP]),
    service("sticky", "10.96.40.6", [STICKY_HTTP], type="NodePort", affinity_seconds=600),
    _slice("sticky", (B1, B2, R1, R2), [STICKY_HTTP]),
    service("self", SELF_IP, [SELF_HTTP]),
    _slice("self", (B1,), [SELF_HTTP]),
    service("empty", EMPTY_IP, [EMPTY_HTTP, EMPTY_DNS], type="LoadBalancer", load_balancer_ips=[EMPTY_LB]),
    endpoint_slice("empty", {}, [EMPTY_HTTP, EMPTY_DNS]),
)

CASES = (
    # externalTrafficPolicy Cluster: every endpoint of the cluster, the flow SNATed to a node address (without it a
    # remote endpoint's reply would die at node2, and a local one's would bypass the reverse NAT).
    FlowCase("NodePort reaches endpoints on both nodes", "tcp", NODE_IP, 30180, answered_by(*ALL_HTTP), sees="node"),
    FlowCase("NodePort reaches endpoints on both nodes, udp", "udp", NODE_IP, 30153,
             answered_by("b1:5353", "b2:5353", "r1:5353", "r2:5353"), sees="node"),
    FlowCase("NodePort whose only endpoint is on the other node", "tcp", NODE_IP, 30181, answered_by("r1:8080"),
             sees="node"),
    FlowCase("NodePort whose only endpoint is on the other node, udp", "udp", NODE_IP, 30151, answered_by("r1:5353"),
             sees="node"),
    FlowCase("an external IP reaches endpoints on both nodes", "tcp", EXTERNAL_IP, 80, answered_by(*ALL_HTTP),
             sees="node"),
    FlowCase("a load-balancer IP reaches endpoints on both nodes", "tcp", WEB_LB, 80, answered_by(*ALL_HTTP),
             sees="node"),
    FlowCase("a load-balancer IP reaches endpoints on both nodes, udp", "udp", WEB_LB, 53,
             answered_by("b1:5353", "b2:5353", "r1:5353", "r2:5353"), sees="node"),
    # loadBalancerSourceRanges: the same load-balancer IP serves a client inside the ranges and drops one outside
    # (upstream's firewall chain: the client waits); the NodePort is not subject to the ranges.
    FlowCase("a client inside loadBalancerSourceRanges is served", "tcp", FENCED_LB, 80,
             answered_by("b1:8080", "r1:8080"), sees="node"),
    FlowCase("a client outside loadBalancerSourceRanges gets nothing", "tcp", FENCED_LB, 80, NO_ANSWER, src="client2"),
    FlowCase("the NodePort of a Service with source ranges serves a client outside them", "tcp", NODE_IP, 30182,
             answered_by("b1:8080", "r1:8080"), src="client2", sees="node"),
    # externalTrafficPolicy Local: this node's endpoints only, and they see the client's own address.
    FlowCase("externalTrafficPolicy Local NodePort: only the local endpoint, the client's address kept", "tcp",
             NODE_IP, 30183, answered_by("b1:8080"), sees="source", sees_by_mode=PROXIED),
    FlowCase("externalTrafficPolicy Local load-balancer IP: only the local endpoint, the client's address kept",
             "tcp", LOCAL_LB, 80, answered_by("b1:8080"), sees="source", sees_by_mode=PROXIED),
    FlowCase("externalTrafficPolicy Local, endpoints only on the other node: no answer", "tcp", NODE_IP, 30184,
             NO_ANSWER),
    # The node's own processes: ClusterIP and NodePort, endpoints on both nodes.
    FlowCase("from the node to a ClusterIP with endpoints on both nodes", "tcp", WEB_IP, 80, answered_by(*ALL_HTTP),
             src="node", sees="node"),
    FlowCase("from the node to a ClusterIP with endpoints on both nodes, udp", "udp", WEB_IP, 53,
             answered_by("b1:5353", "b2:5353", "r1:5353", "r2:5353"), src="node", sees="node"),
    FlowCase("from the node to a NodePort with endpoints on both nodes", "tcp", NODE_IP, 30180,
             answered_by(*ALL_HTTP), src="node", sees="node"),
    # Pods: across nodes with their own address (no local detector is configured, so nothing masquerades pod
    # traffic to a ClusterIP), and to a Service whose only endpoint is the pod itself (hairpin: always
    # masqueraded, else the pod would get a packet from its own address and drop it as martian).
    FlowCase("a pod reaches a Service on the other node with its own address", "tcp", REMOTE_IP, 80,
             answered_by("r1:8080"), src="b2", sees="source", sees_by_mode=PROXIED),
    FlowCase("hairpin: a pod reaches a Service whose only endpoint is itself", "tcp", SELF_IP, 80,
             answered_by("b1:8080"), src="b1", sees="node"),
    # No endpoints: refused at once (TCP reset or ICMP port unreachable), whichever way the flow comes. One UDP
    # case only: the kernel rate-limits ICMP errors per destination (a burst of 6).
    FlowCase("a NodePort without endpoints is refused", "tcp", NODE_IP, 30186, REFUSED),
    FlowCase("a NodePort without endpoints is refused, udp", "udp", NODE_IP, 30156, REFUSED),
    FlowCase("a load-balancer IP without endpoints is refused", "tcp", EMPTY_LB, 80, REFUSED),
    FlowCase("a ClusterIP without endpoints is refused to a client outside", "tcp", EMPTY_IP, 80, REFUSED),
    FlowCase("a ClusterIP without endpoints is refused to the node", "tcp", EMPTY_IP, 80, REFUSED, src="node"),
    FlowCase("a ClusterIP without endpoints is refused to a pod", "tcp", EMPTY_IP, 80, REFUSED, src="b1"),
    # ClientIP affinity from outside, through a NodePort: every flow of the client to the same endpoint, on
    # whichever node (keyed on the client's address, before SNAT).
    FlowCase("ClientIP affinity holds from outside through a NodePort", "tcp", NODE_IP, 30185, sticky(*ALL_HTTP),
             sees="node"),
)


@dataclass(frozen=True)
class HealthCase:
    """The healthCheckNodePort of an externalTrafficPolicy Local LoadBalancer Service, asked from the client as a
    load balancer asks it: `status` with upstream's JSON body."""

    name: str
    service: str
    port: int
    status: int
    local_endpoints: int

    def body(self) -> dict[str, object]:
        return {"service": {"namespace": "default", "name": self.service}, "localEndpoints": self.local_endpoints,
                "serviceProxyHealthy": True}


HEALTH_CASES = (
    HealthCase("health check node port: 200 with a local endpoint", "local", LOCAL_HEALTH, 200, 1),
    HealthCase("health check node port: 503 without one", "local-elsewhere", ELSEWHERE_HEALTH, 503, 0),
)
CHECKSUMS = "no receiver counts a checksum error"


def health_problem(lab: Any, case: HealthCase) -> str | None:
    answer = lab.http_get("client", f"http://{NODE_IP}:{case.port}/", wait=5.0, expect=case.status)
    try:
        body = json.loads(answer["body"])
    except ValueError:
        body = None
    if answer["status"] == case.status and body == case.body():
        return None
    return f"expected {case.status} {case.body()}, saw {answer['status']} {answer['body'][:200]!r} {answer['error']}"


def outcomes(lab: Any, mode: str, timeout: float = 1.0) -> list[tuple[str, str | None]]:
    """Every check in `lab` (a started Lab as above, its node running pyproxy in `mode` on MANIFESTS as NODE_NAME):
    (name, None when right else what was wrong), flow cases first, then health checks, then checksums (last, so
    they count every packet the table sent). `timeout`: as flowcases.results'."""
    done = [(describe_case(case), problem) for case, problem in results(lab, mode, CASES, timeout)]
    done += [(h.name, health_problem(lab, h)) for h in HEALTH_CASES]
    errors = nonzero_checksum_errors(lab.checksum_errors())
    return done + [(CHECKSUMS, f"counted: {errors}" if errors else None)]


def mismatches(lab: Any, mode: str, timeout: float = 1.0) -> list[str]:
    """One line per check that went wrong."""
    return [f"{name}: {problem}" for name, problem in outcomes(lab, mode, timeout) if problem]
