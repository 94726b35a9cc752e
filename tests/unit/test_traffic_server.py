"""The lab's traffic server (tests/labkit/traffic.py, also the lab pods' echo server) on loopback: a probe line and an
HTTP GET get the same answer, naming the server and the client address it saw."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest
from labkit import traffic


@pytest.fixture
def server() -> Iterator[traffic._QuietTCPServer]:
    srv = traffic._QuietTCPServer("web-1", ("127.0.0.1", 0))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_probe_gets_one_line(server: traffic._QuietTCPServer) -> None:
    port = server.server_address[1]
    reply = traffic.parse_reply(traffic._tcp_request("127.0.0.1", port, timeout=5.0))
    assert reply is not None
    assert reply[0] == f"web-1:{port}" and reply[1] == "127.0.0.1"


def test_an_http_get_gets_the_line_as_its_body(server: traffic._QuietTCPServer) -> None:
    port = server.server_address[1]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/anything", timeout=5.0) as resp:
        assert resp.status == 200
        body = resp.read().decode()
    name, peer = body.split()
    assert name == f"web-1:{port}" and peer.startswith("127.0.0.1:")
    head = urllib.request.Request(f"http://127.0.0.1:{port}/", method="HEAD")
    with opener.open(head, timeout=5.0) as resp:
        assert resp.status == 200 and resp.read() == b""
