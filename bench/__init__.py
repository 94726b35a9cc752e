"""pyproxy's benchmarks: `make bench` (python -m bench.run). See bench/run.py and bench/core.py."""

import sys
from pathlib import Path

# The tests' development helpers (cluster: the real control plane; apiobjects: the API objects) are modules in
# tests/, never part of the product package: the benchmarks import them by the names the tests use. Appended, so
# nothing in tests/ can shadow an installed module.
_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
