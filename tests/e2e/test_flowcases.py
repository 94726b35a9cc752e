"""The shared flow-case table (tests/flowcases.py) against every mode this kernel has, with real packets in a
namespace lab. IPVS, which this kernel lacks, runs the same table inside the qemu guest (tests/guest_ipvs)."""

from __future__ import annotations

import pytest
from flowcases import MANIFESTS, NODE_NAME, mismatches

from pyproxy.dataplane.bpf import bcc, loader

pytestmark = pytest.mark.root

MODES = [
    pytest.param("bpf", [], {}, id="bpf"),
    # The same programs compiled at start by BCC (make install-bcc).
    pytest.param("bpf", ["--bpf-loader=bcc"], {}, id="bpf-bcc",
                 marks=pytest.mark.skipif(bcc.missing() is not None, reason=f"--bpf-loader=bcc: {bcc.missing()}")),
    # SNAT's source address the way of kernels without BPF_FIB_LOOKUP_SRC (before 6.7): the egress device's primary
    # address from the devices map, which pyproxy fills from netlink (README, "Kernel requirements").
    pytest.param("bpf", [], {loader.TEST_KERNEL_FLAGS: "0"}, id="bpf-without-fib-src"),
    pytest.param("nftables", [], {}, id="nftables"),
    pytest.param("iptables", ["--iptables-backend=legacy"], {}, id="iptables-legacy"),
    pytest.param("iptables", ["--iptables-backend=nft"], {}, id="iptables-nft"),
]
# The userspace mode runs the table in tests/e2e/test_userspace_e2e.py, chosen by --proxy-mode=auto with every
# kernel mode made unavailable.


@pytest.mark.parametrize("mode, args, environ", MODES)
def test_every_mode_agrees_on_the_flow_table(make_env, monkeypatch: pytest.MonkeyPatch, mode: str, args: list[str],
                                             environ: dict[str, str]) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)  # pyproxy, started below, inherits it
    # A node like a real one (default route via an uplink, strict rp_filter, FORWARD drops INVALID): upstream's
    # netfilter modes reject flows to Services without endpoints in the filter table, after routing, which a
    # node without a route for the ClusterIP would never reach.
    env = make_env(3, distro=True)
    env.write("cluster.yaml", MANIFESTS)
    # The node's name, which the table's externalTrafficPolicy Local slices name as their endpoints' nodeName.
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args])
    wrong = mismatches(env.lab, mode)
    assert not wrong, f"{mode} {args}:\n" + "\n".join(wrong)
