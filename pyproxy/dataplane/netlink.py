"""Links and addresses of pyproxy's network namespace, through pyroute2: which devices and addresses exist and
when they come and go.

This is the only module that speaks rtnetlink through pyroute2; backends ask it for `Link`s, subscribe to
`LinkWatcher`, the proxier lists the node's addresses and subscribes to `AddressWatcher`, and backends manage a
device of their own (IPVS mode's dummy `kube-ipvs0`) or local routes of their own (the userspace mode's) with the
small verbs at the end, instead of holding sockets of their own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pyroute2 import IPRoute

from pyproxy.model.objects import IPV4, IPV6, family_of

log = logging.getLogger(__name__)

ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
TC_H_CLSACT = 0xFFFFFFF1
TC_INGRESS_PARENT = 0xFFFFFFF2
TC_EGRESS_PARENT = 0xFFFFFFF3


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str
    """The rtnetlink kind (veth, dummy, bridge…), "" for a physical device."""
    ether: bool
    """An Ethernet-framed device: the BPF programs parse from an Ethernet header."""
    up: bool
    master: int = 0
    """IFLA_MASTER: the index of the bridge or bond (or other master) this device is enslaved to; 0: none."""
    slave_kind: str = ""
    """IFLA_INFO_SLAVE_KIND: what kind of master it is enslaved to ("bridge", "bond"), "" when none."""
    link: int = 0
    """IFLA_LINK, when it names a device of this namespace: the device a VLAN or macvlan is stacked on, a veth's
    peer; 0 otherwise (none, or one in another namespace: IFLA_LINK_NETNSID)."""
    mtu: int = 0
    """IFLA_MTU (what a driver's XDP limit is about)."""


def _link_of(msg: dict) -> Link:
    info = msg.get_attr("IFLA_LINKINFO")  # type: ignore[attr-defined]
    kind = info.get_attr("IFLA_INFO_KIND") if info else ""
    slave_kind = info.get_attr("IFLA_INFO_SLAVE_KIND") if info else ""
    here = msg.get_attr("IFLA_LINK_NETNSID") is None  # type: ignore[attr-defined]
    return Link(
        index=msg["index"],
        name=msg.get_attr("IFLA_IFNAME"),  # type: ignore[attr-defined]
        kind=kind or "",
        ether=msg["ifi_type"] == ARPHRD_ETHER,
        up=bool(msg["flags"] & 1),
        master=msg.get_attr("IFLA_MASTER") or 0,  # type: ignore[attr-defined]
        slave_kind=slave_kind or "",
        link=(msg.get_attr("IFLA_LINK") or 0) if here else 0,  # type: ignore[attr-defined]
        mtu=msg.get_attr("IFLA_MTU") or 0,  # type: ignore[attr-defined]
    )


def list_links() -> list[Link]:
    """Every device of this network namespace except loopback."""
    with IPRoute() as ipr:
        return [lk for lk in (_link_of(m) for m in ipr.get_links()) if lk.name != "lo"]


def has_clsact(ifindex: int) -> bool:
    with IPRoute() as ipr:
        return any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(ifindex))


def tc_filter_count(ifindex: int) -> int:
    """Filters on the clsact hooks of a device, whoever owns them (pyroute2 lists one header entry per
    priority plus one per filter; only entries with options are filters)."""
    with IPRoute() as ipr:
        n = 0
        for parent in (TC_INGRESS_PARENT, TC_EGRESS_PARENT):
            n += sum(1 for f in ipr.get_filters(ifindex, parent=parent) if f.get_attr("TCA_OPTIONS"))
        return n


def remove_clsact(ifindex: int) -> None:
    with IPRoute() as ipr:
        ipr.tc("del", "clsact", ifindex)


