"""BPF maps as Python mappings, the way bcc's table.py reads: `m[key] = value`, `del m[key]`, iteration.

Keys and values are ctypes structures from `abi`. A per-CPU map yields one value per possible CPU.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator, MutableMapping
from typing import Generic, TypeVar, cast

from pyproxy.dataplane.bpf import libbpf
from pyproxy.dataplane.bpf.libbpf import ffi

K = TypeVar("K", bound=ctypes.Structure | ctypes.c_uint32)
V = TypeVar("V", bound=ctypes.Structure | ctypes.c_uint64)


class MapFullError(OSError):
    """The kernel refused a new entry because the map holds max_entries already."""


def _buf(obj: ctypes.Structure | ctypes._SimpleCData | ctypes.Array) -> object:
    return ffi.from_buffer(memoryview(obj).cast("B"))


class BpfMap(MutableMapping[K, V], Generic[K, V]):
    """One map, by file descriptor. Owns the fd: `close()` (or garbage collection) releases it."""

    def __init__(self, fd: int, name: str, key_type: type[K], value_type: type[V]) -> None:
        self.fd = fd
        self.name = name
        self.key_type = key_type
        self.value_type = value_type

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def __getitem__(self, key: K) -> V:
        value = self.value_type()
        ret = libbpf.lib().bpf_map_lookup_elem(self.fd, _buf(key), _buf(value))
        if ret < 0:
            if ffi.errno == errno.ENOENT or ret == -errno.ENOENT:
                raise KeyError(key)
            libbpf.check(ret, f"lookup in map {self.name}")
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self.put(key, value, libbpf.BPF_ANY)

    def put(self, key: K, value: V, flags: int) -> None:
        """Update with explicit BPF_ANY / BPF_NOEXIST / BPF_EXIST semantics."""
        ret = libbpf.lib().bpf_map_update_elem(self.fd, _buf(key), _buf(value), flags)
        if ret < 0:
            code = -ret if ret != -1 else ffi.errno
            if code == errno.E2BIG:
                raise MapFullError(code, f"BPF map {self.name} is full")
            libbpf.check(ret, f"update of map {self.name}")

    def __delitem__(self, key: K) -> None:
        ret = libbpf.lib().bpf_map_delete_elem(self.fd, _buf(key))
        if ret < 0:
            if ret == -errno.ENOENT or ffi.errno == errno.ENOENT:
                raise KeyError(key)
            libbpf.check(ret, f"delete from map {self.name}")

    def keys_list(self) -> list[K]:
        """All keys at once. Iterating while deleting is safe on the returned list."""
        out: list[K] = []
        lib = libbpf.lib()
        nxt = self.key_type()
        ret = lib.bpf_map_get_next_key(self.fd, ffi.NULL, _buf(nxt))
        while ret == 0:
            out.append(nxt)
            cur, nxt = nxt, self.key_type()
            ret = lib.bpf_map_get_next_key(self.fd, _buf(cur), _buf(nxt))
        return out

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys_list())

    def __len__(self) -> int:
        return len(self.keys_list())

    def clear(self) -> None:
        for k in self.keys_list():
            self.pop(k, None)


class PerCpuArray(Generic[V]):
    """A BPF_MAP_TYPE_PERCPU_ARRAY: index -> one value per possible CPU."""

    def __init__(self, fd: int, name: str, value_type: type[V]) -> None:
        self.fd = fd
        self.name = name
        self.value_type = value_type
        self.ncpus = libbpf.lib().libbpf_num_possible_cpus()
        # The kernel copies each CPU's value at an 8-byte stride.
        self._stride = (ctypes.sizeof(value_type) + 7) // 8 * 8

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def get(self, index: int) -> list[V]:
        raw = (ctypes.c_uint8 * (self._stride * self.ncpus))()
        key = ctypes.c_uint32(index)
        libbpf.check(libbpf.lib().bpf_map_lookup_elem(self.fd, _buf(key), _buf(raw)), f"lookup in {self.name}")
        size = ctypes.sizeof(self.value_type)
        data = bytes(raw)
        return [cast(V, self.value_type.from_buffer_copy(data[i * self._stride : i * self._stride + size]))
                for i in range(self.ncpus)]

    def reset(self, index: int) -> None:
        """Zero one index on every CPU (a reused service id starts its counters from zero)."""
        raw = (ctypes.c_uint8 * (self._stride * self.ncpus))()
        key = ctypes.c_uint32(index)
        libbpf.check(
            libbpf.lib().bpf_map_update_elem(self.fd, _buf(key), _buf(raw), libbpf.BPF_ANY), f"reset {self.name}"
        )
