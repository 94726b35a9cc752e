"""The connection-tracking GC's pure parts, without a kernel: how its interval adapts, and which entries of a packed
CT map a pass picks (tests/priv/test_gc.py runs passes on a loaded map)."""

from __future__ import annotations

import socket
import struct

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pyproxy.dataplane.bpf import abi, gc
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.gc import CtGcMetrics, CtGcSettings, find_garbage, frontends_with_affinity, next_interval

HZ = 250
T = CtTimeouts().ticks(HZ)
NOW = 10**9
MARGIN = int(gc.MARGIN_SECONDS * HZ)
TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
CLIENT, VIP, BACKEND = "192.168.1.10", "10.96.0.10", "10.0.1.1"
S = CtGcSettings()  # 60 s to start, 10 s .. 300 s
CAP = 100_000


# -- the interval ---------------------------------------------------------------------------------------------


def after(interval: float, *, seen: int, deleted: int, previous_left: int = 0) -> float:
    return next_interval(interval, S, capacity=CAP, seen=seen, deleted=deleted, previous_left=previous_left)


def test_a_pass_that_deleted_a_quarter_of_the_capacity_or_more_shortens_the_interval_in_proportion() -> None:
    assert after(60, seen=60_000, deleted=25_000) == pytest.approx(45)  # 25 %: 0.75 x
    assert after(60, seen=60_000, deleted=50_000) == pytest.approx(30)  # 50 %: 0.5 x
    assert after(200, seen=95_000, deleted=90_000) == pytest.approx(20)  # 90 %: 0.1 x
    assert after(60, seen=100_000, deleted=99_000) == S.min_interval  # capped at 90 %, then held at the minimum


def test_a_filling_map_halves_the_interval() -> None:
    # Over half the capacity left, more than the previous pass left: expired entries will pile up faster.
    assert after(60, seen=62_000, deleted=1_000, previous_left=55_000) == 30
    assert after(15, seen=62_000, deleted=1_000, previous_left=55_000) == S.min_interval
    # Half full but not growing: an ordinary quiet pass (grows).
    assert after(60, seen=62_000, deleted=1_000, previous_left=61_000) == 90
    # Growing but under half full: not filling.
    assert after(60, seen=40_000, deleted=1_000, previous_left=10_000) == 90


def test_little_deleted_lengthens_the_interval_by_half_up_to_the_maximum() -> None:
    interval, steps = S.initial_interval, []
    for _ in range(6):
        interval = after(interval, seen=1_000, deleted=4_999)  # under 5 %
        steps.append(interval)
    assert steps == [90, 135, 202.5, 300, 300, 300]


def test_between_five_and_twenty_five_percent_the_interval_stays() -> None:
    assert after(60, seen=30_000, deleted=5_000) == 60
    assert after(60, seen=30_000, deleted=24_999) == 60


def test_an_empty_map_lengthens_and_a_zero_capacity_is_no_error() -> None:
    assert after(60, seen=0, deleted=0) == 90
    assert next_interval(60, S, capacity=0, seen=0, deleted=0, previous_left=0) == 90


@pytest.mark.parametrize(("lo", "start", "hi"), [(0, 60, 300), (20, 10, 300), (10, 60, 30), (-1, 60, 300)])
def test_intervals_out_of_order_are_refused(lo: float, start: float, hi: float) -> None:
    with pytest.raises(ValueError, match="intervals"):
        CtGcSettings(initial_interval=start, min_interval=lo, max_interval=hi)


# -- what a pass picks ----------------------------------------------------------------------------------------


def addr(ip: str) -> bytes:
    return socket.inet_aton(ip)


def port(n: int) -> bytes:
    return struct.pack("!H", n)


