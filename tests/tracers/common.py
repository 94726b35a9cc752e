"""What every tracer shares: the syncs pyproxy makes for the flow table's cluster, the packet, and from verdicts
to an Outcome.

A tracer answers, for one new flow, every verdict the dataplane may reach (all the branches of a random
choice, never a sample), each with the memory the flow leaves behind (affinity entries: iptables' `recent`
lists, nftables' affinity sets, IPVS persistence templates, bpf's affinity entries). `outcome()` runs a first
flow, then a second one from the same client on the memory each first flow left: a Service is sticky when
every second flow lands where its first one did. So a trace tells which endpoints a flow can reach, never how
often: a skewed random choice passes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import flowcases
from flowcases import ALT, B1, B2, B3, DNS, HTTP, NO_ANSWER, REFUSED, Outcome, answered_by, sticky
from labkit.manifests import Port, documents, endpoint_slice, service
from labkit.netns import CLIENT_IP, NODE_CLIENT_IP, NODE_UPLINK_IP, backend_ip, ipv6_of

from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.k8s.manifest import ManifestSource
from pyproxy.model.node import NodeInputs
from pyproxy.model.state import DesiredState, FamilyFilter
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth

# The cluster a traced update starts from: every Service of the table differs (and one more is there), so the
# partial sync to flowcases.MANIFESTS rewrites each of them.
_OLD = Port("old", 81, 8080)
BEFORE = documents(
    service("web", "10.96.20.1", [HTTP, ALT, DNS, _OLD]),  # loses port 81; b3 goes unready, b2 comes
    endpoint_slice("web", {B1: True, B3: True}, [HTTP, ALT, DNS, _OLD]),
    service("split", "10.96.20.2", [HTTP]),  # its second slice comes
    endpoint_slice("split", {B1: True}, [HTTP], name="split-a"),
    service("empty", "10.96.20.3", [HTTP, DNS]),  # its endpoints go
    endpoint_slice("empty", {B1: True, B2: True}, [HTTP, DNS]),
    service("unready", "10.96.20.4", [HTTP]),  # its endpoints go unready
    endpoint_slice("unready", {B1: True, B2: True}, [HTTP]),
    service("sticky", "10.96.20.5", [HTTP]),  # gets ClientIP affinity, and b3
    endpoint_slice("sticky", {B1: True, B2: True}, [HTTP]),
    service("only-b2", "10.96.20.6", [HTTP]),  # b1 and b3 go
    endpoint_slice("only-b2", {B1: True, B2: True, B3: True}, [HTTP]),
    service("gone", "10.96.20.99", [HTTP]),  # deleted
    endpoint_slice("gone", {B1: True}, [HTTP]),
)

BACKENDS = {backend_ip(i): f"b{i}" for i in (1, 2, 3)}
"""Lab addressing (labkit): backend I is 10.201.I.2, named bI in the table."""
SOURCES = {"client": CLIENT_IP, **{name: ip for ip, name in BACKENDS.items()}}
SOURCES6 = {role: ipv6_of(ip) for role, ip in SOURCES.items()}
"""Each role's IPv6 address (labkit.netns.ipv6_of), the source of its IPv6 flows."""
BACKENDS.update({ipv6_of(ip): name for ip, name in list(BACKENDS.items())})
NODE_ADDRESSES4 = (NODE_UPLINK_IP, NODE_CLIENT_IP, *(f"10.201.{i}.1" for i in (1, 2, 3)))
NODE_ADDRESSES = (*NODE_ADDRESSES4, *(ipv6_of(ip) for ip in NODE_ADDRESSES4))
"""The node's own addresses in the table's lab (a distro lab with three backends), of both families: NodePorts are
served on all of them, as pyproxy serves them without --nodeport-addresses."""
NODE = NodeInputs(name=flowcases.NODE_NAME, nodeport_addresses=tuple(sorted(NODE_ADDRESSES4))
                  + tuple(sorted(NODE_ADDRESSES[len(NODE_ADDRESSES4):])), zone=flowcases.NODE_ZONE)

Memory = frozenset[tuple[str, ...]]
"""What flows leave behind for later ones, as hashable facts (each tracer says which)."""


class Unmodelled(AssertionError):
    """A rule, statement or op the tracer does not model: the renderer changed, so the tracer must too."""


@dataclass(frozen=True)
class Packet:
    src: str
    proto: str  # "tcp" | "udp"
    dst: str
    port: int


@dataclass(frozen=True)
class Verdict:
    kind: str
    """"dnat" (to `backend`, "ip:port"), "refused", "no-answer", or anything else a tracer finds (e.g. "node":
    delivered to the node's own stack), which matches no expected outcome."""
    backend: str = ""
    memory: Memory = frozenset()


