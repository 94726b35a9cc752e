"""The userspace proxy itself: one asyncio event loop in a thread of pyproxy's process, serving every frontend
(no thread per connection, nor per frontend).

TCP: each listener's accepted connection gets an endpoint (ClientIP affinity first, else round robin over the
frontend's endpoints for that client), a connection to it, and then bytes are copied both ways by two protocols
that push back on each other (a peer that cannot keep up pauses reading on the other side), half-closes
forwarded. A connect that fails or takes too long moves to the next endpoint, with a longer timeout each time
(`CONNECT_TIMEOUTS`, upstream's userspace proxier's): a refused or silent endpoint costs the client a delay, not
its connection. Only when every attempt failed is the client's connection reset.

UDP: one socket per frontend; each client (address and port) gets a session, a connected socket to the endpoint
chosen for it, whose replies go back to the client from the frontend's socket. A session ends after
`udp_idle_timeout` without a datagram either way (upstream's udpIdleTimeout, 250 ms by default), or when its
endpoint leaves the frontend's endpoints (the client's next datagram starts a new session).

IPv6: an IPv6 frontend's socket is an AF_INET6 one with IPV6_V6ONLY (an IPv4 flow never reaches it, nor an IPv6
one an IPv4 socket), bound with IPV6_FREEBIND: an IPv6 bind is checked against the devices' addresses, which a
Service address with only its local route is not (EADDRNOTAVAIL without it). Its endpoints are IPv6 ones (the
model gives a frontend its own family's), dialled from AF_INET6 sockets.

Everything here runs on the loop's thread; `Proxy.apply` is the one entry from outside (the sync thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pyproxy.dataplane.userspace import sockfilter
from pyproxy.dataplane.userspace.render import Plan, Route
from pyproxy.model.objects import IPV6, Protocol, family_of
from pyproxy.model.state import Backend, Frontend

log = logging.getLogger(__name__)

CONNECT_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)
"""Seconds each connect attempt to an endpoint may take, one attempt per entry, each on the next endpoint
(upstream's userspace proxier's EndpointDialTimeouts)."""
ACCEPTS_PER_WAKEUP = 64
"""Connections (datagrams) taken per readiness callback, so one busy frontend cannot starve the others."""
LISTEN_BACKLOG = 4096
AFFINITY_SWEEP_SECONDS = 10.0
LINGER_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 s: close() sends a reset."""
APPLY_TIMEOUT = 60.0
IPV6_FREEBIND = 78
"""linux/in6.h (Python's socket module lacks it): bind an IPv6 address no device has (kernel 4.15 and later)."""

T = TypeVar("T")


def _reset(sock: socket.socket | None) -> None:
    """Close with a reset, so the peer sees its connection refused or broken, not a clean end."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    sock.close()


def _socket_family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if family_of(ip) == IPV6 else socket.AF_INET


def _same(side: _Side) -> _Side:
    return side


class _Side(asyncio.Protocol):
    """One end of a proxied TCP connection; `peer` is the other end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.eof = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.peer is None:
            transport.pause_reading()  # until both ends are linked

    def link(self, peer: _Side) -> None:
        self.peer, peer.peer = peer, self
        for side in (self, peer):
            if side.transport is not None and not side.closed:
                side.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.closed:
            peer.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is None or peer.transport is None or peer.closed:
            return False
        if peer.eof:
            peer.transport.close()
            return False
        if peer.transport.can_write_eof():
            peer.transport.write_eof()
        return True  # keep our half open: the peer may still answer

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.closed:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        peer = self.peer
        if peer is None or peer.transport is None or peer.closed:
            return
        if exc is not None:  # a reset (or an error): pass it on as a reset
            _reset(peer.transport.get_extra_info("socket"))
            peer.transport.abort()
        else:
            peer.transport.close()  # after what is still buffered


