"""From desired state to BPF map operations: pure, no kernel.

`render()` compares what is applied (`Applied`) with the desired frontends of the Services that changed
and returns a `Plan`: ordered map operations plus the `Applied` that holds once they have run. Order is
what keeps the datapath consistent while the plan runs, packet by packet:

1. backends that become known are added before any slot can point at them;
2. a frontend's slots are written before its count grows, and its count shrinks before slots go;
3. a frontend's service entry is removed before its slots;
4. backends no frontend knows any more go last.

Capacity is checked before anything is written, so a full map fails the sync without half-applying it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pyproxy.dataplane.bpf import abi
from pyproxy.model.state import Backend, Frontend, ServicePortState

FrontendKey = tuple[str, int, str]  # (ClusterIP, port, "TCP"|"UDP")


@dataclass(frozen=True)
class AppliedFrontend:
    svc_id: int
    name: str
    service: str
    backends: tuple[Backend, ...]
    known: tuple[Backend, ...]
    affinity_sec: int


@dataclass(frozen=True)
class Applied:
    """What the maps hold, as the control plane sees it."""

    frontends: Mapping[FrontendKey, AppliedFrontend] = field(default_factory=dict)
    backend_refs: Mapping[Backend, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Op:
    """One map operation. `key`/`value` are plain tuples; the backend converts them to abi structs."""

    verb: str  # "put" | "del" | "reset"
    map: str
    key: tuple
    value: tuple | None = None


@dataclass(frozen=True)
class Plan:
    ops: tuple[Op, ...]
    applied: Applied
    skipped: tuple[str, ...] = ()
    """Frontends the BPF dataplane cannot serve (e.g. SCTP), with the reason, for a log line."""


class CapacityError(RuntimeError):
    """A map would exceed its capacity; nothing was written."""


def frontend_key(fe: Frontend) -> FrontendKey:
    return (fe.ip, fe.port, fe.protocol.value)


def _slot_ops(svc_id: int, old: tuple[Backend, ...], new: tuple[Backend, ...]) -> tuple[list[Op], list[Op]]:
    """Slot writes to run before the count changes, and slot deletes to run after."""
    writes = [
        Op("put", abi.MAP_SLOTS, (svc_id, i), (b.ip, b.port))
        for i, b in enumerate(new)
        if i >= len(old) or old[i] != b
    ]
    deletes = [Op("del", abi.MAP_SLOTS, (svc_id, i)) for i in range(len(new), len(old))]
    return writes, deletes


def render(
    applied: Applied,
    desired: Mapping[str, Iterable[ServicePortState]],
    capacity: Mapping[str, int],
) -> Plan:
    """Plan the changes for the Services in `desired` (Service key -> its frontends; an empty iterable
    means the Service is gone). Services not in `desired` are untouched."""
    frontends = dict(applied.frontends)
    refs: Counter[Backend] = Counter(applied.backend_refs)
    used_ids = {f.svc_id for f in frontends.values()}
    next_id = 0
    early: list[Op] = []
    middle: list[Op] = []
    removals: list[Op] = []
    skipped: list[str] = []

    def alloc_id() -> int:
        nonlocal next_id
        while next_id in used_ids:
            next_id += 1
        used_ids.add(next_id)
        return next_id

    # Claim frontends first: a frontend can move between Services (a ClusterIP freed and reused, or a
    # restart that restored frontends under placeholder names), and must then be updated in place, never
    # deleted after its new owner wrote it. A frontend held by a Service outside this plan stays there.
    changing = set(desired)
    claims: dict[FrontendKey, tuple[str, ServicePortState]] = {}
    for service in sorted(desired):
        for st in desired[service]:
            key = frontend_key(st.frontend)
            if st.frontend.protocol.value not in abi.IPPROTO:
                skipped.append(f"{st.display_name} {st.frontend}: protocol not served by the bpf dataplane")
                continue
            holder = claims[key][0] if key in claims else None
            cur = applied.frontends.get(key)
            if holder is None and cur is not None and cur.service not in changing:
                holder = cur.service
            if holder is not None and holder != service:
                skipped.append(f"{st.display_name} {st.frontend}: frontend already served by {holder}")
                continue
            claims[key] = (service, st)

    for key, cur in applied.frontends.items():
        if cur.service not in changing or key in claims:
            continue
        removals.append(Op("del", abi.MAP_SERVICES, key))
        removals.extend(Op("del", abi.MAP_SLOTS, (cur.svc_id, i)) for i in range(len(cur.backends)))
        removals.append(Op("del", abi.MAP_NAMES, (cur.svc_id,)))
        refs.subtract(cur.known)
        # Its id stays taken until the next plan: its slots are deleted after this plan's writes, which
        # would otherwise hit a new frontend given the same id.
        del frontends[key]

    for key, (service, st) in claims.items():
        cur_fe = applied.frontends.get(key)
        affinity = st.session_affinity_seconds
        nxt = AppliedFrontend(
            svc_id=cur_fe.svc_id if cur_fe else alloc_id(),
            name=st.display_name,
            service=service,
            backends=st.backends,
            known=tuple(sorted(set(st.known_backends) | set(st.backends))),
            affinity_sec=affinity,
        )
        if cur_fe == nxt:
            continue
        for b in nxt.known:
            if refs[b] == 0:
                early.append(Op("put", abi.MAP_BACKENDS, (b.ip, b.port), (0,)))
        refs.update(nxt.known)
        if cur_fe:
            refs.subtract(cur_fe.known)
        else:
            middle.append(Op("reset", abi.MAP_STATS, (nxt.svc_id,)))
        writes, deletes = _slot_ops(nxt.svc_id, cur_fe.backends if cur_fe else (), nxt.backends)
        middle.extend(writes)
        flags = abi.SVC_F_AFFINITY if affinity else 0
        middle.append(Op("put", abi.MAP_SERVICES, key, (nxt.svc_id, len(nxt.backends), flags, affinity)))
        middle.extend(deletes)
        if not cur_fe or cur_fe.name != nxt.name:
            middle.append(Op("put", abi.MAP_NAMES, (nxt.svc_id,), (nxt.name,)))
        frontends[key] = nxt

    late = [Op("del", abi.MAP_BACKENDS, (b.ip, b.port)) for b, n in refs.items() if n <= 0]
    new_refs = {b: n for b, n in refs.items() if n > 0}
    _check_capacity(frontends, new_refs, capacity)
    return Plan(
        ops=tuple(early + middle + removals + late),
        applied=replace(applied, frontends=frontends, backend_refs=new_refs),
        skipped=tuple(skipped),
    )


def _check_capacity(
    frontends: Mapping[FrontendKey, AppliedFrontend], refs: Mapping[Backend, int], capacity: Mapping[str, int]
) -> None:
    need = {
        abi.MAP_SERVICES: len(frontends),
        abi.MAP_SLOTS: sum(len(f.backends) for f in frontends.values()),
        abi.MAP_BACKENDS: len(refs),
    }
    if frontends:
        # Service ids index the per-CPU stats array: the largest id must fit too.
        need[abi.MAP_STATS] = max(f.svc_id for f in frontends.values()) + 1
    for name, n in need.items():
        if name in capacity and n > capacity[name]:
            raise CapacityError(
                f"BPF map {name} would need {n} entries but holds {capacity[name]}: "
                f"raise its size in the configuration; the dataplane keeps its previous state"
            )
