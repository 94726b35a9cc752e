"""Which rtnetlink events the node's address watcher passes on: addresses and the main table's routes, not the local
table's (the userspace mode adds thousands of local routes at once), and a lost burst (ENOBUFS) as a change."""

from __future__ import annotations

import socket
from typing import Any

from pyproxy.dataplane import netlink


class Msg(dict):  # type: ignore[type-arg]
    def __init__(self, event: str, table: int | None = None, **fields: Any) -> None:
        super().__init__(event=event, family=socket.AF_INET, table=table or 0, **fields)
        self.attrs = {"RTA_TABLE": table} if table else {}

    def get_attr(self, name: str) -> Any:
        return self.attrs.get(name)


def watcher() -> tuple[netlink.AddressWatcher, list[str]]:
    seen: list[str] = []
    w = object.__new__(netlink.AddressWatcher)  # no thread, no socket: only the filtering is under test
    w._on_change = lambda: seen.append("change")
    return w, seen


def test_addresses_and_main_table_routes_are_news_local_table_routes_are_not() -> None:
    w, seen = watcher()
    w._handle([Msg("RTM_NEWROUTE", netlink.RT_TABLE_LOCAL)] * 500)
    assert seen == []
    w._handle([Msg("RTM_NEWROUTE", netlink.RT_TABLE_LOCAL), Msg("RTM_NEWROUTE", netlink.RT_TABLE_MAIN)])
    w._handle([Msg("RTM_DELADDR")])
    w._handle([Msg("RTM_NEWLINK")])
    assert seen == ["change", "change"]


def test_lost_events_are_a_change() -> None:
    w, seen = watcher()
    w._lost()
    assert seen == ["change"]


class LinkMsg(dict):  # type: ignore[type-arg]
    """An RTM_*LINK message as pyroute2 gives it: `family` AF_UNSPEC for the device's own news, AF_BRIDGE for the
    bridge's news of its port (no IFLA_LINKINFO there)."""

    def __init__(self, event: str, name: str, index: int, *, family: int = socket.AF_UNSPEC, kind: str | None = "veth",
                 master: int | None = None, link: int | None = None, netnsid: int | None = None) -> None:
        super().__init__(event=event, family=family, index=index, ifi_type=netlink.ARPHRD_ETHER, flags=1)
        info = Msg("info")
        info.attrs = {"IFLA_INFO_KIND": kind, "IFLA_INFO_SLAVE_KIND": "bridge" if master else None}
        self.attrs = {"IFLA_IFNAME": name, "IFLA_MASTER": master, "IFLA_LINK": link, "IFLA_LINK_NETNSID": netnsid,
                      "IFLA_LINKINFO": info if kind is not None else None}

    def get_attr(self, name: str) -> Any:
        return self.attrs.get(name)


def link_watcher() -> tuple[netlink.LinkWatcher, list[object]]:
    seen: list[object] = []
    w = object.__new__(netlink.LinkWatcher)  # no thread, no socket
    w._on_change = lambda lk, present: seen.append((lk, present))
    w._reread = lambda: seen.append("reread")
    return w, seen


def test_a_link_event_says_what_the_device_is_stacked_on_and_enslaved_to() -> None:
    w, seen = link_watcher()
    w._handle([LinkMsg("RTM_NEWLINK", "veth1", 7, master=3, link=2, netnsid=1),
               LinkMsg("RTM_NEWLINK", "mv0", 8, kind="macvlan", link=5)])
    assert seen == [(netlink.Link(7, "veth1", "veth", True, True, master=3, slave_kind="bridge", link=0), True),
                    (netlink.Link(8, "mv0", "macvlan", True, True, link=5), True)]


def test_the_bridges_news_of_its_ports_are_not_the_devices_own() -> None:
    # A port leaving its bridge: the bridge says RTM_DELLINK (AF_BRIDGE) of a device that stays, without its kind.
    w, seen = link_watcher()
    w._handle([LinkMsg("RTM_NEWLINK", "veth1", 7, family=socket.AF_BRIDGE, kind=None, master=3),
               LinkMsg("RTM_DELLINK", "veth1", 7, family=socket.AF_BRIDGE, kind=None, master=3)])
    assert seen == []
    w._handle([LinkMsg("RTM_DELLINK", "veth1", 7)])
    assert seen == [(netlink.Link(7, "veth1", "veth", True, True), False)]


def test_an_address_of_a_devices_own_rereads_the_link_watchers_devices_a_link_local_one_does_not() -> None:
    w, seen = link_watcher()
    w._handle([Msg("RTM_NEWADDR", scope=netlink.RT_SCOPE_LINK)] * 3)
    assert seen == []
    w._handle([Msg("RTM_NEWADDR", scope=netlink.RT_SCOPE_LINK), Msg("RTM_DELADDR", scope=netlink.RT_SCOPE_UNIVERSE)])
    w._lost()
    assert seen == ["reread", "reread"]
