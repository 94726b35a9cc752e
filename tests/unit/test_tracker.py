import threading

import pytest

from pyproxy.model.objects import Endpoint, EndpointPort, EndpointSlice, Protocol, Service, ServicePort
from pyproxy.model.tracker import Change, ChangeTracker, ClusterState


def svc(name: str = "web", ip: str = "10.96.0.10", port: int = 80) -> Service:
    return Service("default", name, "ClusterIP", (ip,), (ServicePort("", port, Protocol.TCP, port),))


def eps(name: str, service: str, ip: str = "10.0.0.1", trigger_time: float | None = None) -> EndpointSlice:
    return EndpointSlice(
        "default",
        name,
        service,
        "IPv4",
        (Endpoint((ip,)),),
        (EndpointPort("", 8080, Protocol.TCP),),
        trigger_time=trigger_time,
    )


def test_a_recorded_update_is_drained_once_with_previous_and_current() -> None:
    tracker: ChangeTracker[Service] = ChangeTracker()
    assert tracker.update("default/web", svc())
    assert tracker.pending() == 1
    assert tracker.pending_keys() == {"default/web"}
    assert tracker.drain() == {"default/web": Change(None, svc())}
    assert tracker.pending() == 0
    assert tracker.drain() == {}


def test_no_op_update_produces_no_pending_change() -> None:
    tracker: ChangeTracker[Service] = ChangeTracker()
    tracker.update("default/web", svc())
    tracker.drain()
    assert not tracker.update("default/web", svc())  # an equal, freshly built object
    assert not tracker.update("default/gone", None)  # deleting what never existed
    assert tracker.pending() == 0


def test_trigger_time_alone_is_not_a_change() -> None:
    tracker: ChangeTracker[EndpointSlice] = ChangeTracker()
    tracker.update("default/web-1", eps("web-1", "web", trigger_time=1.0))
    tracker.drain()
    assert not tracker.update("default/web-1", eps("web-1", "web", trigger_time=2.0))


def test_changes_that_return_to_the_drained_form_cancel_out() -> None:
    tracker: ChangeTracker[Service] = ChangeTracker()
    tracker.update("default/web", svc())
    tracker.drain()
    assert tracker.update("default/web", svc(port=81))
    assert tracker.update("default/web", svc())
    assert tracker.pending() == 0

    # Created and deleted between two syncs: the sync loop never needs to hear of it.
    tracker.update("default/tmp", svc("tmp"))
    tracker.update("default/tmp", None)
    assert tracker.drain() == {}


def test_successive_updates_keep_the_first_previous() -> None:
    tracker: ChangeTracker[Service] = ChangeTracker()
    tracker.update("default/web", svc())
    tracker.drain()
    tracker.update("default/web", svc(port=81))
    tracker.update("default/web", svc(port=82))
    assert tracker.drain() == {"default/web": Change(svc(), svc(port=82))}


def test_current_shows_the_state_of_the_last_drain_and_is_read_only() -> None:
    tracker: ChangeTracker[Service] = ChangeTracker()
    tracker.update("default/web", svc())
    assert dict(tracker.current) == {}
    tracker.drain()
    assert dict(tracker.current) == {"default/web": svc()}
    tracker.update("default/web", None)
    tracker.drain()
    assert dict(tracker.current) == {}
    with pytest.raises(TypeError):
        tracker.current["default/x"] = svc()  # type: ignore[index]


def test_concurrent_watch_threads_lose_no_update() -> None:
    tracker: ChangeTracker[Service] = ChangeTracker()

    def record(thread: int) -> None:
        for i in range(200):
            tracker.update(f"ns{thread}/svc{i}", svc(f"svc{i}"))

    threads = [threading.Thread(target=record, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tracker.drain()) == 8 * 200


def test_slices_are_listed_per_service_sorted_by_key() -> None:
    state = ClusterState()
    state.slices.update("default/web-b", eps("web-b", "web"))
    state.slices.update("default/web-a", eps("web-a", "web"))
    state.slices.update("default/db-a", eps("db-a", "db"))
    assert state.slices_for("default/web") == ()  # not drained yet
    assert state.drain_changed_services() == {"default/web", "default/db"}
    assert [s.name for s in state.slices_for("default/web")] == ["web-a", "web-b"]
    assert state.slices_for("default/none") == ()


def test_a_slice_moving_between_services_changes_both() -> None:
    state = ClusterState()
    state.slices.update("default/s", eps("s", "old"))
    state.drain_changed_services()
    state.slices.update("default/s", eps("s", "new"))
    assert state.drain_changed_services() == {"default/old", "default/new"}
    assert state.slices_for("default/old") == ()
    assert state.slices_for("default/new") == (eps("s", "new"),)


def test_changed_services_combine_service_and_slice_changes() -> None:
    state = ClusterState()
    state.services.update("default/web", svc())
    state.slices.update("default/db-1", eps("db-1", "db"))
    assert state.pending_counts() == (1, 1)
    assert state.drain_changed_services() == {"default/web", "default/db"}
    assert state.pending_counts() == (0, 0)
    assert dict(state.services.current) == {"default/web": svc()}

    state.slices.update("default/db-1", None)
    assert state.drain_changed_services() == {"default/db"}
    assert state.slices_for("default/db") == ()
