"""The userspace proxy's event loop with real sockets on loopback (no root, no namespace): round robin, the retry on
the next endpoint when one refuses, ClientIP affinity, UDP sessions and their idle end, a reset when no endpoint
answers; over IPv6 (::1) too. Counts only, no timing."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pyproxy.dataplane.userspace.proxy import Proxy
from pyproxy.dataplane.userspace.render import State, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Echo:
    """TCP and UDP servers on ip:port (127.0.0.N or ::1) answering their own name (the address, unless told)."""

    def __init__(self, ip: str, port: int, name: str | None = None) -> None:
        self.name = name or ip
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.tcp = socket.create_server((ip, port), family=family)
        self.udp = socket.socket(family, socket.SOCK_DGRAM)
        self.udp.bind((ip, port))
        for target in (self._tcp, self._udp):
            threading.Thread(target=target, daemon=True).start()

    def _tcp(self) -> None:
        while True:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                if conn.recv(64):
                    conn.sendall(self.name.encode())

    def _udp(self) -> None:
        while True:
            try:
                _, peer = self.udp.recvfrom(64)
                self.udp.sendto(self.name.encode(), peer)
            except OSError:
                return

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


@pytest.fixture
def setup() -> Iterator[tuple[Proxy, int, list[Echo]]]:
    port = _free_port()
    servers = [Echo("127.0.0.2", port), Echo("127.0.0.3", port)]  # 127.0.0.4: nothing listens
    proxy = Proxy(udp_idle_timeout=0.25)
    proxy.start()
    yield proxy, port, servers
    proxy.stop()
    for s in servers:
        s.close()


def serve(proxy: Proxy, frontend: Frontend, backends: tuple[Backend, ...], affinity: int = 0) -> None:
    sp = ServicePortState("ns/web", "p", frontend, backends, known_backends=backends,
                          session_affinity_seconds=affinity)
    assert proxy.apply(render(State(), {"ns/web": (sp,)}, full=True)) == {}


def tcp(ip: str, port: int) -> str:
    with socket.create_connection((ip, port), timeout=5) as c:  # either family, by the address
        c.sendall(b"hi")
        return c.recv(64).decode()


def udp(ip: str, port: int) -> str:
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as c:
        c.settimeout(5)
        c.sendto(b"hi", (ip, port))
        data, sender = c.recvfrom(64)
        assert sender[:2] == (ip, port), "the answer comes from the frontend"
        return data.decode()


def test_round_robin_and_a_retry_past_the_endpoint_that_refuses(setup) -> None:
    proxy, port, _ = setup
    front = Frontend("127.0.0.5", _free_port(), Protocol.TCP)
    serve(proxy, front, tuple(Backend(f"127.0.0.{i}", port) for i in (2, 3, 4)))
    answers = [tcp(front.ip, front.port) for _ in range(30)]
    assert len(answers) == 30  # every connection answered, though one endpoint in three refuses
    assert set(answers) == {"127.0.0.2", "127.0.0.3"}
    assert proxy.retries >= 10  # each of 127.0.0.4's turns moved on (a slow connect could add more)


def test_client_ip_affinity_sticks(setup) -> None:
    proxy, port, _ = setup
    front = Frontend("127.0.0.6", _free_port(), Protocol.TCP)
    serve(proxy, front, (Backend("127.0.0.2", port), Backend("127.0.0.3", port)), affinity=600)
    assert len({tcp(front.ip, front.port) for _ in range(10)}) == 1


def test_no_endpoint_answering_resets_the_client(setup) -> None:
    proxy, port, _ = setup
    front = Frontend("127.0.0.7", _free_port(), Protocol.TCP)
    serve(proxy, front, (Backend("127.0.0.4", port),))
    with pytest.raises((ConnectionResetError, BrokenPipeError)), \
            socket.create_connection((front.ip, front.port), timeout=5) as c:
        c.sendall(b"hi")
        if not c.recv(64):
            raise ConnectionResetError("closed without an answer")
    assert proxy.retries == 4  # one attempt per connect timeout (upstream's four)


def test_a_port_another_socket_holds_is_reported_not_opened(setup) -> None:
    proxy, port, _ = setup
    front = Frontend("127.0.0.9", _free_port(), Protocol.TCP)
    with socket.create_server(("0.0.0.0", front.port)):  # a node process on every address
        sp = ServicePortState("ns/web", "p", front, (Backend("127.0.0.2", port),))
        failed = proxy.apply(render(State(), {"ns/web": (sp,)}, full=True))
    assert list(failed) == [front] and "in use" in failed[front]


def test_udp_sessions_go_round_robin_and_answer_from_the_frontend(setup) -> None:
    proxy, port, _ = setup
    front = Frontend("127.0.0.8", _free_port(), Protocol.UDP)
    serve(proxy, front, (Backend("127.0.0.2", port), Backend("127.0.0.3", port)))
    answers = [udp(front.ip, front.port) for _ in range(10)]  # a new socket, so a new session, each
    assert sorted(set(answers)) == ["127.0.0.2", "127.0.0.3"] and answers.count("127.0.0.2") == 5


def test_an_idle_udp_session_ends_and_the_clients_next_datagram_starts_another(setup) -> None:
    proxy, port, _ = setup
    front = Frontend("127.0.0.10", _free_port(), Protocol.UDP)
    serve(proxy, front, (Backend("127.0.0.2", port), Backend("127.0.0.3", port)))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:  # one client: one address and port
        c.settimeout(5)
        c.sendto(b"hi", (front.ip, front.port))
        first = c.recv(64).decode()
        c.sendto(b"hi", (front.ip, front.port))
        assert c.recv(64).decode() == first, "one session while it is not idle"
        sessions = proxy.frontends[front].sessions
        end = time.monotonic() + 10
        while sessions and time.monotonic() < end:  # ends after 250 ms idle (polled, not timed)
            time.sleep(0.05)
        assert not sessions
        c.sendto(b"hi", (front.ip, front.port))
        assert c.recv(64).decode() != first, "a new session, the round robin's next endpoint"


@pytest.fixture
def setup6() -> Iterator[tuple[Proxy, list[int]]]:
    """Two IPv6 endpoints on ::1 (a port each), a third port where nothing listens."""
    ports = [_free_port6() for _ in range(3)]
    servers = [Echo("::1", ports[0], "b1"), Echo("::1", ports[1], "b2")]
    proxy = Proxy(udp_idle_timeout=0.25, cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/48"),
                  is_local=lambda ip: ip in ("::1", "127.0.0.1"))
    proxy.start()
    yield proxy, ports
    proxy.stop()
    for s in servers:
        s.close()


def _free_port6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


def test_an_ipv6_frontend_round_robins_retries_and_keeps_udp_sessions(setup6) -> None:
    proxy, ports = setup6
    front = Frontend("::1", _free_port6(), Protocol.TCP)
    serve(proxy, front, tuple(Backend("::1", p) for p in ports))
    answers = [tcp(front.ip, front.port) for _ in range(30)]
    assert len(answers) == 30 and set(answers) == {"b1", "b2"}  # the third endpoint refuses: retried
    assert proxy.retries >= 10
    dns = Frontend("::1", front.port, Protocol.UDP)  # the same port, UDP: a socket of its own
    serve(proxy, dns, tuple(Backend("::1", p) for p in ports[:2]))
    answers = [udp(dns.ip, dns.port) for _ in range(10)]
    assert sorted(set(answers)) == ["b1", "b2"] and answers.count("b1") == 5


def test_ipv6_client_ip_affinity_sticks(setup6) -> None:
    proxy, ports = setup6
    front = Frontend("::1", _free_port6(), Protocol.TCP)
    serve(proxy, front, tuple(Backend("::1", p) for p in ports[:2]), affinity=600)
    assert len({tcp(front.ip, front.port) for _ in range(10)}) == 1


def test_an_ipv6_listener_takes_no_ipv4_flow() -> None:
    proxy = Proxy(udp_idle_timeout=0.25)
    proxy.start()
    try:
        port = _free_port6()
        server = Echo("::1", _free_port6(), "b1")
        serve(proxy, Frontend("::", port, Protocol.TCP), (Backend("::1", server.tcp.getsockname()[1]),))
        assert tcp("::1", port) == "b1"
        with pytest.raises(ConnectionRefusedError):  # IPV6_V6ONLY: the wildcard takes no IPv4-mapped flow
            tcp("127.0.0.1", port)
        server.close()
    finally:
        proxy.stop()


def test_pods_are_inside_by_their_familys_cluster_cidr(setup6) -> None:
    proxy, _ = setup6
    assert proxy.internal("fd00:10:244:3::4") and proxy.internal("10.244.3.4") and proxy.internal("::1")
    assert not proxy.internal("fd00:10:245::4") and not proxy.internal("2001:db8::1")
    assert not proxy.internal("10.245.0.1")
