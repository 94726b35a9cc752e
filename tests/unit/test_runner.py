"""The bounded-frequency runner on the real monotonic clock, with intervals short enough for a unit test (its
waits are timed waits on an Event, which a fake clock could not drive)."""

from __future__ import annotations

import threading
import time

from pyproxy.proxier.runner import BoundedFrequencyRunner


def _run(runner: BoundedFrequencyRunner) -> threading.Thread:
    t = threading.Thread(target=runner.loop, daemon=True)
    t.start()
    return t


def _wait(cond: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_burst_of_requests_coalesces_into_one_run_per_min_interval() -> None:
    calls: list[float] = []
    runner = BoundedFrequencyRunner(lambda: calls.append(time.monotonic()), min_interval=0.3, max_interval=60)
    t = _run(runner)
    _wait(lambda: len(calls) == 1)  # the first run is immediate
    for _ in range(500):
        runner.request()
    _wait(lambda: len(calls) == 2)
    time.sleep(0.4)
    runner.stop()
    t.join(2)
    assert len(calls) == 2, "500 requests inside one interval must make one run"
    assert calls[1] - calls[0] >= 0.29


def test_periodic_resync_runs_without_requests() -> None:
    calls: list[int] = []
    runner = BoundedFrequencyRunner(lambda: calls.append(1), min_interval=0.01, max_interval=0.1)
    t = _run(runner)
    _wait(lambda: len(calls) >= 3)
    runner.stop()
    t.join(2)


def test_a_failed_run_is_retried_and_the_loop_survives() -> None:
    outcomes = ["fail", "fail", "ok"]
    done: list[str] = []

    def fn() -> None:
        o = outcomes.pop(0) if outcomes else "ok"
        done.append(o)
        if o == "fail":
            raise RuntimeError("apply failed")

    runner = BoundedFrequencyRunner(fn, min_interval=0.01, max_interval=60, retry_interval=0.05)
    t = _run(runner)
    _wait(lambda: done[:3] == ["fail", "fail", "ok"])
    runner.stop()
    t.join(2)
    assert not t.is_alive()


def test_stop_ends_the_loop_promptly() -> None:
    runner = BoundedFrequencyRunner(lambda: None, min_interval=10, max_interval=600)
    t = _run(runner)
    time.sleep(0.05)
    start = time.monotonic()
    runner.stop()
    t.join(2)
    assert not t.is_alive() and time.monotonic() - start < 1


def test_a_run_that_did_nothing_waits_for_the_next_request_without_spinning() -> None:
    calls: list[float] = []
    ready = threading.Event()

    def fn() -> bool:
        calls.append(time.monotonic())
        return ready.is_set()

    runner = BoundedFrequencyRunner(fn, min_interval=5, max_interval=60)
    t = _run(runner)
    _wait(lambda: len(calls) == 1)
    time.sleep(0.2)
    assert len(calls) == 1, "a run that did nothing is not repeated until something is requested"
    ready.set()
    runner.request()
    _wait(lambda: len(calls) == 2)  # at once: the idle run did not count against min_interval
    runner.stop()
    t.join(2)
