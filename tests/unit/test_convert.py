import contextlib
import copy
import ipaddress
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from pyproxy.k8s.convert import endpointslice_from_dict, node_from_dict, service_from_dict
from pyproxy.model.objects import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    InvalidObject,
    Node,
    Protocol,
    Service,
    ServicePort,
    TrafficPolicy,
)


def service_doc() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.10",
            "clusterIPs": ["10.96.0.10", "fd00::10"],
            "ports": [
                {"name": "http", "port": 80, "targetPort": "web", "nodePort": 30080},
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
            ],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
            "externalIPs": ["192.0.2.10", "2001:db8::10"],
            "externalTrafficPolicy": "Local",
            "internalTrafficPolicy": "Cluster",
            "healthCheckNodePort": 31000,
            "loadBalancerSourceRanges": [" 198.51.100.0/24", "203.0.113.7/16 ", "2001:db8::/32"],
            "trafficDistribution": "PreferClose",
        },
        "status": {
            "loadBalancer": {
                "ingress": [
                    {"ip": "203.0.113.10"},
                    {"hostname": "lb.example.com"},
                    {"ip": "203.0.113.11", "ipMode": "Proxy"},
                    {"ip": "2001:db8::11", "ipMode": "VIP"},
                ]
            }
        },
    }


def node_doc() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}},
        "status": {
            "addresses": [
                {"type": "Hostname", "address": "node-a"},
                {"type": "ExternalIP", "address": "192.0.2.5"},
                {"type": "InternalIP", "address": "fd00::5"},
                {"type": "InternalIP", "address": "10.0.0.5"},
            ]
        },
    }


def slice_doc() -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-abc",
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": "web"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2024-05-01T12:00:00Z"},
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.0.0.1"], "nodeName": "node-a", "zone": "z1",
             "hints": {"forZones": [{"name": "z2"}, {"name": "z1"}, {"name": "z2"}]}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        ],
        "ports": [{"name": "http", "port": 8080}, {"name": "dns", "port": 5353, "protocol": "UDP"}],
    }


def test_a_service_converts_with_its_addresses_of_both_families_ports_and_policies() -> None:
    assert service_from_dict(service_doc()) == Service(
        namespace="shop",
        name="web",
        type="LoadBalancer",
        cluster_ips=("10.96.0.10", "fd00::10"),
        ports=(
            ServicePort("http", 80, Protocol.TCP, "web", 30080),
            ServicePort("dns", 53, Protocol.UDP, 5353),
        ),
        session_affinity="ClientIP",
        session_affinity_timeout=600,
        external_ips=("192.0.2.10", "2001:db8::10"),
        # Not the hostname-only ingress, nor the one a proxying load balancer (ipMode Proxy) has.
        load_balancer_ips=("203.0.113.10", "2001:db8::11"),
        external_traffic_policy=TrafficPolicy.LOCAL,
        internal_traffic_policy=TrafficPolicy.CLUSTER,
        health_check_node_port=31000,
        # Trimmed, host bits cleared, of both families.
        load_balancer_source_ranges=("198.51.100.0/24", "203.0.0.0/16", "2001:db8::/32"),
        traffic_distribution="PreferClose",
    )


def test_scheduler_and_weights_come_from_pyproxy_annotations() -> None:
    doc = set_path(service_doc(), "metadata.annotations", {
        "pyproxy.io/scheduler": " wrr ", "pyproxy.io/weights": "10.244.2.7=0, 10.244.1.5=3,",
    })
    svc = service_from_dict(doc)
    assert (svc.scheduler, svc.weights) == ("wrr", (("10.244.1.5", 3), ("10.244.2.7", 0)))
    plain = service_from_dict(service_doc())
    assert (plain.scheduler, plain.weights) == ("", ())


