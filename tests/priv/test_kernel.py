"""The kernel feature probes (pyproxy/dataplane/bpf/kernel.py) on the kernel this runs on: the host's, and Debian's
6.1 in the qemu guest (tests/e2e/test_guest_kernel.py). Each required feature is there (README, "Kernel
requirements", claims both kernels run pyproxy), each probe can also say no (a probe that always said yes would
hide a missing feature until the verifier's dump), and a kernel that lacks one fails the load naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import ROOT

from pyproxy.dataplane.bpf import abi, kernel, loader

pytestmark = ROOT


@pytest.mark.parametrize("feature", kernel.REQUIRED, ids=lambda f: f.name)
def test_this_kernel_has_every_required_feature(feature: kernel.Feature) -> None:
    assert feature.probe(), f"{kernel.release()} lacks {feature.name} (Linux {feature.since})"


def test_the_probes_can_say_no() -> None:
    assert not kernel._helper(kernel.PROG_SCHED_CLS, 100_000)(), "a helper no kernel has"
    assert not kernel._helper(kernel.PROG_SCHED_CLS, kernel.FUNC_SET_RETVAL)(), "a cgroup helper, from TC"
    assert not kernel._hook(10_000)(), "an attach type no kernel has"
    assert not kernel._map_type(10_000)()


def test_fib_lookup_src_probe_tells_a_known_flag_from_an_unknown_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's answer is the helper's run-time check of its flags: a flag no kernel knows is refused."""
    assert kernel.features().fib_src == kernel.fib_lookup_src()
    monkeypatch.setattr(kernel, "BPF_FIB_LOOKUP_SRC", 1 << 30)
    assert not kernel.fib_lookup_src()


def test_the_loader_hands_the_programs_what_the_kernel_offers(bpf_object: Path) -> None:
    obj = loader.load(bpf_object, None, max_entries={abi.MAP_CT: 1024})
    try:
        assert obj.kernel_flags == kernel.features().flags
    finally:
        obj.close()


def test_a_kernel_missing_a_feature_fails_the_load_naming_it(bpf_object: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = next(f for f in kernel.REQUIRED if f.name == "bpf_loop")
    monkeypatch.setattr(kernel, "features", lambda: kernel.KernelFeatures((loop,), 0))
    with pytest.raises(loader.BpfUnavailable) as e:
        loader.load(bpf_object, None)
    assert "bpf_loop (Linux 5.17: SNAT port search" in str(e.value)
    assert "needs Linux 5.18 or later" in str(e.value), "the oldest release with everything required"
