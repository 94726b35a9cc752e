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

UDP_STREAM_AFTER = 2.0
"""Seconds after its first packet from which a replied UDP flow's next packet makes it a stream: the kernel's fixed
rule (nf_conntrack_proto_udp.c, stream_ts), so a query's retries and answer stay a single exchange."""

@dataclass(frozen=True)
class CtTimeouts:
    """Idle timeouts of a tracked flow, in seconds, by protocol and state. Defaults follow the node's own
    conntrack as kube-proxy configures it (upstream's flags in brackets) and, where kube-proxy sets
    nothing, the kernel's and Cilium's values."""

    tcp_new: float = 60.0
    """TCP flow whose SYN got no answer yet (kernel: syn_sent 120 s; Cilium: 60 s)."""
    tcp_established: float = 86400.0
    """TCP flow past its handshake (the client's packet after the SYN-ACK seen)
    [--conntrack-tcp-timeout-established, 24h]."""
    tcp_closing: float = 3600.0
    """TCP flow half-closed by a FIN in one direction [--conntrack-tcp-timeout-close-wait, 1h]."""
    tcp_closed: float = 10.0
    """TCP flow after a RST, kept for late segments (Cilium: 10 s; kernel: close 10 s). A new SYN on the same ports
    replaces it at once, whatever is left of it."""
    udp_new: float = 30.0
    """UDP flow with no reply yet, or replied but not yet a stream (a single exchange: a DNS query and its answer)
    [--conntrack-udp-timeout; the kernel's udp_timeout, 30 s]."""
    udp_established: float = 120.0
    """UDP stream: replied, and a packet more than UDP_STREAM_AFTER seconds after the flow began
    [--conntrack-udp-timeout-stream; the kernel's udp_timeout_stream, 120 s]."""
    tcp_syn_recv: float = 60.0
    """TCP flow whose backend answered the SYN but whose client has not yet acknowledged (half open: a SYN flood's
    flows end here) [--bpf-ct-tcp-syn-recv-timeout; kernel: syn_recv 60 s]."""
    tcp_time_wait: float = 120.0
    """TCP flow closed by FINs both ways; an SNATed flow's node port is not given to a new flow before it ends
    (the backend may hold TIME_WAIT on the tuple) unless no other port is free [--bpf-ct-tcp-time-wait-timeout;
    kernel: time_wait 120 s]."""

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
        return abi.CtTimeoutTicks(**values, shortest=min(values.values()),
                                  udp_stream_after=max(1, int(UDP_STREAM_AFTER * hz)))


def timeout_ticks(t: abi.CtTimeoutTicks, proto: int, state: int) -> int:
    """The idle timeout of a FORWARD or REVERSE entry: what `pyproxy_ct_timeout()` in ct.h computes."""
    if proto == socket.IPPROTO_TCP:
        return int({abi.CT_ST_NEW: t.tcp_new, abi.CT_ST_SYN_RECV: t.tcp_syn_recv, abi.CT_ST_CLOSING: t.tcp_closing,
                    abi.CT_ST_TIME_WAIT: t.tcp_time_wait, abi.CT_ST_CLOSED: t.tcp_closed}.get(state, t.tcp_established))
    return int(t.udp_new if state in (abi.CT_ST_NEW, abi.CT_ST_SYN_RECV) else t.udp_established)

