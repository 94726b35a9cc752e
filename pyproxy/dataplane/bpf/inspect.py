"""`pyproxy inspect` for the BPF dataplane: frontends, their backends and counters, and live flows,
read straight from the maps (pinned ones, or those of the programs attached in this namespace)."""

from __future__ import annotations

import os
from pathlib import Path

from pyproxy.dataplane import netlink
from pyproxy.dataplane.bpf import abi, attach, clock, libbpf, loader
from pyproxy.dataplane.bpf.backend import Maps


def open_maps(pin_path: Path) -> Maps | None:
    """The live maps, or None when pyproxy's BPF dataplane is not set up here."""
    if all((pin_path / n).exists() for n in abi.ALL_MAPS):
        return Maps({n: libbpf.check(libbpf.lib().bpf_obj_get(str(pin_path / n).encode()), f"open {n}")
                     for n in abi.ALL_MAPS})
    for link in netlink.list_links():
        pid = attach.tc_prog_id(link.index, attach.INGRESS)
        if pid and loader.is_ours(pid):
            fds = loader.maps_of_program(pid)
            if all(n in fds for n in abi.ALL_MAPS):
                return Maps(fds)
            for fd in fds.values():
                os.close(fd)
    return None


def report(maps: Maps, flows: bool = True) -> str:
    applied = maps.read_applied()
    lines = [f"{'SERVICE':40} {'FRONTEND':26} {'PACKETS':>9} {'BYTES':>11}  BACKENDS"]
    for key, fe in sorted(applied.frontends.items(), key=lambda kv: kv[1].name):
        per_cpu = maps.stats.get(fe.svc_id)
        pkts, byts = sum(s.packets for s in per_cpu), sum(s.bytes for s in per_cpu)
        backends = ", ".join(str(b) for b in fe.backends) or "(none: refused)"
        lines.append(f"{fe.name:40} {f'{key[0]}:{key[1]}/{key[2]}':26} {pkts:>9} {byts:>11}  {backends}")
    counters = [sum(v.value for v in maps.counters.get(i)) for i in range(len(abi.COUNTERS))]
    lines.append("")
    lines.append("datapath: " + ", ".join(f"{n}={c}" for n, c in zip(abi.COUNTERS, counters, strict=True)))
    if flows:
        lines.append("")
        lines.append(f"{'FLOW (client -> frontend)':48} {'BACKEND':22} {'SERVICE':30} IDLE")
        now, hz = clock.ticks_now(), clock.kernel_hz()
        names = {fe.svc_id: fe.name for fe in applied.frontends.values()}
        for k in maps.ct.keys_list():
            if k.dir != abi.CT_FORWARD:
                continue
            v = maps.ct.get(k)
            if v is None:
                continue
            proto = abi.PROTO_NAME.get(k.proto, str(k.proto))
            flow = (f"{proto} {abi.ip_of(k.saddr)}:{abi.port_of(k.sport)} -> "
                    f"{abi.ip_of(k.daddr)}:{abi.port_of(k.dport)}")
            idle = max(0, now - v.last_seen) / hz
            backend = f"{abi.ip_of(v.nat_addr)}:{abi.port_of(v.nat_port)}"
            lines.append(f"{flow:48} {backend:22} {names.get(v.svc_id, '?'):30} {idle:.1f}s")
    return "\n".join(lines)
