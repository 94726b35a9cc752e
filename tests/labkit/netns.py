"""A network-namespace lab: a client, a node and N backends, wired with veth pairs, for real traffic.

    client 10.200.0.2 --eth0/to-client-- node --to-bI/eth0-- backend I 10.201.I.2   (I = 1..N)
                                           \\--to-uplink/eth0-- uplink 10.199.0.2  (only with distro=True)

With `router="backends"` the backends hang off a router namespace instead of the node, and with `router="client"`
the client does (a path with a smaller MTU on the way, where a router answers "fragmentation needed"):

    node --to-router/eth0-- router 10.198.0.2 --to-bI/eth0-- backend I      (router="backends")
    client --eth0/to-client-- router 10.198.0.2 --eth0/to-router-- node      (router="client")

With `ipv6=True` every link also gets an IPv6 /64 beside its IPv4 /24, each address its IPv4 one's `ipv6_of`
(client fd00:10:200::2, backend I fd00:10:201:I::2, the node fd00:10:200::1, ...; `nodad`, so they work at once),
default routes of both families, and the node forwards IPv6 too (not with a router, node2 or a second client).

`router_mtu` sets the MTU of both ends of the node-router link. `client_addresses=N` gives the client N more
addresses on its link, 10.200.0.3 onwards (`Lab.client_ips`), as N clients behind one link: what source-hashing
schedulers tell apart.

With `client_stack="bridge"` the node's address on the client's link sits on a bridge `br0` whose port is the veth
`to-client` (a node whose NIC is a bridge port); with `client_stack="macvlan"` it sits on a macvlan `mv0` (bridge
mode) over `to-client`, which holds no address itself and answers ARP only for its own addresses (arp_ignore=1), so the
client's frames are the macvlan's (`send_to_lower_device` sends them to to-client's MAC instead, as a client that
took the lower device's ARP answer does). With `client_stack="vlan"` it sits on the VLAN `to-client.100` over
`to-client`, which holds no address (a node whose NIC carries only tagged traffic), and the client's address is on
its own `eth0.100` (`client_ifname`): every frame on the link is tagged. With `client_stack="bond"` it sits on
`bond0` (active-backup, miimon 100) whose one slave is `to-client`. The VLAN and bond drivers are loaded when the
kernel has them as modules (`missing_stack_driver` says why a kernel cannot build a stack). `node_client_ifname`
is the device holding the address in every case, `node_client_lower_ifname` the veth under it:

    client 10.200.0.2 --eth0/to-client-- [br0 | mv0 | to-client.100 | bond0 10.200.0.1] node
    client eth0.100 10.200.0.2 --eth0/to-client-- to-client.100 10.200.0.1 node         (client_stack="vlan")

With `pod_bridge=True` the node's backends hang off a bridge `cni0`, as pods of a bridge CNI do: each `to-bI` veth
is a port of it, cni0 holds their gateway 10.201.0.1/16, and every backend keeps its address 10.201.I.2 (`backend_ip`),
now in that one /16 (with `ipv6`, fd00:10:201::1/48 and fd00:10:201:I::2/48): pods reach each other bridged, port to
port, and the node through cni0. A Backend's `node_ip` is then the gateway, its `node_ifname` its port.

    node cni0 10.201.0.1/16 --to-bI/eth0-- backend I 10.201.I.2/16

With `remote_backends=N` a second node joins (as an operator builds a two-node lab: node 1 runs pyproxy, pods on
both nodes, node 2 with no route back to the external network), and with `second_client=True` a second client
outside the cluster, on a subnet of its own (for loadBalancerSourceRanges that hold one client and not the other):

    client2 10.200.1.2 --eth0/to-client2-- node
    node --to-node2/eth0-- node2 10.197.0.2 --to-rJ/eth0-- remote pod J 10.202.J.2   (J = 1..N)

node2 forwards, and its ONLY routes are its connected links and 10.201.0.0/16 (node 1's pods) via the node: a
reply to a client outside the cluster that was not SNATed to a node address dies there, as it would on a real
second node. The node routes 10.202.0.0/16 via node2, and its default route goes via node2 too, the node network
being where a real node's default route leads: the node's own traffic then leaves from 10.197.0.1, an address
node2 reaches, and what the node forwards untranslated dies at node2. (So a two-node lab has no uplink namespace;
`distro=True` still sets its rp_filter and INVALID drop.) Remote pods are named rJ; their slices name
REMOTE_NODE_NAME.

The node routes (ip_forward=1 in the node namespace only; it is per netns); the client and every backend have
their default route via the node, so traffic to a ClusterIP goes client -> node -> backend and back. The
addressing is deterministic (backend I is always 10.201.I.2) so shipped demo manifests can name backends; the
/24s exist only inside these namespaces. Namespace names are `<prefix>-<4 hex>-<role>`, unique per Lab, so
parallel labs never collide, and a marker file lets a later Lab remove what a crashed (SIGKILLed) run left.

Everything runs `ip`, `ethtool`, `sysctl` and `iptables` through subprocess with a timeout; teardown runs
every step even when one fails, and also on exceptions and KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from labkit.traffic import READY_LINE, HttpResult, ProbeResult

log = logging.getLogger("labkit")

DEFAULT_TIMEOUT = 30.0
# Lab state outside /sys: `ip netns exec` remounts /sys, hiding any bpffs there (kernel-and-bpf.md pitfall 2).
RUN_DIR = Path("/run/pyproxy-lab")
# One bpffs shared by all labs, mounted before any `ip netns exec`, so pins made by pyproxy inside the node
# namespace are visible to `pyproxy cleanup`, `bpftool` and the tests; each Lab pins in its own subdirectory.
BPFFS_DIR = RUN_DIR / "bpffs"
# The cgroup v2 hierarchy mounted outside /sys for the same reason: each lab has a cgroup of its own there, where
# pyproxy's socket hooks go (--cgroup-root), so they act on the lab's processes only, never on the machine's.
CGROUP_DIR = RUN_DIR / "cgroup2"
MARKER_DIR = RUN_DIR / "labs"

CLIENT_IP = "10.200.0.2"
NODE_CLIENT_IP = "10.200.0.1"
CLIENT2_IP = "10.200.1.2"
MAX_CLIENT_ADDRESSES = 200
"""More client addresses than this would run into 10.200.0.255, the link's broadcast address."""
NODE_CLIENT2_IP = "10.200.1.1"
NODE_CLIENT2_IFNAME = "to-client2"
NODE2_IP = "10.197.0.2"
NODE_NODE2_IP = "10.197.0.1"
NODE_NODE2_IFNAME = "to-node2"
REMOTE_NODE_NAME = "lab-node-2"
"""The second node's name, for the nodeName of its pods' endpoints (the lab does not run pyproxy there)."""
UPLINK_IP = "10.199.0.2"
NODE_UPLINK_IP = "10.199.0.1"
NODE_CLIENT_IFNAME = "to-client"
CLIENT_STACKS = ("bridge", "macvlan", "vlan", "bond")
NODE_CLIENT_BRIDGE = "br0"
"""client_stack="bridge": the bridge holding NODE_CLIENT_IP, NODE_CLIENT_IFNAME its port."""
NODE_CLIENT_MACVLAN = "mv0"
"""client_stack="macvlan": the macvlan (bridge mode) over NODE_CLIENT_IFNAME holding NODE_CLIENT_IP."""
CLIENT_VLAN_ID = 100
NODE_CLIENT_VLAN = f"{NODE_CLIENT_IFNAME}.{CLIENT_VLAN_ID}"
"""client_stack="vlan": the VLAN over NODE_CLIENT_IFNAME (which holds no address) holding NODE_CLIENT_IP."""
NODE_CLIENT_BOND = "bond0"
"""client_stack="bond": the bond holding NODE_CLIENT_IP, NODE_CLIENT_IFNAME its one slave. Active-backup: the mode
that asks nothing of the switch (balance-xor and 802.3ad expect the other end to aggregate the links too), the
usual one for a server's uplink to plain switches; with one slave every frame arrives on the active slave and is
the bond's."""
STACK_DRIVERS = {"vlan": "8021q", "bond": "bonding"}
"""The kernel module each client_stack needs beyond veth (bridge and macvlan are everywhere this lab runs)."""
_DRIVER_PRESENT = {"8021q": Path("/proc/net/vlan"), "bonding": Path("/sys/class/net/bonding_masters")}
"""What exists once the driver is in the kernel (built in or loaded), in the caller's network namespace."""
# bonding's max_bonds=0: no bond0 of the module's own in the initial namespace (the lab's is in the node's).
_MODPROBE_ARGS = {"bonding": ("max_bonds=0",)}
POD_BRIDGE = "cni0"
"""pod_bridge=True: the bridge the backends' veths are ports of, holding their gateway POD_GATEWAY_IP."""
POD_GATEWAY_IP = "10.201.0.1"
POD_PREFIX = 16
"""The pod bridge's subnet, 10.201.0.0/16, holds every backend_ip()."""
POD_PREFIX6 = 48
"""Its IPv6 twin: fd00:10:201::/48 holds every ipv6_of(backend_ip())."""
NODE_UPLINK_IFNAME = "to-uplink"
ROUTER_IP = "10.198.0.2"
NODE_ROUTER_IP = "10.198.0.1"
NODE_ROUTER_IFNAME = "to-router"
ROUTER_SIDES = ("client", "backends")
# The interface name on the client, backend and uplink side of their veth.
PEER_IFNAME = "eth0"
IFNAMSIZ = 15
MAX_BACKENDS = 254

