"""The BPF connection-tracking table's flow lifecycle, seen from user space: timeouts and expiry.

The programs (bpf/include/pyproxy/ct.h) keep one entry per direction of a flow, each with the flow's state
(abi.CT_ST_*) and the tick of its last packet, and treat an entry idle for longer than its state's timeout
as absent. The timeouts are constants of the loaded programs (.rodata, `CtTimeouts.ticks`); this module
holds their defaults and the per-state timeout the garbage collector applies (`timeout_ticks`, as ct.h).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, fields

from pyproxy.dataplane.bpf import abi


@dataclass(frozen=True)
class CtTimeouts:
    """Idle timeouts of a tracked flow, in seconds, by protocol and state. Defaults follow the node's own
    conntrack as kube-proxy configures it (upstream's flags in brackets) and, where kube-proxy sets
    nothing, the kernel's and Cilium's values."""

    tcp_new: float = 60.0
    """TCP flow whose SYN got no answer yet (kernel: syn_sent 120 s; Cilium: 60 s)."""
    tcp_established: float = 86400.0
    """TCP flow that got a reply [--conntrack-tcp-timeout-established, 24h]."""
    tcp_closing: float = 3600.0
    """TCP flow half-closed by a FIN in one direction [--conntrack-tcp-timeout-close-wait, 1h]."""
    tcp_closed: float = 10.0
    """TCP flow after FINs both ways or a RST, kept for late segments (Cilium: 10 s; kernel: close 10 s).
    A new SYN on the same ports replaces it at once, whatever is left of it."""
    udp_new: float = 30.0
    """UDP flow with no reply yet [--conntrack-udp-timeout; the kernel's udp_timeout, 30 s]."""
    udp_established: float = 120.0
    """UDP flow that got a reply [--conntrack-udp-timeout-stream; the kernel's udp_timeout_stream, 120 s]."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"connection-tracking timeout {f.name} must be positive, not {value!r}")

    def ticks(self, hz: int) -> abi.CtTimeoutTicks:
        """The struct the programs read, at `hz` ticks per second (rounded up, at least one tick)."""
        values = {}
        for f in fields(self):
            n = max(1, int(-(-getattr(self, f.name) * hz // 1)))
            if n > 0xFFFFFFFF:
                raise ValueError(f"connection-tracking timeout {f.name} is too long: {getattr(self, f.name)} s "
                                 f"exceeds 2**32 ticks at {hz} Hz")
            values[f.name] = n
        return abi.CtTimeoutTicks(**values, shortest=min(values.values()))


def timeout_ticks(t: abi.CtTimeoutTicks, proto: int, state: int) -> int:
    """The idle timeout of a FORWARD or REVERSE entry: what `pyproxy_ct_timeout()` in ct.h computes."""
    if proto == socket.IPPROTO_TCP:
        return int({abi.CT_ST_NEW: t.tcp_new, abi.CT_ST_CLOSING: t.tcp_closing,
                    abi.CT_ST_CLOSED: t.tcp_closed}.get(state, t.tcp_established))
    return int(t.udp_new if state == abi.CT_ST_NEW else t.udp_established)

