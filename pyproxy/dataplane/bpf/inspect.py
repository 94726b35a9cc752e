"""`pyproxy inspect` for the BPF dataplane: frontends, their backends and counters, and live flows,
read straight from the maps: pinned ones, or else those of the dataplane running in this network namespace.

Under `ip netns exec` every invocation gets its own /sys, so the pins of a pyproxy started that way (under
the default /sys/fs/bpf/pyproxy) are out of reach. inspect then finds the maps as a restart does, through
the programs attached to this namespace's devices (attach.maps_in_use), plus the maps no program uses (the
Service names) through the running pyproxy's open fds: the process in this namespace holding the same
services map. Maps found nowhere (pyproxy stopped: the names went with its /sys) are stood in for by empty
ones, so the frontends still show, under placeholder names.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from pathlib import Path

from pyproxy.dataplane import netlink
from pyproxy.dataplane.bpf import abi, attach, clock, libbpf, loader
from pyproxy.dataplane.bpf.conntrack import CtTimeouts, timeout_ticks
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.dataplane.bpf.mapset import Maps
from pyproxy.dataplane.bpf.render import AppliedFrontend
from pyproxy.dataplane.bpf.settings import DEFAULT_OBJECT
from pyproxy.model import inspection
from pyproxy.model.objects import IPV6, join_host_port

log = logging.getLogger(__name__)


def open_maps(pin_path: Path, object_path: Path = DEFAULT_OBJECT) -> Maps | None:
    """The live maps, or None when pyproxy's BPF dataplane is not set up here."""
    if all((pin_path / n).exists() for n in abi.ALL_MAPS):
        return Maps({n: libbpf.check(libbpf.lib().bpf_obj_get(str(pin_path / n).encode()), f"open {n}")
                     for n in abi.ALL_MAPS})
    fds = attach.maps_in_use()
    if abi.MAP_SERVICES not in fds:
        for fd in fds.values():
            os.close(fd)
        return None
    for name, fd in _held_by_the_process_using(loader.map_info(fds[abi.MAP_SERVICES]).id).items():
        if name in fds:
            os.close(fd)
        else:
            fds[name] = fd
    if set(abi.ALL_MAPS) <= fds.keys():
        return Maps(fds)
    try:
        return _with_stand_ins(fds, object_path)
    finally:
        for fd in fds.values():
            os.close(fd)


def _held_by_the_process_using(services_map_id: int) -> dict[str, int]:
    """abi name -> a new fd, for the pyproxy maps a process of this network namespace holds open, if one
    holds the services map `services_map_id` (the running pyproxy of these programs); else none."""
    own_ns = os.stat("/proc/self/ns/net")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        ids: set[int] = set()
        with contextlib.suppress(OSError):  # gone meanwhile, or a kernel thread
            ns = os.stat(f"/proc/{pid}/ns/net")
            if (ns.st_dev, ns.st_ino) != (own_ns.st_dev, own_ns.st_ino) or int(pid) == os.getpid():
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:bpf-map":
                    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                        found = re.search(r"^map_id:\s*(\d+)$", f.read(), re.M)
                    if found:
                        ids.add(int(found.group(1)))
        if services_map_id in ids:
            return _open_ids(ids)
    return {}


