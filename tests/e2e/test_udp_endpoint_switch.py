"""Stale UDP flows (issue 11; upstream kubernetes issues 19029, 48370, 125467): a UDP client that keeps sending
from one fixed source port to a Service while the Service's only endpoint is replaced must get its answers from
the new endpoint within about a second, in every mode, although the old endpoint's server is still up and
answering (which is what makes a stale flow dangerous: nothing ever fails, the answers just come from a pod
that left the Service).

Without clearing, the kernel's conntrack entry (netfilter modes) or the BPF connection-tracking entry (bpf mode)
keeps DNATing that source port to the old endpoint for as long as the client keeps sending. The netfilter modes
delete the entries of endpoints that left (model/conntrack.py plans it, netfilter.clear_stale_udp runs
`conntrack -D`); bpf mode needs no deletion: a flow whose backend is gone from its frontend's backends is
re-balanced at its next packet (the epoch / backends-map check in bpf/include/pyproxy/lb.h).

Measured, and printed (run with -s to see it): from the manifest change to the first answer a brand-new flow gets
from b2 ("applied": the rules are in) and to the first answer the fixed-port flow gets from b2 ("switched").
ClusterIP and NodePort (clients outside the cluster: SNATed, cleared by port as upstream) are held side by side.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from pyproxy.lab.manifests import Port, endpoint_slice, service

MODES = [
    pytest.param("bpf", [], id="bpf"),
    pytest.param("nftables", [], id="nftables"),
    pytest.param("iptables", ["--iptables-backend=legacy"], id="iptables-legacy"),
    pytest.param("iptables", ["--iptables-backend=nft"], id="iptables-nft"),
]
B1, B2 = "10.201.1.2", "10.201.2.2"
NODE_IP, VIP = "10.200.0.1", "10.96.31.1"
DNS = Port("dns", 53, 5353, "UDP", node_port=30054)
TARGETS = {"cluster-ip": (VIP, 53, 40053), "node-port": (NODE_IP, 30054, 40054)}
SWITCH_LIMIT = 1.5
"""Seconds from the change being applied (a new flow reaches b2) to the fixed-port flow reaching b2."""

# Runs in the client's namespace. Every 50 ms, per target: one datagram from the FIXED source port (a connected
# socket, as a DNS stub resolver's), and one from a fresh socket (a new flow: shows when the rules changed).
# Every answer is printed as it comes, with the wall-clock time; it stops at EOF on stdin.
CLIENT = """
import json, select, socket, sys, time
targets = json.loads(sys.argv[1])
fixed = {}
for name, (ip, port, sport) in targets.items():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", sport))
    s.connect((ip, port))
    fixed[s] = name
fresh = {}
print(json.dumps({"ready": True}), flush=True)
while True:
    for s, name in fixed.items():
        s.send(b"probe\\n")
    for name, (ip, port, _) in targets.items():
        f = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        f.connect((ip, port))
        f.send(b"probe\\n")
        fresh[f] = (name, time.monotonic())
    end = time.monotonic() + 0.05
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin, *fixed, *fresh], [], [], left)
        if sys.stdin in ready:
            sys.exit(0)
        for s in ready:
            try:
                reply = s.recv(1024).decode().strip()
            except OSError:
                reply = None
            if s in fixed:
                kind, name = "fixed", fixed[s]
            else:
                kind, name = "fresh", fresh.pop(s)[0]
                s.close()
            if reply:
                print(json.dumps({"t": time.time(), "kind": kind, "target": name, "reply": reply}), flush=True)
    for f, (name, sent) in list(fresh.items()):
        if time.monotonic() - sent > 1.0:
            del fresh[f]
            f.close()
"""


def _slice(*ips: str) -> str:
    return endpoint_slice("dns", dict.fromkeys(ips, True), [DNS])


@pytest.mark.root
@pytest.mark.parametrize(("mode", "args"), MODES)
def test_a_udp_client_on_a_fixed_port_follows_a_replaced_endpoint(make_env, mode: str, args: list[str]) -> None:
    env = make_env(backends=2)
    svc = service("dns", VIP, [DNS], type="NodePort")
    env.write("dns.yaml", svc, _slice(B1))
    env.start(mode=mode, args=args)
    client = env.lab.popen(env.lab.client, sys.executable, "-c", CLIENT, json.dumps(TARGETS), stdin=-1, stdout=-1,
                           text=True)
    assert client.stdin is not None and client.stdout is not None
    try:
        assert json.loads(client.stdout.readline()) == {"ready": True}
        time.sleep(1.5)  # the fixed-port flows are established to b1 (checked below)
        changed = time.time()
        env.write("dns.yaml", svc, _slice(B2))
        time.sleep(4.0)
    finally:
        out, _ = client.communicate(timeout=10)  # closes stdin: the client stops
    answers = [json.loads(line) for line in out.splitlines() if line.strip()]

    def backend(a: dict[str, object]) -> str:
        return str(a["reply"]).split(":", 1)[0]

    timings = {}
    for target in TARGETS:
        mine = [a for a in answers if a["target"] == target]
        fixed_before = {backend(a) for a in mine if a["kind"] == "fixed" and a["t"] < changed}
        assert fixed_before == {"b1"}, f"{target}: before the change the fixed-port flow reached {fixed_before}"
        applied = next((a["t"] - changed for a in mine if a["kind"] == "fresh" and a["t"] > changed
                        and backend(a) == "b2"), None)
        switched = next((a["t"] - changed for a in mine if a["kind"] == "fixed" and a["t"] > changed
                         and backend(a) == "b2"), None)
        assert applied is not None, f"{target}: no new flow reached b2 within 4 s of the change"
        assert switched is not None, f"{target}: the fixed-port flow never reached b2 (stale flow kept)"
        late_b1 = [a["t"] - changed for a in mine if a["kind"] == "fixed" and a["t"] > changed + switched
                   and backend(a) == "b1"]
        assert not late_b1, f"{target}: the fixed-port flow went back to b1 after switching: {late_b1}"
        timings[target] = (applied, switched)
        assert switched - applied <= SWITCH_LIMIT, (
            f"{target}: the fixed-port flow reached b2 {switched - applied:.2f}s after new flows did")
    print(f"\n{mode} {' '.join(args)}: " + "; ".join(
        f"{t}: applied {a:.2f}s, fixed port switched {s:.2f}s after the change" for t, (a, s) in timings.items()))
