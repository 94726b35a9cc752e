"""A restart keeps established flows, external ones included (issue 10; kube-proxy leaves its rules in place and
so does pyproxy): connections and UDP sockets a client holds through a NodePort with externalTrafficPolicy Cluster
(SNATed to the node) and through a ClusterIP go on after pyproxy is stopped and started again, to the same backend,
which still sees the same source address and port. In bpf mode the flows and their SNAT pairs live in the pinned
connection-tracking map; in the netfilter modes, in the kernel's conntrack, which the first sync's clearing of
stale UDP entries must leave alone (upstream 122740: kube-proxy's restart flushed them; deleting every entry
to a frontend that "got its first endpoint", as upstream, fails this test in iptables mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from labkit.manifests import Port, endpoint_slice, service
from labkit.proxy import newer_release

from pyproxy.dataplane.bpf import abi, bcc, libbpf, loader

MODES = [
    pytest.param("bpf", False, [], id="bpf"),
    pytest.param("bpf", True, [], id="bpf-xdp"),
    pytest.param("nftables", False, [], id="nftables"),
    pytest.param("iptables", False, ["--iptables-backend=legacy"], id="iptables-legacy"),
    pytest.param("iptables", False, ["--iptables-backend=nft"], id="iptables-nft"),
]
B1, B2 = "10.201.1.2", "10.201.2.2"
NODE_IP, VIP = "10.200.0.1", "10.96.30.1"
HTTP, DNS = Port("http", 80, 8080, node_port=30080), Port("dns", 53, 5353, "UDP", node_port=30053)
TARGETS = [("tcp", NODE_IP, 30080), ("udp", NODE_IP, 30053), ("tcp", VIP, 80), ("udp", VIP, 53)]

# Runs in the client's namespace: opens every target once (a TCP connection, a connected UDP socket, which only
# accepts replies from the address it sent to), exchanges one request each, prints the replies, waits for a
# line on stdin, then exchanges again on the same sockets.
HOLDER = """
import json, socket, sys
socks = []
for proto, ip, port in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect((ip, port))
    socks.append(s)
def exchange():
    out = []
    for s in socks:
        try:
            s.send(b"probe\\n")
            out.append(s.recv(1024).decode().strip())
        except OSError as e:
            out.append(f"error: {e}")
    print(json.dumps(out), flush=True)