@pytest.mark.parametrize(
    ("annotations", "mode"),
    [
        ({"service.kubernetes.io/topology-mode": "Auto"}, "Auto"),
        ({"service.kubernetes.io/topology-aware-hints": "auto"}, "auto"),
        # The newer annotation wins, as upstream's serviceInfo reads it first.
        ({"service.kubernetes.io/topology-mode": "Disabled", "service.kubernetes.io/topology-aware-hints": "Auto"},
         "Disabled"),
        ({}, ""),
    ],
)
def test_topology_mode_comes_from_the_annotation_or_its_older_name(annotations: dict[str, str], mode: str) -> None:
    svc = service_from_dict(set_path(service_doc(), "metadata.annotations", annotations))
    assert svc.topology_mode == mode


def test_a_minimal_service_gets_the_api_defaults() -> None:
    svc = service_from_dict(
        {"metadata": {"name": "web"}, "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}}
    )
    assert svc == Service(
        "default", "web", "ClusterIP", ("10.96.0.10",), (ServicePort("", 80, Protocol.TCP, 80),)
    )
    assert svc.session_affinity == "None"
    assert svc.session_affinity_timeout == 10800
    assert svc.external_traffic_policy is svc.internal_traffic_policy is TrafficPolicy.CLUSTER
    assert (svc.external_ips, svc.load_balancer_ips, svc.load_balancer_source_ranges) == ((), (), ())
    assert svc.health_check_node_port is None
    assert (svc.traffic_distribution, svc.topology_mode) == ("", "")


@pytest.mark.parametrize(("path", "value"), [("spec.externalTrafficPolicy", ""), ("spec.externalTrafficPolicy", None),
                                             ("spec.internalTrafficPolicy", ""), ("spec.healthCheckNodePort", 0)])
def test_empty_policies_and_a_zero_health_check_port_are_the_api_defaults(path: str, value: Any) -> None:
    svc = service_from_dict(set_path(service_doc(), path, value))
    field = {"spec.externalTrafficPolicy": "external_traffic_policy", "spec.internalTrafficPolicy":
             "internal_traffic_policy", "spec.healthCheckNodePort": "health_check_node_port"}[path]
    assert getattr(svc, field) == getattr(Service("shop", "web", "ClusterIP", (), ()), field)


def test_a_node_converts_with_its_addresses_and_primary_ipv4() -> None:
    node = node_from_dict(node_doc())
    assert node == Node(
        "node-a",
        labels=(("topology.kubernetes.io/zone", "z1"),),
        addresses=(("Hostname", "node-a"), ("ExternalIP", "192.0.2.5"), ("InternalIP", "fd00::5"),
                   ("InternalIP", "10.0.0.5")),
    )
    # As upstream's GetNodeHostIPs: InternalIPs before ExternalIPs, whatever the order in the object.
    assert node.primary_ipv4 == "10.0.0.5"
    only_external = set_path(node_doc(), "status.addresses", [{"type": "ExternalIP", "address": "192.0.2.5"}])
    assert node_from_dict(only_external).primary_ipv4 == "192.0.2.5"
    assert node_from_dict(set_path(node_doc(), "status.addresses", [])).primary_ipv4 is None
    assert not node.deleting


@pytest.mark.parametrize(("path", "value", "deleting"), [
    ("metadata.deletionTimestamp", "2026-11-25T13:00:00Z", True),
    ("spec", {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}]},
     True),
    ("spec", {"taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}, False),
])
def test_a_node_being_deleted_says_so(path: str, value: Any, deleting: bool) -> None:
    """Upstream's NodeEligible: neither a deletionTimestamp nor the cluster autoscaler's deletion taint."""
    assert node_from_dict(set_path(node_doc(), path, value)).deleting is deleting


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("status.addresses.3.address", "10.0.0.300", "status.addresses[3].address '10.0.0.300' is not an IP address"),
        ("status.addresses.1.address", "", "status.addresses[1].address '' is not an IP address"),
        ("status.addresses.0", "node-a", "status.addresses[0] must be an object"),
        ("metadata.labels", {"zone": 1}, "metadata.labels['zone'] must be a string"),
    ],
)
def test_an_invalid_node_is_rejected_with_a_clear_reason(path: str, value: Any, reason: str) -> None:
    with pytest.raises(InvalidObject) as caught:
        node_from_dict(set_path(node_doc(), path, value))
    assert (caught.value.kind, caught.value.key) == ("Node", "node-a")
    assert caught.value.reason.startswith(reason)


