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
