"""One table of packet-flow cases — source, destination, port → backend set | refused | no answer — that every
proxy mode must agree on. tests/e2e/test_flowcases.py runs it in a namespace lab against each mode this kernel
has; the IPVS guest runs the same table (tests/guest_ipvs); tests/unit/test_flowcases_traced.py traces it through
each mode's rendered plan, without root (tests/tracers).

The outcome is what a client sees over many new flows: which backends answered, whether they were always the
same one (session affinity), or how the flows failed. Where a mode deliberately differs from upstream's
semantics, the case says so in `by_mode` (and `sees_by_mode` for the source the endpoints see), with the reason,
so a difference is a decision, never an accident.

The userspace mode's differences, all from being a proxy rather than a NAT: every endpoint sees the node as the
source (its own connection or socket, from the node's address toward that endpoint), so no client address is
kept, not even with externalTrafficPolicy Local; and the Service addresses are the node's own (local routes), so
a port no Service has is refused by the node's own stack, as in ipvs mode (and a node process listening
on 0.0.0.0 on that port would answer, upstream issue 72236, which the ipvs mode's KUBE-IPVS-FILTER prevents).

Lab addressing (labkit): client 10.200.0.2 (outside the cluster), backend I at 10.201.I.2 (named bI),
servers on TCP 8080 and 9090 and UDP 5353 in every backend. The node (pyproxy runs as `--hostname-override=
lab-node`, NODE_NAME) has 10.200.0.1 on the client's link, 10.201.I.1 on backend I's and 10.199.0.1 on its
uplink; NodePorts are served on all of them (no --nodeport-addresses). Every backend is a pod of this node;
a slice may still say another `nodeName`, which is what externalTrafficPolicy Local looks at, and zone hints
(`hints.forZones`), which topology-aware routing looks at: the manifests hold the node's Node object, in zone
NODE_ZONE.

IPv6 and dual-stack (issue 15): each role's IPv6 address is its IPv4 one's `labkit.netns.ipv6_of`
(10.A.B.C -> fd00:10:A:B::C). IPV6_CASES are the IPv6 counterparts of the ClusterIP, NodePort, Local, no-endpoint
and source-range cases, and dual-stack Services reached on IPv6; the IPv4 halves of the dual-stack Services are in
CASES (every mode serves those). tests/e2e/test_flowcases.py runs IPV6_CASES in a lab given IPv6 addresses
(`Lab(ipv6=True)`). A mode that does not render IPv6 yet is named in NOT_RENDERED_YET with why: its
IPv6 cases are not counted as passing (the tracer test marks them as expected failures, strictly, so the day the
mode serves them the mark must go).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.manifests import Port, documents, endpoint_slice, node, service

from pyproxy.model.objects import TOPOLOGY_MODE_ANNOTATION, ZONE_LABEL

B1, B2, B3 = "10.201.1.2", "10.201.2.2", "10.201.3.2"
B1_6, B2_6, B3_6 = "fd00:10:201:1::2", "fd00:10:201:2::2", "fd00:10:201:3::2"
"""The backends' IPv6 addresses (labkit.netns.ipv6_of)."""
HTTP, ALT, DNS = Port("http", 80, 8080), Port("alt", 443, 9090), Port("dns", 53, 5353, "UDP")
NODE_NAME = "lab-node"
NODE_ZONE = "zone-a"
NODE_IP = "10.200.0.1"
"""The node's address on the client's link: where the client sends NodePort traffic."""
NODE_IP6 = "fd00:10:200::1"
"""Its IPv6 address there."""
CLIENT_NET6 = "fd00:10:200::/64"
LB6_CLOSED_IP, LB6_OPEN_IP = "2001:db8::12", "2001:db8::13"
NP6_HTTP, NP6_DNS = Port("http", 80, 8080, node_port=30090), Port("dns", 53, 5353, "UDP", node_port=30091)
LOCAL6_HTTP, EMPTY6_HTTP = Port("http", 80, 8080, node_port=30092), Port("http", 80, 8080, node_port=30093)
DUAL_NP_HTTP = Port("http", 80, 8080, node_port=30094)
EXTERNAL_IP, LB_IP, LB_CLOSED_IP, LB_OPEN_IP = "192.0.2.10", "203.0.113.10", "203.0.113.11", "203.0.113.12"
NP_HTTP, NP_DNS = Port("http", 80, 8080, node_port=30080), Port("dns", 53, 5353, "UDP", node_port=30053)
LOCAL_HTTP, ELSEWHERE_HTTP = Port("http", 80, 8080, node_port=30082), Port("http", 80, 8080, node_port=30083)
EMPTY_HTTP = Port("http", 80, 8080, node_port=30084)
ITP_HTTP, ITP_ELSEWHERE_HTTP = Port("http", 80, 8080, node_port=30085), Port("http", 80, 8080, node_port=30086)
TOPO_HTTP, TOPO_LOCAL_HTTP = Port("http", 80, 8080, node_port=30087), Port("http", 80, 8080, node_port=30088)
# Zone hints: b1 and b3 for this node's zone, b2 for another.
ZONED = {B1: [NODE_ZONE], B2: ["zone-b"], B3: ["zone-c", NODE_ZONE]}

