"""The BPF backend packs a batch's map keys and values with struct and array (cheaper than ctypes at a quarter
million ops): the bytes must be exactly those of the abi ctypes structures, which tests/priv/test_abi.py checks
against the compiled object's BTF."""

from __future__ import annotations

import ctypes

import pytest

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.mapset import KEY_CODECS, VALUE_CODECS

CASES = [
    (abi.MAP_SERVICES, ("10.96.3.4", 8443, "UDP", 0), abi.SvcKey(abi.be32("10.96.3.4"), abi.be16(8443), 17),
     (7, 3, abi.SVC_F_AFFINITY, 10800, 0, 0), abi.SvcValue(7, 3, abi.SVC_F_AFFINITY, 10800)),
    (abi.MAP_SERVICES, ("10.96.3.4", 30080, "TCP", abi.SVC_SCOPE_NODE),
     abi.SvcKey(abi.be32("10.96.3.4"), abi.be16(30080), 6, abi.SVC_SCOPE_NODE),
     (8, 2, abi.SVC_F_NODE_VIEW, 0, abi.SCHED["maglev"], 16381),
     abi.SvcValue(8, 2, abi.SVC_F_NODE_VIEW, 0, abi.SCHED["maglev"], 0, 16381)),
    (abi.MAP_SLOTS, (70000, 9), abi.SlotKey(70000, 9),
     ("10.128.1.2", 8080, 65), abi.Slot(abi.be32("10.128.1.2"), abi.be16(8080), 65)),
    (abi.MAP_BACKENDS, ("192.168.0.1", 53), abi.Backend(abi.be32("192.168.0.1"), abi.be16(53)),
     (0,), abi.BackendInfo(0)),
    (abi.MAP_NAMES, (12,), ctypes.c_uint32(12), ("default/web:http",), abi.SvcName(b"default/web:http")),
    (abi.MAP_PORTS, (126,), ctypes.c_uint32(126), (1 << 63 | 1 << 16,), ctypes.c_uint64(1 << 63 | 1 << 16)),
    (abi.MAP_AFFINITY, (70000, "10.128.1.2", 8080),
     abi.AffinityKey(70000, abi.Backend(abi.be32("10.128.1.2"), abi.be16(8080))), (0,), ctypes.c_uint32(0)),
    (abi.MAP_AFFINITY6, (70000, "fd00:1::2", 8080),
     abi.Affinity6Key(70000, abi.Backend6(abi.in6("fd00:1::2"), abi.be16(8080))), (0,), ctypes.c_uint32(0)),
]


@pytest.mark.parametrize(("name", "key", "ckey", "value", "cvalue"), CASES, ids=[c[0] for c in CASES])
def test_packed_bytes_are_the_abi_structs(name: str, key: tuple, ckey: object, value: tuple, cvalue: object) -> None:
    assert KEY_CODECS[name]([key]) == bytes(ckey)  # type: ignore[call-overload]
    assert VALUE_CODECS[name]([value]) == bytes(cvalue)  # type: ignore[call-overload]
    # A batch is the entries one after the other, as the kernel reads them.
    assert KEY_CODECS[name]([key, key, key]) == bytes(ckey) * 3  # type: ignore[call-overload]
    assert VALUE_CODECS[name]([value] * 2) == bytes(cvalue) * 2  # type: ignore[call-overload]


def test_a_long_name_is_cut_and_stays_nul_terminated() -> None:
    packed = VALUE_CODECS[abi.MAP_NAMES]([("x" * 500,)])
    assert len(packed) == ctypes.sizeof(abi.SvcName) and packed[-1] == 0
    assert abi.SvcName.from_buffer_copy(packed).name == b"x" * (abi.NAME_LEN - 1)
