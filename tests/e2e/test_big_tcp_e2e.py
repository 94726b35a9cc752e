"""BIG TCP through a ClusterIP in bpf mode: a client whose device sends IPv4 GSO packets over 64 KB (kernels since
6.3: `gso_ipv4_max_size`), whose total length field reads 0, must be translated like any other packet.

veth hands a sender's GSO packets to the peer whole, so the node's TC ingress sees them as the client's stack made
them, as it sees GRO's aggregates on a NIC with `gro_ipv4_max_size` raised. Before, the parser took a total length of
0 for a malformed header and passed the packet untranslated, toward the ClusterIP itself: the bulk transfer stalled.
"""

from __future__ import annotations

import pytest
from labkit.manifests import Port, endpoint_slice, service

pytestmark = pytest.mark.root

VIP = "10.96.44.1"
BIG = 185_000
# Debian 12's iproute2 knows no gso_ipv4_max_size (IFLA_GSO_IPV4_MAX_SIZE, 63, since 6.3), nor pyroute2 0.9: an
# RTM_NEWLINK of our own sets it with gso_max_size (41).
SET_GSO = """
import socket, struct, sys
idx = socket.if_nametoindex(sys.argv[1])
size = int(sys.argv[2])
attrs = b"".join(struct.pack("=HHI", 8, t, size) for t in (41, 63))
body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, idx, 0, 0) + attrs
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
s.send(struct.pack("=IHHII", 16 + len(body), 16, 0x1 | 0x4, 1, 0) + body)
err = struct.unpack_from("=i", s.recv(4096), 16)[0]
sys.exit(f"RTM_NEWLINK: {err}" if err else 0)
"""
SEND = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 80), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
start = time.monotonic()
s.sendall(b"x" * 16_000_000)
s.shutdown(socket.SHUT_WR)
got = 0
while chunk := s.recv(65536):
    got += len(chunk)
print(f"{time.monotonic() - start:.3f} {got}")
"""


@pytest.mark.parametrize("mode", ["bpf", "nftables"])
def test_a_bulk_transfer_of_big_tcp_packets_crosses_a_clusterip(make_env, mode: str) -> None:
    env = make_env(1)
    lab = env.lab
    b1 = lab.backends[0].ip
    port = Port("http", 80, 8080)
    env.write("svc.yaml", service("bulk", VIP, [port]), endpoint_slice("bulk", {b1: True}, [port]))
    env.start(mode=mode)
    lab.python(lab.client, "-c", SET_GSO, "eth0", str(BIG))
    lab.exec(lab.client, "ethtool", "-K", "eth0", "tso", "on", "tx", "on", "sg", "on")
    before = lab.net_counters(lab.client).get("TcpRetransSegs", 0)
    out = lab.python(lab.client, "-c", SEND, VIP, timeout=60).stdout.split()
    seconds, got = float(out[0]), int(out[1])
    retransmitted = lab.net_counters(lab.client).get("TcpRetransSegs", 0) - before
    # Untranslated, each big packet went to the ClusterIP and was lost: the transfer crawled on retransmissions
    # (8.3 s and hundreds of retransmitted segments before the fix, 0.3 s and none after, as nftables mode).
    assert got > 0 and retransmitted < 10, f"16 MB in {seconds:.1f} s, {retransmitted} segments retransmitted"