# The cluster the table runs against: manifests for the --source folder.
MANIFESTS = documents(
    # b3 exists but is not ready: it must never be picked.
    service("web", "10.96.20.1", [HTTP, ALT, DNS]),
    endpoint_slice("web", {B1: True, B2: True, B3: False}, [HTTP, ALT, DNS]),
    # Endpoints split across two slices count as one set.
    service("split", "10.96.20.2", [HTTP]),
    endpoint_slice("split", {B1: True}, [HTTP], name="split-a"),
    endpoint_slice("split", {B3: True}, [HTTP], name="split-b"),
    service("empty", "10.96.20.3", [HTTP, DNS]),
    endpoint_slice("empty", {}, [HTTP, DNS]),
    service("unready", "10.96.20.4", [HTTP]),
    endpoint_slice("unready", {B1: False, B2: False}, [HTTP]),
    service("sticky", "10.96.20.5", [HTTP], affinity_seconds=600),
    endpoint_slice("sticky", {B1: True, B2: True, B3: True}, [HTTP]),
    service("only-b2", "10.96.20.6", [HTTP]),
    endpoint_slice("only-b2", {B2: True}, [HTTP]),
    # Traffic from outside the cluster: external IPs, load-balancer IPs, NodePorts.
    service("ext", "10.96.20.7", [HTTP], external_ips=[EXTERNAL_IP]),
    endpoint_slice("ext", {B1: True, B2: True}, [HTTP]),
    service("lb", "10.96.20.8", [HTTP], type="LoadBalancer", load_balancer_ips=[LB_IP]),
    endpoint_slice("lb", {B1: True, B2: True}, [HTTP]),
    # loadBalancerSourceRanges: one that leaves the client out, one that holds it.
    service("lb-closed", "10.96.20.9", [HTTP], type="LoadBalancer", load_balancer_ips=[LB_CLOSED_IP],
            source_ranges=["198.51.100.0/24"]),
    endpoint_slice("lb-closed", {B1: True, B2: True}, [HTTP]),
    service("lb-open", "10.96.20.10", [HTTP], type="LoadBalancer", load_balancer_ips=[LB_OPEN_IP],
            source_ranges=["198.51.100.0/24", "10.200.0.0/24"]),
    endpoint_slice("lb-open", {B1: True, B2: True}, [HTTP]),
    service("np", "10.96.20.11", [NP_HTTP, NP_DNS], type="NodePort"),
    endpoint_slice("np", {B1: True, B2: True}, [NP_HTTP, NP_DNS]),
    # externalTrafficPolicy Local: b1 is this node's, b2 another node's; then all of them on another node.
    service("np-local", "10.96.20.12", [LOCAL_HTTP], type="NodePort", external_traffic_policy="Local"),
    endpoint_slice("np-local", {B1: True, B2: True}, [LOCAL_HTTP], node_names={B1: NODE_NAME, B2: "other-node"}),
    service("np-elsewhere", "10.96.20.13", [ELSEWHERE_HTTP], type="NodePort", external_traffic_policy="Local"),
    endpoint_slice("np-elsewhere", {B1: True, B2: True}, [ELSEWHERE_HTTP],
                   node_names={B1: "other-node", B2: "other-node"}),
    service("np-empty", "10.96.20.14", [EMPTY_HTTP], type="NodePort"),
    endpoint_slice("np-empty", {}, [EMPTY_HTTP]),
    # internalTrafficPolicy Local: the ClusterIP serves this node's endpoints only (b1 here, b2 elsewhere); the
    # NodePort of the same Service still serves every endpoint. Then a Service with none on this node.
    service("itp-local", "10.96.20.15", [ITP_HTTP], type="NodePort", internal_traffic_policy="Local"),
    endpoint_slice("itp-local", {B1: True, B2: True}, [ITP_HTTP], node_names={B1: NODE_NAME, B2: "other-node"}),
    service("itp-elsewhere", "10.96.20.16", [ITP_ELSEWHERE_HTTP], type="NodePort", internal_traffic_policy="Local"),
    endpoint_slice("itp-elsewhere", {B1: True, B2: True}, [ITP_ELSEWHERE_HTTP],
                   node_names={B1: "other-node", B2: "other-node"}),
    # ... and one whose only endpoint here is terminating (still serving) while another node has a ready one.
    service("itp-draining", "10.96.20.17", [HTTP], internal_traffic_policy="Local"),
    endpoint_slice("itp-draining", {B1: True, B2: False}, [HTTP], node_names={B1: "other-node", B2: NODE_NAME},
                   terminating=[B2]),
    # Topology-aware routing: the node is in NODE_ZONE.
    node(NODE_NAME, {ZONE_LABEL: NODE_ZONE}),
    service("topo-close", "10.96.20.18", [TOPO_HTTP], type="NodePort", traffic_distribution="PreferClose"),
    endpoint_slice("topo-close", {B1: True, B2: True, B3: True}, [TOPO_HTTP], zone_hints=ZONED),
    service("topo-auto", "10.96.20.19", [HTTP], annotations={TOPOLOGY_MODE_ANNOTATION: "Auto"}),
    endpoint_slice("topo-auto", {B1: True, B2: True, B3: True}, [HTTP],
                   zone_hints={B1: ["zone-b"], B2: [NODE_ZONE], B3: ["zone-c"]}),
    # Hints, but the Service does not ask for topology.
    service("topo-off", "10.96.20.20", [HTTP]),
    endpoint_slice("topo-off", {B1: True, B2: True, B3: True}, [HTTP], zone_hints=ZONED),
    # b3 has no hint: no topology. Then none hinted for this zone: no topology either.
    service("topo-unhinted", "10.96.20.21", [HTTP], traffic_distribution="PreferClose"),
    endpoint_slice("topo-unhinted", {B1: True, B2: True, B3: True}, [HTTP],
                   zone_hints={B1: [NODE_ZONE], B2: ["zone-b"]}),
    service("topo-elsewhere", "10.96.20.22", [HTTP], traffic_distribution="PreferClose"),
    endpoint_slice("topo-elsewhere", {B1: True, B2: True}, [HTTP], zone_hints={B1: ["zone-b"], B2: ["zone-c"]}),
    # Nothing ready: the serving and terminating endpoints, hints or not.
    service("topo-draining", "10.96.20.23", [HTTP], traffic_distribution="PreferClose"),
    endpoint_slice("topo-draining", {B1: False, B2: False}, [HTTP], terminating=[B1, B2], zone_hints=ZONED),
    # externalTrafficPolicy Local: outside clients get this node's endpoint (b2, hinted for another zone); pods
    # and the node the zone's.
    service("topo-local", "10.96.20.24", [TOPO_LOCAL_HTTP], type="NodePort", external_traffic_policy="Local",
            traffic_distribution="PreferClose"),
    endpoint_slice("topo-local", {B1: True, B2: True, B3: True}, [TOPO_LOCAL_HTTP], zone_hints=ZONED,
                   node_names={B1: "other-node", B2: NODE_NAME, B3: "other-node"}),
    # pyproxy.io/weights: b2 quiesced (weight 0): new flows never reach it, in every mode (the model leaves it out).
    service("quiesced", "10.96.20.25", [HTTP, DNS], annotations={"pyproxy.io/weights": f"{B2}=0"}),
    endpoint_slice("quiesced", {B1: True, B2: True, B3: True}, [HTTP, DNS]),
    # IPv6 (single-stack), as the IPv4 ones above: b3 not ready.
    service("web6", "fd00:10:96::1", [HTTP, DNS], cluster_ips=["fd00:10:96::1"], ip_family_policy="SingleStack"),
    endpoint_slice("web6", {B1_6: True, B2_6: True, B3_6: False}, [HTTP, DNS]),
    service("empty6", "fd00:10:96::3", [HTTP, DNS], cluster_ips=["fd00:10:96::3"]),
    endpoint_slice("empty6", {B1_6: False}, [HTTP, DNS]),
    service("np6", "fd00:10:96::11", [NP6_HTTP, NP6_DNS], type="NodePort", cluster_ips=["fd00:10:96::11"]),
    endpoint_slice("np6", {B1_6: True, B2_6: True}, [NP6_HTTP, NP6_DNS]),
    service("np6-local", "fd00:10:96::12", [LOCAL6_HTTP], type="NodePort", external_traffic_policy="Local",
            cluster_ips=["fd00:10:96::12"]),
    endpoint_slice("np6-local", {B1_6: True, B2_6: True}, [LOCAL6_HTTP],
                   node_names={B1_6: NODE_NAME, B2_6: "other-node"}),
    service("np6-empty", "fd00:10:96::14", [EMPTY6_HTTP], type="NodePort", cluster_ips=["fd00:10:96::14"]),
    endpoint_slice("np6-empty", {}, [EMPTY6_HTTP]),
    service("lb6-closed", "fd00:10:96::9", [HTTP], type="LoadBalancer", cluster_ips=["fd00:10:96::9"],
            load_balancer_ips=[LB6_CLOSED_IP], source_ranges=["2001:db8:ffff::/48", "198.51.100.0/24"]),
    endpoint_slice("lb6-closed", {B1_6: True, B2_6: True}, [HTTP]),
    service("lb6-open", "fd00:10:96::10", [HTTP], type="LoadBalancer", cluster_ips=["fd00:10:96::10"],
            load_balancer_ips=[LB6_OPEN_IP], source_ranges=["2001:db8:ffff::/48", CLIENT_NET6]),
    endpoint_slice("lb6-open", {B1_6: True, B2_6: True}, [HTTP]),
    # Dual-stack: each family's frontends reach that family's endpoints only (b1 by IPv4, b2 by IPv6).
    service("dual", "10.96.20.30", [HTTP], cluster_ips=["10.96.20.30", "fd00:10:96::30"],
            ip_family_policy="RequireDualStack"),
    endpoint_slice("dual", {B1: True}, [HTTP], name="dual-v4"),
    endpoint_slice("dual", {B2_6: True}, [HTTP], name="dual-v6"),
    service("dual-np", "10.96.20.32", [DUAL_NP_HTTP], type="NodePort", cluster_ips=["10.96.20.32", "fd00:10:96::32"],
            ip_family_policy="PreferDualStack"),
    endpoint_slice("dual-np", {B1: True}, [DUAL_NP_HTTP], name="dual-np-v4"),
    endpoint_slice("dual-np", {B2_6: True}, [DUAL_NP_HTTP], name="dual-np-v6"),
    # An IPv4-only Service with an IPv6 slice: not its family's, so it has no endpoint.
    service("v4-with-v6-slice", "10.96.20.31", [HTTP]),
    endpoint_slice("v4-with-v6-slice", {B1_6: True}, [HTTP]),
)