@pytest.mark.parametrize("cluster_ip", ["None", "", None])
def test_headless_or_unallocated_services_have_no_cluster_ip(cluster_ip: str | None) -> None:
    doc = service_doc()
    del doc["spec"]["clusterIPs"]
    doc["spec"]["clusterIP"] = cluster_ip
    assert service_from_dict(doc).cluster_ips == ()


def test_a_slice_converts_with_conditions_topology_and_trigger_time() -> None:
    assert endpointslice_from_dict(slice_doc()) == EndpointSlice(
        namespace="shop",
        name="web-abc",
        service_name="web",
        address_type="IPv4",
        endpoints=(
            Endpoint(("10.0.0.1",), node_name="node-a", zone="z1", zone_hints=("z1", "z2")),
            Endpoint(("10.0.0.2",), ready=False, serving=True, terminating=True),
        ),
        ports=(EndpointPort("http", 8080, Protocol.TCP), EndpointPort("dns", 5353, Protocol.UDP)),
    )
    expected = datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp()
    assert endpointslice_from_dict(slice_doc()).trigger_time == expected


def test_v1beta1_and_v1_normalise_to_the_same_object() -> None:
    beta = slice_doc()
    beta["apiVersion"] = "discovery.k8s.io/v1beta1"
    first = beta["endpoints"][0]
    del first["nodeName"], first["zone"]
    # v1beta1 carried hints.forZones too, in the same shape.
    first["topology"] = {"kubernetes.io/hostname": "node-a", "topology.kubernetes.io/zone": "z1"}
    assert endpointslice_from_dict(beta) == endpointslice_from_dict(slice_doc())


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ({}, (True, True, False)),
        ({"ready": None}, (True, True, False)),
        ({"ready": False}, (False, False, False)),
        ({"ready": False, "serving": True, "terminating": True}, (False, True, True)),
    ],
)
def test_absent_conditions_follow_the_api_defaults(
    conditions: dict[str, Any], expected: tuple[bool, ...]
) -> None:
    doc = slice_doc()
    doc["endpoints"] = [{"addresses": ["10.0.0.1"], "conditions": conditions}]
    ep = endpointslice_from_dict(doc).endpoints[0]
    assert (ep.ready, ep.serving, ep.terminating) == expected


def test_a_slice_port_without_a_number_is_skipped() -> None:
    doc = slice_doc()
    doc["ports"] = [{"name": "all", "port": None}, {"name": "http", "port": 8080}]
    assert endpointslice_from_dict(doc).ports == (EndpointPort("http", 8080, Protocol.TCP),)


@pytest.mark.parametrize("stamp", ["yesterday", 1714564800, "2024-05-01T12:00:00"])
def test_an_unparsable_trigger_time_is_ignored(stamp: object) -> None:
    doc = slice_doc()
    doc["metadata"]["annotations"]["endpoints.kubernetes.io/last-change-trigger-time"] = stamp
    assert endpointslice_from_dict(doc).trigger_time is None


Path = tuple[str | int, ...]


