"""Issue 10's acceptance with real packets: the two-node flow table (tests/twonode.py) against every mode this
kernel has, one lab and one pyproxy per mode (about 10 s for a mode that passes, 30 s for one that does not). IPVS,
which this kernel lacks, runs the same table in the qemu guest (tests/guest_ipvs, test_the_two_node_table_agrees).

twonode.PENDING_MODES are the runs that do not do all of it yet (bpf: no SNAT, so no externalTrafficPolicy Cluster
frontend and no hairpin; iptables and ipvs: no external frontends), being added on other branches. They are expected to
fail (strict: a pending run that passes fails, so it is taken off the list); `pytest --runxfail
tests/e2e/test_twonode.py` shows which checks each still misses.
"""

from __future__ import annotations

import pytest
from labkit.netns import NODE_CLIENT2_IFNAME
from twonode import LOCAL_PODS, MANIFESTS, NODE_NAME, PENDING_MODES, REMOTE_PODS, mismatches

pytestmark = pytest.mark.root

# (id, --proxy-mode, more flags, XDP on the client-facing devices): bpf also with XDP, as the bpf e2e tests run it.
MODES = [
    ("bpf", "bpf", [], False),
    ("bpf-hostns-only", "bpf", ["--bpf-socket-lb-hostns-only"], False),
    ("bpf-xdp", "bpf", [], True),
    ("nftables", "nftables", [], False),
    ("iptables-legacy", "iptables", ["--iptables-backend=legacy"], False),
    ("iptables-nft", "iptables", ["--iptables-backend=nft"], False),
    ("userspace", "userspace", [], False),
]


def _param(name: str, mode: str, args: list[str], xdp: bool) -> object:
    # Only the table's verdict is the expected failure (raises=AssertionError): a pending mode that cannot even
    # start, or a broken lab, still fails the run.
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError,
                               reason=f"{name} does not serve all of issue 10 yet (twonode.PENDING_MODES)")
             ] if name in PENDING_MODES else []
    return pytest.param(mode, args, xdp, id=name, marks=marks)


@pytest.mark.parametrize("mode, args, xdp", [_param(*m) for m in MODES])
def test_two_nodes_and_outside_clients(make_env, mode: str, args: list[str], xdp: bool) -> None:
    # A node like a real one: strict rp_filter, FORWARD drops INVALID, a default route (via node2, see Lab); its
    # pods' processes inside the cgroup pyproxy's socket hooks go on (the other node's pods are not).
    env = make_env(LOCAL_PODS, remote_backends=REMOTE_PODS, second_client=True, distro=True, pods_in_cgroup=True)
    env.write("cluster.yaml", MANIFESTS)
    lab = env.lab
    xdp_devices = [lab.node_client_ifname, NODE_CLIENT2_IFNAME] if xdp else None
    env.start(mode=mode, args=[f"--hostname-override={NODE_NAME}", *args], xdp_devices=xdp_devices)
    # The userspace mode's flows each need its process scheduled: 3 s a flow, as in test_userspace_e2e.py.
    wrong = mismatches(lab, mode, timeout=3.0 if mode == "userspace" else 1.0)
    assert not wrong, f"{mode} {args}{' xdp' if xdp else ''}:\n" + "\n".join(wrong)
