"""Socket load balancing (bpf/include/pyproxy/sock.h): the cgroup hooks with real sockets.

Each test makes its own cgroup (under the machine's cgroup v2 hierarchy), network namespace and pin directory,
attaches the hooks to that cgroup only, and runs a client process inside both; a backend server listens in the
same namespace. That namespace is the node's own for the programs (loaded with its cookie as the host's), as
pyproxy's own namespace is on a node; `World.pod` adds namespaces of pods whose processes run in the same cgroup,
as every pod's do below a real node's root cgroup. Nothing outside the test's cgroup sees the hooks. All are
removed even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from conftest import Load
from harness import CAPACITY, ROOT, Dataplane
from labkit.netns import NetnsThread, ensure_bpffs, ensure_cgroup2

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi, cgroup, clock, gc, libbpf, loader
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.dataplane.bpf.settings import DESTROYER_OBJECT
from pyproxy.dataplane.bpf.sockdestroy import SocketDestroyer
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

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
    pods: list[str] = field(default_factory=list)

    def run_in(self, code: str, netns: str | None = None, args: tuple[str, ...] = (),
               stdin: bool = False) -> subprocess.Popen[str]:
        """`python -c code args...` in the test's namespace (or `netns`) and cgroup (joined before exec, so from its
        first syscall); `stdin`: a pipe to it."""
        procs = self.cgroup / "cgroup.procs"

        def join() -> None:
            procs.write_text(str(os.getpid()))

        return subprocess.Popen(["ip", "netns", "exec", netns or self.netns, sys.executable, "-c", code, *args],
                                stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=join)

    def pod(self) -> str:
        """A new network namespace, a pod's: its processes run in the cgroup by `run_in`. Its eth0 has POD_NET's n-th
        /24 (.2) and a default route to the node's end (.1): it reaches NODE_SERVER, an address of the node's."""
        n = len(self.pods) + 1
        ns, dev = f"{self.netns}-{self.cgroup.name[-6:]}-p{n}", f"p{self.cgroup.name[-6:]}{n}"
        _add_netns(ns)
        self.pods.append(ns)
        for argv in (["ip", "-n", self.netns, "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", ns],
                     ["ip", "-n", self.netns, "addr", "add", f"{POD_NET}.{n}.1/24", "dev", dev],
                     ["ip", "-n", self.netns, "link", "set", dev, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{POD_NET}.{n}.2/24", "dev", "eth0"],
                     ["ip", "-n", ns, "link", "set", "eth0", "up"],
                     ["ip", "-n", ns, "route", "add", "default", "via", f"{POD_NET}.{n}.1"]):
            subprocess.run(argv, check=True)
        return ns


POD_NET = "10.99"
NODE_SERVER = "10.98.0.1"
"""An address of the node's namespace (on its loopback) that every pod reaches through its veth."""


def _state(vip: str, port: int, proto: Protocol, backends: tuple[Backend, ...], **kwargs: Any) -> ServicePortState:
    return ServicePortState(service=f"default/{vip}", port_name=f"p{port}", frontend=Frontend(vip, port, proto),
                            backends=backends, known_backends=backends, **kwargs)


def _add_netns(ns: str) -> None:
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)


def _del_netns(ns: str) -> None:
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.fixture(scope="module")
def node_netns() -> Iterator[tuple[str, int]]:
    """The node's network namespace and its cookie, one for the module's tests (a load of BCC's is kept for one
    set of constants, the cookie among them: 15 s each)."""
    ns = f"pyp-sock-{secrets.token_hex(3)}"
    _add_netns(ns)
    subprocess.run(["ip", "-n", ns, "addr", "add", f"{NODE_SERVER}/32", "dev", "lo"], check=True)
    thread = NetnsThread(ns)
    try:
        yield ns, thread.call(loader.netns_cookie)
    finally:
        thread.close()
        _del_netns(ns)


