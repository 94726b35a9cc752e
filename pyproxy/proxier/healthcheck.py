"""The healthCheckNodePort servers upstream kube-proxy runs (pkg/proxy/healthcheck/service_health.go): for each
LoadBalancer Service with externalTrafficPolicy Local, HTTP on 0.0.0.0:<healthCheckNodePort> in pyproxy's network
namespace, answering any path with 200 while the Service has a ready endpoint on this node and the proxy is
healthy, else 503, so cloud load balancers send traffic only to nodes that can serve it locally.

What each answers comes from the desired state (`model.state.health_check`): the model decides which endpoints
are local, once. The proxier hands over each Service whose state a sync applied (`update`); servers open, move
to a new port and close with them. A port that cannot be bound is logged once, naming the Service and the port,
and tried again at every sync; the other Services' servers are unaffected.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping

from pyproxy.model.state import HealthCheck
from pyproxy.proxier.server import JSON, HttpServer, ProxyHealth

log = logging.getLogger(__name__)


class ServiceHealthServers:
    def __init__(self, health: ProxyHealth, host: str = "0.0.0.0") -> None:
        self._health = health
        self._host = host
        self._lock = threading.Lock()
        self._wanted: dict[str, HealthCheck] = {}
        """Service key -> what its server answers from; read by the servers' threads under the lock."""
        self._servers: dict[str, HttpServer] = {}
        self._failed: dict[str, int] = {}
        """Service key -> the port that could not be bound (logged once)."""

    def update(self, checks: Mapping[str, HealthCheck | None]) -> None:
        """The health checks of the Services a sync applied (None: the Service has none now); then open and
        close servers to match, retrying ports that could not be bound before. Call from one thread."""
        with self._lock:
            for key, check in checks.items():
                if check is None:
                    self._wanted.pop(key, None)
                else:
                    self._wanted[key] = check
            wanted = dict(self._wanted)
        for key, server in list(self._servers.items()):
            if key not in wanted or wanted[key].port != server.port:
                log.info("closing the health check of %s on port %d", key, server.port)
                server.stop()
                del self._servers[key]
        for key, check in wanted.items():
            if key not in self._servers:
                self._open(key, check.port)
        for key in [k for k in self._failed if k not in wanted]:
            del self._failed[key]

    def _open(self, key: str, port: int) -> None:
        try:
            server = HttpServer(self._host, port, {}, fallback=lambda _path: self.answer(key))
        except OSError as e:
            if self._failed.get(key) != port:
                self._failed[key] = port
                log.error("cannot serve the health check of %s on %s:%d: %s (tried again at every sync)",
                          key, self._host, port, e.strerror or e)
            return
        self._servers[key] = server.start()
        self._failed.pop(key, None)
        log.info("serving the health check of %s on %s:%d", key, self._host, server.port)

    def port(self, key: str) -> int | None:
        """The port the Service's server listens on (None: none is open)."""
        server = self._servers.get(key)
        return server.port if server else None

    def answer(self, key: str) -> tuple[int, dict[str, str], bytes]:
        """What the Service's server answers now: upstream's status, headers and JSON body."""
        with self._lock:
            check = self._wanted.get(key)
        count = check.local_endpoints if check else 0
        healthy, _ = self._health.healthy()
        namespace, _, name = key.partition("/")
        body = {"service": {"namespace": namespace, "name": name}, "localEndpoints": count,
                "serviceProxyHealthy": healthy}
        headers = {**JSON, "X-Load-Balancing-Endpoint-Weight": str(count)}
        return (200 if count and healthy else 503), headers, json.dumps(body, indent="\t").encode()

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