class Table:
    """A CT map's contents, packed as a batched lookup returns them."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.values: list[bytes] = []

    def add(self, key: tuple, value: tuple) -> int:
        self.keys.append(gc.CT_KEY.pack(*key))
        self.values.append(gc.CT_VALUE.pack(*value))
        return len(self.keys) - 1

    def flow(self, sport: int, proto: int, state: int, fwd_idle: int, rev_idle: int | None, *,
             frontend: str = VIP) -> tuple[int, int]:
        """A flow's FORWARD and REVERSE entries (None: no REVERSE entry), idle for that many ticks; their indexes."""
        fe, be, client = (addr(frontend), port(80)), (addr(BACKEND), port(8080)), (addr(CLIENT), port(sport))
        fwd = self.add((client[0], fe[0], client[1], fe[1], proto, abi.CT_FORWARD),
                       (*be, state, 0, 1, 1, NOW - fwd_idle))
        if rev_idle is None:
            return fwd, -1
        rev = self.add((be[0], client[0], be[1], client[1], proto, abi.CT_REVERSE),
                       (*fe, state, 0, 1, 1, NOW - rev_idle))
        return fwd, rev

    def affinity(self, vip: str, idle: int, proto: int = TCP) -> int:
        return self.add((addr(CLIENT), addr(vip), port(0), port(80), proto, abi.CT_AFFINITY),
                        (addr(BACKEND), port(8080), 0, 0, 1, 0, NOW - idle))

    def garbage(self, affinity: dict[gc.Frontend, int] | None = None, now: int = NOW) -> set[int]:
        return set(find_garbage(b"".join(self.keys), b"".join(self.values), affinity or {}, T, now, MARGIN))


@pytest.mark.parametrize(("proto", "state", "timeout"), [
    (TCP, abi.CT_ST_NEW, T.tcp_new), (TCP, abi.CT_ST_ESTABLISHED, T.tcp_established),
    (TCP, abi.CT_ST_CLOSING, T.tcp_closing), (TCP, abi.CT_ST_CLOSED, T.tcp_closed),
    (UDP, abi.CT_ST_NEW, T.udp_new), (UDP, abi.CT_ST_ESTABLISHED, T.udp_established),
])
def test_flows_go_only_once_idle_past_their_states_timeout_and_the_margin(proto: int, state: int, timeout: int) -> None:
    t = Table()
    past = t.flow(1000, proto, state, timeout + MARGIN + 1, timeout + MARGIN + 1)
    at_margin = t.flow(1001, proto, state, timeout + MARGIN, timeout + MARGIN)  # expired, within the margin
    fresh = t.flow(1002, proto, state, 0, 0)
    ahead = t.flow(1003, proto, state, -5, -5)  # stamped after this pass's clock reading
    assert t.garbage() == set(past)
    assert not t.garbage() & {*at_margin, *fresh, *ahead}


def test_a_flow_stays_while_either_of_its_entries_is_live() -> None:
    t = Table()
    old = T.tcp_established + MARGIN + 100
    one_way = t.flow(2000, UDP, abi.CT_ST_ESTABLISHED, 0, T.udp_established * 2)  # replies long silent
    other_way = t.flow(2001, TCP, abi.CT_ST_ESTABLISHED, old, 0)
    # The entry under the peer's key may belong to another flow: the same client port to the same backend
    # through another frontend took that reverse key over. It does not keep this flow's expired forward entry.
    stale_fwd, _ = t.flow(2002, TCP, abi.CT_ST_ESTABLISHED, old, None, frontend="10.96.0.99")
    t.flow(2002, TCP, abi.CT_ST_ESTABLISHED, 0, 0)
    assert t.garbage() == {stale_fwd}
    assert not t.garbage() & {*one_way, *other_way}


def test_affinity_entries_go_when_idle_past_their_services_timeout_or_their_frontend_has_no_affinity() -> None:
    services = Table()
    svc_keys = [gc.SVC_KEY.pack(addr(ip), port(80), TCP) for ip in ("10.96.0.10", "10.96.0.11")]
    svc_values = [gc.SVC_VALUE.pack(1, 1, abi.SVC_F_AFFINITY, 60 * HZ), gc.SVC_VALUE.pack(2, 1, 0, 60 * HZ)]
    affinity = frontends_with_affinity(b"".join(svc_keys), b"".join(svc_values))
    assert affinity == {(addr("10.96.0.10"), port(80), TCP): 60 * HZ}
    recent = services.affinity("10.96.0.10", 60 * HZ)
    idle = services.affinity("10.96.0.10", 60 * HZ + MARGIN + 1)
    no_affinity = services.affinity("10.96.0.11", 0)
    gone = services.affinity("10.96.0.12", 0)
    other_proto = services.affinity("10.96.0.10", 0, proto=UDP)  # the UDP frontend on that address is no Service
    assert services.garbage(affinity) == {idle, no_affinity, gone, other_proto}
    assert recent not in services.garbage(affinity)


