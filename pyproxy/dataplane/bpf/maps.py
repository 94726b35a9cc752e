"""BPF maps as Python mappings, the way bcc's table.py reads: `m[key] = value`, `del m[key]`, iteration.

Keys and values are ctypes structures from `abi`. A per-CPU map yields one value per possible CPU.
"""

from __future__ import annotations

import array
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


# What a kernel without batch operations on this map type answers (ENOTSUPP is the kernel's own 524). It then
# leaves the count as it was given; a batch that failed at an entry sets it to the entries done.
_NO_BATCH = frozenset({errno.EINVAL, errno.EOPNOTSUPP, 524})


def _error(ret: int) -> int:
    return -ret if ret != -1 else ffi.errno


def _buf(obj: ctypes.Structure | ctypes._SimpleCData | ctypes.Array) -> object:
    return ffi.from_buffer(memoryview(obj).cast("B"))


def update_batch(fd: int, name: str, keys: bytes, values: bytes, count: int, key_size: int, value_size: int) -> None:
    """Write `count` entries (packed keys, packed values) with BPF_ANY, in order: one bpf(2) call instead of
    one per entry. The kernel applies them one by one, so a reader sees them appear in that order. Falls back
    to one call per entry where the kernel has no batch operations."""
    lib = libbpf.lib()
    key_buf, value_buf = ffi.from_buffer(keys), ffi.from_buffer(values)
    n = ffi.new("uint32_t *", count)
    ret = lib.bpf_map_update_batch(fd, key_buf, value_buf, n, ffi.NULL)
    if ret >= 0:
        return
    code = _error(ret)
    if code in _NO_BATCH and n[0] in (0, count):
        for i in range(count):
            ret = lib.bpf_map_update_elem(fd, key_buf + i * key_size, value_buf + i * value_size, libbpf.BPF_ANY)
            if ret < 0:
                break
        else:
            return
        code = _error(ret)
    if code == errno.E2BIG:
        raise MapFullError(code, f"BPF map {name} is full")
    libbpf.check(ret, f"update of map {name}")


def delete_batch(fd: int, name: str, keys: bytes, count: int, key_size: int) -> None:
    """Delete `count` packed keys in order with one bpf(2) call; keys already absent are skipped."""
    lib = libbpf.lib()
    buf = ffi.from_buffer(keys)
    done = 0
    while done < count:
        n = ffi.new("uint32_t *", count - done)
        ret = lib.bpf_map_delete_batch(fd, buf + done * key_size, n, ffi.NULL)
        if ret >= 0:
            return
        code = _error(ret)
        if code == errno.ENOENT:
            done += n[0] + 1  # the kernel stopped at an absent key: skip it and go on after it
        elif code in _NO_BATCH and n[0] in (0, count - done):
            for i in range(done, count):
                ret = lib.bpf_map_delete_elem(fd, buf + i * key_size)
                if ret < 0 and _error(ret) != errno.ENOENT:
                    libbpf.check(ret, f"delete from map {name}")
            return
        else:
            libbpf.check(ret, f"delete from map {name}")


_TOKEN = 64  # bytes for the kernel's batch position (a u32 bucket for hash maps, a key for arrays)


def lookup_batch(fd: int, name: str, key_size: int, value_size: int, chunk: int = 4096) -> tuple[bytes, bytes] | None:
    """Every key and every value of a map, packed one after the other (entry i's key at i * key_size, its
    value at i * value_size): `chunk` entries per bpf(2) call instead of two calls per entry. None where the
    kernel has no batch lookups for this map type."""
    lib = libbpf.lib()
    keys, values = ffi.new("char[]", key_size * chunk), ffi.new("char[]", value_size * chunk)
    position, following = ffi.new("char[]", _TOKEN), ffi.new("char[]", _TOKEN)
    all_keys: list[bytes] = []
    all_values: list[bytes] = []
    first = True
    while True:
        n = ffi.new("uint32_t *", chunk)
        ret = lib.bpf_map_lookup_batch(fd, ffi.NULL if first else position, following, keys, values, n, ffi.NULL)
        code = _error(ret) if ret < 0 else 0
        if code not in (0, errno.ENOENT):  # ENOENT: this was the last chunk
            if first and code in _NO_BATCH:
                return None
            libbpf.check(ret, f"batch lookup in map {name}")
        all_keys.append(ffi.buffer(keys, n[0] * key_size)[:])
        all_values.append(ffi.buffer(values, n[0] * value_size)[:])
        if code == errno.ENOENT:
            return b"".join(all_keys), b"".join(all_values)
        ffi.memmove(position, following, _TOKEN)
        first = False


