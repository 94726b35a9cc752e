"""The datapath's clock, seen from user space: ticks (jiffies, bpf_jiffies64() in the programs).

The programs stamp connection-tracking entries and time ClientIP affinity in ticks because reading them is
one inlined load (the nanosecond clocks cost a sixth to a quarter of an established flow, bpf/include/
pyproxy/ct.h). The control plane converts: affinity timeouts go into the services map in ticks, and
`pyproxy inspect` turns last_seen into an idle age.

HZ (ticks per second) is a build option of the kernel (100, 250, 300 or 1000) that no interface states
directly; it follows from the starting value of jiffies, which every kernel since 2.6 sets to wrap 300 s
after boot: jiffies = 2**32 - 300*HZ + HZ*uptime. times(2) returns jiffies in USER_HZ units, so
os.times().elapsed is jiffies/HZ seconds, and 2**32/HZ = elapsed + 300 - uptime.
"""

from __future__ import annotations

import functools
import os
import time

from pyproxy.dataplane.bpf.errors import BpfUnavailable

KERNEL_HZ_VALUES = (100, 250, 300, 1000)


class ClockError(BpfUnavailable):
    """The kernel's tick rate could not be told: the BPF mode could not keep affinity timeouts."""


def hz_from(elapsed: float, uptime: float) -> int:
    """HZ from os.times().elapsed and the uptime (CLOCK_MONOTONIC) read together; ClockError when they fit
    none of the kernel's choices (e.g. inside a time namespace, whose monotonic clock is offset)."""
    span = elapsed + 300.0 - uptime
    if span <= 0:
        raise ClockError(f"jiffies/HZ = {elapsed:.2f} s and uptime {uptime:.2f} s do not fit the kernel's start value")
    measured = 2**32 / span
    best = min(KERNEL_HZ_VALUES, key=lambda hz: abs(hz - measured))
    if abs(best - measured) > 0.01 * best:
        raise ClockError(f"the kernel's tick rate measures {measured:.1f}/s, none of {KERNEL_HZ_VALUES}")
    return best


@functools.cache
def kernel_hz() -> int:
    """Ticks per second of this kernel (read once)."""
    return hz_from(os.times().elapsed, time.monotonic())


def ticks_now() -> int:
    """The current jiffies, to 10 ms (times(2)'s resolution)."""
    return round(os.times().elapsed * kernel_hz())
