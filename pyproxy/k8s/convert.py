"""Kubernetes objects as decoded JSON/YAML (plain dicts) → model objects.

Shared by the manifest source and the API informers. Input is untrusted: every field is type-checked
and every problem raises `InvalidObject` naming the object and the field, never another exception.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, NoReturn

from pyproxy.model.objects import (
    DEFAULT_SESSION_AFFINITY_TIMEOUT,
    FAMILY_NAMES,
    IP_FAMILY_POLICIES,
    LAST_CHANGE_TRIGGER_TIME_ANNOTATION,
    MAX_WEIGHT,
    NODE_IP_TYPES,
    SCHEDULER_ANNOTATION,
    SCHEDULERS,
    SERVICE_NAME_LABEL,
    TO_BE_DELETED_TAINT,
    TOPOLOGY_AWARE_HINTS_ANNOTATION,
    TOPOLOGY_MODE_ANNOTATION,
    WEIGHTS_ANNOTATION,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    InvalidObject,
    Node,
    Protocol,
    Service,
    ServicePort,
    TrafficPolicy,
    family_of,
    object_key,
)

SERVICE_KIND = "Service"
ENDPOINT_SLICE_KIND = "EndpointSlice"
NODE_KIND = "Node"

_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
_SESSION_AFFINITIES = ("None", "ClientIP")
# A load-balancer ingress's ipMode: VIP (traffic arrives addressed to the ingress IP; the default) or Proxy.
_LB_IP_MODES = ("VIP", "Proxy")
_MAX_AFFINITY_TIMEOUT = 86400  # upstream validation's limit
_ADDRESS_PARSERS: dict[str, Callable[[str], ipaddress.IPv4Address | ipaddress.IPv6Address] | None] = {
    "IPv4": ipaddress.IPv4Address,
    "IPv6": ipaddress.IPv6Address,
    "FQDN": None,
}


def _path(within: str, field: str) -> str:
    return f"{within}.{field}" if within else field


class _Reader:
    """Typed access to the fields of one object; a failure is an InvalidObject naming the object and
    the field's path. An absent field and an explicit null are the same, as in the API."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key

    def fail(self, reason: str) -> NoReturn:
        raise InvalidObject(self.kind, self.key, reason)

    def check(self, value: Any, typ: type | tuple[type, ...], what: str, path: str) -> Any:
        # bool is an int subclass, but `port: true` is no port number.
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            self.fail(f"{path} must be {what}, not {value!r}")
        return value

    def check_field(self, value: Any, typ: type | tuple[type, ...], what: str, within: str, field: str) -> Any:
        """As check(), the path built only for the error: most fields are fine, and most conversions are of
        whole lists of objects at startup."""
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            self.fail(f"{_path(within, field)} must be {what}, not {value!r}")
        return value

    def get(
        self,
        parent: Mapping[str, Any],
        field: str,
        within: str,
        typ: type | tuple[type, ...],
        what: str,
        default: Any,
    ) -> Any:
        value = parent.get(field)
        return default if value is None else self.check_field(value, typ, what, within, field)

    def elements(
        self, parent: Mapping[str, Any], field: str, within: str, typ: type, what: str
    ) -> list[tuple[str, Any]]:
        """(path, element) for each element of a list field, each element checked against `typ`."""
        path = _path(within, field)
        items = self.get(parent, field, within, list, "a list", [])
        return [(f"{path}[{i}]", self.check(v, typ, what, f"{path}[{i}]")) for i, v in enumerate(items)]

    def mapping(self, parent: Mapping[str, Any], field: str, within: str) -> Mapping[str, Any]:
        result: Mapping[str, Any] = self.get(parent, field, within, Mapping, "an object", {})
        return result

    def string(self, parent: Mapping[str, Any], field: str, within: str, default: str = "") -> str:
        result: str = self.get(parent, field, within, str, "a string", default)
        return result

    def flag(self, parent: Mapping[str, Any], field: str, within: str, default: bool) -> bool:
        result: bool = self.get(parent, field, within, bool, "true or false", default)
        return result

    def integer(self, parent: Mapping[str, Any], field: str, within: str) -> int | None:
        result: int | None = self.get(parent, field, within, int, "an integer", None)
        return result

    def optional_port(self, parent: Mapping[str, Any], field: str, within: str) -> int | None:
        number = self.integer(parent, field, within)
        if number is not None and not 1 <= number <= 65535:
            self.fail(f"{_path(within, field)} {number} is outside 1-65535")
        return number

    def port(self, parent: Mapping[str, Any], field: str, within: str) -> int:
        number = self.optional_port(parent, field, within)
        if number is None:
            self.fail(f"{_path(within, field)} is missing")
        return number

    def protocol(self, parent: Mapping[str, Any], within: str) -> Protocol:
        value = self.string(parent, "protocol", within, Protocol.TCP.value)
        try:
            return Protocol(value)
        except ValueError:
            self.fail(f"{within}.protocol {value!r} is not one of {', '.join(Protocol)}")

    def address(
        self,
        path: str,
        value: str,
        parse: Callable[[str], ipaddress.IPv4Address | ipaddress.IPv6Address],
        what: str,
    ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        try:
            return parse(value)
        except ValueError:
            self.fail(f"{path} {value!r} is not {what}")


def _open(
    kind: str, d: Mapping[str, Any], namespaced: bool = True
) -> tuple[_Reader, str, str, Mapping[str, Any]]:
    """A reader named after the object, its namespace, name and metadata."""
    anonymous = _Reader(kind, "<unnamed>")
    anonymous.check(d, Mapping, "an object", "the object")
    meta = anonymous.mapping(d, "metadata", "")
    namespace = anonymous.string(meta, "namespace", "metadata") or "default"
    name = anonymous.string(meta, "name", "metadata")
    reader = _Reader(kind, object_key(namespace, name or "<unnamed>") if namespaced else name or "<unnamed>")
    if not name:
        reader.fail("metadata.name is missing")
    return reader, namespace, name, meta


def _service_port(r: _Reader, entry: Mapping[str, Any], path: str) -> ServicePort:
    port = r.port(entry, "port", path)
    return ServicePort(
        name=r.string(entry, "name", path),
        port=port,
        protocol=r.protocol(entry, path),
        target_port=r.get(entry, "targetPort", path, (int, str), "an integer or a string", port),
        node_port=r.optional_port(entry, "nodePort", path),
    )


def _ips(r: _Reader, entries: list[tuple[str, str]], what: str = "an IP address") -> tuple[str, ...]:
    """The addresses (IPv4 or IPv6) of (path, value) pairs, in canonical form (one written so already is kept
    without ipaddress's parser: `_canonical_ipv4`, `_canonical_ipv6`)."""
    return tuple(value if (_canonical_ipv6 if ":" in value else _canonical_ipv4)(value)
                 else str(r.address(path, value, ipaddress.ip_address, what)) for path, value in entries)


def _ip_families(r: _Reader, spec: Mapping[str, Any]) -> tuple[str, ...]:
    """spec.ipFamilies: each IPv4 or IPv6, each once."""
    families: list[str] = []
    for path, value in r.elements(spec, "ipFamilies", "spec", str, "a string"):
        if value not in FAMILY_NAMES.values():
            r.fail(f"{path} {value!r} is not one of {', '.join(FAMILY_NAMES.values())}")
        if value in families:
            r.fail(f"{path} {value!r} is given twice")
        families.append(value)
    return tuple(families)


def _cluster_ips(r: _Reader, spec: Mapping[str, Any], families: tuple[str, ...], policy: str) -> tuple[str, ...]:
    """spec.clusterIPs (else spec.clusterIP) of both families, at most one each and, when spec.ipFamilies is given,
    in its families and order; SingleStack allows one, RequireDualStack needs one of each (the API server's own
    rules, so a manifest cannot ask for what no cluster would hold)."""
    entries = r.elements(spec, "clusterIPs", "spec", str, "a string") or [
        ("spec.clusterIP", r.string(spec, "clusterIP", "spec"))
    ]
    # "" is not allocated, "None" headless.
    entries = [(p, v) for p, v in entries if v not in ("", "None")]
    ips = _ips(r, entries, 'an IP address, "None" or empty')
    if len(ips) > 2:
        r.fail(f"spec.clusterIPs holds {len(ips)} addresses; at most one IPv4 and one IPv6")
    names = [FAMILY_NAMES[family_of(ip)] for ip in ips]
    if len(names) == 2 and names[0] == names[1]:
        r.fail(f"spec.clusterIPs holds two {names[0]} addresses; at most one IPv4 and one IPv6")
    for i, ((path, value), name) in enumerate(zip(entries, names, strict=True)):
        if families and (i >= len(families) or families[i] != name):
            r.fail(f"{path} {value!r} is {name}, but spec.ipFamilies is {list(families)}")
    if policy == "SingleStack" and len(ips) > 1:
        r.fail("spec.clusterIPs holds two addresses, but spec.ipFamilyPolicy is SingleStack")
    if policy == "RequireDualStack" and len(ips) == 1:
        r.fail(f"spec.ipFamilyPolicy is RequireDualStack, but spec.clusterIPs holds only the {names[0]} {ips[0]}")
    return ips


def _ip_family_policy(r: _Reader, spec: Mapping[str, Any]) -> str:
    policy = r.string(spec, "ipFamilyPolicy", "spec")
    if policy and policy not in IP_FAMILY_POLICIES:
        r.fail(f"spec.ipFamilyPolicy {policy!r} is not one of {', '.join(IP_FAMILY_POLICIES)}")
    return policy


def _traffic_policy(r: _Reader, spec: Mapping[str, Any], field: str) -> TrafficPolicy:
    """spec.externalTrafficPolicy or spec.internalTrafficPolicy; absent or empty: Cluster. "Global" is refused,
    as the API server refuses it: it was a value of the pre-1.7 beta annotation
    `service.beta.kubernetes.io/external-traffic` (OnlyLocal | Global), never of these fields."""
    value = r.string(spec, field, "spec") or TrafficPolicy.CLUSTER.value
    try:
        return TrafficPolicy(value)
    except ValueError:
        r.fail(f"spec.{field} {value!r} is not one of {', '.join(TrafficPolicy)}")


def _source_ranges(r: _Reader, spec: Mapping[str, Any]) -> tuple[str, ...]:
    """spec.loadBalancerSourceRanges: the CIDRs of both families, trimmed (the API's validation lets whitespace
    through, and upstream trims it) and in canonical form (host bits cleared, as Go's ParseCIDR gives them)."""
    ranges: list[str] = []
    for path, value in r.elements(spec, "loadBalancerSourceRanges", "spec", str, "a string"):
        text = value.strip()
        try:
            if "/" not in text:
                raise ValueError(text)
            network = ipaddress.ip_network(text, strict=False)
        except ValueError:
            r.fail(f"{path} {value!r} is not a CIDR")
        ranges.append(str(network))
    return tuple(ranges)


def _load_balancer_ips(r: _Reader, d: Mapping[str, Any]) -> tuple[str, ...]:
    """status.loadBalancer.ingress[].ip of the ingresses whose ipMode is VIP (or unset), of both families."""
    within = "status.loadBalancer"
    status = r.mapping(r.mapping(d, "status", ""), "loadBalancer", "status")
    entries: list[tuple[str, str]] = []
    for path, entry in r.elements(status, "ingress", within, Mapping, "an object"):
        mode = r.string(entry, "ipMode", path, "VIP")
        if mode not in _LB_IP_MODES:
            r.fail(f"{path}.ipMode {mode!r} is not one of {', '.join(_LB_IP_MODES)}")
        ip = r.string(entry, "ip", path)
        if ip and mode == "VIP":  # an ingress may have only a hostname
            entries.append((f"{path}.ip", ip))
    return _ips(r, entries)


def service_from_dict(d: Mapping[str, Any]) -> Service:
    """Convert a `v1` Service; raises InvalidObject if it cannot be served as written."""
    r, namespace, name, meta = _open(SERVICE_KIND, d)
    spec = r.mapping(d, "spec", "")
    svc_type = r.string(spec, "type", "spec", "ClusterIP")
    if svc_type not in _SERVICE_TYPES:
        r.fail(f"spec.type {svc_type!r} is not one of {', '.join(_SERVICE_TYPES)}")

    entries = r.elements(spec, "ports", "spec", Mapping, "an object")
    ports: list[ServicePort] = []
    for path, entry in entries:
        port = _service_port(r, entry, path)
        # Ports are matched to slice ports by name, so names must tell them apart.
        if len(entries) > 1 and not port.name:
            r.fail(f"{path}.name is required when a Service has more than one port")
        if any(p.name == port.name for p in ports):
            r.fail(f"{path}.name {port.name!r} is used by another port")
        if any((p.port, p.protocol) == (port.port, port.protocol) for p in ports):
            r.fail(f"{path}: port {port.port}/{port.protocol} is used by another port")
        ports.append(port)

    affinity = r.string(spec, "sessionAffinity", "spec", "None")
    if affinity not in _SESSION_AFFINITIES:
        r.fail(f"spec.sessionAffinity {affinity!r} is not one of {', '.join(_SESSION_AFFINITIES)}")
    config = r.mapping(spec, "sessionAffinityConfig", "spec")
    client_ip = r.mapping(config, "clientIP", "spec.sessionAffinityConfig")
    within = "spec.sessionAffinityConfig.clientIP"
    timeout = r.integer(client_ip, "timeoutSeconds", within)
    if timeout is not None and not 1 <= timeout <= _MAX_AFFINITY_TIMEOUT:
        r.fail(f"{within}.timeoutSeconds {timeout} is outside 1-{_MAX_AFFINITY_TIMEOUT}")
    # 0 is the API's "unset" (upstream reads it so).
    health_check_node_port = r.integer(spec, "healthCheckNodePort", "spec") or None
    if health_check_node_port is not None and not 1 <= health_check_node_port <= 65535:
        r.fail(f"spec.healthCheckNodePort {health_check_node_port} is outside 1-65535")

    annotations = r.mapping(meta, "annotations", "metadata")
    ignored: list[str] = []
    families = _ip_families(r, spec)
    policy = _ip_family_policy(r, spec)
    return Service(
        namespace=namespace,
        name=name,
        type=svc_type,
        cluster_ips=_cluster_ips(r, spec, families, policy),
        ports=tuple(ports),
        session_affinity=affinity,
        session_affinity_timeout=DEFAULT_SESSION_AFFINITY_TIMEOUT if timeout is None else timeout,
        external_ips=_ips(r, r.elements(spec, "externalIPs", "spec", str, "a string")),
        load_balancer_ips=_load_balancer_ips(r, d),
        external_traffic_policy=_traffic_policy(r, spec, "externalTrafficPolicy"),
        internal_traffic_policy=_traffic_policy(r, spec, "internalTrafficPolicy"),
        health_check_node_port=health_check_node_port,
        load_balancer_source_ranges=_source_ranges(r, spec),
        scheduler=_scheduler(r, annotations, ignored),
        weights=_weights(r, annotations, ignored),
        # Any value is kept: the API server decides which ones it admits, and newer ones ask for nothing here.
        traffic_distribution=r.string(spec, "trafficDistribution", "spec"),
        topology_mode=_annotation(r, annotations, TOPOLOGY_MODE_ANNOTATION)
        or _annotation(r, annotations, TOPOLOGY_AWARE_HINTS_ANNOTATION),
        ip_families=families,
        ip_family_policy=policy,
        ignored=tuple(ignored),
    )


def _annotation(r: _Reader, annotations: Mapping[str, Any], name: str) -> str:
    return str(r.check(annotations.get(name, ""), str, "a string", f"metadata.annotations[{name}]")).strip()


def _scheduler(r: _Reader, annotations: Mapping[str, Any], ignored: list[str]) -> str:
    """The scheduler annotation; one that names no scheduler is ignored (the node's default applies)."""
    scheduler = _annotation(r, annotations, SCHEDULER_ANNOTATION)
    if scheduler and scheduler not in SCHEDULERS:
        ignored.append(f"metadata.annotations[{SCHEDULER_ANNOTATION}] {scheduler!r} is not one of "
                       f"{', '.join(SCHEDULERS)}: the node's default scheduler applies")
        return ""
    return scheduler


def _weights(r: _Reader, annotations: Mapping[str, Any], ignored: list[str]) -> tuple[tuple[str, int], ...]:
    """`address=weight` pairs, comma-separated; each address an IP address, each weight 0-MAX_WEIGHT. A
    malformed annotation is ignored whole (every endpoint weighs 1): half of one could quiesce the wrong ones."""
    text = _annotation(r, annotations, WEIGHTS_ANNOTATION)
    path = f"metadata.annotations[{WEIGHTS_ANNOTATION}]"
    weights: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        address, sep, weight = item.partition("=")
        problem = ""
        try:
            ip = str(ipaddress.ip_address(address.strip())) if sep else ""
        except ValueError:
            problem = f"{address.strip()!r} is not an IP address"
        if not problem and (not sep or not weight.strip().isdigit() or int(weight) > MAX_WEIGHT):
            problem = f"{item!r} is not address=weight with a weight of 0-{MAX_WEIGHT}"
        if not problem and ip in weights:
            problem = f"{ip} is given two weights"
        if problem:
            ignored.append(f"{path}: {problem}: every endpoint weighs 1")
            return ()
        weights[ip] = int(weight)
    return tuple(sorted(weights.items()))


def _endpoint(r: _Reader, entry: Mapping[str, Any], path: str, address_type: str, v1beta1: bool) -> Endpoint:
    addresses = r.elements(entry, "addresses", path, str, "a string")
    if not addresses:
        r.fail(f"{path}.addresses is empty")
    parse = _ADDRESS_PARSERS[address_type]
    if parse is not None:
        addresses = [(p, str(r.address(p, a, parse, f"an {address_type} address"))) for p, a in addresses]

    conditions = r.mapping(entry, "conditions", path)
    within = f"{path}.conditions"
    ready = r.flag(conditions, "ready", within, True)
    if v1beta1:
        topology = r.mapping(entry, "topology", path)
        node_name = r.string(topology, "kubernetes.io/hostname", f"{path}.topology")
        zone = r.string(topology, "topology.kubernetes.io/zone", f"{path}.topology")
    else:
        node_name = r.string(entry, "nodeName", path)
        zone = r.string(entry, "zone", path)
    hints = r.mapping(entry, "hints", path)
    zone_hints = set()
    for zone_path, for_zone in r.elements(hints, "forZones", f"{path}.hints", Mapping, "an object"):
        name = r.string(for_zone, "name", zone_path)
        if not name:
            r.fail(f"{zone_path}.name is missing")
        zone_hints.add(name)
    return Endpoint(
        addresses=tuple(a for _, a in addresses),
        ready=ready,
        serving=r.flag(conditions, "serving", within, ready),
        terminating=r.flag(conditions, "terminating", within, False),
        node_name=node_name or None,
        zone=zone or None,
        zone_hints=tuple(sorted(zone_hints)),
    )


def _canonical_ipv4(address: str) -> bool:
    """Whether `address` is an IPv4 address exactly as ipaddress writes it (so that is what conversion keeps):
    two C calls instead of ipaddress's Python parser, which dominated converting 100,000 endpoints."""
    try:
        return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, address)) == address
    except OSError:
        return False


