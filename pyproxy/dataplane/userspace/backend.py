"""The userspace dataplane backend (`--proxy-mode=userspace`): kube-proxy's original mode, the last fallback.

Per sync: render.py plans from what the proxy runs now; apply() adds the new Service addresses' local routes
(/32 and /128; netlink, through pyproxy's one netlink module), lets the proxy's loop open, close and re-filter
listeners and swap routes, then removes the local routes nothing uses any more. No netfilter, no bpf() syscall:
what it needs is CAP_NET_ADMIN (the local routes) and CAP_NET_BIND_SERVICE (ports below 1024). Both families are
served, unless IPv6 is off in the network namespace (then IPv4 only, said at start).

A listener that cannot be opened (a node process holds the port on 0.0.0.0, say) leaves its Service in
`unserved`, named in the log and, through the proxier, in an Event; that frontend refuses flows meanwhile, the
other frontends are served, and every periodic sync tries it again (`housekeeping_due`).

Unlike the kernel modes, the dataplane is this process: a stop ends every proxied connection, and until the next
start has synced, the local routes stay, so flows to the Service addresses are refused rather than routed away.
A start adopts the local routes a previous run left (no flaps) and opens every listener anew.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from pyroute2.netlink.exceptions import NetlinkError

from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import DataplaneError, MasqueradeSettings, ModeUnavailable
from pyproxy.dataplane.userspace.proxy import CONNECT_TIMEOUTS, Proxy
from pyproxy.dataplane.userspace.render import DEVICE, ROUTE_PROTO, Plan, State, render
from pyproxy.model.objects import IPV4, IPV6
from pyproxy.model.state import BOTH_FAMILIES, IPV4_ONLY, DesiredState

log = logging.getLogger(__name__)

CAP_NET_BIND_SERVICE, CAP_NET_ADMIN = 10, 12


@dataclass
class UserspaceSettings:
    udp_idle_timeout: float = 0.25
    """--udp-timeout (udpIdleTimeout in a config file): a UDP session with no datagram either way for this long
    ends; the client's next datagram starts a new one, maybe to another endpoint (upstream's default, 250 ms)."""
    connect_timeouts: tuple[float, ...] = CONNECT_TIMEOUTS
    """Seconds each attempt to connect to an endpoint may take; a failed or timed-out attempt moves to the next
    endpoint with the next timeout (upstream's 250 ms, 500 ms, 1 s, 2 s)."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    """--cluster-cidr tells pods from outside clients (externalTrafficPolicy Local limits only the latter); every
    flow leaves from the node, so nothing else of it applies."""

    def problems(self) -> list[str]:
        out = []
        if not self.udp_idle_timeout > 0:
            out.append(f"--udp-timeout must be positive, not {self.udp_idle_timeout:g}s")
        return out


def _capabilities() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def _raise_open_files() -> None:
    """A socket per frontend and two per proxied connection: the default soft limit of 1,024 open files would
    stop the proxy at a few hundred Services. Raised to the hard limit, as a server does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log.info("open files: up to %s", resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _ipv6_problem() -> str | None:
    """Why this network namespace cannot serve IPv6 Service addresses (None: it can): a kernel booted with
    ipv6.disable=1 has no /proc/sys/net/ipv6, and `lo` with disable_ipv6 set takes no IPv6 routes."""
    try:
        with open("/proc/sys/net/ipv6/conf/lo/disable_ipv6") as f:
            if f.read().strip() != "0":
                return f"IPv6 is disabled on {DEVICE} (net.ipv6.conf.lo.disable_ipv6)"
    except FileNotFoundError:
        return "this kernel has no IPv6 (ipv6.disable=1)"
    return None


class UserspaceDataplane:
    mode = "userspace"
    unserved: Mapping[str, str] = MappingProxyType({})  # it serves every Service it is given
    localhost_nodeports = False  # no NodePorts on 127.0.0.1: its listeners are on the Service addresses
    collector = None  # no metrics of its own

    def __init__(self, settings: UserspaceSettings) -> None:
        self.settings = settings
        self.ip_families = BOTH_FAMILIES
        """The IP families it renders: both, unless start() found IPv6 off in this network namespace (then the
        proxier leaves out the IPv6 frontends)."""
        self.state = State()
        self.proxy: Proxy | None = None
        self.unserved: dict[str, str] = {}
        """Service -> why one of its listeners could not be opened (tried again at every sync)."""
        self._index = 0
        self._need_full = True

    def start(self) -> None:
        caps = _capabilities()
        missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                          (CAP_NET_BIND_SERVICE, "CAP_NET_BIND_SERVICE")) if not caps >> bit & 1]
        if missing:
            raise ModeUnavailable(f"the userspace mode needs {' and '.join(missing)} (local routes for the "
                                  "Service addresses, ports below 1024), which this process lacks")
        problem = _ipv6_problem()
        if problem is not None:
            self.ip_families = IPV4_ONLY
            log.warning("userspace mode serves IPv4 only: %s", problem)
        try:
            with netlink.rtnl() as ipr:
                index = netlink.link_index(ipr, DEVICE)
                kept = netlink.local_routes(ipr, ROUTE_PROTO, self.ip_families)
        except (NetlinkError, OSError) as e:
            raise ModeUnavailable(f"cannot read the local routing table: {e}") from e
        if index is None:
            raise ModeUnavailable(f"this network namespace has no {DEVICE}")
        self._index = index
        _raise_open_files()
        self.state = State({}, kept)
        if kept:
            log.info("kept the local routes of %d Service addresses from the previous run", len(kept))
        self.proxy = Proxy(udp_idle_timeout=self.settings.udp_idle_timeout, cluster_cidrs=self._cluster_cidrs(),
                           connect_timeouts=self.settings.connect_timeouts)
        self.proxy.start()

    def stop(self) -> None:
        """Close every listener and connection; the addresses stay (see the module's docstring)."""
        if self.proxy is not None:
            self.proxy.stop()

    def housekeeping_due(self) -> bool:
        return bool(self.unserved)

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        assert self.proxy is not None, "apply before start"
        full = changed is None or self._need_full
        if full:
            services = dict(desired.services)
        else:
            assert changed is not None
            keys = set(changed) | set(self.unserved)
            services = {k: desired.services.get(k, ()) for k in keys}
        plan = render(self.state, services, full=full, cluster_cidrs=self._cluster_cidrs())
        if plan.empty:
            return
        self._need_full = True  # until this plan is all done
        self._addresses("add", plan.add_addresses)
        failed = self.proxy.apply(plan)
        state = plan.state
        if failed:
            # Recorded as not listening, so the next render opens them again.
            state = replace(state, entries={f: replace(e, listen=False) if f in failed else e
                                            for f, e in state.entries.items()})
        self.state = replace(state, addresses=state.addresses | frozenset(plan.del_addresses))
        self._addresses("del", plan.del_addresses)
        self.state = state
        self._need_full = False
        self._report(plan, failed)

    def _cluster_cidrs(self) -> tuple[str, ...]:
        m = self.settings.masquerade
        return tuple(c for c in (m.cluster_cidr, m.cluster_cidr6) if c)

    def _addresses(self, verb: str, ips: tuple[str, ...]) -> None:
        if not ips:
            return
        try:
            with netlink.rtnl() as ipr:
                present = netlink.local_routes(ipr, ROUTE_PROTO, self.ip_families)
                for ip in ips:
                    if (ip in present) != (verb == "add"):
                        netlink.set_local_route(ipr, verb, ip, ROUTE_PROTO, self._index)
        except (NetlinkError, OSError) as e:
            raise DataplaneError(f"{'adding' if verb == 'add' else 'removing'} the local routes of Service "
                                 f"addresses failed: {e}") from e

    def _report(self, plan: Plan, failed: dict) -> None:
        owners = {f: e.service for f, e in plan.state.entries.items()}
        now: dict[str, list[str]] = {}
        for f, why in sorted(failed.items()):
            now.setdefault(owners[f], []).append(f"{f}: {why}")
        for service, lines in now.items():
            why = f"cannot listen on {'; '.join(lines)}"
            if self.unserved.get(service) != why:
                log.warning("Service %s not served: %s", service, why)
        for service in self.unserved.keys() - now.keys():
            if service in owners.values():
                log.info("Service %s served: every listener is open", service)
        self.unserved = {service: f"cannot listen on {'; '.join(lines)}" for service, lines in now.items()}


def cleanup(settings: UserspaceSettings) -> list[str]:
    """Remove every local route of the userspace mode (a running userspace proxy is another process's: its
    listeners go with that process)."""
    try:
        with netlink.rtnl() as ipr:
            index = netlink.link_index(ipr, DEVICE) or 1
            families = (IPV4,) if _ipv6_problem() else (IPV4, IPV6)
            ips = sorted(netlink.local_routes(ipr, ROUTE_PROTO, families))
            for ip in ips:
                netlink.set_local_route(ipr, "del", ip, ROUTE_PROTO, index)
    except NetlinkError as e:
        raise DataplaneError(f"cannot remove the userspace mode's local routes: {e}") from e
    return [f"the local routes of {len(ips)} Service addresses (table local, proto {ROUTE_PROTO})"] if ips else []