BPF_MAP_TYPE_ARRAY = 2
BPF_F_INNER_MAP = 0x1000


def create_inner_array(name: str, value_size: int, max_entries: int) -> int:
    """A new array map (u32 index -> `value_size` bytes) to go into a map-in-map whose inner maps may differ in
    size (BPF_F_INNER_MAP); its fd."""
    opts = ffi.new("struct bpf_map_create_opts *")
    opts.sz = ffi.sizeof("struct bpf_map_create_opts")
    opts.map_flags = BPF_F_INNER_MAP
    return libbpf.check(libbpf.lib().bpf_map_create(BPF_MAP_TYPE_ARRAY, name.encode(), 4, value_size, max_entries,
                                                    opts), f"create map {name}")


def fd_of_map_id(map_id: int, what: str) -> int:
    """An fd of the map with id `map_id` (what a map-in-map's lookup from user space gives)."""
    return libbpf.check(libbpf.lib().bpf_map_get_fd_by_id(map_id), f"open {what} (map id {map_id})")


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

    def put_raw(self, key: bytes, value: bytes) -> None:
        """One entry as packed bytes, BPF_ANY."""
        ret = libbpf.lib().bpf_map_update_elem(self.fd, ffi.from_buffer(key), ffi.from_buffer(value), libbpf.BPF_ANY)
        if ret < 0:
            if _error(ret) == errno.E2BIG:
                raise MapFullError(errno.E2BIG, f"BPF map {self.name} is full")
            libbpf.check(ret, f"update of map {self.name}")

    def get_raw(self, key: bytes) -> bytes | None:
        """The value under a packed key, packed; None when there is none."""
        value = ffi.new("char[]", ctypes.sizeof(self.value_type))
        ret = libbpf.lib().bpf_map_lookup_elem(self.fd, ffi.from_buffer(key), value)
        if ret < 0:
            if _error(ret) == errno.ENOENT:
                return None
            libbpf.check(ret, f"lookup in map {self.name}")
        return bytes(ffi.buffer(value))

    def delete_raw(self, key: bytes) -> None:
        """One entry by packed key; an absent one is no error."""
        ret = libbpf.lib().bpf_map_delete_elem(self.fd, ffi.from_buffer(key))
        if ret < 0 and _error(ret) != errno.ENOENT:
            libbpf.check(ret, f"delete from map {self.name}")

    def update_batch(self, keys: bytes, values: bytes, count: int) -> None:
        """`count` entries, as packed keys and values, in one call (see `update_batch`)."""
        update_batch(self.fd, self.name, keys, values, count, ctypes.sizeof(self.key_type),
                     ctypes.sizeof(self.value_type))

    def delete_batch(self, keys: bytes, count: int) -> None:
        """`count` packed keys deleted in one call; absent ones are skipped (see `delete_batch`)."""
        delete_batch(self.fd, self.name, keys, count, ctypes.sizeof(self.key_type))

    def items_raw(self) -> tuple[bytes, bytes]:
        """Every key and every value, packed (see `lookup_batch`): batched where the kernel can, else one
        lookup per key."""
        got = lookup_batch(self.fd, self.name, ctypes.sizeof(self.key_type), ctypes.sizeof(self.value_type))
        if got is not None:
            return got
        items = [(k, v) for k in self.keys_list() if (v := self.get(k)) is not None]
        return b"".join(bytes(k) for k, _ in items), b"".join(bytes(v) for _, v in items)

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


