"""Mode selection, fallback without BPF privileges, switching modes and cleaning up after all of them."""

from __future__ import annotations

import re
import sys

import pytest
from labkit import describe
from labkit.manifests import Port, endpoint_slice, service

pytestmark = pytest.mark.root

HTTP = Port("http", 80, 8080)
WEB = (service("web", "10.96.30.1", [HTTP]), endpoint_slice("web", {"10.201.1.2": True, "10.201.2.2": True}, [HTTP]))
# The bounding set loses CAP_BPF and CAP_SYS_ADMIN, so the exec'd pyproxy has neither (root or not); it keeps
# CAP_NET_ADMIN, which the netfilter modes need. `ip netns exec` runs first: it needs CAP_SYS_ADMIN itself.
NO_BPF = ["capsh", "--drop=cap_bpf,cap_sys_admin,cap_perfmon", "--", "-c", 'exec "$@"', "pyproxy"]
CAP_BPF, CAP_SYS_ADMIN = 39, 21


def effective_caps(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^CapEff:\s*([0-9a-f]+)$", f.read(), re.M).group(1), 16)


def test_auto_without_bpf_privileges_falls_back_to_netfilter_and_says_why(make_env) -> None:
    env = make_env(2)
    env.write("web.yaml", *WEB)
    proxy = env.start(mode="auto", wrapper=NO_BPF)
    caps = effective_caps(proxy.proc.pid)
    assert not caps & (1 << CAP_BPF | 1 << CAP_SYS_ADMIN), f"capabilities not dropped: {caps:#x}"
    env.assert_reaches("tcp", "10.96.30.1", 80, {"b1:8080", "b2:8080"})
    log = proxy.log_text()
    assert re.search(r"proxy mode bpf skipped: .+", log), log
    assert re.search(r"proxy mode ipvs skipped: .+", log), log  # this kernel has no IPVS
    assert "proxy mode nftables (chosen automatically)" in log, log
    assert 'pyproxy_proxy_mode{mode="nftables"} 1.0' in env.lab.http_get(env.lab.node, proxy.metrics_url)["body"]


def test_bpf_mode_without_privileges_fails_with_the_reason(make_env) -> None:
    env = make_env(1)
    env.write("web.yaml", *WEB)
    cp = env.lab.exec(env.lab.node, *NO_BPF, sys.executable, "-c", "import sys; from pyproxy.cli import main; "
                      f"sys.exit(main(['run', '--proxy-mode=bpf', '--source={env.source}', "
                      f"'--bpf-pin-path={env.lab.pin_path}']))", check=False)
    assert cp.returncode == 1, cp
    assert "--proxy-mode=bpf cannot run here:" in cp.stderr, cp.stderr
    assert "Operation not permitted" in cp.stderr, cp.stderr


def test_each_mode_in_turn_removes_the_last_and_cleanup_removes_everything(make_env) -> None:
    """bpf -> nftables -> iptables (legacy) -> iptables (nft) -> bpf: each start removes what the mode before
    left (two dataplanes translating one ClusterIP would fight), traffic works in each and stays after
    SIGTERM, and `pyproxy cleanup` then leaves nothing of any mode."""
    env = make_env(2)
    env.write("web.yaml", *WEB)
    prog_ids: set[int] = set()
    for mode, args in (("bpf", []), ("nftables", []), ("iptables", ["--iptables-backend=legacy"]),
                       ("iptables", ["--iptables-backend=nft"]), ("bpf", [])):
        proxy = env.start(mode=mode, args=args)
        programs = {p for ids in env.attached_programs().values() for p in ids}
        prog_ids |= programs
        netfilter = env.netfilter_leftovers()
        if mode == "bpf":
            assert programs and not netfilter, netfilter
        else:
            assert not programs, f"{mode} runs but BPF programs are still attached: {programs}"
            other_backend = "nft" if args == ["--iptables-backend=legacy"] else "legacy"
            foreign = [line for line in netfilter
                       if (mode == "nftables" and "KUBE-" in line)
                       or (mode == "iptables" and (line.startswith("nft:")
                                                   or line.startswith(f"iptables-{other_backend}-save")))]
            assert not foreign, f"{mode} {args} runs beside another mode's rules: {foreign}"
        env.assert_reaches("tcp", "10.96.30.1", 80, {"b1:8080", "b2:8080"})
        assert proxy.terminate() == 0, proxy.log_tail()
        # Still served after pyproxy stopped: the rules stay, as kube-proxy's do.
        result = env.probe("tcp", "10.96.30.1", 80, 10)
        assert result["failures"] == 0, f"{mode} after SIGTERM: {describe(result)}"
    env.running.cleanup()
    left = env.leftovers(prog_ids) + env.netfilter_leftovers()
    assert not left, left