@contextlib.contextmanager
def make_world(load: Load, node: tuple[str, int], **load_args: Any) -> Iterator[World]:
    """A World in the node's namespace `node`, its programs loaded with `load_args` (and the per-endpoint counters
    on: the hooks count a connection per endpoint as per frontend)."""
    tag = secrets.token_hex(3)
    # A cgroup and a pin directory of this test's own, on the hierarchies the labs mount outside /sys.
    cg, pins = ensure_cgroup2() / f"sock-test-{tag}", ensure_bpffs() / f"sock-test-{tag}"
    cg.mkdir()
    pins.mkdir()
    ns, host = node
    dp = Dataplane(load(None, max_entries=CAPACITY, endpoint_counters=True, host_netns=host, **load_args),
                   endpoint_counters=True)
    world = World(ns, cg, pins, dp)
    try:
        yield world
    finally:
        cgroup.detach(pins)
        dp.close()
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for pod in world.pods:
            _del_netns(pod)
        pins.rmdir()
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture
def world(load: Load, node_netns: tuple[str, int]) -> Iterator[World]:
    with make_world(load, node_netns) as w:
        yield w


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


CONNECT_VIP = textwrap.dedent("""
    import socket
    try:
        socket.create_connection(("10.96.77.1", 80), timeout=1)
    except OSError as e:
        print(type(e).__name__)
""")
"""What a connect() to VIP:80 fails with."""


def test_a_process_outside_the_cgroup_is_not_affected(world: World) -> None:
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,)), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    out = subprocess.run(["ip", "netns", "exec", world.netns, sys.executable, "-c", CONNECT_VIP], capture_output=True,
                         text=True, timeout=20).stdout.strip()
    assert out in UNTOUCHED, out  # no route to the ClusterIP: nothing rewrote the connect
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


# A pod's (or the node's) client of 6 TCP connections to VIP:80, whose 4 endpoints NODE_SERVER:15001-15004 answer
# with their port (SERVE_FOUR, in the node's namespace: TCP, and UDP for VIP:53's datagrams).
CLIENTS = 8
ENDPOINTS = tuple(Backend(NODE_SERVER, 15001 + i) for i in range(4))
SERVE_FOUR = textwrap.dedent("""
    import socket, sys, threading
    def serve(u, port):
        while True:
            data, peer = u.recvfrom(100); u.sendto(str(port).encode(), peer)
    def accept(t, port):
        while True:
            c, _ = t.accept(); c.sendall(str(port).encode()); c.close()
    for port in range(15001, 15005):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((sys.argv[1], port))   # replies from it
        threading.Thread(target=serve, args=(u, port), daemon=True).start()
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.bind((sys.argv[1], port)); t.listen(16)
        threading.Thread(target=accept, args=(t, port), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
""")
ASK_SIX = textwrap.dedent("""
    import json, socket
    got = []
    for _ in range(6):
        c = socket.create_connection(("10.96.77.1", 80), timeout=2); got.append(int(c.recv(100))); c.close()
    print(json.dumps(got))
""")


def ask_six(world: World, netns: str | None = None) -> list[int]:
    proc = world.run_in(ASK_SIX, netns)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return list(json.loads(out))


@contextlib.contextmanager
def serving_four(world: World) -> Iterator[None]:
    server = world.run_in(SERVE_FOUR, args=(NODE_SERVER,))
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("policy", [{"session_affinity_seconds": 10800}, {"scheduler": "sh"}],
                         ids=["affinity", "sh"])
def test_every_pod_is_a_client_of_its_own_and_the_node_is_one(world: World, policy: dict[str, Any]) -> None:
    """ClientIP affinity and sh key a pod's sockets by its network namespace: 8 pods spread over 4 endpoints,
    each keeping its own, as upstream's by pod address (before: every pod one client, all on one endpoint). The
    node's processes stay one client together."""
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, ENDPOINTS, **policy), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    with serving_four(world):
        pods = [ask_six(world, world.pod()) for _ in range(CLIENTS)]
        node = ask_six(world) + ask_six(world)
    assert all(len(set(got)) == 1 for got in pods), pods
    assert len({got[0] for got in pods}) > 1, pods   # affinity: random first choices; sh: hashes of 8 keys
    assert len(set(node)) == 1, node
    assert dp.counter("sock_lb") == 6 * (CLIENTS + 2)


