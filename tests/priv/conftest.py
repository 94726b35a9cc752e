"""Fixtures shared by the tests of the compiled BPF object: the object itself, built when missing or stale."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import CAPACITY, Dataplane

from pyproxy.dataplane.bpf import loader

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
def dp(bpf_object: Path) -> Iterator[Dataplane]:
    """A fresh, unpinned load of the object: maps of its own, shared with nothing."""
    dataplane = Dataplane(loader.load(bpf_object, None, max_entries=CAPACITY))
    yield dataplane
    dataplane.close()


@pytest.fixture
def dp_counted(bpf_object: Path) -> Iterator[Dataplane]:
    """As `dp`, loaded and programmed with the per-endpoint counters on (--bpf-endpoint-counters)."""
    dataplane = Dataplane(loader.load(bpf_object, None, max_entries=CAPACITY, endpoint_counters=True),
                          endpoint_counters=True)
    yield dataplane
    dataplane.close()
