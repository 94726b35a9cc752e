"""bpf mode's settings (BpfSettings, one docstring per field: the CLI, the config file and the reference pages
come from them) and where its objects are."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pyproxy.dataplane.base import MasqueradeSettings
from pyproxy.dataplane.bpf import abi, maglev
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.gc import CtGcSettings

DEFAULT_OBJECT = Path(os.environ.get("PYPROXY_BPF_OBJECT")
                      or Path(__file__).resolve().parents[3] / "bpf" / "build" / "pyproxy.bpf.o")
"""bpf/build/pyproxy.bpf.o; PYPROXY_BPF_OBJECT names another: the container image's (an installed wheel has no
bpf/build beside it), bench/restarts.py's with a changed map layout."""
DESTROYER_OBJECT = "sockdestroy.bpf.o"
"""bpf/sockdestroy.bpf.c's object, looked for beside BpfSettings.object_path (`make bpf` builds both; the image has
both in /usr/lib/pyproxy)."""
LOADERS = ("libbpf", "bcc")
"""--bpf-loader: libbpf loads the prebuilt object (`make bpf`); bcc compiles bpf/ at start with BCC (bcc.py), for
nodes where the prebuilt object does not fit. Never chosen automatically: bcc only when asked."""
XDP_MODES = ("native", "best-effort", "generic")
"""--bpf-xdp-mode's values (BpfSettings.xdp_mode)."""


