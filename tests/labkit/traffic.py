"""Real traffic for the lab: a backend server, a probing client and an HTTP checker.

Run inside a namespace as `python -m labkit.traffic SUBCOMMAND ...`:

    serve --name b1 --tcp 8080,9090 --udp 5353     answer every TCP connection / UDP datagram
    probe --tcp 10.96.0.10 80 --count 60           one NEW connection (new source port) per request
    probe --udp 10.96.0.53 53 --count 60           one NEW socket per datagram
    probe --tcp 10.96.0.10 80 --sources 10.200.0.2,10.200.0.3 --source-ports 40001,40002
                                                   ... from these addresses and ports in turn
    hold 10.96.0.10 80 --count 6                   open connections and keep them (see `hold`)
    talk 10.96.0.10:80,10.200.0.1:30080 --count 20 --interval 0.1
                                                   long-lived connections exchanging a line each 100 ms
    http http://127.0.0.1:10256/healthz --wait 20 --expect 200

Every reply is one line, `NAME:PORT PEER_IP:PEER_PORT`: the backend's name, the port the request reached it on
(after DNAT, so a multi-port service shows which targetPort it was mapped to) and the source address the
backend saw (so a test can tell whether the client's address survived the NAT). An HTTP GET gets the same line
as the body of an HTTP/1.0 response.

Everything here is bounded in time: each request has its own timeout and a probe run has an overall deadline,
so a broken dataplane shows up as counted failures, never as a hang. The server is quiet: it never prints
tracebacks for the misbehaving peers a broken dataplane produces.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypedDict

# Printed by `serve` once every socket is bound, so whoever started it knows when probing can begin.
READY_LINE = "ready"
# How long a server waits for a client's request bytes before giving up on that connection.
SERVER_REQUEST_TIMEOUT = 5.0
# ... and for a held connection's next request.
SERVER_HOLD_TIMEOUT = 60.0
REQUEST = b"probe\n"


class ProbeResult(TypedDict):
    """What `probe` prints (as JSON) and `Lab.probe` returns."""

    replies: dict[str, int]
    """`NAME:PORT` of the answering backend -> number of requests it answered."""
    failures: int
    """Requests without a well-formed reply."""
    errors: dict[str, int]
    """Why requests failed: timeout, refused, reset, unreachable, empty, deadline, ..."""
    seen_from: dict[str, int]
    """The source IPs the backends reported seeing -> count (the client's own IP unless something SNATs)."""
    by_source: dict[str, dict[str, int]]
    """With sources or source ports given: `ADDRESS` (`ADDRESS:PORT` with source ports) -> `NAME:PORT` of the
    backends that answered requests from there -> count (failed requests under "failed")."""
    count: int
    elapsed: float


class HttpResult(TypedDict):
    status: int | None
    body: str
    error: str | None
    elapsed: float


def format_reply(name: str, port: int, peer: tuple[str, int]) -> bytes:
    return f"{name}:{port} {peer[0]}:{peer[1]}\n".encode()


def parse_reply(data: bytes) -> tuple[str, str] | None:
    """(`NAME:PORT`, peer IP) from a reply line, or None when it is not one of ours."""
    fields = data.decode(errors="replace").split()
    if len(fields) != 2 or ":" not in fields[0] or ":" not in fields[1]:
        return None
    return fields[0], fields[1].rsplit(":", 1)[0]


# ---------------------------------------------------------------------------------------------------- server


class _QuietTCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    # Probes open connections back to back; a deep backlog keeps a slow Python accept loop from dropping SYNs.
    request_queue_size = 256

    def __init__(self, name: str, address: tuple[str, int]) -> None:
        self.name = name
        super().__init__(address, _TCPHandler)

    def handle_error(self, request: object, client_address: object) -> None:
        # Resets and half-open connections are what a broken dataplane produces; the client counts them.
        pass


class _QuietTCPServer6(_QuietTCPServer):
    """On an IPv6 address, IPv6 only: the IPv4 server beside it keeps answering IPv4 with IPv4 peers (not
    ::ffff:-mapped ones), so who connected reads the same in both families."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


class _TCPHandler(socketserver.BaseRequestHandler):
    server: _QuietTCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(SERVER_REQUEST_TIMEOUT)
        reply = format_reply(self.server.name, self.server.server_address[1], self.client_address)
        try:
            # Wait for the request so the reply proves data crossed the forward path, not just the handshake;
            # answer each later one too, so a client can hold the connection (across a proxy restart, say).
            data = sock.recv(1024)
            if data.startswith(HTTP_METHODS):
                _answer_http(sock, data, reply)
                return
            while data:
                sock.sendall(reply)
                sock.settimeout(SERVER_HOLD_TIMEOUT)
                data = sock.recv(1024)
        except OSError:
            pass


# An HTTP request gets the same line as an HTTP/1.0 response, so curl, kubelet's httpGet probes and a user's
# browser can ask a lab pod too.
HTTP_METHODS = (b"GET ", b"HEAD ")
HTTP_HEADER_LIMIT = 16 << 10


def _answer_http(sock: socket.socket, data: bytes, reply: bytes) -> None:
    # Read the whole header first: closing with unread request bytes would reset the connection instead of
    # ending it, and the client could lose the response.
    while b"\r\n\r\n" not in data and len(data) < HTTP_HEADER_LIMIT:
        more = sock.recv(4096)
        if not more:
            break
        data += more
    head = (f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(reply)}\r\n"
            "Connection: close\r\n\r\n").encode()
    sock.sendall(head if data.startswith(b"HEAD ") else head + reply)


def _serve_udp(name: str, sock: socket.socket) -> None:
    port = sock.getsockname()[1]
    while True:
        try:
            _, peer = sock.recvfrom(2048)
            sock.sendto(format_reply(name, port, peer), peer)
        except OSError:
            # ICMP errors from earlier sends surface here (ECONNREFUSED etc.); keep serving.
            continue


def serve(name: str, tcp_ports: Sequence[int], udp_ports: Sequence[int], bind: str = "0.0.0.0",
          exit_on_stdin_eof: bool = False, bind6: str | None = None) -> int:
    """Answer on `bind` (IPv4) and, given `bind6`, on that IPv6 address too (IPv6 only there)."""
    # Bind everything before announcing readiness, so a port clash is an error the starter sees, not a hang.
    tcp_servers = [_QuietTCPServer(name, (bind, port)) for port in tcp_ports]
    tcp_servers += [_QuietTCPServer6(name, (bind6, port)) for port in tcp_ports if bind6 is not None]
    udp_socks = []
    for address in (bind, *([bind6] if bind6 is not None else [])):
        for port in udp_ports:
            sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if ":" in address:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address, port))
            udp_socks.append(sock)
    for server in tcp_servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    for sock in udp_socks:
        threading.Thread(target=_serve_udp, args=(name, sock), daemon=True).start()

    print(READY_LINE, flush=True)
    if exit_on_stdin_eof:
        # The starter holds our stdin open; when it dies (even by SIGKILL) we see EOF and go, leaving nothing.
        sys.stdin.buffer.read()
    else:
        threading.Event().wait()
    return 0


# ---------------------------------------------------------------------------------------------------- client


def _classify(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def _read_line(sock: socket.socket, end: float) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("reply incomplete")
        sock.settimeout(remaining)
        chunk = sock.recv(1024)
        if not chunk:
            break
        data += chunk
    return data


def _reset_on_close(sock: socket.socket) -> None:
    """Make close() send a reset: the socket leaves no TIME_WAIT behind, so the same source port can open the
    next connection to the same destination at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _tcp_request(ip: str, port: int, timeout: float, source: tuple[str, int] | None = None) -> bytes:
    end = time.monotonic() + timeout
    # A fresh socket per request: a new source port (unless one is given), so every request is a new flow for
    # the load balancer.
    with socket.create_connection((ip, port), timeout=timeout, source_address=source) as sock:
        if source is not None and source[1]:
            _reset_on_close(sock)
        sock.sendall(REQUEST)
        return _read_line(sock, end)


def _udp_request(ip: str, port: int, timeout: float, source: tuple[str, int] | None = None) -> bytes:
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        if source is not None:
            sock.bind(source)
        # connect() makes the kernel drop replies whose source is not ip:port, as a real resolver would: a
        # reply that escaped reverse NAT (source = backend IP) is a failure; ICMP port unreachable: "refused".
        sock.connect((ip, port))
        sock.settimeout(timeout)
        sock.send(REQUEST)
        return sock.recv(2048)


def probe(proto: str, ip: str, port: int, count: int, timeout: float = 1.0, deadline: float = 60.0,
          interval: float = 0.0, max_failures: int | None = None, sources: Sequence[str] = (),
          source_ports: Sequence[int] = ()) -> ProbeResult:
    """`count` requests; with `max_failures`, the run stops once that many failed (a caller that must see every
    flow answered need not wait out the timeouts of all the others: what was seen so far is returned).
    Request i comes from sources[i % len(sources)] (default: the address the route picks) and from
    source_ports[(i // len(sources)) % len(source_ports)] (default or 0: a fresh port): every address, then
    every address again from the next port; a TCP connection from a given port ends with a reset."""
    request = _tcp_request if proto == "tcp" else _udp_request
    replies: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    seen_from: Counter[str] = Counter()
    by_source: dict[str, Counter[str]] = {}
    start = time.monotonic()
    for i in range(count):
        if time.monotonic() - start > deadline:
            errors["deadline"] += count - i
            break
        source = None
        if sources or source_ports:
            address = sources[i % len(sources)] if sources else "0.0.0.0"
            sport = source_ports[(i // max(1, len(sources))) % len(source_ports)] if source_ports else 0
            source = (address, sport)
        answer = "failed"
        try:
            parsed = parse_reply(request(ip, port, timeout, source))
        except Exception as exc:  # noqa: BLE001 - every failure is counted by kind, none may end the run
            errors[_classify(exc)] += 1
        else:
            if parsed is None:
                errors["empty"] += 1
            else:
                replies[parsed[0]] += 1
                seen_from[parsed[1]] += 1
                answer = parsed[0]
        if source is not None:
            key = f"{source[0]}:{source[1]}" if source_ports else source[0]
            by_source.setdefault(key, Counter())[answer] += 1
        if max_failures is not None and sum(errors.values()) >= max_failures:
            break
        if interval:
            time.sleep(interval)
    return ProbeResult(replies=dict(sorted(replies.items())), failures=sum(errors.values()),
                       errors=dict(errors), seen_from=dict(seen_from),
                       by_source={k: dict(sorted(v.items())) for k, v in sorted(by_source.items())}, count=count,
                       elapsed=round(time.monotonic() - start, 3))


def hold(ip: str, port: int, count: int, timeout: float = 5.0) -> int:
    """Open `count` TCP connections to ip:port one after the other and keep them open (a load that lasts, as
    the least-connection schedulers weigh it): print, as one JSON line, the `NAME:PORT` that answered each
    (null for one that failed). Then per stdin line `keep NAME:PORT`, close (reset) every connection that
    another backend holds, and print the ones kept; at stdin's end reset them all. Each held connection is
    asked once more before it is reported kept, so a kept one is proven still open."""
    held: list[tuple[socket.socket, str]] = []
    answers: list[str | None] = []
    for _ in range(count):
        try:
            sock = socket.create_connection((ip, port), timeout=timeout)
        except OSError:
            answers.append(None)
            continue
        _reset_on_close(sock)
        try:
            sock.sendall(REQUEST)
            parsed = parse_reply(_read_line(sock, time.monotonic() + timeout))
        except OSError:
            parsed = None
        if parsed is None:
            sock.close()
            answers.append(None)
            continue
        held.append((sock, parsed[0]))
        answers.append(parsed[0])
    print(json.dumps(answers), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] != ["keep"] or len(words) != 2:
            continue
        for sock, name in held:
            if name != words[1]:
                sock.close()
        kept = []
        for sock, name in held:
            if name == words[1]:
                try:
                    sock.sendall(REQUEST)
                    parsed = parse_reply(_read_line(sock, time.monotonic() + timeout))
                except OSError:
                    parsed = None
                kept.append(parsed[0] if parsed else None)
        held = [(sock, name) for sock, name in held if name == words[1]]
        print(json.dumps(kept), flush=True)
    for sock, _ in held:
        sock.close()
    return 0


def talk(targets: Sequence[tuple[str, int]], count: int, interval: float = 0.1, timeout: float = 3.0) -> int:
    """Long-lived connections: `count` TCP connections over `targets` in turn, each asked once at once (printed:
    a JSON line `{"opened": N, "failed": [...]}`), then asked again every `interval` seconds until stdin ends.
    A connection is broken when an exchange fails (no reply within `timeout`, a reset) or another backend or
    source answers (the reply line changed: it went elsewhere after a NAT change). At stdin's end one JSON
    line: connections, opened, broken (with why), exchanges, and the longest gap between two answered
    exchanges of one connection (ms: a packet lost on the way shows as a retransmission's delay)."""
    conns: list[dict[str, Any]] = []
    failed: list[str] = []
    for k in range(count):
        ip, port = targets[k % len(targets)]
        try:
            sock = socket.create_connection((ip, port), timeout=timeout)
            sock.sendall(REQUEST)
            first = _read_line(sock, time.monotonic() + timeout)
        except OSError as exc:
            failed.append(f"{ip}:{port}: {_classify(exc)}")
            continue
        _reset_on_close(sock)
        conns.append({"sock": sock, "target": f"{ip}:{port}", "reply": first, "last": time.monotonic(), "gap": 0.0})
    print(json.dumps({"opened": len(conns), "failed": failed}), flush=True)
    broken: list[str] = []
    exchanges = 0
    started = time.monotonic()
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not stop.wait(interval):
        for c in conns:
            if c.get("broken"):
                continue
            try:
                c["sock"].sendall(REQUEST)
                reply = _read_line(c["sock"], time.monotonic() + timeout)
            except OSError as exc:
                c["broken"] = f"{c['target']}: {_classify(exc)}"
            else:
                if reply != c["reply"]:
                    c["broken"] = f"{c['target']}: answered {reply!r}, first {c['reply']!r}"
            if c.get("broken"):
                # When, from the first line printed: a caller matches it against what it did meanwhile.
                c["broken"] += f" ({time.monotonic() - started:.1f} s in)"
                broken.append(c["broken"])
                continue
            now = time.monotonic()
            c["gap"] = max(c["gap"], now - c["last"])
            c["last"] = now
            exchanges += 1
    for c in conns:
        c["sock"].close()
    gap = max((c["gap"] for c in conns), default=0.0)
    print(json.dumps({"connections": count, "opened": len(conns), "failed_to_open": failed, "broken": broken,
                      "exchanges": exchanges, "max_gap_ms": round(1000 * gap, 1)}), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------- http


HTTP_BODY_LIMIT = 64 << 20
"""Bytes of a body read at most: /metrics has a series per frontend, megabytes at thousands of Services."""


def http_get(url: str, timeout: float = 2.0) -> HttpResult:
    start = time.monotonic()
    # No proxies: the target is the namespace's own loopback, whatever http_proxy the environment names.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    status: int | None = None
    body = ""
    error: str | None = None
    try:
        with opener.open(url, timeout=timeout) as resp:
            status = resp.status
            body = resp.read(HTTP_BODY_LIMIT).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        status = exc.code
        body = exc.read(HTTP_BODY_LIMIT).decode(errors="replace")
    except Exception as exc:  # noqa: BLE001 - reported to the caller, who decides
        error = f"{type(exc).__name__}: {exc}"
    return HttpResult(status=status, body=body, error=error, elapsed=round(time.monotonic() - start, 3))


def wait_http(url: str, expect: int, deadline: float, timeout: float = 1.0) -> HttpResult:
    """Poll `url` until it answers `expect` or `deadline` seconds pass; the last answer either way."""
    end = time.monotonic() + deadline
    while True:
        result = http_get(url, timeout=min(timeout, max(0.1, end - time.monotonic())))
        if result["status"] == expect or time.monotonic() >= end:
            return result
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------- CLI


def _ports(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.traffic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p_serve = sub.add_parser("serve", help="answer TCP connections and UDP datagrams with NAME:PORT")
    p_serve.add_argument("--name", required=True)
    p_serve.add_argument("--tcp", type=_ports, default=[], help="comma-separated ports")
    p_serve.add_argument("--udp", type=_ports, default=[], help="comma-separated ports")
    p_serve.add_argument("--bind", default="0.0.0.0")
    p_serve.add_argument("--bind6", default=None, help="an IPv6 address to answer on too (\"::\": every one)")
    p_serve.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when stdin closes")

    p_probe = sub.add_parser("probe", help="send requests, print a JSON summary of who answered")
    proto = p_probe.add_mutually_exclusive_group(required=True)
    proto.add_argument("--tcp", dest="proto", action="store_const", const="tcp")
    proto.add_argument("--udp", dest="proto", action="store_const", const="udp")
    p_probe.add_argument("ip")
    p_probe.add_argument("port", type=int)
    p_probe.add_argument("--count", type=int, default=20)
    p_probe.add_argument("--timeout", type=float, default=1.0, help="seconds per request")
    p_probe.add_argument("--deadline", type=float, default=60.0, help="seconds for the whole run")
    p_probe.add_argument("--interval", type=float, default=0.0, help="seconds between requests")
    p_probe.add_argument("--max-failures", type=int, default=None, help="stop once this many requests failed")
    p_probe.add_argument("--sources", type=lambda t: [a for a in t.split(",") if a], default=[],
                         help="comma-separated source addresses, one request each in turn")
    p_probe.add_argument("--source-ports", type=_ports, default=[], help="comma-separated source ports")

    p_hold = sub.add_parser("hold", help="open TCP connections and keep them until stdin ends")
    p_hold.add_argument("ip")
    p_hold.add_argument("port", type=int)
    p_hold.add_argument("--count", type=int, default=6)
    p_hold.add_argument("--timeout", type=float, default=5.0, help="seconds per connection")

    p_talk = sub.add_parser("talk", help="long-lived connections exchanging a line every --interval until stdin ends")
    p_talk.add_argument("targets", type=lambda t: [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1]))
                                                   for a in t.split(",") if a], help="IP:PORT[,IP:PORT...]")
    p_talk.add_argument("--count", type=int, default=20)
    p_talk.add_argument("--interval", type=float, default=0.1, help="seconds between a connection's exchanges")
    p_talk.add_argument("--timeout", type=float, default=3.0, help="seconds an exchange may take")

    p_http = sub.add_parser("http", help="GET a URL, print JSON {status, body, error, elapsed}")
    p_http.add_argument("url")
    p_http.add_argument("--timeout", type=float, default=2.0, help="seconds per request")
    p_http.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds for --expect")
    p_http.add_argument("--expect", type=int, default=None, help="status that makes the exit code 0")

    args = parser.parse_args(argv)
    # A terminated server or client ends quietly with status 0 instead of a KeyboardInterrupt-style traceback.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if args.cmd == "serve":
            return serve(args.name, args.tcp, args.udp, args.bind, args.exit_on_stdin_eof, args.bind6)
        if args.cmd == "probe":
            print(json.dumps(probe(args.proto, args.ip, args.port, args.count, args.timeout, args.deadline,
                                   args.interval, args.max_failures, args.sources, args.source_ports)))
            return 0
        if args.cmd == "hold":
            return hold(args.ip, args.port, args.count, args.timeout)
        if args.cmd == "talk":
            return talk(args.targets, args.count, args.interval, args.timeout)
        if args.wait and args.expect is not None:
            result = wait_http(args.url, args.expect, args.wait, args.timeout)
        else:
            result = http_get(args.url, args.timeout)
        print(json.dumps(result))
        return 0 if args.expect is None or result["status"] == args.expect else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