def test_a_hairpin_choice_no_packet_took_goes_once_past_the_shortest_timeout() -> None:
    t = Table()

    def hairpin(idle: int) -> int:
        return t.add((addr(BACKEND), addr(VIP), port(0), port(80), TCP, abi.CT_HAIRPIN),
                     (addr(BACKEND), port(8080), 0, 0, 1, 0, NOW - idle))

    fresh, at_margin, stale = hairpin(0), hairpin(T.shortest + MARGIN), hairpin(T.shortest + MARGIN + 1)
    assert t.garbage() == {stale}
    assert not t.garbage() & {fresh, at_margin}


def test_entries_of_an_unknown_kind_are_left_alone() -> None:
    t = Table()
    t.add((addr(CLIENT), addr(VIP), port(1), port(80), TCP, 7), (addr(BACKEND), port(8080), 0, 0, 1, 1, 0))
    assert t.garbage() == set()


def test_the_packed_layouts_are_the_abi_structs() -> None:
    key = abi.CtKey(abi.be32(CLIENT), abi.be32(VIP), abi.be16(40000), abi.be16(80), TCP, abi.CT_REVERSE)
    assert gc.CT_KEY.pack(addr(CLIENT), addr(VIP), port(40000), port(80), TCP, abi.CT_REVERSE) == bytes(key)
    value = abi.CtValue(abi.be32(BACKEND), abi.be16(8080), abi.CT_ST_CLOSING, abi.CT_F_FIN_FWD, 7, 3, 2**40 + 5)
    packed = gc.CT_VALUE.pack(addr(BACKEND), port(8080), abi.CT_ST_CLOSING, abi.CT_F_FIN_FWD, 7, 3, 2**40 + 5)
    assert packed == bytes(value)
    assert gc._CT_AGE.unpack(packed) == (addr(BACKEND) + port(8080), abi.CT_ST_CLOSING, 2**40 + 5)
    svc = abi.SvcKey(abi.be32(VIP), abi.be16(80), TCP)
    assert gc.SVC_KEY.pack(addr(VIP), port(80), TCP) == bytes(svc)
    assert gc.SVC_VALUE.pack(4, 2, abi.SVC_F_AFFINITY, 900) == bytes(abi.SvcValue(4, 2, abi.SVC_F_AFFINITY, 900))
    # The recount's views: what it reads of a CT value, a backend key and the backend info it writes.
    assert gc._CT_OPEN.unpack(packed) == (addr(BACKEND) + port(8080), abi.CT_ST_CLOSING, abi.CT_F_FIN_FWD)
    backend = bytes(abi.Backend(abi.be32(BACKEND), abi.be16(8080)))
    assert gc._BACKEND_KEY.unpack(backend) == (addr(BACKEND) + port(8080),)
    assert gc._BACKEND_INFO.pack(0, -2) == bytes(abi.BackendInfo(0, -2))


def test_the_ipv6_layout_is_the_ipv6_abi_structs() -> None:
    client, vip, backend = "fd00::10", "fd00:96::a", "fd00:1::1"
    a6 = lambda ip: bytes(abi.in6(ip))  # noqa: E731
    v6 = gc.IPV6
    key = abi.Ct6Key(abi.in6(client), abi.in6(vip), abi.be16(40000), abi.be16(80), TCP, abi.CT_REVERSE)
    assert v6.ct_key.pack(a6(client), a6(vip), port(40000), port(80), TCP, abi.CT_REVERSE) == bytes(key)
    value = bytes(abi.Ct6Value(abi.in6(backend), abi.be16(8080), abi.CT_ST_CLOSING, abi.CT_F_FIN_FWD, 7, 3, 0,
                               2**40 + 5))
    assert v6.ct_age.unpack(value) == (a6(backend) + port(8080), abi.CT_ST_CLOSING, 2**40 + 5)
    assert v6.ct_open.unpack(value) == (a6(backend) + port(8080), abi.CT_ST_CLOSING, abi.CT_F_FIN_FWD)
    assert v6.backend_key.unpack(bytes(abi.Backend6(abi.in6(backend), abi.be16(8080)))) == (a6(backend) + port(8080),)
    assert v6.svc_key.pack(a6(vip), port(80), TCP) == bytes(abi.Svc6Key(abi.in6(vip), abi.be16(80), TCP))


