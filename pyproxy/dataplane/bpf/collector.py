"""bpf mode's own metrics: what the maps count per frontend and per endpoint, read at each scrape
(`BpfCollector`), and the connection-tracking collector's series beside them."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.dataplane.bpf.gc import CtGcMetrics
from pyproxy.dataplane.bpf.render import (
    AppliedFrontend,
)
from pyproxy.model.state import Backend


class Counted(Protocol):
    """What the collector reads of the dataplane at each scrape (backend.BpfDataplane has each)."""

    @property
    def unserved(self) -> Mapping[str, str]: ...

    def map_usage(self) -> Mapping[str, tuple[int, int]]: ...

    def traffic(self) -> list[FrontendTraffic]: ...

    def endpoint_traffic(self) -> list[EndpointTraffic]: ...

    def datapath_counters(self) -> Mapping[str, int]: ...

log = logging.getLogger(__name__)

class BpfCollector(Collector):
    """The BPF dataplane's own metrics: the connection-tracking collector's, how full the maps the control plane
    fills are (`pyproxy_bpf_map_entries{map}` against `pyproxy_bpf_map_capacity{map}`; a map that is full leaves
    Services out, counted by `pyproxy_bpf_services_unserved`), each frontend's packets and bytes from the stats map
    (`service_traffic_families`: one series per frontend; the maps count nothing per endpoint) and the programs'
    event counters (`pyproxy_bpf_datapath_events_total{event}`, abi.COUNTERS), all read at scrape time."""

    def __init__(self, dataplane: Counted) -> None:
        self.gc = CtGcMetrics()
        self.gc6 = CtGcMetrics("ct6", "IPv6 ")
        self._dataplane = dataplane

    def collect(self) -> Iterator[Metric]:
        yield from self.gc.collect()
        yield from self.gc6.collect()
        entries = GaugeMetricFamily("pyproxy_bpf_map_entries", "Entries of a BPF map as pyproxy last programmed it",
                                    labels=["map"])
        capacity = GaugeMetricFamily("pyproxy_bpf_map_capacity", "Entries a BPF map holds at most (max_entries)",
                                     labels=["map"])
        for name, (n, cap) in sorted(self._dataplane.map_usage().items()):
            entries.add_metric([name], n)
            capacity.add_metric([name], cap)
        yield entries
        yield capacity
        yield GaugeMetricFamily("pyproxy_bpf_services_unserved", "Services not programmed because a BPF map is full",
                                value=len(self._dataplane.unserved))
        yield from service_traffic_families(self._dataplane.traffic())
        yield from endpoint_traffic_families(self._dataplane.endpoint_traffic())
        events = CounterMetricFamily("pyproxy_bpf_datapath_events", "Events of the BPF programs, summed over CPUs "
                                     "(abi.COUNTERS: new_flow, no_backend, ct_full, ...)", labels=["event"])
        for name, n in self._dataplane.datapath_counters().items():
            events.add_metric([name], n)
        yield events


class FrontendTraffic(NamedTuple):
    """What the stats map counted for one frontend (a services map entry) since its service id was given."""

    service: str
    """namespace/name"""
    port: str
    """The Service port's name ("" when unnamed)."""
    frontend: str
    """address:port/PROTO, " (node)" for the node-scope entry of an externalTrafficPolicy Local frontend."""
    packets: int
    bytes: int


def _traffic_families(prefix: str, where: str, packets_help: str,
                      traffic: Iterable[tuple[str, str, str, int, int]]) -> Iterator[Metric]:
    """`prefix`_packets_total and `prefix`_bytes_total{namespace,service,port,`where`} of (namespace/name, port
    name, `where`, packets, bytes) rows."""
    labels = ["namespace", "service", "port", where]
    packets = CounterMetricFamily(f"{prefix}_packets", packets_help + " (replies not counted); a socket hook's "
                                  "connection counts 1", labels=labels)
    octets = CounterMetricFamily(f"{prefix}_bytes", "Bytes of those packets as the device had them (frames "
                                 "with their link-layer header; 0 for a socket hook's connection)", labels=labels)
    for service, port, place, n, size in traffic:
        namespace, _, name = service.partition("/")
        packets.add_metric([namespace, name, port, place], n)
        octets.add_metric([namespace, name, port, place], size)
    yield packets
    yield octets


def service_traffic_families(traffic: Iterable[FrontendTraffic]) -> Iterator[Metric]:
    """pyproxy_service_packets_total and pyproxy_service_bytes_total{namespace,service,port,frontend}: one series
    per frontend (a Service port has one per ClusterIP, NodePort address, external and load-balancer IP)."""
    return _traffic_families("pyproxy_service", "frontend", "Client-to-Service packets the BPF programs sent to a "
                             "frontend's endpoints", traffic)


class EndpointTraffic(NamedTuple):
    """What the per-endpoint counters map counted for one backend address:port since it became an endpoint."""

    service: str
    """namespace/name of the Service port it is labelled with: of those whose endpoint it is, the first in order
    (namespace, name, port name). Its counts are the backend's, whichever Service port's traffic it was."""
    port: str
    """That Service port's name ("" when unnamed)."""
    endpoint: str
    """address:port"""
    packets: int
    bytes: int


def endpoint_traffic_families(traffic: Iterable[EndpointTraffic]) -> Iterator[Metric]:
    """pyproxy_endpoint_packets_total and pyproxy_endpoint_bytes_total{namespace,service,port,endpoint}: one series
    per endpoint address:port that was sent traffic (--bpf-endpoint-counters)."""
    return _traffic_families("pyproxy_endpoint", "endpoint", "Client-to-Service packets the BPF programs sent to "
                             "one endpoint address:port, over every Service port it serves", traffic)


def port_name(fe: AppliedFrontend) -> str:
    """The Service port's name of a frontend ("" when unnamed)."""
    return fe.name[len(fe.service) + 1:] if fe.name.startswith(fe.service + ":") else ""


def endpoint_owners(frontends: Iterable[AppliedFrontend]) -> dict[Backend, tuple[str, str, str]]:
    """Backend -> the Service port (namespace, name, port name) its series is labelled with: the first, in that
    order, of those that have it as an endpoint (ready or not)."""
    owners: dict[Backend, tuple[str, str, str]] = {}
    for fe in frontends:
        namespace, _, name = fe.service.partition("/")
        owner = (namespace, name, port_name(fe))
        for b in fe.known:
            cur = owners.get(b)
            if cur is None or owner < cur:
                owners[b] = owner
    return owners
