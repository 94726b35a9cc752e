"""`pyproxy inspect` for the ipvs mode: the view (pyproxy/model/inspection.py) read back from the kernel.

Where each part comes from:
- frontends: IPVS's virtual servers (generic netlink, kernel.read_virtuals: address, port, protocol, scheduler,
  persistence), those render.ours() counts as pyproxy's (on kube-ipvs0, or listed in pyproxy's ipsets);
- endpoints: each virtual server's real servers, with their weights and IPVS's active connection counts;
- policy: the ipsets (`ipset save`): KUBE-LOAD-BALANCER-FW and KUBE-LOAD-BALANCER-SOURCE-CIDR are the source
  ranges; KUBE-NO-LOCAL-ENDPOINTS and KUBE-NO-LOCAL-CLUSTER-IP mean that filter KUBE-IPVS-FIREWALL drops a
  new flow from outside the cluster (answered, as the other readers do, for such a client: no endpoint,
  dropped); a virtual server without a real server of weight > 0 refuses;
- pinned flows and ClientIP affinity: IPVS's own connection table, /proc/net/ip_vs_conn (per network
  namespace): a connection is client -> virtual server -> real server with IPVS's state and seconds to expiry;
  a persistence template (client port 0) is what pins a client to a real server while it lasts.

The kernel holds no Service names in this mode (IPVS, the ipsets and the iptables rules know addresses only),
so a frontend is named by its address; `--service` matches nothing here, `--frontend` does. How a new flow is
scheduled is IPVS's (its schedulers run in the kernel on counters and tables no reader sees): the trace names
the real servers of weight > 0 and the scheduler's rule, not one pick.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pyroute2.netlink.exceptions import NetlinkError

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane import netlink
from pyproxy.dataplane.base import DataplaneError, ModeUnavailable
from pyproxy.dataplane.ipvs import kernel
from pyproxy.dataplane.ipvs import render as r
from pyproxy.model import inspection
from pyproxy.model.objects import family_of, join_host_port

CONN_TABLE = Path("/proc/net/ip_vs_conn")
RULES = {
    "rr": "IPVS's round robin, the next real server in turn",
    "wrr": "IPVS's weighted round robin, each real server in turn as often as its weight",
    "lc": "IPVS's least connection, the fewest active x 256 + inactive connections",
    "wlc": "IPVS's weighted least connection, the fewest (active x 256 + inactive) / weight",
    "sed": "IPVS's shortest expected delay, the least (active + 1) / weight",
    "nq": "IPVS's never queue, a real server without active connections, else the least (active + 1) / weight",
    "sh": "IPVS's source hashing, the source address's bucket in IPVS's own table",
    "dh": "IPVS's destination hashing, the destination address's bucket in IPVS's own table",
    "mh": "IPVS's Maglev hashing, the source address's entry in IPVS's own lookup table",
}
"""What each IPVS scheduler picks by (net/netfilter/ip_vs_*.c)."""


@dataclass(frozen=True)
class Conn:
    """One line of /proc/net/ip_vs_conn."""

    proto: str
    client: str
    client_port: int
    vip: str
    vport: int
    dest: str
    dport: int
    state: str
    expires_sec: int

    @property
    def template(self) -> bool:
        """A persistence template (ClientIP affinity): no client port, it pins the client, not a connection."""
        return self.client_port == 0


def _conn_ip(text: str) -> str:
    """An address of /proc/net/ip_vs_conn: IPv4 as 8 hex digits (the address's value), IPv6 in full colon form
    (%pI6: fd00:0010:0096:0000:0000:0000:0000:000a), a destination's in brackets on newer kernels; compressed."""
    if ":" in text:
        return ipaddress.IPv6Address(text.strip("[]")).compressed
    if len(text) != 8:
        raise ValueError(f"not an address: {text!r}")
    return str(ipaddress.IPv4Address(int(text, 16)))


def parse_conns(text: str) -> list[Conn]:
    """/proc/net/ip_vs_conn: `Pro FromIP FPrt ToIP TPrt DestIP DPrt State Expires [PEName PEData]`, addresses as
    _conn_ip reads them, ports as 4 hex digits."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 9 or words[0] == "Pro":
            continue
        try:
            out.append(Conn(words[0].upper(), _conn_ip(words[1]), int(words[2], 16), _conn_ip(words[3]),
                            int(words[4], 16), _conn_ip(words[5]), int(words[6], 16), words[7].lower(),
                            int(words[8])))
        except ValueError:
            continue
    return out


def _source_ranges(key: r.VSKey, ipsets: Mapping[str, frozenset[str]]) -> tuple[str, ...]:
    entry, family = r.cluster_entry(key), family_of(key[0])
    if entry not in ipsets.get(r.set_name(r.LOAD_BALANCER_FW_SET, family), ()):
        return ()
    ranges = [m.removeprefix(entry + ",") for m in ipsets.get(r.set_name(r.LOAD_BALANCER_SOURCE_CIDR_SET, family), ())
              if m.startswith(entry + ",")]
    return tuple(sorted(str(ipaddress.ip_network(x)) for x in ranges))


def frontend_name(key: r.VSKey) -> str:
    """address:port/protocol, an IPv6 address in brackets ([fd00:10:96::a]:80/TCP)."""
    return f"{join_host_port(key[0], key[1])}/{key[2]}"


def _ip_order(ip: str) -> tuple[int, int]:
    """IPv4 addresses first, each family in numeric order."""
    address = ipaddress.ip_address(ip)
    return address.version, int(address)


def view(virtuals: Mapping[r.VSKey, r.Virtual], addresses: Iterable[str], ipsets: Mapping[str, frozenset[str]],
         conns: Iterable[Conn] = ()) -> inspection.View:
    """The view from IPVS's virtual servers, kube-ipvs0's addresses, pyproxy's ipsets and the connection table."""
    observed = r.Observed(virtuals, frozenset(addresses), ipsets)
    out = inspection.View(mode="ipvs")
    by_key: dict[tuple[str, int, str], inspection.Frontend] = {}
    for key in sorted(r.ours(observed, r.Memory()), key=lambda k: (_ip_order(k[0]), k[1], k[2])):
        v = virtuals[key]
        entry, family = r.cluster_entry(key), family_of(key[0])
        endpoints = tuple(inspection.Endpoint(b.ip, b.port, real.weight, real.active)
                          for b, real in sorted(v.reals.items(), key=lambda x: (_ip_order(x[0].ip), x[0].port)))
        empty = "refused"
        dropping = (r.set_name(name, family) for name in (r.NO_LOCAL_SET, r.NO_LOCAL_CLUSTER_IP_SET))
        if any(entry in ipsets.get(name, ()) for name in dropping):
            endpoints, empty = (), "dropped"
        scheduler = v.scheduler
        by_key[key] = inspection.Frontend(
            ip=key[0], port=key[1], proto=key[2], name=frontend_name(key), service="", scheduler=scheduler,
            endpoints=endpoints, affinity_sec=v.timeout, source_ranges=_source_ranges(key, ipsets), empty=empty,
            rule=RULES.get(scheduler.split()[0], f"IPVS's {scheduler}"))
    out.frontends = list(by_key.values())
    for c in conns:
        fe: inspection.Frontend | None = by_key.get((c.vip, c.vport, c.proto))
        if fe is None and c.template:
            # A template's protocol may read "IP": it pins the client to the address and port whatever the protocol.
            fe = next((f for (ip, port, _), f in by_key.items() if (ip, port) == (c.vip, c.vport)), None)
        if fe is None:
            continue
        backend = f"{c.dest}:{c.dport}"
        if c.template:
            out.affinities.append(inspection.Affinity(fe.proto, c.client, c.vip, c.vport, backend, fe.name,
                                                      c.expires_sec))
        else:
            out.flows.append(inspection.Flow(c.proto, c.client, c.client_port, c.vip, c.vport, backend, fe.name,
                                             c.state, expires_sec=c.expires_sec,
                                             ended=c.proto == "TCP" and c.state in nf.ENDED_TCP_STATES))
    return out


def read(flows: bool = True) -> inspection.View | None:
    """The view of this network namespace's IPVS, or None when the kernel has no IPVS or no virtual server of
    pyproxy's."""
    try:
        ipvs = kernel.open_ipvs()
    except ModeUnavailable:
        return None
    try:
        virtuals = kernel.read_virtuals(ipvs)
    except NetlinkError:
        return None
    finally:
        ipvs.close()
    try:
        with netlink.rtnl() as ipr:
            addresses = netlink.host_addresses(ipr, r.DUMMY_DEVICE)
        ipsets = kernel.read_sets()
    except (DataplaneError, ModeUnavailable, NetlinkError, OSError):
        # Without them only the virtual servers this process cannot tell from others' are missing: none show.
        addresses, ipsets = frozenset(), {}
    conns: list[Conn] = []
    if flows:
        with contextlib.suppress(OSError):  # IPVS's module without its proc files: no flows to show
            conns = parse_conns(CONN_TABLE.read_text())
    found = view(virtuals, addresses, ipsets, conns)
    if not found.frontends:
        return None
    found.source = "IPVS (netlink), ipset save, kube-ipvs0's addresses" + (f", {CONN_TABLE}" if flows else "")
    return found
