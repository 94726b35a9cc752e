"""Socket load balancing (bpf/include/pyproxy/sock.h): the cgroup hooks with real sockets.

Each test makes its own cgroup (under the machine's cgroup v2 hierarchy), network namespace and pin directory,
attaches the hooks to that cgroup only, and runs a client process inside both; a backend server listens in the
same namespace. Nothing outside the test's cgroup sees the hooks. All are removed even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Load
from harness import CAPACITY, ROOT, Dataplane

from pyproxy.dataplane.bpf import abi, cgroup, libbpf
from pyproxy.lab.netns import ensure_bpffs, ensure_cgroup2
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

pytestmark = ROOT

VIP, EMPTY_VIP = "10.96.77.1", "10.96.77.2"
TCP_BACKEND, UDP_BACKEND = Backend("127.0.0.1", 18080), Backend("127.0.0.1", 15353)

SERVER = textwrap.dedent("""
    import socket, sys, threading
    t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("127.0.0.1", 18080)); t.listen(16)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 15353))
    def udp():
        while True:
            data, peer = u.recvfrom(2048)
            u.sendto(b"udp:" + data, peer)
    threading.Thread(target=udp, daemon=True).start()
    print("ready", flush=True)
    while True:
        c, _ = t.accept(); c.sendall(b"tcp-backend"); c.close()
""")

CLIENT = textwrap.dedent("""
    import json, socket
    out = {}
    s = socket.create_connection(("10.96.77.1", 80), timeout=2)
    out["tcp_reply"] = s.recv(100).decode(); out["tcp_peer"] = list(s.getpeername()); s.close()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(2)
    u.sendto(b"q", ("10.96.77.1", 53))
    data, src = u.recvfrom(100); out["udp_reply"] = data.decode(); out["udp_source"] = list(src)
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(2); c.connect(("10.96.77.1", 53))
    c.send(b"c"); out["connected_udp_reply"] = c.recv(100).decode(); out["connected_udp_peer"] = list(c.getpeername())
    try:
        socket.create_connection(("10.96.77.2", 80), timeout=2); out["empty"] = "connected"
    except OSError as e:
        out["empty"] = type(e).__name__
    print(json.dumps(out))
""")


@dataclass
class World:
    netns: str
    cgroup: Path
    pins: Path
    dp: Dataplane

    def run_in(self, code: str) -> subprocess.Popen[str]:
        """`python -c code` in the test's namespace and cgroup (joined before exec, so from its first syscall)."""
        procs = self.cgroup / "cgroup.procs"

        def join() -> None:
            procs.write_text(str(os.getpid()))

        return subprocess.Popen(["ip", "netns", "exec", self.netns, sys.executable, "-c", code],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=join)


def _state(vip: str, port: int, proto: Protocol, backends: tuple[Backend, ...]) -> ServicePortState:
    return ServicePortState(service=f"default/{vip}", port_name=f"p{port}", frontend=Frontend(vip, port, proto),
                            backends=backends, known_backends=backends)


@pytest.fixture
def world(load: Load) -> Iterator[World]:
    tag = secrets.token_hex(3)
    # A cgroup and a pin directory of this test's own, on the hierarchies the labs mount outside /sys.
    cg, pins, ns = ensure_cgroup2() / f"sock-test-{tag}", ensure_bpffs() / f"sock-test-{tag}", f"pyp-sock-{tag}"
    cg.mkdir()
    pins.mkdir()
    # With the per-endpoint counters on: the hooks count a connection per endpoint as per frontend.
    dp = Dataplane(load(None, max_entries=CAPACITY, endpoint_counters=True), endpoint_counters=True)
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        yield World(ns, cg, pins, dp)
    finally:
        cgroup.detach(pins)
        dp.close()
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], check=False)
        pins.rmdir()
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def serve_and_ask(world: World, server_code: str, client_code: str) -> dict[str, object]:
    """Start the server, run the client in the test's namespace and cgroup, and return what the client printed."""
    server = world.run_in(server_code)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = world.run_in(client_code)
        out, err = client.communicate(timeout=20)
        assert client.returncode == 0, err
    finally:
        server.kill()
        server.wait()
    return dict(json.loads(out))


def test_a_node_process_reaches_frontends_through_the_socket_hooks(world: World) -> None:
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,)), _state(VIP, 53, Protocol.UDP, (UDP_BACKEND,)),
             _state(EMPTY_VIP, 80, Protocol.TCP, ()), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    assert sorted(p.name for p in (world.pins / cgroup.LINK_DIR).iterdir()) == sorted(
        f"cgroup_{prog}" for prog in abi.SOCK_HOOKS)
    got = serve_and_ask(world, SERVER, CLIENT)
    assert got["tcp_reply"] == "tcp-backend" and got["tcp_peer"] == [VIP, 80], "connect() and getpeername()"
    assert got["udp_reply"] == "udp:q" and got["udp_source"] == [VIP, 53], "sendto() and recvfrom()'s source"
    assert got["connected_udp_reply"] == "udp:c" and got["connected_udp_peer"] == [VIP, 53]
    assert got["empty"] == "ConnectionRefusedError", "a frontend without endpoints refuses at connect()"
    assert dp.counter("sock_lb") == 3 and dp.counter("sock_refused") == 1
    # A connect() or an unconnected send counts 1 packet and no bytes, for the endpoint as for the frontend.
    assert dp.endpoint_stats() == {TCP_BACKEND: (1, 0), UDP_BACKEND: (2, 0)}


def test_a_process_outside_the_cgroup_is_not_affected(world: World) -> None:
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,)), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    code = "import socket\ntry:\n    socket.create_connection(('10.96.77.1', 80), timeout=1)\nexcept OSError as e:\n" \
           "    print(type(e).__name__)"
    out = subprocess.run(["ip", "netns", "exec", world.netns, sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=20).stdout.strip()
    assert out in ("OSError", "TimeoutError"), out  # no route to the ClusterIP: nothing rewrote the connect
    assert dp.counter("sock_lb") == 0


def test_a_restart_replaces_the_hooks_in_place_and_detach_removes_them(world: World, load: Load) -> None:
    cgroup.attach(world.dp.obj.progs, world.cgroup, world.pins)
    first = {p.name: p.stat().st_ino for p in (world.pins / cgroup.LINK_DIR).iterdir()}
    second = Dataplane(load(None, max_entries=CAPACITY))
    try:
        cgroup.attach(second.obj.progs, world.cgroup, world.pins)  # the same links, their programs replaced
        assert {p.name: p.stat().st_ino for p in (world.pins / cgroup.LINK_DIR).iterdir()} == first
    finally:
        second.close()
    assert len(cgroup.detach(world.pins)) == len(abi.SOCK_HOOKS)
    assert not (world.pins / cgroup.LINK_DIR).exists()


def test_a_start_on_another_cgroup_moves_the_hooks(world: World) -> None:
    """A start makes the hooks what its settings say: on the new --cgroup-root, and on the old one no more."""
    other = world.cgroup.parent / f"{world.cgroup.name}-other"
    other.mkdir()
    try:
        cgroup.attach(world.dp.obj.progs, world.cgroup, world.pins)
        cgroup.attach(world.dp.obj.progs, other, world.pins)
        for pin in (world.pins / cgroup.LINK_DIR).iterdir():
            fd = libbpf.check(libbpf.lib().bpf_obj_get(str(pin).encode()), f"open {pin}")
            try:
                assert cgroup._link_info(fd).cgroup_id == cgroup.cgroup_id(other), pin.name
            finally:
                os.close(fd)
        cgroup.detach(world.pins)
    finally:
        other.rmdir()
