"""pyproxy and its node, end to end: started from manifests with --hostname-override in a lab's node namespace,
the healthCheckNodePort of a LoadBalancer Service with externalTrafficPolicy Local answers as upstream's (200 with
a local endpoint, 503 once none is local, closed once the Service is gone), /healthz answers upstream's JSON, and
the node's addresses (followed as they change) are the NodePorts' addresses."""

from __future__ import annotations

import json

import pytest
from labkit import describe
from labkit.manifests import Port, endpoint_slice, service
from labkit.netns import NODE_CLIENT_IP

pytestmark = pytest.mark.root

NODE = "lab-node"
LB_IP = "10.96.0.40"
HEALTH_PORT = 32100
LB_PORTS = [Port("http", 80, 8080, node_port=30080)]


def lb(env, nodes: dict[str, str]) -> list[str]:
    """The LoadBalancer Service (eTP Local) and a slice of every backend, on the nodes `nodes` names."""
    return [service("lb", LB_IP, LB_PORTS, type="LoadBalancer", external_traffic_policy="Local",
                    health_check_node_port=HEALTH_PORT),
            endpoint_slice("lb", {b.ip: True for b in env.lab.backends}, LB_PORTS, node_names=nodes)]


def body(local: int, healthy: bool = True) -> dict[str, object]:
    return {"service": {"namespace": "default", "name": "lb"}, "localEndpoints": local, "serviceProxyHealthy": healthy}


def test_health_check_node_port_follows_the_local_endpoints(make_env, record_property) -> None:
    env = make_env(2)
    b1, b2 = env.lab.backends
    env.write("lb.yaml", *lb(env, {b1.ip: NODE, b2.ip: "other-node"}))
    proxy = env.start(args=[f"--hostname-override={NODE}"])
    url = f"http://{NODE_CLIENT_IP}:{HEALTH_PORT}/"

    # From the node itself, and from the client side as a load balancer probes it.
    for ns in (env.lab.node, env.lab.client):
        answer = env.lab.http_get(ns, url, wait=5.0, expect=200)
        assert answer["status"] == 200, answer
        assert json.loads(answer["body"]) == body(1), answer
    record_property("health_check_local", answer["body"])

    # b1 moves to another node: none is local.
    env.write("lb.yaml", *lb(env, {b1.ip: "other-node", b2.ip: "other-node"}))
    answer = env.lab.http_get(env.lab.node, url, wait=5.0, expect=503)
    assert answer["status"] == 503 and json.loads(answer["body"]) == body(0), answer

    # Both on this node: two.
    env.write("lb.yaml", *lb(env, {b1.ip: NODE, b2.ip: NODE}))
    elapsed = env.poll(lambda: json.loads(env.lab.http_get(env.lab.node, url)["body"] or "{}") == body(2), 5.0)
    assert elapsed is not None, env.lab.http_get(env.lab.node, url)

    # The Service is gone: so is its server.
    (env.source / "lb.yaml").unlink()
    assert env.poll(lambda: env.lab.http_get(env.lab.node, url)["status"] is None, 5.0) is not None
    assert proxy.wait_for_log(f"closing the health check of default/lb on port {HEALTH_PORT}", 2.0)


def test_healthz_answers_upstreams_json(make_env) -> None:
    env = make_env(1)
    proxy = env.start(args=[f"--hostname-override={NODE}"])
    answer = env.lab.http_get(env.lab.node, proxy.healthz_url)
    assert answer["status"] == 200, answer
    health = json.loads(answer["body"])
    assert list(health) == ["lastUpdated", "currentTime", "nodeEligible", "healthy", "status"], health
    assert health["nodeEligible"] is True and health["healthy"] is True
    assert health["lastUpdated"] == health["currentTime"], "healthy: lastUpdated is now, as upstream's"
    assert health["currentTime"].endswith("Z") and "T" in health["currentTime"]
    assert env.lab.http_get(env.lab.node, proxy.healthz_url.replace("/healthz", "/livez"))["status"] == 200