def set_path(doc: dict[str, Any], path: Path | str, value: Any) -> dict[str, Any]:
    """A copy of `doc` with `path` set to `value`; a str path is dotted, with list indices as numbers."""
    if isinstance(path, str):
        path = tuple(int(p) if p.isdigit() else p for p in path.split("."))
    doc = copy.deepcopy(doc)
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("metadata.name", None, "metadata.name is missing"),
        ("metadata", ["web"], "metadata must be an object"),
        ("spec.type", "Magic", "spec.type 'Magic' is not one of"),
        ("spec.clusterIPs.0", "10.96.0.300", "spec.clusterIPs[0] '10.96.0.300' is not an IP address"),
        ("spec.clusterIPs", "10.96.0.10", "spec.clusterIPs must be a list"),
        ("spec.ports.0.port", 0, "spec.ports[0].port 0 is outside 1-65535"),
        ("spec.ports.0.port", 70000, "spec.ports[0].port 70000 is outside 1-65535"),
        ("spec.ports.0.port", None, "spec.ports[0].port is missing"),
        ("spec.ports.0.port", "80", "spec.ports[0].port must be an integer, not '80'"),
        ("spec.ports.0.port", True, "spec.ports[0].port must be an integer"),
        ("spec.ports.0.nodePort", 99999, "spec.ports[0].nodePort 99999 is outside 1-65535"),
        ("spec.ports.1.protocol", "ICMP", "spec.ports[1].protocol 'ICMP' is not one of TCP, UDP, SCTP"),
        ("spec.ports.1.name", "http", "spec.ports[1].name 'http' is used by another port"),
        ("spec.ports.1.name", None, "spec.ports[1].name is required when a Service has more than one port"),
        ("spec.ports.1", {"name": "alt", "port": 80}, "spec.ports[1]: port 80/TCP is used by another port"),
        ("spec.ports.1", "53/UDP", "spec.ports[1] must be an object"),
        ("spec.sessionAffinity", "Cookie", "spec.sessionAffinity 'Cookie' is not one of None, ClientIP"),
        (
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            0,
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds 0 is outside 1-86400",
        ),
        ("spec.externalIPs.1", "192.0.2", "spec.externalIPs[1] '192.0.2' is not an IP address"),
        ("spec.externalIPs.1", "2001:db8::g", "spec.externalIPs[1] '2001:db8::g' is not an IP address"),
        ("spec.clusterIPs.1", "fd00::10::1", "spec.clusterIPs[1] 'fd00::10::1' is not an IP address"),
        ("spec.clusterIPs.1", "10.96.0.11", "spec.clusterIPs holds two IPv4 addresses; at most one IPv4 and one IPv6"),
        ("spec.clusterIPs", ["10.96.0.10", "fd00::10", "fd00::11"], "spec.clusterIPs holds 3 addresses"),
        ("spec.ipFamilies", ["IPv6", "IPv4"], "spec.clusterIPs[0] '10.96.0.10' is IPv4, but spec.ipFamilies is"),
        ("spec.ipFamilies", ["IPv4"], "spec.clusterIPs[1] 'fd00::10' is IPv6, but spec.ipFamilies is ['IPv4']"),
        ("spec.ipFamilies", ["IPv4", "IPv4"], "spec.ipFamilies[1] 'IPv4' is given twice"),
        ("spec.ipFamilies", ["ipv6"], "spec.ipFamilies[0] 'ipv6' is not one of IPv4, IPv6"),
        ("spec.ipFamilyPolicy", "DualStack", "spec.ipFamilyPolicy 'DualStack' is not one of SingleStack, "),
        ("spec.ipFamilyPolicy", "SingleStack", "spec.clusterIPs holds two addresses, but spec.ipFamilyPolicy is Sing"),
        ("spec.clusterIPs", ["fd00::10"], None),  # RequireDualStack (set below) with one family
        ("status.loadBalancer.ingress.3.ip", "2001:db8:::11", "status.loadBalancer.ingress[3].ip '2001:db8:::11' is "
                                                              "not an IP address"),
        ("spec.loadBalancerSourceRanges.2", "2001:db8::/129", "spec.loadBalancerSourceRanges[2] '2001:db8::/129' is "
                                                              "not a CIDR"),
        ("spec.externalIPs", "192.0.2.10", "spec.externalIPs must be a list"),
        # "Global" was the pre-1.7 beta annotation's value, never the field's: the API server refuses it too.
        ("spec.externalTrafficPolicy", "Global", "spec.externalTrafficPolicy 'Global' is not one of Cluster, Local"),
        ("spec.externalTrafficPolicy", "local", "spec.externalTrafficPolicy 'local' is not one of Cluster, Local"),
        ("spec.internalTrafficPolicy", "PreferLocal", "spec.internalTrafficPolicy 'PreferLocal' is not one of"),
        ("spec.healthCheckNodePort", 65536, "spec.healthCheckNodePort 65536 is outside 1-65535"),
        ("spec.healthCheckNodePort", -1, "spec.healthCheckNodePort -1 is outside 1-65535"),
        ("spec.loadBalancerSourceRanges.1", "10.0.0.0/33", "spec.loadBalancerSourceRanges[1] '10.0.0.0/33' is not a"),
        ("spec.loadBalancerSourceRanges.0", "10.0.0.1", "spec.loadBalancerSourceRanges[0] '10.0.0.1' is not a CIDR"),
        ("spec.loadBalancerSourceRanges.0", "office", "spec.loadBalancerSourceRanges[0] 'office' is not a CIDR"),
        ("status.loadBalancer.ingress.0.ip", "203.0.113", "status.loadBalancer.ingress[0].ip '203.0.113' is not an IP"),
        ("status.loadBalancer.ingress.0.ipMode", "NAT", "status.loadBalancer.ingress[0].ipMode 'NAT' is not one of"),
        ("status.loadBalancer", [], "status.loadBalancer must be an object"),
        # The API server admits only string annotations.
        ("metadata.annotations", {"pyproxy.io/scheduler": 3}, "metadata.annotations[pyproxy.io/scheduler] must be a"),
    ],
)
def test_an_invalid_service_is_rejected_with_a_clear_reason(path: str, value: Any, reason: str | None) -> None:
    doc = set_path(service_doc(), path, value)
    if reason is None:
        doc["spec"]["ipFamilyPolicy"] = "RequireDualStack"
        reason = "spec.ipFamilyPolicy is RequireDualStack, but spec.clusterIPs holds only the IPv6 fd00::10"
    with pytest.raises(InvalidObject) as caught:
        service_from_dict(doc)
    assert caught.value.kind == "Service"
    assert caught.value.reason.startswith(reason)
    if path != "metadata":
        assert caught.value.key == ("shop/<unnamed>" if path == "metadata.name" else "shop/web")