class _Frontend:
    """One frontend's route, endpoint choice (round robin cursors, ClientIP affinity) and listener."""

    def __init__(self, proxy: Proxy, frontend: Frontend, route: Route) -> None:
        self.proxy = proxy
        self.frontend = frontend
        self.route = route
        self.cursors = [0, 0]
        """Round robin over `route.backends` and over `route.external_backends`."""
        self.affinity: dict[str, tuple[Backend, float]] = {}
        """Client address -> (endpoint, when last used)."""
        self.sock: socket.socket | None = None
        self.filtered = False
        """The listener has a socket filter, which each connection it accepts inherits."""
        self.sessions: dict[tuple[str, int], _UdpSession] = {}

    # -- choosing

    def set_route(self, route: Route) -> None:
        self.route = route
        for client, session in list(self.sessions.items()):
            if session.backend not in route.known:
                session.close()
                self.sessions.pop(client, None)

    def candidates(self, client: str) -> list[Backend]:
        """The endpoints for a new flow from `client`, in the order to try them: the affine one or the round
        robin's next first, then the others in turn."""
        route = self.route
        pool, which = route.backends, 0
        if route.external_backends is not None and not self.proxy.internal(client):
            pool, which = route.external_backends, 1
        if not pool:
            return []
        start = None
        if route.affinity_seconds:
            held = self.affinity.get(client)
            if held is not None and held[0] in pool and self.proxy.loop.time() - held[1] < route.affinity_seconds:
                start = pool.index(held[0])
        if start is None:
            start = self.cursors[which] % len(pool)
            self.cursors[which] = start + 1
        return [pool[(start + i) % len(pool)] for i in range(len(pool))]

    def chosen(self, client: str, backend: Backend) -> None:
        """A new flow from `client` went to `backend`: where its next ones go, with affinity."""
        if self.route.affinity_seconds:
            self.affinity[client] = (backend, self.proxy.loop.time())

    def sweep_affinity(self, now: float) -> None:
        ttl = self.route.affinity_seconds
        for client, (_, used) in list(self.affinity.items()):
            if not ttl or now - used >= ttl:
                del self.affinity[client]

    # -- listening

    def open(self, program: Sequence[sockfilter.Insn] | None) -> None:
        kind = socket.SOCK_STREAM if self.frontend.protocol is Protocol.TCP else socket.SOCK_DGRAM
        family = _socket_family(self.frontend.ip)
        sock = socket.socket(family, kind)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_FREEBIND, 1)
            sockfilter.attach(sock, program)  # before bind: no packet may arrive unfiltered
            sock.bind((self.frontend.ip, self.frontend.port))
            if kind == socket.SOCK_STREAM:
                sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.filtered = program is not None
        reader = self._accept if kind == socket.SOCK_STREAM else self._datagrams
        self.proxy.loop.add_reader(sock.fileno(), reader)

    def refilter(self, program: Sequence[sockfilter.Insn] | None) -> None:
        if self.sock is not None:
            sockfilter.attach(self.sock, program)
            self.filtered = program is not None

    def close(self) -> None:
        if self.sock is not None:
            self.proxy.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        for session in list(self.sessions.values()):
            session.close()
        self.sessions.clear()

    def _accept(self) -> None:
        assert self.sock is not None
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # ECONNABORTED, EMFILE...: this one is lost, the listener goes on
                log.debug("accept on %s: %s", self.frontend, e)
                return
            conn.setblocking(False)
            if self.filtered:
                # The connection inherits the listener's filter; what it admitted is admitted.
                sockfilter.attach(conn, None)
            self.proxy.spawn(self.proxy.serve_tcp(self, conn, peer[0]))

    def _datagrams(self) -> None:
        sock = self.sock
        assert sock is not None
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                data, client = sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # an ICMP error for an earlier reply
            session = self.sessions.get(client)
            if session is None:
                tried = self.candidates(client[0])
                if not tried:
                    continue
                try:
                    session = _UdpSession(self, client, tried[0])
                except OSError as e:
                    log.debug("UDP session %s -> %s: %s", client, tried[0], e)
                    continue
                self.chosen(client[0], tried[0])
                self.sessions[client] = session
            session.send(data)


