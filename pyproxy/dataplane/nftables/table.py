"""What pyproxy's nftables table holds, as the renderer needs to know it, and how to read that from the kernel.

`TableState` is deliberately coarse: chains by name (with the hook of base chains), sets with their timeouts,
the addresses of `nodeport-ips`, map names and the elements of the verdict maps. Rules are not recorded: a chain
pyproxy writes is always flushed and rewritten whole, so what rules it held before never matters.

Every object a Service owns carries its owner in its name (`service-HASH-ns/name/proto/port`,
`endpoint-HASH-ns/name/proto/port__ip/port`, `external-…`, `local-…`, `firewall-…`, `affinity-…`, as upstream
kube-proxy names them), and the elements of the `no-endpoint-*` maps carry it in their comment. That is what
lets a partial sync find a Service's objects, and a restarted pyproxy adopt a table it did not write, from the
table alone.

`known` is the one thing the kernel does not hold: the endpoints (ready or not) each frontend knew, so a
UDP flow whose endpoint left can be flushed from conntrack. Read back from a table, it is the endpoints that
have a chain, i.e. the ready ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyproxy.model.state import Backend

FAMILY = "ip"
FAMILIES = {4: FAMILY, 6: "ip6"}
"""IP family (model.objects.IPV4, IPV6) -> the nftables family of its table (upstream: `ip kube-proxy`,
`ip6 kube-proxy`)."""
TABLE = "pyproxy"
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
FIREWALL_IPS = "firewall-ips"
NODEPORT_IPS = "nodeport-ips"

SERVICE_PREFIX = "service-"
ENDPOINT_PREFIX = "endpoint-"
AFFINITY_PREFIX = "affinity-"
EXTERNAL_PREFIX = "external-"
LOCAL_PREFIX = "local-"
FIREWALL_PREFIX = "firewall-"
HASH_LEN = 8
# Separates a service port's part of an endpoint chain's name from the endpoint's `ip/port`.
ENDPOINT_SEP = "__"

ElemKey = tuple[str, str, int]
"""(address, "tcp"|"udp"|"sctp", port): a key of the verdict maps. The node-port maps are keyed by protocol and
port alone (`tcp . 30080`): their keys have "" for the address."""


@dataclass(frozen=True, slots=True)
class Hook:
    """What makes a chain a base chain."""

    type: str
    hook: str
    priority: int


@dataclass(frozen=True, slots=True)
class Elem:
    verdict: str
    """`goto CHAIN`."""
    comment: str | None = None


@dataclass(frozen=True)
class TableState:
    present: bool = False
    chains: Mapping[str, Hook | None] = field(default_factory=dict)
    """Every chain; base chains map to their hook."""
    sets: Mapping[str, int | None] = field(default_factory=dict)
    """Every set -> its timeout in seconds."""
    maps: frozenset[str] = frozenset()
    nodeport_ips: frozenset[str] | None = None
    """The addresses in the `nodeport-ips` set; None: not known (a full sync writes them anyway)."""
    elements: Mapping[str, Mapping[ElemKey, Elem]] = field(default_factory=dict)
    """Map name -> its elements."""
    known: Mapping[ElemKey, frozenset[Backend]] = field(default_factory=dict)
    """Frontend -> every endpoint it knew when last written (not in the kernel; see the module docstring)."""

    def elems(self, map_name: str) -> Mapping[ElemKey, Elem]:
        return self.elements.get(map_name, {})


def _strip_hash(rest: str) -> str | None:
    """`HASH-ns/name/...` -> `ns/name/...`, or None when `rest` does not look like that."""
    if len(rest) <= HASH_LEN or rest[HASH_LEN] != "-":
        return None
    return rest[HASH_LEN + 1:]


def port_part(name: str) -> str | None:
    """`ns/name/proto/port` of a service, endpoint or affinity object's name; None for other names."""
    for prefix in (SERVICE_PREFIX, ENDPOINT_PREFIX, AFFINITY_PREFIX, EXTERNAL_PREFIX, LOCAL_PREFIX, FIREWALL_PREFIX):
        if name.startswith(prefix):
            rest = _strip_hash(name[len(prefix):])
            return rest.split(ENDPOINT_SEP, 1)[0] if rest and "/" in rest else None
    return None


def owner(name: str) -> str | None:
    """The Service key (`ns/name`) owning a chain or set of this name; None for pyproxy's own objects."""
    part = port_part(name)
    if part is None:
        return None
    ns, _, rest = part.partition("/")
    return f"{ns}/{rest.split('/', 1)[0]}"


