"""The scheduler table (tests/schedcases.py) in bpf mode, with real connections in a namespace lab: every scheduler
a Service may ask for by its annotation, then each as the node's default (--bpf-scheduler) on the same Services
without it. The ipvs mode runs the same table in the guest (tests/guest_ipvs)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import schedcases

from pyproxy.dataplane.bpf import abi

pytestmark = pytest.mark.root


def test_every_scheduler_a_service_asks_for(make_env: Callable) -> None:
    env = make_env(3, client_addresses=schedcases.CLIENT_ADDRESSES)
    env.write_raw("cluster.yaml", schedcases.manifests())
    env.start()
    seen: list[str] = []
    wrong = schedcases.mismatches(env.lab, "bpf", update=lambda text: env.write_raw("cluster.yaml", text), seen=seen)
    assert not wrong, "\n".join(wrong + seen)
    # `pyproxy inspect` says which scheduler each frontend runs, with the table size and the weights.
    inspect = env.running.inspect()
    line = {name: next((row for row in inspect.splitlines() if f"default/sched-{name}:" in row), "")
            for name in abi.SCHED}
    assert " maglev/16381 " in line["maglev"], inspect
    assert " wrr/4 " in line["wrr"] and "weight 3" in line["wrr"], inspect
    assert all(f" {name} " in line[name] for name in ("rr", "lc", "sed", "nq", "sh", "dh", "random")), inspect
    assert " open)" in line["lc"], inspect


def test_each_scheduler_as_the_nodes_default_keeps_a_held_connection_through_restarts(make_env: Callable) -> None:
    """One pyproxy per --bpf-scheduler, each restarted onto the last one's pinned maps: the table's checks on
    the unannotated Services, and a connection held open from the first to the last."""
    env = make_env(3, client_addresses=schedcases.CLIENT_ADDRESSES)
    env.write_raw("cluster.yaml", schedcases.manifests(annotated=False))
    seen: list[str] = []
    wrong: list[str] = []
    holder: subprocess.Popen[str] | None = None
    try:
        for default in abi.SCHED:
            if env.proxy is not None:
                assert env.proxy.terminate(20.0) == 0
            env.start(args=[f"--bpf-scheduler={default}"])
            if holder is None:
                holder = env.lab.popen(env.lab.client, sys.executable, "-m", "labkit.traffic", "hold",
                                       schedcases.service_ip("rr"), "80", "--count", "1", stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                assert holder.stdin is not None and holder.stdout is not None
                held = json.loads(holder.stdout.readline())[0]
            wrong += schedcases.mismatches(env.lab, "bpf", schedulers=[default], annotated=False, seen=seen,
                                           update=lambda text: env.write_raw("cluster.yaml", text))
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(f"keep {held}\n")
            holder.stdin.flush()
            # Answered through the same connection: a restart with another scheduler left it alone.
            assert json.loads(holder.stdout.readline()) == [held], f"the connection held to {held} ended at {default}"
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    assert not wrong, "\n".join(wrong + seen)
