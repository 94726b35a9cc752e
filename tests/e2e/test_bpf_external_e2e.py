"""bpf mode's external frontends with real packets: a NodePort with externalTrafficPolicy Local, reached by a client
outside the cluster on the node's own address (the lab's client link), TC and XDP.

What a user checks: only this node's endpoints answer, they see the client's own address (no SNAT), a NodePort
whose endpoints are all on other nodes does not answer (dropped, as upstream: the load balancer's health check
steers clients to another node) while its ClusterIP serves every endpoint, and receivers count no checksum error.
"""

from __future__ import annotations

import pytest
from labkit import describe
from labkit.manifests import Port, endpoint_slice, service
from labkit.netns import NODE_CLIENT_IP

pytestmark = pytest.mark.root

NODE = "lab-node"


@pytest.mark.parametrize("xdp", [False, True], ids=["tc", "xdp"])
def test_nodeport_with_local_policy_serves_outside_clients_from_this_nodes_endpoints(make_env, xdp: bool) -> None:
    env = make_env(2)
    b1, b2 = (b.ip for b in env.lab.backends)
    here, elsewhere = Port("http", 80, 8080, node_port=30080), Port("http", 80, 8080, node_port=30081)
    env.write("here.yaml", service("here", "10.96.30.1", [here], type="NodePort", external_traffic_policy="Local"),
              endpoint_slice("here", {b1: True, b2: True}, [here], node_names={b1: NODE, b2: "other-node"}))
    env.write("elsewhere.yaml",
              service("elsewhere", "10.96.30.2", [elsewhere], type="NodePort", external_traffic_policy="Local"),
              endpoint_slice("elsewhere", {b2: True}, [elsewhere], node_names={b2: "other-node"}))
    env.start(args=[f"--hostname-override={NODE}"], xdp_devices=[env.lab.node_client_ifname] if xdp else None)

    env.assert_reaches("tcp", NODE_CLIENT_IP, 30080, {"b1:8080"})  # and the client's own address seen
    none = env.probe("tcp", NODE_CLIENT_IP, 30081, 4, timeout=0.5)
    assert not none["replies"] and set(none["errors"]) == {"timeout"}, f"expected no answer: {describe(none)}"
    env.assert_reaches("tcp", "10.96.30.2", 80, {"b2:8080"})  # the ClusterIP serves every endpoint
    env.assert_no_checksum_errors()