def test_ipv6_entries_expire_by_the_same_rules() -> None:
    timeouts = abi.CtTimeoutTicks(tcp_new=10, tcp_established=100, tcp_closing=10, tcp_closed=5, udp_new=10,
                                  udp_established=20, shortest=5)
    a6 = lambda ip: bytes(abi.in6(ip))  # noqa: E731
    keys, values = [], []
    for i, last_seen in enumerate((1000, 100)):  # one fresh, one long idle: established TCP, 100 ticks
        keys.append(gc.IPV6.ct_key.pack(a6("fd00::10"), a6("fd00:96::a"), port(40000 + i), port(80), TCP,
                                        abi.CT_FORWARD))
        values.append(bytes(abi.Ct6Value(abi.in6("fd00:1::1"), abi.be16(8080), abi.CT_ST_ESTABLISHED, 0, 1, 0, 0,
                                         last_seen)))
    garbage = gc.find_garbage(b"".join(keys), b"".join(values), {}, timeouts, now=1050, margin=0, layout=gc.IPV6)
    assert list(garbage) == [1]


def test_the_metrics_show_in_the_registry_that_registers_them() -> None:
    metrics = CtGcMetrics()
    registry = CollectorRegistry()
    registry.register(metrics)
    metrics.entries.set(12)
    metrics.deleted.inc(5)
    metrics.duration.observe(0.02)
    assert registry.get_sample_value("pyproxy_bpf_ct_entries") == 12
    assert registry.get_sample_value("pyproxy_bpf_ct_gc_deleted_total") == 5
    assert registry.get_sample_value("pyproxy_bpf_ct_gc_duration_seconds_count") == 1
    assert b"pyproxy_bpf_ct_gc_duration_seconds_bucket" in generate_latest(registry)


def test_the_ipv6_collectors_metrics_sit_beside_the_ipv4_ones() -> None:
    registry = CollectorRegistry()
    v4, v6 = CtGcMetrics(), CtGcMetrics("ct6", "IPv6 ")
    registry.register(v4)
    registry.register(v6)
    v4.entries.set(3)
    v6.entries.set(7)
    assert registry.get_sample_value("pyproxy_bpf_ct_entries") == 3
    assert registry.get_sample_value("pyproxy_bpf_ct6_entries") == 7


def test_the_recount_adds_the_sockets_the_hooks_counted_by_family() -> None:
    """A node socket the hooks pointed at a backend of an lc, sed or nq frontend (SOCK_F_COUNTED) is one open
    connection to it until its close deletes the entry; uncounted entries (a connection to a random frontend, an
    unconnected socket's answer) are none. An IPv6 socket's IPv4-mapped backend counts for IPv4."""
    def sock(cookie: int, be: str, flags: int) -> tuple[bytes, bytes]:
        return (bytes(abi.SockKey(cookie, abi.be32(be), abi.be16(8080))),
                bytes(abi.SockValue(abi.be32(VIP), abi.be16(80), flags)))

    def sock6(cookie: int, be: str, flags: int) -> tuple[bytes, bytes]:
        return (bytes(abi.Sock6Key(cookie, abi.in6(be), abi.be16(8080))),
                bytes(abi.Sock6Value(abi.in6("fd00:96::a"), abi.be16(80), flags)))

    four = [sock(1, BACKEND, abi.SOCK_F_COUNTED), sock(2, BACKEND, abi.SOCK_F_COUNTED), sock(3, BACKEND, 0)]
    six = [sock6(4, "fd00:1::1", abi.SOCK_F_COUNTED), sock6(5, f"::ffff:{BACKEND}", abi.SOCK_F_COUNTED),
           sock6(6, "fd00:1::1", 0)]
    socks = (b"".join(k for k, _ in four), b"".join(v for _, v in four))
    socks6 = (b"".join(k for k, _ in six), b"".join(v for _, v in six))
    assert gc.count_sockets(socks, socks6) == {addr(BACKEND) + port(8080): 3}
    assert gc.count_sockets(socks, socks6, gc.IPV6) == {bytes(abi.in6("fd00:1::1")) + port(8080): 1}