SEND_UNCONNECTED = textwrap.dedent("""
    import json, socket, sys
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    def round():
        got = []
        for u in socks:
            u.settimeout(2)
            ports, sources = [], set()
            for _ in range(30):
                u.sendto(b"q", ("10.96.77.1", 53))
                data, src = u.recvfrom(100); ports.append(int(data)); sources.add(src)
            got.append({"ports": ports, "sources": sorted(sources)})
        return got
    print(json.dumps(round()), flush=True)
    sys.stdin.readline()
    print(json.dumps(round()), flush=True)
""")
"""Two unconnected UDP sockets, 30 sendto()s each to VIP:53 (the endpoint's port in each answer, and the answers'
sources), a line of JSON; once told (a line on stdin), the same again."""


def test_an_unconnected_udp_socket_keeps_one_endpoint_until_it_leaves(world: World) -> None:
    """A node process's unconnected UDP socket's datagrams to a frontend go to one endpoint, as conntrack keeps one
    flow per 5-tuple on the packet path (before: a new choice per datagram, all 4 endpoints in 30); when that
    endpoint leaves the Service, the socket's next datagrams go to another one, and stay there. (A pod's UDP is the
    packet path's: ServicePortState.pods_at_socket.)"""
    dp = world.dp
    dp.apply(_state(VIP, 53, Protocol.UDP, ENDPOINTS), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    with serving_four(world):
        proc = world.run_in(SEND_UNCONNECTED, stdin=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            first = json.loads(proc.stdout.readline() or "null")
            assert first is not None, proc.stderr.read() if proc.stderr else ""
            chosen = {sock["ports"][0] for sock in first}
            dp.apply(_state(VIP, 53, Protocol.UDP, tuple(e for e in ENDPOINTS if e.port not in chosen)),
                     service="default/web")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            second = json.loads(proc.stdout.readline() or "null")
            assert second is not None, proc.stderr.read() if proc.stderr else ""
        finally:
            proc.kill()
            proc.wait()
    for sock in first + second:
        assert len(set(sock["ports"])) == 1, f"a socket's datagrams spread: {first} then {second}"
        assert sock["sources"] == [[VIP, 53]], sock["sources"]
    assert not chosen & {sock["ports"][0] for sock in second}, f"stayed on a removed endpoint: {first} {second}"
    assert dp.counter("sock_lb") == 4 * 30


def test_a_pod_is_left_to_tc_where_the_frontend_says_the_socket_would_differ(world: World) -> None:
    """A frontend without SVC_F_SOCK_PODS (--masquerade-all here: TC would SNAT the pod's flow): a pod's connect()
    goes on to the Service address untouched (toward the node, which has no route for it), the node's is
    translated."""
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,)), service="default/web",
             masq=MasqueradeSettings(masquerade_all=True))
    assert not dp.maps.services[abi.SvcKey(abi.be32(VIP), abi.be16(80), 6)].flags & abi.SVC_F_SOCK_PODS
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    assert connect_vip(world, world.pod()) in UNTOUCHED and dp.counter("sock_lb") == 0
    assert connect_vip(world) == "ConnectionRefusedError" and dp.counter("sock_lb") == 1   # 127.0.0.1:18080


LOCALHOST_CLIENT = CLIENT.replace('("10.96.77.1", 80)', '("127.0.0.1", 30080)').replace(
    '("10.96.77.1", 53)', '("127.0.0.1", 30053)')
"""CLIENT, asking the NodePorts on 127.0.0.1 instead of the ClusterIP (and the empty ClusterIP still)."""

POD_OWN_LOOPBACK = textwrap.dedent("""
    import socket
    t = socket.socket(); t.bind(("127.0.0.1", 30080)); t.listen(1)
    c = socket.create_connection(("127.0.0.1", 30080), timeout=2)
    a, _ = t.accept(); a.sendall(b"pod-own"); print(c.recv(100).decode())
""")


