"""The bpf mode's new-flow decision (bpf/include/pyproxy/lb.h, pyproxy_lb_forward) over the map ops render() plans for
a run of syncs, each from the `Applied` the one before committed (as the backend's apply()).

Models: the ops applied in order to dict "maps" (put, del, reset; deleting what is not there fails); the services
map looked up by (daddr, dport, proto, scope "packets"): a miss passes the packet untranslated (common.untranslated),
a frontend with source ranges drops a source none of its MAP_SRCRANGES entries holds; backend_count 0 is dropped
with the SVC_F_DROP flag (externalTrafficPolicy Local, no endpoint here) and refused without it (TC answers a reset
or a port unreachable, reject.h), else every slot 0..backend_count-1 is a possible pick (a missing slot drops);
with the affinity flag, a second flow from the client reuses the backend the first one recorded while that backend
is in the frontend's affinity entries (MAP_AFFINITY: its slots). An IPv6 packet reads the IPv6 twins of these maps
(render.by_family), as the TC and XDP programs' IPv6 halves do.
Does not model: the kernel (map sizes, byte layouts: tests/priv does), connection tracking of established flows, the
affinity timeout, real randomness, XDP versus TC, socket load balancing of the node's own processes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence

from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.backend import BpfDataplane
from pyproxy.dataplane.bpf.render import Applied, Plan, render
from tracers.common import Memory, Packet, Sync, Unmodelled, Verdict, as_served, untranslated

CAPACITY = {abi.MAP_SERVICES: 65536, abi.MAP_SLOTS: 1 << 20, abi.MAP_BACKENDS: 65536, abi.MAP_STATS: 65536}
_PROTO = {"tcp": "TCP", "udp": "UDP"}
# SVC_F_MASQ changes the source the backend sees, not who answers.
# SVC_F_NODE_VIEW, which entry the node's own sockets use (not traced: no node-origin case is).
# SVC_F_SOCK_PODS, whether a pod's socket may be translated at connect() (not traced: pods' flows are traced on the
# packet path, where --bpf-socket-lb-hostns-only sends them, and the flag says the socket gives the same).
# SVC_F_NODE_DENIED, the node's own sockets refused (not traced, as SVC_F_NODE_VIEW).
KNOWN_FLAGS = (abi.SVC_F_AFFINITY | abi.SVC_F_DROP | abi.SVC_F_RANGES | abi.SVC_F_MASQ | abi.SVC_F_NODE_VIEW
               | abi.SVC_F_SOCK_PODS | abi.SVC_F_NODE_DENIED)

Maps = dict[str, dict[tuple, tuple | None]]
_MAPS = (abi.MAP_SERVICES, abi.MAP_SRCRANGES, abi.MAP_SLOTS, abi.MAP_AFFINITY)
_MAPS6 = (abi.MAP_SERVICES6, abi.MAP_SRCRANGES6, abi.MAP_SLOTS6, abi.MAP_AFFINITY6)
"""The maps a new flow's decision reads, IPv4's and their IPv6 twins (render.by_family): an IPv6 packet is looked
up in the IPv6 ones."""


def plans(syncs: Sequence[Sync]) -> list[Plan]:
    """The plans of `syncs` in turn, as the bpf backend's apply() renders them from what the last one left (the
    frontends of the families it renders: the proxier leaves out the others)."""
    applied, out = Applied(), []
    for desired, changed in as_served(syncs, BpfDataplane.ip_families):
        keys = set(desired.services) | applied.by_service.keys() if changed is None else changed
        out.append(render(applied, {k: desired.services.get(k, ()) for k in keys}, CAPACITY))
        applied.commit(out[-1])
    return out


def apply(plans: Sequence[Plan]) -> Maps:
    maps: Maps = {}
    for op in (op for p in plans for op in p.ops):
        m = maps.setdefault(op.map, {})
        if op.verb == "put":
            m[op.key] = op.value
        elif op.verb == "del":
            if op.key not in m:
                raise Unmodelled(f"{op.map}: delete of {op.key}, which no op wrote")
            del m[op.key]
        elif op.verb == "reset":
            m[op.key] = None
        else:
            raise Unmodelled(f"op {op.verb} on {op.map}")
    return maps


class BpfTracer:
    def __init__(self, plans: Sequence[Plan]) -> None:
        self.maps = apply(plans)

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        names = _MAPS6 if ":" in pkt.dst else _MAPS
        services, ranges, slots, usable = (self.maps.get(name, {}) for name in names)
        svc = services.get((pkt.dst, pkt.port, _PROTO[pkt.proto], abi.SVC_SCOPE_PACKETS))
        if svc is None:
            yield untranslated(pkt)
            return
        svc_id, count, flags, _affinity_seconds, _sched, _table_size = svc
        if flags & ~KNOWN_FLAGS:
            raise Unmodelled(f"services map flags {flags:#x}")
        if flags & abi.SVC_F_RANGES and not any(
            ipaddress.ip_address(pkt.src) in ipaddress.ip_network(cidr)
            for sid, cidr in ranges if sid == svc_id
        ):
            yield Verdict("no-answer")  # PYPROXY_CNT_SOURCE_DENIED
            return
        if count == 0:
            yield Verdict("no-answer" if flags & abi.SVC_F_DROP else "refused")
            return
        affinity = bool(flags & abi.SVC_F_AFFINITY)
        key = ("affinity", pkt.src, pkt.dst, str(pkt.port), pkt.proto)
        if affinity:
            recorded = [fact[-2:] for fact in memory if fact[:-2] == key]
            alive = [(ip, port) for ip, port in recorded if (svc_id, ip, int(port)) in usable]
            if alive:
                ip, port = alive[0]
                yield Verdict("dnat", f"{ip}:{port}", memory)
                return
        for slot in range(count):
            backend = slots.get((svc_id, slot))
            if backend is None:
                yield Verdict("no-answer")  # PYPROXY_DROP: a slot miss
                continue
            ip, port, _weight = backend
            left = frozenset({(*key, ip, str(port))}) if affinity else frozenset()
            yield Verdict("dnat", f"{ip}:{port}", left)



def tracer(syncs: Sequence[Sync]) -> BpfTracer:
    return BpfTracer(plans(syncs))