@dataclass(frozen=True)
class Outcome:
    kind: str
    """"backends": every flow answered, and the answering set is exactly `backends`;
    "sticky": every flow answered, always by the same one of `backends`;
    "refused": every flow refused at once (REJECT: TCP reset or ICMP port unreachable);
    "no-answer": no flow answered (dropped, or not translated and nothing listens)."""
    backends: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return f"{self.kind} {sorted(self.backends)}" if self.backends else self.kind


def answered_by(*names: str) -> Outcome:
    return Outcome("backends", frozenset(names))


def sticky(*names: str) -> Outcome:
    return Outcome("sticky", frozenset(names))


REFUSED = Outcome("refused")
NO_ANSWER = Outcome("no-answer")


@dataclass(frozen=True)
class FlowCase:
    name: str
    proto: str
    dst: str
    port: int
    expect: Outcome
    src: str = "client"
    """"client", a backend's name ("b1") for traffic from a pod of the cluster, or "node" for the node's own
    processes (in the node's namespace and the lab's cgroup, where bpf mode's socket hooks act); any role of
    the lab (`Lab.probe`'s `ns`: "client2", "r1", ...)."""
    by_mode: Mapping[str, Outcome] = field(default_factory=dict)
    """Deliberate per-mode differences from `expect` (the reason is in the case's comment)."""
    sees: str | None = None
    """The source address every answering endpoint must have seen: "source", the sender's own (not SNATed);
    "node", one of the node's addresses (SNATed, masqueraded); None: not checked."""
    sees_by_mode: Mapping[str, str] = field(default_factory=dict)
    """Deliberate per-mode differences from `sees`."""

    def expected(self, mode: str) -> Outcome:
        return self.by_mode.get(mode, self.expect)

    @property
    def family(self) -> int:
        """The destination's IP family: 6 for an IPv6 case."""
        return 6 if ":" in self.dst else 4

    def seen(self, mode: str) -> str | None:
        return self.sees_by_mode.get(mode, self.sees)


