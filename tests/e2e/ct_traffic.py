"""Traffic for the connection-tracking end-to-end tests (issue 16), run inside a lab namespace as
`python tests/e2e/ct_traffic.py SUBCOMMAND ...`; test_ct_e2e.py imports it for its constants and `run_json`.

    serve --name b1 --port 7070
        TCP and UDP on one port. TCP, one command line per connection:
          `probe`  -> `NAME:PORT PEER_IP:PEER_PORT`      `get N` -> N bytes      `put N` + N bytes -> `got N ok`
        then the server waits for the client to close first, as request/response servers do (HTTP/1.1, Redis):
        TIME_WAIT stays with the client, the backend keeps no socket for the 4-tuple once the client is done.
        UDP: `probe NONCE` -> `NAME:PORT PEER NONCE`; `big N NONCE` + filler -> an N-byte datagram whose first
        line says how long the request was and whether every byte of it arrived intact.
    pair --proto tcp|udp --service IP:PORT --direct IP:PORT --ports 41001,41002,41003
        per source port: one exchange with the Service, then one with the backend directly, from that port
    soak --tcp-service .. --tcp-direct .. --udp-service .. --udp-direct .. --ports 42000-42019 --seconds 15
        the same alternation for a duration, TCP and UDP, over a small source-port range (every port reused)
    get|put IP PORT BYTES      a TCP transfer from / to the server; udp-big IP PORT BYTES: one big datagram

Clients bind their source port with SO_REUSEADDR, as clients that pick their own port do, and close first with
a graceful shutdown (FIN, then read to the server's FIN). A port the kernel refuses (EADDRINUSE, EADDRNOTAVAIL:
the same 4-tuple still in TIME_WAIT) is not the proxy's failure: `soak` counts it and takes the next port.
Every exchange has a timeout; every subcommand prints one JSON object. Stdlib and labkit.traffic only.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from labkit.traffic import READY_LINE, format_reply, parse_reply

SCRIPT = Path(__file__).resolve()
SERVER_IDLE_TIMEOUT = 10.0
CHUNK = 65536
# Period 251 (prime): a byte that lands at the wrong offset shows. Long enough for any CHUNK-sized slice.
_CYCLE = bytes(range(251)) * (CHUNK // 251 + 2)
_REFUSED = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
_TCP_INFO_PMTU, _TCP_INFO_SND_MSS, _TCP_INFO_TOTAL_RETRANS = 60, 16, 100  # offsets in struct tcp_info
IP_MTU = getattr(socket, "IP_MTU", 14)


def filler(offset: int, n: int) -> bytes:
    """Bytes offset..offset+n of the endless test pattern (n <= CHUNK)."""
    phase = offset % 251
    return _CYCLE[phase:phase + n]


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


class PortRefused(OSError):
    """The kernel would not let this socket use its source port (not a dataplane failure)."""


class ExchangeError(Exception):
    """An exchange got no answer, a wrong one, or one from the wrong address; str() is the kind."""


# ---------------------------------------------------------------------------------------------------- server


def _recv_line(sock: socket.socket, deadline: float, limit: int = 256) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("line incomplete")
        sock.settimeout(remaining)
        chunk = sock.recv(1)  # byte by byte: what follows the line (a put's body) stays in the socket
        if not chunk:
            break
        data += chunk
    return data


def _recv_pattern(sock: socket.socket, n: int, deadline: float) -> bool:
    """Read exactly n bytes of the pattern; False if they differ from it, TimeoutError/EOF raise."""
    got, intact = 0, True
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{got} of {n} bytes")
        sock.settimeout(remaining)
        chunk = sock.recv(min(CHUNK, n - got))
        if not chunk:
            raise ConnectionError(f"EOF after {got} of {n} bytes")
        intact = intact and chunk == filler(got, len(chunk))
        got += len(chunk)
    return intact


def _send_pattern(sock: socket.socket, n: int) -> None:
    sent = 0
    while sent < n:
        chunk = filler(sent, min(CHUNK, n - sent))
        sock.sendall(chunk)
        sent += len(chunk)


def _wait_eof(sock: socket.socket, deadline: float) -> None:
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        if not sock.recv(CHUNK):
            return
    raise TimeoutError("no FIN")


def _serve_tcp_connection(name: str, port: int, conn: socket.socket, peer: tuple[str, int]) -> None:
    with conn:
        try:
            deadline = time.monotonic() + SERVER_IDLE_TIMEOUT
            cmd = _recv_line(conn, deadline).split()
            if cmd[:1] == [b"probe"]:
                conn.sendall(format_reply(name, port, peer))
            elif cmd[:1] == [b"get"]:
                _send_pattern(conn, int(cmd[1]))
            elif cmd[:1] == [b"put"]:
                n = int(cmd[1])
                intact = _recv_pattern(conn, n, time.monotonic() + SERVER_IDLE_TIMEOUT * 3)
                conn.sendall(f"got {n} {'ok' if intact else 'corrupt'}\n".encode())
            _wait_eof(conn, time.monotonic() + SERVER_IDLE_TIMEOUT)  # the client closes first
        except (OSError, ValueError, IndexError):
            pass  # resets and half-open connections are what a broken dataplane makes: the client counts them


def _serve_udp(name: str, sock: socket.socket) -> None:
    port = sock.getsockname()[1]
    while True:
        try:
            data, peer = sock.recvfrom(65535)
            head, _, body = data.partition(b"\n")
            fields = head.split()
            if fields[:1] == [b"big"] and len(fields) == 3:
                want, nonce = int(fields[1]), fields[2]
                intact = body == filler(0, len(body)) if len(body) <= CHUNK else False
                line = format_reply(name, port, peer).rstrip(b"\n") + b" got=%d ok=%d %s\n" % (
                    len(data), int(intact), nonce)
                sock.sendto(line + filler(0, max(0, want - len(line))), peer)
            else:
                nonce = fields[1] if len(fields) > 1 else b"-"
                sock.sendto(format_reply(name, port, peer).rstrip(b"\n") + b" " + nonce + b"\n", peer)
        except (OSError, ValueError):
            continue


def serve(name: str, port: int) -> int:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(256)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    threading.Thread(target=_serve_udp, args=(name, udp), daemon=True).start()

    def accept() -> None:
        while True:
            conn, peer = listener.accept()
            threading.Thread(target=_serve_tcp_connection, args=(name, port, conn, peer), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(READY_LINE, flush=True)
    sys.stdin.buffer.read()  # the starter holds stdin open: its end (even by SIGKILL) ends the server
    return 0


# ---------------------------------------------------------------------------------------------------- client


def _bound(kind: int, sport: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("", sport))
    except OSError as exc:
        sock.close()
        if exc.errno in _REFUSED:
            raise PortRefused(exc.errno, f"bind {sport}: {exc.strerror}") from exc
        raise
    return sock


def _kind(exc: BaseException) -> str:
    if isinstance(exc, ExchangeError):
        return str(exc)
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def tcp_exchange(dst: tuple[str, int], sport: int, timeout: float) -> dict[str, Any]:
    """Connect from `sport`, `probe`, read the answer, close first; {"reply": "b1:7070", "seen": "IP:PORT"}.
    PortRefused when the kernel refuses the port, ExchangeError/OSError when the exchange fails."""
    deadline = time.monotonic() + timeout
    with _bound(socket.SOCK_STREAM, sport) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(dst)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise PortRefused(exc.errno, f"connect from {sport}: {exc.strerror}") from exc
            raise
        sock.sendall(b"probe\n")
        line = _recv_line(sock, deadline)
        fields = line.split()
        if parse_reply(line) is None:
            raise ExchangeError("empty" if not line else "garbled")
        sock.shutdown(socket.SHUT_WR)
        _wait_eof(sock, deadline)
    return {"reply": fields[0].decode(), "seen": fields[1].decode()}


def udp_exchange(dst: tuple[str, int], sport: int, timeout: float) -> dict[str, Any]:
    """One datagram from `sport` to dst and its answer, which must come from dst itself (a resolver drops a
    reply from elsewhere); an answer from another address is the failure "wrong-source <addr>"."""
    deadline = time.monotonic() + timeout
    nonce = secrets.token_hex(6).encode()
    with _bound(socket.SOCK_DGRAM, sport) as sock:
        sock.sendto(b"probe " + nonce + b"\n", dst)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer")
            sock.settimeout(remaining)
            data, src = sock.recvfrom(65535)
            fields = data.split()
            if len(fields) == 3 and fields[2] == nonce:
                break  # anything else is a late answer to an earlier datagram from this port
    if src != dst:
        raise ExchangeError(f"wrong-source {src[0]}:{src[1]}")
    return {"reply": fields[0].decode(), "seen": fields[1].decode()}


EXCHANGES: dict[str, Callable[[tuple[str, int], int, float], dict[str, Any]]] = {
    "tcp": tcp_exchange, "udp": udp_exchange}


def attempt(proto: str, dst: tuple[str, int], sport: int, timeout: float) -> dict[str, Any]:
    """One exchange as a JSON-able record: ok, error kind, reply, elapsed; PortRefused propagates."""
    start = time.monotonic()
    record: dict[str, Any] = {"port": sport, "to": f"{dst[0]}:{dst[1]}"}
    try:
        record.update(EXCHANGES[proto](dst, sport, timeout), ok=True)
    except PortRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is a counted result, none may end the run
        record.update(ok=False, error=_kind(exc))
    record["elapsed"] = round(time.monotonic() - start, 4)
    return record


def pair(proto: str, service: tuple[str, int], direct: tuple[str, int], ports: Sequence[int],
         timeout: float) -> dict[str, Any]:
    """Per port: the Service, then the backend directly, from that same port (the issue's reproduction)."""
    results = []
    for port in ports:
        entry: dict[str, Any] = {"port": port}
        for kind, dst in (("service", service), ("direct", direct)):
            try:
                entry[kind] = attempt(proto, dst, port, timeout)
            except PortRefused as exc:
                entry[kind] = {"port": port, "ok": False, "error": f"port refused: {exc.strerror}"}
        results.append(entry)
    return {"proto": proto, "results": results}


def _tw_reuse_delay() -> float:
    """Seconds a TIME_WAIT 4-tuple must age before connect() may reuse it: tcp_tw_reuse_delay with
    tcp_tw_reuse=1, else the whole TIME_WAIT (60 s)."""
    try:
        reuse = int(Path("/proc/sys/net/ipv4/tcp_tw_reuse").read_text())
        delay_ms = int(Path("/proc/sys/net/ipv4/tcp_tw_reuse_delay").read_text())
    except (OSError, ValueError):
        reuse, delay_ms = 0, 1000
    return delay_ms / 1000 if reuse == 1 else 60.0


def soak(targets: dict[str, tuple[tuple[str, int], tuple[str, int]]], ports: Sequence[int], seconds: float,
         timeout: float) -> dict[str, Any]:
    """Alternate Service and direct exchanges, TCP and UDP, from `ports` in turn, for `seconds`.

    Step i takes port i mod len(ports) and runs, from it: TCP to the Service, TCP to the backend, UDP to the
    Service, UDP to the backend. So every port talks to the Service and then directly to the backend (the
    issue's sequence), to the backend and then to the Service again, and reuses each 4-tuple of the step
    before last (a new connection on the tuple of a closed one). A TCP 4-tuple is reused only once its
    TIME_WAIT may be (tcp_tw_reuse_delay); a port the kernel still refuses is counted and the next one taken."""
    gap = _tw_reuse_delay() + 0.005
    keys = [f"{proto}-{kind}" for proto in targets for kind in ("service", "direct")]
    stats = {k: collections.Counter({"attempted": 0, "ok": 0, "failed": 0, "port_reused": 0,
                                     "tuple_reused": 0, "port_refused": 0}) for k in keys}
    errors: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, Any]] = []
    last_used: dict[tuple[str, int, str], float] = {}  # (proto, port, dst) -> when the exchange ended
    ports_used: set[tuple[str, int]] = set()
    waited = 0.0
    start = time.monotonic()
    end = start + seconds
    step = 0
    while time.monotonic() < end:
        for proto, (service, direct) in targets.items():
            for kind, dst in (("service", service), ("direct", direct)):
                key, stat = f"{proto}-{kind}", stats[f"{proto}-{kind}"]
                for offset in range(len(ports)):
                    port = ports[(step + offset) % len(ports)]
                    tup = (proto, port, f"{dst[0]}:{dst[1]}")
                    if proto == "tcp" and tup in last_used:
                        pause = min(last_used[tup] + gap, end) - time.monotonic()
                        if pause > 0:
                            waited += pause
                            time.sleep(pause)
                        if time.monotonic() >= end:
                            break
                    try:
                        record = attempt(proto, dst, port, timeout)
                    except PortRefused:
                        stat["port_refused"] += 1
                        continue
                    stat["attempted"] += 1
                    stat["port_reused"] += (proto, port) in ports_used
                    stat["tuple_reused"] += tup in last_used
                    ports_used.add((proto, port))
                    last_used[tup] = time.monotonic()
                    if record["ok"]:
                        stat["ok"] += 1
                    else:
                        stat["failed"] += 1
                        errors[f"{key} {record['error']}"] += 1
                        if len(failures) < 20:
                            failures.append({"kind": key, "step": step, **record})
                    break
        step += 1
    elapsed = time.monotonic() - start
    total = {k: sum(s[k] for s in stats.values()) for k in ("attempted", "ok", "failed", "port_reused",
                                                             "tuple_reused", "port_refused")}
    return {"seconds": round(elapsed, 2), "steps": step, "ports": len(ports), "total": total,
            "per_kind": {k: dict(v) for k, v in stats.items()}, "errors": dict(errors),
            "first_failures": failures, "rate_per_s": round(total["attempted"] / elapsed, 1),
            "waited_for_time_wait_s": round(waited, 2)}


