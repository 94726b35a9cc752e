"""Clients that stress a flow table (issue 25; /work/shared/notes/real-node-layout.md, "Clients that stress a flow
table"), run inside a lab namespace as `python tests/flowstress.py SUBCOMMAND ...`. The end-to-end tests
(tests/e2e/test_flow_lifecycle_e2e.py) and the bench (bench/udpsnat.py) import it for `run_json`, the iptables
rules that make a namespace lose packets, and the per-window accounting.

    connect IP PORT --count 60 --hold 1.5
        COUNT TCP connections at once, each: connect, ask, wait HOLD seconds, ask again, close first (FIN, then
        read to the server's FIN). A connection is whole when both answers came, from the same backend, and it
        ended without a reset. With LOST_SYNACK_RULES in the namespace, each connection's first SYN-ACK is lost
        and its connect() takes the SYN's retransmission (about 1 s): `retransmitted` counts those.
    syn-flood IP PORT --count 5000 --first-port 20000 --rate 2500
        COUNT SYNs from distinct source ports through a raw socket, paced, never completed: the namespace must
        drop the SYN-ACKs (FLOOD_RULES), or its kernel would answer them with resets.
    udp-paced IP PORT --rate 100 --seconds 60 [--schedule 25x10,50x10,...] --first-port 10000
        single UDP exchanges (one query, one answer: a DNS client behind a NAT), each from a fresh source port
        never used before in the run, sent on a fixed schedule (late sends catch up at once: the count is the
        schedule's); every query is accounted to the WINDOW-second window and the schedule step it was sent in.

The servers are the lab's (labkit.traffic serve): a TCP connection is answered `NAME:PORT PEER` per
request and closed after the client's FIN; a UDP datagram is answered with the same line. Every subcommand
prints one JSON object; everything is bounded in time. Stdlib and labkit.traffic only.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import selectors
import signal
import socket
import statistics
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.traffic import REQUEST, parse_reply
from labkit.traffic import _classify as _kind  # timeout, reset, refused, unreachable, ECONNREFUSED ...

SCRIPT = Path(__file__).resolve()

LOST_SYNACK_CHAIN = "LOST_SYNACK"
LOST_SYNACK_RULES = (
    ("-N", LOST_SYNACK_CHAIN),
    ("-A", "INPUT", "-p", "tcp", "--tcp-flags", "SYN,ACK", "SYN,ACK", "-j", LOST_SYNACK_CHAIN),
    # One token per 4-tuple and hour: the tuple's first SYN-ACK takes it and is dropped, every later one passes.
    ("-A", LOST_SYNACK_CHAIN, "-m", "hashlimit", "--hashlimit-name", "lostsynack",
     "--hashlimit-mode", "srcip,srcport,dstip,dstport", "--hashlimit-upto", "1/hour", "--hashlimit-burst", "1",
     "--hashlimit-htable-expire", "3600000", "-j", "DROP"),
)
"""iptables rules (each an argv tail) that drop each connection's first SYN-ACK, exactly once, in the namespace
they are added to. `counters(LOST_SYNACK_CHAIN)` afterwards: [SYN-ACKs dropped]; the INPUT rule counts them all."""

FLOOD_RULES = (
    ("-A", "INPUT", "-p", "tcp", "--tcp-flags", "SYN,ACK", "SYN,ACK", "-j", "DROP"),
    ("-A", "INPUT", "-p", "tcp", "-j", "DROP"),
)
"""iptables rules for a namespace that floods: every SYN-ACK (counted by the first rule) and any other TCP packet is
dropped before its kernel sees it, so nothing of the flood is ever answered or reset."""


def iptables_argvs(rules: Sequence[Sequence[str]]) -> list[list[str]]:
    """The commands that add `rules` (LOST_SYNACK_RULES, FLOOD_RULES), for `lab.exec(ns, *argv)`."""
    return [["iptables", "-w", "5", *rule] for rule in rules]


def parse_counters(listing: str) -> list[int]:
    """The packet counter of each rule in `iptables -nvxL CHAIN` output, in order."""
    lines = listing.splitlines()[2:]  # "Chain ..." and the column heads
    return [int(line.split()[0]) for line in lines if line.strip()]


def counters_argv(chain: str) -> list[str]:
    return ["iptables", "-w", "5", "-nvxL", chain]


def run_json(lab: Any, ns: str, *args: str, timeout: float) -> dict[str, Any]:
    """This script's subcommand `args` inside `ns` (a Lab's namespace, bounded by `timeout`); its JSON result."""
    out = lab.python(ns, str(SCRIPT), *args, timeout=timeout).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


# ---------------------------------------------------------------------------------------------- connect


class Broken(Exception):
    """A connection that did not talk to one backend end to end; str() is the kind."""


def _ask(sock: socket.socket, reader: Any, deadline: float) -> tuple[str, str]:
    """One request's answer, read through `reader` (the socket's makefile): (`NAME:PORT` of the backend, the
    source address it saw)."""
    sock.sendall(REQUEST)
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    line = reader.readline(256)
    if not line.endswith(b"\n"):
        raise Broken("closed" if not line else "cut")
    parsed = parse_reply(line)
    if parsed is None:
        raise Broken("garbled")
    return parsed


def one_connection(ip: str, port: int, hold: float, timeout: float) -> dict[str, Any]:
    """Connect, ask, wait `hold`, ask again, close first and read to the server's FIN: a record of it."""
    record: dict[str, Any] = {"ok": False}
    start = time.monotonic()
    deadline = start + timeout + hold
    try:
        with socket.create_connection((ip, port), timeout=timeout) as sock, sock.makefile("rb") as reader:
            record["connect_s"] = round(time.monotonic() - start, 3)
            record["port"] = sock.getsockname()[1]
            first, record["seen"] = _ask(sock, reader, deadline)
            record["backend"] = first
            time.sleep(hold)
            second, _ = _ask(sock, reader, deadline)
            if second != first:
                raise Broken(f"answered by {first}, then by {second}")
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if reader.read():
                raise Broken("more than the answers")
            record["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is a counted result
        record["error"] = str(exc) if isinstance(exc, Broken) else _kind(exc)
    return record


def connect_many(ip: str, port: int, count: int, hold: float, timeout: float) -> dict[str, Any]:
    """`count` connections (one_connection) at once; a summary, with the failed ones."""
    records: list[dict[str, Any]] = [{} for _ in range(count)]

    def go(i: int) -> None:
        records[i] = one_connection(ip, port, hold, timeout)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    connect = [r["connect_s"] for r in records if "connect_s" in r]
    return {"target": f"{ip}:{port}", "count": count, "whole": sum(1 for r in records if r["ok"]),
            "errors": dict(Counter(r["error"] for r in records if not r["ok"])),
            "backends": dict(sorted(Counter(r["backend"] for r in records if r["ok"]).items())),
            "seen_from": dict(Counter(r["seen"] for r in records if r["ok"])),
            "connect_s": _spread(connect), "retransmitted": sum(1 for c in connect if c >= 0.9),
            "failed": [r for r in records if not r["ok"]][:5]}


# ---------------------------------------------------------------------------------------------- syn-flood


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def syn_packet(src: str, dst: str, sport: int, dport: int, seq: int) -> bytes:
    """An IPv4 TCP SYN with an MSS option, checksums filled (the kernel fills the IP header's, IP_HDRINCL)."""
    saddr, daddr = socket.inet_aton(src), socket.inet_aton(dst)
    options = struct.pack("!BBH", 2, 4, 1460)
    offset = (20 + len(options)) // 4
    header = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, offset << 4, 0x02, 64240, 0, 0) + options
    pseudo = saddr + daddr + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(header))
    tcp = header[:16] + struct.pack("!H", _checksum(pseudo + header)) + header[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), random.getrandbits(16), 0x4000, 64,
                     socket.IPPROTO_TCP, 0, saddr, daddr)
    return ip + tcp