# The counters a wrong checksum after NAT increments in the receiving namespace (names as nstat prints them).
CHECKSUM_COUNTERS = ("TcpInCsumErrors", "UdpInCsumErrors", "IcmpInCsumErrors", "IpExtInCsumErrors",
                     "Udp6InCsumErrors", "Icmp6InCsumErrors")
"""TCP's counter covers both families; UDP and ICMP over IPv6 count theirs in /proc/net/snmp6."""

ARRIVALS_TABLE = "lab_arrivals"
"""The nftables table of `Lab.count_arrivals`."""

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


@dataclass
class Traffic:
    """What `Lab.under_traffic` saw."""

    held: dict[str, Any] = field(default_factory=dict)
    """traffic.talk's summary: connections, opened, broken (why each), exchanges, max_gap_ms."""
    probes: list[ProbeResult] = field(default_factory=list)

    @property
    def failures(self) -> dict[str, int]:
        """New connections that failed, by error."""
        out: dict[str, int] = {}
        for r in self.probes:
            for error, n in r["errors"].items():
                out[error] = out.get(error, 0) + n
        return out

    @property
    def count(self) -> int:
        return sum(r["count"] for r in self.probes)


class LabError(RuntimeError):
    """A lab command failed; the message carries the command and its stderr."""


@dataclass(frozen=True, slots=True)
class Backend:
    index: int
    name: str
    """Short name, `b1`, `b2`, ...: what the traffic server answers with."""
    ns: str
    """The namespace's full name."""
    ip: str
    node_ip: str
    """The node's address on this link: the backend's default gateway."""
    node_ifname: str
    """The node-side interface of this backend's veth pair."""


def backend_ip(index: int) -> str:
    """Backend `index`'s address; fixed, so manifests written ahead of time match the lab."""
    return f"10.201.{index}.2"


def conf_key(ifname: str, setting: str) -> str:
    """sysctl's key of an IPv4 setting of one device, '/'-separated: a VLAN device's name holds a dot
    (to-client.100), which the dotted form would read as a separator."""
    return f"net/ipv4/conf/{ifname}/{setting}"


def ipv6_of(ipv4: str) -> str:
    """The lab's IPv6 address beside an IPv4 one: 10.A.B.C -> fd00:10:A:B::C (each link's /24 a /64), in
    canonical form, so a case names both families of a role alike (10.200.0.2 -> fd00:10:200::2)."""
    a, b, c, d = ipv4.split(".")
    return str(ipaddress.IPv6Address(f"fd00:{a}:{b}:{c}::{d}"))


def remote_backend_ip(index: int) -> str:
    """Remote pod `index`'s address (behind node2); fixed like backend_ip()."""
    return f"10.202.{index}.2"


# ------------------------------------------------------------------------------------------------- commands


def missing_stack_driver(stack: str) -> str | None:
    """Why this kernel cannot build `client_stack=stack` (None when it can): the stack's driver (STACK_DRIVERS) is
    built in or loaded, or is loaded here (modprobe) when the kernel has it as a module."""
    module = STACK_DRIVERS.get(stack)
    if module is None or _DRIVER_PRESENT[module].exists():
        return None
    if shutil.which("modprobe") is not None:
        run(["modprobe", "-q", module, *_MODPROBE_ARGS.get(module, ())], check=False)
    if _DRIVER_PRESENT[module].exists():
        return None
    return f"kernel {os.uname().release} has no {module} driver (client_stack={stack!r}) and modprobe cannot load it"


def python_env() -> dict[str, str]:
    """The environment for `python -m labkit...` or `-m pyproxy...` inside a namespace: this process's, with this
    pyproxy and this lab on the path (an `ip netns exec` child inherits the environment, but need not share our
    working directory)."""
    here = Path(__file__).resolve()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here.parents[2]), str(here.parents[1]),
                                                    env.get("PYTHONPATH", "")) if p)
    return env