def _tcp_info(sock: socket.socket) -> dict[str, int]:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    (pmtu,) = struct.unpack_from("I", info, _TCP_INFO_PMTU)
    (snd_mss,) = struct.unpack_from("I", info, _TCP_INFO_SND_MSS)
    (retrans,) = struct.unpack_from("I", info, _TCP_INFO_TOTAL_RETRANS)
    return {"pmtu": pmtu, "snd_mss": snd_mss, "total_retrans": retrans,
            "ip_mtu": sock.getsockopt(socket.IPPROTO_IP, IP_MTU)}


def transfer(direction: str, dst: tuple[str, int], nbytes: int, timeout: float) -> dict[str, Any]:
    """`get`: nbytes from the server; `put`: nbytes to it. Ok when all arrived intact within `timeout`."""
    start = time.monotonic()
    deadline = start + timeout
    result: dict[str, Any] = {"direction": direction, "bytes": nbytes, "ok": False, "stage": "connect"}
    try:
        with socket.create_connection(dst, timeout=timeout) as sock:
            result["stage"] = "transfer"
            sock.sendall(f"{direction} {nbytes}\n".encode())
            if direction == "get":
                intact = _recv_pattern(sock, nbytes, deadline)
            else:
                _send_pattern(sock, nbytes)
                intact = _recv_line(sock, deadline).split() == [b"got", str(nbytes).encode(), b"ok"]
            result.update(tcp_info=_tcp_info(sock), stage="close")
            sock.shutdown(socket.SHUT_WR)
            _wait_eof(sock, deadline)
        result.update(ok=intact, stage="done")
        if not intact:
            result["error"] = "corrupt"
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        result["error"] = f"{_kind(exc)}: {exc}"
    result["elapsed"] = round(time.monotonic() - start, 3)
    return result