@dataclass
class BpfSettings:
    object_path: Path = DEFAULT_OBJECT
    """The compiled programs (bpf/build/pyproxy.bpf.o, built by `make bpf`), for the libbpf loader."""
    loader: str = "libbpf"
    """--bpf-loader (LOADERS): what loads the programs and makes the maps. Both make the same maps under the same
    pins, so a restart with the other loader keeps every flow."""
    pin_path: Path = Path("/sys/fs/bpf/pyproxy")
    """Where maps are pinned; a bpffs is mounted there when none is."""
    devices: tuple[str, ...] = ()
    """Devices to attach to; empty means the device rule's (devices.py): every non-loopback Ethernet device,
    including later ones, but one of each stack of devices (a bridge, not its ports; a bond, not its slaves)."""
    xdp_devices: tuple[str, ...] = ()
    """Devices that get the XDP program (as xdp_mode says), whether or not they get TC (a bridge's port does not);
    a start removes pyproxy's XDP program from every other device."""
    xdp_mode: str = "best-effort"
    """--bpf-xdp-mode (XDP_MODES; Cilium's --bpf-lb-acceleration): native, the driver's XDP or none: a device
    whose driver refuses it (the program takes no multi-buffer frames, so e.g. a veth above an MTU of about 3,500)
    is an error naming the device and the kernel's reason, and keeps TC only; best-effort, native where the
    driver takes it, else generic XDP (skb mode: no faster than TC) with a warning saying why; generic, always
    skb mode."""
    max_entries: dict[str, int] = field(default_factory=dict)
    """--bpf-map-sizes: map capacities overriding abi.h's defaults, by map name (abi.RESIZABLE's values; the flag
    takes their short names). A capacity the kernel refuses fails the start, naming the map and the memory it
    needs; one too small for the Services leaves the Services that do not fit out (logged, an Event, the
    pyproxy_bpf_map_* metrics) while the others are served."""
    ct_timeouts: CtTimeouts = field(default_factory=CtTimeouts)
    """Idle timeouts of tracked flows by protocol and state (constants of the programs loaded at start)."""
    ct_gc: CtGcSettings = field(default_factory=CtGcSettings)
    """How often the connection-tracking map's expired entries are deleted (an interval that adapts, gc.py)."""
    socket_lb: bool = True
    """Socket load balancing for the processes below `cgroup_root` (the node's own and, on a real node, its pods'):
    cgroup hooks at connect() and UDP send/receive point their sockets at a backend (bpf/include/pyproxy/sock.h).
    Off: node processes do not reach Services (pods still do, by TC on their veths)."""
    socket_lb_hostns_only: bool = False
    """--bpf-socket-lb-hostns-only (config: bpf.socketLBHostNamespaceOnly; Cilium's socketLB.hostNamespaceOnly):
    the socket hooks translate the node's own network namespace only; every pod's connections keep their Service
    address at the socket (for service meshes and VMs that need the original destination) and are translated by TC
    on the pod's veth. Off: a pod's connection is translated at the socket wherever that gives what TC would."""
    cgroup_root: Path | None = None
    """The cgroup v2 directory the socket hooks go on; they act on every process in it and below. None: the root
    of the node's cgroup v2 hierarchy, mounted at /run/pyproxy/cgroup2 when the node has none."""
    masquerade: MasqueradeSettings = field(default_factory=MasqueradeSettings)
    """--masquerade-all and --cluster-cidr, as every mode (ProxySettings sets the one shared policy); the
    masquerade bit means nothing here: SNAT is decided per flow in the programs."""
    snat_ports: tuple[int, int] = abi.DEFAULT_SNAT_PORTS
    """--bpf-snat-port-range: the source ports SNAT (masquerade) gives out, first and last. Kept out of the kernel's
    ephemeral range so no node socket shares one (snat.py); its size bounds the SNATed flows open at once from one
    node address to one backend address and port."""
    scheduler: str = "random"
    """--bpf-scheduler: how a new flow's backend is chosen for Services whose `pyproxy.io/scheduler` annotation
    names none (bpf/include/pyproxy/sched.h; README, "Schedulers")."""
    maglev_table_size: int = maglev.DEFAULT_TABLE_SIZE
    """--bpf-maglev-table-size: entries of each maglev frontend's lookup table, a prime of maglev.TABLE_SIZES.
    Larger spreads flows more evenly over many backends (each gets M/N entries, ±1) at 8 bytes per entry and
    frontend; keep it above 100 times the largest backend count."""
    endpoint_counters: bool = False
    """--bpf-endpoint-counters (config: bpf.endpointCounters): the programs also count the packets and bytes they
    send to each endpoint (address:port), for pyproxy_endpoint_packets_total and pyproxy_endpoint_bytes_total.
    Costs a hash lookup per forwarded packet (README, "Metrics"); off, the programs hold no trace of it (a
    constant of the programs loaded at start) and the map stays empty. Counts of endpoints that stay survive a
    restart."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each naming its flag (ProxySettings.validate). The
        timeouts check their signs themselves (CtTimeouts); here, that they fit the programs' tick counters
        at the fastest kernel clock (CONFIG_HZ=1000)."""
        out = [f"--xdp-devices names {dev}, which --devices leaves out" for dev in self.xdp_devices
               if self.devices and dev not in self.devices]
        out += [f"the capacity of map {name} must be 1..{2**32 - 1}, not {n}"
                for name, n in self.max_entries.items() if not 0 < n < 2**32]
        resizable = set(abi.RESIZABLE.values())
        out += [f"--bpf-map-sizes: {name} is not a map whose size can be set (those are "
                f"{', '.join(abi.RESIZABLE)})" for name in self.max_entries if name not in resizable]
        try:
            self.ct_timeouts.ticks(1000)
        except ValueError as e:
            out.append(str(e))
        lo, hi = self.snat_ports
        if not 1024 <= lo <= hi <= 65535:
            out.append(f"--bpf-snat-port-range must be FIRST-LAST within 1024-65535, not {lo}-{hi}")
        if self.xdp_mode not in XDP_MODES:
            out.append(f"--bpf-xdp-mode must be one of {', '.join(XDP_MODES)}, not {self.xdp_mode!r}")
        if self.loader not in LOADERS:
            out.append(f"--bpf-loader must be one of {', '.join(LOADERS)}, not {self.loader!r}")
        if self.scheduler not in abi.SCHED:
            out.append(f"--bpf-scheduler must be one of {', '.join(abi.SCHED)}, not {self.scheduler!r}")
        if self.maglev_table_size not in maglev.TABLE_SIZES:
            out.append(f"--bpf-maglev-table-size must be one of {', '.join(map(str, maglev.TABLE_SIZES))}, "
                       f"not {self.maglev_table_size}")
        return out
