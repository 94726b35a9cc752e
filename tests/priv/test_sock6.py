"""Socket load balancing of IPv6 frontends (bpf/include/pyproxy/sock.h, the connect6/sendmsg6/recvmsg6/getpeername6
hooks) with real sockets, in test_sock.py's world: a cgroup, a network namespace and a pin directory of the test's
own. The IPv6 maps are written entry by entry (render does not write them yet)."""

from __future__ import annotations

import ctypes
import textwrap

import test_sock
from conftest import Load
from harness import ROOT, Dataplane
from test_sock import World, make_world, node_netns, world  # noqa: F401 (the fixtures)

from pyproxy.dataplane.bpf import abi, cgroup
from pyproxy.model.objects import Protocol

pytestmark = ROOT

VIP6, EMPTY_VIP6 = "fd00:96::77", "fd00:96::78"
TCP_BACKEND, UDP_BACKEND = ("::1", 18080), ("::1", 15353)

# test_sock.py's server, on IPv6 loopback.
SERVER = test_sock.SERVER.replace("socket.socket()", "socket.socket(socket.AF_INET6)").replace(
    "socket.AF_INET,", "socket.AF_INET6,").replace('"127.0.0.1"', '"::1"')

CLIENT = textwrap.dedent("""
    import json, socket
    out = {}
    s = socket.create_connection(("fd00:96::77", 80), timeout=2)
    out["tcp_reply"] = s.recv(100).decode(); out["tcp_peer"] = list(s.getpeername()[:2]); s.close()
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(2)
    u.sendto(b"q", ("fd00:96::77", 53))
    data, src = u.recvfrom(100); out["udp_reply"] = data.decode(); out["udp_source"] = list(src[:2])
    try:
        socket.create_connection(("fd00:96::78", 80), timeout=2); out["empty"] = "connected"
    except OSError as e:
        out["empty"] = type(e).__name__
    print(json.dumps(out))
""")


def frontend6(dp: Dataplane, vip: str, port: int, proto: int, backends: tuple[tuple[str, int], ...],
              svc_id: int, flags: int = 0) -> None:
    dp.maps.services6[abi.Svc6Key(abi.in6(vip), abi.be16(port), proto, abi.SVC_SCOPE_PACKETS)] = abi.SvcValue(
        svc_id=svc_id, backend_count=len(backends), flags=flags)
    for i, (ip, p) in enumerate(backends):
        dp.maps.slots6[abi.SlotKey(svc_id, i)] = abi.Slot6(abi.in6(ip), abi.be16(p), 0)
        dp.maps.backends6[abi.Backend6(abi.in6(ip), abi.be16(p))] = abi.BackendInfo(0, 0)


def test_a_node_process_reaches_ipv6_frontends_through_the_socket_hooks(world: World) -> None:  # noqa: F811
    dp = world.dp
    frontend6(dp, VIP6, 80, 6, (TCP_BACKEND,), 1)
    frontend6(dp, VIP6, 53, 17, (UDP_BACKEND,), 2)
    frontend6(dp, EMPTY_VIP6, 80, 6, (), 3)
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    got = test_sock.serve_and_ask(world, SERVER, CLIENT)
    assert got["tcp_reply"] == "tcp-backend" and got["tcp_peer"] == [VIP6, 80], "connect() and getpeername()"
    assert got["udp_reply"] == "udp:q" and got["udp_source"] == [VIP6, 53], "sendto() and recvfrom()'s source"
    assert got["empty"] == "ConnectionRefusedError", "a frontend without endpoints refuses at connect()"
    assert dp.counter("sock_lb") == 2 and dp.counter("sock_refused") == 1
    # The TCP socket's entry went with its close (cgroup/sock_release); the unconnected UDP socket's is in the
    # answers' LRU of its own (its close cannot name the backends it sent to), where it can evict no connected one.
    assert len(dp.maps.socks6) == 0 and ctypes.sizeof(abi.Sock6Key) == 32
    [(key, value)] = dp.maps.sockanswers6.items()
    assert (key.port, value.flags) == (abi.be16(UDP_BACKEND[1]), 0)


MAPPED_CLIENT = textwrap.dedent("""
    import json, socket
    out = {}
    s = socket.socket(socket.AF_INET6); s.settimeout(2); s.connect(("::ffff:10.96.77.1", 80))
    out["tcp_reply"] = s.recv(100).decode(); out["tcp_peer"] = list(s.getpeername()[:2]); s.close()
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(2)
    u.sendto(b"q", ("::ffff:10.96.77.1", 53))
    data, src = u.recvfrom(100); out["udp_reply"] = data.decode(); out["udp_source"] = list(src[:2])
    print(json.dumps(out))
""")