def untranslated(pkt: Packet) -> Verdict:
    """A new flow no rule translated or dropped: to a node address it reaches the node's own stack, where nothing
    listens on the table's ports, which refuses it (a TCP reset, an ICMP port unreachable); elsewhere it is routed
    on, away from the lab, and nothing answers. A loopback destination is the sender's own stack (a pod's 127.0.0.1
    is its own), which refuses it likewise."""
    return Verdict("refused" if pkt.dst in NODE_ADDRESSES or pkt.dst.startswith("127.") else "no-answer")


class Tracer(Protocol):
    def flows(self, pkt: Packet, memory: Memory) -> Iterable[Verdict]:
        """Every verdict a new flow `pkt` may reach, given what earlier flows left (`memory`)."""
        ...


Sync = tuple[DesiredState, frozenset[str] | None]
"""One apply() the proxier made: the desired state, and the Services it changed (None: a full sync)."""


def syncs(*manifests: str) -> list[Sync]:
    """What pyproxy applies to its dataplane while its `--source` file holds each of `manifests` in turn: the
    manifest source reads it into the proxier, which syncs after each into a dataplane that only remembers. The
    first sync is a full one, the later ones partial (only the Services that changed). The proxier knows the node
    as the lab's pyproxy does (NODE: its name, its addresses, the zone of the manifests' Node)."""
    dp = FakeDataplane()
    proxier = Proxier(dp, min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("trace"),
                      health=ProxyHealth(sync_period=30))
    proxier.set_node_inputs(NODE)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "cluster.yaml")
        source = ManifestSource(path, proxier)
        for i, text in enumerate(manifests):
            Path(tmp, f"{i}.yaml").write_text(text)
            os.replace(Path(tmp, f"{i}.yaml"), path)  # a new inode: the source sees the change at once
            source.load_once()
            proxier.sync()
    if len(dp.applies) != len(manifests):
        raise AssertionError(f"{len(manifests)} manifests, but the proxier applied {len(dp.applies)} times")
    return [(desired, changed) for desired, changed in dp.applies]


def as_served(syncs: Sequence[Sync], families: frozenset[int]) -> list[Sync]:
    """What the proxier hands a dataplane that renders `families` (its backend's `ip_families`): each sync's
    desired state without the other family's frontends (model.state.FamilyFilter)."""
    only = FamilyFilter(families)
    return [(only.update(desired, changed), changed) for desired, changed in syncs]


def desired_state(manifests: str = flowcases.MANIFESTS) -> DesiredState:
    """The desired state pyproxy computes from `manifests`."""
    return syncs(manifests)[-1][0]


def _name(backend: str) -> str:
    if ":" not in backend:
        return backend
    ip, port = backend.rsplit(":", 1)
    return f"{BACKENDS.get(ip, ip)}:{port}"


def outcome(tracer: Tracer, case: flowcases.FlowCase) -> Outcome:
    pkt = Packet((SOURCES6 if case.family == 6 else SOURCES)[case.src], case.proto, case.dst, case.port)
    first = set(tracer.flows(pkt, frozenset()))
    kinds = {v.kind for v in first}
    if kinds == {"refused"}:
        return REFUSED
    if kinds == {"no-answer"}:
        return NO_ANSWER
    if kinds != {"dnat"}:
        return Outcome("mixed " + ", ".join(sorted(f"{v.kind} {_name(v.backend)}".strip() for v in first)))
    names = sorted({_name(v.backend) for v in first})
    stays = all({(w.kind, w.backend) for w in tracer.flows(pkt, v.memory)} == {("dnat", v.backend)} for v in first)
    return sticky(*names) if stays and len(names) > 1 else answered_by(*names)


def traced_cases(cases: Sequence[flowcases.FlowCase] = flowcases.CASES) -> list[flowcases.FlowCase]:
    """The cases a tracer follows: traffic that enters the node (from the client or a pod). The node's own
    processes take other paths (nat OUTPUT, IPVS's local-out hook, bpf's socket hooks at connect()) that the
    tracers do not model; the privileged table (tests/e2e/test_flowcases.py) checks those cases."""
    return [case for case in cases if case.src in SOURCES]


def mismatches(tracer: Tracer, mode: str, cases: Sequence[flowcases.FlowCase] = flowcases.CASES) -> list[str]:
    """One line per case of `cases` whose traced outcome is not what `mode` must do (exactly: a trace sees
    every branch, so a sticky Service must be sticky over all its ready endpoints)."""
    wrong = []
    for case in traced_cases(cases):
        expected, seen = case.expected(mode), outcome(tracer, case)
        if seen != expected:
            wrong.append(f"{case.name} ({case.src} -> {case.proto} {case.dst}:{case.port}): "
                         f"expected {expected}, traced {seen}")
    return wrong