@pytest.mark.parametrize(("name", "value", "reason"), [
    ("scheduler", "wlc", " 'wlc' is not one of random, rr, wrr, lc, sed, nq, sh, dh, maglev: the node's default "
                         "scheduler applies"),
    ("weights", "10.0.0.1:3", ": '10.0.0.1:3' is not address=weight with a weight of 0-100: every endpoint weighs 1"),
    ("weights", "10.0.0.1=101", ": '10.0.0.1=101' is not address=weight"),
    ("weights", "10.0.0.1=-1", ": '10.0.0.1=-1' is not address=weight"),
    ("weights", "10.0.0.2=0, pod-a=1", ": 'pod-a' is not an IP address: every endpoint weighs 1"),
    ("weights", "10.0.0.1=1, 10.0.0.1=2", ": 10.0.0.1 is given two weights"),
])
def test_a_malformed_pyproxy_annotation_is_ignored_and_the_service_kept(name: str, value: str, reason: str) -> None:
    """The API server checks no annotation: a typo in one of pyproxy's must not take the Service's traffic away.
    It is ignored whole (a half-read weights list could quiesce the wrong endpoints), with the reason."""
    svc = service_from_dict(set_path(service_doc(), "metadata.annotations", {f"pyproxy.io/{name}": value}))
    assert (svc.scheduler, svc.weights) == ("", ())
    assert svc.ignored == (f"metadata.annotations[pyproxy.io/{name}]{reason}",) or \
        svc.ignored[0].startswith(f"metadata.annotations[pyproxy.io/{name}]{reason}"), svc.ignored
    assert service_from_dict(service_doc()).ignored == ()


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("metadata.labels", {}, "the kubernetes.io/service-name label is missing"),
        ("addressType", "IPX", "addressType 'IPX' is not one of IPv4, IPv6, FQDN"),
        ("addressType", None, "addressType '' is not one of"),
        ("endpoints.0.addresses.0", "fd00::1", "endpoints[0].addresses[0] 'fd00::1' is not an IPv4 address"),
        ("endpoints.0.addresses.0", "10.0.0", "endpoints[0].addresses[0] '10.0.0' is not an IPv4 address"),
        ("addressType", "IPv6", "endpoints[0].addresses[0] '10.0.0.1' is not an IPv6 address"),
        ("endpoints.0.addresses", [], "endpoints[0].addresses is empty"),
        ("endpoints.0.conditions", {"ready": "yes"}, "endpoints[0].conditions.ready must be true or false"),
        ("endpoints.0", ["10.0.0.1"], "endpoints[0] must be an object"),
        ("endpoints.0.hints", [], "endpoints[0].hints must be an object"),
        ("endpoints.0.hints.forZones", {"name": "z1"}, "endpoints[0].hints.forZones must be a list"),
        ("endpoints.0.hints.forZones.1", "z1", "endpoints[0].hints.forZones[1] must be an object"),
        ("endpoints.0.hints.forZones.1", {}, "endpoints[0].hints.forZones[1].name is missing"),
        ("endpoints.0.hints.forZones.1.name", 1, "endpoints[0].hints.forZones[1].name must be a string"),
        ("ports.0.port", 65536, "ports[0].port 65536 is outside 1-65535"),
        ("ports.0.port", "8080", "ports[0].port must be an integer"),
        ("ports.1.protocol", "udp", "ports[1].protocol 'udp' is not one of TCP, UDP, SCTP"),
    ],
)
def test_an_invalid_slice_is_rejected_with_a_clear_reason(path: str, value: Any, reason: str) -> None:
    with pytest.raises(InvalidObject) as caught:
        endpointslice_from_dict(set_path(slice_doc(), path, value))
    assert (caught.value.kind, caught.value.key) == ("EndpointSlice", "shop/web-abc")
    assert caught.value.reason.startswith(reason)


