"""The health and metrics HTTP servers. Each binds in `start()` (port 0 picks a free port, read back
from `.port`), so a caller that returns from `start()` knows the server is accepting."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class ProxyHealth:
    """Upstream's notion of a healthy proxy: it has applied a sync, and no change has waited unapplied
    for longer than twice the sync period."""

    def __init__(self, sync_period: float, clock: Callable[[], float] = time.time) -> None:
        self._timeout = 2 * sync_period
        self._clock = clock
        self._lock = threading.Lock()
        self.last_updated: float | None = None
        self._pending_since: float | None = None

    def queued(self) -> None:
        with self._lock:
            if self._pending_since is None:
                self._pending_since = self._clock()

    def updated(self) -> None:
        with self._lock:
            self.last_updated = self._clock()
            self._pending_since = None

    def healthy(self) -> tuple[bool, dict[str, object]]:
        with self._lock:
            now = self._clock()
            ok = self.last_updated is not None and (
                self._pending_since is None or now - self._pending_since < self._timeout
            )
            return ok, {"lastUpdated": self.last_updated, "currentTime": now}


class _Server:
    def __init__(self, host: str, port: int, routes: dict[str, Callable[[], tuple[int, str, bytes]]]) -> None:
        routes_ = routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                route = routes_.get(self.path.split("?", 1)[0])
                code, ctype, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"http-{self.port}", daemon=True)

    def start(self) -> _Server:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def health_server(host: str, port: int, health: ProxyHealth) -> _Server:
    def healthz() -> tuple[int, str, bytes]:
        ok, body = health.healthy()
        return (200 if ok else 503), "application/json", json.dumps(body).encode()

    def livez() -> tuple[int, str, bytes]:
        return 200, "text/plain", b"ok\n"

    return _Server(host, port, {"/healthz": healthz, "/livez": livez})


def metrics_server(host: str, port: int, registry: CollectorRegistry, mode: str) -> _Server:
    def metrics() -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    def proxy_mode() -> tuple[int, str, bytes]:
        return 200, "text/plain", mode.encode()

    return _Server(host, port, {"/metrics": metrics, "/proxyMode": proxy_mode})
