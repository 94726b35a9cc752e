"""`make demo` (`python -m labkit.demo`): real traffic through pyproxy's BPF dataplane in a namespace lab.

Builds a lab with three backends, starts pyproxy on the node with the shipped manifests
(tests/labkit/demo-manifests: `web` 10.96.0.10:80/TCP -> 8080 and `dns` 10.96.0.53:53/UDP -> 5353), sends new TCP
connections and UDP datagrams from the client to the ClusterIPs, prints how they spread, shows
`pyproxy inspect`, stops pyproxy with SIGTERM, runs `pyproxy cleanup` and removes the lab. Exit status 0 only
when every backend answered on both services, nothing failed and no receiver counted a checksum error.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labkit.netns import Lab, LabError, nonzero_checksum_errors
from labkit.proxy import Pyproxy, PyproxyError
from labkit.traffic import ProbeResult

MANIFESTS = Path(__file__).resolve().parent / "demo-manifests"
BACKENDS = 3
REQUESTS = 60
# `pyproxy inspect` lists every tracked flow too: enough lines for the services and some flows.
INSPECT_LINES = 30


@dataclass(frozen=True)
class DemoService:
    name: str
    proto: str
    cluster_ip: str
    port: int
    backend_port: int


SERVICES = (
    DemoService("web", "tcp", "10.96.0.10", 80, 8080),
    DemoService("dns", "udp", "10.96.0.53", 53, 5353),
)


def _table(results: list[tuple[DemoService, ProbeResult]], lab: Lab) -> str:
    rows = [("service", "backend", "answered")]
    for svc, result in results:
        target = f"{svc.name} {svc.cluster_ip}:{svc.port}/{svc.proto.upper()}"
        for b in lab.backends:
            rows.append((target, f"{b.name} {b.ip}:{svc.backend_port}",
                         str(result["replies"].get(f"{b.name}:{svc.backend_port}", 0))))
        rows.append((target, "failed", f"{result['failures']} {result['errors'] or ''}".rstrip()))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _problems(results: list[tuple[DemoService, ProbeResult]], lab: Lab) -> list[str]:
    problems = []
    for svc, result in results:
        expected = {f"{b.name}:{svc.backend_port}" for b in lab.backends}
        if missing := sorted(expected - result["replies"].keys()):
            problems.append(f"{svc.name}: no answer from {', '.join(missing)}")
        if unexpected := sorted(result["replies"].keys() - expected):
            problems.append(f"{svc.name}: answers from unexpected {', '.join(unexpected)}")
        if result["failures"]:
            problems.append(f"{svc.name}: {result['failures']} of {result['count']} requests failed "
                            f"{result['errors']}")
    return problems


def _head(text: str, lines: int) -> str:
    rows = text.rstrip().splitlines()
    more = f"\n... ({len(rows) - lines} more lines)" if len(rows) > lines else ""
    return "\n".join(rows[:lines]) + more


def _check_manifests_match(lab: Lab) -> None:
    # The shipped manifests name the backends by address; the lab's addressing is fixed so that they match.
    text = "".join(p.read_text() for p in sorted(MANIFESTS.glob("*.yaml")))
    missing = [b.ip for b in lab.backends if b.ip not in text]
    if missing:
        raise LabError(f"manifests in {MANIFESTS} do not name backends {missing}")


def run_demo() -> int:
    if os.geteuid() != 0:
        print("pyproxy demo needs root (network namespaces and BPF); try: sudo make demo", file=sys.stderr)
        return 1
    log_path = Path(tempfile.mkstemp(prefix="pyproxy-demo-", suffix=".log")[1])
    problems: list[str] = []
    proxy: Pyproxy | None = None
    try:
        with Lab(BACKENDS) as lab:
            print(f"lab {lab.id}: client {lab.client_ip} -> node -> "
                  + ", ".join(f"{b.name} {b.ip}" for b in lab.backends))
            _check_manifests_match(lab)
            lab.start_servers(tcp=[s.backend_port for s in SERVICES if s.proto == "tcp"],
                              udp=[s.backend_port for s in SERVICES if s.proto == "udp"])
            with Pyproxy(lab, MANIFESTS, log_path=log_path) as proxy:
                print(f"starting: ip netns exec {lab.node} {' '.join(proxy.command())}")
                proxy.start()
                print(f"healthy after {proxy.wait_healthy(20.0):.1f}s")

                results = [(svc, lab.probe(svc.proto, svc.cluster_ip, svc.port, REQUESTS)) for svc in SERVICES]
                print(f"\n{REQUESTS} new connections / datagrams per service from the client:\n")
                print(_table(results, lab))
                problems += _problems(results, lab)

                print("\n$ pyproxy inspect\n" + _head(proxy.inspect(), INSPECT_LINES))

                status = proxy.terminate(10.0)
                if status != 0:
                    problems.append("pyproxy did not exit within 10 s of SIGTERM" if status is None
                                    else f"pyproxy exited {status} on SIGTERM")
                else:
                    print("\npyproxy stopped on SIGTERM with status 0")
                proxy.cleanup()
                print("pyproxy cleanup: done")
            if errors := nonzero_checksum_errors(lab.checksum_errors()):
                problems.append(f"checksum errors counted by receivers: {errors}")
    except KeyboardInterrupt:
        print("\ninterrupted; the lab was removed", file=sys.stderr)
        return 130
    except PyproxyError as exc:
        problems.append(str(exc))  # ends with pyproxy's log tail already
        proxy = None
    except LabError as exc:
        problems.append(str(exc))

    if problems:
        print("\nDEMO FAILED:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        if proxy is not None:
            print(f"\n--- pyproxy log tail ({log_path}) ---\n{proxy.log_tail(60)}", file=sys.stderr)
        return 1
    print(f"\ndemo OK: every backend answered, no failures, no checksum errors (pyproxy log: {log_path})")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo())