def test_a_node_process_reaches_a_nodeport_on_127_0_0_1_and_a_pod_its_own_loopback(world: World) -> None:
    """localhostNodePorts: the node's connect() and sendto() to 127.0.0.1:<nodePort> reach the Service (its HOST
    entry) and still see 127.0.0.1 as their peer; a pod's 127.0.0.1 is its own, where its own server answers."""
    dp = world.dp
    node_port = {"kind": FrontendKind.NODE_PORT}
    dp.apply(_state("127.0.0.1", 30080, Protocol.TCP, (TCP_BACKEND,), external_backends=(TCP_BACKEND,), **node_port),
             _state("127.0.0.1", 30053, Protocol.UDP, (UDP_BACKEND,), external_backends=(UDP_BACKEND,), **node_port),
             _state(EMPTY_VIP, 80, Protocol.TCP, ()), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    got = serve_and_ask(world, SERVER, LOCALHOST_CLIENT)
    assert got == {"tcp_reply": "tcp-backend", "tcp_peer": ["127.0.0.1", 30080], "udp_reply": "udp:q",
                   "udp_source": ["127.0.0.1", 30053], "connected_udp_reply": "udp:c",
                   "connected_udp_peer": ["127.0.0.1", 30053], "empty": "ConnectionRefusedError"}
    assert dp.counter("sock_lb") == 3
    proc = world.run_in(POD_OWN_LOOPBACK, world.pod())
    out, err = proc.communicate(timeout=20)
    assert (proc.returncode, out.strip()) == (0, "pod-own"), err
    assert dp.counter("sock_lb") == 3


HOLD = textwrap.dedent("""
    import socket, sys
    socks = [socket.create_connection(("10.96.77.1", 80), timeout=2) for _ in range(int(sys.argv[1]))]
    print("held", flush=True)
    sys.stdin.readline()
    for s in socks:
        s.close()
    print("closed", flush=True)
    sys.stdin.readline()
""")


def test_lc_counts_a_node_sockets_connection_until_it_closes_and_its_entry_goes_with_it(world: World) -> None:
    """A connect() the hooks balance to an lc frontend's backend counts one open connection there (what lc, sed and
    nq compare) while the socket lives; its close (cgroup/sock_release) takes the count back and deletes the socket's
    PYPROXY_MAP_SOCKS entry, so the map does not grow with every connection ever made. The collector's recount
    keeps what the sockets hold."""
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,), scheduler="lc"), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    backend = abi.Backend(abi.be32(TCP_BACKEND.ip), abi.be16(TCP_BACKEND.port))
    server = world.run_in(SERVER)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    holder = world.run_in(HOLD, args=("3",), stdin=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held", holder.stderr.read() if holder.stderr else ""
        assert dp.maps.backends[backend].active == 3 and len(dp.maps.socks) == 3
        assert all(v.flags & abi.SOCK_F_COUNTED for v in dp.maps.socks.values())
        hz = clock.kernel_hz()
        collector = gc.CtGarbageCollector(
            BpfMap(os.dup(dp.obj.maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue),
            BpfMap(os.dup(dp.obj.maps[abi.MAP_SERVICES]), abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue),
            capacity=dp.capacity[abi.MAP_CT], timeouts=CtTimeouts().ticks(hz), hz=hz,
            backends=BpfMap(os.dup(dp.obj.maps[abi.MAP_BACKENDS]), abi.MAP_BACKENDS, abi.Backend, abi.BackendInfo),
            socks=(BpfMap(os.dup(dp.obj.maps[abi.MAP_SOCKS]), abi.MAP_SOCKS, abi.SockKey, abi.SockValue),
                   BpfMap(os.dup(dp.obj.maps[abi.MAP_SOCKS6]), abi.MAP_SOCKS6, abi.Sock6Key, abi.Sock6Value)))
        try:
            collector.run_pass()
        finally:
            collector.close()
        assert dp.maps.backends[backend].active == 3, "the recount lost the sockets' connections"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "closed"
        assert dp.maps.backends[backend].active == 0 and len(dp.maps.socks) == 0
    finally:
        for proc in (holder, server):
            proc.kill()
            proc.wait()


UNTOUCHED = ("OSError", "TimeoutError")
"""What a connect() to VIP:80 that no hook translated gets: no route for it, or no answer at the node."""


STORM = textwrap.dedent("""
    import socket, sys
    held = socket.create_connection(("10.96.77.1", 80), timeout=2)
    for _ in range(int(sys.argv[1])):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.sendto(b"q", ("10.96.77.1", 53))
        u.close()
    print(held.getpeername()[0])
""")
"""A connected TCP socket to VIP:80 held while fresh unconnected UDP sockets each send one datagram to VIP:53 (a
resolver without a socket of its own per query), then the TCP socket's peer name."""


def test_a_storm_of_unconnected_udp_sockets_evicts_no_connected_sockets_peer(world: World) -> None:
    """Every unconnected UDP socket's datagram leaves an entry for its answers that nothing deletes (its close names
    no peer) but the LRU. Kept in a map of its own, four times as many of them as the socket map holds leave a
    connected socket's entry alone: its getpeername() still shows the Service, not the backend it was pointed at."""
    dp = world.dp
    dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,)), service="default/web")
    dp.apply(_state(VIP, 53, Protocol.UDP, (UDP_BACKEND,)), service="default/dns")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    storm = 4 * dp.capacity[abi.MAP_SOCKS]
    server = world.run_in(SERVER)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = world.run_in(STORM, args=(str(storm),))
        out, err = client.communicate(timeout=120)
    finally:
        server.kill()
        server.wait()
    assert client.returncode == 0, err
    assert out.strip() == VIP, f"after {storm} unconnected sockets' datagrams the held socket's peer is {out.strip()}"
    assert dp.counter("sock_lb") == storm + 1
    assert len(dp.maps.sockanswers) > dp.capacity[abi.MAP_SOCKANS] // 2, "the storm did not fill the answers' LRU"


