"""Which UDP flows a change of endpoints made stale: the one plan every netfilter-based mode executes.

UDP has no end of connection, so a conntrack entry DNATed to an endpoint keeps sending a client's datagrams
there as long as the client keeps talking (a DNS client on a fixed source port: forever), even after the
endpoint left the Service, and an entry made while a frontend had no endpoint keeps its flow untranslated
(upstream kubernetes issues 19029, 48370, 125467). Upstream's rules, kept here:

- an endpoint that left a UDP frontend's known endpoints (ready or not): delete the entries to that frontend
  DNATed to it;
- a UDP frontend that had no endpoint and now has one: delete the entries to it that were never DNATed.

Every frontend kind is a frontend here: ClusterIP, external IP, load-balancer IP and NodePort. A NodePort is
served on several node addresses (and a mode may not know which addresses a previous run served it on), so,
as upstream, its DNATed entries are cleared by port on any address (`Stale.ip` ""); its un-DNATed ones are
cleared per node address, since only "reply source = original destination" tells an untranslated entry apart,
and that needs the address.

Restart (upstream 122740: a restart flushed live flows): the filters make that impossible by construction. An
endpoint's entries are only deleted when a previous state the mode knows (its own memory, or what it adopted
from the kernel) listed the endpoint and the new one does not, so an endpoint present now is never cleared; a
frontend the mode saw no state for counts as "had no endpoint", which only deletes untranslated entries, which
no live endpoint flow is.

Pure: the modes turn `Stale` into `conntrack -D` arguments (dataplane/netfilter.py) and run them after their
rules are in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from pyproxy.model.objects import IPV4, IPV6, Protocol, family_of
from pyproxy.model.state import Backend, FrontendKind, ServicePortState

UdpKey = tuple[str, int, int]
"""(address, port, family) of a UDP frontend; address "" for a NodePort (all its addresses of that family: a
dual-stack NodePort is two frontends, each of which gets its first endpoint on its own)."""


class Stale(NamedTuple):
    """UDP conntrack entries to delete: those to `ip`:`port` ("" = any address) DNATed to `endpoint`, or, with
    `endpoint` None, those to `ip`:`port` never DNATed (their reply comes from `ip` itself)."""

    ip: str
    port: int
    endpoint: Backend | None = None

    def __str__(self) -> str:
        return f"udp {self.ip or '*'}:{self.port} -> {self.endpoint or '(not DNATed)'}"

    @property
    def family(self) -> int:
        """IPV4 or IPV6: the frontend's address's, else (a NodePort's, any address) the endpoint's."""
        if self.ip:
            return family_of(self.ip)
        return self.endpoint.family if self.endpoint is not None else IPV4


@dataclass(frozen=True)
class UdpFrontend:
    """What the plan needs to know of one UDP frontend (all addresses of a NodePort together)."""

    served: bool
    """Some source gets DNATed to an endpoint (it has usable endpoints)."""
    known: frozenset[Backend] = frozenset()
    """Every endpoint flows may be DNATed to: the ready ones and those kept for established flows."""
    addresses: frozenset[str] = field(default=frozenset())
    """A NodePort's node addresses (needed to clear its untranslated entries); others: their own address."""

    def __or__(self, other: UdpFrontend) -> UdpFrontend:
        """Two parts of one frontend together (a NodePort's addresses)."""
        return UdpFrontend(self.served or other.served, self.known | other.known, self.addresses | other.addresses)


def udp_key(sp: ServicePortState) -> UdpKey:
    fe = sp.frontend
    return ("" if sp.kind is FrontendKind.NODE_PORT else fe.ip, fe.port, IPV6 if ":" in fe.ip else IPV4)


def udp_frontends(states: Iterable[ServicePortState]) -> dict[UdpKey, UdpFrontend]:
    """The UDP frontends of `states`, NodePorts merged per port."""
    out: dict[UdpKey, UdpFrontend] = {}
    for sp in states:
        if sp.frontend.protocol is not Protocol.UDP:
            continue
        key = udp_key(sp)
        mine = UdpFrontend(served=bool(sp.backends or sp.external_backends),
                           known=frozenset((*sp.known_backends, *sp.backends, *sp.external_backends)),
                           addresses=frozenset({sp.frontend.ip}))
        out[key] = out[key] | mine if key in out else mine
    return out


def stale_udp(old: Mapping[UdpKey, UdpFrontend], new: Mapping[UdpKey, UdpFrontend]) -> list[Stale]:
    """The entries made stale going from `old` to `new` (both: the frontends in the sync's scope; a frontend
    missing from `old` is one the mode knew nothing of, as after a restart: it is treated as unserved)."""
    out: list[Stale] = []
    for key in sorted(set(old) | set(new)):
        ip, port, _ = key
        before, after = old.get(key), new.get(key)
        if after is not None and after.served and (before is None or not before.served):
            # Flows begun while it had no endpoint were never DNATed: they would stay untranslated.
            out += [Stale(a, port) for a in sorted(after.addresses if not ip else {ip}) if a]
        if before is not None:
            gone = before.known - (after.known if after is not None else frozenset())
            out += [Stale(ip, port, b) for b in sorted(gone)]
    return out


def stale_udp_states(old: Iterable[ServicePortState], new: Iterable[ServicePortState]) -> list[Stale]:
    """`stale_udp` over two sets of frontend states."""
    return stale_udp(udp_frontends(old), udp_frontends(new))