# The userspace mode proxies: its endpoints see the node (PROXIED), in every case; the cases that check the source say
# so.
PROXIED = {"userspace": "node"}
LOCALHOST = "127.0.0.1"
NO_LOCALHOST_NODEPORTS = {"iptables": REFUSED, "nftables": REFUSED, "ipvs": REFUSED, "userspace": REFUSED}
"""The modes that serve no NodePort on 127.0.0.1 (a connect() there is refused: nothing listens)."""

CASES = (
    # No --cluster-cidr, no --masquerade-all: a ClusterIP flow keeps the client's address, but through a proxy.
    FlowCase("ready endpoints only, tcp", "tcp", "10.96.20.1", 80, answered_by("b1:8080", "b2:8080"), sees="source",
             sees_by_mode=PROXIED),
    FlowCase("second port of the same service", "tcp", "10.96.20.1", 443, answered_by("b1:9090", "b2:9090")),
    FlowCase("udp port", "udp", "10.96.20.1", 53, answered_by("b1:5353", "b2:5353"), sees="source",
             sees_by_mode=PROXIED),
    FlowCase("endpoints from two slices", "tcp", "10.96.20.2", 80, answered_by("b1:8080", "b3:8080")),
    FlowCase("no endpoints: rejected", "tcp", "10.96.20.3", 80, REFUSED),
    FlowCase("no endpoints: rejected, udp", "udp", "10.96.20.3", 53, REFUSED),
    FlowCase("no ready endpoints: rejected", "tcp", "10.96.20.4", 80, REFUSED),
    FlowCase("ClientIP affinity sticks", "tcp", "10.96.20.5", 80, sticky("b1:8080", "b2:8080", "b3:8080")),
    # IPVS puts every ClusterIP on the node (kube-ipvs0), so a port no Service has would reach the node's own
    # stack; upstream rejects it there (KUBE-IPVS-FILTER), and so does pyproxy. The userspace mode has the ClusterIPs
    # on the node too (local routes), and no netfilter: the node's stack refuses the port, nothing listening on it.
    FlowCase("a port the service does not have is not translated", "tcp", "10.96.20.1", 81, NO_ANSWER,
             by_mode={"ipvs": REFUSED, "userspace": REFUSED}),
    FlowCase("an address that is no service is not translated", "tcp", "10.96.20.99", 80, NO_ANSWER),
    FlowCase("from a pod to another pod's service", "tcp", "10.96.20.6", 80, answered_by("b2:8080"), src="b1"),
    # The node's own processes (kubelet probes, host-network pods): the netfilter modes translate them on the
    # OUTPUT path, IPVS by its local-out hook, bpf mode at connect()/sendmsg() (socket load balancing); in userspace
    # mode the ClusterIP is the node's own address, where the proxy listens.
    FlowCase("from the node itself", "tcp", "10.96.20.1", 80, answered_by("b1:8080", "b2:8080"), src="node"),
    FlowCase("from the node itself, udp", "udp", "10.96.20.1", 53, answered_by("b1:5353", "b2:5353"), src="node"),
    FlowCase("from the node, no endpoints: rejected", "tcp", "10.96.20.3", 80, REFUSED, src="node"),
    FlowCase("from the node, ClientIP affinity sticks", "tcp", "10.96.20.5", 80,
             sticky("b1:8080", "b2:8080", "b3:8080"), src="node"),
)


