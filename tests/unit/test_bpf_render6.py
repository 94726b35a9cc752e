"""render() with IPv6 frontends (pyproxy/dataplane/bpf/render.py, `by_family`): each entry that holds an address goes
to its family's map, in a batch right after its IPv4 one; an IPv4-only plan is what it was."""

from __future__ import annotations

import pytest

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.backend import BpfDataplane
from pyproxy.dataplane.bpf.render import Applied, CapacityError, render
from pyproxy.dataplane.bpf.settings import BpfSettings
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


# The capacity check: each family against its own maps (render._check_capacity); a plan that does not fit writes
# nothing, and BpfDataplane leaves out only the Services that do not fit.
V4B = state("10.96.0.11", (Backend("10.0.1.2", 8080), Backend("10.0.1.3", 8080)))
V6B = state("fd00:96::b", (Backend("fd00:1::3", 8080),))


def applied_with(*states: ServicePortState, capacity: dict[str, int]) -> Applied:
    applied = Applied()
    for i, st in enumerate(states):
        applied.commit(render(applied, {f"default/s{i}": [st]}, capacity))
    return applied


@pytest.mark.parametrize(("full", "size"), [
    (abi.MAP_SERVICES6, 1), (abi.MAP_SLOTS6, 2), (abi.MAP_BACKENDS6, 2),
])
def test_an_ipv6_service_that_does_not_fit_its_ipv6_map_is_rejected_naming_it(full: str, size: int) -> None:
    """V6 fills the IPv6 map (1 frontend, 2 slots, 2 backends); another IPv6 Service does not fit and the error
    names the IPv6 map, while IPv4 Services still fit: the IPv4 maps are not charged for the IPv6 entries."""
    capacity = {**CAPACITY, abi.MAP_SERVICES: 1, abi.MAP_SLOTS: 1, abi.MAP_BACKENDS: 1, full: size}
    applied = applied_with(V6, capacity=capacity)
    with pytest.raises(CapacityError, match=rf"BPF map {full} would need \d+ entries but holds {size}:"):
        render(applied, {"default/other": [V6B]}, capacity)
    applied.commit(render(applied, {"default/v4": [V4]}, capacity))  # 1 IPv4 frontend, slot and backend: fits
    assert applied.frontends6 == 1 and len(applied.frontends) == 2


@pytest.mark.parametrize(("full", "size"), [
    (abi.MAP_SERVICES, 1), (abi.MAP_SLOTS, 1), (abi.MAP_BACKENDS, 1),
])
def test_an_ipv4_service_that_does_not_fit_its_ipv4_map_is_rejected_naming_it(full: str, size: int) -> None:
    capacity = {**CAPACITY, abi.MAP_SERVICES6: 1, abi.MAP_SLOTS6: 2, abi.MAP_BACKENDS6: 2, full: size}
    applied = applied_with(V4, capacity=capacity)
    with pytest.raises(CapacityError, match=rf"BPF map {full} would need \d+ entries but holds {size}:"):
        render(applied, {"default/other": [V4B]}, capacity)
    applied.commit(render(applied, {"default/v6": [V6]}, capacity))  # the IPv6 maps' own room
    assert applied.frontends6 == 1 and applied.slots6 == 2 and applied.backends6 == 2


def test_the_ipv6_endpoint_counters_map_holds_the_ipv6_backends() -> None:
    capacity = {**CAPACITY, abi.MAP_EPSTATS: 1, abi.MAP_EPSTATS6: 1}
    applied = Applied()
    applied.commit(render(applied, {"default/v4": [V4]}, capacity, endpoint_counters=True))
    with pytest.raises(CapacityError, match=abi.MAP_EPSTATS6):
        render(applied, {"default/v6": [V6]}, capacity, endpoint_counters=True)


def test_the_maps_indexed_by_service_id_count_both_families() -> None:
    """Names and stats serve both families (ids are shared): two frontends of different families need two."""
    capacity = {**CAPACITY, abi.MAP_NAMES: 1}
    with pytest.raises(CapacityError, match=abi.MAP_NAMES):
        render(Applied(), {"default/web": [V4, V6]}, capacity)


def test_the_per_family_counts_follow_removals() -> None:
    capacity = {**CAPACITY, abi.MAP_SERVICES6: 1, abi.MAP_BACKENDS6: 2}
    applied = applied_with(V6, capacity=capacity)
    applied.commit(render(applied, {"default/s0": []}, capacity))
    assert (applied.frontends6, applied.slots6, applied.backends6) == (0, 0, 0)
    applied.commit(render(applied, {"default/other": [V6B]}, capacity))  # the room is back
    assert (applied.frontends6, applied.slots6, applied.backends6) == (1, 1, 1)


def test_the_map_fill_metrics_count_each_family_in_its_own_map() -> None:
    """`pyproxy_bpf_map_entries{map}` (BpfDataplane.map_usage): the IPv6 twins report their own fill."""
    dp = BpfDataplane(BpfSettings(endpoint_counters=True))
    dp.applied = applied_with(V4, V6, capacity=CAPACITY)
    dp._capacity = dict.fromkeys(abi.RESIZABLE.values(), 100)  # noqa: SLF001 # as start() reads them
    usage = {name: n for name, (n, _) in dp.map_usage().items()}
    assert usage == {abi.MAP_SERVICES: 1, abi.MAP_SLOTS: 1, abi.MAP_BACKENDS: 1, abi.MAP_EPSTATS: 1,
                     abi.MAP_STATS: 2, abi.MAP_SERVICES6: 1, abi.MAP_SLOTS6: 2, abi.MAP_BACKENDS6: 2,
                     abi.MAP_EPSTATS6: 2, abi.MAP_AFFINITY: 0, abi.MAP_AFFINITY6: 0}


def test_a_plan_for_one_service_does_not_look_at_every_applied_frontend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan costs O(what changed): with 1,000 dual-stack Services applied, one endpoint change asks the family of
    a handful of addresses, not of every frontend (a pass over all of them made each sync at 10,000 dual-stack
    Services cost 40-130 ms instead of a few), and its IPv6 slot still goes to the IPv6 map."""
    import pyproxy.dataplane.bpf.render as render_module

    capacity = dict.fromkeys(abi.ALL_MAPS, 100_000)
    applied = Applied()
    desired = {f"default/s{i}": [state(f"10.96.{i // 250}.{i % 250}", (Backend(f"10.1.{i // 250}.{i % 250}", 8080),)),
                                  state(f"fd00:96::{i:x}", (Backend(f"fd00:1::{i:x}", 8080),))] for i in range(1000)}
    applied.commit(render(applied, desired, capacity))
    asked = []
    real = render_module.family_of
    monkeypatch.setattr(render_module, "family_of", lambda a: asked.append(a) or real(a))
    one = desired["default/s7"][1]
    changed = state(one.frontend.ip, (Backend("fd00:1::7", 8080), Backend("fd00:2::7", 8080)))
    got = maps_of(render(applied, {"default/s7": [desired["default/s7"][0], changed]}, capacity).batches)
    assert len(asked) < 50, f"family_of asked {len(asked)} times for a one-Service plan"
    v6_id = applied.frontends[("fd00:96::7", 80, "TCP", abi.SVC_SCOPE_PACKETS)].svc_id
    assert got[f"put {abi.MAP_SLOTS6}"] == [(v6_id, 1)]
    assert f"put {abi.MAP_SLOTS}" not in got
