"""Fixtures shared by every test folder: one real etcd + kube-apiserver per test session.

The cluster starts only when a test asks for it (about 5 s), runs `--authorization-mode=RBAC` (the admin
token is in system:masters, so admin tests are unaffected; the RBAC test needs a server that enforces it),
and lives in the session's temporary directory. Tests share it, so each works in its own namespace and
compares the proxy's state with the server's full state, never with a count it assumes.
"""

from __future__ import annotations

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