def test_an_ipv6_socket_reaches_an_ipv4_frontend_by_its_mapped_address(world: World) -> None:  # noqa: F811
    """A dual-stack socket (AF_INET6) connecting to ::ffff:<ClusterIP>: the IPv4 frontends decide, and the socket
    sees the frontend's mapped address as its peer and as its datagrams' source."""
    dp = world.dp
    dp.apply(test_sock._state(test_sock.VIP, 80, Protocol.TCP, (test_sock.TCP_BACKEND,)),
             test_sock._state(test_sock.VIP, 53, Protocol.UDP, (test_sock.UDP_BACKEND,)), service="default/web")
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    got = test_sock.serve_and_ask(world, test_sock.SERVER, MAPPED_CLIENT)
    mapped = f"::ffff:{test_sock.VIP}"
    assert got["tcp_reply"] == "tcp-backend" and got["tcp_peer"] == [mapped, 80]
    assert got["udp_reply"] == "udp:q" and got["udp_source"] == [mapped, 53]
    assert dp.counter("sock_lb") == 2


SEND6 = textwrap.dedent("""
    import socket
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        u.sendto(b"q", ("fd00:96::77", 53)); print("sent")
    except OSError as e:
        print(type(e).__name__)
""")


def send6(w: World, netns: str | None = None) -> str:
    proc = w.run_in(SEND6, netns)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    return out.strip()


def test_a_pods_ipv6_send_is_translated_where_the_frontend_allows_it_and_not_with_hostns_only(
        load: Load, node_netns: tuple[str, int]) -> None:  # noqa: F811
    """The IPv6 twin of test_sock's pod paths: a pod's sendto() to an IPv6 frontend is translated at its socket with
    SVC_F_SOCK_PODS (to ::1 of its own namespace), left alone without it (no route: ENETUNREACH) and with
    --bpf-socket-lb-hostns-only; the node's is translated every time."""
    for hostns_only in (False, True):
        with make_world(load, node_netns, socket_lb_hostns_only=hostns_only) as w:
            dp = w.dp
            frontend6(dp, VIP6, 53, 17, (UDP_BACKEND,), 1, flags=abi.SVC_F_SOCK_PODS)
            cgroup.attach(dp.obj.progs, w.cgroup, w.pins)
            pod = w.pod()
            assert send6(w, pod) == ("OSError" if hostns_only else "sent")
            assert dp.counter("sock_lb") == (0 if hostns_only else 1), hostns_only
            frontend6(dp, VIP6, 53, 17, (UDP_BACKEND,), 1)
            assert send6(w, pod) == "OSError"
            assert dp.counter("sock_lb") == (0 if hostns_only else 1), "no SVC_F_SOCK_PODS: left alone"
            assert send6(w) == "sent" and dp.counter("sock_lb") == (1 if hostns_only else 2), "the node's"


SERVE_FOUR6 = test_sock.SERVE_FOUR.replace("socket.AF_INET,", "socket.AF_INET6,").replace("sys.argv[1]", '"::1"')
SEND_THIRTY6 = textwrap.dedent("""
    import json, socket
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(2)
    ports = []
    for _ in range(30):
        u.sendto(b"q", ("fd00:96::77", 53)); ports.append(int(u.recvfrom(100)[0]))
    print(json.dumps({"ports": ports}))
""")


def test_an_unconnected_ipv6_udp_socket_keeps_one_endpoint(world: World) -> None:  # noqa: F811
    """test_sock's unconnected UDP flow on an IPv6 frontend: 30 sendto()s of one socket, one endpoint of 4."""
    dp = world.dp
    frontend6(dp, VIP6, 53, 17, tuple(("::1", 15001 + i) for i in range(4)), 1)
    cgroup.attach(dp.obj.progs, world.cgroup, world.pins)
    ports = test_sock.serve_and_ask(world, SERVE_FOUR6, SEND_THIRTY6)["ports"]
    assert isinstance(ports, list) and len(ports) == 30, ports
    assert len(set(ports)) == 1, f"one socket's datagrams spread: {ports}"
    assert len(dp.maps.sockflows6) == 1
