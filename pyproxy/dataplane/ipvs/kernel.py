"""The IPVS mode's kernel I/O: IPVS over generic netlink (pyroute2), kube-ipvs0 over rtnetlink (pyroute2),
ipsets through the `ipset` command, the IPVS sysctls. Nothing here decides anything; render.py does.

- IPVS: pyroute2's `IPVS` socket. Two traps of its helper classes: `IPVSDest` defaults to direct routing
  (fwd_method 3), while kube-proxy forwards by NAT ("masq", 0), so every real server is written with
  fwd_method 0; and `IPVSService.from_message` leaves its defaults in the friendly keys (timeout, flags), so
  dumps are read from the raw IPVS_*_ATTR_* attributes. A third: it gives an IPv4 virtual server its netmask
  (255.255.255.255) but an IPv6 one none, which the kernel refuses; an IPv6 one's "netmask" is its prefix length
  (128, as upstream), which the kernel reads as a host-order u32 from the attribute's four bytes.
- ipsets: `ipset restore -exist` takes a whole batch in one process and ignores members already there (or
  already gone), which makes a retried batch harmless; `ipset save` reads them back.
- kube-ipvs0 lives in pyroute2 here rather than in dataplane/netlink.py: only this mode has the device.
"""

from __future__ import annotations

import errno
import shlex
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pyroute2 import IPVS, IPVSDest, IPVSService
from pyroute2.netlink.exceptions import NetlinkError

from pyproxy.dataplane.base import DataplaneError, ModeUnavailable
from pyproxy.dataplane.ipvs.render import BITMAP_PORT, SET_FAMILIES, SET_TYPES, Real, Virtual, VSKey
from pyproxy.model.objects import IPV6, family_of
from pyproxy.model.state import Backend

IPSET_TIMEOUT = 30.0
PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": getattr(socket, "IPPROTO_SCTP", 132)}
PROTOCOL_NAMES = {v: k for k, v in PROTOCOLS.items()}
FWD_MASQ = 0
AF_OF_FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}
IPV6_NETMASK = socket.inet_ntoa(struct.pack("=I", 128))
"""An IPv6 virtual server's prefix length, 128, in pyroute2's IPv4-address form of the netmask attribute."""
SVC_F_PERSISTENT = 0x1
SVC_F_SCHED1 = 0x8
"""sh-fallback for sh, mh-fallback for mh: a flow that hashes to a real server of weight 0 goes to the next one
instead of being refused (both keep a weight-0 server's share of the table, so that it comes back to the same
clients). Weight 0 means "no new flows" here (a draining endpoint, or one a Service's weights quiesce), never
"refuse some clients"."""
FALLBACK_SCHEDULERS = frozenset({"sh", "mh"})
SYSCTL_DIR = Path("/proc/sys/net/ipv4")
# As upstream: conntrack entries for IPVS flows (so iptables can masquerade them), connections to a deleted
# real server expire on their next packet, and affinity templates of a weight-0 (draining) real server
# expire instead of pinning new connections to it.
SYSCTLS = {"vs/conntrack": "1", "vs/expire_nodest_conn": "1", "vs/expire_quiescent_template": "1",
           "ip_forward": "1"}


# ------------------------------------------------------------------------------------------------- IPVS


def open_ipvs() -> IPVS:
    """An IPVS socket that has been allowed to list; ModeUnavailable when the kernel has no IPVS or this
    process may not use it."""
    try:
        ipvs = IPVS()
    except NetlinkError as e:
        if e.code == errno.ENOENT:
            raise ModeUnavailable("the kernel has no IPVS (no IPVS generic netlink family: load ip_vs)") from e
        raise ModeUnavailable(f"cannot open the IPVS netlink family: {e}") from e
    try:
        ipvs.service("dump")
    except NetlinkError as e:
        ipvs.close()
        if e.code == errno.EPERM:
            raise ModeUnavailable("IPVS needs CAP_NET_ADMIN, which this process lacks") from e
        raise ModeUnavailable(f"cannot list IPVS virtual servers: {e}") from e
    return ipvs