@pytest.mark.parametrize("mode", ["bpf", "iptables"])
def test_node_ports_use_the_nodes_addresses_as_they_change(make_env, mode: str) -> None:
    env = make_env(1)
    (b1,) = env.lab.backends
    env.write("lb.yaml", *lb(env, {b1.ip: NODE}))
    proxy = env.start(mode=mode, args=[f"--hostname-override={NODE}", "--nodeport-addresses=10.0.0.0/8"])
    started = proxy.log_text()
    assert "NodePorts use node addresses" in started and NODE_CLIENT_IP in started, proxy.log_tail()
    assert "default/lb: LoadBalancer" not in started  # no ingress IP: no load-balancer frontend
    assert "not served" not in started, proxy.log_tail()
    # bpf mode serves this NodePort (externalTrafficPolicy Local: no SNAT needed) on the node's addresses, iptables
    # mode every NodePort (KUBE-SERVICES jumps to KUBE-NODEPORTS from each of them, rewritten when they change).
    env.assert_reaches("tcp", NODE_CLIENT_IP, 30080, {"b1:8080"})
    # An address added to the node is followed; one outside --nodeport-addresses is not chosen.
    env.lab.exec(env.lab.node, "ip", "addr", "add", "10.250.0.1/32", "dev", env.lab.node_client_ifname)
    env.lab.exec(env.lab.node, "ip", "addr", "add", "172.31.0.1/32", "dev", env.lab.node_client_ifname)
    assert proxy.wait_for_log("10.250.0.1 (--nodeport-addresses=10.0.0.0/8)", 5.0), proxy.log_tail()
    assert "172.31.0.1" not in proxy.log_text()
    assert env.poll(lambda: env.probe("tcp", "10.250.0.1", 30080, 3)["replies"] == {"b1:8080": 3}, 5.0) is not None
    outside = env.probe("tcp", "172.31.0.1", 30080, 3, timeout=0.5)
    assert not outside["replies"] and set(outside["errors"]) == {"refused"}, describe(outside)  # the node's stack
    # The health check answers on the new address once the sync the change started is applied (iptables mode serves
    # the NodePort on every local address before that: its answer above does not say the sync is done).
    answer = env.lab.http_get(env.lab.node, f"http://10.250.0.1:{HEALTH_PORT}/", wait=5.0, expect=200)
    assert answer["status"] == 200 and json.loads(answer["body"]) == body(1), answer


def test_following_the_api_the_node_being_deleted_fails_healthz_and_names_the_primary_address(
        make_env, cluster, kube, namespace: str) -> None:
    """The own Node from the API: its InternalIP is the primary address (--nodeport-addresses=primary; the lab's
    node has no default route, so before the Node there is none), and once it has a deletionTimestamp (held by a
    finalizer, as a drained node is) /healthz answers 503 with "nodeEligible": false, as upstream >= 1.28."""
    name = f"node-{namespace}"
    path = f"/api/v1/nodes/{name}"
    kube.api.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "finalizers": ["pyproxy.test/hold"]},
    })
    try:
        node = kube.api.request("GET", path)
        node["status"] = {"addresses": [{"type": "InternalIP", "address": NODE_CLIENT_IP}]}
        kube.api.request("PUT", f"{path}/status", body=node)
        env = make_env(1)
        proxy = env.start_api(cluster, node=name, args=["--nodeport-addresses=primary"])
        assert proxy.wait_for_log(f"NodePorts use node addresses {NODE_CLIENT_IP} (--nodeport-addresses=primary)",
                                  10.0), proxy.log_tail()
        answer = env.lab.http_get(env.lab.node, proxy.healthz_url)
        assert answer["status"] == 200 and json.loads(answer["body"])["nodeEligible"] is True, answer

        kube.api.request("DELETE", path)  # the finalizer holds it: a deletionTimestamp, not gone
        answer = env.lab.http_get(env.lab.node, proxy.healthz_url, wait=10.0, expect=503)
        health = json.loads(answer["body"])
        assert answer["status"] == 503 and health["nodeEligible"] is False and health["healthy"] is True, answer
    finally:
        node = kube.api.request("GET", path)
        node["metadata"]["finalizers"] = []
        kube.api.request("PUT", path, body=node)
