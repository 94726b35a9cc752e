"""/healthz and the healthCheckNodePort servers, answering over real HTTP on 127.0.0.1 in-process: upstream's
status codes, headers and JSON bodies, servers opening and closing with the Services, a port in use logged."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Node,
    Protocol,
    Service,
    ServicePort,
    TrafficPolicy,
)
from pyproxy.model.state import HealthCheck
from pyproxy.proxier.healthcheck import ServiceHealthServers
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth, go_time, health_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str = "/", host: str = "127.0.0.1") -> tuple[int, dict[str, str], str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{host}:{port}{path}", timeout=2) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


class Clock:
    def __init__(self) -> None:
        self.now = 1764075600.25  # 2025-11-25T13:00:00.25Z

    def __call__(self) -> float:
        return self.now


def test_times_are_written_as_gos_json_writes_them() -> None:
    assert go_time(1764075600.25) == "2025-11-25T13:00:00.25Z"
    assert go_time(1764075600.0) == "2025-11-25T13:00:00Z"
    assert go_time(None) == "0001-01-01T00:00:00Z"


def test_healthz_answers_upstreams_body_and_503_while_the_node_is_being_deleted() -> None:
    clock = Clock()
    health = ProxyHealth(sync_period=30, clock=clock)
    server = health_server("127.0.0.1", 0, health).start()
    try:
        code, headers, body = get(server.port, "/healthz")
        assert code == 503, "not programmed yet"
        assert json.loads(body) == {"lastUpdated": "0001-01-01T00:00:00Z", "currentTime": "2025-11-25T13:00:00.25Z",
                                    "nodeEligible": True, "healthy": False}
        health.updated()
        clock.now += 5
        code, headers, body = get(server.port, "/healthz")
        assert (code, headers["Content-Type"], headers["X-Content-Type-Options"]) == (200, "application/json",
                                                                                      "nosniff")
        assert body == ('{"lastUpdated":"2025-11-25T13:00:05.25Z","currentTime":"2025-11-25T13:00:05.25Z",'
                        '"nodeEligible":true,"healthy":true,'
                        '"status":{"IPv4":{"lastUpdated":"2025-11-25T13:00:00.25Z","healthy":true}}}')
        health.set_node(Node("node-a", deleting=True))
        code, _, body = get(server.port, "/healthz")
        assert code == 503 and json.loads(body)["nodeEligible"] is False and json.loads(body)["healthy"] is True
        assert json.loads(body)["lastUpdated"] == "2025-11-25T13:00:00.25Z", "the last sync, as upstream when 503"
        health.set_node(Node("node-a"))
        assert get(server.port, "/healthz")[0] == 200
        health.set_node(None)  # the Node was deleted from the API
        assert get(server.port, "/healthz")[0] == 503
        assert get(server.port, "/livez")[:1] == (200,), "/livez: the process runs"
        health.set_node(Node("node-a"))
        health.queued()
        clock.now += 61  # a change waited longer than two sync periods
        code, _, body = get(server.port, "/healthz")
        assert code == 503 and json.loads(body)["healthy"] is False and json.loads(body)["nodeEligible"] is True
    finally:
        server.stop()


@pytest.fixture
def servers() -> Iterator[tuple[ServiceHealthServers, Clock, ProxyHealth]]:
    clock = Clock()
    health = ProxyHealth(sync_period=30, clock=clock)
    health.updated()
    hs = ServiceHealthServers(health, host="127.0.0.1")
    yield hs, clock, health
    hs.stop()


def test_a_service_with_local_endpoints_answers_200_with_upstreams_body_and_headers(servers) -> None:
    hs, clock, health = servers
    port = free_port()
    hs.update({"shop/web": HealthCheck(port, 2)})
    code, headers, body = get(port, "/any/path")
    assert code == 200
    assert (headers["Content-Type"], headers["X-Content-Type-Options"], headers["X-Load-Balancing-Endpoint-Weight"]) \
        == ("application/json", "nosniff", "2")
    assert body == ('{\n\t"service": {\n\t\t"namespace": "shop",\n\t\t"name": "web"\n\t},\n\t"localEndpoints": 2,\n'
                    '\t"serviceProxyHealthy": true\n}')
    hs.update({"shop/web": HealthCheck(port, 0)})
    code, headers, body = get(port)
    assert (code, headers["X-Load-Balancing-Endpoint-Weight"], json.loads(body)["localEndpoints"]) == (503, "0", 0)
    hs.update({"shop/web": HealthCheck(port, 1)})
    health.queued()
    clock.now += 61  # a change waited longer than two sync periods: unhealthy, 503 even with a local endpoint
    code, _, body = get(port)
    assert code == 503 and json.loads(body) == {"service": {"namespace": "shop", "name": "web"}, "localEndpoints": 1,
                                                "serviceProxyHealthy": False}


def test_servers_follow_the_services_and_a_port_in_use_is_logged(servers, caplog: pytest.LogCaptureFixture) -> None:
    hs, _, _ = servers
    a, b, taken = free_port(), free_port(), socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        with caplog.at_level("INFO", logger="pyproxy.proxier.healthcheck"):
            hs.update({"default/a": HealthCheck(a, 1), "default/b": HealthCheck(busy, 1)})
            hs.update({})  # the next sync tries again, without logging again
        assert get(a)[0] == 200, "the other Service is served"
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert errors == [f"cannot serve the health check of default/b on 127.0.0.1:{busy}: Address already in use "
                          "(tried again at every sync)"]
        assert hs.port("default/b") is None
        hs.update({"default/b": HealthCheck(b, 3)})  # its port changed: now it binds
        assert json.loads(get(b)[2])["localEndpoints"] == 3
        hs.update({"default/a": None})  # Service a is gone
        with pytest.raises(urllib.error.URLError):
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"http://127.0.0.1:{a}/", timeout=1)
        hs.update({"default/b": HealthCheck(a, 3)})  # moved to another port: the old one closes
        assert hs.port("default/b") == a and get(a)[0] == 200
    finally:
        taken.close()


def local_lb(port: int) -> Service:
    ports = (ServicePort("http", 80, Protocol.TCP, 8080, 30080), ServicePort("dns", 53, Protocol.UDP, 53, 30053))
    return Service("default", "lb", "LoadBalancer", ("10.96.0.30",), ports,
                   external_traffic_policy=TrafficPolicy.LOCAL, health_check_node_port=port)


def lb_slice(*endpoints: tuple[str, str | None]) -> EndpointSlice:
    return EndpointSlice("default", "lb-1", "lb", "IPv4", tuple(Endpoint((ip,), node_name=n) for ip, n in endpoints),
                         (EndpointPort("http", 8080, Protocol.TCP), EndpointPort("dns", 53, Protocol.UDP)))


def test_the_proxier_serves_each_services_health_check_from_the_desired_state() -> None:
    health = ProxyHealth(sync_period=30)
    hs = ServiceHealthServers(health, host="127.0.0.1")
    p = Proxier(FakeDataplane(), min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("fake"), health=health,
                node_name="node-a", service_health=hs)
    p.set_node_inputs(NodeInputs("node-a", ("10.0.0.5",), "10.0.0.5"))
    port, moved = free_port(), free_port()
    try:
        p.set_service("default/lb", local_lb(port))
        p.set_endpoint_slice("default/lb-1", lb_slice(("10.1.0.1", "node-a"), ("10.1.0.2", "node-a"),
                                                      ("10.1.0.3", "node-b")))
        p.mark_synced()
        p.sync()
        code, headers, body = get(port)
        assert (code, json.loads(body)["localEndpoints"], headers["X-Load-Balancing-Endpoint-Weight"]) == (200, 2, "2")
        p.set_endpoint_slice("default/lb-1", lb_slice(("10.1.0.3", "node-b"), ("10.1.0.4", None)))
        p.sync()
        assert get(port)[0] == 503 and json.loads(get(port)[2])["localEndpoints"] == 0
        p.set_service("default/lb", local_lb(moved))
        p.sync()
        assert get(moved)[0] == 503 and hs.port("default/lb") == moved
        p.set_service("default/lb", None)
        p.sync()
        assert hs.port("default/lb") is None
    finally:
        hs.stop()


def test_with_nodeport_addresses_the_servers_listen_on_them_and_follow_them() -> None:
    """Upstream binds the health check node ports to the --nodeport-addresses addresses when given (here two of
    the loopback's), and moves with them."""
    health = ProxyHealth(sync_period=30)
    health.updated()
    hs = ServiceHealthServers(health, on_nodeport_addresses=True)
    port = free_port()
    try:
        hs.update({"default/web": HealthCheck(port, 1)}, ("127.0.0.2",))
        assert get(port, host="127.0.0.2")[0] == 200
        with pytest.raises(urllib.error.URLError):
            get(port, host="127.0.0.1")
        hs.update({}, ("127.0.0.1", "127.0.0.3"))  # the node's addresses changed: the servers move
        assert get(port, host="127.0.0.1")[0] == get(port, host="127.0.0.3")[0] == 200
        with pytest.raises(urllib.error.URLError):
            get(port, host="127.0.0.2")
        hs.update({}, ())
        assert hs.port("default/web") is None, "no node-port address: no server, as upstream"
    finally:
        hs.stop()


def test_a_health_check_node_port_serves_on_an_ipv6_node_address_too() -> None:
    """A dual-stack node's --nodeport-addresses hold IPv6 addresses too: its servers listen there as well (here
    on the loopback's ::1)."""
    health = ProxyHealth(sync_period=30)
    health.updated()
    hs = ServiceHealthServers(health, on_nodeport_addresses=True)
    port = free_port()
    try:
        hs.update({"default/web": HealthCheck(port, 1)}, ("127.0.0.1", "::1"))
        assert get(port, host="[::1]")[0] == get(port, host="127.0.0.1")[0] == 200
    finally:
        hs.stop()
