"""clock.hz_from: the kernel's tick rate from the start value jiffies wraps from, 300 s after boot."""

from __future__ import annotations

import pytest

from pyproxy.dataplane.bpf.clock import KERNEL_HZ_VALUES, ClockError, hz_from


@pytest.mark.parametrize("hz", KERNEL_HZ_VALUES)
@pytest.mark.parametrize("uptime", [0.5, 746.1, 86400.0 * 400])
def test_each_configurable_rate_is_told_apart_at_any_uptime(hz: int, uptime: float) -> None:
    jiffies = 2**32 - 300 * hz + int(hz * uptime)  # INITIAL_JIFFIES, then HZ a second
    elapsed = int(jiffies / hz * 100) / 100  # times(2) in USER_HZ (100) units, as os.times() gives it
    assert hz_from(elapsed, uptime + 0.2) == hz  # the two reads a little apart


@pytest.mark.parametrize(("elapsed", "uptime"), [(100.0, 1000.0), (5_000_000.0, 10.0)])
def test_clocks_that_fit_no_kernel_rate_are_an_error(elapsed: float, uptime: float) -> None:
    """E.g. a time namespace offsetting the monotonic clock: guessing would make affinity timeouts wrong."""
    with pytest.raises(ClockError):
        hz_from(elapsed, uptime)
