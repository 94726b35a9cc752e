"""The proxier's sync: what reaches the dataplane, when, and what health says."""

from __future__ import annotations

import pytest

from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import Endpoint, EndpointPort, EndpointSlice, Protocol, Service, ServicePort
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth


def _svc(name: str, ip: str) -> Service:
    return Service("default", name, "ClusterIP", (ip,), (ServicePort("", 80, Protocol.TCP, 8080),))


def _slice(name: str, svc: str, *ips: str) -> EndpointSlice:
    return EndpointSlice(
        "default", name, svc, "IPv4",
        tuple(Endpoint((ip,)) for ip in ips), (EndpointPort("", 8080, Protocol.TCP),),
    )


def _proxier() -> tuple[Proxier, FakeDataplane, ProxyHealth]:
    dp, health = FakeDataplane(), ProxyHealth(sync_period=30)
    p = Proxier(dp, min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("fake"), health=health)
    return p, dp, health


def _synced_on_a_clock(monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> tuple[Proxier, FakeDataplane]:
    """A proxier on the clock `clock[0]`, past its first (full) sync of one Service."""
    monkeypatch.setattr("pyproxy.proxier.proxier.time.monotonic", lambda: clock[0])
    p, dp, _ = _proxier()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.mark_synced()
    p.sync()
    return p, dp


def test_nothing_is_applied_before_the_source_has_listed_everything() -> None:
    p, dp, health = _proxier()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.sync()
    assert dp.applies == []
    assert not health.healthy()[0]
    p.mark_synced()
    p.sync()
    assert len(dp.applies) == 1 and dp.applies[0][1] is None, "the first sync is a full one"
    assert health.healthy()[0]


def test_a_change_to_one_service_applies_only_that_service() -> None:
    p, dp, _ = _proxier()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.set_service("default/b", _svc("b", "10.96.0.2"))
    p.mark_synced()
    p.sync()
    p.set_endpoint_slice("default/b-1", _slice("b-1", "b", "10.0.0.1"))
    p.sync()
    desired, changed = dp.applies[-1]
    assert changed == {"default/b"}
    assert [str(b) for b in desired.services["default/b"][0].backends] == ["10.0.0.1:8080"]


def test_a_no_op_update_does_not_sync() -> None:
    p, dp, _ = _proxier()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.mark_synced()
    p.sync()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.sync()
    assert len(dp.applies) == 1


def test_a_failed_apply_is_retried_with_the_same_services() -> None:
    """The retry is a full sync, as upstream's after an error: a failed apply may have left the kernel
    anywhere between the two states, and only a full sync reconciles with it."""
    p, dp, _ = _proxier()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.mark_synced()
    p.sync()
    p.set_endpoint_slice("default/a-1", _slice("a-1", "a", "10.0.0.9"))
    dp.fail_next = 1
    try:
        p.sync()
        raise AssertionError("the failure must reach the runner, which retries")
    except Exception as e:  # noqa: BLE001
        assert "injected" in str(e)
    p.sync()
    assert dp.applies[-1][1] is None
    assert [str(b) for b in dp.state.services["default/a"][0].backends] == ["10.0.0.9:8080"]
    p.set_endpoint_slice("default/a-1", _slice("a-1", "a", "10.0.0.8"))
    p.sync()
    assert dp.applies[-1][1] == {"default/a"}, "once a sync succeeded, syncs are partial again"


def test_a_change_that_alters_no_service_leaves_the_proxy_healthy() -> None:
    """Seen on the Vagrant lab: the own Node arrived after the first sync and its primary address changed no
    Service's frontends. That sync had nothing to apply, but the queued change was never marked applied: /healthz
    (and every health-check node port's serviceProxyHealthy) answered 503 from 2 x --sync-period on, the pod
    went unready and its DaemonSet's rollout stalled, with the dataplane fully programmed."""
    clock = [1000.0]
    dp, health = FakeDataplane(), ProxyHealth(sync_period=30, clock=lambda: clock[0])
    p = Proxier(dp, min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("fake"), health=health)
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.mark_synced()
    p.sync()
    p.set_node_inputs(NodeInputs(name="node1", primary_ip="192.168.50.11"))
    p.sync()
    assert len(dp.applies) == 1, "nothing to apply: no frontend uses the node's addresses"
    clock[0] += 61
    assert health.healthy()[0], "the queued change was handled by that sync"
    assert health.healthz()[0] == 200


def test_periodic_syncs_apply_only_changes_and_a_full_one_comes_hourly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's rhythm: every --sync-period a sync applies what changed (nothing, when nothing did); the
    whole rule set is rewritten only once per full_sync_period (an hour)."""
    clock = [1000.0]
    p, dp = _synced_on_a_clock(monkeypatch, clock)
    for _ in range(100):  # 100 periodic wake-ups, 30 s apart, nothing changed
        clock[0] += 30
        p.sync()
    assert len(dp.applies) == 1
    p.set_service("default/b", _svc("b", "10.96.0.2"))
    clock[0] += 30
    p.sync()
    assert dp.applies[-1][1] == {"default/b"}
    clock[0] = 1000.0 + 3600
    p.sync()
    assert len(dp.applies) == 3 and dp.applies[-1][1] is None


def test_a_periodic_sync_applies_nothing_changed_while_the_dataplane_has_housekeeping_due(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """IPVS deletes a drained real server on a later sync, not on a change: with housekeeping due, a periodic
    sync calls apply with no changed Service; once it is done, quiet periods apply nothing again."""
    clock = [1000.0]
    p, dp = _synced_on_a_clock(monkeypatch, clock)
    dp.housekeeping = True
    clock[0] += 30
    p.sync()
    assert len(dp.applies) == 2 and dp.applies[-1][1] == frozenset()
    dp.housekeeping = False
    clock[0] += 30
    p.sync()
    assert len(dp.applies) == 2


def test_a_frontend_a_deleted_service_frees_reaches_the_dataplane_with_its_waiting_claimant(
        caplog: pytest.LogCaptureFixture) -> None:
    """The model decides which Service serves a contested frontend; the partial apply that deletes the holder
    must also carry the Service that gets the frontend, and each rejected claim is logged once."""
    p, dp, _ = _proxier()
    p.set_service("default/a", _svc("a", "10.96.0.1"))
    p.set_service("default/b", _svc("b", "10.96.0.1"))
    p.mark_synced()
    with caplog.at_level("WARNING", logger="pyproxy.proxier.proxier"):
        p.sync()
        p.set_endpoint_slice("default/b-1", _slice("b-1", "b", "10.0.0.1"))
        p.sync()
    assert [r.getMessage() for r in caplog.records] == [
        "default/b ClusterIP 10.96.0.1:80/TCP: frontend already served by default/a"]
    assert dp.applies[-1][1] == {"default/b"} and "default/b" not in dp.applies[-1][0].services
    p.set_service("default/a", None)
    p.sync()
    desired, changed = dp.applies[-1]
    assert changed == {"default/a", "default/b"}
    assert [str(b) for b in desired.services["default/b"][0].backends] == ["10.0.0.1:8080"]
