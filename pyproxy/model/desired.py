"""From Services and EndpointSlices to the desired state, with upstream kube-proxy's semantics.

Pure functions: the sync loop calls `update_desired_state` with the Service keys the trackers reported
changed, and every other Service's entry is reused as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pyproxy.model.objects import EndpointSlice, Service, ServicePort
from pyproxy.model.state import Backend, DesiredState, Frontend, ServicePortState

# ExternalName Services are DNS-only; every other type gets a ClusterIP frontend.
_PROXIED_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer"})


# Backend(ip, port) without the Python-level __new__ a NamedTuple has: this loop makes one per endpoint, and a
# cold start at 10,000 Services x 10 endpoints makes 100,000.
_new_backend = tuple.__new__


def _backends(port: ServicePort, slices: Iterable[EndpointSlice]) -> tuple[tuple[Backend, ...], tuple[Backend, ...]]:
    """(ready, known) backends of one service port, deduplicated and sorted; one tuple for both when every
    known backend is ready (the common case)."""
    ready: set[Backend] = set()
    known: set[Backend] = set()
    for eps in slices:
        if eps.address_type != "IPv4":
            continue
        # Match by (name, protocol), not targetPort: the slice controller already resolved targetPort
        # (named ones included) into the slice ports' numbers, and names the slice ports after the
        # service ports.
        for ep_port in eps.ports:
            if ep_port.name != port.name or ep_port.protocol != port.protocol:
                continue
            number = ep_port.port
            for ep in eps.endpoints:
                # Like upstream, only the first address counts: the API says they are fungible.
                if not ep.addresses:
                    continue
                backend: Backend = _new_backend(Backend, (ep.addresses[0], number))
                known.add(backend)
                if ep.ready:
                    ready.add(backend)
    all_known = tuple(sorted(known))
    return (all_known if len(ready) == len(known) else tuple(sorted(ready))), all_known


def compute_service_state(
    svc: Service | None, slices: Iterable[EndpointSlice]
) -> tuple[ServicePortState, ...]:
    """The frontends of one Service (one per IPv4 ClusterIP and port, sorted), or () when it has
    nothing to serve: absent, ExternalName, headless or without a ClusterIP."""
    if svc is None or svc.type not in _PROXIED_TYPES or not svc.cluster_ips:
        return ()
    slices = tuple(slices)
    affinity = svc.session_affinity_timeout if svc.session_affinity == "ClientIP" else 0
    states: list[ServicePortState] = []
    for port in svc.ports:
        ready, known = _backends(port, slices)
        states.extend(
            ServicePortState(
                service=svc.key,
                port_name=port.name,
                frontend=Frontend(ip, port.port, port.protocol),
                backends=ready,
                known_backends=known,
                session_affinity_seconds=affinity,
            )
            for ip in svc.cluster_ips
        )
    return tuple(sorted(states, key=lambda s: s.frontend))


def update_desired_state(
    prev: DesiredState,
    services: Mapping[str, Service],
    slices_for: Callable[[str], Iterable[EndpointSlice]],
    changed: Iterable[str],
) -> DesiredState:
    """A new DesiredState equal to `prev` except for the `changed` Service keys, recomputed from
    `services` and `slices_for`. `prev` is not modified."""
    result = dict(prev.services)
    for key in changed:
        states = compute_service_state(services.get(key), slices_for(key))
        if states:
            result[key] = states
        else:
            result.pop(key, None)
    return DesiredState(result)


def compute_desired_state(
    services: Mapping[str, Service], slices_for: Callable[[str], Iterable[EndpointSlice]]
) -> DesiredState:
    """The full desired state of every Service."""
    return update_desired_state(DesiredState(), services, slices_for, services)