class _PerCpu(Generic[V]):
    """A per-CPU map: one value per possible CPU for each key. Owns the fd."""

    def __init__(self, fd: int, name: str, value_type: type[V]) -> None:
        self.fd = fd
        self.name = name
        self.value_type = value_type
        self.ncpus = libbpf.lib().libbpf_num_possible_cpus()
        # The kernel copies each CPU's value at an 8-byte stride.
        self._stride = (ctypes.sizeof(value_type) + 7) // 8 * 8
        self.entry_size = self._stride * self.ncpus
        """Bytes of one key's values, every CPU's, as the kernel reads and writes them."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class PerCpuArray(_PerCpu[V]):
    """A BPF_MAP_TYPE_PERCPU_ARRAY: index -> one value per possible CPU."""

    def get(self, index: int) -> list[V]:
        raw = (ctypes.c_uint8 * (self._stride * self.ncpus))()
        key = ctypes.c_uint32(index)
        libbpf.check(libbpf.lib().bpf_map_lookup_elem(self.fd, _buf(key), _buf(raw)), f"lookup in {self.name}")
        size = ctypes.sizeof(self.value_type)
        data = bytes(raw)
        return [cast(V, self.value_type.from_buffer_copy(data[i * self._stride : i * self._stride + size]))
                for i in range(self.ncpus)]

    def reset(self, *indexes: int) -> None:
        """Zero indexes on every CPU (a reused service id starts its counters from zero), in one call."""
        size = self._stride * self.ncpus
        update_batch(self.fd, self.name, array.array("I", indexes).tobytes(), bytes(size * len(indexes)),
                     len(indexes), 4, size)


class PerCpuHash(_PerCpu[V], Generic[K, V]):
    """A BPF_MAP_TYPE_PERCPU_HASH: key -> one value per possible CPU. Keys go in and out packed, a whole map or batch
    at a time (the per-endpoint counters: one entry per backend, read at every scrape)."""

    def __init__(self, fd: int, name: str, key_type: type[K], value_type: type[V]) -> None:
        super().__init__(fd, name, value_type)
        self.key_type = key_type

    def get(self, key: bytes) -> list[V] | None:
        """One packed key's value on each CPU; None when absent."""
        raw = ffi.new("char[]", self.entry_size)
        ret = libbpf.lib().bpf_map_lookup_elem(self.fd, ffi.from_buffer(key), raw)
        if ret < 0:
            if _error(ret) == errno.ENOENT:
                return None
            libbpf.check(ret, f"lookup in {self.name}")
        return self._values(ffi.buffer(raw)[:], 0)

    def put_zeros(self, keys: bytes, count: int) -> None:
        """`count` packed keys, each with every CPU's value zeroed, in one call (see `update_batch`)."""
        update_batch(self.fd, self.name, keys, bytes(self.entry_size * count), count, ctypes.sizeof(self.key_type),
                     self.entry_size)

    def delete_batch(self, keys: bytes, count: int) -> None:
        """`count` packed keys deleted in one call; absent ones are skipped (see `delete_batch`)."""
        delete_batch(self.fd, self.name, keys, count, ctypes.sizeof(self.key_type))

    def items_raw(self) -> tuple[bytes, bytes]:
        """Every key and every key's values (`entry_size` bytes each: every CPU's, at the kernel's stride), packed:
        batched where the kernel can, else one lookup per key."""
        key_size = ctypes.sizeof(self.key_type)
        got = lookup_batch(self.fd, self.name, key_size, self.entry_size)
        return got if got is not None else self._items_one_by_one(key_size)

    def keys_raw(self) -> list[bytes]:
        """Every packed key."""
        keys, _ = self.items_raw()
        size = ctypes.sizeof(self.key_type)
        return [keys[i:i + size] for i in range(0, len(keys), size)]

    def _values(self, data: bytes, offset: int) -> list[V]:
        """The per-CPU values of one key, packed at `offset` of `data`."""
        return [cast(V, self.value_type.from_buffer_copy(data, offset + c * self._stride)) for c in range(self.ncpus)]

    def _items_one_by_one(self, key_size: int) -> tuple[bytes, bytes]:
        lib = libbpf.lib()
        keys, values = [], []
        cur, nxt = ffi.new("char[]", key_size), ffi.new("char[]", key_size)
        value = ffi.new("char[]", self.entry_size)
        ret = lib.bpf_map_get_next_key(self.fd, ffi.NULL, nxt)
        while ret == 0:
            if lib.bpf_map_lookup_elem(self.fd, nxt, value) == 0:
                keys.append(ffi.buffer(nxt, key_size)[:])
                values.append(ffi.buffer(value, self.entry_size)[:])
            ffi.memmove(cur, nxt, key_size)
            ret = lib.bpf_map_get_next_key(self.fd, cur, nxt)
        return b"".join(keys), b"".join(values)