def _canonical_ipv6(address: str) -> bool:
    """`_canonical_ipv4` for IPv6: inet_ntop and ipaddress both write RFC 5952's form (lower case, no leading
    zeros, the first longest run of two or more zero groups as ::), so an address inet_ntop gives back unchanged is
    also what ipaddress writes. ipaddress's Python parser made an IPv6 slice cost over three times an IPv4 one.
    Not an address with a dotted quad (::ffff:10.0.0.1): ipaddress's form for those depends on the Python
    version; nor one with a zone (fe80::1%eth0), which inet_pton does not take. Those go field by field."""
    if "." in address:
        return False
    try:
        return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, address)) == address
    except OSError:
        return False


_CANONICAL: dict[str, Callable[[str], bool]] = {"IPv4": _canonical_ipv4, "IPv6": _canonical_ipv6}
"""addressType -> whether an address is valid and written as conversion would keep it (the fast path's test)."""


def _endpoints_fast(entries: object, v1beta1: bool, canonical: Callable[[str], bool]) -> tuple[Endpoint, ...] | None:
    """The endpoints of an IPv4 or IPv6 slice (`canonical`: its family's address test) when each is plainly
    well-formed (as the API server and most manifests write them), else None, and the caller converts field by
    field, which names what is wrong. Accepts only what that full conversion accepts, and builds the same objects
    from it."""
    if entries is None:
        return ()
    if type(entries) is not list:
        return None
    out = []
    for e in entries:
        if type(e) is not dict:
            return None
        addresses = e.get("addresses")
        if type(addresses) is not list or not addresses:
            return None
        for a in addresses:
            if type(a) is not str or not canonical(a):
                return None
        conditions = e.get("conditions")
        if conditions is None:
            conditions = {}
        elif type(conditions) is not dict:
            return None
        # Each condition: absent or null means its default, else it must be a bool (inline: 300,000 of them).
        ready, serving, terminating = conditions.get("ready"), conditions.get("serving"), conditions.get("terminating")
        if ready is None:
            ready = True
        elif type(ready) is not bool:
            return None
        if serving is None:
            serving = ready
        elif type(serving) is not bool:
            return None
        if terminating is None:
            terminating = False
        elif type(terminating) is not bool:
            return None
        if v1beta1:
            topology = e.get("topology")
            if topology is None:
                topology = {}
            elif type(topology) is not dict:
                return None
            node_name, zone = topology.get("kubernetes.io/hostname"), topology.get("topology.kubernetes.io/zone")
        else:
            node_name, zone = e.get("nodeName"), e.get("zone")
        if (node_name is not None and type(node_name) is not str) or (zone is not None and type(zone) is not str):
            return None
        hints = e.get("hints")
        zone_hints = () if hints is None else _zone_hints_fast(hints)  # most slices have no hints: no call
        if zone_hints is None:
            return None
        out.append(Endpoint(tuple(addresses), ready, serving, terminating, node_name or None, zone or None,
                            zone_hints))
    return tuple(out)


