"""A network-namespace lab with real traffic, for tests, `pyproxy demo` and benchmarks (stdlib only)."""

from pyproxy.lab.netns import Backend, Lab, LabError, nonzero_checksum_errors, reap_stale_labs
from pyproxy.lab.proxy import Pyproxy, PyproxyError, describe, write_manifest
from pyproxy.lab.traffic import HttpResult, ProbeResult

__all__ = [
    "Backend",
    "HttpResult",
    "Lab",
    "LabError",
    "ProbeResult",
    "Pyproxy",
    "PyproxyError",
    "describe",
    "nonzero_checksum_errors",
    "reap_stale_labs",
    "write_manifest",
]
