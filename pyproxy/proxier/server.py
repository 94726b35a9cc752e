"""The health and metrics HTTP servers. Each binds in `start()` (port 0 picks a free port, read back
from `.port`), so a caller that returns from `start()` knows the server is accepting."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pyproxy.model.objects import Node
from pyproxy.proxier.metrics import ProxyMetrics


def go_time(t: float | None) -> str:
    """A Unix time as Go's JSON writes a UTC time.Time (RFC 3339, nanoseconds without trailing zeros); None: Go's
    zero time, which upstream reports before its first sync."""
    if t is None:
        return "0001-01-01T00:00:00Z"
    whole = int(t)
    fraction = f"{round((t - whole) * 1e9):09d}".rstrip("0")
    stamp = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{fraction}Z" if fraction else f"{stamp}Z"


class ProxyHealth:
    """Upstream's notion of a healthy proxy: it has applied a sync, and no change has waited unapplied
    for longer than twice the sync period. (Upstream also counts a proxy that has not synced yet as healthy;
    pyproxy answers 503 until its first sync is applied, so a 200 means "programmed".) /healthz also needs the
    node to be eligible: not being deleted (`set_node`)."""

    def __init__(self, sync_period: float, clock: Callable[[], float] = time.time) -> None:
        self._timeout = 2 * sync_period
        self._clock = clock
        self._lock = threading.Lock()
        self.last_updated: float | None = None
        self._pending_since: float | None = None
        self.node_eligible = True
        """False while the own Node is being deleted (or was): upstream's nodeEligible. True while no Node is
        known (from manifests, or before the API delivers it), as upstream before its first Node event."""

    def queued(self) -> None:
        with self._lock:
            if self._pending_since is None:
                self._pending_since = self._clock()

    def updated(self) -> None:
        with self._lock:
            self.last_updated = self._clock()
            self._pending_since = None

    def set_node(self, node: Node | None) -> None:
        """The own Node as the API has it now (None: deleted)."""
        with self._lock:
            self.node_eligible = node is not None and not node.deleting

    def healthy(self) -> tuple[bool, dict[str, object]]:
        """Whether the proxy is healthy, the node aside (upstream's Health(), also the health-check node ports'
        serviceProxyHealthy), and the body of /healthz, as upstream's (json.Marshal of its ProxyHealth): times as
        Go writes them, lastUpdated being the current time while healthy."""
        with self._lock:
            now = self._clock()
            ok = self.last_updated is not None and (
                self._pending_since is None or now - self._pending_since < self._timeout
            )
            eligible = self.node_eligible
            last = now if ok and eligible else self.last_updated
            body: dict[str, object] = {"lastUpdated": go_time(last), "currentTime": go_time(now),
                                       "nodeEligible": eligible, "healthy": ok}
            if self.last_updated is not None:  # per IP family, once it has synced (Go's omitempty)
                body["status"] = {"IPv4": {"lastUpdated": go_time(self.last_updated), "healthy": ok}}
        return ok, body

    def healthz(self) -> tuple[int, bytes]:
        """/healthz: 200 when healthy and the node eligible, else 503; upstream's JSON body either way."""
        ok, body = self.healthy()
        return (200 if ok and body["nodeEligible"] else 503), json.dumps(body, separators=(",", ":")).encode()


Route = Callable[[str], tuple[int, dict[str, str], bytes]]
"""path -> (status, headers, body)."""


class _ThreadingHTTPServer6(ThreadingHTTPServer):
    """On an IPv6 address (a health-check node port on an IPv6 node address, --healthz-bind-address=[::]:…)."""

    address_family = socket.AF_INET6


class HttpServer:
    def __init__(self, host: str, port: int, routes: dict[str, Route], fallback: Route | None = None) -> None:
        def not_found(_path: str) -> tuple[int, dict[str, str], bytes]:
            return 404, {"Content-Type": "text/plain"}, b"not found\n"

        routes_, fallback_ = routes, fallback or not_found

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                code, headers, body = routes_.get(path, fallback_)(path)
                self.send_response(code)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self._httpd = (_ThreadingHTTPServer6 if ":" in host else ThreadingHTTPServer)((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        # Polled 10 times a second, not socketserver's 2: stop() waits for the poll, and a sync that closes a
        # health-check server (a Service deleted) waits for stop().
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,), name=f"http-{self.port}",
                                        daemon=True)

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def close(self) -> None:
        """Release the socket of a server never started (stop() would wait for a loop that never ran)."""
        self._httpd.server_close()


JSON = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}
"""Upstream's headers on every health answer."""


def _text(body: bytes, ctype: str = "text/plain") -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": ctype}, body


def health_server(host: str, port: int, health: ProxyHealth, metrics: ProxyMetrics | None = None) -> HttpServer:
    """/healthz and /livez; each answer counted by its code in kubeproxy_proxy_healthz_total and
    kubeproxy_proxy_livez_total when `metrics` are given."""

    def healthz(_path: str) -> tuple[int, dict[str, str], bytes]:
        code, body = health.healthz()
        if metrics is not None:
            metrics.healthz.labels(code=str(code)).inc()
        return code, JSON, body

    def livez(_path: str) -> tuple[int, dict[str, str], bytes]:
        if metrics is not None:
            metrics.livez.labels(code="200").inc()
        return _text(b"ok\n")

    return HttpServer(host, port, {"/healthz": healthz, "/livez": livez})


def metrics_server(host: str, port: int, registry: CollectorRegistry, mode: str) -> HttpServer:
    return HttpServer(host, port, {"/metrics": lambda _p: _text(generate_latest(registry), CONTENT_TYPE_LATEST),
                                "/proxyMode": lambda _p: _text(mode.encode())})
