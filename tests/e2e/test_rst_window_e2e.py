"""Issue 25's RST defect end to end: a long-lived TCP connection through a NodePort (externalTrafficPolicy Cluster, so
SNATed to the node) survives a forged RST outside the client's sequence window, also once the closed timeout has
passed. Before the RST window (bpf/include/pyproxy/ct.h) the RST closed the flow; its entries expired in the closed
timeout, the client's next segment became a new flow with a new SNAT port, and the backend, which knew the old
port, reset the connection. In bpf mode (TC, and XDP on the client's device), with the closed timeout at 2 s."""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import pytest
from labkit.manifests import Port, endpoint_slice, service

from pyproxy.dataplane.bpf import abi, libbpf
from pyproxy.dataplane.bpf.maps import BpfMap, PerCpuArray

pytestmark = pytest.mark.root

B1, B2 = "10.201.1.2", "10.201.2.2"
NODE_IP, VIP = "10.200.0.1", "10.96.31.1"
HTTP = Port("http", 80, 8080, node_port=30081)
CLOSED_S = 2

# In the client's namespace: one connection to the NodePort, an exchange, its local port and the reply printed; then,
# at each line on stdin, another exchange on the same connection.
HOLDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
def exchange():
    try:
        s.send(b"probe\\n")
        return s.recv(1024).decode().strip()
    except OSError as e:
        return f"error: {e}"
print(s.getsockname()[1], exchange(), flush=True)
for _ in sys.stdin:
    print(exchange(), flush=True)
"""

# In the client's namespace: a RST from the client's address and port to the NodePort, at sequence argv[5], sent
# on a raw socket (the client's own TCP stack never sees it), as an attacker who knows the 4-tuple forges one.
FORGE = """
import socket, struct, sys
src, sport, dst, dport, seq = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def csum(b):
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF
tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x04, 0, 0, 0)
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(tcp))
tcp = tcp[:16] + struct.pack("!H", csum(pseudo + tcp)) + tcp[18:]
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
raw.sendto(tcp, (dst, 0))
"""


def _pinned(pins: Path, name: str) -> int:
    return libbpf.check(libbpf.lib().bpf_obj_get(str(pins / name).encode()), f"open {pins / name}")


def _client_entry(pins: Path, client: str, port: int) -> abi.CtValue:
    """The FORWARD entry of the client's connection to the NodePort, from the pinned flow map."""
    ct = BpfMap(_pinned(pins, abi.MAP_CT), abi.MAP_CT, abi.CtKey, abi.CtValue)
    try:
        return ct[abi.CtKey(abi.be32(client), abi.be32(NODE_IP), abi.be16(port), abi.be16(HTTP.node_port), 6,
                            abi.CT_FORWARD)]
    finally:
        ct.close()


def _rst_ignored(pins: Path) -> int:
    counters = PerCpuArray(_pinned(pins, abi.MAP_COUNTERS), abi.MAP_COUNTERS, ctypes.c_uint64)
    try:
        return sum(v.value for v in counters.get(abi.COUNTERS.index("ct_rst_ignored")))
    finally:
        counters.close()


@pytest.mark.parametrize("xdp", [False, True], ids=["tc", "xdp"])
def test_a_forged_out_of_window_reset_does_not_end_a_long_lived_snated_connection(make_env, xdp: bool) -> None:
    env = make_env(backends=2)
    env.write("np.yaml", service("long", VIP, [HTTP], type="NodePort"),
              endpoint_slice("long", {B1: True, B2: True}, [HTTP]))
    env.start(mode="bpf", args=[f"--bpf-ct-tcp-close-timeout={CLOSED_S}s"],
              xdp_devices=[env.lab.node_client_ifname] if xdp else None)
    pins = Path(env.lab.pin_path)
    holder = env.lab.popen(env.lab.client, sys.executable, "-c", HOLDER, NODE_IP, str(HTTP.node_port), stdin=-1,
                           stdout=-1, text=True)
    assert holder.stdout is not None and holder.stdin is not None
    port, first = holder.stdout.readline().split(maxsplit=1)
    first = first.strip()
    assert not first.startswith("error") and env.lab.client_ip not in first, f"not answered, or not SNATed: {first}"
    entry = _client_entry(pins, env.lab.client_ip, int(port))
    assert entry.state == abi.CT_ST_ESTABLISHED, entry.state

    forged = (entry.seq_end + (1 << 31)) & 0xFFFFFFFF
    env.lab.exec(env.lab.client, sys.executable, "-c", FORGE, env.lab.client_ip, port, NODE_IP,
                 str(HTTP.node_port), str(forged))
    deadline = time.monotonic() + 5
    while _rst_ignored(pins) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rst_ignored(pins) >= 1, "the forged RST never reached the programs"
    assert _client_entry(pins, env.lab.client_ip, int(port)).state == abi.CT_ST_ESTABLISHED, "the RST closed the flow"

    time.sleep(CLOSED_S + 1.5)  # past the closed timeout: a closed flow would be gone now
    holder.stdin.write("\n")
    holder.stdin.flush()
    after = holder.stdout.readline().strip()
    holder.stdin.close()
    holder.wait(timeout=10)
    assert after == first, f"the connection did not survive the forged RST: {after!r} (before: {first!r})"
    env.assert_no_checksum_errors()
    print(json.dumps({"port": port, "forged_seq": forged, "seq_end": entry.seq_end, "reply": after}))