class _UdpSession:
    """One UDP client of a frontend: a connected socket to its endpoint, ended when idle."""

    def __init__(self, frontend: _Frontend, client: tuple[str, int], backend: Backend) -> None:
        self.frontend = frontend
        self.client = client
        self.backend = backend
        self.loop = frontend.proxy.loop
        self.timeout = frontend.proxy.udp_idle_timeout
        sock = socket.socket(_socket_family(backend.ip), socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect((backend.ip, backend.port))
        except OSError:
            sock.close()
            raise
        self.sock: socket.socket | None = sock
        self.last = self.loop.time()
        self.loop.add_reader(sock.fileno(), self._replies)
        self.timer = self.loop.call_later(self.timeout, self._check)

    def send(self, data: bytes) -> None:
        if self.sock is None:
            return
        self.last = self.loop.time()
        # A full buffer, or the ICMP error of an earlier datagram: UDP loses it, as the network would.
        with contextlib.suppress(OSError):
            self.sock.send(data)

    def _replies(self) -> None:
        out = self.frontend.sock
        for _ in range(ACCEPTS_PER_WAKEUP):
            if self.sock is None:
                return
            try:
                data = self.sock.recv(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # ECONNREFUSED: the endpoint's port unreachable for an earlier datagram
            self.last = self.loop.time()
            if out is not None:
                with contextlib.suppress(OSError):
                    out.sendto(data, self.client)

    def _check(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.timeout:
            self.close()
            if self.frontend.sessions.get(self.client) is self:
                del self.frontend.sessions[self.client]
        else:
            self.timer = self.loop.call_later(self.timeout - idle, self._check)

    def close(self) -> None:
        self.timer.cancel()
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None


def is_local(ip: str) -> bool:
    """Whether `ip` is one of this network namespace's own addresses (only those can be bound without
    IPV6_FREEBIND: an IPv6 Service address's local route does not make it one, an IPv4 one's does, and neither
    is a client's source)."""
    with socket.socket(_socket_family(ip), socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


class Proxy:
    """The event loop and the frontends it serves."""

    def __init__(self, *, udp_idle_timeout: float, cluster_cidrs: Sequence[str] = (),
                 connect_timeouts: Sequence[float] = CONNECT_TIMEOUTS,
                 is_local: Callable[[str], bool] = is_local) -> None:
        self.udp_idle_timeout = udp_idle_timeout
        self.cluster = tuple(ipaddress.ip_network(c, strict=False) for c in cluster_cidrs)
        """--cluster-cidr's networks, at most one of each family: the pods."""
        self.connect_timeouts = tuple(connect_timeouts)
        self._is_local = is_local
        self._local: dict[str, bool] = {}
        """is_local's answers, forgotten at every apply (the node's addresses change rarely)."""
        self.loop = asyncio.new_event_loop()
        self.frontends: dict[Frontend, _Frontend] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="userspace-proxy", daemon=True)
        self.retries = 0
        """Connect attempts that failed and moved to the next endpoint (or gave up)."""

    # -- from other threads

    def start(self) -> None:
        self._thread.start()

    def apply(self, plan: Plan) -> dict[Frontend, str]:
        """Run the plan's listener and route changes on the loop; the frontends whose listener could not be
        opened, with why."""
        return self._call(self._apply, plan)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._close_all)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        async def run() -> T:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=APPLY_TIMEOUT)

    # -- on the loop

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_later(AFFINITY_SWEEP_SECONDS, self._sweep)
        self.loop.run_forever()
        self.loop.close()

    def _sweep(self) -> None:
        now = self.loop.time()
        for fe in self.frontends.values():
            fe.sweep_affinity(now)
        self.loop.call_later(AFFINITY_SWEEP_SECONDS, self._sweep)

    def _apply(self, plan: Plan) -> dict[Frontend, str]:
        self._local.clear()
        for f in plan.close:
            if f in self.frontends:
                self.frontends[f].close()
        for f, route in plan.routes.items():
            if route is None:
                gone = self.frontends.pop(f, None)
                if gone is not None:
                    gone.close()
            elif f in self.frontends:
                self.frontends[f].set_route(route)
            else:
                self.frontends[f] = _Frontend(self, f, route)
        for f, program in plan.refilter.items():
            self.frontends[f].refilter(program)
        failed = {}
        for f, program in plan.open.items():
            try:
                self.frontends[f].open(program)
            except OSError as e:
                failed[f] = e.strerror or str(e)
        return failed

    def _close_all(self) -> None:
        for fe in self.frontends.values():
            fe.close()
        for task in self._tasks:
            task.cancel()

    def spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def internal(self, client: str) -> bool:
        """Whether a client is the node itself or (with --cluster-cidr) a pod: what externalTrafficPolicy Local
        does not limit."""
        address = ipaddress.ip_address(client)
        if any(address in net for net in self.cluster if net.version == address.version):
            return True
        local = self._local.get(client)
        if local is None:
            local = self._local[client] = self._is_local(client)
        return local

    async def serve_tcp(self, fe: _Frontend, conn: socket.socket, client: str) -> None:
        """Connect an accepted connection to an endpoint (trying the next one on failure) and link the two."""
        tried = fe.candidates(client)
        upstream: _Side | None = None
        for attempt, timeout in enumerate(self.connect_timeouts):
            if not tried:
                break
            backend = tried[attempt % len(tried)]
            side = _Side()
            try:
                await asyncio.wait_for(self.loop.create_connection(functools.partial(_same, side), backend.ip,
                                                                   backend.port), timeout)
            except (TimeoutError, OSError) as e:
                self.retries += 1
                log.debug("%s: connect to %s failed (%s), attempt %d", fe.route.name, backend,
                          type(e).__name__ if not str(e) else e, attempt + 1)
                continue
            upstream = side
            fe.chosen(client, backend)
            break
        if upstream is None:
            log.info("%s: no endpoint answered a connection from %s (tried %s)", fe.route.name, client,
                     ", ".join(str(b) for b in tried) or "none")
            _reset(conn)
            return
        downstream = _Side()
        try:
            await self.loop.connect_accepted_socket(lambda: downstream, conn)
        except OSError:
            _reset(conn)
            if upstream.transport is not None:
                upstream.transport.abort()
            return
        if upstream.closed:  # the endpoint closed before the client was linked: pass the end on
            if downstream.transport is not None:
                downstream.transport.close()
            return
        downstream.link(upstream)

