"""The healthCheckNodePort servers upstream kube-proxy runs (pkg/proxy/healthcheck/service_health.go): for each
LoadBalancer Service with externalTrafficPolicy Local, HTTP on <healthCheckNodePort> in pyproxy's network
namespace, answering any path with 200 while the Service has a ready endpoint on this node and the proxy is
healthy, else 503, so cloud load balancers send traffic only to nodes that can serve it locally. As upstream, the
servers listen on 0.0.0.0 unless --nodeport-addresses narrows the node-port addresses; then on each of those
(none: no server), following them as they change.

What each answers comes from the desired state (`model.state.health_check`): the model decides which endpoints
are local, once. The proxier hands over each Service whose state a sync applied (`update`); servers open, move
to a new port and close with them. A port that cannot be bound is logged once, naming the Service and the port,
and tried again at every sync; the other Services' servers are unaffected.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence

from pyproxy.model.state import HealthCheck
from pyproxy.proxier.server import JSON, HttpServer, ProxyHealth

log = logging.getLogger(__name__)


class ServiceHealthServers:
    def __init__(self, health: ProxyHealth, host: str = "0.0.0.0", *, on_nodeport_addresses: bool = False) -> None:
        """`host`: the address servers listen on, unless `on_nodeport_addresses` (--nodeport-addresses given):
        then on each node-port address `update` is told of."""
        self._health = health
        self._host = host
        self._on_nodeport_addresses = on_nodeport_addresses
        self._hosts: tuple[str, ...] = () if on_nodeport_addresses else (host,)
        self._lock = threading.Lock()
        self._wanted: dict[str, HealthCheck] = {}
        """Service key -> what its server answers from; read by the servers' threads under the lock."""
        self._servers: dict[str, list[HttpServer]] = {}
        """Service key -> its servers, one per address in `_hosts` (all bound, or none)."""
        self._failed: dict[str, int] = {}
        """Service key -> the port that could not be bound (logged once)."""

    def update(self, checks: Mapping[str, HealthCheck | None], nodeport_addresses: Sequence[str] = ()) -> None:
        """The health checks of the Services a sync applied (None: the Service has none now) and the node-port
        addresses now; then open and close servers to match, retrying ports that could not be bound before.
        Call from one thread."""
        with self._lock:
            for key, check in checks.items():
                if check is None:
                    self._wanted.pop(key, None)
                else:
                    self._wanted[key] = check
            wanted = dict(self._wanted)
        hosts = tuple(nodeport_addresses) if self._on_nodeport_addresses else self._hosts
        moved = hosts != self._hosts
        self._hosts = hosts
        for key, servers in list(self._servers.items()):
            if moved or key not in wanted or wanted[key].port != servers[0].port:
                log.info("closing the health check of %s on port %d", key, servers[0].port)
                for server in servers:
                    server.stop()
                del self._servers[key]
        for key, check in wanted.items():
            if key not in self._servers:
                self._open(key, check.port)
        for key in [k for k in self._failed if k not in wanted]:
            del self._failed[key]

    def _open(self, key: str, port: int) -> None:
        servers: list[HttpServer] = []
        for host in self._hosts:
            try:
                servers.append(HttpServer(host, port, {}, fallback=lambda _path: self.answer(key)))
            except OSError as e:
                for server in servers:
                    server.close()
                if self._failed.get(key) != port:
                    self._failed[key] = port
                    log.error("cannot serve the health check of %s on %s:%d: %s (tried again at every sync)",
                              key, host, port, e.strerror or e)
                return
        if not servers:
            return  # no node-port address
        self._servers[key] = [server.start() for server in servers]
        self._failed.pop(key, None)
        log.info("serving the health check of %s on %s port %d", key, ", ".join(self._hosts), port)

    def port(self, key: str) -> int | None:
        """The port the Service's servers listen on (None: none is open)."""
        servers = self._servers.get(key)
        return servers[0].port if servers else None

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
        for servers in self._servers.values():
            for server in servers:
                server.stop()
        self._servers.clear()
