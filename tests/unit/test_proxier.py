"""The proxier's sync: what reaches the dataplane, when, and what health says."""

from __future__ import annotations

from pyproxy.dataplane.fake import FakeDataplane
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
    assert dp.applies[-1][1] == {"default/a"}
    assert [str(b) for b in dp.state.services["default/a"][0].backends] == ["10.0.0.9:8080"]