def source_for(ip: str, port: int) -> str:
    """The address this namespace's routing sends from toward ip:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port))
        return str(probe.getsockname()[0])


def syn_flood(ip: str, port: int, count: int, first_port: int, rate: float, source: str = "") -> dict[str, Any]:
    """`count` SYNs to ip:port from source ports first_port.. (one each), `rate` a second in 10-ms batches."""
    if first_port + count - 1 > 65535:
        raise ValueError(f"{count} source ports from {first_port} run past 65535")
    src = source or source_for(ip, port)
    per_batch = max(1, round(rate / 100))
    start = time.monotonic()
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
        for i in range(count):
            if i % per_batch == 0:
                pause = start + (i / per_batch) * 0.01 - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
            raw.sendto(syn_packet(src, ip, first_port + i, port, random.getrandbits(32)), (ip, 0))
    return {"target": f"{ip}:{port}", "source": src, "sent": count, "ports": [first_port, first_port + count - 1],
            "seconds": round(time.monotonic() - start, 3)}


# ---------------------------------------------------------------------------------------------- udp-paced


@dataclass(frozen=True)
class Step:
    rate: float
    """Exchanges a second."""
    seconds: float


def parse_schedule(text: str) -> list[Step]:
    """`25x10,50x10`: 25 a second for 10 s, then 50 a second for 10 s."""
    steps = []
    for item in text.split(","):
        rate, _, seconds = item.strip().partition("x")
        steps.append(Step(float(rate), float(seconds)))
    return steps


def send_times(steps: Sequence[Step]) -> list[tuple[float, int]]:
    """(offset from the start, step index) of every query of the schedule, in order."""
    out: list[tuple[float, int]] = []
    begin = 0.0
    for k, step in enumerate(steps):
        out += [(begin + i / step.rate, k) for i in range(int(round(step.rate * step.seconds)))]
        begin += step.seconds
    return out


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard) if hard != resource.RLIM_INFINITY
                                                    else wanted, hard))


def udp_paced(ip: str, port: int, steps: Sequence[Step], timeout: float = 2.0, first_port: int = 10000,
              last_port: int = 65000, window: float = 10.0, source: str = "") -> dict[str, Any]:
    """Single exchanges on the schedule `steps`, each from the next source port of first_port..last_port (skipping
    one the kernel refuses), answered when a well-formed answer comes from ip:port itself (a connected socket:
    a reply that escaped the reverse translation is dropped, as a resolver drops it) within `timeout`.
    The result: per window and per step sent/answered, why the others failed, who answered, pacing."""
    times = send_times(steps)
    if len(times) > last_port - first_port + 1:
        raise ValueError(f"{len(times)} exchanges need more fresh ports than {first_port}-{last_port}")
    most = max(s.rate for s in steps) * timeout
    _raise_fd_limit(int(most * 1.5) + 256)
    n_windows = int(sum(s.seconds for s in steps) / window + 0.999)
    w_sent, w_answered = [0] * n_windows, [0] * n_windows
    s_sent, s_answered = [0] * len(steps), [0] * len(steps)
    errors: Counter[str] = Counter()
    backends: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    late: list[float] = []
    refused_ports = 0
    sel = selectors.DefaultSelector()
    pending: dict[int, tuple[socket.socket, int, int]] = {}  # fd -> (socket, window, step)
    expiry: deque[tuple[float, int, socket.socket]] = deque()  # (deadline, fd, socket), in send order
    next_port = first_port
    start = time.monotonic()

    def finish(fd: int, outcome: str | None, answer: tuple[str, str] | None = None) -> None:
        sock, w, k = pending.pop(fd)
        sel.unregister(sock)
        sock.close()
        if outcome is None and answer is not None:
            w_answered[w] += 1
            s_answered[k] += 1
            backends[answer[0]] += 1
            seen[answer[1]] += 1
        else:
            errors[outcome or "garbled"] += 1

    i = 0
    while i < len(times) or pending:
        now = time.monotonic()
        while i < len(times) and start + times[i][0] <= now:
            offset, k = times[i]
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            while True:
                if next_port > last_port:
                    raise RuntimeError(f"ran out of fresh source ports at {last_port}")
                try:
                    sock.bind((source, next_port))
                    break
                except OSError:
                    refused_ports += 1
                finally:
                    next_port += 1
            sock.setblocking(False)
            sock.connect((ip, port))
            w = min(int(offset / window), n_windows - 1)
            try:
                sock.send(REQUEST)
            except OSError as exc:
                sock.close()
                errors[f"send: {_kind(exc)}"] += 1
            else:
                pending[sock.fileno()] = (sock, w, k)
                sel.register(sock, selectors.EVENT_READ)
                expiry.append((now + timeout, sock.fileno(), sock))
            w_sent[w] += 1
            s_sent[k] += 1
            late.append(now - (start + offset))
            i += 1
        while expiry and expiry[0][0] <= now:
            _, fd, sock = expiry.popleft()
            if fd in pending and pending[fd][0] is sock:
                finish(fd, "timeout")
        waits = [expiry[0][0] - now] if expiry else []
        if i < len(times):
            waits.append(start + times[i][0] - now)
        for key, _ in sel.select(max(0.0, min(waits)) if waits else 0.0):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(2048)
            except OSError as exc:
                finish(sock.fileno(), _kind(exc))
                continue
            parsed = parse_reply(data)
            finish(sock.fileno(), None if parsed else "garbled", parsed)
    elapsed = time.monotonic() - start
    late.sort()
    return {
        "target": f"{ip}:{port}", "sent": len(times), "answered": sum(w_answered), "errors": dict(errors),
        "window_s": window,
        "windows": [{"start_s": round(j * window, 3), "sent": s, "answered": a}
                    for j, (s, a) in enumerate(zip(w_sent, w_answered, strict=True))],
        "steps": [{"rate": st.rate, "seconds": st.seconds, "sent": s, "answered": a}
                  for st, s, a in zip(steps, s_sent, s_answered, strict=True)],
        "backends": dict(sorted(backends.items())), "seen_from": dict(seen),
        "ports": [first_port, next_port - 1], "ports_refused": refused_ports,
        "late_ms": {"p50": round(1000 * late[len(late) // 2], 2) if late else 0.0,
                    "p99": round(1000 * late[int(len(late) * 0.99)], 2) if late else 0.0,
                    "max": round(1000 * late[-1], 2) if late else 0.0},
        "seconds": round(elapsed, 3),
    }


def answered_pct(sent: int, answered: int) -> float:
    return 100.0 * answered / sent if sent else 100.0


def window_rates(result: dict[str, Any]) -> list[float]:
    """udp-paced's answered share per window, in %."""
    return [answered_pct(w["sent"], w["answered"]) for w in result["windows"]]


