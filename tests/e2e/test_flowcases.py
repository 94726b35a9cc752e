"""The shared flow-case table (tests/flowcases.py) against every mode this kernel has, with real packets in a
namespace lab. IPVS, which this kernel lacks, runs the same table inside the qemu guest (tests/guest_ipvs)."""

from __future__ import annotations

import pytest
from flowcases import IPV6_CASES, MANIFESTS, NODE_NAME, NOT_RENDERED_YET, mismatches
from labkit.netns import nonzero_checksum_errors

from pyproxy.dataplane.bpf import bcc, loader

pytestmark = pytest.mark.root

MODES = [
    # The node's pods inside the hooked cgroup (the lab's pods_in_cgroup, as on a node): their flows to frontends the
    # model lets the socket path translate go by their sockets; with --bpf-socket-lb-hostns-only all by TC.
    pytest.param("bpf", [], {}, id="bpf"),
    pytest.param("bpf", ["--bpf-socket-lb-hostns-only"], {}, id="bpf-hostns-only"),
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
USERSPACE = pytest.param("userspace", [], {}, id="userspace")
"""Not in MODES: its IPv4 table runs once, in tests/e2e/test_userspace_e2e.py, where --proxy-mode=auto chooses it
with every kernel mode made unavailable (the same table twice cost a run of some 20 s for nothing)."""
TIMEOUTS = {"userspace": 3.0}
"""Seconds an answered flow gets, where not the table's 1 s: each userspace flow takes a few wakeups of pyproxy's
process (accept, connect, a copy each way), which on this shared 2-core machine under load took over 1 s for one
flow in several hundred (tests/e2e/test_userspace_e2e.py)."""


@pytest.mark.parametrize("mode, args, environ", MODES)
def test_every_mode_agrees_on_the_flow_table(make_env, monkeypatch: pytest.MonkeyPatch, mode: str, args: list[str],
                                             environ: dict[str, str]) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)  # pyproxy, started below, inherits it
    # A node like a real one (default route via an uplink, strict rp_filter, FORWARD drops INVALID): upstream's
    # netfilter modes reject flows to Services without endpoints in the filter table, after routing, which a
    # node without a route for the ClusterIP would never reach.
    # Its pods' processes inside the cgroup pyproxy's socket hooks go on, as below a real node's root cgroup.
    env = make_env(3, distro=True, pods_in_cgroup=True)
    env.write("cluster.yaml", MANIFESTS)
    # The node's name, which the table's externalTrafficPolicy Local slices name as their endpoints' nodeName.
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args])
    wrong = mismatches(env.lab, mode, timeout=TIMEOUTS.get(mode, 1.0))
    assert not wrong, f"{mode} {args}:\n" + "\n".join(wrong)


IPV6_MODES = [param for param in [*MODES, USERSPACE] if param.values[0] not in NOT_RENDERED_YET]
"""The modes that render IPv6 (flowcases.NOT_RENDERED_YET names the others, and why)."""


@pytest.mark.parametrize("mode, args, environ", IPV6_MODES)
def test_the_modes_that_render_ipv6_agree_on_the_ipv6_flow_table(make_env, mode: str, args: list[str],
                                                                 environ: dict[str, str]) -> None:
    # The same node, every link with an IPv6 /64 beside its IPv4 one: the client and the pods send from their
    # IPv6 addresses, NodePorts are served on the node's.
    env = make_env(3, distro=True, ipv6=True, pods_in_cgroup=True)
    env.write("cluster.yaml", MANIFESTS)
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args])
    wrong = mismatches(env.lab, mode, IPV6_CASES, timeout=TIMEOUTS.get(mode, 1.0))
    assert not wrong, f"{mode} {args}:\n" + "\n".join(wrong)
    assert not nonzero_checksum_errors(env.lab.checksum_errors())
