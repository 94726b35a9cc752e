"""The endpoint-port bitmap (MAP_PORTS) that render() keeps: bit `port % 64` of word `port // 64` is set while some
backend in MAP_BACKENDS (ready or not) has that port. The programs read it to decide whether a TCP SYN or UDP
datagram that is no Service's must look for an old flow's reverse entry, so a missing bit lets an old flow capture
a new connection's replies and a stale one only costs a lookup.

Every plan here runs on test_render's map model, which checks after each op that every known backend's port is
in the bitmap and at the end that the bitmap holds exactly the ports of `Applied.backend_refs`."""

from __future__ import annotations

import random

import pytest
from test_render import WEB, Cluster, port

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import Applied, Op, Plan, ports_batch
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend

API = "default/api"


def word_ops(plan: Plan) -> list[tuple[int, int, int]]:
    """(position in the plan, word, value) of each MAP_PORTS write."""
    return [(i, op.key[0], op.value[0]) for i, op in enumerate(plan.ops) if op.map == abi.MAP_PORTS and op.value]


def last(plan: Plan, verb: str, map_name: str) -> int:
    return max(i for i, op in enumerate(plan.ops) if (op.verb, op.map) == (verb, map_name))


def bits(*ports: int) -> dict[int, int]:
    """Words of MAP_PORTS with these ports' bits."""
    words: dict[int, int] = {}
    for p in ports:
        words[p // 64] = words.get(p // 64, 0) | 1 << (p % 64)
    return words


def test_new_backends_set_exactly_their_ports_bits_right_after_the_backends() -> None:
    c = Cluster()
    ready = [Backend("10.0.1.1", 8080), Backend("10.0.1.2", 1), Backend("10.0.1.3", 65535)]
    plan = c.sync({WEB: [port(WEB, "10.96.0.10", 80, ready, not_ready=[Backend("10.0.1.9", 63)])]})
    ops = word_ops(plan)
    assert {w: v for _, w, v in ops} == bits(8080, 1, 65535, 63)  # words 126, 0 (ports 1 and 63), 1023
    first_port, backends_done = ops[0][0], last(plan, "put", abi.MAP_BACKENDS)
    assert [i for i, _, _ in ops] == list(range(backends_done + 1, backends_done + 1 + len(ops)))
    assert first_port < min(i for i, op in enumerate(plan.ops) if op.map == abi.MAP_SLOTS)
    assert {w: v for w, v in enumerate(c.applied.port_words) if v} == bits(8080, 1, 65535, 63)
    assert c.applied.port_backends == {8080: 1, 1: 1, 65535: 1, 63: 1}


def test_a_port_already_set_is_not_written_again() -> None:
    c = Cluster()
    c.sync({WEB: [port(WEB, "10.96.0.10", 80, [Backend("10.0.1.1", 8080)])]})
    plan = c.sync({API: [port(API, "10.96.0.11", 80, [Backend("10.0.2.1", 8080)])]})
    assert word_ops(plan) == []
    assert c.applied.port_backends == {8080: 2}


def test_a_shared_port_stays_set_until_its_last_backend_goes() -> None:
    c = Cluster()
    a, b, shared = Backend("10.0.1.1", 8080), Backend("10.0.2.1", 8080), Backend("10.0.3.1", 9000)
    c.sync({WEB: [port(WEB, "10.96.0.10", 80, [a, shared])],
            API: [port(API, "10.96.0.11", 80, [b], not_ready=[shared])]})
    assert c.applied.port_backends == {8080: 2, 9000: 1}

    plan = c.sync({WEB: []})  # a goes, b still has 8080; shared (9000) is still API's not-ready endpoint
    assert word_ops(plan) == []
    assert c.applied.port_backends == {8080: 1, 9000: 1}

    plan = c.sync({API: [port(API, "10.96.0.11", 80, [b])]})  # shared leaves: 9000 has no backend left
    ((i, w, v),) = word_ops(plan)
    assert (w, v) == (9000 // 64, 0) and i > last(plan, "del", abi.MAP_BACKENDS)

    plan = c.sync({API: []})
    ((i, w, v),) = word_ops(plan)
    assert (w, v) == (8080 // 64, 0) and i > last(plan, "del", abi.MAP_BACKENDS)
    assert plan.ops[-1].map == abi.MAP_EPOCH  # the epoch bump stays the plan's last op
    assert c.applied.port_backends == {} and not any(c.applied.port_words)


def test_a_word_that_gains_and_loses_bits_is_widened_first_and_narrowed_after_the_deletions() -> None:
    c = Cluster()
    c.sync({WEB: [port(WEB, "10.96.0.10", 80, [Backend("10.0.1.1", 8080)])]})
    plan = c.sync({WEB: [port(WEB, "10.96.0.10", 80, [Backend("10.0.1.1", 8081)])]})  # same word, next bit
    (widen_at, w1, widened), (narrow_at, w2, narrowed) = word_ops(plan)
    assert w1 == w2 == 126
    assert widened == bits(8080, 8081)[126] and narrowed == bits(8081)[126]
    assert last(plan, "put", abi.MAP_BACKENDS) < widen_at < last(plan, "put", abi.MAP_SLOTS)
    assert last(plan, "del", abi.MAP_BACKENDS) < narrow_at


def test_the_same_endpoint_in_two_services_counts_once() -> None:
    c = Cluster()
    be = Backend("10.0.1.1", 8080)
    c.sync({WEB: [port(WEB, "10.96.0.10", 80, [be])], API: [port(API, "10.96.0.11", 80, [be])]})
    assert c.applied.port_backends == {8080: 1}
    assert word_ops(c.sync({WEB: []})) == []
    assert [(w, v) for _, w, v in word_ops(c.sync({API: []}))] == [(126, 0)]


def test_a_restart_rebuilds_the_counts_and_the_whole_bitmap_from_the_backends() -> None:
    c = Cluster()
    unreferenced = Backend("10.0.9.9", 7000)  # in MAP_BACKENDS, no frontend knows it (read back after a restart)
    c.sync({WEB: [port(WEB, "10.96.0.10", 80, [Backend("10.0.1.1", 8080), Backend("10.0.1.2", 53)],
                       protocol=Protocol.TCP)],
            API: [port(API, "10.96.0.11", 53, [Backend("10.0.1.2", 53)], protocol=Protocol.UDP)]})
    restarted = Applied(c.applied.frontends, {**c.applied.backend_refs, unreferenced: 0}, c.applied.epoch)
    assert restarted.port_backends == {8080: 1, 53: 1, 7000: 1}
    assert {w: v for w, v in enumerate(restarted.port_words) if v} == bits(8080, 53, 7000)

    batch = ports_batch(restarted)  # what start() writes over whatever the map held
    assert (batch.verb, batch.map, len(batch.keys)) == ("put", abi.MAP_PORTS, abi.PORT_WORDS)
    assert [k for (k,) in batch.keys] == list(range(abi.PORT_WORDS))
    assert batch.values is not None and [v for (v,) in batch.values] == restarted.port_words

    # The first plan after the restart removes the unreferenced backend, and with it its port.
    c.applied = restarted
    for op in batch.ops():
        c.model.run(op)
    c.model.maps[abi.MAP_BACKENDS][unreferenced] = (0,)
    plan = c.sync({WEB: [port(WEB, "10.96.0.10", 80, [Backend("10.0.1.1", 8080), Backend("10.0.1.2", 53)])]})
    assert Op("del", abi.MAP_BACKENDS, unreferenced) in plan.ops
    assert [(w, v) for _, w, v in word_ops(plan)] == [(7000 // 64, 0)]
    assert c.applied.port_backends == {8080: 1, 53: 1}


@pytest.mark.parametrize("seed", range(5))
def test_random_syncs_keep_the_bitmap_exact(seed: int) -> None:
    """Backends on few ports, sharing words and bits, come and go; Cluster.sync checks the bitmap after every op
    and compares it with Applied's backends after every plan."""
    rng = random.Random(seed)
    pool = [Backend(f"10.0.{i // 8}.{i % 8}", rng.choice([80, 81, 127, 128, 8080, 8081, 65535])) for i in range(24)]
    services = [f"ns/s{i}" for i in range(8)]
    c = Cluster()
    for _ in range(150):
        plan = {}
        for svc in rng.sample(services, rng.randint(1, 3)):
            plan[svc] = [port(svc, f"10.96.1.{services.index(svc)}", number, rng.sample(pool, rng.randint(0, 4)),
                              not_ready=rng.sample(pool, rng.randint(0, 2)), name=str(number))
                         for number in rng.sample([80, 443], rng.randint(0, 2))]
        c.sync(plan)
        expected: dict[int, int] = {}
        for b in c.applied.backend_refs:
            expected[b.port] = expected.get(b.port, 0) + 1
        assert c.applied.port_backends == expected
