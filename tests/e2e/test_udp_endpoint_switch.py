"""Stale UDP flows (issue 11; upstream kubernetes issues 19029, 48370, 125467): a UDP client that keeps sending
from one fixed source port to a Service while the Service's only endpoint is replaced must get its answers from
the new endpoint within about a second, in every mode, although the old endpoint's server is still up and
answering (which is what makes a stale flow dangerous: nothing ever fails, the answers just come from a pod
that left the Service).

Without clearing, the kernel's conntrack entry (netfilter modes) or the BPF connection-tracking entry (bpf mode)
keeps DNATing that source port to the old endpoint for as long as the client keeps sending. The netfilter modes
delete the entries of endpoints that left (model/conntrack.py plans it, netfilter.clear_stale_udp runs
`conntrack -D`); bpf mode needs no deletion: a flow whose backend is gone from its frontend's backends is
re-balanced at its next packet (the epoch / backends-map check in bpf/include/pyproxy/lb.h).

The client and the measurement are tests/udpswitch.py's (the IPVS guest runs the same). Measured, and printed
(run with -s to see it): from the manifest change to the first answer a brand-new flow gets
from b2 ("applied": the rules are in) and to the first answer the fixed-port flow gets from b2 ("switched").
ClusterIP and NodePort (clients outside the cluster: SNATed, cleared by port as upstream) are held side by side.
"""

from __future__ import annotations

import pytest
from flowcases import NOT_RENDERED_YET
from labkit.manifests import Port, endpoint_slice, service
from labkit.netns import ipv6_of
from udpswitch import describe, measure

MODES = [
    pytest.param("bpf", [], id="bpf"),
    pytest.param("nftables", [], id="nftables"),
    pytest.param("iptables", ["--iptables-backend=legacy"], id="iptables-legacy"),
    pytest.param("iptables", ["--iptables-backend=nft"], id="iptables-nft"),
    pytest.param("userspace", [], id="userspace"),
]
CONNTRACK_MODES = {"nftables", "iptables"}
"""The modes whose kernel conntrack entries must be deleted (bpf mode re-balances the flow at its next packet; the
userspace proxy ends the session of an endpoint that left, and the client's next datagram starts another)."""
B1, B2 = "10.201.1.2", "10.201.2.2"
NODE_IP, VIP = "10.200.0.1", "10.96.31.1"
DNS = Port("dns", 53, 5353, "UDP", node_port=30054)
TARGETS = {"cluster-ip": (VIP, 53, 40053), "node-port": (NODE_IP, 30054, 40054)}
SWITCH_LIMIT = 1.5
"""Seconds from the change being applied (a new flow reaches b2) to the fixed-port flow reaching b2."""

def _slice(*ips: str) -> str:
    return endpoint_slice("dns", dict.fromkeys(ips, True), [DNS])


@pytest.mark.root
@pytest.mark.parametrize(("mode", "args"), MODES)
def test_a_udp_client_on_a_fixed_port_follows_a_replaced_endpoint(make_env, mode: str, args: list[str]) -> None:
    env = make_env(backends=2)
    svc = service("dns", VIP, [DNS], type="NodePort")
    env.write("dns.yaml", svc, _slice(B1))
    env.start(mode=mode, args=args)
    timings = measure(env.lab, TARGETS, lambda: env.write("dns.yaml", svc, _slice(B2)))
    print(f"\n{mode} {' '.join(args)}: {describe(timings)}")
    for target, (applied, switched) in timings.items():
        assert switched - applied <= SWITCH_LIMIT, (
            f"{target}: the fixed-port flow reached b2 {switched - applied:.2f}s after new flows did")
    if mode in CONNTRACK_MODES:
        # Upstream's conntrack reconciler series count what `conntrack -D` deleted: at least the two fixed-port flows.
        metrics = env.metrics()
        assert metrics["kubeproxy_conntrack_reconciler_deleted_entries_total"] >= len(TARGETS), metrics
        assert metrics["kubeproxy_conntrack_reconciler_sync_duration_seconds_count"] >= 1


B1_6, B2_6 = ipv6_of(B1), ipv6_of(B2)
VIP6 = "fd00:10:96:31::1"
DNS6 = Port("dns", 53, 5353, "UDP", node_port=30055)
TARGETS6 = {"cluster-ip": (VIP6, 53, 40055), "node-port": (ipv6_of(NODE_IP), 30055, 40056)}