def _service(key: VSKey, full: bool = False, **extra: Any) -> IPVSService:
    """The service of `key`; `full`: as add and set need it (with its netmask)."""
    if full and family_of(key[0]) == IPV6:
        extra["netmask"] = IPV6_NETMASK
    return IPVSService(addr=key[0], port=key[1], protocol=PROTOCOLS[key[2]], **extra)


def _service_of(msg: Any) -> tuple[VSKey, str, int] | None:
    """(key, scheduler, persistence) of an IPv4 or IPv6 address:port virtual server message; None for others
    (fwmark ones: never ours)."""
    svc = msg.get_attr("IPVS_CMD_ATTR_SERVICE")
    proto = PROTOCOL_NAMES.get(svc.get_attr("IPVS_SVC_ATTR_PROTOCOL"))
    if (svc.get_attr("IPVS_SVC_ATTR_AF") not in AF_OF_FAMILY.values() or proto is None
            or svc.get_attr("IPVS_SVC_ATTR_FWMARK")):
        return None
    flags = svc.get_attr("IPVS_SVC_ATTR_FLAGS") or {}
    timeout = svc.get_attr("IPVS_SVC_ATTR_TIMEOUT") if flags.get("flags", 0) & SVC_F_PERSISTENT else 0
    key = (svc.get_attr("IPVS_SVC_ATTR_ADDR"), svc.get_attr("IPVS_SVC_ATTR_PORT"), proto)
    scheduler = svc.get_attr("IPVS_SVC_ATTR_SCHED_NAME") or ""
    if scheduler in FALLBACK_SCHEDULERS and not flags.get("flags", 0) & SVC_F_SCHED1:
        # Not as put_virtual writes it (an older pyproxy's, or someone's by hand): read so that render.py plans
        # an edit, which sets the flag and keeps the connections.
        scheduler += " without fallback"
    return key, scheduler, timeout


def read_reals(ipvs: IPVS, key: VSKey) -> dict[Backend, Real]:
    reals = {}
    for d in ipvs.dest("dump", service=_service(key)):
        dest = d.get_attr("IPVS_CMD_ATTR_DEST")
        b = Backend(dest.get_attr("IPVS_DEST_ATTR_ADDR"), dest.get_attr("IPVS_DEST_ATTR_PORT"))
        reals[b] = Real(dest.get_attr("IPVS_DEST_ATTR_WEIGHT"), dest.get_attr("IPVS_DEST_ATTR_ACTIVE_CONNS") or 0,
                        dest.get_attr("IPVS_DEST_ATTR_INACT_CONNS") or 0)
    return reals


def read_virtuals(ipvs: IPVS) -> dict[VSKey, Virtual]:
    """Every virtual server of ours' kind with its real servers (one dump, then one per virtual server)."""
    found = [s for s in map(_service_of, ipvs.service("dump")) if s is not None]
    return {key: Virtual(sched, timeout, read_reals(ipvs, key)) for key, sched, timeout in found}


def read_virtual(ipvs: IPVS, key: VSKey) -> Virtual | None:
    """One virtual server with its real servers, None when there is none."""
    try:
        msgs = ipvs.service("get", service=_service(key))
    except NetlinkError as e:
        if e.code in (errno.ESRCH, errno.ENOENT):
            return None
        raise
    for found in filter(None, map(_service_of, msgs)):
        return Virtual(found[1], found[2], read_reals(ipvs, key))
    return None


def put_virtual(ipvs: IPVS, verb: str, key: VSKey, scheduler: str, timeout: int) -> None:
    flags = {"flags": (SVC_F_PERSISTENT if timeout else 0) | (SVC_F_SCHED1 if scheduler in FALLBACK_SCHEDULERS else 0),
             "mask": 0xFFFF}
    ipvs.service(verb, service=_service(key, True, sched_name=scheduler, timeout=timeout, flags=flags))