def udp_big(dst: tuple[str, int], nbytes: int, count: int, timeout: float) -> dict[str, Any]:
    """`count` datagrams of nbytes to dst, each answered by an nbytes datagram; both must arrive whole."""
    outcomes = []
    for _ in range(count):
        nonce = secrets.token_hex(6).encode()
        head = b"big %d %s\n" % (nbytes, nonce)
        request = head + filler(0, nbytes - len(head))
        outcome: dict[str, Any] = {"ok": False}
        start = time.monotonic()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(request, dst)
                while True:
                    sock.settimeout(max(0.01, start + timeout - time.monotonic()))
                    data, src = sock.recvfrom(65535)
                    line, _, body = data.partition(b"\n")
                    if line.split()[-1:] == [nonce]:
                        break
                fields = line.split()
                outcome.update(reply=fields[0].decode(), request_seen=fields[2].decode(), reply_bytes=len(data),
                               reply_from=f"{src[0]}:{src[1]}")
                outcome["ok"] = (src == dst and fields[2:4] == [b"got=%d" % nbytes, b"ok=1"]
                                 and len(data) == nbytes and body == filler(0, len(body)))
            except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
                outcome["error"] = _kind(exc)
        outcome["elapsed"] = round(time.monotonic() - start, 3)
        outcomes.append(outcome)
    return {"bytes": nbytes, "datagrams": outcomes, "ok": all(o["ok"] for o in outcomes)}