def test_ipv6_slice_addresses_are_checked_and_kept_canonical() -> None:
    doc = set_path(slice_doc(), "addressType", "IPv6")
    doc["endpoints"] = [{"addresses": ["FD00:0:0::0001"]}, {"addresses": ["fd00::2"], "conditions": {"ready": False}}]
    eps = endpointslice_from_dict(doc)
    assert eps.address_type == "IPv6"
    assert [e.addresses for e in eps.endpoints] == [("fd00::1",), ("fd00::2",)]
    doc["endpoints"][1]["addresses"] = ["fd00::2", "fd00::zz"]
    with pytest.raises(InvalidObject) as caught:
        endpointslice_from_dict(doc)
    assert caught.value.reason == "endpoints[1].addresses[1] 'fd00::zz' is not an IPv6 address"


def test_dual_stack_fields_convert() -> None:
    doc = service_doc()
    doc["spec"] |= {"ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "PreferDualStack",
                    "clusterIPs": ["FD00::0010", "10.96.0.10"]}
    svc = service_from_dict(doc)
    assert (svc.cluster_ips, svc.ip_families, svc.ip_family_policy) == (
        ("fd00::10", "10.96.0.10"), ("IPv6", "IPv4"), "PreferDualStack")
    # PreferDualStack on a single-stack cluster: one family allocated; SingleStack IPv6.
    doc["spec"] |= {"clusterIPs": ["fd00::10"], "clusterIP": "fd00::10"}
    assert service_from_dict(doc).cluster_ips == ("fd00::10",)
    doc["spec"] |= {"ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack"}
    assert service_from_dict(doc).cluster_ips == ("fd00::10",)
    # Weights name IPv6 endpoints too.
    doc["metadata"]["annotations"] = {"pyproxy.io/weights": "fd00:0::1=0,10.0.0.1=2"}
    assert service_from_dict(doc).weights == (("10.0.0.1", 2), ("fd00::1", 0))


