"""What every tracer shares: the flow table's desired state, the packet, and from verdicts to an Outcome.

A tracer answers, for one new flow, every verdict the dataplane may reach (all the branches of a random
choice, never a sample), each with the memory the flow leaves behind (affinity entries: iptables' `recent`
lists, nftables' affinity sets, IPVS persistence templates, bpf's affinity entries). `outcome()` runs a first
flow, then a second one from the same client on the memory each first flow left: a Service is sticky when
every second flow lands where its first one did. So a trace tells which endpoints a flow can reach, never how
often: a skewed random choice passes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import flowcases
from flowcases import NO_ANSWER, REFUSED, Outcome, answered_by, sticky

from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.k8s.manifest import ManifestSource
from pyproxy.lab.netns import CLIENT_IP, backend_ip
from pyproxy.model.state import DesiredState
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth

BACKENDS = {backend_ip(i): f"b{i}" for i in (1, 2, 3)}
"""Lab addressing (pyproxy.lab): backend I is 10.201.I.2, named bI in the table."""
SOURCES = {"client": CLIENT_IP, **{name: ip for ip, name in BACKENDS.items()}}

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


class Tracer(Protocol):
    def flows(self, pkt: Packet, memory: Memory) -> Iterable[Verdict]:
        """Every verdict a new flow `pkt` may reach, given what earlier flows left (`memory`)."""
        ...


def desired_state(manifests: str = flowcases.MANIFESTS) -> DesiredState:
    """The desired state pyproxy computes from `manifests`: read by the manifest source (the `--source` reader)
    into the proxier, which syncs once into a dataplane that only remembers it."""
    dp = FakeDataplane()
    proxier = Proxier(dp, min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("trace"),
                      health=ProxyHealth(sync_period=30))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "cluster.yaml")
        path.write_text(manifests)
        ManifestSource(path, proxier).load_once()
    proxier.sync()
    if not dp.applies:
        raise AssertionError("the proxier applied nothing")
    return dp.state


def _name(backend: str) -> str:
    if ":" not in backend:
        return backend
    ip, port = backend.rsplit(":", 1)
    return f"{BACKENDS.get(ip, ip)}:{port}"


def outcome(tracer: Tracer, case: flowcases.FlowCase) -> Outcome:
    pkt = Packet(SOURCES[case.src], case.proto, case.dst, case.port)
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


def mismatches(tracer: Tracer, mode: str) -> list[str]:
    """One line per case of the table whose traced outcome is not what `mode` must do (exactly: a trace sees
    every branch, so a sticky Service must be sticky over all its ready endpoints)."""
    wrong = []
    for case in flowcases.CASES:
        expected, seen = case.expected(mode), outcome(tracer, case)
        if seen != expected:
            wrong.append(f"{case.name} ({case.src} -> {case.proto} {case.dst}:{case.port}): "
                         f"expected {expected}, traced {seen}")
    return wrong