exchange()
sys.stdin.readline()
exchange()
"""


@pytest.mark.parametrize(("mode", "xdp", "args"), MODES)
def test_a_restart_keeps_held_flows_and_their_snat(make_env, mode: str, xdp: bool, args: list[str]) -> None:
    _held_flows_survive_a_restart(make_env, mode, xdp, args, args)


@pytest.mark.skipif(bcc.missing() is not None, reason=f"--bpf-loader=bcc: {bcc.missing()}")
@pytest.mark.parametrize(("first", "then"), [(["--bpf-loader=bcc"], []), ([], ["--bpf-loader=bcc"])],
                         ids=["bcc-to-libbpf", "libbpf-to-bcc"])
def test_a_switch_of_bpf_loader_keeps_held_flows(make_env, first: list[str], then: list[str]) -> None:
    """Both loaders make the same maps under the same pins: a restart with the other one is a restart."""
    _held_flows_survive_a_restart(make_env, "bpf", False, first, then)


def _held_flows_survive_a_restart(make_env, mode: str, xdp: bool, args: list[str], then: list[str], *,
                                  older: Callable[[Any], tuple[str, ...]] | None = None,
                                  restarted: Callable[[Any], None] | None = None) -> None:
    """`older(env)`: the wrapper of the release to start first (an upgrade); `restarted(env)`: checks once the
    second start is up, before the held flows exchange again."""
    env = make_env(backends=2)
    env.write("np.yaml", service("held", VIP, [HTTP, DNS], type="NodePort"),
              endpoint_slice("held", {B1: True, B2: True}, [HTTP, DNS]))
    start = {"mode": mode, "args": args, "xdp_devices": [env.lab.node_client_ifname] if xdp else None}
    env.start(**start, wrapper=older(env) if older else ())
    holder = env.lab.popen(env.lab.client, sys.executable, "-c", HOLDER, json.dumps(TARGETS), stdin=-1, stdout=-1,
                           text=True)
    assert holder.stdout is not None and holder.stdin is not None
    before = json.loads(holder.stdout.readline())
    assert not [r for r in before if r.startswith("error")], before
    seen_from = {r.split()[1].rsplit(":", 1)[0] for r in before[:2]}
    assert env.lab.client_ip not in seen_from, f"the NodePort flows were not SNATed: {before}"

    assert env.running.terminate() == 0
    env.start(**{**start, "args": then})
    if restarted:
        restarted(env)

    holder.stdin.write("\n")
    holder.stdin.flush()
    after = json.loads(holder.stdout.readline())
    holder.wait(timeout=10)
    assert after == before, "after the restart, each held flow must reach the same backend from the same source"
    env.assert_no_checksum_errors()


def _release_before(workdir: Path, change: str, path: str) -> tuple[str, ...]:
    """The release just before the commit that brought `change` into `path` (git's pickaxe), as an upgrade meets it:
    its package and programs (built here) in `workdir`, and the command prefix that runs them (see newer_release).
    Skips without the history (a shallow clone)."""
    git = ["git", "-C", str(REPO)]
    found = subprocess.run([*git, "log", "-1", "--format=%H", f"-S{change}", "--", path], capture_output=True,
                           text=True)
    if found.returncode != 0 or not found.stdout.strip():
        pytest.skip(f"no git history of {path} here (shallow clone?)")
    tree = workdir / "older-release"
    tree.mkdir()
    archive = subprocess.run([*git, "archive", f"{found.stdout.strip()}~1", "pyproxy", "bpf", "Makefile"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    subprocess.run(["make", "-s", "bpf/build/pyproxy.bpf.o"], cwd=tree, check=True, timeout=300)
    return ("env", "-C", str(tree), f"PYTHONPATH={tree}", f"PYPROXY_BPF_OBJECT={tree / 'bpf/build/pyproxy.bpf.o'}")


@pytest.mark.parametrize("xdp", [False, True], ids=["bpf", "bpf-xdp"])
def test_an_upgrade_across_the_ct_layout_change_keeps_held_flows(make_env, xdp: bool) -> None:
    """From the release whose flow map was pyproxy_ct_v2 (before the RST window) to this one, pyproxy_ct_v3: the
    held flows, their SNAT pairs included, are carried over into the new map (loader.carry_over), reach the same
    backend from the same source, and the old map's pin is gone."""

    def older(env: Any) -> tuple[str, ...]:
        return _release_before(env.lab.workdir, 'MAP_CT = "pyproxy_ct_v3"', "pyproxy/dataplane/bpf/abi.py")

    def restarted(env: Any) -> None:
        pins = Path(env.lab.pin_path)
        assert (pins / abi.MAP_CT).exists() and not (pins / "pyproxy_ct_v2").exists()
        log = env.running.log_text()
        assert "carried" in log and "pyproxy_ct_v2 over into pyproxy_ct_v3" in log and "cannot carry" not in log

    _held_flows_survive_a_restart(make_env, "bpf", xdp, [], [], older=older, restarted=restarted)


# ---------------------------------------------------------------------------------------------------------------
# Issue 12: restarts and an upgrade whose map layout changed, under load (bench/restarts.py measures it at 200 new
# connections/s over 10 restarts; this is its lighter check, counts only).

REPO = Path(__file__).resolve().parents[2]
BUMPED = "bench/build/pyproxy-frag-v9.bpf.o"
"""pyproxy's programs with the frags map renamed pyproxy_frag_v9 (the Makefile builds it), as a newer release."""


def _map_id(pin: Path) -> int:
    fd = libbpf.check(libbpf.lib().bpf_obj_get(str(pin).encode()), f"open {pin}")
    try:
        return int(loader.map_info(fd).id)
    finally:
        os.close(fd)


def test_restarts_and_a_map_layout_change_under_load_lose_no_connection(make_env) -> None:
    """New connections to a ClusterIP and a NodePort, one after the other, and 6 long-lived connections
    exchanging a line every 100 ms, while pyproxy is killed (SIGKILL), then stopped (SIGTERM) and started as a
    build whose frags map changed layout, then stopped and started as the current build again: no new
    connection fails, no long-lived one breaks, and the connection-tracking map is the same kernel map
    throughout while the frags map follows each build."""
    subprocess.run(["make", "-s", BUMPED], cwd=REPO, check=True, timeout=300)
    env = make_env(backends=2)
    env.write("np.yaml", service("held", VIP, [HTTP], type="NodePort"), endpoint_slice("held", {B1: True, B2: True},
                                                                                      [HTTP]))
    env.start()
    pins = Path(env.lab.pin_path)
    ct = _map_id(pins / abi.MAP_CT)
    events: list[str] = []
    with env.lab.under_traffic([(VIP, 80), (NODE_IP, 30080)], [(VIP, 80), (NODE_IP, 30080)]) as traffic:
        t0 = time.monotonic()

        def event(what: str) -> None:  # when, as talk's "s in" of a broken connection counts (about)
            events.append(f"{what} at {time.monotonic() - t0:.1f} s")

        time.sleep(1)
        env.running.kill()
        event("killed")
        env.start()
        event("started")
        time.sleep(1)
        assert env.running.terminate() == 0
        event("stopped")
        env.start(wrapper=newer_release(env.lab.workdir, REPO / BUMPED,
                                        {f'MAP_FRAGS = "{abi.MAP_FRAGS}"': 'MAP_FRAGS = "pyproxy_frag_v9"'}))
        event("started the newer layout")
        assert (pins / "pyproxy_frag_v9").exists() and not (pins / abi.MAP_FRAGS).exists()
        time.sleep(1)
        assert env.running.terminate() == 0
        event("stopped")
        env.start()
        event("started the current layout")
        assert (pins / abi.MAP_FRAGS).exists() and not (pins / "pyproxy_frag_v9").exists()
        time.sleep(1)
    held = traffic.held
    assert _map_id(pins / abi.MAP_CT) == ct, "the connection-tracking map was replaced"
    assert traffic.failures == {}, f"new connections failed: {traffic.failures}"
    assert traffic.count >= 40, traffic.probes
    assert held["broken"] == [] and held["exchanges"] > 0, (
        f"broken {held['broken']}; {'; '.join(events)}; {held['exchanges']} exchanges, longest gap "
        f"{held['max_gap_ms']} ms")