EXTERNAL_CASES = (
    FlowCase("an external IP reaches the endpoints", "tcp", EXTERNAL_IP, 80, answered_by("b1:8080", "b2:8080")),
    FlowCase("a load-balancer IP reaches the endpoints", "tcp", LB_IP, 80, answered_by("b1:8080", "b2:8080")),
    # Sources outside loadBalancerSourceRanges are dropped (upstream's firewall chain), so the client waits.
    FlowCase("a load-balancer IP whose source ranges leave the client out: no answer", "tcp", LB_CLOSED_IP, 80,
             NO_ANSWER),
    FlowCase("a load-balancer IP whose source ranges hold the client", "tcp", LB_OPEN_IP, 80,
             answered_by("b1:8080", "b2:8080")),
    # The node and its pods meet the same ranges by their own addresses (none in them here).
    # Not done yet in ipvs mode (docs/differences.md): its source-range check sits in filter INPUT, before IPVS's
    # LOCAL_IN hook, which the node's own flows never cross (IPVS translates them at LOCAL_OUT first); upstream's
    # checks them in nat KUBE-SERVICES, which OUTPUT jumps to. Measured in the guest: the node is answered.
    FlowCase("a load-balancer IP whose source ranges leave the node out: no answer", "tcp", LB_OPEN_IP, 80,
             NO_ANSWER, src="node", by_mode={"ipvs": answered_by("b1:8080", "b2:8080")}),
    FlowCase("a load-balancer IP whose source ranges leave a pod out: no answer", "tcp", LB_OPEN_IP, 80,
             NO_ANSWER, src="b3"),
    FlowCase("a NodePort on the node's address reaches the endpoints", "tcp", NODE_IP, 30080,
             answered_by("b1:8080", "b2:8080")),
    FlowCase("a NodePort on the node's address reaches the endpoints, udp", "udp", NODE_IP, 30053,
             answered_by("b1:5353", "b2:5353")),
    # externalTrafficPolicy Local: only this node's endpoints serve clients from outside the cluster, which keep their
    # address (the userspace mode's proxy cannot keep it: its endpoint sees the node).
    FlowCase("externalTrafficPolicy Local: only this node's endpoint", "tcp", NODE_IP, 30082, answered_by("b1:8080"),
             sees="source", sees_by_mode=PROXIED),
    # ... and with none on this node while the cluster has some, the flow is dropped (the client's load balancer
    # tries another node), as upstream's DROP; the same Service's ClusterIP still answers.
    FlowCase("externalTrafficPolicy Local, no endpoint on this node: no answer", "tcp", NODE_IP, 30083, NO_ANSWER),
    FlowCase("externalTrafficPolicy Local, no endpoint on this node: the ClusterIP answers", "tcp", "10.96.20.13", 80,
             answered_by("b1:8080", "b2:8080")),
    # Refused in every mode, as upstream's REJECT.
    FlowCase("a NodePort of a Service without endpoints: refused", "tcp", NODE_IP, 30084, REFUSED),
    # The node's own processes reach NodePorts (nat OUTPUT in the nftables and iptables modes, IPVS's local-out
    # hook, bpf's socket hooks); with externalTrafficPolicy Local they are not limited to this node's endpoints
    # (upstream's short circuit: masqueraded, every endpoint).
    FlowCase("from the node itself to a NodePort", "tcp", NODE_IP, 30080, answered_by("b1:8080", "b2:8080"),
             src="node"),
    FlowCase("from the node, externalTrafficPolicy Local without a local endpoint: every endpoint", "tcp", NODE_IP,
             30083, answered_by("b1:8080", "b2:8080"), src="node"),
    # localhostNodePorts (upstream's default in iptables mode): the node's own processes reach NodePorts on
    # 127.0.0.1 too, bpf mode through its socket hooks. Upstream's nftables and ipvs modes never serve them, nor do
    # pyproxy's netfilter and userspace modes (docs/differences.md): nothing listens there, the node refuses.
    FlowCase("from the node to a NodePort on 127.0.0.1", "tcp", LOCALHOST, 30080, answered_by("b1:8080", "b2:8080"),
             src="node", by_mode=NO_LOCALHOST_NODEPORTS),
    FlowCase("from the node to a NodePort on 127.0.0.1, udp", "udp", LOCALHOST, 30053,
             answered_by("b1:5353", "b2:5353"), src="node", by_mode=NO_LOCALHOST_NODEPORTS),
    FlowCase("from the node to 127.0.0.1, externalTrafficPolicy Local without a local endpoint: every endpoint",
             "tcp", LOCALHOST, 30083, answered_by("b1:8080", "b2:8080"), src="node", by_mode=NO_LOCALHOST_NODEPORTS),
    # A pod's 127.0.0.1 is its own (nothing listens on the NodePort there), in every mode as upstream.
    FlowCase("from a pod to 127.0.0.1:<nodePort>: its own loopback", "tcp", LOCALHOST, 30080, REFUSED, src="b1"),
    # ipvs mode, as upstream's IPVS proxier, has one virtual server for every source: with a local endpoint it
    # serves the node (and pods) this node's endpoints only; without one, every endpoint (upstream's PR 97081),
    # while a filter rule drops sources from outside the cluster.
    FlowCase("from the node, externalTrafficPolicy Local with a local endpoint: every endpoint", "tcp", NODE_IP,
             30082, answered_by("b1:8080", "b2:8080"), src="node", by_mode={"ipvs": answered_by("b1:8080")}),
)