def test_ipv6_and_fqdn_slices_check_their_own_address_family() -> None:
    doc = set_path(slice_doc(), "addressType", "IPv6")
    doc["endpoints"] = [{"addresses": ["fd00:0::1"]}]
    assert endpointslice_from_dict(doc).endpoints[0].addresses == ("fd00::1",)
    doc = set_path(slice_doc(), "addressType", "FQDN")
    doc["endpoints"] = [{"addresses": ["web.example.com"]}]
    assert endpointslice_from_dict(doc).endpoints[0].addresses == ("web.example.com",)


def paths(node: Any, prefix: Path = ()) -> Iterator[Path]:
    """The path of every value inside a document."""
    children = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else []
    for key, child in children:
        yield (*prefix, key)
        yield from paths(child, (*prefix, key))


ODD_VALUES: list[Any] = [None, [], ["x"], {}, {"a": 1}, "", "x", 0, -1, 1.5, True]


@pytest.mark.parametrize(
    ("convert", "doc"),
    [(service_from_dict, service_doc()), (endpointslice_from_dict, slice_doc()), (node_from_dict, node_doc())],
)
def test_odd_shapes_anywhere_are_rejected_not_crashed_on(
    convert: Callable[[dict[str, Any]], object], doc: dict[str, Any]
) -> None:
    for path in paths(doc):
        for value in ODD_VALUES:
            with contextlib.suppress(InvalidObject):
                convert(set_path(doc, path, value))
    for top in ODD_VALUES:
        with pytest.raises(InvalidObject):
            convert(top)


def _outcome(doc: Any) -> object:
    try:
        return endpointslice_from_dict(doc)
    except InvalidObject as e:
        return str(e)


