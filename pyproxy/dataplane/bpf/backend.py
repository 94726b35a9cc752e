"""The BPF dataplane backend: loads the programs, keeps them on the managed devices, applies plans."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Set
from pathlib import Path

from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import DataplaneError
from pyproxy.dataplane.bpf import abi, attach, bcc, cgroup, clock, devices, loader, snat
from pyproxy.dataplane.bpf.collector import BpfCollector, EndpointTraffic, FrontendTraffic, endpoint_owners, port_name
from pyproxy.dataplane.bpf.gc import IPV6, CtGarbageCollector
from pyproxy.dataplane.bpf.maps import BpfMap
from pyproxy.dataplane.bpf.mapset import Maps
from pyproxy.dataplane.bpf.render import (
    Applied,
    CapacityError,
    Plan,
    Scheduling,
    render,
)
from pyproxy.dataplane.bpf.settings import DESTROYER_OBJECT, BpfSettings
from pyproxy.dataplane.bpf.sockdestroy import SocketDestroyer
from pyproxy.model.state import BOTH_FAMILIES, Backend, DesiredState, ServicePortState

log = logging.getLogger(__name__)

class BpfDataplane:
    mode = "bpf"
    ip_families = BOTH_FAMILIES
    """The IP families it renders: both, IPv6 frontends to the IPv6 maps (render.by_family). A class attribute: the
    bpf tracer (tests/tracers/bpf.py) reads it without building a backend."""

    def __init__(self, settings: BpfSettings) -> None:
        self.settings = settings
        self._obj: loader.LoadedObject | None = None
        self.maps: Maps | None = None
        self.applied = Applied()
        self._capacity: dict[str, int] = {}
        self._watcher: netlink.LinkWatcher | None = None
        self._devaddrs: snat.DeviceAddresses | None = None
        self._gc: CtGarbageCollector | None = None
        self._gc6: CtGarbageCollector | None = None
        self._destroyer: SocketDestroyer | None = None
        """bpf/sockdestroy.bpf.c, once the socket hooks are attached on a kernel that has bpf_sock_destroy (6.5)."""
        self.collector = BpfCollector(self)
        """The dataplane's own metrics, for the proxier's registry (a prometheus Collector)."""
        self.unserved: dict[str, str] = {}
        """Services left out because a map is full -> why (`_apply_what_fits`)."""
        self.localhost_nodeports = False
        """True once the socket hooks are attached: their connect() and sendmsg() hooks serve 127.0.0.1's NodePorts
        (render.py gives those frontends the services map's PYPROXY_SVC_SCOPE_HOST only, which no packet meets)."""
        self._lock = threading.Lock()
        self._owners: tuple[Applied | None, int, dict[Backend, tuple[str, str, str]]] = (None, -1, {})
        """endpoint_owners() of an Applied at a generation: a scrape recomputes it only after a plan was applied."""
        self.attached: dict[str, int] = {}
        """Managed device name -> ifindex: the devices with the TC programs."""
        self._links: dict[int, netlink.Link] = {}
        self._addresses: dict[int, list[str]] = {}
        """The node's devices and their own addresses, as the watcher last told: what the device rule reads."""
        self._verdicts: dict[int, tuple[str, devices.Verdict]] = {}
        """ifindex -> its name and the device rule's verdict, as applied."""

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        s = self.settings
        # Before anything is changed: what BCC lacks here, and ClockError where the tick rate cannot be told.
        if s.loader == "bcc" and (problem := bcc.missing()):
            raise bcc.BccUnavailable(f"--bpf-loader=bcc: {problem}")
        timeouts = s.ct_timeouts.ticks(clock.kernel_hz())
        loader.ensure_bpffs(s.pin_path)
        try:
            reserved = snat.reserve(s.snat_ports)
        except OSError as e:
            log.warning("cannot keep node sockets off the SNAT ports %d-%d: %s", *s.snat_ports, e)
        else:
            if reserved:
                log.info("%s", reserved)
        adopt = self._previous_maps()
        try:
            if s.loader == "bcc":
                self._obj = bcc.load(s.pin_path, s.max_entries, adopt, timeouts, s.snat_ports,
                                     s.masquerade.cluster_cidr, s.endpoint_counters,
                                     cluster_cidr6=s.masquerade.cluster_cidr6,
                                     socket_lb_hostns_only=s.socket_lb_hostns_only)
            else:
                self._obj = loader.load(s.object_path, s.pin_path, s.max_entries, adopt, timeouts, s.snat_ports,
                                        s.masquerade.cluster_cidr, s.endpoint_counters,
                                        cluster_cidr6=s.masquerade.cluster_cidr6,
                                        socket_lb_hostns_only=s.socket_lb_hostns_only)
            log.info("BPF programs loaded by %s", s.loader)
        finally:
            for fd in adopt.values():
                os.close(fd)
        # Maps owns its fds and the object owns its own: duplicate, so each closes only what it has.
        self.maps = Maps({n: os.dup(fd) for n, fd in self._obj.maps.items()})
        self._capacity = {n: loader.map_info(fd).max_entries for n, fd in self._obj.maps.items()}
        self.applied = self.maps.read_applied()
        self.maps.bump_epoch(self.applied)
        self.maps.write_ports(self.applied)
        self.maps.sync_endpoint_stats(self.applied, s.endpoint_counters)
        self.maps.sync_affinity(self.applied)
        if self.applied.frontends:
            log.info("kept %d frontends from the previous run", len(self.applied.frontends))
        if not self._obj.kernel_flags & abi.KERNEL_FIB_SRC:
            # Before any device is attached: SNAT finds its source address from the first packet on.
            self._devaddrs = snat.DeviceAddresses(
                BpfMap(os.dup(self._obj.maps[abi.MAP_DEVADDRS]), abi.MAP_DEVADDRS, ctypes.c_uint32, ctypes.c_uint32),
                devaddrs6=BpfMap(os.dup(self._obj.maps[abi.MAP_DEVADDRS6]), abi.MAP_DEVADDRS6, ctypes.c_uint32,
                                 abi.In6))
            self._devaddrs.start()
        # Subscribe before listing so a device created in between is not missed.
        self._watcher = netlink.LinkWatcher(self._on_link, self._reread)
        self._read_devices()
        self._watcher.start()
        self._attach_socket_hooks()
        # The new programs are attached: the flows the old ones recorded meanwhile are copied too, the old pins go.
        loader.retire_old_layouts(s.pin_path, self._obj.maps)
        # Its own fds: it runs beside syncs and device events and takes none of their locks.
        self._gc = CtGarbageCollector(
            BpfMap(os.dup(self._obj.maps[abi.MAP_CT]), abi.MAP_CT, abi.CtKey, abi.CtValue),
            BpfMap(os.dup(self._obj.maps[abi.MAP_SERVICES]), abi.MAP_SERVICES, abi.SvcKey, abi.SvcValue),
            capacity=self._capacity[abi.MAP_CT], timeouts=timeouts, hz=clock.kernel_hz(), settings=s.ct_gc,
            metrics=self.collector.gc,
            backends=BpfMap(os.dup(self._obj.maps[abi.MAP_BACKENDS]), abi.MAP_BACKENDS, abi.Backend, abi.BackendInfo),
            socks=self._socket_maps(),
        )
        self._gc.start()
        # IPv6 flows by the same rules, in metrics of their own (pyproxy_bpf_ct6_*).
        self._gc6 = CtGarbageCollector(
            BpfMap(os.dup(self._obj.maps[abi.MAP_CT6]), abi.MAP_CT6, abi.Ct6Key, abi.Ct6Value),
            BpfMap(os.dup(self._obj.maps[abi.MAP_SERVICES6]), abi.MAP_SERVICES6, abi.Svc6Key, abi.SvcValue),
            capacity=self._capacity[abi.MAP_CT6], timeouts=timeouts, hz=clock.kernel_hz(), settings=s.ct_gc,
            backends=BpfMap(os.dup(self._obj.maps[abi.MAP_BACKENDS6]), abi.MAP_BACKENDS6, abi.Backend6,
                            abi.BackendInfo),
            socks=self._socket_maps(),
            layout=IPV6,
            metrics=self.collector.gc6,
        )
        self._gc6.start()

    def _socket_maps(self) -> tuple[BpfMap, BpfMap]:
        """PYPROXY_MAP_SOCKS and SOCKS6 on fds of their own, for a collector's recount (the sockets counted)."""
        assert self._obj is not None
        return (BpfMap(os.dup(self._obj.maps[abi.MAP_SOCKS]), abi.MAP_SOCKS, abi.SockKey, abi.SockValue),
                BpfMap(os.dup(self._obj.maps[abi.MAP_SOCKS6]), abi.MAP_SOCKS6, abi.Sock6Key, abi.Sock6Value))

    def _attach_socket_hooks(self) -> None:
        """Make the socket hooks what the settings say (cgroup.py): on the chosen cgroup, or nowhere."""
        assert self._obj is not None
        s = self.settings
        if not s.socket_lb:
            for line in cgroup.detach(s.pin_path):
                log.info("detached %s: socket load balancing is off", line)
            return
        root = s.cgroup_root
        if root is None:
            try:
                root = cgroup.default_root()
            except loader.BpfUnavailable as e:
                log.warning("node processes will not reach Services: %s", e)
                return
        cgroup.attach(self._obj.progs, root, s.pin_path)
        self.localhost_nodeports = True
        path = s.object_path.with_name(DESTROYER_OBJECT)
        try:
            self._destroyer = SocketDestroyer.load(path, self._obj.maps)
        except (loader.BpfUnavailable, OSError) as e:
            log.warning("a node process's connected UDP socket will keep an endpoint that left (moving it needs "
                        "bpf_sock_destroy, kernel 6.5, and %s): %s", path, e)

    def stop(self) -> None:
        if self._destroyer:
            self._destroyer.close()
        if self._gc:
            self._gc.stop()
        if self._gc6:
            self._gc6.stop()
        if self._watcher:
            self._watcher.stop()
        if self._devaddrs:
            self._devaddrs.stop()
        if self.maps:
            self.maps.close()
        if self._obj:
            self._obj.close()

    def _previous_maps(self) -> dict[str, int]:
        """Maps held by a previous run's programs still attached here (see loader's docstring), by their full
        names: the kernel keeps 15 characters, and pyproxy_epoch_v1 was never adopted under its cut name."""
        return attach.maps_in_use()

    # -- devices ---------------------------------------------------------------------------------

    def _on_link(self, link: netlink.Link, present: bool) -> None:
        """A device came, changed (enslaved, released, renamed) or went: the rule is worked out again for all, since
        one device's change can change another's verdict (a port's bridge, a VLAN's parent)."""
        with self._lock:
            if present:
                self._links[link.index] = link
            else:
                self._links.pop(link.index, None)
            self._sync_devices()

    def _read_devices(self) -> None:
        """The devices and their addresses from the kernel, then the rule for all (at start: a failure fails it)."""
        with self._lock:
            self._links = {lk.index: lk for lk in netlink.list_links()}
            self._addresses = netlink.own_addresses()
            self._sync_devices()

    def _reread(self) -> None:
        """_read_devices for the watcher: when an address of a device's own came or went (the rule reads them), and
        when events were lost."""
        try:
            self._read_devices()
        except OSError as e:  # the next event reads them again; the watcher thread must live on
            log.warning("cannot list the node's devices and addresses: %s", e)

    def _sync_devices(self) -> None:
        """Make every device hold what the device rule says, acting only where its verdict changed (or on a device
        seen for the first time, which may hold what an earlier run left)."""
        s = self.settings
        cidrs = [c for c in (s.masquerade.cluster_cidr, s.masquerade.cluster_cidr6) if c]
        verdicts = devices.plan(list(self._links.values()), self._addresses, devices=s.devices,
                                xdp_devices=s.xdp_devices, cluster_cidrs=cidrs)
        for index in self._verdicts.keys() - verdicts.keys():
            name = self._verdicts.pop(index)[0]
            if self.attached.pop(name, None) is not None:
                log.info("device %s removed", name)
        for index, verdict in verdicts.items():
            link = self._links[index]
            before = self._verdicts.get(index)
            if before == (link.name, verdict):
                continue
            if before is not None and before[0] != link.name:
                self.attached.pop(before[0], None)
                before = None  # renamed: said again under its new name
            try:
                self._apply_verdict(link, verdict, before[1] if before else None)
            except OSError as e:
                log.error("cannot attach to device %s: %s", link.name, e)
                continue  # tried again at the next event
            self._verdicts[index] = (link.name, verdict)

    def _apply_verdict(self, link: netlink.Link, v: devices.Verdict, before: devices.Verdict | None) -> None:
        assert self._obj is not None
        progs = self._obj.progs
        why = f": {v.why}" if v.why else ""
        if v.tc and (before is None or not before.tc):
            attach.attach_tc(link.index, attach.INGRESS, progs[abi.PROG_TC_INGRESS])
            attach.attach_tc(link.index, attach.EGRESS, progs[abi.PROG_TC_EGRESS])
            self.attached[link.name] = link.index
            log.info("attached to device %s (ifindex %d)%s", link.name, link.index, why)
        elif not v.tc and (before is None or before.tc):
            self.attached.pop(link.name, None)
            removed = self._detach(link, v.why, attach.TC_HOOKS)
            if not removed and v.why not in devices.UNSTACKED:
                # A device of a stack: said even where nothing was there to go (the other reasons are said only
                # when programs go: every device without programs would repeat them).
                log.info("no tc programs on %s: %s", link.name, v.why)
        elif before is not None and v.why != before.why:
            log.info("device %s: %s", link.name, v.why or "an Ethernet device of its own")
        if v.xdp and (before is None or not before.xdp):
            self._attach_xdp(link, progs[abi.PROG_XDP])
        elif not v.xdp and (before is None or before.xdp):
            self._detach(link, "not in --xdp-devices", attach.XDP_HOOKS)

    def _attach_xdp(self, link: netlink.Link, prog_fd: int) -> None:
        """XDP on `link` as --bpf-xdp-mode says. A refusal is said with the device's MTU and the kernel's reason:
        the usual one is a driver's limit on the frame size XDP takes without multi-buffer support."""
        mode = self.settings.xdp_mode
        if mode != "generic":
            try:
                attach.attach_xdp(link.index, prog_fd, "native")
                log.info("XDP (native) on %s", link.name)
                return
            except OSError as e:
                why = f"{e.strerror} (MTU {link.mtu})"
                if mode == "native":
                    log.error("no XDP on %s: the driver refused native XDP: %s; --bpf-xdp-mode=native, so the "
                              "device keeps TC only (best-effort would fall back to generic XDP)", link.name, why)
                    return
                log.warning("native XDP refused on %s: %s; falling back to generic XDP, no faster than TC "
                            "(--bpf-xdp-mode=native makes this an error)", link.name, why)
        try:
            attach.attach_xdp(link.index, prog_fd, "generic")
            log.info("XDP (generic) on %s", link.name)
        except OSError as e:
            log.error("no XDP on %s: %s; the device keeps TC only", link.name, e.strerror)

    def _detach(self, link: netlink.Link, why: str, hooks: Iterable[str] | None = None) -> list[str]:
        """Make `link` hold none of our programs on `hooks` (default: any), saying what went and why: a start
        leaves exactly the programs its settings ask for, whatever an earlier run with other settings left.
        Returns the hooks a program was removed from."""
        try:
            removed = attach.detach(link.index, hooks)
        except OSError as e:
            log.error("cannot detach pyproxy's programs from device %s (%s): %s", link.name, why, e)
            return []
        if removed:
            log.info("detached %s from %s: %s", ", ".join(removed), link.name, why)
        return removed

    # -- sync ------------------------------------------------------------------------------------

    def housekeeping_due(self) -> bool:
        return False  # nothing here waits for time: the kernel expires flows itself

    def apply(self, desired: DesiredState, changed: Set[str] | None) -> None:
        assert self.maps is not None
        keys = set(changed) if changed is not None else set(desired.services) | self.applied.by_service.keys()
        # A Service left out for want of room is tried again at every sync, whatever changed: room may have come.
        keys |= self.unserved.keys()
        wanted = {k: desired.services.get(k, ()) for k in keys}
        try:
            self._apply(self._render(wanted))
        except CapacityError:
            self._apply_what_fits(wanted)
        else:
            self._served(keys)

    def _render(self, wanted: Mapping[str, Iterable[ServicePortState]]) -> Plan:
        return render(self.applied, wanted, self._capacity, self.settings.masquerade,
                      Scheduling(self.settings.scheduler, self.settings.maglev_table_size),
                      self.settings.endpoint_counters)

    def _apply(self, plan: Plan) -> None:
        assert self.maps is not None
        for line in plan.skipped:
            log.warning("not served: %s", line)
        try:
            self.maps.run_batches(plan.batches)
        except OSError as e:
            # Re-read the truth so the next sync plans from what the kernel really holds; the plan may have
            # removed backends without its epoch bump.
            self.applied = self.maps.read_applied()
            self.maps.bump_epoch(self.applied)
            self.maps.write_ports(self.applied)
            self.maps.sync_endpoint_stats(self.applied, self.settings.endpoint_counters)
            self.maps.sync_affinity(self.applied)
            raise DataplaneError(f"programming the BPF maps failed: {e}") from e
        released = plan.epoch != self.applied.epoch
        self.applied.commit(plan)
        if released and self._destroyer:
            self._destroy_stale_sockets()

    def _destroy_stale_sockets(self) -> None:
        """After a plan that removed endpoints: the node's connected UDP sockets pointed at one are destroyed, so
        their owners open new ones, balanced afresh (sockdestroy.py). A failure costs only that move."""
        assert self._destroyer is not None
        try:
            moved = self._destroyer.run()
        except OSError as e:
            log.warning("cannot move connected UDP sockets off endpoints that left: %s", e)
            return
        if moved:
            log.info("destroyed %d connected UDP socket(s) of the node pointed at endpoints that left", moved)

    def _apply_what_fits(self, wanted: Mapping[str, Iterable[ServicePortState]]) -> None:
        """The maps cannot hold every Service of `wanted`: apply them one by one, those that free room first
        (removed ones, then those already served, in name order, then new ones), and leave each that does not fit
        as it was (a Service already served keeps its last state: its traffic never stops). Each left out is
        logged once, until it fits (`unserved`)."""
        served = self.applied.by_service
        order = sorted(wanted, key=lambda k: (bool(tuple(wanted[k])), k not in served, k))
        for key in order:
            try:
                plan = self._render({key: wanted[key]})
            except CapacityError as e:
                if key not in self.unserved:
                    log.error("Service %s not programmed: %s", key, e)
                self.unserved[key] = str(e)
                continue
            self._apply(plan)
            self._served([key])

    def _served(self, keys: Iterable[str]) -> None:
        for key in keys:
            if self.unserved.pop(key, None) is not None:
                log.info("Service %s programmed: the BPF maps have room for it again", key)

    def traffic(self) -> list[FrontendTraffic]:
        """Per frontend as last applied, the stats map's packets and bytes summed over CPUs ([] when not started)."""
        maps, frontends = self.maps, list(self.applied.frontends.items())
        if maps is None:
            return []
        out = []
        try:
            for (ip, port, proto, scope), fe in frontends:
                per_cpu = maps.stats.get(fe.svc_id)
                where = f"{ip}:{port}/{proto}" + (" (node)" if scope == abi.SVC_SCOPE_NODE else "")
                out.append(FrontendTraffic(fe.service, port_name(fe), where, sum(v.packets for v in per_cpu),
                                           sum(v.bytes for v in per_cpu)))
        except OSError as e:  # stopped (maps closed) while scraped
            log.debug("reading the stats map: %s", e)
            return []
        return sorted(out)

    def endpoint_traffic(self) -> list[EndpointTraffic]:
        """Per endpoint that was sent a packet, its counts summed over CPUs, labelled with a Service port it serves
        as last applied ([] when not started or the counters are off)."""
        maps, applied = self.maps, self.applied
        if maps is None or not self.settings.endpoint_counters:
            return []
        of, generation, owners = self._owners
        if of is not applied or generation != applied.generation:
            generation = applied.generation  # before the frontends: a plan committed meanwhile recomputes next time
            owners = endpoint_owners(list(applied.frontends.values()))
            self._owners = (applied, generation, owners)
        try:
            counts = maps.endpoint_stats()
        except OSError as e:  # stopped (maps closed) while scraped
            log.debug("reading the endpoint counters map: %s", e)
            return []
        out = []
        for b, (packets, octets) in counts.items():
            owner = owners.get(b)
            if packets and owner is not None:
                namespace, name, port = owner
                out.append(EndpointTraffic(f"{namespace}/{name}", port, f"{b.ip}:{b.port}", packets, octets))
        return sorted(out)

    def datapath_counters(self) -> dict[str, int]:
        """abi.COUNTERS name -> the programs' count, summed over CPUs ({} when not started)."""
        maps = self.maps
        if maps is None:
            return {}
        try:
            return {n: sum(v.value for v in maps.counters.get(i)) for i, n in enumerate(abi.COUNTERS)}
        except OSError as e:
            log.debug("reading the counters map: %s", e)
            return {}

    def map_usage(self) -> dict[str, tuple[int, int]]:
        """Map name -> (entries, capacity) of the maps the control plane fills, as last applied."""
        a = self.applied
        counters = self.settings.endpoint_counters
        backends = len(a.backend_refs) - a.backends6
        held = {abi.MAP_SERVICES: len(a.frontends) - a.frontends6, abi.MAP_SLOTS: a.slots - a.slots6,
                abi.MAP_BACKENDS: backends, abi.MAP_STATS: a.max_id() + 1,
                abi.MAP_EPSTATS: backends if counters else 0,
                abi.MAP_SERVICES6: a.frontends6, abi.MAP_SLOTS6: a.slots6, abi.MAP_BACKENDS6: a.backends6,
                abi.MAP_EPSTATS6: a.backends6 if counters else 0,
                abi.MAP_AFFINITY: a.affinity - a.affinity6, abi.MAP_AFFINITY6: a.affinity6}
        return {name: (n, self._capacity[name]) for name, n in held.items() if name in self._capacity}


def cleanup(pin_path: Path) -> list[str]:
    """Remove every program, pin and qdisc pyproxy's BPF mode made in this namespace; returns what went."""
    done = [f"programs on {lk.name} ({', '.join(hooks)})" for lk in netlink.list_links()
            if (hooks := attach.detach(lk.index))]
    if pin_path.exists():
        done += cgroup.detach(pin_path)
        for pin in sorted(pin_path.iterdir()):
            if pin.name.startswith(abi.MAP_PREFIX):
                pin.unlink()
                done.append(f"pin {pin}")
        if loader.is_mountpoint(pin_path):
            loader.unmount(pin_path)
            done.append(f"bpffs at {pin_path}")
        if not any(pin_path.iterdir()):
            pin_path.rmdir()
    return done
