"""Fixtures shared by every test folder: one real etcd + kube-apiserver per test session.

The cluster starts only when a test asks for it (about 5 s), runs `--authorization-mode=RBAC` (the admin
token is in system:masters, so admin tests are unaffected; the RBAC test needs a server that enforces it),
and lives in the session's temporary directory. Tests share it, so each works in its own namespace and
compares the proxy's state with the server's full state, never with a count it assumes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from apiobjects import Kube
from cluster.cluster import Cluster

# The IPVS end-to-end tests need a kernel with IPVS: this machine's has none, so tests/e2e/test_ipvs_guest.py runs
# them inside a qemu guest. Where IPVS is missing they are not collected at all rather than listed as skipped.
collect_ignore = [] if Path("/proc/sys/net/ipv4/vs").exists() else ["guest_ipvs"]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A missing apiserver binary fails here with a message naming `make apiserver`: never a skip.
    with Cluster(tmp_path_factory.mktemp("cluster"), authorization_mode="RBAC") as c:
        yield c


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Iterator[Kube]:
    k = Kube(cluster.kubeconfig)
    yield k
    k.close()


@pytest.fixture
def namespace(kube: Kube) -> str:
    return kube.namespace()


@pytest.fixture
def kubeconfig(cluster: Cluster) -> Path:
    return cluster.kubeconfig


# The skips a host run may have (make test sets PYPROXY_SKIP_GUARD): any other skip means a test did not run that
# should have (BCC broken after install would otherwise skip some 300 cases and leave the run green), and fails
# the session, as the guest runs' guard does (tests/e2e/conftest.py, guest_pytest). By reason text: why allowed.
ALLOWED_SKIPS = {
    "BPF_PROG_TEST_RUN for skbs needs a complete IPv": "no kernel's test run takes a truncated IP header on an skb; "
                                                       "the XDP run of the same case shows it",
    "has no BPF_FIB_LOOKUP_SRC": "kernels before 6.7: the devices-map way of finding the SNAT source runs instead",
}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.environ.get("PYPROXY_SKIP_GUARD"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    unexpected = []
    for rep in skipped:
        reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if not any(allowed in reason for allowed in ALLOWED_SKIPS):
            unexpected.append(f"{rep.nodeid}: {reason}")
    if unexpected and reporter:
        reporter.write_sep("=", "skips not in tests/conftest.py's ALLOWED_SKIPS: tests that should have run did not",
                           red=True)
        for line in unexpected:
            reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_setup(item: pytest.Item) -> None:
    # make test's whole-run bound (Makefile, PYPROXY_TEST_DEADLINE): past it, no further test starts, and the run
    # ends failing with the summary of what ran, rather than being killed by CI's limit with nothing said.
    deadline = os.environ.get("PYPROXY_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.exit(f"the whole-run bound (PYPROXY_TEST_DEADLINE, Makefile's TEST_MINUTES) passed before {item.nodeid}",
                    returncode=pytest.ExitCode.TESTS_FAILED)