# internalTrafficPolicy Local, from pods and from the node: only this node's endpoints; with none here while the
# cluster has some, dropped (upstream's DROP: the client waits). It applies to the ClusterIP only.
ITP_CASES = (
    FlowCase("internalTrafficPolicy Local: a pod reaches this node's endpoint only", "tcp", "10.96.20.15", 80,
             answered_by("b1:8080"), src="b1"),
    FlowCase("internalTrafficPolicy Local: the node reaches this node's endpoint only", "tcp", "10.96.20.15", 80,
             answered_by("b1:8080"), src="node"),
    FlowCase("internalTrafficPolicy Local: the NodePort still reaches every endpoint", "tcp", NODE_IP, 30085,
             answered_by("b1:8080", "b2:8080")),
    # No ready endpoint here: this node's serving and terminating one (upstream's ProxyTerminatingEndpoints, per
    # scope), though another node's is ready.
    FlowCase("internalTrafficPolicy Local: this node's terminating endpoint when none here is ready", "tcp",
             "10.96.20.17", 80, answered_by("b2:8080"), src="b1"),
    FlowCase("internalTrafficPolicy Local, no endpoint on this node: a pod's flow is dropped", "tcp", "10.96.20.16",
             80, NO_ANSWER, src="b1"),
    # bpf mode serves the node's own connect() in its socket hook, before any packet exists: there it fails the
    # connect with ETIMEDOUT at once, the error a dropped SYN ends in, rather than refuse it (a REJECT) or let
    # an untranslated packet to the ClusterIP leave by the default route. ipvs mode refuses it: IPVS schedules
    # the node's own flows in its local-out hook, before filter OUTPUT and INPUT where the drop rule could act,
    # and a virtual server without real servers answers port unreachable (ip_vs_leave), as upstream's IPVS
    # proxier does for every source; dropping it there would need a rule in mangle or raw OUTPUT.
    FlowCase("internalTrafficPolicy Local, no endpoint on this node: the node's flow is dropped", "tcp",
             "10.96.20.16", 80, NO_ANSWER, src="node", by_mode={"ipvs": REFUSED}),
    FlowCase("internalTrafficPolicy Local, no endpoint on this node: the NodePort still answers", "tcp", NODE_IP,
             30086, answered_by("b1:8080", "b2:8080")),
)


