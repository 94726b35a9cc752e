"""render() with IPv6 frontends (pyproxy/dataplane/bpf/render.py, `by_family`): each entry that holds an address goes
to its family's map, in a batch right after its IPv4 one; an IPv4-only plan is what it was."""

from __future__ import annotations

import pytest

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import Applied, render
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, ServicePortState

CAPACITY = {abi.MAP_SERVICES: 64, abi.MAP_SLOTS: 64, abi.MAP_BACKENDS: 64, abi.MAP_STATS: 64, abi.MAP_NAMES: 64}


def state(vip: str, backends: tuple[Backend, ...], ranges: tuple[str, ...] = ()) -> ServicePortState:
    return ServicePortState(service="default/web", port_name=f"p-{vip}", frontend=Frontend(vip, 80, Protocol.TCP),
                            backends=backends, known_backends=backends, source_ranges=ranges)


V4 = state("10.96.0.10", (Backend("10.0.1.1", 8080),))
V6 = state("fd00:96::a", (Backend("fd00:1::1", 8080), Backend("fd00:1::2", 8080)))


def maps_of(plan_batches: tuple) -> dict[str, list]:
    out: dict[str, list] = {}
    for b in plan_batches:
        out.setdefault(f"{b.verb} {b.map}", []).extend(b.keys)
    return out


def test_each_family_goes_to_its_own_maps() -> None:
    plan = render(Applied(), {"default/web": [V4, V6]}, CAPACITY)
    got = maps_of(plan.batches)
    assert [k[0] for k in got[f"put {abi.MAP_SERVICES}"]] == ["10.96.0.10"]
    assert [k[0] for k in got[f"put {abi.MAP_SERVICES6}"]] == ["fd00:96::a"]
    assert got[f"put {abi.MAP_BACKENDS}"] == [Backend("10.0.1.1", 8080)]
    assert sorted(got[f"put {abi.MAP_BACKENDS6}"]) == [Backend("fd00:1::1", 8080), Backend("fd00:1::2", 8080)]
    v6_id = plan.upserts[("fd00:96::a", 80, "TCP", abi.SVC_SCOPE_PACKETS)].svc_id
    assert {k[0] for k in got[f"put {abi.MAP_SLOTS6}"]} == {v6_id}
    assert v6_id not in {k[0] for k in got[f"put {abi.MAP_SLOTS}"]}
    # Shared maps: the names of both.
    assert len(got[f"put {abi.MAP_NAMES}"]) == 2


def test_an_ipv4_only_plan_has_no_ipv6_batch() -> None:
    plan = render(Applied(), {"default/web": [V4]}, CAPACITY)
    assert not [b for b in plan.batches if b.map.endswith("6_v1")]


def test_source_ranges_go_to_the_frontend_of_their_family() -> None:
    ranges = ("192.168.0.0/16", "fd00:c::/48")
    plan = render(Applied(), {"default/web": [state("10.96.0.10", V4.backends, ranges),
                                              state("fd00:96::a", V6.backends, ranges)]}, CAPACITY)
    got = maps_of(plan.batches)
    assert [k[1] for k in got[f"put {abi.MAP_SRCRANGES}"]] == ["192.168.0.0/16"]
    assert [k[1] for k in got[f"put {abi.MAP_SRCRANGES6}"]] == ["fd00:c::/48"]


def test_removal_deletes_from_the_ipv6_maps() -> None:
    applied = Applied()
    applied.commit(render(applied, {"default/web": [V6]}, CAPACITY))
    got = maps_of(render(applied, {"default/web": []}, CAPACITY).batches)
    assert [k[0] for k in got[f"del {abi.MAP_SERVICES6}"]] == ["fd00:96::a"]
    assert len(got[f"del {abi.MAP_SLOTS6}"]) == 2 and len(got[f"del {abi.MAP_BACKENDS6}"]) == 2
    assert f"del {abi.MAP_SLOTS}" not in got


@pytest.mark.parametrize(("masq", "outside4", "outside6"), [
    (MasqueradeSettings(cluster_cidr="10.244.0.0/16"), True, False),
    (MasqueradeSettings(cluster_cidr6="fd00:10:244::/56"), False, True),
    (MasqueradeSettings(cluster_cidr="10.244.0.0/16", cluster_cidr6="fd00:10:244::/56"), True, True),
], ids=["ipv4-cidr", "ipv6-cidr", "pair"])
def test_each_familys_clusterip_masquerades_by_its_own_cluster_cidr(masq: MasqueradeSettings, outside4: bool,
                                                                    outside6: bool) -> None:
    """--cluster-cidr's IPv4 CIDR flags IPv4 ClusterIPs F_MASQ_OUTSIDE, its IPv6 one IPv6 ClusterIPs: a family
    without a CIDR of its own keeps its clients' addresses (the programs hold no prefix to compare with)."""
    plan = render(Applied(), {"default/web": [V4, V6]}, CAPACITY, masq)
    flags = {key[0]: fe.flags for key, fe in plan.upserts.items()}
    assert bool(flags["10.96.0.10"] & abi.SVC_F_MASQ_OUTSIDE) == outside4
    assert bool(flags["fd00:96::a"] & abi.SVC_F_MASQ_OUTSIDE) == outside6
