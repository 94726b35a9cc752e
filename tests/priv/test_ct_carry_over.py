"""An upgrade keeps established flows across a CT layout change (loader.carry_over): the flows of a previous
release's pinned pyproxy_ct_v2 and pyproxy_ct6_v1 are copied into pyproxy_ct_v3 and pyproxy_ct6_v2 at load, again
once the new programs are attached (retire_old_layouts), and the old pins then go; the programs follow the carried
flows, and a carried flow takes any RST, as the old programs let it (ct.h, the RST window). Both loaders."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
from conftest import Load
from harness import CAPACITY, CLIENT, PORT, ROOT, TC_EGRESS, TC_INGRESS, VIP, Dataplane, dnat, port_state
from packets import TCP, TCP_ACK, TCP_RST, Flow, decode, frame

from pyproxy.dataplane.bpf import abi, clock, libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.model.state import Backend

pytestmark = ROOT

BE = Backend("10.0.1.1", 8080)
LRU_HASH = 9  # BPF_MAP_TYPE_LRU_HASH, the CT maps' type
OLD_CT, OLD_CT6 = (c.old for c in abi.CT_CARRY_OVER)
SVC_ID = 0  # the id render gives the first frontend of a fresh load (checked below)


def old_map(pins: Path, name: str, key: type[ctypes.Structure], value: type[ctypes.Structure]) -> BpfMap:
    """A map as a previous release pinned it: its name, its entries' layout."""
    fd = libbpf.check(libbpf.lib().bpf_map_create(LRU_HASH, name.encode(), ctypes.sizeof(key), ctypes.sizeof(value),
                                                  1024, ffi.NULL), f"create {name}")
    libbpf.check(libbpf.lib().bpf_obj_pin(fd, str(pins / name).encode()), f"pin {name}")
    return BpfMap(fd, name, key, value)


def flow_keys(flow: Flow, be: Backend) -> tuple[abi.CtKey, abi.CtKey]:
    return (abi.CtKey(abi.be32(flow.src), abi.be32(flow.dst), abi.be16(flow.sport), abi.be16(flow.dport), TCP,
                      abi.CT_FORWARD),
            abi.CtKey(abi.be32(be.ip), abi.be32(flow.src), abi.be16(be.port), abi.be16(flow.sport), TCP,
                      abi.CT_REVERSE))


def write_v2_flow(ct: BpfMap, flow: Flow, be: Backend, svc_id: int) -> None:
    """An established flow's two entries as pyproxy_ct_v2's programs wrote them."""
    now = clock.ticks_now()
    fwd, rev = flow_keys(flow, be)
    ct[fwd] = abi.CtValueV2(abi.be32(be.ip), abi.be16(be.port), abi.CT_ST_ESTABLISHED, 0, svc_id, 0, now)
    ct[rev] = abi.CtValueV2(abi.be32(flow.dst), abi.be16(flow.dport), abi.CT_ST_ESTABLISHED, 0, svc_id,
                            now & 0xFFFFFFFF, now)


def test_an_upgrade_carries_established_flows_over_and_removes_the_old_pins(load: Load, pins: Path) -> None:
    old = old_map(pins, OLD_CT, abi.CtKey, abi.CtValueV2)
    old6 = old_map(pins, OLD_CT6, abi.Ct6Key, abi.Ct6ValueV1)
    early, late = Flow(CLIENT, VIP, 45000, PORT), Flow(CLIENT, VIP, 45001, PORT)
    write_v2_flow(old, early, BE, svc_id=SVC_ID)
    k6 = abi.Ct6Key(abi.in6("fd00:c::10"), abi.in6("fd00:96::a"), abi.be16(45000), abi.be16(80), TCP, abi.CT_FORWARD)
    old6[k6] = abi.Ct6ValueV1(abi.in6("fd00:1::1"), abi.be16(8080), abi.CT_ST_ESTABLISHED, abi.CT_F_FIN_FWD,
                              SVC_ID, 0, 0, clock.ticks_now())
    dp = Dataplane(load(pins, max_entries=CAPACITY))
    try:
        fwd, rev = flow_keys(early, BE)
        for k in (fwd, rev):
            v = dp.maps.ct[k]
            assert (v.state, v.flags, v.svc_id) == (abi.CT_ST_ESTABLISHED, abi.CT_F_SEQ_UNKNOWN, SVC_ID)
        assert dp.maps.ct[fwd].nat_addr == abi.be32(BE.ip) and dp.maps.ct[rev].nat_port == abi.be16(PORT)
        v6 = dp.maps.ct6[k6]
        assert (v6.state, v6.flags, v6.nat_port) == (abi.CT_ST_ESTABLISHED, abi.CT_F_FIN_FWD | abi.CT_F_SEQ_UNKNOWN,
                                                     abi.be16(8080))
        assert (pins / OLD_CT).exists(), "the old programs still write the old map until the new ones are attached"
        # A flow the old programs began after the load: the second pass, once attached, carries it too.
        write_v2_flow(old, late, BE, svc_id=SVC_ID)
        done = loader.retire_old_layouts(pins, dp.obj.maps)
        assert done == {OLD_CT: 2, OLD_CT6: 0}, "the second pass copies only what the first did not"
        assert not (pins / OLD_CT).exists() and not (pins / OLD_CT6).exists()
        assert dp.maps.ct.get(flow_keys(late, BE)[0]) is not None

        # The programs follow the carried flows: same backend, no new flow; a RST from anywhere closes them.
        dp.apply(port_state(TCP, backends=(BE, Backend("10.0.1.2", 8080))))
        assert dp.svc_id(port_state(TCP, backends=(BE,))) == SVC_ID, "the carried entries name another service id"
        for flow in (early, late):
            assert dnat(dp, TC_INGRESS, flow, tcp_flags=TCP_ACK, seq=123) == BE
        assert dp.counter("new_flow") == 0 and dp.counter("established") == 2
        _, out = dp.run(TC_EGRESS, frame(Flow(BE.ip, CLIENT, BE.port, 45000), tcp_flags=TCP_RST, seq=(1 << 31) + 9))
        assert decode(out).flow == early.reply()
        assert dp.maps.ct[fwd].state == abi.CT_ST_CLOSED and dp.counter("ct_rst_ignored") == 0
    finally:
        old.close()
        old6.close()
        dp.close()


def test_an_old_map_that_cannot_be_read_costs_its_flows_not_the_start(load: Load, pins: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A pin under the old name of another layout than pyproxy_ct_v2's: one error line, the load goes on."""
    odd = old_map(pins, OLD_CT, abi.CtKey, abi.CtValue)  # 32-byte values: not the v2 layout
    odd.close()
    with caplog.at_level(logging.INFO, logger="pyproxy.dataplane.bpf.loader"):
        obj = load(pins, max_entries=CAPACITY)
    try:
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and not errors[0].exc_info, [r.getMessage() for r in errors]
        assert f"cannot carry the flows of {pins / OLD_CT}" in errors[0].getMessage()
        assert "not the 16+24 of pyproxy_ct_v2" in errors[0].getMessage()
        assert loader.retire_old_layouts(pins, obj.maps) == {}
        assert not (pins / OLD_CT).exists()
    finally:
        obj.close()