def test_the_fast_path_for_endpoints_agrees_with_field_by_field_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain IPv4 endpoints take a fast path; whatever the input, it must give what the full conversion
    gives: the same objects, or the same error (which then comes from the full conversion)."""
    beta = set_path(slice_doc(), "apiVersion", "discovery.k8s.io/v1beta1")
    beta["endpoints"][0] = {"addresses": ["10.0.0.1"], "topology": {"kubernetes.io/hostname": "node-a",
                                                                  "topology.kubernetes.io/zone": "z1"},
                            "hints": {"forZones": [{"name": "z1"}]}}
    docs = []
    for doc in (slice_doc(), beta):
        docs += [set_path(doc, path, value) for path in paths(doc) for value in ODD_VALUES]
        docs += [set_path(doc, "endpoints.0.addresses.0", a)
                 for a in ("010.0.0.1", "10.0.0.01", " 10.0.0.1", "10.0.0.1\n", "10.1", "1.2.3.4.5", "255.255.255.255",
                           "0.0.0.0", "10.0.0.256", "fd00::1", "10.0.0.1/32")]
        docs += [set_path(doc, "endpoints.0.hints.forZones", z) for z in ([], [{"name": "z1", "extra": 1}],
                                                                         [{"name": ""}], [{"name": None}], None)]
        docs += [set_path(doc, "endpoints.0.addresses", ["10.0.0.1", "10.0.0.2"]), set_path(doc, "endpoints", None),
                 set_path(doc, "endpoints", [])]
    v6 = set_path(slice_doc(), "addressType", "IPv6")
    v6["endpoints"] = [{"addresses": ["fd00::1"], "conditions": {"ready": True}, "nodeName": "node-a"}]
    docs += [set_path(v6, path, value) for path in paths(v6) for value in ODD_VALUES]
    docs += [set_path(v6, "endpoints.0.addresses.0", a) for a in IPV6_SPELLINGS]
    docs += [set_path(v6, "endpoints.0.addresses", ["fd00::1", "fd00::2"]),
             set_path(v6, "endpoints.0.addresses", ["fd00::1", "10.0.0.1"])]
    fast = [_outcome(d) for d in docs]
    monkeypatch.setattr("pyproxy.k8s.convert._endpoints_fast", lambda *args: None)
    assert fast == [_outcome(d) for d in docs]
    assert sum(isinstance(f, EndpointSlice) for f in fast) > 50  # not only errors compared


IPV6_SPELLINGS = (
    "fd00::1", "FD00::1", "fd00:0::1", "fd00:0:0:0:0:0:0:1", "fd00::0001", "::", "::1", "::0", "1::", "fd00::",
    "1:0:0:1:0:0:0:1", "1:0:0:1:0:0:1:1", "1:0:1:0:1:0:1:0", "1::1:0:0:1:1", "1:0:0:1::1", "0:0:1::1",
    "::ffff:10.0.0.1", "::ffff:a00:1", "::10.0.0.1", "64:ff9b::10.0.0.1", "fe80::1%eth0", "fd00::1/128",
    "fd00:::1", "fd00::1::2", "1:2:3:4:5:6:7:8:9", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "g::1", " fd00::1",
    "fd00::1\n", "", "1:2:3:4:5:6:7:8",
)
"""IPv6 addresses as written and miswritten: canonical, uncompressed, upper case, dotted quads, zones, invalid."""


def test_the_ipv6_fast_test_takes_only_what_ipaddress_writes() -> None:
    """An address the IPv6 fast path keeps as written must be exactly ipaddress's form of it, and ipaddress's form
    of every address takes the fast path, over every zero-run shape of eight groups, but those with a zone and
    those whose first 80 bits are zero (IPv4-mapped and -compatible: inet_ntop writes them with a dotted quad)."""
    from pyproxy.k8s.convert import _canonical_ipv6

    spellings = list(IPV6_SPELLINGS)
    for mask in range(256):  # each group zero or not: every place and length of zero runs
        groups = [0 if mask >> i & 1 else 0x1000 + i for i in range(8)]
        full = ":".join(f"{g:x}" for g in groups)
        spellings += [full, str(ipaddress.IPv6Address(full))]
    for a in spellings:
        try:
            written = str(ipaddress.IPv6Address(a))
        except ValueError:
            written = None
        if _canonical_ipv6(a):
            assert written == a, a
        elif written == a and "%" not in a and int(ipaddress.IPv6Address(a)) >> 48:
            raise AssertionError(f"{a}: canonical but not taken by the fast path")


def _service_outcome(doc: Any) -> object:
    try:
        return service_from_dict(doc)
    except InvalidObject as e:
        return str(e)


def test_service_addresses_already_canonical_skip_the_parser_and_convert_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ClusterIPs and externalIPs written canonically are kept without ipaddress's parser; any spelling gives what
    the parser gives: the same Service (canonical addresses) or the same error."""
    spellings = [*IPV6_SPELLINGS, "10.0.0.1", "010.0.0.1", "10.0.0.01", "10.1", "10.0.0.256", "0.0.0.0", " 10.0.0.1"]
    docs = [set_path(service_doc(), "spec.externalIPs", [a]) for a in spellings]
    docs += [set_path(set_path(service_doc(), "spec.clusterIPs", ["10.96.0.10", a]), "spec.ipFamilyPolicy",
                      "RequireDualStack") for a in spellings]
    fast = [_service_outcome(d) for d in docs]
    monkeypatch.setattr("pyproxy.k8s.convert._canonical_ipv4", lambda a: False)
    monkeypatch.setattr("pyproxy.k8s.convert._canonical_ipv6", lambda a: False)
    assert fast == [_service_outcome(d) for d in docs]
    assert sum(isinstance(f, Service) for f in fast) > 20
