"""render(): desired state to ordered BPF map operations, checked without a kernel.

Every plan is also run against `MapModel`, a dictionary model of the maps that after each single operation
checks what the datapath needs at that instant (a frontend's slots 0..count-1 exist and point at known
backends, with ClientIP affinity each of those backends is in its affinity entries, no two frontends share a
service id, every known backend's port is in the port bitmap), and at the end
that the maps hold exactly what `Applied` says once the plan is committed, and that its indexes match a fresh
`Applied` built from the same state. The ordering tests then pin the specific orders render.py promises.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Mapping
from dataclasses import replace

import pytest

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.render import (
    DEFAULT_SCHEDULING,
    NO_MASQUERADE,
    Applied,
    CapacityError,
    Op,
    Plan,
    Scheduling,
    frontend_key,
    next_epoch,
    render,
    wrr_round,
)
from pyproxy.model.objects import Protocol
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

WEB, DNS = "default/web", "kube-system/dns"
A, B, C, D = (Backend(f"10.0.1.{i}", 8080) for i in (1, 2, 3, 4))
X, Y = Backend("10.0.2.1", 53), Backend("10.0.2.2", 53)

MapContents = dict[str, dict[tuple, tuple]]


def port(
    service: str,
    ip: str,
    number: int,
    backends: Iterable[Backend],
    *,
    not_ready: Iterable[Backend] = (),
    protocol: Protocol = Protocol.TCP,
    affinity: int = 0,
    name: str = "",
) -> ServicePortState:
    ready = tuple(sorted(backends))
    return ServicePortState(
        service=service,
        port_name=name,
        frontend=Frontend(ip, number, protocol),
        backends=ready,
        known_backends=tuple(sorted(set(ready) | set(not_ready))),
        session_affinity_seconds=affinity,
    )


def web(*backends: Backend, not_ready: Iterable[Backend] = (), number: int = 80) -> ServicePortState:
    return port(WEB, "10.96.0.10", number, backends, not_ready=not_ready)


def dns(*backends: Backend) -> ServicePortState:
    return port(DNS, "10.96.0.53", 53, backends, protocol=Protocol.UDP, name="dns")


class MapModel:
    """The maps render() writes, as dictionaries keyed and valued by the ops' tuples."""

    def __init__(self, endpoint_counters: bool = False) -> None:
        self.maps: MapContents = {m: {} for m in (abi.MAP_SERVICES, abi.MAP_SLOTS, abi.MAP_TABLES, abi.MAP_BACKENDS,
                                                  abi.MAP_NAMES, abi.MAP_EPOCH, abi.MAP_PORTS, abi.MAP_AFFINITY)}
        self.endpoint_counters = endpoint_counters
        if endpoint_counters:
            self.maps[abi.MAP_EPSTATS] = {}
        self.resets: list[int] = []
        self.fresh: set[int] = set()
        self.epochs_seen: set[tuple] = set()
        self.last_op: Op | None = None
        self.losing_affinity: set[int] = set()
        """Service ids whose affinity the running plan turns off: their slots may meanwhile hold backends their
        affinity entries do not (the flag goes with the plan's entry write)."""

    def run(self, op: Op) -> None:
        self.last_op = op
        if op.verb == "reset":
            assert op.map == abi.MAP_STATS
            self.resets.append(op.key[0])
        elif op.map == abi.MAP_TABLES:
            self.run_table(op)
        elif op.verb == "put" and op.map == abi.MAP_PORTS and op.value == (0,):
            self.maps[op.map].pop(op.key, None)  # an array: a zero word is the same as one never written
        elif op.verb == "put":
            assert op.value is not None
            self.maps[op.map][op.key] = op.value
        else:
            assert op.verb == "del", op
            self.maps[op.map].pop(op.key, None)

    def run_table(self, op: Op) -> None:
        """MAP_TABLES as the programs see it: (service id, entry) -> backend; a new table replaces the old one
        once written (Maps.tables), so "new" only says which entries the next puts start afresh."""
        tables = self.maps[abi.MAP_TABLES]
        if op.verb == "new":
            self.fresh.add(op.key[0])
        elif op.verb == "put":
            svc_id = op.key[0]
            if svc_id in self.fresh:
                self.fresh.discard(svc_id)
                for key in [k for k in tables if k[0] == svc_id]:
                    del tables[key]
            tables[op.key] = op.value
        else:
            for key in [k for k in tables if k[0] == op.key[0]]:
                del tables[key]

    def check_epoch(self, plan: Plan) -> None:
        """The datapath trusts a flow's backend while the backends epoch is the one it was confirmed at, so a
        plan that deletes backends must make a never-seen epoch current after its last deletion, and a plan
        that deletes none leaves the epoch (and every flow's check) alone."""
        ops = plan.ops
        deletions = [i for i, op in enumerate(ops) if op.verb == "del" and op.map == abi.MAP_BACKENDS]
        bumps = [i for i, op in enumerate(ops) if op.map == abi.MAP_EPOCH]
        if not deletions:
            assert bumps == []
            return
        assert bumps == [len(ops) - 1] and bumps[0] > deletions[-1]
        epoch = self.maps[abi.MAP_EPOCH][0,]
        assert epoch not in self.epochs_seen and epoch != (0,)
        self.epochs_seen.add(epoch)

    def check_servable(self) -> None:
        services, slots, backends = (self.maps[m] for m in (abi.MAP_SERVICES, abi.MAP_SLOTS, abi.MAP_BACKENDS))
        ids = [v[0] for v in services.values()]
        assert len(ids) == len(set(ids)), f"two frontends share a service id: {services}"
        tables, affinity = self.maps[abi.MAP_TABLES], self.maps[abi.MAP_AFFINITY]
        for key, (svc_id, count, flags, *_, table_size) in services.items():
            # With affinity, a backend a new flow may pick is one the client's next flows may stay with.
            sticky = flags & abi.SVC_F_AFFINITY and svc_id not in self.losing_affinity
            for i in range(count):
                assert (svc_id, i) in slots, f"{key}: slot {i} of {count} missing"
                assert slots[svc_id, i][:2] in backends, f"{key}: slot {i} points at unknown {slots[svc_id, i]}"
                assert not sticky or (svc_id, *slots[svc_id, i][:2]) in affinity, \
                    f"{key}: slot {i}'s {slots[svc_id, i]} not in its affinity entries"
            for i in range(table_size):
                # A table being replaced by one of another size may miss entries: the programs choose at random.
                entry = tables.get((svc_id, i))
                assert entry is None or entry in backends, f"{key}: table entry {i} of {table_size} unknown"
                assert entry is None or not sticky or (svc_id, *entry) in affinity, \
                    f"{key}: table entry {i}'s {entry} not in its affinity entries"
        if self.endpoint_counters:
            # A backend a slot can point at is counted from its first packet: its counters came before it.
            uncounted = set(backends) - set(self.maps[abi.MAP_EPSTATS])
            assert not uncounted, f"backends without counters: {uncounted}"
        if self.last_op is not None and self.last_op[:2] in (("put", abi.MAP_BACKENDS), ("put", abi.MAP_PORTS)):
            return  # a new backend's port bit comes with the batch after the backends', a word at a time
        words = self.maps[abi.MAP_PORTS]
        for _, p in backends:
            assert words.get((p // 64,), (0,))[0] >> (p % 64) & 1, f"port {p} of a known backend not in the bitmap"


def contents(applied: Applied, endpoint_counters: bool = False) -> MapContents:
    """What the maps hold when they match `applied` (MAP_EPSTATS: as written, zeroed; the model counts nothing)."""
    fes = applied.frontends
    counters = {abi.MAP_EPSTATS: {(b.ip, b.port): (0, 0) for b in applied.backend_refs}} if endpoint_counters else {}
    return {
        **counters,
        abi.MAP_SERVICES: {
            k: (f.svc_id, len(f.backends), f.flags | (abi.SVC_F_AFFINITY if f.affinity_sec else 0), f.affinity_sec,
                f.sched, len(f.table))
            for k, f in fes.items()
        },
        abi.MAP_SLOTS: {(f.svc_id, i): (b.ip, b.port, f.weights[i] if f.weights else 1)
                        for f in fes.values() for i, b in enumerate(f.backends)},
        abi.MAP_TABLES: {(f.svc_id, i): (b.ip, b.port) for f in fes.values() for i, b in enumerate(f.table)},
        abi.MAP_BACKENDS: {(b.ip, b.port): (0,) for b in applied.backend_refs},
        abi.MAP_NAMES: {(f.svc_id,): (f.name,) for f in fes.values()},
        abi.MAP_EPOCH: {(0,): (applied.epoch,)} if applied.epoch else {},
        abi.MAP_PORTS: port_words({b.port for b in applied.backend_refs}),
        abi.MAP_AFFINITY: {(f.svc_id, b.ip, b.port): (0,) for f in fes.values() if f.affinity_sec for b in f.backends},
    }


def port_words(ports: Iterable[int]) -> dict[tuple, tuple]:
    """MAP_PORTS holding exactly `ports` (words never written are absent: zero in the array map)."""
    words: dict[int, int] = {}
    for p in ports:
        words[p // 64] = words.get(p // 64, 0) | 1 << (p % 64)
    return {(w,): (v,) for w, v in words.items()}


def check_indexes(applied: Applied) -> None:
    """The incremental indexes equal those built from scratch from the same frontends and references."""
    fresh = Applied(applied.frontends, applied.backend_refs)
    assert applied == fresh
    assert applied.by_service == fresh.by_service
    assert applied.slots == fresh.slots == sum(len(f.backends) for f in applied.frontends.values())
    six = [(k, f) for k, f in applied.frontends.items() if ":" in k[0]]
    assert applied.slots6 == fresh.slots6 == sum(len(f.backends) for _, f in six)
    assert applied.frontends6 == fresh.frontends6 == len(six)
    assert applied.ids6 == fresh.ids6 == {f.svc_id for _, f in six}
    assert applied.backends6 == fresh.backends6 == sum(1 for b in applied.backend_refs if ":" in b.ip)
    sticky = [(k, f) for k, f in applied.frontends.items() if f.affinity_sec]
    assert applied.affinity == fresh.affinity == sum(len(f.backends) for _, f in sticky)
    assert applied.affinity6 == fresh.affinity6 == sum(len(f.backends) for k, f in sticky if ":" in k[0])
    assert applied.max_id() == max((f.svc_id for f in applied.frontends.values()), default=-1)
    assert applied.new_ids(3) == fresh.new_ids(3)


class Cluster:
    """Successive plans, each run on the map model as BpfDataplane.apply runs them on the kernel."""

    def __init__(self, capacity: Mapping[str, int] | None = None, endpoint_counters: bool = False) -> None:
        self.applied = Applied()
        self.model = MapModel(endpoint_counters)
        self.capacity = dict(capacity or {})
        self.endpoint_counters = endpoint_counters

    def sync(self, desired: Mapping[str, Iterable[ServicePortState]],
             scheduling: Scheduling = DEFAULT_SCHEDULING) -> Plan:
        plan = render(self.applied, {k: tuple(v) for k, v in desired.items()}, self.capacity, NO_MASQUERADE,
                      scheduling, self.endpoint_counters)
        self.model.losing_affinity = {fe.svc_id for fe in plan.upserts.values() if not fe.affinity_sec}
        for op in plan.ops:
            self.model.run(op)
            self.model.check_servable()
        self.model.check_epoch(plan)
        self.applied.commit(plan)
        assert self.model.maps == contents(self.applied, self.endpoint_counters)
        check_indexes(self.applied)
        return plan

    def svc_id(self, st: ServicePortState) -> int:
        fe = st.frontend
        return self.applied.frontends[frontend_key(fe)].svc_id


def positions(plan: Plan, verb: str, map_name: str) -> list[int]:
    return [i for i, op in enumerate(plan.ops) if op.verb == verb and op.map == map_name]


def test_new_service_writes_backends_then_slots_then_its_entry() -> None:
    c = Cluster()
    plan = c.sync({WEB: [web(A, B, C, not_ready=[D])]})
    backends, slots = positions(plan, "put", abi.MAP_BACKENDS), positions(plan, "put", abi.MAP_SLOTS)
    (entry,) = positions(plan, "put", abi.MAP_SERVICES)
    (reset,) = positions(plan, "reset", abi.MAP_STATS)
    assert len(backends) == 4 and len(slots) == 3  # not-ready D is known, never in a slot
    assert max(backends) < min(slots) and max(slots) < entry
    assert reset < entry  # counting starts from zero, never wiped after the first packet
    assert plan.ops[entry] == Op("put", abi.MAP_SERVICES, ("10.96.0.10", 80, "TCP", 0),
                                   (0, 3, abi.SVC_F_SOCK_PODS, 0, 0, 0))


def test_shrinking_deletes_slots_after_the_count_shrinks() -> None:
    c = Cluster()
    c.sync({WEB: [web(A, B, C)]})
    plan = c.sync({WEB: [web(A)]})
    svc_id = c.svc_id(web(A))
    assert [(op.verb, op.map, op.key) for op in plan.ops] == [
        ("put", abi.MAP_SERVICES, ("10.96.0.10", 80, "TCP", 0)),
        ("del", abi.MAP_SLOTS, (svc_id, 1)),
        ("del", abi.MAP_SLOTS, (svc_id, 2)),
        ("del", abi.MAP_BACKENDS, (B.ip, B.port)),
        ("del", abi.MAP_BACKENDS, (C.ip, C.port)),
        ("put", abi.MAP_EPOCH, (0,)),
    ]
    assert plan.ops[0].value == (svc_id, 1, abi.SVC_F_SOCK_PODS, 0, 0, 0)
    assert plan.ops[-1].value == (1,) and c.applied.epoch == 1


def test_growing_and_reordering_writes_slots_before_the_count_grows() -> None:
    c = Cluster()
    c.sync({WEB: [web(B, C)]})
    plan = c.sync({WEB: [web(A, B, C, D)]})  # A sorts first: every slot moves
    (entry,) = positions(plan, "put", abi.MAP_SERVICES)
    assert positions(plan, "put", abi.MAP_SLOTS) == list(range(entry - 4, entry))
    assert max(positions(plan, "put", abi.MAP_BACKENDS)) < entry - 4


def test_removing_a_service_deletes_its_entry_then_slots_then_backends() -> None:
    c = Cluster()
    c.sync({WEB: [web(A, B, not_ready=[C])]})
    svc_id = c.svc_id(web(A))
    plan = c.sync({WEB: []})
    assert [(op.verb, op.map, op.key) for op in plan.ops] == [
        ("del", abi.MAP_SERVICES, ("10.96.0.10", 80, "TCP", 0)),
        ("del", abi.MAP_SLOTS, (svc_id, 0)),
        ("del", abi.MAP_SLOTS, (svc_id, 1)),
        ("del", abi.MAP_NAMES, (svc_id,)),
        ("del", abi.MAP_BACKENDS, (A.ip, A.port)),
        ("del", abi.MAP_BACKENDS, (B.ip, B.port)),
        ("del", abi.MAP_BACKENDS, (C.ip, C.port)),
        ("put", abi.MAP_PORTS, (8080 // 64,)),  # no backend left on 8080: its bit goes
        ("put", abi.MAP_EPOCH, (0,)),
    ]
    assert c.applied == Applied()


@pytest.mark.parametrize("web_in_plan", [False, True], ids=["dns-only", "both-services"])
def test_a_change_to_one_service_touches_only_that_service(web_in_plan: bool) -> None:
    c = Cluster()
    c.sync({WEB: [web(A, B)], DNS: [dns(X)]})
    web_before = {k: f for k, f in c.applied.frontends.items() if f.service == WEB}
    dns_id = c.svc_id(dns(X))
    plan = c.sync({DNS: [dns(X, Y)], **({WEB: [web(A, B)]} if web_in_plan else {})})
    assert plan.ops, "the DNS change is planned"
    for op in plan.ops:
        if op.map in (abi.MAP_SLOTS, abi.MAP_NAMES, abi.MAP_STATS):
            assert op.key[0] == dns_id, op
        else:
            assert op.key in {("10.96.0.53", 53, "UDP", 0), (X.ip, X.port), (Y.ip, Y.port)}, op
    assert {k: f for k, f in c.applied.frontends.items() if f.service == WEB} == web_before


def test_unchanged_render_plans_nothing() -> None:
    c = Cluster()
    desired = {WEB: [web(A, B, not_ready=[C])], DNS: [dns(X)]}
    c.sync(desired)
    applied = copy.deepcopy(c.applied)
    plan = c.sync(desired)
    assert plan.ops == ()
    assert c.applied == applied


def test_service_ids_stay_put_and_a_reused_id_starts_from_zero_stats() -> None:
    c = Cluster()
    c.sync({WEB: [web(A)], DNS: [dns(X)]})
    web_id, dns_id = c.svc_id(web(A)), c.svc_id(dns(X))
    assert web_id != dns_id
    c.sync({WEB: [web(A, B)]})  # a changed frontend keeps its id
    assert (c.svc_id(web(A, B)), c.svc_id(dns(X))) == (web_id, dns_id)

    c.sync({WEB: []})
    c.model.resets.clear()
    other = port("default/other", "10.96.0.99", 443, [C])
    c.sync({"default/other": [other]})
    assert c.svc_id(other) == web_id  # the freed id is reused ...
    assert c.model.resets == [web_id]  # ... and its per-CPU counters zeroed before use
    assert c.svc_id(dns(X)) == dns_id


def test_a_frontend_replaced_within_one_plan_keeps_its_slots() -> None:
    """A Service whose port changes: old frontend out, new one in, one plan. The new frontend must not get
    the id whose slots the old frontend's removals delete later in the same plan (MapModel checks it)."""
    c = Cluster()
    c.sync({WEB: [web(A, B)]})
    c.sync({WEB: [web(A, B, number=8080)]})
    assert set(c.applied.frontends) == {("10.96.0.10", 8080, "TCP", 0)}


def test_a_frontend_moving_between_services_is_updated_in_place() -> None:
    c = Cluster()
    moved = port(WEB, "10.96.0.10", 80, [A])
    c.sync({WEB: [moved]})
    svc_id = c.svc_id(moved)
    new_owner = port("default/web2", "10.96.0.10", 80, [B], name="http")
    plan = c.sync({WEB: [], "default/web2": [new_owner]})
    assert not positions(plan, "del", abi.MAP_SERVICES)
    assert c.svc_id(new_owner) == svc_id
    assert c.applied.frontends["10.96.0.10", 80, "TCP", 0].service == "default/web2"


def test_client_ip_affinity_is_flagged_with_its_timeout() -> None:
    c = Cluster()
    plan = c.sync({WEB: [port(WEB, "10.96.0.10", 80, [A], affinity=10800)]})
    (entry,) = positions(plan, "put", abi.MAP_SERVICES)
    assert plan.ops[entry].value == (0, 1, abi.SVC_F_AFFINITY | abi.SVC_F_SOCK_PODS, 10800, 0, 0)


def sticky(*backends: Backend, not_ready: Iterable[Backend] = (), affinity: int = 10800) -> ServicePortState:
    return port(WEB, "10.96.0.10", 80, backends, not_ready=not_ready, affinity=affinity)


def affinity_ops(plan: Plan) -> list[tuple[str, tuple]]:
    return [(op.verb, op.key) for op in plan.ops if op.map == abi.MAP_AFFINITY]


def test_affinity_entries_hold_the_slots_of_frontends_with_affinity_only() -> None:
    """MAP_AFFINITY: (service id, backend) for each slot of a frontend with ClientIP affinity, the endpoints a
    client's affinity may keep: never a not-ready one, and nothing for a frontend without affinity."""
    c = Cluster()
    plan = c.sync({WEB: [sticky(A, B, not_ready=[C])], DNS: [dns(X)]})
    web_id = c.svc_id(sticky(A))
    assert affinity_ops(plan) == [("put", (web_id, A.ip, A.port)), ("put", (web_id, B.ip, B.port))]
    assert c.model.maps[abi.MAP_AFFINITY] == {(web_id, A.ip, A.port): (0,), (web_id, B.ip, B.port): (0,)}


def test_a_backend_joins_the_affinity_entries_before_a_slot_holds_it_and_leaves_after_none_does() -> None:
    c = Cluster()
    c.sync({WEB: [sticky(A, B)]})
    web_id = c.svc_id(sticky(A))
    # B becomes unready (terminating beside ready ones), C ready: B's slot is C's now.
    plan = c.sync({WEB: [sticky(A, C, not_ready=[B])]})
    assert affinity_ops(plan) == [("put", (web_id, C.ip, C.port)), ("del", (web_id, B.ip, B.port))]
    (put,), (dele,) = positions(plan, "put", abi.MAP_AFFINITY), positions(plan, "del", abi.MAP_AFFINITY)
    (entry,) = positions(plan, "put", abi.MAP_SERVICES)
    assert put < min(positions(plan, "put", abi.MAP_SLOTS)) and dele > entry
    # The Service goes: its affinity entries after its entry and slots.
    plan = c.sync({WEB: []})
    assert sorted(affinity_ops(plan)) == [("del", (web_id, A.ip, A.port)), ("del", (web_id, C.ip, C.port))]
    assert min(positions(plan, "del", abi.MAP_AFFINITY)) > max(positions(plan, "del", abi.MAP_SLOTS))
    assert c.applied.affinity == 0


def test_affinity_turned_on_writes_its_entries_first_and_turned_off_deletes_them_last() -> None:
    c = Cluster()
    c.sync({WEB: [sticky(A, B, affinity=0)]})
    web_id = c.svc_id(sticky(A))
    plan = c.sync({WEB: [sticky(A, B)]})
    (entry,) = positions(plan, "put", abi.MAP_SERVICES)
    assert [op.key for op in plan.ops[:entry]] == [(web_id, A.ip, A.port), (web_id, B.ip, B.port)]
    plan = c.sync({WEB: [sticky(A, B, affinity=0)]})
    assert [(op.verb, op.map) for op in plan.ops] == [("put", abi.MAP_SERVICES)] + [("del", abi.MAP_AFFINITY)] * 2
    # Another timeout alone changes no entry.
    c.sync({WEB: [sticky(A, B)]})
    assert affinity_ops(c.sync({WEB: [sticky(A, B, affinity=60)]})) == []


def test_the_affinity_map_counts_the_new_entries_written_before_the_old_ones_go() -> None:
    c = Cluster({abi.MAP_AFFINITY: 3})
    c.sync({WEB: [sticky(A, B)], DNS: [dns(X, Y)]})  # 2 entries: DNS has no affinity
    c.sync({WEB: [sticky(A, C, not_ready=[B])]})  # C comes before B goes: 3 at the peak
    before, model = copy.deepcopy(c.applied), copy.deepcopy(c.model.maps)
    with pytest.raises(CapacityError, match=abi.MAP_AFFINITY):
        c.sync({WEB: [sticky(B, D, not_ready=[A, C])]})  # 4 at the peak, though 2 after
    assert c.applied == before and c.model.maps == model


@pytest.mark.parametrize(
    ("full_map", "size"),
    [(abi.MAP_SERVICES, 2), (abi.MAP_SLOTS, 3), (abi.MAP_BACKENDS, 3), (abi.MAP_STATS, 2)],
)
def test_capacity_exceeded_names_the_map_and_changes_nothing(full_map: str, size: int) -> None:
    c = Cluster({full_map: size})
    c.sync({WEB: [web(A, B)], DNS: [dns(X)]})  # 2 frontends, 3 slots, 3 backends, ids 0..1: fits
    before, model = copy.deepcopy(c.applied), copy.deepcopy(c.model.maps)
    grow = {WEB: [web(A, B), web(C, number=443)]}  # one more of everything
    with pytest.raises(CapacityError, match=full_map):
        c.sync(grow)
    assert c.applied == before and c.model.maps == model


def test_the_endpoint_counters_map_must_hold_every_backend_when_they_count() -> None:
    for counters in (False, True):
        c = Cluster({abi.MAP_EPSTATS: 2}, endpoint_counters=counters)
        c.sync({WEB: [web(A, B)]})
        if counters:
            with pytest.raises(CapacityError, match=abi.MAP_EPSTATS):
                c.sync({DNS: [dns(X)]})
        else:
            c.sync({DNS: [dns(X)]})  # the map stays empty: its size does not matter


def test_an_endpoint_keeps_its_counters_while_any_service_has_it() -> None:
    c = Cluster(endpoint_counters=True)
    c.sync({WEB: [web(A, B)], DNS: [port(DNS, "10.96.0.53", 53, [A])]})
    plan = c.sync({WEB: [web(B)]})
    assert [op for op in plan.ops if op.map == abi.MAP_EPSTATS] == []
    plan = c.sync({DNS: []})
    assert [op for op in plan.ops if op.map == abi.MAP_EPSTATS] == [Op("del", abi.MAP_EPSTATS, (A.ip, A.port))]


def test_the_first_plan_of_a_restart_writes_no_counters_of_backends_the_map_holds() -> None:
    """Backends read back from the maps after a restart are unreferenced until the first sync references them
    again and writes them to the backends map once more: their counters are not written again (that would zero
    them); only backends new to the map get theirs."""
    held = Applied(backend_refs={A: 0})
    plan = render(held, {WEB: (web(A, B),)}, {}, endpoint_counters=True)
    assert [op for op in plan.ops if op.map == abi.MAP_EPSTATS] == [Op("put", abi.MAP_EPSTATS, (B.ip, B.port), (0, 0))]
    assert Op("put", abi.MAP_BACKENDS, (A.ip, A.port), (0,)) in plan.ops


def test_sctp_frontends_are_reported_skipped() -> None:
    c = Cluster()
    sctp = port(WEB, "10.96.0.10", 9000, [A], protocol=Protocol.SCTP, name="sig")
    plan = c.sync({WEB: [web(A), sctp]})
    assert len(plan.skipped) == 1 and "10.96.0.10:9000/SCTP" in plan.skipped[0]
    assert "default/web:sig" in plan.skipped[0]
    assert set(c.applied.frontends) == {("10.96.0.10", 80, "TCP", 0)}


def test_unreferenced_backends_read_back_after_a_restart_go_with_the_next_plan() -> None:
    c = Cluster()
    c.sync({WEB: [web(A)]})
    # As Maps.read_applied() returns it: a backend still in the map that no frontend references.
    c.applied = Applied(c.applied.frontends, {**c.applied.backend_refs, D: 0})
    c.model.maps[abi.MAP_BACKENDS][D.ip, D.port] = (0,)
    plan = c.sync({DNS: [dns(X)]})  # a plan about another Service still removes it
    assert Op("del", abi.MAP_BACKENDS, (D.ip, D.port)) in plan.ops
    assert D not in c.applied.backend_refs


def test_a_not_ready_endpoint_keeps_the_epoch_and_a_removed_one_bumps_it_once() -> None:
    """Flows re-check their backend only after backends left the maps: a backend that turns not ready is
    still an endpoint (its connections stay), so nothing is bumped; removing two in one plan bumps once."""
    c = Cluster()
    c.sync({WEB: [web(A, B, C)]})
    assert c.applied.epoch == 0
    assert [op.map for op in c.sync({WEB: [web(A, not_ready=[B, C])]}).ops if op.map == abi.MAP_EPOCH] == []
    plan = c.sync({WEB: [web(A)]})
    assert [op for op in plan.ops if op.map == abi.MAP_EPOCH] == [Op("put", abi.MAP_EPOCH, (0,), (1,))]
    c.sync({DNS: [dns(X)]})
    c.sync({DNS: []})
    assert c.applied.epoch == 2


def test_epochs_skip_zero_when_they_wrap() -> None:
    assert next_epoch(0) == 1 and next_epoch(5) == 6 and next_epoch(0xFFFFFFFF) == 1


def test_a_plan_commits_only_onto_the_state_it_was_made_from() -> None:
    applied = Applied()
    plan = render(applied, {WEB: [web(A)]}, {})
    applied.commit(plan)
    with pytest.raises(ValueError, match="generation"):
        applied.commit(plan)


def test_the_stats_capacity_counts_the_largest_id_left_after_the_plan() -> None:
    c = Cluster({abi.MAP_STATS: 2})
    c.sync({WEB: [web(A)], DNS: [dns(X)]})  # ids 0 and 1
    assert c.svc_id(dns(X)) == 1
    # DNS (id 1) goes and a new Service comes in the same plan: it gets id 2, the ids in use after the plan
    # are 0 and 2, which do not fit. Without DNS's removal they would be 0, 1 and 2: no different.
    with pytest.raises(CapacityError, match=abi.MAP_STATS):
        c.sync({DNS: [], "default/other": [port("default/other", "10.96.0.99", 443, [C])]})
    c.sync({DNS: []})
    c.sync({"default/other": [port("default/other", "10.96.0.99", 443, [C])]})  # takes the freed id 1
    assert c.applied.max_id() == 1


def test_a_cold_start_comes_in_few_batches() -> None:
    """The backend writes each batch (ops of one kind on one map) with one syscall."""
    c = Cluster()
    desired = {f"ns/svc-{i}": [port(f"ns/svc-{i}", f"10.96.1.{i}", 80, [Backend(f"10.1.{i}.{j}", 80)
                                                                         for j in range(3)])]
               for i in range(50)}
    plan = c.sync(desired)
    assert [(b.verb, b.map, len(b.keys)) for b in plan.batches] == [
        ("put", abi.MAP_BACKENDS, 150), ("put", abi.MAP_PORTS, 1), ("reset", abi.MAP_STATS, 50),
        ("put", abi.MAP_SLOTS, 150), ("put", abi.MAP_SERVICES, 50), ("put", abi.MAP_NAMES, 50)]
    plan = c.sync({k: [] for k in desired})
    assert [(b.verb, b.map, len(b.keys)) for b in plan.batches] == [
        ("del", abi.MAP_SERVICES, 50), ("del", abi.MAP_SLOTS, 150), ("del", abi.MAP_NAMES, 50),
        ("del", abi.MAP_BACKENDS, 150), ("put", abi.MAP_PORTS, 1), ("put", abi.MAP_EPOCH, 1)]


@pytest.mark.parametrize("counters", [False, True], ids=["", "endpoint-counters"])
@pytest.mark.parametrize("seed", range(5))
def test_random_partial_syncs_keep_the_maps_servable_and_the_indexes_exact(seed: int, counters: bool) -> None:
    """Services come, go, change backends, ports and ClusterIPs (taking over each other's), one plan at a
    time over a few of them; Cluster.sync checks every op and the indexes after every plan (with per-endpoint
    counters: every backend has its counters before a slot can point at it, and exactly the backends have them
    after each plan)."""
    rng = random.Random(seed)
    pool = [Backend(f"10.0.{i // 8}.{i % 8}", 8080) for i in range(24)]
    services = [f"ns/s{i}" for i in range(12)]
    c = Cluster(endpoint_counters=counters)
    desired: dict[str, list[ServicePortState]] = {}
    for _ in range(150):
        plan: dict[str, list[ServicePortState]] = {}
        for svc in rng.sample(services, rng.randint(1, 4)):
            states = []
            for number in rng.sample([80, 443, 53], rng.randint(0, 2)):
                ready = rng.sample(pool, rng.randint(0, 5))
                # Half the Services have ClientIP affinity: a ClusterIP taken over by another turns it on or off.
                states.append(port(svc, f"10.96.0.{rng.randint(1, 10)}", number, ready,
                                   not_ready=rng.sample(pool, rng.randint(0, 2)), name=str(number),
                                   affinity=600 * (int(svc[4:]) % 2)))
            plan[svc] = states
        c.sync(plan)
        desired.update(plan)
    # A full plan may still move a frontend that two Services claim (a partial plan leaves it with its
    # holder, a full one gives it to the first by name); a second full plan has nothing left to do.
    c.sync(desired)
    held = copy.deepcopy(c.applied)
    assert c.sync(desired).ops == () and c.applied == held


def test_a_local_policy_frontend_gives_the_node_every_endpoint_in_an_entry_of_its_own() -> None:
    """externalTrafficPolicy Local: packets from outside get this node's endpoints, the node's own sockets every
    endpoint (scope NODE, which the primary entry's SVC_F_NODE_VIEW points them to); once the policy is
    Cluster, the node entry goes."""
    c = Cluster()
    local = replace(port(WEB, "192.168.1.5", 30080, (A, B)), kind=FrontendKind.NODE_PORT, external_backends=(A,))
    c.sync({WEB: [local]})
    services, slots = c.model.maps[abi.MAP_SERVICES], c.model.maps[abi.MAP_SLOTS]
    outside = services["192.168.1.5", 30080, "TCP", abi.SVC_SCOPE_PACKETS]
    node = services["192.168.1.5", 30080, "TCP", abi.SVC_SCOPE_NODE]
    assert outside[1:3] == (1, abi.SVC_F_NODE_VIEW | abi.SVC_F_SOCK_PODS)
    assert slots[outside[0], 0] == (A.ip, A.port, 1)
    assert node[1:3] == (2, abi.SVC_F_SOCK_PODS)
    assert {slots[node[0], i] for i in range(2)} == {(A.ip, A.port, 1), (B.ip, B.port, 1)}
    c.sync({WEB: [replace(local, external_backends=(A, B), masquerade=True)]})
    assert list(c.model.maps[abi.MAP_SERVICES].values()) == [(outside[0], 2, abi.SVC_F_MASQ, 0, 0, 0)]


def test_a_nodeport_on_127_0_0_1_is_a_host_entry_only_served_as_the_node_sees_it() -> None:
    """localhostNodePorts: the socket hooks look 127.0.0.1 up in scope HOST; no PACKETS entry (a packet to a loopback
    address arriving on a device must not reach a Service: CVE-2020-8558), every endpoint as for the node's own
    processes (externalTrafficPolicy Local's short circuit), and pods (whose 127.0.0.1 is their own) left alone."""
    c = Cluster()
    local = replace(port(WEB, "127.0.0.1", 30080, (A, B)), kind=FrontendKind.NODE_PORT, external_backends=(A,))
    c.sync({WEB: [local]})
    services, slots = c.model.maps[abi.MAP_SERVICES], c.model.maps[abi.MAP_SLOTS]
    assert list(services) == [("127.0.0.1", 30080, "TCP", abi.SVC_SCOPE_HOST)]
    host = services["127.0.0.1", 30080, "TCP", abi.SVC_SCOPE_HOST]
    assert host[1:3] == (2, 0)
    assert {slots[host[0], i] for i in range(2)} == {(A.ip, A.port, 1), (B.ip, B.port, 1)}
    c.sync({WEB: []})
    assert list(c.model.maps[abi.MAP_SERVICES]) == []


# -- schedulers ---------------------------------------------------------------------------------------------


def entry(c: Cluster, st: ServicePortState) -> tuple:
    return c.model.maps[abi.MAP_SERVICES][frontend_key(st.frontend)]


def test_a_services_scheduler_or_the_node_default_is_in_its_entry() -> None:
    c = Cluster()
    web = port(WEB, "10.96.0.10", 80, [A, B])
    c.sync({WEB: [replace(web, scheduler="sh")]}, Scheduling("rr"))
    assert entry(c, web)[4:] == (abi.SCHED["sh"], 0)
    c.sync({WEB: [web]}, Scheduling("lc"))
    assert entry(c, web)[4:] == (abi.SCHED["lc"], 0)


def test_weights_go_in_the_slots() -> None:
    c = Cluster()
    # As the model leaves it for weights A=5, B=0: B known (its flows go on), not a backend.
    web = replace(port(WEB, "10.96.0.10", 80, [A, C]), scheduler="sed", weights=((A.ip, 5), (B.ip, 0)),
                  known_backends=(A, B, C))
    c.sync({WEB: [web]})
    svc_id, count = entry(c, web)[:2]
    slots = c.model.maps[abi.MAP_SLOTS]
    assert count == 2 and {slots[svc_id, i] for i in range(2)} == {(A.ip, A.port, 5), (C.ip, C.port, 1)}
    assert (B.ip, B.port) in c.model.maps[abi.MAP_BACKENDS]


def test_wrr_writes_one_smooth_round_and_equal_weights_need_none() -> None:
    assert wrr_round([3, 1]) == [0, 0, 1, 0]
    assert wrr_round([6, 2]) == wrr_round([3, 1])  # divided by the common divisor: the shortest round
    assert wrr_round([5, 1, 1]) == [0, 0, 1, 0, 2, 0, 0]  # the light ones between the heavy one's turns
    rounds = wrr_round([100] + [1] * 999)
    assert len(rounds) < 65536 and rounds.count(0) > 50
    c = Cluster()
    web = replace(port(WEB, "10.96.0.10", 80, [A, B]), scheduler="wrr")
    c.sync({WEB: [web]})
    assert entry(c, web)[4:] == (abi.SCHED["rr"], 0)  # equal weights: plain turns
    c.sync({WEB: [replace(web, weights=((A.ip, 2),))]})
    svc_id = entry(c, web)[0]
    assert entry(c, web)[4:] == (abi.SCHED["wrr"], 3)
    table = c.model.maps[abi.MAP_TABLES]
    assert sorted(table[svc_id, i] for i in range(3)) == [(A.ip, A.port), (A.ip, A.port), (B.ip, B.port)]
    c.sync({WEB: []})
    assert c.model.maps[abi.MAP_TABLES] == {}


def test_a_maglev_table_changes_by_a_delta_and_goes_with_its_frontend() -> None:
    c = Cluster()
    backends = [Backend(f"10.0.3.{i}", 8080) for i in range(1, 11)]
    web = replace(port(WEB, "10.96.0.10", 80, backends), scheduler="maglev")
    c.sync({WEB: [web]}, Scheduling(table_size=251))
    assert entry(c, web)[4:] == (abi.SCHED["maglev"], 251)
    plan = c.sync({WEB: [replace(port(WEB, "10.96.0.10", 80, backends[1:]), scheduler="maglev")]},
                  Scheduling(table_size=251))
    writes = [op for op in plan.ops if op.map == abi.MAP_TABLES]
    assert 0 < len(writes) < 251 // 4  # about the leaving backend's tenth, not the table
    # A larger table: written whole, the entry's size follows.
    c.sync({WEB: [replace(port(WEB, "10.96.0.10", 80, backends[1:]), scheduler="maglev")]},
           Scheduling(table_size=509))
    assert entry(c, web)[4:] == (abi.SCHED["maglev"], 509) and len(c.model.maps[abi.MAP_TABLES]) == 509
    assert [op.verb for op in plan.ops if op.map == abi.MAP_TABLES][0] == "put"  # a delta: no new table
    resized = c.sync({WEB: [replace(port(WEB, "10.96.0.10", 80, backends[1:]), scheduler="maglev")]},
                     Scheduling(table_size=1021))
    assert [op.verb for op in resized.ops if op.map == abi.MAP_TABLES][:2] == ["new", "put"]
    c.sync({WEB: []})
    assert c.model.maps[abi.MAP_TABLES] == {}