class _Watcher:
    """A thread reading rtnetlink notifications (`_handle` each) until `stop()`. It subscribes when made and
    delivers from `start()` on: subscribe, list, then start, and no change slips between the list and the first
    event. (The socket is made and read in the thread: pyroute2 0.9's IPRoute reads nothing in a thread other
    than the one that made it.)"""

    name = "netlink-watch"

    def __init__(self) -> None:
        self._ipr: IPRoute | None = None
        self._bound = threading.Event()
        self._go = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if not self._bound.wait(10.0) or self._ipr is None:
            raise OSError(f"{self.name}: could not subscribe to rtnetlink")

    def start(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        if self._ipr is not None:
            with contextlib.suppress(OSError):
                self._ipr.close()

    def _handle(self, msgs: list[dict]) -> None:
        raise NotImplementedError

    def _lost(self) -> None:
        """Events were lost (the socket's buffer overflowed): whatever follows them must read the kernel again."""

    def _run(self) -> None:
        try:
            ipr = IPRoute()
            ipr.bind()  # links, IPv4/IPv6 addresses and routes
        except OSError as e:
            log.warning("%s: %s", self.name, e)
            self._bound.set()
            return
        self._ipr = ipr
        self._bound.set()
        self._go.wait()
        while not self._stop.is_set():
            try:
                msgs = ipr.get()
            except OSError as e:
                if e.errno == errno.ENOBUFS and not self._stop.is_set():
                    # A burst of events (thousands of routes added at once) overflowed the socket: the
                    # subscription still stands, only those events are gone.
                    log.info("%s: events lost in a burst (%s); reading the kernel again", self.name, e)
                    self._lost()
                    continue
                if not self._stop.is_set():
                    log.warning("%s: %s", self.name, e)
                return
            except Exception as e:  # noqa: BLE001 - a closed socket at stop, or a netlink hiccup
                if not self._stop.is_set():
                    log.warning("%s: %s", self.name, e)
                return
            self._handle(msgs)


class LinkWatcher(_Watcher):
    """Calls `on_change(link, present)` for every link added, changed (enslaved, released, renamed...) or removed,
    from a thread of its own; and `reread()`, if given, once for a batch of events that adds or removes an address of
    a device's own (not a link-local or host one: every device that comes up gets an IPv6 link-local address), or
    when events were lost: what it follows must then be read from the kernel again."""

    name = "link-watch"

    def __init__(self, on_change: Callable[[Link, bool], None], reread: Callable[[], None] | None = None) -> None:
        self._on_change = on_change
        self._reread = reread
        super().__init__()

    def _handle(self, msgs: list[dict]) -> None:
        for m in msgs:
            event = m.get("event")
            # The bridge's own news of its ports (AF_BRIDGE: port state, and RTM_DELLINK when one leaves the bridge,
            # the device staying) carry no link kind: only the device's own (AF_UNSPEC) say what it is.
            if event not in ("RTM_NEWLINK", "RTM_DELLINK") or m.get("family") == socket.AF_BRIDGE:
                continue
            try:
                lk = _link_of(m)
            except (KeyError, TypeError):
                continue
            if lk.name and lk.name != "lo":
                self._on_change(lk, event == "RTM_NEWLINK")
        own = (m for m in msgs if m.get("event") in ("RTM_NEWADDR", "RTM_DELADDR"))
        if self._reread is not None and any(m.get("scope") not in (RT_SCOPE_LINK, RT_SCOPE_HOST) for m in own):
            self._reread()

    def _lost(self) -> None:
        if self._reread is not None:
            self._reread()


# -- the node's own addresses ------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Address:
    """One address of this network namespace (IPv4 or IPv6)."""

    device: str
    ip: str
    loopback: bool
    """A host-scope address (127.0.0.1 or ::1 on lo) or one in 127.0.0.0/8."""


RT_SCOPE_HOST = 254
RT_SCOPE_LINK = 253
RT_TABLE_MAIN, RT_TABLE_LOCAL = 254, 255
RTN_LOCAL = 2


def list_ipv4_addresses() -> list[Address]:
    """Every IPv4 address of this network namespace, with its device, in the kernel's order."""
    return list_addresses((socket.AF_INET,))


def list_addresses(families: tuple[int, ...] = (socket.AF_INET, socket.AF_INET6)) -> list[Address]:
    """Every address of `families` (socket.AF_*) of this network namespace, with its device, in the kernel's order,
    IPv4 first."""
    with IPRoute() as ipr:
        names = {m["index"]: m.get_attr("IFLA_IFNAME") for m in ipr.get_links()}
        out = []
        for family in families:
            for a in ipr.get_addr(family=family):
                ip = a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
                device = names.get(a["index"], "")
                out.append(Address(device, ip, a["scope"] == RT_SCOPE_HOST or ip.startswith("127.")))
        return out


IFA_F_SECONDARY = 0x01
RT_SCOPE_UNIVERSE = 0


def own_addresses() -> dict[int, list[str]]:
    """Device index -> the addresses it holds of its own, "ip/prefix", in the kernel's order: every IPv4 one and the
    IPv6 ones that are not link-local (which the kernel gives every device that comes up) or host-scoped. Loopback's
    are left out."""
    out: dict[int, list[str]] = {}
    with IPRoute() as ipr:
        for a in ipr.get_addr():
            ip = a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
            link_local = a["family"] == socket.AF_INET6 and a["scope"] == RT_SCOPE_LINK
            if not ip or a["scope"] == RT_SCOPE_HOST or link_local:
                continue
            out.setdefault(a["index"], []).append(f"{ip}/{a['prefixlen']}")
    return out


def primary_ipv4_by_device() -> dict[int, str]:
    """Device index -> its primary IPv4 address, for the devices that have one: the first global-scope address
    that is not a secondary (another address of a subnet the device already has), in the kernel's order. What
    MASQUERADE gives a packet leaving by the device (unless one of its addresses shares the next hop's subnet)."""
    out: dict[int, str] = {}
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET):
            if a["scope"] != RT_SCOPE_UNIVERSE or a["flags"] & IFA_F_SECONDARY or a["index"] in out:
                continue
            ip = a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
            if ip:
                out[a["index"]] = ip
    return out


