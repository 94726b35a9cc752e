"""pyproxy/dataplane/bpf/abi.py against the BTF of the compiled object: the C side is the truth.

A mismatch here means Python writes keys the programs never find, or reads values from the wrong bytes:
the dataplane then silently drops or misroutes. Needs bpftool, not root.
"""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.maps import PerCpuArray, PerCpuHash
from pyproxy.dataplane.bpf.mapset import Maps

BPF_MAP_TYPE_PROG_ARRAY, BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY = 3, 5, 6  # uapi enum bpf_map_type
_QUALIFIERS = ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG")


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # bytes
    size: int  # bytes


class Btf:
    """The types of one object's BTF, as `bpftool -j btf dump file` prints them."""

    def __init__(self, types: list[dict[str, Any]]) -> None:
        self.types = {t["id"]: t for t in types}

    @classmethod
    def of(cls, obj: Path, bpftool: str) -> Btf:
        out = subprocess.run([bpftool, "-j", "btf", "dump", "file", str(obj)], check=True,
                             capture_output=True, text=True).stdout
        return cls(json.loads(out)["types"])

    def named(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((t for t in self.types.values() if t["kind"] == kind and t["name"] == name), None)

    def resolve(self, type_id: int) -> dict[str, Any]:
        """The type behind typedefs and qualifiers."""
        t = self.types[type_id]
        while t["kind"] in _QUALIFIERS:
            t = self.types[t["type_id"]]
        return t

    def size(self, type_id: int) -> int:
        t = self.resolve(type_id)
        if t["kind"] == "ARRAY":
            return int(self.size(t["type_id"]) * t["nr_elems"])
        if t["kind"] == "PTR":
            return 8
        return int(t["size"])

    def members(self, struct: dict[str, Any]) -> list[Member]:
        assert all(not m.get("bitfield_size") for m in struct["members"]), f"{struct['name']} has bitfields"
        assert all(m["bits_offset"] % 8 == 0 for m in struct["members"])
        return [Member(m["name"], m["bits_offset"] // 8, self.size(m["type_id"])) for m in struct["members"]]

    def map_defs(self) -> dict[str, dict[str, Any]]:
        """Map name -> its BTF-defined map struct (members type, key, value, max_entries, ...)."""
        sec = self.named("DATASEC", ".maps")
        assert sec is not None, "the object defines no .maps section"
        out = {}
        for var in sec["vars"]:
            v = self.types[var["type_id"]]
            out[v["name"]] = self.resolve(v["type_id"])
        return out

    def map_field(self, map_def: dict[str, Any], field: str) -> dict[str, Any]:
        """A map definition's `__type(field, T)` as T; `__uint(field, n)` as the ARRAY whose nr_elems is n."""
        member = next(m for m in map_def["members"] if m["name"] == field)
        ptr = self.resolve(member["type_id"])
        assert ptr["kind"] == "PTR"
        return self.resolve(ptr["type_id"])

    def map_uint(self, map_def: dict[str, Any], field: str) -> int:
        return int(self.map_field(map_def, field)["nr_elems"])

    def inner_map(self, map_def: dict[str, Any]) -> dict[str, Any]:
        """A map-in-map's `__array(values, struct T)`: T, the definition of its inner maps."""
        member = next(m for m in map_def["members"] if m["name"] == "values")
        array = self.resolve(member["type_id"])
        assert array["kind"] == "ARRAY"
        ptr = self.resolve(array["type_id"])
        assert ptr["kind"] == "PTR"
        return self.resolve(ptr["type_id"])


def python_members(cls: type[ctypes.Structure]) -> list[Member]:
    return [Member(name, getattr(cls, name).offset, getattr(cls, name).size) for name, *_ in cls._fields_]


@pytest.fixture(scope="module")
def btf(bpf_object: Path, tool: Callable[[str], str]) -> Btf:
    return Btf.of(bpf_object, tool("bpftool"))


def assert_layout(btf: Btf, name: str) -> None:
    """abi.py's mirror of struct `name` has the size and the members of the C struct in `btf`."""
    cls = abi.STRUCTS[name]
    struct = btf.named("STRUCT", name)
    assert struct is not None, f"struct {name} is not in the BTF"
    assert ctypes.sizeof(cls) == struct["size"], f"sizeof {name}"
    assert python_members(cls) == btf.members(struct)


@pytest.mark.parametrize("name", sorted(abi.STRUCTS))
def test_struct_layout_matches_btf(btf: Btf, name: str) -> None:
    assert_layout(btf, name)


@pytest.mark.parametrize("name", sorted(abi.STRUCTS))
def test_struct_has_no_hidden_padding(btf: Btf, name: str) -> None:
    """abi.h's rule: hash keys compare bytewise, so every byte of a struct belongs to a named member."""
    struct = btf.named("STRUCT", name)
    assert struct is not None
    end = 0
    for m in btf.members(struct):
        assert m.offset == end, f"{name}: hole before {m.name}"
        end = m.offset + m.size
    assert end == struct["size"], f"{name}: hole at the end"


def test_every_map_of_the_object_is_known_to_python(btf: Btf) -> None:
    assert sorted(btf.map_defs()) == sorted(abi.ALL_MAPS)


def _c_name(btf: Btf, t: dict[str, Any]) -> str:
    return f"struct {t['name']}" if t["kind"] == "STRUCT" else f"{t['kind'].lower()}{btf.size(t['id']) * 8}"


def _py_name(cls: type) -> str:
    names = {v: k for k, v in abi.STRUCTS.items()}
    return f"struct {names[cls]}" if cls in names else f"int{ctypes.sizeof(cls) * 8}"


def test_python_reads_each_map_with_its_c_key_and_value_types(btf: Btf) -> None:
    """mapset.Maps is how the control plane reads and writes every map: its key and value types must be
    the map's own, and the per-CPU readers must be used exactly for the per-CPU maps of their kind."""
    maps = Maps({name: -1 for name in abi.ALL_MAPS})  # no fds: only the declared types are inspected
    readers: dict[str, tuple[type, type, int | None]] = {
        m.name: (m.key_type, m.value_type, None) for m in maps.by_name.values()
    }
    for arr in (maps.stats, maps.counters, maps.refusals):
        assert isinstance(arr, PerCpuArray)
        readers[arr.name] = (ctypes.c_uint32, arr.value_type, BPF_MAP_TYPE_PERCPU_ARRAY)
    for per_cpu_hash in (maps.epstats, maps.epstats6):
        assert isinstance(per_cpu_hash, PerCpuHash)
        readers[per_cpu_hash.name] = (per_cpu_hash.key_type, per_cpu_hash.value_type, BPF_MAP_TYPE_PERCPU_HASH)
    assert sorted(readers) == sorted(abi.ALL_MAPS)

    defs = btf.map_defs()
    for name, (key_type, value_type, per_cpu) in readers.items():
        d = defs.get(name)
        assert d is not None, f"map {name} is not in the object"
        kind = btf.map_uint(d, "type")
        if per_cpu is None:
            assert kind not in (BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY), f"{name} is per-CPU"
        else:
            assert kind == per_cpu, f"{name}: map type {kind}, read as {per_cpu}"
        fields = [("key", key_type), ("value", value_type)]
        if name in abi.JUMPS6:
            # A program array: u32 index -> program fd, declared by size (the kernel takes no BTF types for it).
            assert kind == BPF_MAP_TYPE_PROG_ARRAY, f"{name} is a program array"
            for field, cls in (("key_size", key_type), ("value_size", value_type)):
                assert cls is ctypes.c_uint32 and btf.map_uint(d, field) == 4, f"{name} {field}"
            continue
        if name in (abi.MAP_TABLES, abi.MAP_TABLES6):
            # A map of maps: user space writes inner maps' fds and reads their ids (u32 both); each inner map
            # (a frontend's table) is read and written as u32 -> struct pyproxy_backend (IPv6: pyproxy_backend6),
            # which the template gives by size only (maps.h says why).
            assert value_type is ctypes.c_uint32
            inner = btf.inner_map(d)
            entry = abi.Backend if name == abi.MAP_TABLES else abi.Backend6
            for field, cls in (("key_size", ctypes.c_uint32), ("value_size", entry)):
                assert btf.map_uint(inner, field) == ctypes.sizeof(cls), f"{name}'s tables' {field}"
            fields = fields[:1]
        for field, cls in fields:
            assert _py_name(cls) == _c_name(btf, btf.map_field(d, field)), f"{name} {field}"


def _counter_enum(btf: Btf, obj: Path, dwarfdump: Callable[[], str]) -> list[tuple[str, int]]:
    """enum pyproxy_counter from the object's BTF, else from its DWARF. clang's BTF records only types that
    maps, programs or globals use, and the enum is used only for its constants, so today it is in the
    DWARF (-g) alone."""
    enum = btf.named("ENUM", "pyproxy_counter")
    if enum is not None:
        return [(v["name"], v["val"]) for v in enum["values"]]
    dump = subprocess.run([dwarfdump(), "--name=pyproxy_counter", "--show-children", str(obj)],
                          check=True, capture_output=True, text=True).stdout
    found = re.findall(r'DW_AT_name\s+\("(PYPROXY_CNT_\w+)"\)\s+DW_AT_const_value\s+\((\d+)\)', dump)
    assert found, "enum pyproxy_counter is in neither the BTF nor the DWARF of the object"
    return [(name, int(val)) for name, val in found]


def test_counter_enum_matches_python_order(btf: Btf, bpf_object: Path, tool: Callable[[str], str]) -> None:
    values = _counter_enum(btf, bpf_object, lambda: tool("llvm-dwarfdump"))
    assert values[-1] == ("PYPROXY_CNT_MAX", len(abi.COUNTERS))
    assert [name.removeprefix("PYPROXY_CNT_").lower() for name, _ in values[:-1]] == list(abi.COUNTERS)
    assert [val for _, val in values[:-1]] == list(range(len(abi.COUNTERS)))
    assert btf.map_uint(btf.map_defs()[abi.MAP_COUNTERS], "max_entries") == len(abi.COUNTERS)


def test_the_endpoint_counters_map_follows_the_backends_map(btf: Btf) -> None:
    """One entry per backend: by default as many as the backends map holds (loader.load keeps a resized backends
    map's size for it too)."""
    defs = btf.map_defs()
    assert (btf.map_uint(defs[abi.MAP_EPSTATS], "max_entries")
            == btf.map_uint(defs[abi.MAP_BACKENDS], "max_entries"))


def test_programs_python_attaches_exist(btf: Btf) -> None:
    funcs = {t["name"] for t in btf.types.values() if t["kind"] == "FUNC" and t.get("linkage") == "global"}
    assert {abi.PROG_TC_INGRESS, abi.PROG_TC_EGRESS, abi.PROG_XDP} <= funcs
    assert {prog for jumps in abi.JUMPS6.values() for prog in jumps.values()} <= funcs
    assert all(f.startswith(abi.PROG_PREFIX) for f in funcs), "cleanup recognises programs by this prefix"


ABI_H = Path(__file__).resolve().parents[2] / "bpf" / "include" / "pyproxy" / "abi.h"
MIRRORED = ("CT_F_", "CT_ST_", "SVC_F_", "SVC_SCOPE_", "SOCK_F_", "KERNEL_",
            "CT_FORWARD", "CT_REVERSE", "CT_AFFINITY", "CT_HAIRPIN")
"""The #define families of abi.h whose every member Python must know: the flags and states it writes or reads."""


def abi_defines(tool: Callable[[str], str]) -> dict[str, int]:
    """abi.h's integer #defines (PYPROXY_ prefix dropped) as the preprocessor has them, one referring to another
    resolved: BTF holds structs and enums, not macros, so the flags are checked against the header itself."""
    argv = [tool("clang"), "-dM", "-E", "-I", str(ABI_H.parents[1]), "-I", "/usr/include/x86_64-linux-gnu", str(ABI_H)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    raw = dict(re.findall(r"^#define PYPROXY_(\w+) (\S+)$", out, re.M))
    values: dict[str, int] = {}
    for name, text in raw.items():
        while text.startswith("PYPROXY_") and text[8:] in raw:
            text = raw[text[8:]]
        if re.fullmatch(r"(0x[0-9a-fA-F]+|\d+)[uUlL]*", text):
            values[name] = int(text.rstrip("uUlL"), 0)
    return values


def test_abi_h_flags_and_states_match_python(tool: Callable[[str], str]) -> None:
    """A flag value that differs (or one Python lacks) makes the control plane write bits the programs read as
    something else, or read an entry's state wrongly (inspect, the collector): silent misbehaviour, not an error."""
    defines = abi_defines(tool)
    wrong = [f"{name}: abi.h {value:#x}, abi.py {getattr(abi, name):#x}" for name, value in sorted(defines.items())
             if isinstance(getattr(abi, name, None), int) and getattr(abi, name) != value]
    missing = [name for name in sorted(defines) if name.startswith(MIRRORED) and not hasattr(abi, name)]
    assert not wrong and not missing, f"differ: {wrong}; not in abi.py: {missing}"
    assert len([n for n in defines if n.startswith(MIRRORED)]) >= 20, "abi.h's flags not found: the parse broke"
