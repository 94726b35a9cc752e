"""What `pyproxy run`, `inspect` and `cleanup` do, given ready settings."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Protocol

from pyproxy.dataplane.bpf import inspect as bpf_inspect
from pyproxy.dataplane.iptables import inspect as iptables_inspect
from pyproxy.dataplane.ipvs import inspect as ipvs_inspect
from pyproxy.dataplane.nftables import inspect as nft_inspect
from pyproxy.k8s.client import ApiClient, ConfigError, configuration
from pyproxy.k8s.events import record_node_event, record_service_event
from pyproxy.k8s.informer import ApiSource
from pyproxy.k8s.manifest import ManifestSource
from pyproxy.model import inspection
from pyproxy.proxier import modes
from pyproxy.proxier.config import ProxySettings, SettingError, node_name, parse_address
from pyproxy.proxier.healthcheck import ServiceHealthServers
from pyproxy.proxier.metrics import InformerCollector, NoLocalEndpointsCollector, ProxyMetrics
from pyproxy.proxier.node import NodeAddresses
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth, health_server, metrics_server

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """pyproxy cannot start as configured; the message says why."""


class _Source(Protocol):
    def start(self) -> object: ...

    def stop(self) -> None: ...


def _api_client(settings: ProxySettings) -> ApiClient:
    try:
        return ApiClient(configuration(settings.connection))
    except ConfigError as e:
        raise StartupError(str(e)) from e


def run(settings: ProxySettings, stop: threading.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `stop`); the dataplane stays programmed after return."""
    stop = stop or threading.Event()
    # Configuration errors first: wrong settings or a wrong kubeconfig must not leave programs attached.
    try:
        settings.validate()
    except SettingError as e:
        raise StartupError(str(e)) from e
    api = None if settings.source is not None else _api_client(settings)
    try:
        dataplane = modes.start_dataplane(settings)
    except modes.NoModeAvailable as e:
        raise StartupError(str(e)) from e
    metrics = ProxyMetrics(dataplane.mode)
    if dataplane.collector is not None:
        metrics.registry.register(dataplane.collector)  # the dataplane's own metrics (bpf: connection-tracking GC)
    health = ProxyHealth(settings.sync_period)
    service_health = ServiceHealthServers(health, on_nodeport_addresses=bool(settings.nodeport_addresses))
    node = node_name(settings)
    proxier = Proxier(
        dataplane,
        min_sync_period=settings.min_sync_period,
        sync_period=settings.sync_period,
        full_sync_period=settings.full_sync_period,
        metrics=metrics,
        health=health,
        node_name=node,
        service_health=service_health,
    )
    metrics.registry.register(NoLocalEndpointsCollector(lambda: proxier.served))
    # The node's addresses before the sources start, so the first sync already has its NodePorts.
    node_addresses = NodeAddresses(node, settings.nodeport_addresses, proxier.set_node_inputs,
                                   localhost=settings.localhost_nodeports and dataplane.localhost_nodeports)
    proxier.node_addresses = node_addresses
    node_addresses.start()
    servers = [
        health_server(*parse_address(settings.healthz_bind_address), health, metrics).start(),
        metrics_server(*parse_address(settings.metrics_bind_address), metrics.registry, dataplane.mode).start(),
    ]
    source: _Source
    if api is None:
        assert settings.source is not None
        source = ManifestSource(settings.source, proxier, node_name=node)
        origin = str(settings.source)
    else:
        source = ApiSource(api, proxier, node)
        metrics.registry.register(InformerCollector({n: r.stats for n, r in source.reflectors.items()}))
        origin = f"{api.host} as node {node}"
        threading.Thread(
            target=record_node_event, args=(api, node, "Starting", "Starting pyproxy."), daemon=True
        ).start()
        client = api

        def on_unserved(service: str, why: str) -> None:
            threading.Thread(target=record_service_event,
                             args=(client, node, service, "FailedToProgram", f"pyproxy on {node}: {why}"),
                             daemon=True).start()

        proxier.on_unserved = on_unserved

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping, the dataplane stays in place", signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    sync_thread = threading.Thread(target=proxier.runner.loop, name="sync", daemon=True)
    sync_thread.start()
    source.start()
    log.info("pyproxy running: mode=%s source=%s node=%s", dataplane.mode, origin, node)
    stop.wait()
    source.stop()
    proxier.runner.stop()
    sync_thread.join(timeout=5)
    node_addresses.stop()
    for s in servers:
        s.stop()
    service_health.stop()
    dataplane.stop()
    return 0


def inspect_view(settings: ProxySettings, flows: bool = True) -> inspection.View:
    """What the dataplane of this network namespace holds, both IP families': the BPF maps when pyproxy's programs
    or pins are here, else pyproxy's nftables tables, else the iptables mode's chains (iptables' and ip6tables'),
    else pyproxy's IPVS virtual servers."""
    maps = bpf_inspect.open_maps(settings.bpf.pin_path, settings.bpf.object_path)
    if maps is not None:
        try:
            return bpf_inspect.view(maps, flows)
        finally:
            maps.close()
    found = nft_inspect.read() or iptables_inspect.read(flows) or ipvs_inspect.read(flows)
    if found is None:
        raise StartupError(
            f"no pyproxy dataplane here: no BPF pins under {settings.bpf.pin_path}, no pyproxy program attached in "
            "this network namespace, no nftables table ip or ip6 pyproxy, no KUBE-SVC/KUBE-NODEPORTS chains in "
            "either iptables backend (iptables or ip6tables) and no IPVS virtual server of pyproxy's (run inspect "
            "in pyproxy's network namespace, "
            "with pyproxy's --bpf-pin-path if it pins elsewhere)"
        )
    return found


def cleanup(settings: ProxySettings) -> list[str]:
    """Remove what every mode made here: "mode: what" per removed thing."""
    return modes.cleanup(settings)
