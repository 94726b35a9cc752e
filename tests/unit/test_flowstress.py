"""tests/flowstress.py's pure parts: the SYN it builds, the UDP client's schedule and accounting, the iptables
counters it reads (the clients themselves run in tests/e2e/test_flow_lifecycle_e2e.py and bench/udpsnat.py)."""

from __future__ import annotations

import socket
import struct

import flowstress
import pytest


def _sum16(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def test_the_syn_is_a_well_formed_ipv4_tcp_syn() -> None:
    packet = flowstress.syn_packet("10.200.1.2", "10.200.1.1", 20001, 30181, 12345)
    ip, tcp = packet[:20], packet[20:]
    version_ihl, _, total, _, frag, ttl, proto, _, src, dst = struct.unpack("!BBHHHBBH4s4s", ip)
    assert (version_ihl, total, frag, ttl, proto) == (0x45, len(packet), 0x4000, 64, socket.IPPROTO_TCP)
    assert (socket.inet_ntoa(src), socket.inet_ntoa(dst)) == ("10.200.1.2", "10.200.1.1")
    sport, dport, seq, ack, offset, flags = struct.unpack("!HHIIBB", tcp[:14])
    assert (sport, dport, seq, ack, offset >> 4, flags) == (20001, 30181, 12345, 0, len(tcp) // 4, 0x02)
    assert tcp[20:] == struct.pack("!BBH", 2, 4, 1460)  # MSS
    pseudo = src + dst + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    assert _sum16(pseudo + tcp) == 0xFFFF  # the checksum verifies


def test_the_schedule_sends_each_steps_rate_for_its_seconds() -> None:
    steps = flowstress.parse_schedule("10x2,40x0.5")
    assert steps == [flowstress.Step(10.0, 2.0), flowstress.Step(40.0, 0.5)]
    times = flowstress.send_times(steps)
    assert len(times) == 20 + 20
    assert [k for _, k in times] == [0] * 20 + [1] * 20
    assert times[0] == (0.0, 0) and times[20] == (2.0, 1)
    assert all(a[0] < b[0] for a, b in zip(times, times[1:], strict=False))
    assert times[-1][0] == pytest.approx(2.0 + 19 / 40)


def test_window_accounting_reads_as_percentages() -> None:
    result = {"window_s": 10.0, "windows": [{"start_s": 0.0, "sent": 1000, "answered": 1000},
                                            {"start_s": 10.0, "sent": 1000, "answered": 534},
                                            {"start_s": 20.0, "sent": 0, "answered": 0}]}
    assert flowstress.window_rates(result) == [100.0, 53.4, 100.0]
    assert flowstress.describe_windows(result) == "100/53.4/100 % answered per 10 s window (sent 1000/1000/0)"


def test_rule_counters_are_read_in_order() -> None:
    listing = ("Chain LOST_SYNACK (1 references)\n"
               "    pkts      bytes target     prot opt in     out     source               destination\n"
               "     120     7200 DROP       0    --  *      *       0.0.0.0/0            0.0.0.0/0            "
               "limit: up to 1/hour burst 1 mode srcip-srcport-dstip-dstport\n"
               "       3      180            0    --  *      *       0.0.0.0/0            0.0.0.0/0\n")
    assert flowstress.parse_counters(listing) == [120, 3]
    assert flowstress.counters_argv("INPUT") == ["iptables", "-w", "5", "-nvxL", "INPUT"]
    assert all(argv[:3] == ["iptables", "-w", "5"] for argv in flowstress.iptables_argvs(flowstress.FLOOD_RULES))