@pytest.mark.root
@pytest.mark.parametrize(("mode", "args"), [m for m in MODES if m.values[0] not in NOT_RENDERED_YET])
def test_an_ipv6_udp_client_on_a_fixed_port_follows_a_replaced_endpoint(make_env, mode: str, args: list[str]) -> None:
    """The same over IPv6: the stale entries go with `conntrack -f ipv6` (the one plan, model/conntrack.py); bpf mode
    re-balances the flow as for IPv4."""
    env = make_env(backends=2, ipv6=True)
    svc = service("dns6", VIP6, [DNS6], type="NodePort", cluster_ips=[VIP6])
    env.write("dns.yaml", svc, endpoint_slice("dns6", {B1_6: True}, [DNS6]))
    env.start(mode=mode, args=args)
    timings = measure(env.lab, TARGETS6,
                      lambda: env.write("dns.yaml", svc, endpoint_slice("dns6", {B2_6: True}, [DNS6])))
    print(f"\n{mode} {' '.join(args)} IPv6: {describe(timings)}")
    for target, (applied, switched) in timings.items():
        assert switched - applied <= SWITCH_LIMIT, (
            f"{target}: the fixed-port flow reached b2 {switched - applied:.2f}s after new flows did")
    if mode in CONNTRACK_MODES:  # the others delete nothing (CONNTRACK_MODES)
        assert env.metrics()["kubeproxy_conntrack_reconciler_deleted_entries_total"] >= len(TARGETS6)


POD_TARGETS = {"cluster-ip": (VIP, 53, 40057)}


@pytest.mark.root
@pytest.mark.parametrize(("mode", "args"), [
    pytest.param("bpf", [], id="bpf"),
    pytest.param("bpf", ["--bpf-socket-lb-hostns-only"], id="bpf-hostns-only"),
    pytest.param("nftables", [], id="nftables"),
])
def test_a_pods_connected_udp_socket_follows_a_replaced_endpoint(make_env, mode: str, args: list[str]) -> None:
    """Issue 26's third row: the same client in a pod of the node, its processes inside the cgroup the socket hooks
    are attached to (as below a real node's root cgroup). Its connected socket must move to the new endpoint as
    fast as in upstream's modes; a socket pointed at b1 once at connect() would keep b1 for its whole life."""
    env = make_env(backends=3, pods_in_cgroup=True)
    pod = env.lab.backends[2]
    assert env.lab.in_cgroup(pod.ns)
    svc = service("dns", VIP, [DNS])
    env.write("dns.yaml", svc, _slice(B1))
    env.start(mode=mode, args=args)
    timings = measure(env.lab, POD_TARGETS, lambda: env.write("dns.yaml", svc, _slice(B2)), ns=pod.ns)
    print(f"\n{mode} {' '.join(args)}, a pod's client: {describe(timings)}")
    for target, (applied, switched) in timings.items():
        assert switched - applied <= SWITCH_LIMIT, (
            f"{target}: the fixed-port flow reached b2 {switched - applied:.2f}s after new flows did")


NODE_TARGETS = {"cluster-ip": (VIP, 53, 40058)}


@pytest.mark.root
@pytest.mark.parametrize(("mode", "args"), [pytest.param("bpf", [], id="bpf"),
                                            pytest.param("nftables", [], id="nftables")])
def test_a_node_processes_connected_udp_socket_follows_a_replaced_endpoint(make_env, mode: str,
                                                                           args: list[str]) -> None:
    """The same client as a process of the node itself, whose connected socket the bpf socket hooks point at b1 at
    connect(): bpf mode destroys it once b1 leaves (bpf_sock_destroy, kernel 6.5; its owner reopens it, as a
    resolver does, and the new one gets b2), as fast as upstream's modes move its conntrack flow. nftables beside it
    (a node with a default route, which a node process's datagram to a ClusterIP takes there)."""
    env = make_env(backends=2, distro=True)
    svc = service("dns", VIP, [DNS])
    env.write("dns.yaml", svc, _slice(B1))
    env.start(mode=mode, args=args)
    timings = measure(env.lab, NODE_TARGETS, lambda: env.write("dns.yaml", svc, _slice(B2)), ns=env.lab.node)
    print(f"\n{mode} {' '.join(args)}, a node process: {describe(timings)}")
    for target, (applied, switched) in timings.items():
        assert switched - applied <= SWITCH_LIMIT, (
            f"{target}: the fixed-port flow reached b2 {switched - applied:.2f}s after new flows did")
    if mode == "bpf":
        assert "destroyed 1 connected UDP socket" in env.running.log_text(), env.running.log_tail()