CONNECTED_PAIR = textwrap.dedent("""
    import errno, socket, sys
    socks = []
    for port in (53, 54):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("10.96.77.1", port))
        s.setblocking(False)
        socks.append(s)
    print(" ".join(f"{s.getpeername()[0]}:{s.getpeername()[1]}" for s in socks), flush=True)
    sys.stdin.readline()
    out = []
    for s in socks:
        try:
            s.recv(100)
            out.append("data")
        except BlockingIOError:
            out.append("open")
        except OSError as e:
            out.append(errno.errorcode[e.errno])
    print(" ".join(out), flush=True)
""")
"""Two connected UDP sockets of a node process, to VIP:53 and VIP:54; once told, what each reads: "open" (nothing to
read, still connected) or the error its owner gets."""


def test_the_iterator_destroys_the_connected_udp_sockets_whose_endpoint_left(world: World, bpf_object: Path) -> None:
    """bpf/sockdestroy.bpf.c on the datapath's maps (whichever loader made them), run in the node's namespace after
    one Service's only endpoint left: the socket pointed at it fails with ECONNABORTED (its owner opens another,
    balanced afresh), the other Service's socket stays connected, and a second pass destroys nothing more."""
    dp = world.dp
    gone, kept = Backend("127.0.0.1", 15353), Backend("127.0.0.1", 15354)
    dp.apply(_state(VIP, 53, Protocol.UDP, (gone,)), service="default/dns")
    dp.apply(_state(VIP, 54, Protocol.UDP, (kept,)), service="default/other")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    path = bpf_object.with_name(DESTROYER_OBJECT)
    if tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (6, 5):
        # The 6.1 guest: no bpf_sock_destroy. The load fails cleanly, which the dataplane logs and carries on from.
        with pytest.raises(loader.BpfUnavailable, match="refused to load"):
            SocketDestroyer.load(path, dp.obj.maps)
        return
    destroyer = SocketDestroyer.load(path, dp.obj.maps)
    thread = NetnsThread(world.netns)
    client = world.run_in(CONNECTED_PAIR, stdin=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().split() == [f"{VIP}:53", f"{VIP}:54"], "getpeername() before"
        assert thread.call(destroyer.run) == 0, "destroyed a socket whose endpoint is still there"
        dp.apply(_state(VIP, 53, Protocol.UDP, (Backend("127.0.0.1", 15355),)), service="default/dns")
        assert thread.call(destroyer.run) == 1
        assert thread.call(destroyer.run) == 0
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().split() == ["ECONNABORTED", "open"]
    finally:
        client.kill()
        client.wait()
        thread.close()
        destroyer.close()


def connect_vip(world: World, netns: str | None = None) -> str:
    proc = world.run_in(CONNECT_VIP, netns)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    return out.strip()


def test_hostns_only_leaves_every_pod_to_tc(load: Load, node_netns: tuple[str, int]) -> None:
    """--bpf-socket-lb-hostns-only: a pod's connect() keeps the Service address (for TC), the node's is translated."""
    with make_world(load, node_netns, socket_lb_hostns_only=True) as world:
        dp = world.dp
        dp.apply(_state(VIP, 80, Protocol.TCP, (TCP_BACKEND,)), service="default/web")
        cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
        assert connect_vip(world, world.pod()) in UNTOUCHED and dp.counter("sock_lb") == 0
        assert connect_vip(world) == "ConnectionRefusedError" and dp.counter("sock_lb") == 1


HAIRPIN = textwrap.dedent("""
    import json, socket
    t = socket.socket(); t.bind(("0.0.0.0", 8080)); t.listen(4)
    c = socket.socket(); c.settimeout(1)
    try:
        c.connect(("10.96.77.1", 80)); print(json.dumps(["connected", c.getsockname()[0]]))
    except OSError as e:
        print(json.dumps([type(e).__name__, c.getsockname()[0]]))
""")


def test_a_pods_connection_to_itself_is_left_to_tc(world: World) -> None:
    """Hairpin: the pod's chosen endpoint is the pod itself (the frontend's only one). TC masquerades such a flow; at
    the socket the pod would reach itself from its own address: its connect() goes on untouched (toward the node,
    which has no route for the ClusterIP here), bound to its own address. Another pod's is translated."""
    dp = world.dp
    pod, other = world.pod(), world.pod()
    dp.apply(_state(VIP, 80, Protocol.TCP, (Backend(f"{POD_NET}.1.2", 8080),)), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    proc = world.run_in(HAIRPIN, pod)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert json.loads(out) in ([e, f"{POD_NET}.1.2"] for e in UNTOUCHED), out
    assert dp.counter("sock_lb") == 0
    # (Translated toward the first pod, which no longer listens, through a node that does not forward here.)
    proc = world.run_in(HAIRPIN, other)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert dp.counter("sock_lb") == 1, out


def test_the_node_is_denied_a_load_balancer_ip_whose_source_ranges_leave_it_out(world: World) -> None:
    """A load-balancer frontend whose source ranges leave out the node's primary address (node_denied): the node's
    connect() fails at once with ETIMEDOUT, as its dropped SYN would end; a pod's goes on untouched, for TC, which
    checks the pod's address against the ranges."""
    dp = world.dp
    lb = _state(VIP, 80, Protocol.TCP, (TCP_BACKEND,), kind=FrontendKind.LOAD_BALANCER,
                external_backends=(TCP_BACKEND,), source_ranges=("198.51.100.0/24",), node_denied=True)
    dp.apply(lb, service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    assert connect_vip(world) == "TimeoutError"
    assert dp.counter("source_denied") == 1 and dp.counter("sock_lb") == 0   # refused by the hook, not waited out
    assert connect_vip(world, world.pod()) in UNTOUCHED and dp.counter("sock_lb") == 0
    dp.apply(replace(lb, node_denied=False), service="default/web")
    assert connect_vip(world) == "ConnectionRefusedError" and dp.counter("sock_lb") == 1   # 127.0.0.1:18080
