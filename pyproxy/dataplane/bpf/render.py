"""From desired state to BPF map operations: pure, no kernel.

`render()` compares what is applied (`Applied`) with the desired frontends of the Services that changed
and returns a `Plan`: ordered map operations plus the change to `Applied` that holds once they have run
(`Applied.commit`). Order is what keeps the datapath consistent while the plan runs, packet by packet:

1. backends that become known are added before any slot can point at them (and, with per-endpoint counters, their
   zeroed entry in `MAP_EPSTATS` before them, so their first packet is counted);
2. a frontend's slots are written before its count grows, and its count shrinks before slots go; with ClientIP
   affinity, its entry for a backend in `MAP_AFFINITY` (the backends a client's affinity may keep) is written before
   any of its slots holds the backend and deleted after none does, so a backend a new flow may pick is always one
   the client's next flows stay with (affinity turned on: its entries come before the service entry says so; off:
   after, and the slots written meanwhile may hold backends they lack, for the affinity ends with this plan); its
   table
   (`MAP_TABLES`: wrr, Maglev; an array per frontend) is written before its entry's table size changes: a table of
   the same size by its changed entries in place, each write atomic, so a flow meanwhile gets the old or the new
   entry's backend, both ready; one of another size as a new array ("new"), filled before it replaces the old
   (the programs choose at random while the size in the entry and the table's disagree: never a drop);
3. a frontend's service entry is removed before its slots, table and affinity entries;
4. backends no frontend knows any more go last, their `MAP_EPSTATS` entries with them (an endpoint's counts go
   when it leaves every Service; one that stays keeps them, across restarts too: the map is pinned);
5. the endpoint-port bitmap (`MAP_PORTS`: bit `port % 64` of word `port // 64` is set while some backend in
   `MAP_BACKENDS` has that port) gains its new bits right after the backends are added and loses its cleared
   ones right after they are removed, so at every instant it covers every backend in the map;
6. after them, a plan that removed backends bumps the backends epoch (`MAP_EPOCH`): established flows trust
   their backend while their epoch is current and check it again once it is not (bpf/include/pyproxy/lb.h),
   so the bump must follow the deletions, and an epoch is never made current twice.

The ops come grouped by kind (every slot write of the plan, then every service entry, ...), which keeps
each rule above for every frontend and lets the backend write each group with one batched syscall.

Capacity is checked before anything is written, so a full map fails the sync without half-applying it.

A plan costs O(what changed), not O(what is applied): `Applied` keeps the indexes render() needs (the
frontends of each Service, backend reference counts, the backends per port, the slot total, the free service
ids), and a plan
carries its change to them instead of a new copy.

One module of some 800 lines on purpose: the ordering rules above hold across every map at once, and each
operation is written next to the rule that makes it safe; split by map, no file would show why its order is right.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from typing import NamedTuple

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi, maglev
from pyproxy.model.objects import IPV6, family_of
from pyproxy.model.state import Backend, Frontend, FrontendKind, ServicePortState

FrontendKey = tuple[str, int, str, int]
"""(address, port, "TCP"|"UDP", scope): a services map key. Scope abi.SVC_SCOPE_NODE is the entry an external
frontend with externalTrafficPolicy Local has for the node's own processes, which reach every endpoint; scope
abi.SVC_SCOPE_HOST the only entry of a NodePort on 127.0.0.1 (`ServicePortState.node_only`)."""


@dataclass(frozen=True, slots=True)
class AppliedFrontend:
    svc_id: int
    name: str
    service: str
    backends: tuple[Backend, ...]
    known: tuple[Backend, ...]
    affinity_sec: int
    flags: int = 0
    """abi.SVC_F_DROP, SVC_F_RANGES, SVC_F_MASQ, SVC_F_NODE_VIEW, SVC_F_SOCK_PODS and SVC_F_NODE_DENIED as the
    services map holds them (affinity is `affinity_sec`)."""
    source_ranges: tuple[str, ...] = ()
    """The CIDRs of its entries in MAP_SRCRANGES (loadBalancerSourceRanges)."""
    sched: int = 0
    """abi.SCHED: the scheduler the programs run for it."""
    weights: tuple[int, ...] = ()
    """The weight of each of `backends` (its slot's weight), in order; (): every one 1."""
    table: tuple[Backend, ...] = ()
    """Its entries in MAP_TABLES, in order (wrr's round, Maglev's lookup table); (): none."""


class Op(NamedTuple):
    """One map operation. `key`/`value` are tuples (a Backend is one: (ip, port)); the backend converts them
    to the maps' bytes."""

    verb: str  # "put" | "del" | "reset" | "new" (a frontend's table, MAP_TABLES: an empty one of `value[0]` entries)
    map: str
    key: tuple
    value: tuple | None = None


class Batch(NamedTuple):
    """Consecutive ops of one kind on one map, as the backend writes them: one batched syscall. A plan is
    held as batches rather than ops because a cold start at 10,000 Services has a quarter million of them:
    an Op each would double the plan's memory and cost a tenth of a second to build."""

    verb: str
    map: str
    keys: Sequence[tuple]
    values: Sequence[tuple] | None = None
    """For "put": one value per key."""

    def ops(self) -> Iterator[Op]:
        if self.values is None:
            return (Op(self.verb, self.map, k) for k in self.keys)
        return (Op(self.verb, self.map, k, v) for k, v in zip(self.keys, self.values, strict=True))


_BACKEND_INFO = (0,)  # the backends map's value: no flags
_ZERO_STATS = (0, 0)  # a new MAP_EPSTATS entry: no packets, no bytes (on every CPU)
_WORD_BITS = 64  # ports per word of MAP_PORTS


def _port_bit(port: int) -> tuple[int, int]:
    """The word of MAP_PORTS that holds `port`, and the port's bit in it."""
    return port // _WORD_BITS, 1 << (port % _WORD_BITS)


@dataclass(frozen=True, slots=True)
class Plan:
    batches: tuple[Batch, ...]
    """The ops, in order, grouped (see Batch); none is empty."""
    upserts: Mapping[FrontendKey, AppliedFrontend]
    """Frontends new or changed once the ops have run."""
    removed: tuple[FrontendKey, ...]
    refs: Mapping[Backend, int]
    """The new reference count of every backend whose count changed (0: no longer in the backends map)."""
    released: Sequence[Backend]
    """The backends the plan removes from the map (those of `refs` left with no reference)."""
    ports: Mapping[int, int]
    """The new number of backends in the map with that port, for every port whose number changed."""
    base: int
    """The `Applied.generation` it was planned from: it commits onto that state and no other."""
    epoch: int
    """The backends epoch once the plan has run: the applied one, or one more when it removes backends."""
    skipped: tuple[str, ...] = ()
    """Frontends the BPF dataplane cannot serve (e.g. SCTP), with the reason, for a log line."""

    @property
    def ops(self) -> tuple[Op, ...]:
        """Every op, in order, one by one."""
        return tuple(op for batch in self.batches for op in batch.ops())


class Applied:
    """What the maps hold, as the control plane sees it, with the indexes that keep render() O(change).

    `frontends` and `backend_refs` are the state (two Applied are equal when these are); the rest is derived
    from them. Changed only by `commit()`, once a plan's ops have all run. Backends may be held with no
    reference (read back from the maps after a restart): the next plan removes them unless it uses them.
    """

    __slots__ = ("frontends", "backend_refs", "epoch", "by_service", "slots", "slots6", "ids6", "backends6",
                 "affinity", "affinity6", "generation", "port_backends", "port_words", "_unreferenced", "_free",
                 "_next_id")

    def __init__(
        self,
        frontends: Mapping[FrontendKey, AppliedFrontend] | None = None,
        backend_refs: Mapping[Backend, int] | None = None,
        epoch: int = 0,
    ) -> None:
        self.frontends: dict[FrontendKey, AppliedFrontend] = dict(frontends or {})
        self.backend_refs: dict[Backend, int] = dict(backend_refs or {})
        self.epoch = epoch
        """The backends epoch in MAP_EPOCH: which flows' backend checks are still valid, not what is served
        (so not part of equality)."""
        self.by_service: dict[str, dict[FrontendKey, None]] = {}
        """Service -> its frontends (a dict for a stable order)."""
        self.slots = 0
        """Slots in use: the sum of every frontend's ready backends."""
        self.slots6 = 0
        """Of `slots`, those of IPv6 frontends (MAP_SLOTS6's)."""
        self.affinity = 0
        """Entries of the affinity maps: the slots of the frontends with ClientIP affinity (`affinity_members`)."""
        self.affinity6 = 0
        """Of `affinity`, those of IPv6 frontends (MAP_AFFINITY6's)."""
        self.ids6: set[int] = set()
        """The service ids of the IPv6 frontends (MAP_SERVICES6's): which map a slot, table or source range of a
        plan goes to (`by_family`), without a pass over every frontend at each sync."""
        self.backends6 = sum(1 for b in self.backend_refs if family_of(b.ip) == IPV6)
        """Of `backend_refs`, the IPv6 ones (MAP_BACKENDS6's)."""
        self.generation = 0
        self.port_backends: dict[int, int] = {}
        """Port -> how many backends in the map (`backend_refs`, referenced or not) have it."""
        self.port_words = [0] * abi.PORT_WORDS
        """MAP_PORTS as it is once it matches `port_backends`: word -> its 64 bits."""
        for b in self.backend_refs:
            self.port_backends[b.port] = self.port_backends.get(b.port, 0) + 1
        for p in self.port_backends:
            word, bit = _port_bit(p)
            self.port_words[word] |= bit
        self._unreferenced = {b for b, n in self.backend_refs.items() if n <= 0}
        for key, fe in self.frontends.items():
            self.by_service.setdefault(fe.service, {})[key] = None
            self._count(key, fe, 1)
        ids = {fe.svc_id for fe in self.frontends.values()}
        self._next_id = max(ids) + 1 if ids else 0
        """One past the largest service id in use."""
        self._free = sorted(set(range(self._next_id)) - ids)
        """Ids below `_next_id` no frontend uses, ascending: the next plan's new frontends take the lowest."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Applied):
            return NotImplemented
        return self.frontends == other.frontends and self.backend_refs == other.backend_refs

    __hash__ = None  # type: ignore[assignment] # mutable

    def __repr__(self) -> str:
        return f"Applied({len(self.frontends)} frontends, {len(self.backend_refs)} backends)"

    @property
    def frontends6(self) -> int:
        """Of `frontends`, the IPv6 ones."""
        return len(self.ids6)

    def new_ids(self, count: int) -> list[int]:
        """The ids the next `count` new frontends get: the lowest ones no frontend uses."""
        taken = self._free[:count]
        return taken + list(range(self._next_id, self._next_id + count - len(taken)))

    def max_id(self) -> int:
        """The largest service id in use (-1: none)."""
        return self._next_id - 1

    def unreferenced(self) -> set[Backend]:
        return self._unreferenced

    def commit(self, plan: Plan) -> None:
        """Fold in a plan rendered from this state, once its ops have all run."""
        if plan.base != self.generation:
            raise ValueError(f"plan made for generation {plan.base}, applied is at {self.generation}")
        freed = []
        for key in plan.removed:
            fe = self.frontends.pop(key)
            self._unindex(key, fe)
            freed.append(fe.svc_id)
        allocated = []
        for key, fe in plan.upserts.items():
            old = self.frontends.get(key)
            if old is None:
                allocated.append(fe.svc_id)
            else:
                self._unindex(key, old)
            self.frontends[key] = fe
            self.by_service.setdefault(fe.service, {})[key] = None
            self._count(key, fe, 1)
        if allocated:
            # They are new_ids(len(allocated)): the lowest free ids, then ids from _next_id up.
            del self._free[: len(allocated)]
            self._next_id = max(self._next_id, max(allocated) + 1)
        for svc_id in freed:
            bisect.insort(self._free, svc_id)
        # Keep _next_id one past the largest id in use, so max_id() stays exact.
        while self._free and self._free[-1] == self._next_id - 1:
            self._free.pop()
            self._next_id -= 1
        held = self.backend_refs
        self.backends6 += sum(1 for b in plan.refs if b not in held and family_of(b.ip) == IPV6)
        self.backends6 -= sum(1 for b in plan.released if family_of(b.ip) == IPV6)
        held.update(plan.refs)
        for b in plan.released:
            del held[b]
        if self._unreferenced:
            self._unreferenced.difference_update(plan.refs)
        for p, n in plan.ports.items():
            word, bit = _port_bit(p)
            if n > 0:
                self.port_backends[p] = n
                self.port_words[word] |= bit
            else:
                del self.port_backends[p]
                self.port_words[word] &= ~bit
        self.epoch = plan.epoch
        self.generation += 1

    def _unindex(self, key: FrontendKey, fe: AppliedFrontend) -> None:
        keys = self.by_service[fe.service]
        del keys[key]
        if not keys:
            del self.by_service[fe.service]
        self._count(key, fe, -1)

    def _count(self, key: FrontendKey, fe: AppliedFrontend, sign: int) -> None:
        """Count a frontend in (1) or out (-1) of the slot, affinity and per-family counts."""
        self.slots += sign * len(fe.backends)
        members = len(affinity_members(fe))
        self.affinity += sign * members
        if family_of(key[0]) == IPV6:
            self.slots6 += sign * len(fe.backends)
            self.affinity6 += sign * members
            if sign > 0:
                self.ids6.add(fe.svc_id)
            else:
                self.ids6.discard(fe.svc_id)


def affinity_members(fe: AppliedFrontend) -> tuple[Backend, ...]:
    """A frontend's entries in MAP_AFFINITY (or MAP_AFFINITY6), as (service id, backend): its slots' backends when it
    has ClientIP affinity (the endpoints its new flows may use, the only ones a client's affinity keeps), else none."""
    return fe.backends if fe.affinity_sec else ()


class CapacityError(RuntimeError):
    """A map would exceed its capacity; nothing was written."""


NO_MASQUERADE = MasqueradeSettings()


class Scheduling(NamedTuple):
    """The node's scheduling settings render needs (BpfSettings)."""

    scheduler: str = "random"
    """--bpf-scheduler: the scheduler of frontends whose Service names none (abi.SCHED)."""
    table_size: int = maglev.DEFAULT_TABLE_SIZE
    """--bpf-maglev-table-size: entries of each Maglev table (maglev.TABLE_SIZES)."""


def _schedule(st: ServicePortState, backends: tuple[Backend, ...], scheduling: Scheduling,
              cur: AppliedFrontend | None) -> tuple[int, tuple[Backend, ...], tuple[int, ...], tuple[Backend, ...]]:
    """How the programs choose among `backends` for this frontend: the scheduler (abi.SCHED), the backends (one slot
    each) with their weights (() when all are 1), and the frontend's table (wrr, maglev). `cur`: the frontend as
    applied, whose table is reused when nothing it is computed from changed (a Maglev table costs milliseconds, and a
    full sync renders every Service)."""
    name = st.scheduler or scheduling.scheduler
    weights: tuple[int, ...] = ()
    if st.weights:
        # The model left out endpoints of weight 0 (quiesced): these weigh 1 or more.
        weights = tuple(st.weight(b) for b in backends)
        if all(w == 1 for w in weights):
            weights = ()
    table: tuple[Backend, ...] = ()
    if name == "wrr":
        if not weights:
            return abi.SCHED["rr"], backends, weights, table  # equal weights: plain turns, no table
        table = tuple(backends[i] for i in wrr_round(weights))
    elif name == "maglev" and backends:
        if (cur is not None and cur.sched == abi.SCHED["maglev"] and cur.backends == backends
                and cur.weights == weights and len(cur.table) == scheduling.table_size):
            table = cur.table
        else:
            table = tuple(backends[i] for i in maglev.table(backends, scheduling.table_size, weights or None))
    return abi.SCHED[name], backends, weights, table


def wrr_round(weights: Sequence[int]) -> list[int]:
    """One round of weighted round robin over backends 0..n-1: backend i has weights[i] turns, spread through the
    round (smooth WRR, as nginx: each turn goes to the backend furthest behind its share) rather than in runs.
    Weights are divided by their greatest common divisor first, so the round is as short as can be (at most
    sum(weights), below 65536 with weights of 1-100 and up to 655 backends; longer rounds are scaled down)."""
    g = 0
    for w in weights:
        g = math.gcd(g, w)
    ws = [w // g for w in weights]
    total = sum(ws)
    if total > _MAX_ROUND:
        ws = [max(1, w * _MAX_ROUND // total) for w in ws]
        total = sum(ws)
    current = [0] * len(ws)
    out = []
    for _ in range(total):
        for i, w in enumerate(ws):
            current[i] += w
        best = max(range(len(ws)), key=current.__getitem__)
        current[best] -= total
        out.append(best)
    return out


_MAX_ROUND = 65535  # a table's size is a u16 (pyproxy_svc_value.table_size)
DEFAULT_SCHEDULING = Scheduling()


def frontend_key(fe: Frontend, scope: int = abi.SVC_SCOPE_PACKETS) -> FrontendKey:
    return (fe.ip, fe.port, fe.protocol.value, scope)


def _has_node_view(st: ServicePortState) -> bool:
    """Whether the node's own processes reach other endpoints at this frontend than its packets do: an external
    frontend with externalTrafficPolicy Local, which serves the node from every endpoint (upstream's short
    circuit for local sources)."""
    return st.kind.external and st.external_backends != st.backends


def _node_view(st: ServicePortState) -> ServicePortState:
    """The frontend as the node's own processes reach it (`_has_node_view`): from `backends`, as a ClusterIP."""
    return replace(st, kind=FrontendKind.CLUSTER_IP, external_backends=(), masquerade=False,
                   source_ranges=(), health_check_node_port=None, local_ready=False)


def render(
    applied: Applied,
    desired: Mapping[str, Iterable[ServicePortState]],
    capacity: Mapping[str, int],
    masq: MasqueradeSettings = NO_MASQUERADE,
    scheduling: Scheduling = DEFAULT_SCHEDULING,
    endpoint_counters: bool = False,
) -> Plan:
    """Plan the changes for the Services in `desired` (Service key -> its frontends; an empty iterable
    means the Service is gone). Services not in `desired` are untouched. `applied` is only read. `masq`: the
    ClusterIP frontends' masquerade flags (--masquerade-all, --cluster-cidr, whose prefix the programs hold);
    `scheduling`: the node's scheduler and Maglev table size; `endpoint_counters` (--bpf-endpoint-counters): keep an
    entry in MAP_EPSTATS for each backend in MAP_BACKENDS (else the map stays empty)."""
    current = applied.frontends
    applied_refs = applied.backend_refs
    refs: dict[Backend, int] = {}
    """Backends whose count this plan changes (or that had none): their count once the plan has run."""
    for b in applied.unreferenced():
        refs[b] = 0
    skipped: list[str] = []

    # Claim frontends first: a frontend can move between Services (a ClusterIP freed and reused, or a
    # restart that restored frontends under placeholder names), and must then be updated in place, never
    # deleted after its new owner wrote it. Which Service serves a frontend the model decided: each is unique.
    claims: dict[FrontendKey, tuple[str, ServicePortState]] = {}
    for service in sorted(desired):
        for st in desired[service]:
            key = frontend_key(st.frontend)
            if key[2] not in abi.IPPROTO:
                skipped.append(f"{st.display_name} {st.frontend}: protocol not served by the bpf dataplane")
                continue
            if st.node_only:   # the socket hooks' only (abi.h: PYPROXY_SVC_SCOPE_HOST), served as the node sees it
                claims[frontend_key(st.frontend, abi.SVC_SCOPE_HOST)] = (service, _node_view(st))
                continue
            claims[key] = (service, st)
            if _has_node_view(st):
                claims[frontend_key(st.frontend, abi.SVC_SCOPE_NODE)] = (service, _node_view(st))

    removed: list[FrontendKey] = []
    for service in desired:
        for key in applied.by_service.get(service, ()):
            if key in claims:
                continue
            removed.append(key)
            for b in current[key].known:
                refs[b] = refs.get(b, applied_refs.get(b, 0)) - 1

    # New frontends never take the id of one removed by this plan: its slots are deleted after this plan's
    # writes, which would otherwise hit the new frontend. So the ids are those free before the plan.
    new_ids = iter(applied.new_ids(sum(1 for key in claims if key not in current)))
    upserts: dict[FrontendKey, AppliedFrontend] = {}
    # The keys (and values) of each batch of the plan, in the order the batches run.
    backend_puts: list[Backend] = []
    resets: list[tuple[int]] = []
    slot_keys: list[tuple[int, int]] = []
    slot_values: list[tuple[str, int, int]] = []
    table_news: list[tuple[int]] = []
    table_sizes: list[tuple[int]] = []
    table_keys: list[tuple[int, int]] = []
    table_values: list[Backend] = []
    entry_keys: list[FrontendKey] = []
    entry_values: list[tuple[int, int, int, int, int, int]] = []
    slot_deletes: list[tuple[int, int]] = []
    table_deletes: list[tuple[int]] = []
    name_keys: list[tuple[int]] = []
    name_values: list[tuple[str]] = []
    range_puts: list[tuple[int, str]] = []
    range_deletes: list[tuple[int, str]] = []
    affinity_puts: list[tuple[int, str, int]] = []
    affinity_deletes: list[tuple[int, str, int]] = []
    for key, (service, st) in claims.items():
        cur_fe = current.get(key)
        affinity = st.session_affinity_seconds
        # The datapath cannot tell pods from outside clients (no cluster CIDR): every packet entering the node is
        # served as external, from external_backends (upstream's rule when no local detector is configured).
        backends = st.external_backends if st.kind.external else st.backends
        flags = abi.SVC_F_RANGES if st.source_ranges else 0
        # Dropped, not refused: externalTrafficPolicy Local without an endpoint here (for the packets from
        # outside), internalTrafficPolicy Local without one (the model's `drop`, from every source).
        if (st.kind.external and not backends and st.backends) or st.drop:
            flags |= abi.SVC_F_DROP
        if st.masquerades(masq.masquerade_all):
            flags |= abi.SVC_F_MASQ
        elif masq.cluster_cidr_of(st.family) and not st.kind.external:
            flags |= abi.SVC_F_MASQ_OUTSIDE
        if _has_node_view(st):
            flags |= abi.SVC_F_NODE_VIEW
        if st.pods_at_socket(masq.masquerade_all):
            flags |= abi.SVC_F_SOCK_PODS
        if st.node_denied:
            flags |= abi.SVC_F_NODE_DENIED
        known = st.known_backends
        if known != backends and not set(backends).issubset(known):
            known = tuple(sorted(set(known) | set(backends)))
        sched, backends, weights, table = _schedule(st, backends, scheduling, cur_fe)
        nxt = AppliedFrontend(
            svc_id=cur_fe.svc_id if cur_fe else next(new_ids),
            name=st.display_name,
            service=service,
            backends=backends,
            known=known,
            affinity_sec=affinity,
            flags=flags,
            source_ranges=st.source_ranges,
            sched=sched,
            weights=weights,
            table=table,
        )
        if cur_fe == nxt:
            continue
        svc_id = nxt.svc_id
        for b in nxt.known:
            n = refs.get(b)
            if n is None:
                n = applied_refs.get(b, 0)
            if n <= 0:
                backend_puts.append(b)
            refs[b] = n + 1
        new = _slots(nxt)
        if cur_fe:
            old = _slots(cur_fe)
            for b in cur_fe.known:
                refs[b] = refs.get(b, applied_refs.get(b, 0)) - 1
            for i, slot in enumerate(new):
                if i >= len(old) or old[i] != slot:
                    slot_keys.append((svc_id, i))
                    slot_values.append(slot)
            slot_deletes.extend((svc_id, i) for i in range(len(new), len(old)))
            old_table = cur_fe.table
        else:
            resets.append((svc_id,))
            slot_keys.extend((svc_id, i) for i in range(len(new)))
            slot_values.extend(new)
            old_table = ()
        # The table as a delta: a Maglev table keeps most entries when a backend comes or goes. A table of another
        # size is a new one, written whole before it takes the old one's place.
        if table and len(table) != len(old_table):
            table_news.append((svc_id,))
            table_sizes.append((len(table),))
        for i, b in maglev.delta(old_table, table):
            table_keys.append((svc_id, i))
            table_values.append(b)
        if old_table and not table:
            table_deletes.append((svc_id,))
        members = affinity_members(nxt)
        old_members = affinity_members(cur_fe) if cur_fe else ()
        if members != old_members:
            kept = set(old_members)
            affinity_puts.extend((svc_id, *b) for b in members if b not in kept)
            kept = set(members)
            affinity_deletes.extend((svc_id, *b) for b in old_members if b not in kept)
        old_ranges = cur_fe.source_ranges if cur_fe else ()
        if old_ranges != nxt.source_ranges:
            range_puts.extend((svc_id, r) for r in nxt.source_ranges if r not in old_ranges)
            range_deletes.extend((svc_id, r) for r in old_ranges if r not in nxt.source_ranges)
        entry_keys.append(key)
        entry_values.append((svc_id, len(new), (abi.SVC_F_AFFINITY if affinity else 0) | flags, affinity, sched,
                             len(table)))
        if not cur_fe or cur_fe.name != nxt.name:
            name_keys.append((svc_id,))
            name_values.append((nxt.name,))
        upserts[key] = nxt

    _check_capacity(applied, upserts, removed, refs, capacity, endpoint_counters)
    gone = [current[key] for key in removed]
    released = [b for b, n in refs.items() if n <= 0]
    # A backend the map held already (unreferenced after a restart) keeps its entry and its counts.
    counted = [b for b in backend_puts if b not in applied_refs] if endpoint_counters else []
    ports, port_sets, port_clears = _port_changes(applied, backend_puts, released)
    epoch = next_epoch(applied.epoch) if released else applied.epoch
    batches = (
        Batch("put", abi.MAP_EPSTATS, counted, [_ZERO_STATS] * len(counted)),
        Batch("put", abi.MAP_BACKENDS, backend_puts, [_BACKEND_INFO] * len(backend_puts)),
        port_sets,
        Batch("reset", abi.MAP_STATS, resets),
        Batch("put", abi.MAP_AFFINITY, affinity_puts, [(0,)] * len(affinity_puts)),
        Batch("put", abi.MAP_SLOTS, slot_keys, slot_values),
        Batch("new", abi.MAP_TABLES, table_news, table_sizes),
        Batch("put", abi.MAP_TABLES, table_keys, table_values),
        # A frontend's ranges are in place before its entry says to check them, and go after it stops saying so.
        Batch("put", abi.MAP_SRCRANGES, range_puts, [(0,)] * len(range_puts)),
        Batch("put", abi.MAP_SERVICES, entry_keys, entry_values),
        Batch("del", abi.MAP_SRCRANGES, range_deletes),
        Batch("del", abi.MAP_SLOTS, slot_deletes),
        Batch("del", abi.MAP_AFFINITY, affinity_deletes),
        Batch("del", abi.MAP_TABLES, table_deletes),
        Batch("put", abi.MAP_NAMES, name_keys, name_values),
        Batch("del", abi.MAP_SERVICES, removed),
        Batch("del", abi.MAP_SLOTS, [(fe.svc_id, i) for fe in gone for i in range(len(fe.backends))]),
        Batch("del", abi.MAP_AFFINITY, [(fe.svc_id, *b) for fe in gone for b in affinity_members(fe)]),
        Batch("del", abi.MAP_TABLES, [(fe.svc_id,) for fe in gone if fe.table]),
        Batch("del", abi.MAP_NAMES, [(fe.svc_id,) for fe in gone]),
        Batch("del", abi.MAP_SRCRANGES, [(fe.svc_id, r) for fe in gone for r in fe.source_ranges]),
        Batch("del", abi.MAP_BACKENDS, released),
        Batch("del", abi.MAP_EPSTATS, released if endpoint_counters else ()),
        port_clears,
        epoch_batch(epoch) if released else Batch("put", abi.MAP_EPOCH, ()),
    )
    # The applied IPv6 frontends' ids (removed ones' too: their slots go from the IPv6 map) and the new ones'.
    new6 = {fe.svc_id for key, fe in upserts.items() if family_of(key[0]) == IPV6}
    v6_ids = applied.ids6 | new6 if new6 - applied.ids6 else applied.ids6
    return Plan(
        batches=tuple(b for b in by_family(batches, v6_ids) if b.keys),
        upserts=upserts,
        removed=tuple(removed),
        refs=refs,
        released=released,
        ports=ports,
        base=applied.generation,
        epoch=epoch,
        skipped=tuple(skipped),
    )


# The maps whose entries hold an address, by their IPv6 twins (abi.h); how a batch's entry tells its family: by the
# address in its key (services, backends, per-endpoint counters), or by its frontend's service id (slots, tables,
# source ranges, affinity).
_TWINS: dict[str, str | None] = {
    abi.MAP_SERVICES: abi.MAP_SERVICES6, abi.MAP_BACKENDS: abi.MAP_BACKENDS6, abi.MAP_EPSTATS: abi.MAP_EPSTATS6,
    abi.MAP_SLOTS: abi.MAP_SLOTS6, abi.MAP_TABLES: abi.MAP_TABLES6, abi.MAP_SRCRANGES: abi.MAP_SRCRANGES6,
    abi.MAP_AFFINITY: abi.MAP_AFFINITY6,
}
_BY_ADDRESS = frozenset({abi.MAP_SERVICES, abi.MAP_BACKENDS, abi.MAP_EPSTATS})


def by_family(batches: Iterable[Batch], v6_ids: Set[int]) -> Iterator[Batch]:
    """The plan's batches with each IPv6 entry moved to the IPv6 twin of its map, in a batch right after its IPv4
    one: the order of the rules above holds within each family, and an IPv4-only plan is what it was. `v6_ids`: the
    service ids of IPv6 frontends (applied or planned). Each frontend's backends are of its own family (the
    model's dual-stack Services have a frontend per family)."""
    for b in batches:
        twin = _TWINS.get(b.map, "")
        if twin == "" or b.verb == "reset":
            yield b
            continue
        by_address = b.map in _BY_ADDRESS
        six = [family_of(k[0]) == IPV6 if by_address else k[0] in v6_ids for k in b.keys]
        if b.map == abi.MAP_SRCRANGES:
            # A Service's source ranges may mix families; each frontend keeps those of its own.
            keep = [(family_of(k[1]) == IPV6) == v6 for k, v6 in zip(b.keys, six, strict=True)]
            b = Batch(b.verb, b.map, [k for k, ok in zip(b.keys, keep, strict=True) if ok],
                      None if b.values is None else [v for v, ok in zip(b.values, keep, strict=True) if ok])
            six = [v6 for v6, ok in zip(six, keep, strict=True) if ok]
        if not any(six):
            yield b
            continue
        values = b.values
        yield Batch(b.verb, b.map, [k for k, v6 in zip(b.keys, six, strict=True) if not v6],
                    None if values is None else [v for v, v6 in zip(values, six, strict=True) if not v6])
        if twin is not None:
            yield Batch(b.verb, twin, [k for k, v6 in zip(b.keys, six, strict=True) if v6],
                        None if values is None else [v for v, v6 in zip(values, six, strict=True) if v6])


def _slots(fe: AppliedFrontend) -> list[tuple[str, int, int]]:
    """A frontend's slots as MAP_SLOTS holds them: (ip, port, weight)."""
    weights = fe.weights or (1,) * len(fe.backends)
    return [(b.ip, b.port, w) for b, w in zip(fe.backends, weights, strict=True)]


def _port_changes(
    applied: Applied, puts: Iterable[Backend], released: Iterable[Backend]
) -> tuple[dict[int, int], Batch, Batch]:
    """The ports whose number of backends in the map changes (their new number), and MAP_PORTS' writes: the
    words that gain bits, with those bits added (to run once the backends are in the map), and the words that
    lose bits, with their final value (to run once the backends are gone)."""
    counts = applied.port_backends
    ports: dict[int, int] = {}
    for b in puts:
        if b not in applied.backend_refs:  # else it was in the map already (unreferenced after a restart)
            ports[b.port] = ports.get(b.port, counts.get(b.port, 0)) + 1
    for b in released:
        ports[b.port] = ports.get(b.port, counts.get(b.port, 0)) - 1
    gained: dict[int, int] = {}
    lost: dict[int, int] = {}
    for p, n in ports.items():
        if (n > 0) != (p in counts):
            word, bit = _port_bit(p)
            changed = gained if n > 0 else lost
            changed[word] = changed.get(word, 0) | bit
    words = applied.port_words
    grown = {w: words[w] | bits for w, bits in gained.items()}
    final = {w: grown.get(w, words[w]) & ~bits for w, bits in lost.items()}
    return (
        ports,
        Batch("put", abi.MAP_PORTS, [(w,) for w in grown], [(v,) for v in grown.values()]),
        Batch("put", abi.MAP_PORTS, [(w,) for w in final], [(v,) for v in final.values()]),
    )


def ports_batch(applied: Applied) -> Batch:
    """The whole of MAP_PORTS as `applied` has it: written once at start, whatever the map held before."""
    return Batch("put", abi.MAP_PORTS, [(w,) for w in range(abi.PORT_WORDS)], [(v,) for v in applied.port_words])


def next_epoch(epoch: int) -> int:
    """The epoch after `epoch`: never 0, the epoch of flows recorded before epochs existed (abi.h)."""
    return epoch % 0xFFFFFFFF + 1


def epoch_batch(epoch: int) -> Batch:
    """The write that makes `epoch` the current backends epoch."""
    return Batch("put", abi.MAP_EPOCH, [(0,)], [(epoch,)])


def _check_capacity(
    applied: Applied,
    upserts: Mapping[FrontendKey, AppliedFrontend],
    removed: list[FrontendKey],
    refs: Mapping[Backend, int],
    capacity: Mapping[str, int],
    endpoint_counters: bool = False,
) -> None:
    """The most each map holds while the plan runs, from the applied counts and the plan's changes: new entries
    are written before the entries they replace go (the order rules above), so a plan that removes as much as it
    adds still needs the room for both at its peak. A plan that does not fit so may fit as several (the backend
    applies removals first then). Each family counts against its own maps (an IPv6 frontend, its slots and
    backends against the IPv6 twins: by_family); the maps indexed by service id (names, stats, cursors) serve
    both."""
    current = applied.frontends
    slots6 = applied.slots6
    slots = applied.slots - slots6
    affinity6 = applied.affinity6
    affinity = applied.affinity - affinity6
    added = added6 = 0
    top = applied.max_id()
    for key, fe in upserts.items():
        old = current.get(key)
        grown = max(0, len(fe.backends) - (len(old.backends) if old else 0))
        # A frontend's new affinity entries are all written before its old ones go.
        members = affinity_members(fe)
        if members:
            old_members = set(affinity_members(old)) if old else set()
            joined = sum(1 for b in members if b not in old_members)
        else:
            joined = 0
        six = family_of(key[0]) == IPV6
        if six:
            slots6 += grown
            affinity6 += joined
        else:
            slots += grown
            affinity += joined
        if old is None:
            added += 1
            added6 += six
            top = max(top, fe.svc_id)
    # Backends new to the map come first and the released go last; C-level loops, as a cold start touches 100,000.
    held = applied.backend_refs
    new = [b for b, n in refs.items() if n > 0 and b not in held]
    new6 = sum(1 for b in new if family_of(b.ip) == IPV6)
    backends6 = applied.backends6 + new6
    backends = len(held) + len(new) - backends6
    frontends6 = applied.frontends6 + added6
    need = {
        abi.MAP_SERVICES: len(current) + added - frontends6,
        abi.MAP_SERVICES6: frontends6,
        abi.MAP_NAMES: len(current) + added,
        abi.MAP_SLOTS: slots,
        abi.MAP_SLOTS6: slots6,
        abi.MAP_BACKENDS: backends,
        abi.MAP_BACKENDS6: backends6,
        abi.MAP_AFFINITY: affinity,
        abi.MAP_AFFINITY6: affinity6,
    }
    if endpoint_counters:
        need[abi.MAP_EPSTATS] = backends
        need[abi.MAP_EPSTATS6] = backends6
    # Service ids index arrays (per-CPU stats, rr cursors): the largest id must fit the smallest of them.
    by_id = [m for m in (abi.MAP_STATS, abi.MAP_CURSORS) if m in capacity]
    id_map = min(by_id, key=capacity.__getitem__) if by_id else None
    if id_map is not None and top + 1 > capacity[id_map]:
        # `top` still counts the frontends this plan removes; only this rare case pays for the exact answer.
        gone = set(removed)
        ids = [fe.svc_id for key, fe in current.items() if key not in gone and key not in upserts]
        need[id_map] = max([*ids, *(fe.svc_id for fe in upserts.values())], default=-1) + 1
    for name, n in need.items():
        if name in capacity and n > capacity[name]:
            raise CapacityError(
                f"BPF map {name} would need {n} entries but holds {capacity[name]}: "
                f"raise its size in the configuration; the dataplane keeps its previous state"
            )
