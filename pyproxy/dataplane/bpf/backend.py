"""The BPF dataplane backend: loads the programs, keeps them on the managed devices, applies plans."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import DataplaneError
from pyproxy.dataplane.bpf import abi, attach, loader
from pyproxy.dataplane.bpf.maps import BpfMap, PerCpuArray
from pyproxy.dataplane.bpf.render import Applied, AppliedFrontend, CapacityError, FrontendKey, Op, render
from pyproxy.model.state import Backend, DesiredState

log = logging.getLogger(__name__)

DEFAULT_OBJECT = Path(__file__).resolve().parents[3] / "bpf" / "build" / "pyproxy.bpf.o"


@dataclass
class BpfSettings:
    object_path: Path = DEFAULT_OBJECT
    """The compiled programs (bpf/build/pyproxy.bpf.o, built by `make bpf`)."""
    pin_path: Path = Path("/sys/fs/bpf/pyproxy")
    """Where maps are pinned; a bpffs is mounted there when none is."""
    devices: tuple[str, ...] = ()
    """Devices to attach to; empty means every non-loopback Ethernet device, including later ones."""
    xdp_devices: tuple[str, ...] = ()
    """Devices that also get the XDP program (native mode, generic as a fallback)."""
    max_entries: dict[str, int] = field(default_factory=dict)
    """Map capacities overriding abi.h's defaults, by map name."""


def _key_codec() -> dict[str, Callable[[tuple], Any]]:
    return {
        abi.MAP_SERVICES: lambda k: abi.SvcKey(abi.be32(k[0]), abi.be16(k[1]), abi.IPPROTO[k[2]]),
        abi.MAP_SLOTS: lambda k: abi.SlotKey(k[0], k[1]),
        abi.MAP_BACKENDS: lambda k: abi.Backend(abi.be32(k[0]), abi.be16(k[1])),
        abi.MAP_NAMES: lambda k: ctypes.c_uint32(k[0]),
    }


_VALUE_CODEC: dict[str, Callable[[tuple], Any]] = {
    abi.MAP_SERVICES: lambda v: abi.SvcValue(*v),
    abi.MAP_SLOTS: lambda v: abi.Backend(abi.be32(v[0]), abi.be16(v[1])),
    abi.MAP_BACKENDS: lambda v: abi.BackendInfo(*v),
    abi.MAP_NAMES: lambda v: abi.SvcName(v[0].encode()[: abi.NAME_LEN - 1]),
}
_KEY_CODEC = _key_codec()


class Maps:
    """The program's maps as mappings (also used read-only by `pyproxy inspect`)."""

    def __init__(self, fds: dict[str, int]) -> None:
        self.services: BpfMap = BpfMap(fds[abi.MAP_SERVICES], abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue)
        self.slots: BpfMap = BpfMap(fds[abi.MAP_SLOTS], abi.MAP_SLOTS, abi.SlotKey, abi.Backend)
        self.backends: BpfMap = BpfMap(fds[abi.MAP_BACKENDS], abi.MAP_BACKENDS, abi.Backend, abi.BackendInfo)
        self.ct: BpfMap = BpfMap(fds[abi.MAP_CT], abi.MAP_CT, abi.CtKey, abi.CtValue)
        self.names: BpfMap = BpfMap(fds[abi.MAP_NAMES], abi.MAP_NAMES, ctypes.c_uint32, abi.SvcName)
        self.stats: PerCpuArray = PerCpuArray(fds[abi.MAP_STATS], abi.MAP_STATS, abi.SvcStats)
        self.counters: PerCpuArray = PerCpuArray(fds[abi.MAP_COUNTERS], abi.MAP_COUNTERS, ctypes.c_uint64)
        self.by_name: dict[str, BpfMap] = {
            m.name: m for m in (self.services, self.slots, self.backends, self.ct, self.names)
        }

    def close(self) -> None:
        for m in self.by_name.values():
            m.close()
        self.stats.close()
        self.counters.close()

    def run(self, op: Op) -> None:
        if op.verb == "reset":
            self.stats.reset(op.key[0])
            return
        m = self.by_name[op.map]
        key = _KEY_CODEC[op.map](op.key)
        if op.verb == "put":
            assert op.value is not None
            m[key] = _VALUE_CODEC[op.map](op.value)
        else:
            m.pop(key, None)

    def read_applied(self) -> Applied:
        """Rebuild what is applied from the maps (after a restart, or after a failed apply)."""
        frontends: dict[FrontendKey, AppliedFrontend] = {}
        for k in self.services.keys_list():
            v = self.services.get(k)
            if v is None:
                continue
            name_v = self.names.get(ctypes.c_uint32(v.svc_id))
            # The names map is not held by the programs, so a restart under `ip netns exec` may not find it;
            # a placeholder owner is then renamed in place by the first full sync.
            name = name_v.name.decode(errors="replace") if name_v else f"?/svc-{v.svc_id}"
            backends = []
            for i in range(v.backend_count):
                b = self.slots.get(abi.SlotKey(v.svc_id, i))
                if b is not None:
                    backends.append(Backend(abi.ip_of(b.addr), abi.port_of(b.port)))
            key = (abi.ip_of(k.vip), abi.port_of(k.port), abi.PROTO_NAME.get(k.proto, str(k.proto)))
            frontends[key] = AppliedFrontend(
                svc_id=v.svc_id,
                name=name,
                service=name.split(":", 1)[0],
                backends=tuple(backends),
                known=tuple(backends),
                affinity_sec=v.affinity_sec if v.flags & abi.SVC_F_AFFINITY else 0,
            )
        refs: dict[Backend, int] = {}
        for f in frontends.values():
            for b in f.known:
                refs[b] = refs.get(b, 0) + 1
        # Backends no frontend references (e.g. not-ready ones) stay known with no references: the
        # first full sync either re-references them or removes them.
        for bk in self.backends.keys_list():
            refs.setdefault(Backend(abi.ip_of(bk.addr), abi.port_of(bk.port)), 0)
        return Applied(frontends=frontends, backend_refs=refs)