def delete_virtual(ipvs: IPVS, key: VSKey) -> None:
    ipvs.service("del", service=_service(key))


def put_real(ipvs: IPVS, verb: str, key: VSKey, b: Backend, weight: int) -> None:
    ipvs.dest(verb, service=_service(key), dest=IPVSDest(addr=b.ip, port=b.port, weight=weight, fwd_method=FWD_MASQ))


def delete_real(ipvs: IPVS, key: VSKey, b: Backend) -> None:
    ipvs.dest("del", service=_service(key), dest=IPVSDest(addr=b.ip, port=b.port))


# ---------------------------------------------------------------------------------------------------- ipset


def ipset_path() -> str:
    path = shutil.which("ipset")
    if path is None:
        raise ModeUnavailable("ipset not found in PATH (install the ipset package)")
    return path


def _ipset(*args: str, input: str | None = None) -> str:
    argv = [ipset_path(), *args]
    try:
        cp = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=IPSET_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise DataplaneError(f"{shlex.join(argv)}: no answer within {IPSET_TIMEOUT:g}s") from e
    except OSError as e:
        raise DataplaneError(f"{shlex.join(argv)}: {e}") from e
    if cp.returncode != 0:
        raise DataplaneError(f"{shlex.join(argv)} exited {cp.returncode}: {(cp.stderr or cp.stdout).strip()}")
    return cp.stdout


def check_ipset() -> None:
    try:
        _ipset("list", "-n")
    except DataplaneError as e:
        raise ModeUnavailable(f"ipset cannot be used here: {e}") from e


def read_sets(names: Iterable[str] = SET_TYPES) -> dict[str, frozenset[str]]:
    """Members of the named sets that exist."""
    return parse_sets(_ipset("save"), names)


def parse_sets(text: str, names: Iterable[str] = SET_TYPES) -> dict[str, frozenset[str]]:
    """Members of the named sets in `ipset save` output (lines `create NAME …` and `add NAME MEMBER`)."""
    wanted = set(names)
    members: dict[str, set[str]] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "create" and words[1] in wanted:
            members.setdefault(words[1], set())
        elif len(words) >= 3 and words[0] == "add" and words[1] in wanted:
            members.setdefault(words[1], set()).add(words[2])
    return {name: frozenset(m) for name, m in members.items()}


def _create_options(name: str, kind: str) -> str:
    # A bitmap has no address family; it needs its range (every port, as upstream).
    if kind == BITMAP_PORT:
        return "range 0-65535"
    return "family inet6" if SET_FAMILIES[name] == IPV6 else "family inet"


def change_sets(adds: Iterable[tuple[str, str]] = (), dels: Iterable[tuple[str, str]] = (),
                create: Mapping[str, str] = SET_TYPES) -> None:
    """Create the sets (if missing), then add and delete members, in one `ipset restore -exist`."""
    lines = [f"create {name} {kind} {_create_options(name, kind)}" for name, kind in create.items()]
    lines += [f"add {name} {entry}" for name, entry in adds]
    lines += [f"del {name} {entry}" for name, entry in dels]
    _ipset("restore", "-exist", input="\n".join(lines) + "\n")


def destroy_set(name: str) -> None:
    _ipset("destroy", name)


# --------------------------------------------------------------------------------------------------- sysctl


def check_sysctls() -> None:
    for name in SYSCTLS:
        if not (SYSCTL_DIR / name).exists():
            raise ModeUnavailable(f"no sysctl net.ipv4.{name.replace('/', '.')} (IPVS not loaded?)")


def write_sysctls() -> None:
    for name, value in SYSCTLS.items():
        path = SYSCTL_DIR / name
        if path.read_text().strip() != value:
            path.write_text(value)