def elem_owner(map_name: str, elem: Elem) -> str | None:
    """The Service key owning a map element: named by its target chain, or by its comment (`ns/name:port`)."""
    if map_name in (SERVICE_IPS, SERVICE_NODEPORTS, FIREWALL_IPS):
        return owner(verdict_target(elem.verdict))
    return elem.comment.split(":", 1)[0] if elem.comment else None


def verdict_target(verdict: str) -> str:
    return verdict.split(" ", 1)[1] if " " in verdict else ""


def endpoint_of(chain: str) -> Backend | None:
    """The endpoint an `endpoint-…__ip/port` chain DNATs to, or an `affinity-…__ip/port` set pins its clients to."""
    if not chain.startswith((ENDPOINT_PREFIX, AFFINITY_PREFIX)) or ENDPOINT_SEP not in chain:
        return None
    ip, _, port = chain.rsplit(ENDPOINT_SEP, 1)[1].partition("/")
    parts = ip.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):  # IPv6, its colons written as dots (render.py)
        ip = ip.replace(".", ":")
    return Backend(ip, int(port)) if port.isdigit() else None


# ------------------------------------------------------------------------------------------ reading a listing


def parse_listing(doc: Mapping[str, Any], family: str = FAMILY) -> TableState:
    """The state of the table of `family` ("ip", "ip6") from `nft -j list table ip pyproxy`'s output (parsed
    JSON), or from listings of a whole family's chains, sets and maps, of which only our table's count."""
    chains: dict[str, Hook | None] = {}
    sets: dict[str, int | None] = {}
    maps: set[str] = set()
    elements: dict[str, dict[ElemKey, Elem]] = {}
    present = False
    nodeport_ips = None
    for item in doc.get("nftables", []):
        obj = next(iter(item.values()), None)
        if not isinstance(obj, dict) or obj.get("table", TABLE) != TABLE or obj.get("family", family) != family:
            continue
        if "table" in item:
            if obj.get("name", TABLE) != TABLE:
                continue
            present = True
        elif "chain" in item:
            c = item["chain"]
            chains[c["name"]] = Hook(c["type"], c["hook"], int(c["prio"])) if "hook" in c else None
        elif "set" in item:
            s = item["set"]
            sets[s["name"]] = s.get("timeout")
            if s["name"] == NODEPORT_IPS:
                nodeport_ips = frozenset(e for e in s.get("elem", []) if isinstance(e, str))
        elif "map" in item:
            m = item["map"]
            maps.add(m["name"])
            elements[m["name"]] = dict(_map_elements(m.get("elem", [])))
    return TableState(present=present, chains=chains, sets=sets, maps=frozenset(maps), elements=elements,
                      nodeport_ips=nodeport_ips,
                      known=_known_from_chains(chains, {**elements.get(SERVICE_IPS, {}),
                                                        **elements.get(SERVICE_NODEPORTS, {})}))


def _map_elements(raw: list[Any]) -> Iterator[tuple[ElemKey, Elem]]:
    for key, value in raw:
        comment = None
        if isinstance(key, dict) and "elem" in key:  # an element with a comment (or a timeout)
            comment = key["elem"].get("comment")
            key = key["elem"]["val"]
        parts = key["concat"] if isinstance(key, dict) and "concat" in key else None
        verdict = next(iter(value.items()), None) if isinstance(value, dict) else None
        if parts is None or len(parts) not in (2, 3) or verdict is None:
            continue  # not an element pyproxy writes; a full sync replaces the map's contents anyway
        if len(parts) == 2:
            parts = ["", *parts]  # a node-port map's `proto . port`
        kind, arg = verdict
        target = arg.get("target", "") if isinstance(arg, dict) else ""
        yield (str(parts[0]), str(parts[1]), int(parts[2])), Elem(f"{kind} {target}".strip(), comment)


def _known_from_chains(chains: Mapping[str, Hook | None], service_ips: Mapping[ElemKey, Elem]) -> dict[
        ElemKey, frozenset[Backend]]:
    by_port: dict[str, set[Backend]] = {}
    for name in chains:
        part, backend = port_part(name), endpoint_of(name)
        if part is not None and backend is not None:
            by_port.setdefault(part, set()).add(backend)
    return {key: frozenset(by_port.get(port_part(verdict_target(e.verdict)) or "", ()))
            for key, e in service_ips.items()}
