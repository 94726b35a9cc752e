"""Ordinary Kubernetes YAML for lab scenarios: `v1` Services and Nodes and `discovery.k8s.io/v1` EndpointSlices.

Written as block-style YAML text, the way people write manifests, without a YAML library (stdlib only).
Values are not validated, on purpose: tests also write invalid objects (port 70000, protocol FOO, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True, slots=True)
class Port:
    """One Service port and the backend port it maps to (the EndpointSlice carries that resolved number)."""

    name: str
    port: int
    backend_port: int
    protocol: str = "TCP"
    target_port: int | str | None = None
    """The Service's targetPort when it differs from `backend_port`, e.g. a port name such as "http"."""
    node_port: int | None = None
    """The port's nodePort (NodePort and LoadBalancer Services)."""


# Words YAML 1.1 reads as booleans or null when unquoted.
_YAML_WORDS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}


def _q(value: object) -> str:
    """A scalar: plain when it is an unambiguous word, else a JSON string, which is a valid YAML double-quoted
    scalar (so an IP, "80" or "on" is never misread as a number or a boolean)."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9.-]*", value) and \
            value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


def service(name: str, cluster_ip: str, ports: Sequence[Port], *, namespace: str = "default",
            affinity_seconds: int | None = None, type: str = "ClusterIP",  # noqa: A002 - the field's name
            external_traffic_policy: str | None = None, internal_traffic_policy: str | None = None,
            health_check_node_port: int | None = None, external_ips: Sequence[str] = (),
            load_balancer_ips: Sequence[str] = (), source_ranges: Sequence[str] = (),
            traffic_distribution: str | None = None, annotations: Mapping[str, str] | None = None,
            cluster_ips: Sequence[str] = (), ip_family_policy: str | None = None) -> str:
    """A Service (ClusterIP unless `type` says otherwise); `affinity_seconds` turns on ClientIP session affinity
    for that long; `external_ips` are spec.externalIPs, `load_balancer_ips` its status's ingress IPs,
    `source_ranges` spec.loadBalancerSourceRanges, `traffic_distribution` spec.trafficDistribution;
    `annotations` its metadata's. `cluster_ips`: spec.clusterIPs (the first must be `cluster_ip`), with
    spec.ipFamilies written to match, and `ip_family_policy` spec.ipFamilyPolicy (dual-stack Services)."""
    lines = ["apiVersion: v1", "kind: Service", "metadata:", f"  name: {_q(name)}", f"  namespace: {_q(namespace)}"]
    if annotations:
        lines += ["  annotations:"] + [f"    {_q(k)}: {_q(v)}" for k, v in annotations.items()]
    lines += ["spec:", f"  type: {_q(type)}", f"  clusterIP: {_q(cluster_ip)}"]
    if cluster_ips:
        lines += ["  clusterIPs:"] + [f"  - {_q(ip)}" for ip in cluster_ips]
        lines += ["  ipFamilies:"] + [f"  - {'IPv6' if ':' in ip else 'IPv4'}" for ip in cluster_ips]
    if ip_family_policy is not None:
        lines.append(f"  ipFamilyPolicy: {_q(ip_family_policy)}")
    if traffic_distribution is not None:
        lines.append(f"  trafficDistribution: {_q(traffic_distribution)}")
    if external_traffic_policy is not None:
        lines.append(f"  externalTrafficPolicy: {_q(external_traffic_policy)}")
    if internal_traffic_policy is not None:
        lines.append(f"  internalTrafficPolicy: {_q(internal_traffic_policy)}")
    if health_check_node_port is not None:
        lines.append(f"  healthCheckNodePort: {health_check_node_port}")
    if external_ips:
        lines += ["  externalIPs:"] + [f"  - {_q(ip)}" for ip in external_ips]
    if source_ranges:
        lines += ["  loadBalancerSourceRanges:"] + [f"  - {_q(r)}" for r in source_ranges]
    if affinity_seconds is not None:
        lines += ["  sessionAffinity: ClientIP", "  sessionAffinityConfig:", "    clientIP:",
                  f"      timeoutSeconds: {affinity_seconds}"]
    lines.append("  ports:")
    for p in ports:
        lines += [f"  - name: {_q(p.name)}", f"    port: {p.port}", f"    protocol: {_q(p.protocol)}",
                  f"    targetPort: {_q(p.backend_port if p.target_port is None else p.target_port)}"]
        if p.node_port is not None:
            lines.append(f"    nodePort: {p.node_port}")
    if load_balancer_ips:
        lines += ["status:", "  loadBalancer:", "    ingress:"] + [f"    - ip: {_q(ip)}" for ip in load_balancer_ips]
    return "\n".join(lines) + "\n"


def endpoint_slice(service_name: str, endpoints: Mapping[str, bool | None], ports: Sequence[Port], *,
                   name: str | None = None, namespace: str = "default",
                   node_names: Mapping[str, str] | None = None, terminating: Collection[str] = (),
                   zone_hints: Mapping[str, Sequence[str]] | None = None) -> str:
    """An IPv4 slice, or an IPv6 one when its addresses are IPv6: `endpoints` maps address -> ready (None: no
    conditions, which the API reads as ready); `node_names` address -> the endpoint's nodeName; `terminating` the
    addresses that are terminating and still serving (their ready is then false); `zone_hints` address -> its
    hints.forZones names; its ports are the Service ports' backend ports."""
    lines = ["apiVersion: discovery.k8s.io/v1", "kind: EndpointSlice", "metadata:",
             f"  name: {_q(name or service_name + '-abc12')}", f"  namespace: {_q(namespace)}", "  labels:",
             f"    {SERVICE_NAME_LABEL}: {_q(service_name)}",
             f"addressType: {'IPv6' if any(':' in a for a in endpoints) else 'IPv4'}"]
    lines.append("endpoints:" if endpoints else "endpoints: []")
    for address, ready in endpoints.items():
        lines.append(f"- addresses: [{_q(address)}]")
        if address in terminating:
            lines += ["  conditions:", "    ready: false", "    serving: true", "    terminating: true"]
        elif ready is not None:
            lines += ["  conditions:", f"    ready: {'true' if ready else 'false'}"]
        if node_names and address in node_names:
            lines.append(f"  nodeName: {_q(node_names[address])}")
        if zone_hints and address in zone_hints:
            lines += ["  hints:", "    forZones:"] + [f"    - name: {_q(z)}" for z in zone_hints[address]]
    lines.append("ports:")
    for p in ports:
        lines += [f"- name: {_q(p.name)}", f"  port: {p.backend_port}", f"  protocol: {_q(p.protocol)}"]
    return "\n".join(lines) + "\n"


def node(name: str, labels: Mapping[str, str]) -> str:
    """A Node with `labels` (e.g. topology.kubernetes.io/zone); pyproxy takes the one named as it runs."""
    return "\n".join(["apiVersion: v1", "kind: Node", "metadata:", f"  name: {_q(name)}", "  labels:",
                      *(f"    {_q(k)}: {_q(v)}" for k, v in labels.items())]) + "\n"


def documents(*docs: str) -> str:
    """Several objects in one multi-document YAML file."""
    return "---\n" + "---\n".join(docs)