# ---------------------------------------------------------------------------------------------------- CLI


def port_list(text: str) -> list[int]:
    """`41001,41002` or `42000-42019`."""
    ports: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        ports += range(int(lo), int(hi or lo) + 1)
    return ports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ct_traffic.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--name", required=True)
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("pair")
    p.add_argument("--proto", choices=sorted(EXCHANGES), required=True)
    p.add_argument("--service", type=address, required=True)
    p.add_argument("--direct", type=address, required=True)
    p.add_argument("--ports", type=port_list, required=True)
    p.add_argument("--timeout", type=float, default=3.0)
    p = sub.add_parser("soak")
    for proto in EXCHANGES:
        p.add_argument(f"--{proto}-service", type=address, required=True)
        p.add_argument(f"--{proto}-direct", type=address, required=True)
    p.add_argument("--ports", type=port_list, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--timeout", type=float, default=1.0)
    for name in ("get", "put", "udp-big"):
        p = sub.add_parser(name)
        p.add_argument("dst", type=address, metavar="IP:PORT")
        p.add_argument("bytes", type=int)
        p.add_argument("--timeout", type=float, default=30.0)
        p.add_argument("--count", type=int, default=3)
    args = parser.parse_args(argv)

    result: dict[str, Any]
    if args.cmd == "serve":
        return serve(args.name, args.port)
    if args.cmd == "pair":
        result = pair(args.proto, args.service, args.direct, args.ports, args.timeout)
    elif args.cmd == "soak":
        targets = {proto: (getattr(args, f"{proto}_service"), getattr(args, f"{proto}_direct"))
                   for proto in EXCHANGES}
        result = soak(targets, args.ports, args.seconds, args.timeout)
    elif args.cmd == "udp-big":
        result = udp_big(args.dst, args.bytes, args.count, args.timeout)
    else:
        result = transfer(args.cmd, args.dst, args.bytes, args.timeout)
    print(json.dumps(result))
    return 0


def run_json(lab: Any, ns: str, *args: str, timeout: float) -> dict[str, Any]:
    """Run this script's subcommand `args` inside `ns` (bounded by `timeout`); its JSON result."""
    out = lab.python(ns, str(SCRIPT), *args, timeout=timeout).stdout
    result: dict[str, Any] = json.loads(out)
    return result


if __name__ == "__main__":
    sys.exit(main())
