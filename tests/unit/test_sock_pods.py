"""Which frontends a pod's socket may be translated at (ServicePortState.pods_at_socket, the model's one rule), and
the flag the bpf renderer writes for it (abi.SVC_F_SOCK_PODS, which sock.h reads): only where the socket path gives
the pod what the packet path on its veth would."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import Applied, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

CAPACITY = {abi.MAP_SERVICES: 64, abi.MAP_SLOTS: 64, abi.MAP_BACKENDS: 64, abi.MAP_STATS: 64, abi.MAP_NAMES: 64}
A, B = Backend("10.0.1.1", 8080), Backend("10.0.1.2", 8080)
CLUSTER_IP = ServicePortState(service="default/web", port_name="p", frontend=Frontend("10.96.0.10", 80, Protocol.TCP),
                              backends=(A, B), known_backends=(A, B))
LB = replace(CLUSTER_IP, frontend=Frontend("192.0.2.10", 80, Protocol.TCP), kind=FrontendKind.LOAD_BALANCER,
             external_backends=(A, B))


@pytest.mark.parametrize(("st", "masq", "at_socket"), [
    (CLUSTER_IP, MasqueradeSettings(), True),
    (CLUSTER_IP, MasqueradeSettings(cluster_cidr="10.0.0.0/16"), True),   # a pod is inside the cluster CIDR
    (CLUSTER_IP, MasqueradeSettings(masquerade_all=True), False),          # TC SNATs the pod's flow
    (replace(LB, masquerade=True), MasqueradeSettings(), False),          # externalTrafficPolicy Cluster: SNATed
    (LB, MasqueradeSettings(), True),                                     # Local: the pod keeps its address
    (LB, MasqueradeSettings(masquerade_all=True), True),                  # which --masquerade-all leaves to Local
    (replace(LB, source_ranges=("198.51.100.0/24",)), MasqueradeSettings(), False),   # TC checks the pod's address
    (replace(LB, external_backends=(A,)), MasqueradeSettings(), True),    # Local: every endpoint, as upstream's pods
    # UDP: TC moves a connected socket's flow when its endpoint leaves
    (replace(CLUSTER_IP, frontend=Frontend("10.96.0.10", 53, Protocol.UDP)), MasqueradeSettings(), False),
], ids=["clusterip", "cluster-cidr", "masquerade-all", "etp-cluster", "etp-local", "etp-local-masquerade-all",
        "source-ranges", "etp-local-short-circuit", "udp"])
def test_a_pods_socket_is_translated_only_where_the_packet_path_gives_the_same(
        st: ServicePortState, masq: MasqueradeSettings, at_socket: bool) -> None:
    assert st.pods_at_socket(masq.masquerade_all) is at_socket
    six = Frontend("fd00:96::a", st.frontend.port, st.frontend.protocol)
    for one in (st, replace(st, frontend=six, backends=(Backend("fd00::1", 80),),
                            known_backends=(Backend("fd00::1", 80),), external_backends=())):
        plan = render(Applied(), {"default/web": [one]}, CAPACITY, masq)
        (fe,) = (fe for key, fe in plan.upserts.items() if key[-1] == abi.SVC_SCOPE_PACKETS)
        assert bool(fe.flags & abi.SVC_F_SOCK_PODS) is at_socket, one.frontend
