"""The BCC loader (--bpf-loader=bcc) against the libbpf one: the same maps, the same struct layouts as BCC compiles
them (test_abi.py checks libbpf's object's BTF), and a switch from one loader to the other keeps the pinned
maps and what they hold. The packet fixtures run with both loaders through conftest's `load`."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import CAPACITY, ROOT
from test_abi import python_members

from pyproxy.dataplane.bpf import abi, bcc, libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi
from pyproxy.dataplane.bpf.maps import BpfMap

pytestmark = [
    *ROOT,
    pytest.mark.skipif(bcc.missing() is not None, reason=f"--bpf-loader=bcc: {bcc.missing()}"),
]


def _shape(fd: int) -> tuple[str, int, int, int, int, int]:
    info = loader.map_info(fd)
    return info.name.decode(), info.type, info.key_size, info.value_size, info.max_entries, info.map_flags


@pytest.fixture(scope="module")
def bcc_obj() -> Iterator[loader.LoadedObject]:
    obj = bcc.load(None, max_entries=CAPACITY)
    yield obj
    obj.close()


def test_bcc_makes_the_maps_libbpf_makes(bpf_object: Path, bcc_obj: loader.LoadedObject) -> None:
    """bcc.h declares the maps again for BCC: names, types, key and value sizes, capacities and flags must be
    maps.h's, or a switch of loader would replace the pinned maps (and lose every flow)."""
    ours = loader.load(bpf_object, None, max_entries=CAPACITY)
    try:
        assert sorted(bcc_obj.maps) == sorted(ours.maps) == sorted(abi.ALL_MAPS)
        assert {n: _shape(fd) for n, fd in bcc_obj.maps.items()} == {n: _shape(fd) for n, fd in ours.maps.items()}
        assert sorted(bcc_obj.progs) == sorted(ours.progs)
    finally:
        ours.close()


def _layout_probe(structs: dict[str, type[ctypes.Structure]]) -> str:
    """A BCC program that writes, for each struct, its size and then each member's offset and size, as BCC's
    compile of abi.h has them (in BCC's include environment: the kernel headers, not /usr/include)."""
    lines = ['#include "pyproxy/abi.h"', "BPF_TABLE(\"array\", u32, u32, layout, 1024);",
             "int probe(struct __sk_buff *skb) {", "u32 k = 0, v;"]
    for name, cls in structs.items():
        values = [f"sizeof(struct {name})"]
        for member, *_ in cls._fields_:
            values += [f"__builtin_offsetof(struct {name}, {member})", f"sizeof(((struct {name} *)0)->{member})"]
        lines += [f"v = {value}; layout.update(&k, &v); k++;" for value in values]
    return "\n".join([*lines, "return 0;", "}"])


@pytest.fixture(scope="module")
def bcc_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Struct name -> [size, offset, size, ...] as BCC compiled them. BCC 0.26 loads no BTF of the structs here (the
    programs' BTF holds their functions only), so a program reports what it was compiled with: one test run."""
    probe = tmp_path_factory.mktemp("bcc") / "layout.c"
    probe.write_text(_layout_probe(abi.STRUCTS))
    module = bcc.Module(probe, bcc._cflags(), "the layout probe")
    try:
        fd = module.load("probe", bcc.PROGRAMS[abi.PROG_TC_INGRESS][0], 0)
        try:
            data = ffi.new("uint8_t[]", 64)
            opts = ffi.new("struct bpf_test_run_opts *")
            opts.sz, opts.data_in, opts.data_size_in = ffi.sizeof("struct bpf_test_run_opts"), data, 64
            libbpf.check(libbpf.lib().bpf_prog_test_run_opts(fd, opts), "test run the layout probe")
        finally:
            os.close(fd)
        (table_fd, _), = module.tables().values()
        values = BpfMap(os.dup(table_fd), "layout", ctypes.c_uint32, ctypes.c_uint32)
        got = [int(values[ctypes.c_uint32(i)].value) for i in range(1024)]
        values.close()
    finally:
        module.close()
    out, i = {}, 0
    for name, cls in abi.STRUCTS.items():
        n = 1 + 2 * len(cls._fields_)
        out[name], i = got[i : i + n], i + n
    return out


@pytest.mark.parametrize("name", sorted(abi.STRUCTS))
def test_struct_layout_matches_bccs_compile(bcc_layout: dict[str, list[int]], name: str) -> None:
    """test_abi.py's check, on what BCC compiles: one abi.h, one layout, whichever compiler and headers."""
    cls = abi.STRUCTS[name]
    want = [ctypes.sizeof(cls)]
    for m in python_members(cls):
        want += [m.offset, m.size]
    assert bcc_layout[name] == want, f"struct {name}: BCC's [size, offset, size, ...] against abi.py's"


def test_a_switch_of_loader_keeps_the_pinned_maps_and_their_entries(bpf_object: Path, pins: Path) -> None:
    """libbpf, then BCC, then libbpf again on one pin path: the same kernel maps each time (a restart with the other
    loader keeps every connection), an entry written under one loader read under the next."""
    key = abi.CtKey(saddr=abi.be32("192.168.1.10"), daddr=abi.be32("10.96.0.10"), sport=abi.be16(40000),
                    dport=abi.be16(80), proto=6, dir=abi.CT_FORWARD)
    value = abi.CtValue(nat_addr=abi.be32("10.0.1.1"), nat_port=abi.be16(8080), svc_id=7, last_seen=1)
    objs: list[loader.LoadedObject] = []
    try:
        objs.append(loader.load(bpf_object, pins, max_entries=CAPACITY))
        ids = {n: loader.map_info(fd).id for n, fd in objs[0].maps.items()}
        ct = BpfMap(os.dup(objs[0].maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue)
        ct[key] = value
        ct.close()
        for load in (lambda: bcc.load(pins, max_entries=CAPACITY),
                     lambda: loader.load(bpf_object, pins, max_entries=CAPACITY)):
            objs.pop().close()
            objs.append(load())
            assert {n: loader.map_info(fd).id for n, fd in objs[0].maps.items()} == ids
            ct = BpfMap(os.dup(objs[0].maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue)
            assert bytes(ct[key]) == bytes(value)
            ct.close()
    finally:
        for obj in objs:
            obj.close()


def test_a_pin_of_another_size_is_replaced_as_libbpf_replaces_it(pins: Path) -> None:
    objs: list[loader.LoadedObject] = []
    try:
        objs.append(bcc.load(pins, max_entries=CAPACITY))
        before = {n: loader.map_info(fd).id for n, fd in objs[0].maps.items()}
        objs.pop().close()
        objs.append(bcc.load(pins, max_entries={**CAPACITY, abi.MAP_CT: 2 * CAPACITY[abi.MAP_CT]}))
        after = {n: loader.map_info(fd).id for n, fd in objs[0].maps.items()}
        assert loader.map_info(objs[0].maps[abi.MAP_CT]).max_entries == 2 * CAPACITY[abi.MAP_CT]
        assert after[abi.MAP_CT] != before[abi.MAP_CT]
        assert {n: i for n, i in after.items() if n != abi.MAP_CT} == \
            {n: i for n, i in before.items() if n != abi.MAP_CT}
        fd = libbpf.check(libbpf.lib().bpf_obj_get(str(pins / abi.MAP_CT).encode()), "open the CT pin")
        try:
            assert loader.map_info(fd).id == after[abi.MAP_CT]
        finally:
            os.close(fd)
    finally:
        for obj in objs:
            obj.close()