# Topology-aware routing (PreferClose or the topology-mode annotation Auto; hints.forZones): the cluster endpoints
# hinted for the node's zone, from every source and frontend, unless an endpoint lacks a hint or none names the
# zone; this node's endpoints (externalTrafficPolicy Local) ignore hints.
TOPOLOGY_CASES = (
    FlowCase("PreferClose: a pod reaches the endpoints hinted for this zone", "tcp", "10.96.20.18", 80,
             answered_by("b1:8080", "b3:8080"), src="b2"),
    FlowCase("PreferClose: the node reaches the endpoints hinted for this zone", "tcp", "10.96.20.18", 80,
             answered_by("b1:8080", "b3:8080"), src="node"),
    FlowCase("PreferClose: a NodePort reaches the endpoints hinted for this zone", "tcp", NODE_IP, 30087,
             answered_by("b1:8080", "b3:8080")),
    FlowCase("topology-mode Auto: the endpoint hinted for this zone", "tcp", "10.96.20.19", 80, answered_by("b2:8080"),
             src="b1"),
    FlowCase("hints without PreferClose or Auto: every endpoint", "tcp", "10.96.20.20", 80,
             answered_by("b1:8080", "b2:8080", "b3:8080"), src="b1"),
    FlowCase("PreferClose, an endpoint without a hint: every endpoint", "tcp", "10.96.20.21", 80,
             answered_by("b1:8080", "b2:8080", "b3:8080"), src="b1"),
    FlowCase("PreferClose, no endpoint hinted for this zone: every endpoint", "tcp", "10.96.20.22", 80,
             answered_by("b1:8080", "b2:8080"), src="b3"),
    FlowCase("PreferClose, nothing ready: the terminating endpoints, hints ignored", "tcp", "10.96.20.23", 80,
             answered_by("b1:8080", "b2:8080"), src="b3"),
    FlowCase("PreferClose, externalTrafficPolicy Local: outside clients get this node's endpoint", "tcp", NODE_IP,
             30088, answered_by("b2:8080")),
    FlowCase("PreferClose, externalTrafficPolicy Local: pods get the zone's endpoints", "tcp", "10.96.20.24", 80,
             answered_by("b1:8080", "b3:8080"), src="b2"),
)
# The weights annotation's 0, in every mode (schedulers, which only bpf and ipvs have: tests/schedcases.py).
WEIGHT_CASES = (
    FlowCase("weight 0 quiesces an endpoint: TCP", "tcp", "10.96.20.25", 80, answered_by("b1:8080", "b3:8080")),
    FlowCase("weight 0 quiesces an endpoint: UDP", "udp", "10.96.20.25", 53, answered_by("b1:5353", "b3:5353")),
)
# The IPv4 halves of the dual-stack Services: every mode serves them, its IPv6 halves or not.
DUAL_STACK_IPV4_CASES = (
    FlowCase("dual-stack: the IPv4 ClusterIP reaches the IPv4 endpoints only", "tcp", "10.96.20.30", 80,
             answered_by("b1:8080")),
    FlowCase("dual-stack: the NodePort on the node's IPv4 address reaches the IPv4 endpoints only", "tcp", NODE_IP,
             30094, answered_by("b1:8080")),
    # A frontend uses only its family's slices (upstream's per-family proxiers).
    FlowCase("an IPv4-only Service ignores IPv6 slices: no endpoints, rejected", "tcp", "10.96.20.31", 80, REFUSED),
)
CASES += EXTERNAL_CASES + ITP_CASES + TOPOLOGY_CASES + WEIGHT_CASES + DUAL_STACK_IPV4_CASES

# The IPv6 counterparts of the cases above, and dual-stack Services reached on IPv6. The client and the pods send
# from their IPv6 addresses.
IPV6_CASES = (
    FlowCase("IPv6: ready endpoints only, tcp", "tcp", "fd00:10:96::1", 80, answered_by("b1:8080", "b2:8080"),
             sees="source", sees_by_mode=PROXIED),
    FlowCase("IPv6: udp port", "udp", "fd00:10:96::1", 53, answered_by("b1:5353", "b2:5353")),
    FlowCase("IPv6: from a pod", "tcp", "fd00:10:96::1", 80, answered_by("b1:8080", "b2:8080"), src="b3"),
    # A TCP reset; for UDP ICMPv6 port unreachable (nftables' `reject` in ip6, ip6tables' icmp6-port-unreachable).
    FlowCase("IPv6: no ready endpoints: rejected", "tcp", "fd00:10:96::3", 80, REFUSED),
    FlowCase("IPv6: no ready endpoints: rejected, udp", "udp", "fd00:10:96::3", 53, REFUSED),
    FlowCase("IPv6: a NodePort on the node's IPv6 address reaches the endpoints", "tcp", NODE_IP6, 30090,
             answered_by("b1:8080", "b2:8080")),
    FlowCase("IPv6: a NodePort on the node's IPv6 address reaches the endpoints, udp", "udp", NODE_IP6, 30091,
             answered_by("b1:5353", "b2:5353")),
    FlowCase("IPv6: externalTrafficPolicy Local: only this node's endpoint", "tcp", NODE_IP6, 30092,
             answered_by("b1:8080"), sees="source", sees_by_mode=PROXIED),
    FlowCase("IPv6: a NodePort of a Service without endpoints: refused", "tcp", NODE_IP6, 30093, REFUSED),
    FlowCase("IPv6: a load-balancer IP whose source ranges leave the client out: no answer", "tcp", LB6_CLOSED_IP,
             80, NO_ANSWER),
    FlowCase("IPv6: a load-balancer IP whose source ranges hold the client", "tcp", LB6_OPEN_IP, 80,
             answered_by("b1:8080", "b2:8080")),
    FlowCase("dual-stack: the IPv6 ClusterIP reaches the IPv6 endpoints only", "tcp", "fd00:10:96::30", 80,
             answered_by("b2:8080")),
    FlowCase("dual-stack: the NodePort on the node's IPv6 address reaches the IPv6 endpoints only", "tcp", NODE_IP6,
             30094, answered_by("b2:8080")),
    # The node's own processes, on the OUTPUT path as for IPv4.
    FlowCase("IPv6: from the node itself", "tcp", "fd00:10:96::1", 80, answered_by("b1:8080", "b2:8080"), src="node"),
    FlowCase("IPv6: from the node itself to a NodePort", "tcp", NODE_IP6, 30090, answered_by("b1:8080", "b2:8080"),
             src="node"),
    # TCP, as the IPv4 case: the reset reaches the node's socket. (A UDP datagram from the node itself got no
    # ICMPv6 error back in nftables and both iptables flavours alike on this kernel: its sender waits.) ipvs: IPVS
    # refuses in its local-out hook with ICMPv6 port unreachable, which reaches the socket while connect() still
    # holds it, and TCP drops it (TcpExtLockDroppedIcmps; IPv4's ICMP error is not lost so): the SYN's
    # retransmission is refused, after 1 s, past the table's 0.5 s. Seen with IPVS alone, no rule of pyproxy's, on
    # Debian's 6.1; upstream's IPVS proxier, whose virtual server is the same, shares it. tests/guest_ipvs checks
    # the refusal with a longer wait.
    FlowCase("IPv6: from the node, no endpoints: rejected", "tcp", "fd00:10:96::3", 80, REFUSED, src="node",
             by_mode={"ipvs": NO_ANSWER}),
)

