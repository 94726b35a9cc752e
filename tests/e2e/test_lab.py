"""The namespace lab on its own, without pyproxy: plain routed traffic, the checksum counters the BPF tests rely
on, the distro-like node, and that nothing (namespaces, processes, pins) is left behind, even after a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from labkit import Lab, describe, nonzero_checksum_errors, reap_stale_labs
from labkit.netns import MARKER_DIR, list_namespaces, parse_proc_net_counters, python_env
from labkit.traffic import parse_reply


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(namespaces: list[str]) -> list[int]:
    out = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
           for ns in namespaces]
    return [int(p) for text in out for p in text.split()]


def _wait(check: Callable[[], bool], deadline: float = 5.0) -> bool:
    end = time.monotonic() + deadline
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _assert_gone(lab_id: str, namespaces: list[str], pids: list[int]) -> None:
    assert not set(namespaces) & set(list_namespaces()), f"namespaces left: {list_namespaces()}"
    assert _wait(lambda: not any(_alive(p) for p in pids)), f"processes left: {[p for p in pids if _alive(p)]}"
    assert not (MARKER_DIR / f"{lab_id}.json").exists()


# ------------------------------------------------------------------------------------------------ no root


def test_parse_proc_net_counters() -> None:
    text = textwrap.dedent("""\
        Ip: Forwarding DefaultTTL InReceives
        Ip: 1 64 1234
        Tcp: RtoAlgorithm InCsumErrors
        Tcp: 1 7
        Udp: InDatagrams InCsumErrors
        Udp: 10 3
        IpExt: InNoRoutes InCsumErrors
        IpExt: 0 2
        """)
    counters = parse_proc_net_counters(text)
    assert counters["TcpInCsumErrors"] == 7
    assert counters["UdpInCsumErrors"] == 3
    assert counters["IpExtInCsumErrors"] == 2
    assert counters["IpInReceives"] == 1234


def test_parse_reply() -> None:
    assert parse_reply(b"b1:8080 10.200.0.2:40000\n") == ("b1:8080", "10.200.0.2")
    assert parse_reply(b"") is None
    assert parse_reply(b"HTTP/1.1 400 Bad Request\r\n") is None


# ------------------------------------------------------------------------------------------------ root


@pytest.mark.root
def test_routed_traffic_reaches_every_backend_and_nothing_is_left_behind() -> None:
    with Lab(3) as lab:
        namespaces = lab.namespaces
        assert len(set(namespaces)) == 5 and all(ns.startswith(lab.id + "-") for ns in namespaces)
        assert all(len(ifname) <= 15 for ifname in lab.node_ifnames)
        lab.start_servers(tcp=[8080, 9090], udp=[5353])
        for b in lab.backends:
            for proto, port in (("tcp", 8080), ("tcp", 9090), ("udp", 5353)):
                result = lab.probe(proto, b.ip, port, 5)
                assert result["replies"] == {f"{b.name}:{port}": 5}, describe(result)
                assert result["seen_from"] == {lab.client_ip: 5}

        # A backend added after start gets a link, a route and the same servers.
        b4 = lab.add_backend()
        assert (b4.name, b4.ip, b4.node_ifname) == ("b4", "10.201.4.2", "to-b4")
        assert lab.probe("udp", b4.ip, 5353, 3)["replies"] == {"b4:5353": 3}

        # Full checksums on the wire (pitfall 3) on client and backend ends; still nothing counted as bad.
        for ns in (lab.client, b4.ns):
            features = lab.exec(ns, "ethtool", "-k", "eth0").stdout
            assert "tx-checksumming: off" in features
        assert not nonzero_checksum_errors(lab.checksum_errors())
        pids = _pids(lab.namespaces)
        assert pids, "servers should be running in the backends"
        namespaces, workdir, pins = lab.namespaces, lab.workdir, Path(lab.pin_path)
    assert lab.teardown_errors == []
    _assert_gone(lab.id, namespaces, pids)
    assert not workdir.exists() and not pins.exists()


@pytest.mark.root
def test_failures_are_counted_quickly_not_waited_out() -> None:
    with Lab(1) as lab:
        lab.start_servers(tcp=[8080], udp=[5353])
        b1 = lab.backends[0]
        refused = lab.probe("tcp", b1.ip, 8081, 5, timeout=1.0)
        assert refused["failures"] == 5 and refused["errors"] == {"refused": 5}
        udp_refused = lab.probe("udp", b1.ip, 5354, 5, timeout=1.0)
        assert udp_refused["failures"] == 5 and udp_refused["errors"] == {"refused": 5}
        # No route on the node for a ClusterIP without a proxy: every request fails, within the bound.
        start = time.monotonic()
        nowhere = lab.probe("tcp", "10.96.0.10", 80, 4, timeout=0.5, deadline=1.2)
        assert nowhere["failures"] == 4 and not nowhere["replies"]
        assert time.monotonic() - start < 10


@pytest.mark.root
def test_more_client_addresses_fixed_source_ports_and_held_connections() -> None:
    with Lab(1, client_addresses=2) as lab:
        assert lab.client_ips == ["10.200.0.2", "10.200.0.3", "10.200.0.4"]
        lab.start_servers(tcp=[8080], udp=[5353])
        b1 = lab.backends[0]
        # The same source port again at once, for each address: a TCP flow from a fixed port ends with a reset,
        # so no TIME_WAIT stands in the next one's way.
        result = lab.probe("tcp", b1.ip, 8080, 12, sources=lab.client_ips, source_ports=[40001, 40002])
        assert result["failures"] == 0, describe(result)
        assert result["seen_from"] == dict.fromkeys(lab.client_ips, 4)
        assert result["by_source"] == {f"{ip}:{port}": {"b1:8080": 2} for ip in lab.client_ips
                                       for port in (40001, 40002)}
        udp = lab.probe("udp", b1.ip, 5353, 3, sources=lab.client_ips[1:2])
        assert udp["by_source"] == {"10.200.0.3": {"b1:5353": 3}}, describe(udp)
        assert lab.probe("tcp", b1.ip, 8080, 1)["by_source"] == {}
        holder = lab.popen(lab.client, sys.executable, "-m", "labkit.traffic", "hold", b1.ip, "8080",
                           "--count", "2", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdin is not None and holder.stdout is not None
        assert json.loads(holder.stdout.readline()) == ["b1:8080", "b1:8080"]
        holder.stdin.write("keep b1:8080\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == ["b1:8080", "b1:8080"]  # asked again: still open
        holder.stdin.close()
        assert holder.wait(timeout=10) == 0


@pytest.mark.root
def test_csum_offload_option_leaves_offload_on() -> None:
    with Lab(1, csum_offload=True) as lab:
        assert "tx-checksumming: on" in lab.exec(lab.client, "ethtool", "-k", "eth0").stdout


_BAD_CHECKSUM_SENDER = textwrap.dedent("""
    import socket, struct, sys
    src, dst, proto = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def csum(data):
        data += b"\\0" * (len(data) % 2)
        s = sum(struct.unpack(f"!{len(data) // 2}H", data))
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        return ~s & 0xFFFF

    if proto == 17:
        l4 = struct.pack("!HHHH", 40000, 5353, 9, 0) + b"x"
        at = 6
    else:
        l4 = struct.pack("!HHIIBBHHH", 40000, 8080, 1, 0, 5 << 4, 0x02, 65535, 0, 0)
        at = 16
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, proto, len(l4))
    bad = csum(pseudo + l4) ^ 0x00FF  # the right checksum, deliberately broken
    l4 = l4[:at] + struct.pack("!H", bad) + l4[at + 2:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.sendto(ip + l4, (dst, 0))
    """)


@pytest.mark.root
@pytest.mark.parametrize(("proto", "counter"), [(17, "UdpInCsumErrors"), (6, "TcpInCsumErrors")])
def test_a_wrong_checksum_is_counted_by_the_receiver(proto: int, counter: str) -> None:
    # The zero-checksum-error assertions of the BPF tests mean something only if a bad checksum arriving at a
    # backend through the node is really counted there.
    with Lab(1) as lab:
        lab.start_servers(tcp=[8080], udp=[5353])
        b1 = lab.backends[0]
        before = lab.checksum_errors()["b1"][counter]
        lab.python(lab.client, "-c", _BAD_CHECKSUM_SENDER, lab.client_ip, b1.ip, str(proto))
        assert _wait(lambda: lab.checksum_errors()["b1"][counter] > before, 3.0), lab.checksum_errors()


@pytest.mark.root
@pytest.mark.parametrize("rp_filter", [1, 2])
def test_distro_node(rp_filter: int) -> None:
    with Lab(2, distro=True, rp_filter=rp_filter) as lab:
        assert lab.uplink is not None and "to-uplink" in lab.node_ifnames
        for iface in ("all", "default", "to-client", "to-b1", "to-b2", "to-uplink"):
            value = lab.exec(lab.node, "sysctl", "-n", f"net.ipv4.conf.{iface}.rp_filter").stdout.strip()
            assert value == str(rp_filter), f"{iface}: rp_filter={value}"
        assert "via 10.199.0.2 dev to-uplink" in lab.exec(lab.node, "ip", "route", "show", "default").stdout
        rules = lab.exec(lab.node, "iptables", "-w", "5", "-S", "FORWARD").stdout
        assert "-A FORWARD -m conntrack --ctstate INVALID -j DROP" in rules
        # Plain routing passes strict rp_filter and the INVALID rule.
        lab.start_servers(tcp=[8080], udp=[5353])
        b3 = lab.add_backend()
        value = lab.exec(lab.node, "sysctl", "-n", "net.ipv4.conf.to-b3.rp_filter").stdout.strip()
        assert value == str(rp_filter)
        for b in lab.backends:
            assert lab.probe("tcp", b.ip, 8080, 5)["replies"] == {f"{b.name}:8080": 5}
            assert lab.probe("udp", b.ip, 5353, 5)["replies"] == {f"{b.name}:5353": 5}
        assert b3.name == "b3"
        assert not nonzero_checksum_errors(lab.checksum_errors())


@pytest.mark.root
def test_two_node_lab_pods_behind_node2_and_no_way_back_to_the_client() -> None:
    """What the two-node acceptance relies on: node 1 and its pods reach node 2's pods (and are reached back),
    the client outside the cluster does not (node2 has no route to it: only SNAT to a node address can make
    a remote endpoint answer it), and a second client on its own subnet is routed like the first."""
    with Lab(1, remote_backends=2, second_client=True, distro=True) as lab:
        assert lab.uplink is None and lab.node2 is not None and lab.client2 is not None
        assert [(r.name, r.ip) for r in lab.remote_backends] == [("r1", "10.202.1.2"), ("r2", "10.202.2.2")]
        assert {"to-client2", "to-node2"} <= set(lab.node_ifnames) and "to-uplink" not in lab.node_ifnames
        routes = lab.exec(lab.node2, "ip", "-4", "route").stdout
        assert "default" not in routes and "10.200." not in routes, routes
        lab.start_servers(tcp=[8080], udp=[5353])
        for r in lab.remote_backends:
            for src in ("node", "b1"):
                result = lab.probe("tcp", r.ip, 8080, 3, ns=src)
                assert result["replies"] == {f"{r.name}:8080": 3}, describe(result)
            # The node's own traffic leaves from its node-network address, which node2 reaches.
            assert lab.probe("udp", r.ip, 5353, 3, ns="node")["seen_from"] == {"10.197.0.1": 3}
            lost = lab.probe("tcp", r.ip, 8080, 2, timeout=0.5)
            assert not lost["replies"] and set(lost["errors"]) == {"timeout"}, describe(lost)
        assert lab.probe("tcp", "10.201.1.2", 8080, 3, ns="client2")["seen_from"] == {"10.200.1.2": 3}
        assert not nonzero_checksum_errors(lab.checksum_errors())
        assert {"client2", "node2", "r1", "r2"} <= set(lab.checksum_errors())
        namespaces, pids = lab.namespaces, _pids(lab.namespaces)
        assert len(namespaces) == 7 and pids
    _assert_gone(lab.id, namespaces, pids)


def _link_of(lab: Lab, dev: str) -> dict:
    return json.loads(lab.exec(lab.node, "ip", "-j", "-d", "addr", "show", "dev", dev).stdout)[0]


def _global(link: dict) -> list[str]:
    return [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("scope") != "link"]


@pytest.mark.root
@pytest.mark.parametrize("stack", ["bridge", "macvlan",
                                   *(pytest.param(s, marks=pytest.mark.stack_driver(s)) for s in ("vlan", "bond"))])
def test_a_stacked_client_link_holds_the_node_address_above_the_veth(stack: str) -> None:
    """client_stack: the node's client-facing address on a bridge whose port is the client's veth, on a macvlan or
    a VLAN over it, or on a bond whose slave it is (the veth holding none), both named in node_ifnames; with a VLAN
    the client's address is on a VLAN of its own too. The client reaches the backends through it as through a plain
    link, and a pod address arriving at the client is counted. (VLAN and bond where the kernel has their drivers:
    the qemu guest, tests/e2e/test_stacked_devices_guest.py.)"""
    with Lab(1, client_stack=stack, ipv6=True) as lab:
        upper, lower = lab.node_client_ifname, lab.node_client_lower_ifname
        uppers = {"bridge": "br0", "macvlan": "mv0", "vlan": "to-client.100", "bond": "bond0"}
        assert (upper, lower) == (uppers[stack], "to-client")
        assert {upper, lower} <= set(lab.node_ifnames)
        up, low = _link_of(lab, upper), _link_of(lab, lower)
        assert _global(up) == ["10.200.0.1/24", "fd00:10:200::1/64"] and _global(low) == [], (up, low)
        if stack in ("bridge", "bond"):
            assert up["linkinfo"]["info_kind"] == stack and low.get("master") == upper, (up, low)
        else:
            assert up["linkinfo"]["info_kind"] == stack and up["link"] == lower, up
        if stack == "macvlan":
            assert up["linkinfo"]["info_data"]["mode"] == "bridge", up
        if stack == "bond":
            assert up["linkinfo"]["info_data"]["mode"] == "active-backup", up
        if stack == "vlan":
            assert up["linkinfo"]["info_data"]["id"] == 100, up
            client = {link["ifname"]: link for link in
                      json.loads(lab.exec(lab.client, "ip", "-j", "-d", "addr", "show").stdout)}
            tagged = client[lab.client_ifname]
            assert lab.client_ifname == "eth0.100" and tagged["linkinfo"]["info_kind"] == "vlan", tagged
            assert _global(tagged) == ["10.200.0.2/24", "fd00:10:200::2/64"] and _global(client["eth0"]) == [], client
        lab.start_servers(tcp=[8080], udp=[5353])
        lab.count_arrivals(lab.client, ["10.201.0.0/16"])
        for proto, port in (("tcp", 8080), ("udp", 5353)):
            assert lab.probe(proto, "10.201.1.2", port, 3)["replies"] == {f"b1:{port}": 3}
        assert lab.arrivals(lab.client) >= 6  # TCP: SYN-ACK and more per connection; UDP: one reply each
        lab.count_arrivals(lab.client, ["10.201.0.0/16"])  # again: from zero
        assert lab.arrivals(lab.client) == 0

        # The client's frames for the node's address go to the upper device's MAC (a macvlan's lower device answers
        # ARP only for its own addresses); send_to_lower_device sends them to the veth's, and the node still answers.
        def mac(dev: str) -> str:
            return lab.exec(lab.node, "cat", f"/sys/class/net/{dev}/address").stdout.strip()

        def neighbour() -> str:
            return lab.exec(lab.client, "ip", "neigh", "show", "10.200.0.1").stdout
        if stack == "macvlan":
            assert lab.exec(lab.node, "sysctl", "-n", f"net.ipv4.conf.{lower}.arp_ignore").stdout.strip() == "1"
            assert mac(upper) in neighbour(), (neighbour(), mac(upper))
        lab.send_to_lower_device()
        assert mac(lower) in neighbour() and "PERMANENT" in neighbour(), neighbour()
        assert lab.probe("tcp", "10.201.1.2", 8080, 3)["replies"] == {"b1:8080": 3}
        assert not nonzero_checksum_errors(lab.checksum_errors())


@pytest.mark.root
def test_pod_bridge_puts_the_backends_on_one_bridge_that_holds_their_gateway() -> None:
    """pod_bridge: every backend's veth is a port of cni0, which holds 10.201.0.1/16 (and fd00:10:201::1/48); the
    backends keep their 10.201.I.2, in that one subnet, and reach each other bridged, with their own address."""
    with Lab(2, pod_bridge=True, ipv6=True) as lab:
        assert _global(_link_of(lab, "cni0")) == ["10.201.0.1/16", "fd00:10:201::1/48"]
        assert [(b.ip, b.node_ip, b.node_ifname) for b in lab.backends] == [
            ("10.201.1.2", "10.201.0.1", "to-b1"), ("10.201.2.2", "10.201.0.1", "to-b2")]
        b3 = lab.add_backend()
        for b in lab.backends:
            port = _link_of(lab, b.node_ifname)
            assert port.get("master") == "cni0" and _global(port) == [], port
        assert lab.node_ifnames == ["to-client", "cni0", "to-b1", "to-b2", "to-b3"]
        peer = json.loads(lab.exec(b3.ns, "ip", "-j", "addr", "show", "dev", "eth0").stdout)[0]
        assert _global(peer) == ["10.201.3.2/16", "fd00:10:201:3::2/48"], peer
        lab.start_servers(tcp=[8080], udp=[5353])
        for proto, port in (("tcp", 8080), ("udp", 5353)):
            assert lab.probe(proto, b3.ip, port, 3)["replies"] == {f"b3:{port}": 3}
            result = lab.probe(proto, b3.ip, port, 3, ns="b1")
            assert result["replies"] == {f"b3:{port}": 3} and result["seen_from"] == {"10.201.1.2": 3}, result
        assert not nonzero_checksum_errors(lab.checksum_errors())


@pytest.mark.root
def test_http_helper_waits_for_a_server() -> None:
    with Lab(0) as lab:
        url = "http://127.0.0.1:18080/"
        assert lab.http_get(lab.node, url, timeout=0.5)["status"] is None
        lab.popen(lab.node, sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "18080",
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = lab.http_get(lab.node, url, wait=10, expect=200)
        assert result["status"] == 200, result
        assert lab.http_get(lab.node, url + "missing")["status"] == 404


@pytest.mark.root
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_teardown_on_exception(exc: type[BaseException]) -> None:
    lab = Lab(2)
    with pytest.raises(exc), lab:
        lab.start_servers(tcp=[8080])
        namespaces, pids = lab.namespaces, _pids(lab.namespaces)
        raise exc("boom")
    _assert_gone(lab.id, namespaces, pids)


@pytest.mark.root
def test_a_killed_owner_leaves_nothing_running_and_its_namespaces_are_reaped() -> None:
    # A test run SIGKILLed mid-way: its servers die with it (parent-death signal, stdin EOF), and the next
    # Lab (or reap_stale_labs) removes its namespaces, never those of a live owner.
    script = textwrap.dedent("""
        import json, time
        from labkit import Lab
        lab = Lab(2).start()
        lab.start_servers(tcp=[8080], udp=[5353])
        print(json.dumps({"id": lab.id, "namespaces": lab.namespaces}), flush=True)
        time.sleep(60)
        """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=python_env())
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        pids = _pids(info["namespaces"])
        assert len(pids) == 2
        with Lab(0) as live:
            assert info["id"] not in reap_stale_labs(), "an owner that is alive must not be reaped"
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=10)
            assert _wait(lambda: not any(_alive(p) for p in pids)), "servers outlived their owner"
            # Reaped here, or already by a Lab another run started meanwhile (every Lab start reaps).
            reaped = reap_stale_labs()
            assert info["id"] in reaped or not set(info["namespaces"]) & set(list_namespaces())
            assert live.node in list_namespaces(), "a live lab was reaped"
        _assert_gone(info["id"], info["namespaces"], pids)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)


@pytest.mark.root
def test_a_failing_teardown_step_does_not_stop_the_rest() -> None:
    with Lab(2) as lab, Lab(1) as other:
        assert lab.id != other.id and not set(lab.namespaces) & set(other.namespaces)
        lab.start_servers(tcp=[8080])
        namespaces, pids = lab.namespaces, _pids(lab.namespaces)
        # Someone removed a backend namespace under the lab's feet: its deletion fails, the rest still goes.
        subprocess.run(["ip", "netns", "del", lab.backends[0].ns], check=True, timeout=10)
    assert len(lab.teardown_errors) == 1 and lab.backends[0].ns in lab.teardown_errors[0]
    _assert_gone(lab.id, namespaces, pids)
    assert other.teardown_errors == []
