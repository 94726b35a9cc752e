"""The VLAN and bond uplinks of test_stacked_devices_e2e.py, with real packets, in a qemu guest: this machine's kernel
has no 8021q or bonding driver (there those tests are deselected, conftest.py's `stack_driver`), Debian bookworm's 6.1
kernel has both as modules (tests/guest/build-image.sh copies them; the lab loads them).

The object is built here, on the host (the guest has no clang and reads this checkout's bpf/build over the read-only
share), then the guest runs just the VLAN and bond variants of the lab's own check and of the NodePort test, in bpf mode
(TC only, XDP on the NIC-like lower device, `--devices` naming every device: the two TC passes the mark must make one)
and nftables mode (conftest.py's `guest_pytest`: passes when the guest's pytest exits 0 with nothing skipped). Time
bounds inside scale under emulation (tests/emulation.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
TEST = "tests/e2e/test_stacked_devices_e2e.py::test_nodeports_through_a_client_link_stacked_over_the_nic"
LAB_TEST = "tests/e2e/test_lab.py::test_a_stacked_client_link_holds_the_node_address_above_the_veth"
MODES = ("bpf", "bpf-xdp", "bpf-devices", "nftables")
STACKS = ("vlan", "bond")
# Measured: 12 and 13.5 minutes for the 10 cases (25-120 s each, the guest's boot 10 s) under TCG with 2 emulated CPUs,
# a CI run and other tests beside it on the 2-core host (load 5); the bound leaves room for a busier one.
GUEST_TIMEOUT = 2400.0
SELECTION = os.environ.get("PYPROXY_GUEST_STACK_TESTS", " ".join(
    [f"{LAB_TEST}[{stack}]" for stack in STACKS] + [f"{TEST}[{stack}-{mode}]" for stack in STACKS for mode in MODES]))
"""What the guest's pytest runs: the lab's VLAN and bond layouts and the 8 VLAN and bond cases of the NodePort test,
and nothing else (a guest boot is quick, its pytest is not: about a minute a case); or e.g. one node id while working
on it."""


def test_vlan_and_bond_uplinks_in_a_guest(guest_pytest: Callable[..., None]) -> None:
    built = subprocess.run(["make", "-s", "bpf"], cwd=REPO, capture_output=True, text=True)
    assert built.returncode == 0, f"make bpf failed:\n{built.stdout}{built.stderr}"
    # -s: each case's lines (x/20 answered per Service and protocol) in the guest's output, which the host prints.
    guest_pytest(f"-s --durations=0 {SELECTION}", GUEST_TIMEOUT)
