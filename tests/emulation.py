"""Time bounds for tests that also run under CPU emulation: the qemu guest (TCG, tests/guest/run.py) runs the same
code 10-50x slower than the host, so a bound measured on the host is scaled there. guest_pytest
(tests/e2e/conftest.py) sets PYPROXY_TEST_EMULATED=1 in the guest."""

from __future__ import annotations

import os

EMULATED = bool(os.environ.get("PYPROXY_TEST_EMULATED"))
"""The tests run under CPU emulation (the qemu guest)."""
SLOWDOWN = 10.0
"""How much longer a bound is under emulation: starting pyproxy (its BPF objects verified, its first sync) and the
lab's Python servers took more than 20 s there where the host takes 1-3 (an earlier guest run of the stacked-devices
test failed on the lab's 20 s wait for /healthz)."""


def bound(seconds: float) -> float:
    """`seconds`, the host's bound, or SLOWDOWN times it under emulation."""
    return seconds * SLOWDOWN if EMULATED else seconds