def _zone_hints_fast(hints: object) -> tuple[str, ...] | None:
    """An endpoint's `hints.forZones` names, as `_endpoint` reads them, when plainly well-formed; else None."""
    if type(hints) is not dict:
        return None
    zones = hints.get("forZones")
    if zones is None:
        return ()
    if type(zones) is not list:
        return None
    names = set()
    for z in zones:
        name = z.get("name") if type(z) is dict else None
        if type(name) is not str or not name:
            return None
        names.add(name)
    return tuple(sorted(names))


def _endpoint_port(r: _Reader, entry: Mapping[str, Any], path: str) -> EndpointPort | None:
    port = r.optional_port(entry, "port", path)
    if port is None:
        # The API allows it ("all ports"); a proxy has nothing to forward to, as upstream.
        return None
    return EndpointPort(name=r.string(entry, "name", path), port=port, protocol=r.protocol(entry, path))


def _trigger_time(value: object) -> float | None:
    """Unix time of an RFC 3339 timestamp; None when absent or unparsable (it only feeds a metric)."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo else None


def endpointslice_from_dict(d: Mapping[str, Any]) -> EndpointSlice:
    """Convert a `discovery.k8s.io/v1` or `v1beta1` EndpointSlice (v1 when `apiVersion` is absent, as
    in the items of a list response); raises InvalidObject if it cannot be used as written."""
    r, namespace, name, meta = _open(ENDPOINT_SLICE_KIND, d)
    service_name = r.string(r.mapping(meta, "labels", "metadata"), SERVICE_NAME_LABEL, "metadata.labels")
    if not service_name:
        r.fail(f"the {SERVICE_NAME_LABEL} label is missing")
    address_type = r.string(d, "addressType", "")
    if address_type not in _ADDRESS_PARSERS:
        r.fail(f"addressType {address_type!r} is not one of {', '.join(_ADDRESS_PARSERS)}")
    v1beta1 = d.get("apiVersion") == "discovery.k8s.io/v1beta1"
    canonical = _CANONICAL.get(address_type)
    endpoints = _endpoints_fast(d.get("endpoints"), v1beta1, canonical) if canonical is not None else None
    if endpoints is None:
        endpoints = tuple(_endpoint(r, e, p, address_type, v1beta1)
                          for p, e in r.elements(d, "endpoints", "", Mapping, "an object"))
    ports = (_endpoint_port(r, e, p) for p, e in r.elements(d, "ports", "", Mapping, "an object"))
    annotations = r.mapping(meta, "annotations", "metadata")
    return EndpointSlice(
        namespace=namespace,
        name=name,
        service_name=service_name,
        address_type=address_type,
        endpoints=endpoints,
        ports=tuple(p for p in ports if p is not None),
        trigger_time=_trigger_time(annotations.get(LAST_CHANGE_TRIGGER_TIME_ANNOTATION)),
    )


def node_from_dict(d: Mapping[str, Any]) -> Node:
    """Convert a `v1` Node; only its name, labels and addresses matter to a proxy. Its InternalIP and ExternalIP
    addresses must be IP addresses (kept in canonical form); the other types are names, kept as written."""
    r, _, name, meta = _open(NODE_KIND, d, namespaced=False)
    labels = r.mapping(meta, "labels", "metadata")
    for key, value in labels.items():
        r.check(value, str, "a string", f"metadata.labels[{key!r}]")
    status = r.mapping(d, "status", "")
    addresses = []
    for path, entry in r.elements(status, "addresses", "status", Mapping, "an object"):
        kind, address = r.string(entry, "type", path), r.string(entry, "address", path)
        if kind in NODE_IP_TYPES:
            address = str(r.address(f"{path}.address", address, ipaddress.ip_address, "an IP address"))
        addresses.append((kind, address))
    spec = r.mapping(d, "spec", "")
    taints = [r.string(t, "key", path) for path, t in r.elements(spec, "taints", "spec", Mapping, "an object")]
    deleting = meta.get("deletionTimestamp") is not None or TO_BE_DELETED_TAINT in taints
    return Node(name=name, labels=tuple(sorted(labels.items())), addresses=tuple(addresses), deleting=deleting)
