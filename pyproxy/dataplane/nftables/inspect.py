"""`pyproxy inspect` for the nftables mode: the view (pyproxy/model/inspection.py) read from `nft -j list table
ip pyproxy`, `nft -j list table ip6 pyproxy` (each family's frontends are in its own table, as upstream's `ip
kube-proxy` and `ip6 kube-proxy`) and the kernel's conntrack table, of both families.

The table holds no Service names but in its objects' names (table.py), so a frontend is named by its port part,
`ns/name/proto/port`. Its endpoints are the endpoint chains of that port part, its ClientIP affinity entries the
elements of the port's `affinity-…` sets (one set per endpoint, each element a client address), and its source
ranges the prefixes its `firewall-…` chain lets through. A dual-stack Service's two families' objects have the
same names, one set in each table: each table is read on its own and the two views joined.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator, Mapping
from typing import Any

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.base import DataplaneError
from pyproxy.dataplane.nftables import table as t
from pyproxy.dataplane.nftables.backend import run_nft
from pyproxy.model import inspection

RANDOM = "random"
"""The numgen draw every service chain makes (upstream's nftables mode has no other scheduler)."""


def read() -> inspection.View | None:
    """The view of this network namespace's tables (ip and ip6), or None when there is no pyproxy table."""
    items: list[Any] = []
    listed = []
    for family in t.FAMILIES.values():
        try:
            items += json.loads(run_nft(["-j", "list", "table", family, t.TABLE])).get("nftables", [])
        except DataplaneError:
            continue  # no such table (or, for ip6, no IPv6 nftables here)
        listed.append(f"nft -j list table {family} {t.TABLE}")
    if not listed:
        return None
    try:
        flows = nf.conntrack_list()
    except DataplaneError:
        flows = []
    out = view({"nftables": items}, flows)
    out.source = ", ".join([*listed, "conntrack -L"])
    return out


def _items(doc: Mapping[str, Any], kind: str, family: str) -> Iterator[dict[str, Any]]:
    for item in doc.get("nftables", []):
        obj = item.get(kind)
        if isinstance(obj, dict) and obj.get("table") == t.TABLE and obj.get("family", family) == family:
            yield obj


def _prefixes(node: Any) -> Iterator[str]:
    """Every address or prefix in a rule's expression (the firewall chain's `ip saddr != { … } drop`)."""
    if isinstance(node, dict):
        if "prefix" in node and isinstance(node["prefix"], dict):
            yield f"{node['prefix']['addr']}/{node['prefix']['len']}"
            return
        for value in node.values():
            yield from _prefixes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _prefixes(value)
    elif isinstance(node, str) and _is_address(node):
        yield f"{node}/{ipaddress.ip_address(node).max_prefixlen}"


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _source_ranges(doc: Mapping[str, Any], family: str) -> dict[str, tuple[str, ...]]:
    """Firewall chain -> the ranges it lets through."""
    out: dict[str, list[str]] = {}
    for rule in _items(doc, "rule", family):
        if rule["chain"].startswith(t.FIREWALL_PREFIX):
            out.setdefault(rule["chain"], []).extend(_prefixes(rule.get("expr", [])))
    return {chain: tuple(sorted(set(ranges))) for chain, ranges in out.items()}


def _affinities(doc: Mapping[str, Any], family: str) -> Iterator[tuple[str, str, str, float]]:
    """(port part, endpoint ip:port, client, seconds left) per element of an affinity set."""
    for s in _items(doc, "set", family):
        name = s["name"]
        part = t.port_part(name)
        backend = t.endpoint_of(name)
        if not name.startswith(t.AFFINITY_PREFIX) or part is None or backend is None:
            continue
        endpoint = str(inspection.Endpoint(backend.ip, backend.port))
        for elem in s.get("elem", []):
            inner = elem.get("elem", {}) if isinstance(elem, dict) else {"val": elem}
            expires = inner.get("expires", s.get("timeout", 0))
            yield part, endpoint, str(inner.get("val")), float(expires)


def view(doc: Mapping[str, Any], ct: list[nf.CtEntry]) -> inspection.View:
    """The view from the tables' JSON listing (either table's or both's) and the conntrack entries."""
    out = inspection.View(mode="nftables")
    for family in t.FAMILIES.values():
        _add_table(out, doc, family)
    out.nodeport_ips.sort(key=lambda ip: (ipaddress.ip_address(ip).version, ipaddress.ip_address(ip)))
    out.flows = list(nf.ct_flows(out, ct))
    return out


def _add_table(out: inspection.View, doc: Mapping[str, Any], family: str) -> None:
    """The frontends, affinity entries and node-port addresses of the table of `family` ("ip", "ip6")."""
    state = t.parse_listing(doc, family)
    node_family = next(f for f, name in t.FAMILIES.items() if name == family)
    endpoints: dict[str, list[inspection.Endpoint]] = {}
    for chain in state.chains:
        part, backend = t.port_part(chain), t.endpoint_of(chain)
        if part is not None and backend is not None:
            endpoints.setdefault(part, []).append(inspection.Endpoint(backend.ip, backend.port))
    for eps in endpoints.values():
        eps.sort(key=lambda e: (ipaddress.ip_address(e.ip), e.port))
    affinity_sec = {part: int(timeout or 0) for name, timeout in state.sets.items()
                    if name.startswith(t.AFFINITY_PREFIX) and (part := t.port_part(name)) is not None}
    ranges = _source_ranges(doc, family)
    firewalled = {key: ranges.get(t.verdict_target(e.verdict), ()) for key, e in state.elems(t.FIREWALL_IPS).items()}
    out.nodeport_ips += sorted(state.nodeport_ips or ())
    by_part: dict[str, list[inspection.Frontend]] = {}
    for map_name in (t.SERVICE_IPS, t.SERVICE_NODEPORTS):
        for (ip, proto, port), elem in state.elems(map_name).items():
            target = t.verdict_target(elem.verdict)
            part = t.port_part(target) or target
            fe = inspection.Frontend(
                ip=ip, port=port, proto=proto.upper(), name=part, service=t.owner(target) or "?",
                scheduler=RANDOM, endpoints=tuple(endpoints.get(part, ())), affinity_sec=affinity_sec.get(part, 0),
                source_ranges=firewalled.get((ip, proto, port), ()), node_family=node_family)
            by_part.setdefault(part, []).append(fe)
            out.frontends.append(fe)
    for map_name in (t.NO_ENDPOINT_SERVICES, t.NO_ENDPOINT_NODEPORTS):
        for (ip, proto, port), elem in state.elems(map_name).items():
            name = elem.comment or "?"
            out.frontends.append(inspection.Frontend(
                ip=ip, port=port, proto=proto.upper(), name=name, service=name.split(":", 1)[0], scheduler=RANDOM,
                empty="refused" if "reject" in elem.verdict else "dropped",
                source_ranges=firewalled.get((ip, proto, port), ()), node_family=node_family))
    for part, endpoint, client, left in _affinities(doc, family):
        for fe in by_part.get(part, ()):
            out.affinities.append(inspection.Affinity(fe.proto, client, fe.ip, fe.port, endpoint, fe.name, left))