def describe_windows(result: dict[str, Any]) -> str:
    """`100/100/99.8/53.4 % answered per 10 s window (sent 1000/1000/1000/1000)`."""
    rates = "/".join(f"{r:.4g}" for r in window_rates(result))
    sent = "/".join(str(w["sent"]) for w in result["windows"])
    return f"{rates} % answered per {result['window_s']:g} s window (sent {sent})"


# ---------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/flowstress.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_conn = sub.add_parser("connect", help="TCP connections at once, each asked twice and closed")
    p_conn.add_argument("ip")
    p_conn.add_argument("port", type=int)
    p_conn.add_argument("--count", type=int, default=60)
    p_conn.add_argument("--hold", type=float, default=1.5, help="seconds between a connection's two requests")
    p_conn.add_argument("--timeout", type=float, default=10.0, help="seconds a connection may take, but --hold")
    p_flood = sub.add_parser("syn-flood", help="SYNs from distinct source ports, never completed (raw socket)")
    p_flood.add_argument("ip")
    p_flood.add_argument("port", type=int)
    p_flood.add_argument("--count", type=int, default=5000)
    p_flood.add_argument("--first-port", type=int, default=20000)
    p_flood.add_argument("--rate", type=float, default=2500.0, help="SYNs a second")
    p_flood.add_argument("--source", default="", help="source address (default: the route's)")
    p_udp = sub.add_parser("udp-paced", help="single UDP exchanges from fresh source ports, paced")
    p_udp.add_argument("ip")
    p_udp.add_argument("port", type=int)
    p_udp.add_argument("--rate", type=float, default=100.0, help="exchanges a second")
    p_udp.add_argument("--seconds", type=float, default=60.0)
    p_udp.add_argument("--schedule", type=parse_schedule, default=None,
                       help="RATExSECONDS,... steps instead of --rate/--seconds")
    p_udp.add_argument("--timeout", type=float, default=2.0, help="seconds an answer may take")
    p_udp.add_argument("--first-port", type=int, default=10000)
    p_udp.add_argument("--last-port", type=int, default=65000)
    p_udp.add_argument("--window", type=float, default=10.0, help="seconds of an accounting window")
    p_udp.add_argument("--source", default="", help="source address (default: the route's)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.cmd == "connect":
        result = connect_many(args.ip, args.port, args.count, args.hold, args.timeout)
    elif args.cmd == "syn-flood":
        result = syn_flood(args.ip, args.port, args.count, args.first_port, args.rate, args.source)
    else:
        steps = args.schedule or [Step(args.rate, args.seconds)]
        result = udp_paced(args.ip, args.port, steps, args.timeout, args.first_port, args.last_port, args.window,
                           args.source)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
