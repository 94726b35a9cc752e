"""ClientIP affinity with real connections, while the client's endpoint terminates (issue 25): a Service with
sessionAffinity ClientIP and three endpoints; the one the client sticks to is then marked ready=false, serving=true,
terminating=true in the EndpointSlice (a pod of a rolling update, draining). Upstream honours affinity only to the
endpoints new connections may use (the ready ones while there are any), so the client's new connections go to one
of the other two and stay there. bpf mode beside nftables, whose affinity sets hold only the usable endpoints.
"""

from __future__ import annotations

import pytest
from labkit import describe
from labkit.manifests import endpoint_slice, service
from scenarios import WEB_PORTS

pytestmark = pytest.mark.root

STICKY_IP = "10.96.0.31"


def sticky(endpoints: list[str], terminating: tuple[str, ...] = ()) -> list[str]:
    return [service("sticky", STICKY_IP, WEB_PORTS, affinity_seconds=600),
            endpoint_slice("sticky", dict.fromkeys(endpoints, True), WEB_PORTS, terminating=terminating)]


@pytest.mark.parametrize("mode", ["bpf", "nftables"])
def test_a_terminating_endpoint_loses_the_clients_affinity_to_the_ready_ones(make_env, mode: str) -> None:
    env = make_env(3)
    ips = [b.ip for b in env.lab.backends]
    env.write("sticky.yaml", *sticky(ips))
    env.start(mode=mode)
    first = env.probe("tcp", STICKY_IP, 80, 10)
    assert first["failures"] == 0 and len(first["replies"]) == 1, describe(first)
    chosen = next(iter(first["replies"]))  # "b2:8080"
    chosen_ip = next(b.ip for b in env.lab.backends if f"{b.name}:8080" == chosen)

    env.write("sticky.yaml", *sticky(ips, terminating=(chosen_ip,)))
    moved = env.poll(lambda: chosen not in env.probe("tcp", STICKY_IP, 80, 3)["replies"], deadline=5.0)
    assert moved is not None, f"{chosen} still gets the client's new connections while it terminates"
    again = env.probe("tcp", STICKY_IP, 80, 20)
    assert again["failures"] == 0 and len(again["replies"]) == 1, describe(again)
    assert chosen not in again["replies"], describe(again)