def _open_ids(ids: set[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for map_id in ids:
        fd = libbpf.lib().bpf_map_get_fd_by_id(map_id)
        if fd < 0:
            continue
        name = attach.abi_map_name(loader.map_info(fd).name.decode())
        if name is None or name in out:
            os.close(fd)
        else:
            out[name] = fd
    return out


def _with_stand_ins(fds: dict[str, int], object_path: Path) -> Maps:
    """Maps from `fds` and, for those missing, new empty ones: the object loaded (not attached) reusing every
    found map, as a restart does, so each stand-in has its map's exact shape."""
    missing = sorted(set(abi.ALL_MAPS) - fds.keys())
    log.info("%s not found (no pyproxy runs in this network namespace): shown empty%s", ", ".join(missing),
             "; Services are named ?/svc-ID" if abi.MAP_NAMES in missing else "")
    capacities = {name: loader.map_info(fd).max_entries for name, fd in fds.items()}
    level = loader.log.level
    loader.log.setLevel(logging.WARNING)  # not "reusing map ..." per map: nothing is reused for long here
    try:
        obj = loader.load(object_path, None, capacities, fds)
    finally:
        loader.log.setLevel(level)
    try:
        return Maps({name: os.dup(fd) for name, fd in obj.maps.items()})
    finally:
        obj.close()


def _ip(a: int | abi.In6) -> str:
    """An address as a CT entry holds it: IPv4's network-order u32, or IPv6's struct pyproxy_in6."""
    return abi.ip6_of(a) if isinstance(a, abi.In6) else abi.ip_of(a)


def _snat_source(ct: BpfMap, k: abi.CtKey | abi.Ct6Key, v: abi.CtValue | abi.Ct6Value) -> str:
    """The node address and port an SNATed flow leaves from: its SNAT pair's REVERSE entry (ct.h's
    pyproxy_ct_snat_key), in the CT map `ct` of its family."""
    snat = ct.get(type(k)(saddr=k.saddr, daddr=v.nat_addr, sport=k.sport, dport=v.nat_port, proto=k.proto,
                          dir=abi.CT_REVERSE))
    if snat is None or not snat.flags & abi.CT_F_SNAT:
        return "?"
    return join_host_port(_ip(snat.nat_addr), abi.port_of(snat.nat_port))


def _endpoints(maps: Maps, fe: AppliedFrontend) -> tuple[inspection.Endpoint, ...]:
    """The frontend's endpoints, in slot order (sh and dh index them), with their open flows when its scheduler
    counts them."""
    counting = abi.SCHED_NAME.get(fe.sched) in abi.COUNTING_SCHEDULERS
    out = []
    for i, b in enumerate(fe.backends):
        active = None
        if counting:
            info = (maps.backends6.get(abi.Backend6(abi.in6(b.ip), abi.be16(b.port))) if b.family == IPV6
                    else maps.backends.get(abi.Backend(abi.be32(b.ip), abi.be16(b.port))))
            active = max(0, info.active) if info is not None else 0
        out.append(inspection.Endpoint(b.ip, b.port, fe.weights[i] if fe.weights else 1, active))
    return tuple(out)


def view(maps: Maps, flows: bool = True) -> inspection.View:
    """What the maps hold, as `pyproxy inspect` shows it and `inspect trace` decides from."""
    applied = maps.read_applied()
    out = inspection.View(mode="bpf")
    for (ip, port, proto, scope), fe in sorted(applied.frontends.items(), key=lambda kv: kv[1].name):
        per_cpu = maps.stats.get(fe.svc_id)
        out.frontends.append(inspection.Frontend(
            ip=ip, port=port, proto=proto, name=fe.name, service=fe.service,
            scheduler=abi.SCHED_NAME.get(fe.sched, str(fe.sched)), endpoints=_endpoints(maps, fe),
            node=scope != abi.SVC_SCOPE_PACKETS, affinity_sec=fe.affinity_sec, source_ranges=fe.source_ranges,
            empty="dropped" if fe.flags & abi.SVC_F_DROP else "refused", table=tuple(map(str, fe.table)),
            packets=sum(s.packets for s in per_cpu), bytes=sum(s.bytes for s in per_cpu)))
    out.counters = {n: sum(v.value for v in maps.counters.get(i)) for i, n in enumerate(abi.COUNTERS)}
    if not flows:
        return out
    now, hz = clock.ticks_now(), clock.kernel_hz()
    names = {fe.svc_id: fe.name for fe in applied.frontends.values()}
    affinity_ticks = {fe.svc_id: fe.affinity_sec * hz for fe in applied.frontends.values()}
    timeouts = loaded_timeouts() or CtTimeouts().ticks(hz)
    for ct in (maps.ct, maps.ct6):
        _add_flows(out, ct, names, affinity_ticks, now, hz, timeouts)
    return out


def loaded_timeouts() -> abi.CtTimeoutTicks | None:
    """The connection-tracking timeouts the attached programs run with: their .rodata (struct pyproxy_config, the
    loader's constants), read through a program on this namespace's devices; None when none is attached."""
    for pid in sorted({pid for link in netlink.list_links() for pid in attach.ours(link.index).values()}):
        fds = loader.maps_of_program(pid)
        try:
            for name, fd in fds.items():
                if name.endswith(".rodata"):
                    value = BpfMap(os.dup(fd), name, ctypes.c_uint32, abi.Config)
                    try:
                        return value[ctypes.c_uint32(0)].ct
                    except (KeyError, OSError):
                        return None
                    finally:
                        value.close()
        finally:
            for fd in fds.values():
                os.close(fd)
    return None


def _expired(ct: BpfMap, k: ctypes.Structure, v: ctypes.Structure, now: int, t: abi.CtTimeoutTicks) -> bool:
    """Whether the flow of FORWARD entry `v` under `k` is gone in the programs' eyes (ct.h pyproxy_ct_live): this
    entry and its peer are both past their state's timeout. The collector deletes such a flow at its next pass."""
    if now - v.last_seen <= timeout_ticks(t, k.proto, v.state):
        return False
    peer_key = ct.key_type(saddr=v.nat_addr, daddr=k.saddr, sport=v.nat_port, dport=k.sport, proto=k.proto,
                           dir=abi.CT_REVERSE)
    peer = ct.get(peer_key)
    return peer is None or now - peer.last_seen > timeout_ticks(t, k.proto, peer.state)


def _add_flows(out: inspection.View, ct: BpfMap, names: dict[int, str], affinity_ticks: dict[int, int], now: int,
               hz: int, timeouts: abi.CtTimeoutTicks) -> None:
    """The live flows and affinities of one family's CT map (PYPROXY_MAP_CT, PYPROXY_MAP_CT6): a flow past its
    timeouts is absent to the programs, and not shown, though the collector has not deleted it yet."""
    for k in ct.keys_list():
        if k.dir == abi.CT_REVERSE or k.dir == abi.CT_HAIRPIN:   # HAIRPIN: a choice its flow takes at once
            continue
        v = ct.get(k)
        # An SNAT pair's FORWARD entry is the reply side of a flow listed under its client (abi.h).
        if v is None or v.flags & abi.CT_F_SNAT:
            continue
        proto = abi.PROTO_NAME.get(k.proto, str(k.proto))
        backend = join_host_port(_ip(v.nat_addr), abi.port_of(v.nat_port))
        idle = max(0, now - v.last_seen)
        name = names.get(v.svc_id, "?")
        if k.dir == abi.CT_AFFINITY:
            out.affinities.append(inspection.Affinity(
                proto, _ip(k.saddr), _ip(k.daddr), abi.port_of(k.dport), backend, name,
                round((affinity_ticks.get(v.svc_id, 0) - idle) / hz, 3)))
            continue
        if _expired(ct, k, v, now, timeouts):
            continue
        out.flows.append(inspection.Flow(
            proto, _ip(k.saddr), abi.port_of(k.sport), _ip(k.daddr), abi.port_of(k.dport), backend,
            name, abi.CT_STATE_NAME.get(v.state, str(v.state)), idle_sec=round(idle / hz, 3),
            snat=_snat_source(ct, k, v) if v.flags & abi.CT_F_MASQ else None,
            # lb.h takes a SYN on a closing or closed flow as a new connection: such a flow pins none.
            ended=k.proto == abi.IPPROTO["TCP"] and v.state in abi.CT_ST_REOPENS))


def report(maps: Maps, flows: bool = True) -> str:
    return inspection.report(view(maps, flows), flows)