NOT_RENDERED_YET: dict[str, str] = {}
"""The modes that do not serve IPV6_CASES yet, and why (their backends' `ip_families`)."""


def outcome_of(result: Mapping[str, Any]) -> Outcome:
    """Classify a `Lab.probe` result."""
    replies: dict[str, int] = result["replies"]
    errors: dict[str, int] = result["errors"]
    if replies and not result["failures"]:
        return sticky(*replies) if len(replies) == 1 else answered_by(*replies)
    if not replies and set(errors) == {"refused"}:
        return REFUSED
    if not replies:
        return NO_ANSWER
    return Outcome(f"mixed {replies} {errors}")


def matches(expected: Outcome, seen: Outcome) -> bool:
    if expected.kind == "sticky":
        # One backend for all flows, and a legitimate one.
        return seen.kind == "sticky" and seen.backends <= expected.backends
    if expected.kind == "backends" and len(expected.backends) == 1:
        return seen.backends == expected.backends and seen.kind in ("backends", "sticky")
    return seen == expected


def results(lab: Any, mode: str, cases: Sequence[FlowCase] = CASES,
            timeout: float = 1.0) -> list[tuple[FlowCase, str | None]]:
    """Run `cases` with real flows in `lab` (a started labkit.Lab whose node runs pyproxy in `mode` on the
    cases' manifests): each case with None when it did what `mode` must, else what was wrong. `timeout`: the
    seconds a flow that must be answered gets."""
    addresses: dict[str, set[str]] = {}

    def sources(role: str) -> set[str]:
        if role not in addresses:
            addresses[role] = lab.addresses(role)
        return addresses[role]

    done: list[tuple[FlowCase, str | None]] = []
    for case in cases:
        expected = case.expected(mode)
        positive = expected.kind in ("backends", "sticky")
        # Enough flows that a missing backend or a broken affinity shows; few where nothing should answer. A case
        # that must answer every flow stops after a few failures: a mode that cannot serve it is told as surely,
        # without waiting out a timeout per flow. Refused means refused within the 0.5 s a flow gets: at once.
        result = lab.probe(case.proto, case.dst, case.port, 30 if positive else 4, timeout=timeout if positive else 0.5,
                           ns=case.src, max_failures=3 if positive else None)
        seen = outcome_of(result)
        problem = None
        if not matches(expected, seen):
            problem = f"expected {expected}, saw {seen}"
        elif positive and case.seen(mode) is not None:
            allowed = sources(case.src if case.seen(mode) == "source" else "node")
            if not set(result["seen_from"]) <= allowed:
                problem = f"endpoints saw {result['seen_from']}, expected the {case.seen(mode)}'s {sorted(allowed)}"
        done.append((case, problem))
    return done


def describe_case(case: FlowCase) -> str:
    return f"{case.name} ({case.src} -> {case.proto} {case.dst}:{case.port})"


def mismatches(lab: Any, mode: str, cases: Sequence[FlowCase] = CASES, timeout: float = 1.0) -> list[str]:
    """`results` of the cases that went wrong, one line each."""
    return [f"{describe_case(case)}: {problem}" for case, problem in results(lab, mode, cases, timeout) if problem]
