"""Issue 25's flow lifecycle (test_flow_lifecycle_e2e.py) with the node's client-facing address on a VLAN and on a
bond, with real packets, in the qemu guest: this machine's kernel has no 8021q or bonding driver, Debian bookworm's
6.1 has both (the lab loads them). Per stack a guest of its own runs the lifecycle file with PYPROXY_LIFECYCLE_STACK
set: bpf (TC, and XDP on the lower device) beside nftables, each held to the kernel conntrack's outcome.

Measured: 6.5 minutes per stack for the lost SYN-ACK and the flood, 3.5 for the DNS-like UDP (its 100 exchanges a
second answered 6,000 of 6,000 in every mode on both stacks). PYPROXY_GUEST_LIFECYCLE_TESTS sets what the guest's
pytest runs (e.g. one row while working on it).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
SELECTION = os.environ.get("PYPROXY_GUEST_LIFECYCLE_TESTS", "tests/e2e/test_flow_lifecycle_e2e.py")
GUEST_TIMEOUT = 3600.0


@pytest.mark.parametrize("stack", ["vlan", "bond"])
def test_flow_lifecycle_on_a_stacked_uplink_in_a_guest(guest_pytest: Callable[..., None], stack: str) -> None:
    built = subprocess.run(["make", "-s", "bpf"], cwd=REPO, capture_output=True, text=True)
    assert built.returncode == 0, f"make bpf failed:\n{built.stdout}{built.stderr}"
    guest_pytest(f"-s --durations=0 {SELECTION}", GUEST_TIMEOUT, env={"PYPROXY_LIFECYCLE_STACK": stack})
