"""IPVS mode end to end, in a qemu guest: this machine's kernel has no IPVS, Debian's has.

Builds the guest image when it is missing or stale (tests/guest/build-image.sh, cached in ~/.cache/pyproxy),
boots it with this checkout shared read-only (tests/guest/run.py) and runs `pytest tests/guest_ipvs` there.
The guest's output is printed (pytest shows it for a failure, or always with -s); the test passes when the
guest's pytest exits 0. Bounded: the build by build_image()'s timeout (30 minutes; it takes about 1 minute),
the guest run by GUEST_TIMEOUT.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.root

GUEST_DIR = Path(__file__).resolve().parents[1] / "guest"
# 4 minutes on an idle machine, 9 with two other test suites beside it; the two-node table added about 3 (11.4
# measured on a busy host).
GUEST_TIMEOUT = 1200.0
COMMAND = "python -m pytest -q -p no:cacheprovider -ra"
SELECTION = os.environ.get("PYPROXY_GUEST_TESTS", "tests/guest_ipvs")
"""What the guest's pytest runs: all of tests/guest_ipvs, or e.g. `tests/guest_ipvs -k scheduler` while working
on one test (a guest boot costs minutes)."""


def _runner() -> ModuleType:
    # tests/guest/run.py is a stdlib-only script, not a package module: load it from its path.
    spec = importlib.util.spec_from_file_location("pyproxy_guest_run", GUEST_DIR / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_ipvs_mode_in_a_guest() -> None:
    run = _runner()
    image = run.build_image()
    result = run.run_in_guest(f"{COMMAND} {shlex.join(shlex.split(SELECTION))}", timeout=GUEST_TIMEOUT, echo=None,
                              image=image)
    print(f"===== guest output ({result.seconds:g}s, exit {result.returncode}) =====\n{result.output}")
    if result.returncode in (124, 125):
        print(f"===== guest console =====\n{result.console[-20000:]}")
    assert result.returncode == 0, f"pytest in the guest exited {result.returncode}: {result.output[-3000:]}"
    summary = result.output.strip().splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary, summary  # skipped: not really in the guest
