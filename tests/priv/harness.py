"""The BPF object driven packet by packet with BPF_PROG_TEST_RUN: a fresh load programmed the way pyproxy does
(render() -> Maps.run_batches), and the checks a receiver makes. Shared by test_packets.py and test_ct.py."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from packets import TCP, TCP_ACK, TCP_SYN, UDP, Flow, L4Csum, decode, frame

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi
from pyproxy.dataplane.bpf.mapset import Maps
from pyproxy.dataplane.bpf.render import (
    DEFAULT_SCHEDULING,
    NO_MASQUERADE,
    Applied,
    Plan,
    Scheduling,
    frontend_key,
    render,
)
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

ROOT = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="BPF_PROG_TEST_RUN and map creation need root"),
]

TC_ACT_OK, TC_ACT_SHOT = 0, 2
XDP_TRANSLATED_MARK = (0x70797031).to_bytes(4, "little")  # nat.h PYPROXY_XDP_TRANSLATED, as the host stores it
XDP_DROP, XDP_PASS = 1, 2

SERVICE = "default/web"
VIP = "10.96.0.10"
PORT = 80
CLIENT = "192.168.1.10"
READY = (Backend("10.0.1.1", 8080), Backend("10.0.1.2", 8080), Backend("10.0.1.3", PORT))  # .3: port kept
NOT_READY = Backend("10.0.1.9", 8080)
PROTOS = {TCP: Protocol.TCP, UDP: Protocol.UDP}
# Small maps: a fresh load per test stays cheap, and the loader's resize path is exercised.
# Every map small, the IPv6 twins too: preallocated maps (the LRU ones: connection tracking, the socket maps; the
# hashes) take their whole size at each load (bpftool memlock at the defaults: ct6 38 MB, the socket maps 29 MB,
# affinity 34 MB each family, slots6 34 MB), and the fixtures keep a load per set of load settings, which the
# 6.1 guest's 2 GB did not hold (its pytest was killed, 137).
CAPACITY = {abi.MAP_SERVICES: 64, abi.MAP_SLOTS: 256, abi.MAP_BACKENDS: 256, abi.MAP_CT: 8192,
            abi.MAP_STATS: 64, abi.MAP_NAMES: 64, abi.MAP_CURSORS: 64, abi.MAP_TABLES: 32768,
            abi.MAP_CT6: 8192, abi.MAP_SOCKS: 1024, abi.MAP_SOCKS6: 1024, abi.MAP_SOCKFLOWS: 1024,
            abi.MAP_SOCKFLOWS6: 1024, abi.MAP_SOCKANS: 1024, abi.MAP_SOCKANS6: 1024,
            abi.MAP_SERVICES6: 64, abi.MAP_SLOTS6: 256, abi.MAP_BACKENDS6: 256,
            abi.MAP_AFFINITY: 256, abi.MAP_AFFINITY6: 256, abi.MAP_TABLES6: 32768}


def port_state(
    proto: int = TCP,
    backends: tuple[Backend, ...] = READY,
    not_ready: tuple[Backend, ...] = (NOT_READY,),
    *,
    port: int = PORT,
    affinity: int = 0,
    scheduler: str = "",
    weights: tuple[tuple[str, int], ...] = (),
) -> ServicePortState:
    return ServicePortState(
        service=SERVICE,
        port_name=f"p{port}-{proto}",
        frontend=Frontend(VIP, port, PROTOS[proto]),
        backends=tuple(sorted(backends)),
        known_backends=tuple(sorted(set(backends) | set(not_ready))),
        session_affinity_seconds=affinity,
        scheduler=scheduler,
        weights=weights,
    )


@dataclass(frozen=True)
class Prog:
    name: str
    ok: int  # verdict for "carry on"
    drop: int


TC_INGRESS = Prog(abi.PROG_TC_INGRESS, TC_ACT_OK, TC_ACT_SHOT)
TC_EGRESS = Prog(abi.PROG_TC_EGRESS, TC_ACT_OK, TC_ACT_SHOT)
XDP = Prog(abi.PROG_XDP, XDP_PASS, XDP_DROP)
INGRESS = [pytest.param(TC_INGRESS, id="tc"), pytest.param(XDP, id="xdp")]
ALL_PROGS = [*INGRESS, pytest.param(TC_EGRESS, id="tc-egress")]
BOTH_PROTOS = [pytest.param(TCP, id="tcp"), pytest.param(UDP, id="udp")]


class Dataplane:
    """One loaded copy of the programs and maps, programmed through render() like BpfDataplane.apply."""

    def __init__(self, obj: loader.LoadedObject, endpoint_counters: bool = False) -> None:
        self.obj = obj
        self.endpoint_counters = endpoint_counters
        """What the object was loaded with (--bpf-endpoint-counters): render keeps the endpoint counters map then."""
        # Maps owns (closes) its fds, and so does the object: give Maps its own.
        self.maps = Maps({name: os.dup(fd) for name, fd in obj.maps.items()})
        self.capacity = {name: loader.map_info(fd).max_entries for name, fd in obj.maps.items()}
        self.applied = Applied()
        self.meta = b""
        """The metadata XDP left in front of the last frame it ran on."""

    def close(self) -> None:
        self.maps.close()
        self.obj.close()

    def apply(self, *states: ServicePortState, service: str = SERVICE,
              masq: MasqueradeSettings = NO_MASQUERADE, scheduling: Scheduling = DEFAULT_SCHEDULING) -> Plan:
        plan = render(self.applied, {service: states}, self.capacity, masq, scheduling, self.endpoint_counters)
        self.maps.run_batches(plan.batches)
        self.applied.commit(plan)
        return plan

    def svc_id(self, state: ServicePortState) -> int:
        return self.applied.frontends[frontend_key(state.frontend)].svc_id

    def run(self, prog: Prog, data: bytes, ifindex: int = 0) -> tuple[int, bytes]:
        """One BPF_PROG_TEST_RUN: the verdict and the frame as the program left it. XDP's test run returns the
        packet's metadata in front of the frame: it goes to `self.meta` (the mark of a packet XDP translated).
        `ifindex`: the device, of the calling thread's network namespace, the packet arrives on (else none for TC,
        loopback for XDP): what SNAT's routing lookup starts from."""
        data_in = ffi.new("uint8_t[]", data)
        out = ffi.new("uint8_t[]", len(data) + 512)
        opts = ffi.new("struct bpf_test_run_opts *")
        opts.sz = ffi.sizeof("struct bpf_test_run_opts")
        opts.data_in = data_in
        opts.data_size_in = len(data)
        opts.data_out = out
        opts.data_size_out = len(out)
        if ifindex:
            ctx = (libbpf.xdp_ctx(len(data), ifindex) if prog.name == abi.PROG_XDP
                   else libbpf.skb_ctx(ifindex, ifindex))
            ctx_in = ffi.new("uint8_t[]", ctx)
            opts.ctx_in = ctx_in
            opts.ctx_size_in = len(ctx)
        libbpf.check(libbpf.lib().bpf_prog_test_run_opts(self.obj.progs[prog.name], opts), f"test run {prog.name}")
        frame = bytes(ffi.buffer(out, opts.data_size_out))
        self.meta = b""
        if prog.name == abi.PROG_XDP and len(frame) > len(data):  # XDP here never changes the frame's length
            self.meta, frame = frame[: len(frame) - len(data)], frame[len(frame) - len(data) :]
        return int(opts.retval), frame

    def counter(self, name: str) -> int:
        return sum(v.value for v in self.maps.counters.get(abi.COUNTERS.index(name)))

    def counters(self) -> dict[str, int]:
        return {name: self.counter(name) for name in abi.COUNTERS}

    def stats(self, svc_id: int) -> tuple[int, int]:
        per_cpu = self.maps.stats.get(svc_id)
        return sum(s.packets for s in per_cpu), sum(s.bytes for s in per_cpu)

    def endpoint_stats(self) -> dict[Backend, tuple[int, int]]:
        """Backend -> (packets, bytes) of MAP_EPSTATS, summed over CPUs."""
        return self.maps.endpoint_stats()