IFA_F_DADFAILED, IFA_F_DEPRECATED, IFA_F_TENTATIVE = 0x08, 0x20, 0x40


def primary_ipv6_by_device() -> dict[int, str]:
    """Device index -> its first global IPv6 address that is usable as a source (not tentative, deprecated or
    failed duplicate detection), in the kernel's order: what SNAT of IPv6 flows gives a packet leaving by the device
    where the kernel's route lookup cannot name the source (the BPF dataplane's devices map)."""
    out: dict[int, str] = {}
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET6):
            unusable = IFA_F_TENTATIVE | IFA_F_DEPRECATED | IFA_F_DADFAILED
            flags = a.get_attr("IFA_FLAGS") or a["flags"]
            if a["scope"] != RT_SCOPE_UNIVERSE or flags & unusable or a["index"] in out:
                continue
            ip = a.get_attr("IFA_ADDRESS") or a.get_attr("IFA_LOCAL")
            if ip:
                out[a["index"]] = ip
    return out


def default_route_device(family: int = socket.AF_INET) -> str | None:
    """The device of this namespace's default route of `family` (socket.AF_INET or AF_INET6; the first one, by
    metric), None without one."""
    with IPRoute() as ipr:
        routes = [r for r in ipr.get_routes(family=family, table=254) if r["dst_len"] == 0]
        routes.sort(key=lambda r: r.get_attr("RTA_PRIORITY") or 0)
        for r in routes:
            oif = r.get_attr("RTA_OIF")
            if oif is None:
                multipath = r.get_attr("RTA_MULTIPATH") or []
                oif = multipath[0]["oif"] if multipath else None
            if oif is not None:
                found = ipr.get_links(oif)
                if found:
                    return str(found[0].get_attr("IFLA_IFNAME"))
        return None


class AddressWatcher(_Watcher):
    """Calls `on_change()` from a thread of its own whenever an address or a route of the main table of
    `families` (IPv4 unless told) of this network namespace is added or removed (the callback lists again what
    it needs: the events come in bursts), or events were lost. Routes of other tables are not news: what is read
    here is the addresses and the main table's default route, and the local table changes with the addresses
    anyway, or, thousands at once, with the userspace mode's Service routes, each burst of which would otherwise
    list every address again."""

    name = "address-watch"

    _EVENTS = frozenset({"RTM_NEWADDR", "RTM_DELADDR", "RTM_NEWROUTE", "RTM_DELROUTE"})
    _ROUTE_EVENTS = frozenset({"RTM_NEWROUTE", "RTM_DELROUTE"})
    _families: tuple[int, ...] = (socket.AF_INET,)

    def __init__(self, on_change: Callable[[], None], families: tuple[int, ...] = (socket.AF_INET,)) -> None:
        self._on_change = on_change
        self._families = families
        super().__init__()

    def _news(self, m: dict) -> bool:
        if m.get("event") not in self._EVENTS or m.get("family") not in self._families:
            return False
        if m.get("event") in self._ROUTE_EVENTS:
            return (m.get_attr("RTA_TABLE") or m.get("table")) == RT_TABLE_MAIN  # type: ignore[attr-defined]
        return True

    def _handle(self, msgs: list[dict]) -> None:
        if any(self._news(m) for m in msgs):
            self._on_change()

    def _lost(self) -> None:
        self._on_change()


