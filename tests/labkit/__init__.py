"""Development tooling, not part of pyproxy (neither the wheel nor the image has it): a network-namespace lab with
real traffic for the tests, `make demo` and the benchmarks (stdlib only; tests/ on the path: pytest puts it there,
bench/__init__.py and the Makefile too).

    with Lab(3) as lab:                                   # client <-> node <-> b1..b3, torn down on exit
        lab.start_servers(tcp=[8080], udp=[5353])         # each backend answers "bI:PORT PEER"
        with Pyproxy(lab, manifests_dir) as proxy:        # `python -m pyproxy run` inside lab.node
            proxy.start()
            proxy.wait_healthy()
            result = lab.probe("tcp", "10.96.0.10", 80, 60)   # {"replies": {"b1:8080": 21, ...}, ...}
        assert not nonzero_checksum_errors(lab.checksum_errors())
"""

from labkit.netns import Backend, Lab, LabError, nonzero_checksum_errors, reap_stale_labs
from labkit.proxy import Pyproxy, PyproxyError, describe, write_manifest
from labkit.traffic import HttpResult, ProbeResult

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
