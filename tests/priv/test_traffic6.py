"""The IPv6 datapath with real traffic: a client, a node and a backend in network namespaces of their own, the TC
programs on the node's two devices (the IPv4 entry points, which tail-call their IPv6 twins, as pyproxy attaches
them), the IPv6 maps written entry by entry. A TCP connection and a UDP exchange to the IPv6 ClusterIP reach the
backend and come back from the frontend; checksum offload is off on the client's and the backend's devices, both
ways, so each end's stack verifies every checksum the programs rewrote (README's pitfall: veth hands on
CHECKSUM_PARTIAL packets that receivers trust), and neither counts a checksum error."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import Load
from harness import CAPACITY, ROOT, Dataplane
from labkit.netns import NetnsThread
from test_packets6 import frontend6

from pyproxy.dataplane.bpf import abi, attach

pytestmark = ROOT

VIP6, PORT = "fd00:96::a", 80
CLIENT6, NODE_C, NODE_B, BACKEND6 = "fd00:c::10", "fd00:c::1", "fd00:1::fe", "fd00:1::1"

SERVER = textwrap.dedent("""
    import socket, threading
    t = socket.socket(socket.AF_INET6); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("::", 8080)); t.listen(16)
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.bind(("::", 8080))
    def udp():
        while True:
            data, peer = u.recvfrom(65535)
            u.sendto(b"udp:" + data, peer)
    threading.Thread(target=udp, daemon=True).start()
    print("ready", flush=True)
    while True:
        c, peer = t.accept()
        data = b""
        while len(data) < 100000:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
        c.sendall(f"{peer[0]} {len(data)} ".encode() + b"r" * 100000); c.close()
""")

CLIENT = textwrap.dedent("""
    import json, socket, time
    out = {}
    t0 = time.monotonic()
    s = socket.create_connection(("fd00:96::a", 80), timeout=5)
    out["connect_s"] = round(time.monotonic() - t0, 3)
    s.sendall(b"q" * 100000)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    seen_as, got, rest = data.split(b" ", 2)
    out["tcp"] = [seen_as.decode(), int(got), len(rest)]; out["tcp_peer"] = list(s.getpeername()[:2]); s.close()
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(5)
    u.sendto(b"d" * 1000, ("fd00:96::a", 80))
    data, src = u.recvfrom(65535); out["udp"] = [len(data), list(src[:2])]
    print(json.dumps(out))
""")


@dataclass
class Net:
    client: str
    node: str
    backend: str
    thread: NetnsThread

    def sh(self, ns: str, *argv: str) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True, text=True,
                              timeout=30).stdout


@pytest.fixture
def net() -> Iterator[Net]:
    tag = secrets.token_hex(3)
    c, n, b = f"p6c-{tag}", f"p6n-{tag}", f"p6b-{tag}"
    thread = None
    try:
        for ns in (c, n, b):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "link", "add", "c0", "netns", c, "type", "veth", "peer", "name", "nc", "netns", n],
                       check=True)
        subprocess.run(["ip", "link", "add", "b0", "netns", b, "type", "veth", "peer", "name", "nb", "netns", n],
                       check=True)
        for ns, dev, addr in ((c, "c0", CLIENT6), (n, "nc", NODE_C), (n, "nb", NODE_B), (b, "b0", BACKEND6)):
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{addr}/64", "dev", dev, "nodad"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        subprocess.run(["ip", "-n", c, "-6", "route", "add", "default", "via", NODE_C], check=True)
        subprocess.run(["ip", "-n", b, "-6", "route", "add", "default", "via", NODE_B], check=True)
        subprocess.run(["ip", "netns", "exec", n, "sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"], check=True)
        for ns, dev in ((c, "c0"), (b, "b0")):
            subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tx", "off", "rx", "off"], check=True,
                           capture_output=True)
        # The link-local addresses are still tentative (duplicate address detection, about a second): until they are
        # not, neighbour discovery loses the first packets forwarded (without any program too: a first SYN is
        # then retransmitted after 1 s).
        deadline = time.monotonic() + 10
        while any(subprocess.run(["ip", "-n", ns, "-6", "addr", "show", "tentative"], capture_output=True,
                                 text=True).stdout.strip() for ns in (c, n, b)) and time.monotonic() < deadline:
            time.sleep(0.1)
        thread = NetnsThread(n)
        yield Net(c, n, b, thread)
    finally:
        if thread is not None:
            thread.close()
        for ns in (c, n, b):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                subprocess.run(["kill", "-9", pid], check=False)
            subprocess.run(["ip", "netns", "del", ns], check=False)


def _csum_errors(net: Net, ns: str) -> dict[str, int]:
    counters = json.loads(net.sh(ns, "nstat", "-a", "-z", "--json"))
    flat = {k: v for table in counters.values() for k, v in table.items()}
    return {k: v for k, v in flat.items() if "CsumErrors" in k and v}


@pytest.mark.parametrize("xdp", [pytest.param(False, id="tc"), pytest.param(True, id="xdp")])
def test_tcp_and_udp_to_an_ipv6_clusterip_through_real_devices(load: Load, net: Net, xdp: bool) -> None:
    """`xdp`: the XDP program on the client's side of the node too (native, on the veth), translating the client's
    packets before TC (which then takes them as done)."""
    dp = Dataplane(load(None, max_entries=CAPACITY))
    try:
        frontend6(dp, 6, ((BACKEND6, 8080),))
        frontend6(dp, 17, ((BACKEND6, 8080),), svc_id=2)
        index = {dev: int(json.loads(net.sh(net.node, "ip", "-j", "link", "show", dev))[0]["ifindex"])
                 for dev in ("nc", "nb")}
        for dev in ("nc", "nb"):
            net.thread.call(attach.attach_tc, index[dev], attach.INGRESS, dp.obj.progs[abi.PROG_TC_INGRESS])
            net.thread.call(attach.attach_tc, index[dev], attach.EGRESS, dp.obj.progs[abi.PROG_TC_EGRESS])
        if xdp:
            net.thread.call(attach.attach_xdp, index["nc"], dp.obj.progs[abi.PROG_XDP], "native")
        server = subprocess.Popen(["ip", "netns", "exec", net.backend, sys.executable, "-c", SERVER],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            got = json.loads(net.sh(net.client, sys.executable, "-c", CLIENT))
        finally:
            server.kill()
            server.wait()
        # The backend saw the client's own address (no SNAT), got all 100,000 bytes; the client all of its answer,
        # from the frontend.
        assert got["connect_s"] < 0.5, "a lost SYN (retransmitted after 1 s)"
        assert got["tcp"] == [CLIENT6, 100000, 100000]
        assert got["tcp_peer"] == [VIP6, PORT]
        assert got["udp"] == [1004, [VIP6, PORT]]
        assert _csum_errors(net, net.client) == {} and _csum_errors(net, net.backend) == {}
        nonzero = {k: v for k, v in dp.counters().items() if v}
        assert nonzero["new_flow"] == 2 and nonzero["revnat"] > 0 and "ct_reopened" not in nonzero, nonzero
    finally:
        dp.close()