# -- a backend's own device (IPVS mode's kube-ipvs0) ---------------------------------------------------------


@contextlib.contextmanager
def rtnl() -> Iterator[IPRoute]:
    """One rtnetlink socket for a batch of the verbs below."""
    with IPRoute() as ipr:
        yield ipr


def link_index(ipr: IPRoute, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return found[0] if found else None


def ensure_dummy(ipr: IPRoute, name: str) -> int:
    """The index of dummy device `name`, creating it (left down: its addresses are local all the same)."""
    index = link_index(ipr, name)
    if index is None:
        ipr.link("add", ifname=name, kind="dummy")
        index = link_index(ipr, name)
        if index is None:
            raise OSError(f"{name} was created but cannot be found")
    return index


def host_addresses(ipr: IPRoute, name: str) -> frozenset[str]:
    """The global IPv4 and IPv6 addresses on device `name` (none when it does not exist); not the IPv6 link-local
    one the kernel gives a device that is up, which nobody put there."""
    index = link_index(ipr, name)
    if index is None:
        return frozenset()
    return frozenset(a.get_attr("IFA_ADDRESS") for family in (socket.AF_INET, socket.AF_INET6)
                     for a in ipr.get_addr(index=index, family=family) if a["scope"] == RT_SCOPE_UNIVERSE)


def set_host_address(ipr: IPRoute, index: int, verb: str, ip: str) -> None:
    """Add ("add") or remove ("del") `ip`/32 (an IPv6 `ip`/128) on the device with `index`."""
    ipr.addr(verb, index=index, address=ip, prefixlen=128 if family_of(ip) == IPV6 else 32)


_AF = {IPV4: socket.AF_INET, IPV6: socket.AF_INET6}
_HOST_PREFIX = {IPV4: 32, IPV6: 128}


def local_routes(ipr: IPRoute, proto: int, families: Iterable[int] = (IPV4, IPV6)) -> frozenset[str]:
    """The destinations of the host (/32, /128) `local` routes of the local table of `families` (IPV4, IPV6) whose
    routing protocol is `proto`."""
    return frozenset(r.get_attr("RTA_DST") for family in families
                     for r in ipr.get_routes(family=_AF[family], table=RT_TABLE_LOCAL)
                     if r["proto"] == proto and r["type"] == RTN_LOCAL and r["dst_len"] == _HOST_PREFIX[family])


def set_local_route(ipr: IPRoute, verb: str, ip: str, proto: int, index: int) -> None:
    """Add ("add") or remove ("del") `local ip/32 dev <index> table local proto <proto> src ip`, or for an IPv6
    `ip`, `local ip/128 dev <index> table local proto <proto>`: the node then takes packets for `ip` as its own,
    as for one of its addresses, without the address (the kernel inserts a route in O(log n), where an address
    costs a walk of the device's addresses). An IPv4 `ip` may then be bound by any socket, and the node's own
    flows to it leave from it; IPv6 checks a bind against the devices' addresses only, so an IPv6 socket binds it
    with IPV6_FREEBIND, and the kernel refuses a preferred source that is no device's address ("Invalid source
    address"): the node's own flows to it leave from an address source selection picks."""
    family = family_of(ip)
    extra = {"prefsrc": ip} if family == IPV4 else {}
    ipr.route(verb, family=_AF[family], dst=f"{ip}/{_HOST_PREFIX[family]}", table=RT_TABLE_LOCAL, type=RTN_LOCAL,
              proto=proto, scope=RT_SCOPE_HOST, oif=index, **extra)


def delete_link(ipr: IPRoute, name: str) -> bool:
    """Remove device `name`; False when it was not there."""
    index = link_index(ipr, name)
    if index is None:
        return False
    ipr.link("del", index=index)
    return True