def run(argv: Sequence[str], *, check: bool = True, timeout: float = DEFAULT_TIMEOUT,
        input: str | None = None, env: Mapping[str, str] | None = None,
        cgroup: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion within `timeout` seconds; LabError with its stderr when it fails. With
    `cgroup`, the command runs in that cgroup v2 directory from its first instruction."""
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input,
                            env=None if env is None else dict(env),
                            preexec_fn=None if cgroup is None else _joiner(cgroup))
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"timed out after {timeout:g}s: {shlex.join(argv)}") from exc
    except OSError as exc:
        raise LabError(f"cannot run {shlex.join(argv)}: {exc}") from exc
    if check and cp.returncode != 0:
        raise LabError(f"{shlex.join(argv)} exited {cp.returncode}: {(cp.stderr or cp.stdout).strip()}")
    return cp


class NetnsThread:
    """One thread of this process that has entered an `ip netns` namespace (setns affects only the calling
    thread; the sockets it opens, and the packets a BPF test run makes, are in that namespace)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{netns}", initializer=self._enter)

    def _enter(self) -> None:
        with open(f"/run/netns/{self.netns}") as f:
            if _libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in that thread: its result, or its exception."""
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def scratch_node(prefix: str, links: Sequence[tuple[str, str]],
                 routes: Sequence[tuple[str, str, str]] = ()) -> Iterator[tuple[NetnsThread, dict[str, int]]]:
    """A private network namespace set up as a node, and a thread inside it: forwarding on, one veth per
    `links` entry (device, its address/prefix; the peer end up and unaddressed: this kernel has no dummy
    devices), `routes` (network, via, device). Yields the thread and each device's ifindex; the namespace is
    deleted on exit, whatever happens. For driving BPF test runs whose route lookups (SNAT's) must see a
    node's routing, not the machine's."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    run(["ip", "netns", "add", name])
    thread = None
    try:
        run(["ip", "-n", name, "link", "set", "lo", "up"])
        run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        for dev, cidr in links:
            run(["ip", "-n", name, "link", "add", dev, "type", "veth", "peer", "name", f"{dev}-p"])
            run(["ip", "-n", name, "addr", "add", cidr, "dev", dev])
            run(["ip", "-n", name, "link", "set", f"{dev}-p", "up"])
            run(["ip", "-n", name, "link", "set", dev, "up"])
        for net, via, dev in routes:
            run(["ip", "-n", name, "route", "add", net, "via", via, "dev", dev])
        ifindex = {dev: int(json.loads(run(["ip", "-n", name, "-j", "link", "show", dev]).stdout)[0]["ifindex"])
                   for dev, _ in links}
        thread = NetnsThread(name)
        yield thread, ifindex
    finally:
        if thread is not None:
            thread.close()
        run(["ip", "netns", "del", name], check=False)


def _joiner(cgroup: Path) -> Callable[[], None]:
    """A preexec_fn that moves the child into `cgroup` before it execs (`ip netns exec` keeps the cgroup)."""
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    return join


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test runner dies, even by SIGKILL, its servers and
    # pyproxy get SIGTERM instead of living on. It survives `ip netns exec`'s exec (ip is not setuid).
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _process_starttime(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a live owner from a new process that reused its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def list_namespaces() -> list[str]:
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str) -> None:
    # Only ever our own uniquely named namespaces: whatever runs there was started by a lab.
    for pid in run(["ip", "netns", "pids", ns], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_pids(ns)
    run(["ip", "netns", "del", ns])


def _remove_tree(path: Path) -> None:
    # Works on bpffs too: pins unlink, directories rmdir.
    if path.exists():
        shutil.rmtree(path)


@contextlib.contextmanager
def _run_dir_lock() -> Iterator[None]:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _is_mounted(path: Path, fstype: str) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[4] == target and fields[sep + 1] == fstype:
                return True
    return False


def _ensure_mount(path: Path, fstype: str) -> Path:
    with _run_dir_lock():
        if not _is_mounted(path, fstype):
            path.mkdir(parents=True, exist_ok=True)
            run(["mount", "-t", fstype, fstype, str(path)])
    return path


def ensure_bpffs() -> Path:
    """Mount the labs' shared bpffs at BPFFS_DIR unless it is there already; returns BPFFS_DIR."""
    return _ensure_mount(BPFFS_DIR, "bpf")


def ensure_cgroup2() -> Path:
    """Mount the cgroup v2 hierarchy at CGROUP_DIR unless it is there already; returns CGROUP_DIR."""
    return _ensure_mount(CGROUP_DIR, "cgroup2")


def _remove_cgroup(path: Path, deadline: float = 5.0) -> None:
    """Remove a lab's cgroup once its processes are gone (a cgroup with members cannot be removed)."""
    end = time.monotonic() + deadline
    while path.exists():
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def reap_stale_labs() -> list[str]:
    """Remove namespaces, pins and markers of labs whose owning process is gone; returns their ids.

    A Lab writes a marker (owner pid and start time) before it creates anything, so only labs of dead owners
    are touched, never those of a live parallel run."""
    reaped: list[str] = []
    if not MARKER_DIR.is_dir():
        return reaped
    for marker in MARKER_DIR.glob("*.json"):
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if _process_starttime(owner["pid"]) == owner["starttime"]:
            continue
        lab_id = marker.stem
        for ns in list_namespaces():
            if ns.startswith(lab_id + "-"):
                with contextlib.suppress(LabError):
                    _delete_namespace(ns)
        with contextlib.suppress(OSError):
            _remove_tree(BPFFS_DIR / lab_id)
        with contextlib.suppress(OSError):
            _remove_cgroup(CGROUP_DIR / lab_id, 0.0)
        marker.unlink(missing_ok=True)
        reaped.append(lab_id)
    return reaped


# ------------------------------------------------------------------------------------------------- the lab


class Lab:
    """client <-> node <-> backends in network namespaces; a context manager that always tears down.

    `distro=True` makes the node look like a stock distribution: strict (or, with rp_filter=2, loose) reverse
    path filtering on all, default and every interface, a default route via an extra uplink namespace, and
    `iptables -A FORWARD -m conntrack --ctstate INVALID -j DROP`. `csum_offload=False` (the default) turns off
    tx checksum offload on the client's and backends' veth ends: their packets then carry full checksums, and
    a checksum left wrong by NAT is verified and counted by the receiver (pitfall 3), see `checksum_errors()`.
    `router="client"|"backends"` puts a router namespace between the node and that side (see the module's
    docstring), its link to the node at `router_mtu`; a Backend's `node_ip`/`node_ifname` are then the router's.
    `client_stack="bridge"|"macvlan"|"vlan"|"bond"` puts the node's client-facing address on a device stacked over
    the client's veth, and `pod_bridge=True` makes the backends ports of a bridge (both in the module's docstring).
    `pods_in_cgroup=True` runs the node's pods' commands in the lab's cgroup, as a node has them (`exec`).
    """

    def __init__(self, backends: int = 3, *, prefix: str = "pyp", distro: bool = False,
                 csum_offload: bool = False, rp_filter: int = 1, router: str | None = None,
                 router_mtu: int | None = None, remote_backends: int = 0, second_client: bool = False,
                 client_addresses: int = 0, ipv6: bool = False, client_stack: str | None = None,
                 pod_bridge: bool = False, pods_in_cgroup: bool = False) -> None:
        if not 0 <= backends <= MAX_BACKENDS or not 0 <= remote_backends <= MAX_BACKENDS:
            raise ValueError(f"backends and remote_backends must be 0..{MAX_BACKENDS}")
        if router is not None and (remote_backends or second_client):
            # Both would need their own routes through the router: not built, so refused rather than half-wired.
            raise ValueError("a router does not combine with remote_backends or second_client")
        if ipv6 and (router is not None or remote_backends or second_client):
            raise ValueError("ipv6 is built for the client, the backends and the uplink only")
        if not 0 <= client_addresses <= MAX_CLIENT_ADDRESSES:
            raise ValueError(f"client_addresses must be 0..{MAX_CLIENT_ADDRESSES}")
        if rp_filter not in (0, 1, 2):
            raise ValueError("rp_filter must be 0, 1 or 2")
        if router is not None and router not in ROUTER_SIDES:
            raise ValueError(f"router must be one of {ROUTER_SIDES} or None")
        if router_mtu is not None and (router is None or not 576 <= router_mtu <= 65535):
            raise ValueError("router_mtu needs a router and must be 576..65535")
        if client_stack is not None and client_stack not in CLIENT_STACKS:
            raise ValueError(f"client_stack must be one of {CLIENT_STACKS} or None")
        if client_stack is not None and router == "client":
            raise ValueError("client_stack stacks the node's own client link, which router='client' replaces")
        if client_stack == "vlan" and client_addresses:
            raise ValueError("client_addresses are not built on the client's VLAN")
        if pod_bridge and router == "backends":
            raise ValueError("pod_bridge bridges the node's own backend links, which router='backends' replaces")
        self.client_stack = client_stack
        """The device holding the node's client-facing address: a bridge over the client's veth, a macvlan, a VLAN
        or a bond over it, or (None) the veth itself."""
        self.pod_bridge = pod_bridge
        """The backends are ports of the bridge POD_BRIDGE, their gateway, in one subnet."""
        self.pods_in_cgroup = pods_in_cgroup
        """The node's pods' commands (`exec` in a backend's namespace) run in the lab's cgroup, beside the node's
        own, as every pod's containers run below a real node's root cgroup: pyproxy's socket hooks see them. Off,
        only the node's commands do, and a pod's traffic always takes the packet path (its veth's TC). Outside
        clients and other nodes' pods are never in it."""
        self.router_side = router
        """Which side of the node the router namespace is on: "client", "backends" or None (no router)."""
        self.router_mtu = router_mtu
        self.prefix = prefix
        self.distro = distro
        self.csum_offload = csum_offload
        self.rp_filter = rp_filter
        self._initial_backends = backends
        self._initial_remote = remote_backends
        self.second_client = second_client
        self.client_addresses = client_addresses
        self.ipv6 = ipv6
        """Every link has IPv6 addresses beside its IPv4 ones (`ipv6_of`)."""
        self.id = ""
        self._backends: list[Backend] = []
        self._remote: list[Backend] = []
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._servers: dict[str, subprocess.Popen[bytes]] = {}
        self._server_ports: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._workdir: Path | None = None
        self._started = False
        self._closed = False
        self.teardown_errors: list[str] = []

    # ---- names

    def _ns(self, role: str) -> str:
        return f"{self.id}-{role}"

    @property
    def node(self) -> str:
        return self._ns("node")

    @property
    def client(self) -> str:
        return self._ns("client")

    @property
    def uplink(self) -> str | None:
        return self._ns("uplink") if self.distro and not self._initial_remote else None

    @property
    def node2(self) -> str | None:
        """The second node's namespace (remote_backends > 0), else None."""
        return self._ns("node2") if self._initial_remote else None

    @property
    def client2(self) -> str | None:
        """The second client's namespace (second_client=True), else None."""
        return self._ns("client2") if self.second_client else None

    @property
    def router(self) -> str | None:
        return self._ns("router") if self.router_side else None

    @property
    def backends(self) -> list[Backend]:
        """The pods of the node (the one running pyproxy)."""
        return list(self._backends)

    @property
    def remote_backends(self) -> list[Backend]:
        """The pods behind node2 (`node_ip`/`node_ifname` are node2's address and interface on their link)."""
        return list(self._remote)

    @property
    def namespaces(self) -> list[str]:
        return list(self._namespaces)

    @property
    def client_ip(self) -> str:
        return CLIENT_IP

    @property
    def client_ips(self) -> list[str]:
        """Every address of the client: `client_ip` first, then the `client_addresses` more."""
        base = ipaddress.IPv4Address(CLIENT_IP)
        return [str(base + i) for i in range(self.client_addresses + 1)]

    @property
    def node_client_ifname(self) -> str:
        """The node's client-facing interface (where ClusterIP traffic enters the node): the device holding its
        address on the client's link, stacked (client_stack) or not."""
        if self.router_side == "client":
            return NODE_ROUTER_IFNAME
        return {"bridge": NODE_CLIENT_BRIDGE, "macvlan": NODE_CLIENT_MACVLAN, "vlan": NODE_CLIENT_VLAN,
                "bond": NODE_CLIENT_BOND}.get(self.client_stack or "", NODE_CLIENT_IFNAME)

    @property
    def client_ifname(self) -> str:
        """The client's device holding its address: eth0, or with client_stack="vlan" the VLAN over it."""
        return f"{PEER_IFNAME}.{CLIENT_VLAN_ID}" if self.client_stack == "vlan" else PEER_IFNAME

    @property
    def node_client_lower_ifname(self) -> str:
        """The node's end of the client's link, the NIC-like device: with client_stack, the veth under
        `node_client_ifname` (the bridge's port, the macvlan's or the VLAN's lower device, the bond's slave); else
        `node_client_ifname` itself."""
        return NODE_CLIENT_IFNAME if self.client_stack else self.node_client_ifname

    @property
    def node_ifnames(self) -> list[str]:
        """Every interface of the node except lo, the devices stacked over others and those under them alike."""
        backend_side = ([NODE_ROUTER_IFNAME] if self.router_side == "backends"
                        else [POD_BRIDGE] * self.pod_bridge + [b.node_ifname for b in self._backends])
        names = [self.node_client_ifname] + [NODE_CLIENT_IFNAME] * bool(self.client_stack) + backend_side
        names += [NODE_CLIENT2_IFNAME] if self.second_client else []
        names += [NODE_NODE2_IFNAME] if self.node2 else []
        return (names + [NODE_UPLINK_IFNAME]) if self.uplink else names

    @property
    def pin_path(self) -> str:
        """A bpffs path unique to this lab, for `--bpf-pin-path`; the lab removes whatever is left there."""
        return str(BPFFS_DIR / self.id)

    @property
    def cgroup(self) -> Path:
        """A cgroup v2 directory unique to this lab, for `--cgroup-root`: the socket hooks act on its processes."""
        return CGROUP_DIR / self.id

    @property
    def workdir(self) -> Path:
        """A scratch directory removed at teardown."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        return self._workdir

    def _resolve(self, ns: str) -> str:
        """Accept a full namespace name or a role (`node`, `client`, `uplink`, `b1`, ...)."""
        return ns if ns in self._namespaces else self._ns(ns)

    def _role(self, ns: str) -> str:
        return ns.removeprefix(self.id + "-")

    # ---- lifecycle

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> Lab:
        if self._started:
            raise LabError("lab already started")
        if self.client_stack is not None and (missing := missing_stack_driver(self.client_stack)):
            raise LabError(missing)
        self._started = True
        try:
            self._claim_id()
            ensure_bpffs()
            ensure_cgroup2()
            self.cgroup.mkdir()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _claim_id(self) -> None:
        with contextlib.suppress(LabError, OSError):
            reap_stale_labs()
        MARKER_DIR.mkdir(parents=True, exist_ok=True)
        existing = set(list_namespaces())
        while True:
            self.id = f"{self.prefix}-{secrets.token_hex(2)}"
            marker = MARKER_DIR / f"{self.id}.json"
            if any(ns.startswith(self.id + "-") for ns in existing):
                continue
            try:
                # O_EXCL: two labs drawing the same id at the same moment cannot both claim it.
                with open(marker, "x") as f:
                    pid = os.getpid()
                    json.dump({"pid": pid, "starttime": _process_starttime(pid)}, f)
            except FileExistsError:
                continue
            return

    def _add_ns(self, role: str) -> str:
        ns = self._ns(role)
        run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.ipv6:
            # No duplicate address detection on the devices made here, their link-local addresses included:
            # while one is tentative (a second), neighbour discovery through it waits, and a first flow with it.
            self.sysctl(ns, {"net.ipv6.conf.all.accept_dad": 0, "net.ipv6.conf.default.accept_dad": 0})
        return ns

    def _address(self, ns: str, dev: str, cidr: str, prefix6: int = 64) -> None:
        """`cidr` on `dev` in `ns`, and with `ipv6` its IPv6 twin (ipv6_of) with `prefix6`."""
        run(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])
        if self.ipv6:
            run(["ip", "-n", ns, "addr", "add", f"{ipv6_of(cidr.split('/')[0])}/{prefix6}", "dev", dev, "nodad"])

    def _node_device(self, name: str, cidr: str, *create: str, prefix6: int = 64) -> None:
        """A device of the node made by `ip link add NAME CREATE...` (a bridge, a macvlan), addressed and up."""
        run(["ip", "-n", self.node, "link", "add", name, *create])
        if self.distro:
            self.sysctl(self.node, {conf_key(name, "rp_filter"): self.rp_filter})
        self._address(self.node, name, cidr, prefix6)
        run(["ip", "-n", self.node, "link", "set", name, "up"])

    def _link(self, node_ifname: str, peer_ns: str, node_cidr: str | None, peer_cidr: str, gateway: str | None, *,
              upstream: str | None = None, mtu: int | None = None, master: str | None = None,
              prefix6: int = 64, peer_vlan: int | None = None) -> None:
        """A veth pair node:node_ifname <-> peer_ns:eth0, addressed and up; the peer's default route goes via
        `gateway` (None: no default route). `upstream` puts the first end in that namespace (a router, node2)
        instead of the node; `mtu` sets both ends'. `node_cidr` None leaves the first end unaddressed, `master`
        makes it a port of that bridge (or a slave of that bond); `prefix6` is the IPv6 addresses' prefix length.
        `peer_vlan` puts the peer's address on a VLAN of that id over its eth0 (eth0.ID), eth0 holding none."""
        up = self.node if upstream is None else upstream
        if len(node_ifname) > IFNAMSIZ:
            raise LabError(f"interface name too long: {node_ifname}")
        # Created directly inside the namespaces: no temporary name in the host namespace to collide on.
        run(["ip", "-n", up, "link", "add", node_ifname, "type", "veth", "peer", "name", PEER_IFNAME,
             "netns", peer_ns])
        if master is not None:
            run(["ip", "-n", up, "link", "set", node_ifname, "master", master])
        if mtu is not None:
            run(["ip", "-n", up, "link", "set", node_ifname, "mtu", str(mtu)])
            run(["ip", "-n", peer_ns, "link", "set", PEER_IFNAME, "mtu", str(mtu)])
        if self.distro and up == self.node:
            # Before the address: strict filtering from the first packet, also on devices added later.
            self.sysctl(self.node, {conf_key(node_ifname, "rp_filter"): self.rp_filter})
        if node_cidr is not None:
            self._address(up, node_ifname, node_cidr, prefix6)
        peer_devs = [PEER_IFNAME]
        if peer_vlan is not None:
            peer_devs.append(f"{PEER_IFNAME}.{peer_vlan}")
            run(["ip", "-n", peer_ns, "link", "add", "link", PEER_IFNAME, "name", peer_devs[-1], "type", "vlan",
                 "id", str(peer_vlan)])
        self._address(peer_ns, peer_devs[-1], peer_cidr, prefix6)
        for dev in peer_devs:
            if not self.csum_offload and peer_ns != self.uplink:
                # Full checksums on the wire, so the receiver verifies (and counts) what NAT did (pitfall 3).
                self.exec(peer_ns, "ethtool", "-K", dev, "tx", "off")
        run(["ip", "-n", up, "link", "set", node_ifname, "up"])
        for dev in peer_devs:
            run(["ip", "-n", peer_ns, "link", "set", dev, "up"])
        if gateway is not None:
            run(["ip", "-n", peer_ns, "route", "add", "default", "via", gateway])
            if self.ipv6:
                run(["ip", "-n", peer_ns, "-6", "route", "add", "default", "via", ipv6_of(gateway)])

    def _build(self) -> None:
        self._add_ns("node")
        self.sysctl(self.node, {"net.ipv4.ip_forward": 1})
        if self.ipv6:
            self.sysctl(self.node, {"net.ipv6.conf.all.forwarding": 1})
        if self.distro:
            self.sysctl(self.node, {"net.ipv4.conf.all.rp_filter": self.rp_filter,
                                    "net.ipv4.conf.default.rp_filter": self.rp_filter,
                                    "net.ipv4.conf.lo.rp_filter": self.rp_filter})
            # conntrack in the node: a NAT that leaves flows looking invalid to it gets them dropped, as on a
            # distribution.
            self.exec(self.node, "iptables", "-w", "5", "-A", "FORWARD", "-m", "conntrack", "--ctstate",
                      "INVALID", "-j", "DROP")
        if self.router_side:
            router = self._add_ns("router")
            self.sysctl(router, {"net.ipv4.ip_forward": 1})
            self._link(NODE_ROUTER_IFNAME, router, f"{NODE_ROUTER_IP}/24", f"{ROUTER_IP}/24", NODE_ROUTER_IP,
                       mtu=self.router_mtu)
            behind = "10.200.0.0/24" if self.router_side == "client" else "10.201.0.0/16"
            run(["ip", "-n", self.node, "route", "add", behind, "via", ROUTER_IP])
        if self.client_stack in ("bridge", "macvlan") or self.pod_bridge:
            # As a kubeadm node has it (and this kernel's default): bridged frames pass iptables/nftables too.
            self.sysctl(self.node, {"net.bridge.bridge-nf-call-iptables": 1, "net.bridge.bridge-nf-call-ip6tables": 1})
        self._add_ns("client")
        if self.client_stack == "bridge":
            self._node_device(NODE_CLIENT_BRIDGE, f"{NODE_CLIENT_IP}/24", "type", "bridge")
        if self.client_stack == "bond":
            self._node_device(NODE_CLIENT_BOND, f"{NODE_CLIENT_IP}/24", "type", "bond", "mode", "active-backup",
                              "miimon", "100")
        client_cidr = None if self.client_stack else f"{NODE_CLIENT_IP}/24"
        self._link(NODE_CLIENT_IFNAME, self.client, client_cidr, f"{CLIENT_IP}/24", NODE_CLIENT_IP,
                   upstream=self.router if self.router_side == "client" else None,
                   master={"bridge": NODE_CLIENT_BRIDGE, "bond": NODE_CLIENT_BOND}.get(self.client_stack or ""),
                   peer_vlan=CLIENT_VLAN_ID if self.client_stack == "vlan" else None)
        if self.client_stack == "vlan":
            self._node_device(NODE_CLIENT_VLAN, f"{NODE_CLIENT_IP}/24", "link", NODE_CLIENT_IFNAME, "type", "vlan",
                              "id", str(CLIENT_VLAN_ID))
        if self.client_stack == "macvlan":
            self._node_device(NODE_CLIENT_MACVLAN, f"{NODE_CLIENT_IP}/24", "link", NODE_CLIENT_IFNAME, "type",
                              "macvlan", "mode", "bridge")
            # The lower device answers ARP for its own addresses only (none), so the client resolves the node's
            # address to the macvlan's MAC and its frames are the macvlan's. With the default, 0, the lower device
            # answers too, and a client that takes its MAC sends frames the macvlan never sees (measured: about
            # half the labs). `Lab.send_to_lower_device` makes the client do so.
            self.sysctl(self.node, {conf_key(NODE_CLIENT_IFNAME, "arp_ignore"): 1})
        for ip in self.client_ips[1:]:
            run(["ip", "-n", self.client, "addr", "add", f"{ip}/24", "dev", PEER_IFNAME])
        if self.second_client:
            self._link(NODE_CLIENT2_IFNAME, self._add_ns("client2"), f"{NODE_CLIENT2_IP}/24", f"{CLIENT2_IP}/24",
                       NODE_CLIENT2_IP)
        if self.uplink:
            uplink = self._add_ns("uplink")
            self._link(NODE_UPLINK_IFNAME, uplink, f"{NODE_UPLINK_IP}/24", f"{UPLINK_IP}/24", NODE_UPLINK_IP)
            # The node's default route leaves through the uplink, as a real node's does: traffic the dataplane
            # does not translate goes there, not back to the client.
            run(["ip", "-n", self.node, "route", "add", "default", "via", UPLINK_IP])
            if self.ipv6:
                run(["ip", "-n", self.node, "-6", "route", "add", "default", "via", ipv6_of(UPLINK_IP)])
        if self.pod_bridge:
            self._node_device(POD_BRIDGE, f"{POD_GATEWAY_IP}/{POD_PREFIX}", "type", "bridge", prefix6=POD_PREFIX6)
        for _ in range(self._initial_backends):
            self._add_backend()
        if self.node2:
            self._build_node2()

    def _build_node2(self) -> None:
        node2 = self._add_ns("node2")
        self.sysctl(node2, {"net.ipv4.ip_forward": 1})
        # No default route on node2: whatever it must send to an address it has no route for dies there.
        self._link(NODE_NODE2_IFNAME, node2, f"{NODE_NODE2_IP}/24", f"{NODE2_IP}/24", None)
        run(["ip", "-n", node2, "route", "add", "10.201.0.0/16", "via", NODE_NODE2_IP])
        run(["ip", "-n", self.node, "route", "add", "10.202.0.0/16", "via", NODE2_IP])
        # The node network is where the node's default route leads (see the module's docstring).
        run(["ip", "-n", self.node, "route", "add", "default", "via", NODE2_IP])
        for index in range(1, self._initial_remote + 1):
            name = f"r{index}"
            pod = Backend(index=index, name=name, ns=self._add_ns(name), ip=remote_backend_ip(index),
                          node_ip=f"10.202.{index}.1", node_ifname=f"to-{name}")
            self._link(pod.node_ifname, pod.ns, f"{pod.node_ip}/24", f"{pod.ip}/24", pod.node_ip, upstream=node2)
            self._remote.append(pod)

    def _add_backend(self) -> Backend:
        index = len(self._backends) + 1
        if index > MAX_BACKENDS:
            raise LabError(f"at most {MAX_BACKENDS} backends")
        name = f"b{index}"
        ns = self._add_ns(name)
        if self.pod_bridge:
            backend = Backend(index=index, name=name, ns=ns, ip=backend_ip(index), node_ip=POD_GATEWAY_IP,
                              node_ifname=f"to-{name}")
            self._link(backend.node_ifname, ns, None, f"{backend.ip}/{POD_PREFIX}", backend.node_ip,
                       master=POD_BRIDGE, prefix6=POD_PREFIX6)
            self._backends.append(backend)
            return backend
        backend = Backend(index=index, name=name, ns=ns, ip=backend_ip(index), node_ip=f"10.201.{index}.1",
                          node_ifname=f"to-{name}")
        self._link(backend.node_ifname, ns, f"{backend.node_ip}/24", f"{backend.ip}/24", backend.node_ip,
                   upstream=self.router if self.router_side == "backends" else None)
        self._backends.append(backend)
        return backend

    def add_backend(self) -> Backend:
        """One more backend namespace and node interface, after start; it runs the servers the others run."""
        if not self._started or self._closed:
            raise LabError("lab not running")
        backend = self._add_backend()
        if self._server_ports is not None:
            self.start_servers(*self._server_ports, backends=[backend])
        return backend

    def close(self) -> list[str]:
        """Tear everything down; every step runs even if an earlier one failed. Returns the failures (also
        logged). A KeyboardInterrupt during teardown does not cut it short: it is re-raised at the end."""
        if self._closed:
            return self.teardown_errors
        self._closed = True
        interrupted: KeyboardInterrupt | None = None

        def step(what: str, fn: Callable[..., object], *args: Any) -> None:
            nonlocal interrupted
            try:
                fn(*args)
            except KeyboardInterrupt as exc:
                interrupted = exc
            except Exception as exc:  # noqa: BLE001 - collected and logged; the next step must still run
                self.teardown_errors.append(f"{what}: {exc}")
                log.warning("lab %s teardown: %s: %s", self.id, what, exc)

        step("stop processes", self._stop_processes)
        for ns in reversed(self._namespaces):
            step(f"delete namespace {ns}", _delete_namespace, ns)
        if self.id:
            # Pins first: unpinning pyproxy's socket-hook links detaches them from the lab's cgroup.
            step("remove pins", _remove_tree, Path(self.pin_path))
            step("remove cgroup", _remove_cgroup, self.cgroup)
            step("remove marker", (MARKER_DIR / f"{self.id}.json").unlink, True)
        if self._workdir is not None:
            step("remove workdir", _remove_tree, self._workdir)
        if interrupted is not None:
            raise interrupted
        return self.teardown_errors

    def _stop_processes(self, grace: float = 3.0) -> None:
        procs = [p for p in self._procs if p.poll() is None]
        for p in procs:
            # Each was started in its own session: the group also holds anything it spawned.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=grace)
        for p in self._procs:
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        self._servers.clear()

    # ---- running things in namespaces

    def exec(self, ns: str, *argv: str, check: bool = True, timeout: float = DEFAULT_TIMEOUT,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        """`ip netns exec NS argv...` to completion (bounded by `timeout`); LabError on failure if `check`.
        In the node's namespace the command also runs in the lab's cgroup, as the node's own processes:
        where pyproxy's socket hooks act (--cgroup-root); with `pods_in_cgroup`, in a pod's of this node too."""
        ns = self._resolve(ns)
        return run(["ip", "netns", "exec", ns, *argv], check=check, timeout=timeout, input=input, env=python_env(),
                   cgroup=self.cgroup if self.in_cgroup(ns) else None)

    def in_cgroup(self, ns: str) -> bool:
        """Whether `exec` runs a command of `ns` (a name or a role) in the lab's cgroup: the node's, and with
        `pods_in_cgroup` its pods'."""
        ns = self._resolve(ns)
        return ns == self.node or (self.pods_in_cgroup and any(b.ns == ns for b in self._backends))

    def popen(self, ns: str, *argv: str, client: bool = False, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `ip netns exec NS argv...` in the background; the lab terminates it at teardown at the
        latest. It gets its own session (so teardown can signal its whole group) and gets SIGTERM when the
        calling *thread* ends (PR_SET_PDEATHSIG): call it from the main thread or a thread that outlives it.
        `client`: a client process, placed as `exec` places one (in the lab's cgroup where `ns` is a namespace
        whose processes are inside it); servers and pyproxy itself stay where they were started."""
        kwargs.setdefault("env", python_env())
        ns = self._resolve(ns)
        join = _joiner(self.cgroup) if client and self.in_cgroup(ns) else None

        def preexec() -> None:
            _die_with_parent()
            if join is not None:
                join()

        proc: subprocess.Popen[Any] = subprocess.Popen(  # noqa: S603
            ["ip", "netns", "exec", ns, *argv], start_new_session=True, preexec_fn=preexec, **kwargs)
        self._procs.append(proc)
        return proc

    def python(self, ns: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """This Python (`sys.executable`) with `args`, inside `ns`."""
        return self.exec(ns, sys.executable, *args, **kwargs)

    def sysctl(self, ns: str, settings: Mapping[str, int | str]) -> None:
        self.exec(ns, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items()))

    # ---- traffic

    def start_servers(self, tcp: Iterable[int] = (), udp: Iterable[int] = (),
                      backends: Iterable[Backend] | None = None, timeout: float = 10.0) -> None:
        """Run the traffic server in each backend (all by default, remote pods too) on these ports; returns once
        all listen.

        Backends added later with add_backend() get the same servers."""
        tcp_ports, udp_ports = tuple(tcp), tuple(udp)
        self._server_ports = (tcp_ports, udp_ports)
        targets = list(self._backends + self._remote if backends is None else backends)
        started = []
        for b in targets:
            if b.name in self._servers:
                self.stop_servers([b])
            # stdin stays an open pipe: the server exits on its EOF, i.e. when this process is gone.
            proc = self.popen(b.ns, sys.executable, "-m", "labkit.traffic", "serve", "--name", b.name,
                              "--tcp", ",".join(map(str, tcp_ports)), "--udp", ",".join(map(str, udp_ports)),
                              *(["--bind6", "::"] if self.ipv6 else []),
                              "--exit-on-stdin-eof", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
            self._servers[b.name] = proc
            started.append((b, proc))
        # Started all at once, then waited for: the Python start-ups overlap.
        end = time.monotonic() + timeout
        for b, proc in started:
            assert proc.stdout is not None and proc.stderr is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
            line = proc.stdout.readline().decode().strip() if ready else ""
            if line != READY_LINE:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=5)
                err = proc.stderr.read().decode(errors="replace").strip()
                raise LabError(f"server in {b.name} did not start (rc={proc.returncode}): {err[-2000:]}")

    def stop_servers(self, backends: Iterable[Backend] | None = None) -> None:
        names = [b.name for b in (self._backends + self._remote if backends is None else backends)]
        for name in names:
            proc = self._servers.pop(name, None)
            if proc is None:
                continue
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def probe(self, proto: str, ip: str, port: int, count: int = 20, *, timeout: float = 1.0,
              deadline: float | None = None, interval: float = 0.0, ns: str | None = None,
              max_failures: int | None = None, sources: Sequence[str] = (),
              source_ports: Sequence[int] = ()) -> ProbeResult:
        """Send `count` requests (a new TCP connection / UDP socket each) from the client (or `ns`) to
        ip:port, stopping after `max_failures` failed ones if given; from the `sources` addresses and
        `source_ports` in turn (traffic.probe), each request's answer in the result's `by_source`.
        Returns {"replies": {"b1:8080": n, ...}, "failures": k, "errors": {...}, ...}."""
        if proto not in ("tcp", "udp"):
            raise ValueError("proto must be tcp or udp")
        if deadline is None:
            deadline = min(60.0, count * timeout + 5.0)
        out = self.python(self.client if ns is None else ns, "-m", "labkit.traffic", "probe",
                          f"--{proto}", ip, str(port), "--count", str(count), "--timeout", str(timeout),
                          "--deadline", str(deadline), "--interval", str(interval),
                          *([] if max_failures is None else ["--max-failures", str(max_failures)]),
                          *(["--sources", ",".join(sources)] if sources else []),
                          *(["--source-ports", ",".join(map(str, source_ports))] if source_ports else []),
                          timeout=deadline + 15.0).stdout
        result: ProbeResult = json.loads(out)
        return result

    @contextlib.contextmanager
    def under_traffic(self, held: Sequence[tuple[str, int]], probed: Sequence[tuple[str, int]], *,
                      connections: int = 6, timeout: float = 3.0) -> Iterator[Traffic]:
        """While the block runs (a restart, say): `connections` long-lived TCP connections from the client over
        `held` exchanging a line every 100 ms (traffic.talk), and new TCP connections to `probed` in turn, 10
        at a time. After it, the result's `held` is talk's summary (broken ones named) and `probes` every
        probe's result."""
        talk = self.popen(self.client, sys.executable, "-m", "labkit.traffic", "talk",
                          ",".join(f"{ip}:{port}" for ip, port in held), "--count", str(connections),
                          "--timeout", str(timeout), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert talk.stdout is not None and talk.stdin is not None
        opened = json.loads(talk.stdout.readline())
        if opened["opened"] != connections:
            talk.kill()
            raise LabError(f"only {opened['opened']} of {connections} long-lived connections opened: {opened}")
        out = Traffic()
        stop = threading.Event()

        def new_connections() -> None:
            while not stop.is_set():
                for ip, port in probed:
                    out.probes.append(self.probe("tcp", ip, port, 10, timeout=timeout))

        thread = threading.Thread(target=new_connections)
        thread.start()
        try:
            yield out
        finally:
            stop.set()
            thread.join(timeout=120)
            talk.stdin.close()
            out.held = json.loads(talk.stdout.readline())

    def http_get(self, ns: str, url: str, *, timeout: float = 2.0, wait: float = 0.0,
                 expect: int | None = None) -> HttpResult:
        """GET `url` from inside `ns`; with `wait` and `expect`, poll until it answers `expect` (bounded)."""
        args = ["-m", "labkit.traffic", "http", url, "--timeout", str(timeout)]
        if wait and expect is not None:
            args += ["--wait", str(wait), "--expect", str(expect)]
        out = self.python(ns, *args, check=False, timeout=wait + timeout + 15.0).stdout
        result: HttpResult = json.loads(out)
        return result

    # ---- observation

    def checksum_errors(self, namespaces: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
        """Checksum error counters per namespace, {role: {TcpInCsumErrors: n, ...}}, of the clients, the
        backends, the node (and the router, node2 and its pods), read from /proc/net/snmp and /proc/net/netstat
        inside each."""
        extra = [ns for ns in (self.router, self.client2, self.node2) if ns]
        targets = (list(namespaces) if namespaces is not None
                   else [self.client, *(b.ns for b in self._backends + self._remote), self.node, *extra])
        result = {}
        for ns in targets:
            counters = self.net_counters(ns)
            result[self._role(self._resolve(ns))] = {k: counters.get(k, 0) for k in CHECKSUM_COUNTERS}
        return result

    def addresses(self, ns: str) -> set[str]:
        """The IPv4 addresses of `ns` (a role or a full name), and with `ipv6` its global IPv6 ones, except
        loopback's, as the kernel lists them."""
        links = json.loads(self.exec(ns, "ip", "-j", *([] if self.ipv6 else ["-4"]), "addr", "show").stdout or "[]")
        return {a["local"] for link in links if link.get("ifname") != "lo" for a in link.get("addr_info", [])
                if a.get("scope") != "link"}

    def send_to_lower_device(self) -> None:
        """With client_stack: the client's frames for the node's address go to the MAC address of the device under
        the one holding it (a permanent neighbour entry), as when that device answered the client's ARP: a macvlan's
        lower device then receives them as its own (a bridge takes its ports' as its own anyway)."""
        if not self.client_stack:
            raise LabError("send_to_lower_device needs a client_stack")
        mac = self.exec(self.node, "cat", f"/sys/class/net/{NODE_CLIENT_IFNAME}/address").stdout.strip()
        self.exec(self.client, "ip", "neigh", "replace", NODE_CLIENT_IP, "lladdr", mac, "dev", self.client_ifname,
                  "nud", "permanent")

    def count_arrivals(self, ns: str, sources: Iterable[str]) -> None:
        """From now on, count the IPv4 packets that reach `ns` (a role or a full name) from `sources` (addresses or
        CIDRs), before anything there looks at them (an nftables counter at prerouting, raw priority; a second call
        starts again from zero): what `arrivals(ns)` reads. A pod's address among a client's arrivals is a reply
        that left the node untranslated."""
        table = f"ip {ARRIVALS_TABLE}"
        rules = (f"add table {table}\ndelete table {table}\n"
                 f"table {table} {{ chain pre {{ type filter hook prerouting priority raw; policy accept; "
                 f"ip saddr {{ {', '.join(sources)} }} counter; }}; }}\n")
        self.exec(ns, "nft", "-f", "-", input=rules)

    def arrivals(self, ns: str) -> int:
        """The packets counted since `count_arrivals(ns, ...)`."""
        listing = json.loads(self.exec(ns, "nft", "-j", "list", "table", "ip", ARRIVALS_TABLE).stdout)
        return sum(expr["counter"]["packets"] for item in listing["nftables"] if "rule" in item
                   for expr in item["rule"]["expr"] if "counter" in expr)

    def net_counters(self, ns: str) -> dict[str, int]:
        """Every counter of /proc/net/snmp, /proc/net/netstat and /proc/net/snmp6 inside `ns`, named as nstat
        names them (IcmpOutDestUnreachs, IcmpMsgOutType3, TcpInCsumErrors, Udp6InCsumErrors, ...)."""
        counters = parse_proc_net_counters(self.exec(ns, "cat", "/proc/net/snmp", "/proc/net/netstat").stdout)
        snmp6 = self.exec(ns, "cat", "/proc/net/snmp6", check=False).stdout  # absent where IPv6 is off
        for line in snmp6.splitlines():
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                counters[name] = int(value.strip())
        return counters


def parse_proc_net_counters(text: str) -> dict[str, int]:
    """`/proc/net/snmp`-style text (a header line then a value line per group) -> {GroupField: value}."""
    counters = {}
    lines = text.splitlines()
    for header, values in zip(lines, lines[1:], strict=False):
        h_group, _, h_fields = header.partition(":")
        v_group, _, v_fields = values.partition(":")
        if h_group != v_group or not h_fields.split() or not v_fields.split()[0].lstrip("-").isdigit():
            continue
        for name, value in zip(h_fields.split(), v_fields.split(), strict=False):
            with contextlib.suppress(ValueError):
                counters[h_group + name] = int(value)
    return counters


def nonzero_checksum_errors(errors: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Only the namespaces and counters of `Lab.checksum_errors()` that are not zero: {} means all clean."""
    return {ns: {k: v for k, v in c.items() if v} for ns, c in errors.items() if any(c.values())}
