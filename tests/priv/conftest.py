"""Fixtures shared by the tests of the BPF programs: the object, built when missing or stale, and `load`, which loads
the programs with each loader (--bpf-loader): every test that loads them runs once with libbpf and once with BCC."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from harness import CAPACITY, Dataplane

from pyproxy.dataplane.bpf import abi, bcc, libbpf, loader, maps
from pyproxy.dataplane.bpf.libbpf import ffi

REPO = Path(__file__).resolve().parents[2]
BPF_OBJECT = REPO / "bpf" / "build" / "pyproxy.bpf.o"


def _tool(name: str) -> str:
    path = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        pytest.skip(f"{name} not installed (make install)")
    return path


@pytest.fixture(scope="session")
def tool() -> Callable[[str], str]:
    """The path of a command-line tool, skipping the test when it is missing; bpftool lives in /usr/sbin,
    often outside a user's PATH."""
    return _tool


@pytest.fixture(scope="session")
def bpf_object() -> Path:
    """bpf/build/pyproxy.bpf.o as `make bpf` builds it from the current sources: a stale object would
    test yesterday's headers. A failing build fails the tests that need it."""
    if shutil.which("clang") is None:
        if not BPF_OBJECT.exists():
            pytest.skip("no clang to build bpf/build/pyproxy.bpf.o (make install)")
        return BPF_OBJECT
    built = subprocess.run(["make", "-s", "bpf"], cwd=REPO, capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail(f"make bpf failed:\n{built.stdout}{built.stderr}")
    return BPF_OBJECT


@pytest.fixture
def pins() -> Iterator[Path]:
    """A pin path of this test's own, on a bpffs, removed afterwards."""
    path = Path(f"/run/pyproxy-test-fixture-pins-{os.getpid()}")
    loader.ensure_bpffs(path)
    yield path
    for pin in path.glob(f"{abi.MAP_PREFIX}*"):
        pin.unlink()
    if loader.is_mountpoint(path):
        loader.unmount(path)
    path.rmdir()


class Load(Protocol):
    def __call__(self, pin_dir: Path | None, **kwargs: Any) -> loader.LoadedObject:
        """The programs loaded by the loader under test: loader.load's arguments but the object."""


_ARRAYS = (2, 6)  # BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PERCPU_ARRAY
_PROG_ARRAY = 3  # BPF_MAP_TYPE_PROG_ARRAY


def clear_maps(obj: loader.LoadedObject) -> None:
    """Every map of `obj` as a fresh load has it: hash maps emptied, arrays zeroed."""
    lib = libbpf.lib()
    for name, fd in obj.maps.items():
        info = loader.map_info(fd)
        if info.type == _PROG_ARRAY:
            continue  # the load's own IPv6 programs (loader.fill_jumps), not state
        if info.type in _ARRAYS:
            size = (info.value_size + 7) // 8 * 8 * lib.libbpf_num_possible_cpus() if info.type == 6 \
                else info.value_size
            n = info.max_entries
            maps.update_batch(fd, name, bytes((ctypes.c_uint32 * n)(*range(n))), bytes(size * n), n, 4, size)
            continue
        key, nxt = ffi.new("char[]", info.key_size), ffi.new("char[]", info.key_size)
        while lib.bpf_map_get_next_key(fd, ffi.NULL, nxt) == 0:
            ffi.memmove(key, nxt, info.key_size)
            libbpf.check(lib.bpf_map_delete_elem(fd, key), f"empty {name}")


class CachedLoads:
    """A load of the programs costs the verifier's pass over them (libbpf: about a second for the object on a busy
    2-core machine; BCC also compiles bpf/, some 15 s), which a fresh load per test would pay some 200 times: an
    unpinned load, once closed, is kept and handed out again to a test asking for the same settings, with its maps
    emptied (what a fresh load has). A load asked for while another of the same settings is out gets one of its
    own, so loads never share maps. Pinned loads are fresh every time (their maps are the pins')."""

    def __init__(self, make: Callable[..., loader.LoadedObject]) -> None:
        self.make = make
        """make(pin_dir, **settings): a fresh load, by the loader under test."""
        self.idle: dict[str, list[loader.LoadedObject]] = {}
        self.made: list[loader.LoadedObject] = []

    def __call__(self, pin_dir: Path | None, **kwargs: Any) -> loader.LoadedObject:
        if pin_dir is not None:
            return self.make(pin_dir, **kwargs)
        key = repr(sorted((k, bytes(v) if isinstance(v, ctypes.Structure) else sorted(v.items())
                           if isinstance(v, dict) else v) for k, v in kwargs.items()))
        idle = self.idle.setdefault(key, [])
        if idle:
            kept = idle.pop()
            clear_maps(kept)
        else:
            kept = self.make(None, **kwargs)
            self.made.append(kept)
        return loader.LoadedObject(kept.handle, dict(kept.progs), dict(kept.maps), kernel_flags=kept.kernel_flags,
                                   release=lambda _: idle.append(kept))

    def close(self) -> None:
        for obj in self.made:
            obj.close()


LOADER_MODULES = {"test_bcc.py", "test_maps.py"}
"""Fixtures that differ by loader (BCC's own pins, build and errors; each loader making and adopting the maps): every
case of theirs runs under both."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # BCC compiles the very sources libbpf's object is built from (bcc.h maps the map definitions and the constants),
    # so the rest of the fixtures run under BCC as a parity set: each test function once, its first case (whatever
    # load settings it asks for), every case under libbpf. PYPROXY_BCC_ALL=1 runs every case under both, for a change
    # to bcc.h or bcc.py.
    if os.environ.get("PYPROXY_BCC_ALL"):
        return
    seen: set[tuple[str, str]] = set()
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("bpf_loader") != "bcc" or item.path.name in LOADER_MODULES:
            keep.append(item)
            continue
        function = (item.path.name, getattr(item, "originalname", item.name))
        (drop if function in seen else keep).append(item)
        seen.add(function)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", params=["libbpf", "bcc"])
def bpf_loader(request: pytest.FixtureRequest) -> str:
    """--bpf-loader: each test that loads the programs runs with both; BCC's skipped, saying why, where it is
    missing (`make install-bcc`)."""
    if request.param == "bcc" and (why := bcc.missing()):
        pytest.skip(f"--bpf-loader=bcc: {why}")
    return str(request.param)


@pytest.fixture(scope="session")
def load(bpf_loader: str, bpf_object: Path) -> Iterator[Load]:
    loads = CachedLoads((lambda pin_dir, **kwargs: loader.load(bpf_object, pin_dir, **kwargs))
                        if bpf_loader == "libbpf" else bcc.load)
    yield loads
    loads.close()


@pytest.fixture
def dp(load: Load) -> Iterator[Dataplane]:
    """A fresh, unpinned load of the programs: maps of its own, shared with nothing."""
    dataplane = Dataplane(load(None, max_entries=CAPACITY))
    yield dataplane
    dataplane.close()


@pytest.fixture
def dp_counted(bpf_object: Path) -> Iterator[Dataplane]:
    """As `dp`, loaded and programmed with the per-endpoint counters on (--bpf-endpoint-counters)."""
    dataplane = Dataplane(loader.load(bpf_object, None, max_entries=CAPACITY, endpoint_counters=True),
                          endpoint_counters=True)
    yield dataplane
    dataplane.close()