class BpfDataplane:
    mode = "bpf"

    def __init__(self, settings: BpfSettings) -> None:
        self.settings = settings
        self._obj: loader.LoadedObject | None = None
        self.maps: Maps | None = None
        self.applied = Applied()
        self._capacity: dict[str, int] = {}
        self._watcher: netlink.LinkWatcher | None = None
        self._lock = threading.Lock()
        self.attached: dict[str, int] = {}
        """Managed device name -> ifindex."""

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        s = self.settings
        loader.ensure_bpffs(s.pin_path)
        adopt = self._previous_maps()
        try:
            self._obj = loader.load(s.object_path, s.pin_path, s.max_entries, adopt)
        finally:
            for fd in adopt.values():
                os.close(fd)
        # Maps owns its fds and the object owns its own: duplicate, so each closes only what it has.
        self.maps = Maps({n: os.dup(fd) for n, fd in self._obj.maps.items()})
        self._capacity = {n: loader.map_info(fd).max_entries for n, fd in self._obj.maps.items()}
        self.applied = self.maps.read_applied()
        if self.applied.frontends:
            log.info("kept %d frontends from the previous run", len(self.applied.frontends))
        # Subscribe before listing so a device created in between is not missed.
        self._watcher = netlink.LinkWatcher(self._on_link)
        for link in netlink.list_links():
            self._on_link(link, True)
        self._watcher.start()

    def stop(self) -> None:
        if self._watcher:
            self._watcher.stop()
        if self.maps:
            self.maps.close()
        if self._obj:
            self._obj.close()

    def _previous_maps(self) -> dict[str, int]:
        """Maps held by a previous run's programs still attached here (see loader's docstring)."""
        for link in netlink.list_links():
            pid = attach.tc_prog_id(link.index, attach.INGRESS)
            if pid and loader.is_ours(pid):
                return loader.maps_of_program(pid)
        return {}

    # -- devices ---------------------------------------------------------------------------------

    def _wanted(self, link: netlink.Link) -> bool:
        if self.settings.devices:
            return link.name in self.settings.devices
        return link.ether

    def _on_link(self, link: netlink.Link, present: bool) -> None:
        with self._lock:
            if not present:
                if self.attached.pop(link.name, None) is not None:
                    log.info("device %s removed", link.name)
                return
            if self.attached.get(link.name) == link.index:
                return
            if not self._wanted(link):
                detach_device(link)
                return
            try:
                self._attach(link)
            except OSError as e:
                log.error("cannot attach to device %s: %s", link.name, e)

    def _attach(self, link: netlink.Link) -> None:
        assert self._obj is not None
        progs = self._obj.progs
        attach.attach_tc(link.index, attach.INGRESS, progs[abi.PROG_TC_INGRESS])
        attach.attach_tc(link.index, attach.EGRESS, progs[abi.PROG_TC_EGRESS])
        if link.name in self.settings.xdp_devices:
            try:
                attach.attach_xdp(link.index, progs[abi.PROG_XDP], "native")
                log.info("XDP (native) on %s", link.name)
            except OSError as e:
                log.warning("native XDP failed on %s (%s); falling back to generic XDP", link.name, e)
                attach.attach_xdp(link.index, progs[abi.PROG_XDP], "generic")
        self.attached[link.name] = link.index
        log.info("attached to device %s (ifindex %d)", link.name, link.index)

    # -- sync ------------------------------------------------------------------------------------

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        assert self.maps is not None
        keys = set(changed) if changed is not None else (
            set(desired.services) | {f.service for f in self.applied.frontends.values()}
        )
        try:
            plan = render(self.applied, {k: desired.services.get(k, ()) for k in keys}, self._capacity)
        except CapacityError as e:
            raise DataplaneError(str(e)) from e
        for line in plan.skipped:
            log.warning("not served: %s", line)
        try:
            for op in plan.ops:
                self.maps.run(op)
        except OSError as e:
            # Re-read the truth so the next sync plans from what the kernel really holds.
            self.applied = self.maps.read_applied()
            raise DataplaneError(f"programming the BPF maps failed: {e}") from e
        self.applied = plan.applied


def detach_device(link: netlink.Link) -> bool:
    """Remove pyproxy's programs from one device (and the clsact qdisc when nothing else uses it)."""
    removed = False
    for direction in (attach.INGRESS, attach.EGRESS):
        if loader.is_ours(attach.tc_prog_id(link.index, direction)):
            removed |= attach.detach_tc(link.index, direction)
    for mode, pid in attach.xdp_prog_ids(link.index).items():
        if loader.is_ours(pid):
            attach.detach_xdp(link.index, mode)
            removed = True
    if removed and netlink.has_clsact(link.index) and netlink.tc_filter_count(link.index) == 0:
        netlink.remove_clsact(link.index)
    return removed


def cleanup(pin_path: Path) -> list[str]:
    """Remove every program, pin and qdisc pyproxy's BPF mode made in this namespace; returns what went."""
    done = [f"programs on {lk.name}" for lk in netlink.list_links() if detach_device(lk)]
    if pin_path.exists():
        for pin in sorted(pin_path.iterdir()):
            if pin.name.startswith("pyproxy_"):
                pin.unlink()
                done.append(f"pin {pin}")
        if loader.is_mountpoint(pin_path):
            loader.unmount(pin_path)
            done.append(f"bpffs at {pin_path}")
        if not any(pin_path.iterdir()):
            pin_path.rmdir()
    return done