def backend_of(out: bytes) -> Backend:
    d = decode(out).flow
    return Backend(d.dst, d.dport)


def assert_checksums_valid(out: bytes, csum: L4Csum = L4Csum.FULL) -> None:
    """What a receiver checks: the IPv4 header checksum, and the TCP/UDP one unless it is absent (UDP's 0)
    or not computed yet (partial)."""
    d = decode(out)
    assert d.ip_csum_ok, "IPv4 header checksum"
    if csum is L4Csum.FULL:
        assert d.l4_csum_ok, f"{'TCP' if d.flow.proto == TCP else 'UDP'} checksum {d.l4_csum:#06x}"


def dnat(
    dp: Dataplane,
    prog: Prog,
    flow: Flow,
    payload: bytes = b"",
    *,
    csum: L4Csum = L4Csum.FULL,
    tcp_flags: int = TCP_SYN,
    options: bytes = b"",
    **tcp: int,
) -> Backend:
    """Send one client packet to the frontend; assert it left as the very frame the client would have sent
    to the chosen backend (source, payload and all else untouched), with checksums a receiver accepts. `tcp`: seq,
    ack, window of its TCP header (packets.frame)."""
    verdict, out = dp.run(prog, frame(flow, payload, csum=csum, tcp_flags=tcp_flags, options=options, **tcp))
    assert verdict == prog.ok
    be = backend_of(out)
    # Else an untranslated packet passes the check below (it is then the frame "to" its own destination).
    assert (be.ip, be.port) != (flow.dst, flow.dport), f"not DNATed: {flow} left as it came"
    assert out == frame(flow.to(be.ip, be.port), payload, csum=csum, tcp_flags=tcp_flags, options=options, **tcp)
    assert_checksums_valid(out, csum)
    if prog.name == abi.PROG_XDP and (flow.proto == UDP or tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN):
        # TC ingress runs next on the same packet and must not take it for a direct connection (nat.h).
        assert dp.meta == XDP_TRANSLATED_MARK, f"XDP translated without leaving its mark: {dp.meta.hex()}"
    return be
