"""What a restart leaves behind and what a setting silently ignores (issue 17), end to end in a namespace lab.

- a start makes the attached programs exactly what its settings say: XDP goes when --xdp-devices no longer
  names the device, TC when --devices no longer names it, and the log says what went;
- a duration that cannot work (--sync-period=0 spins a core; --min-sync-period=-1) ends pyproxy at once with
  status 2 and a message naming the flag, before anything is programmed;
- `ip netns exec NODE pyproxy inspect` finds the running dataplane though each `ip netns exec` has its own /sys;
- a setting the running mode does not honour is named in a warning;
- an iptables-mode restart leaves its own chains alone: the stale-mode cleanup removes only other modes' things;
- `--config` with a kubeadm cluster's kube-proxy ConfigMap, unchanged, starts the file's mode (issue 12).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from labkit.manifests import Port, endpoint_slice, service
from labkit.netns import PEER_IFNAME

pytestmark = pytest.mark.root

HTTP = Port("http", 80, 8080)
WEB_IP = "10.96.30.1"
WEB = (service("web", WEB_IP, [HTTP]), endpoint_slice("web", {"10.201.1.2": True, "10.201.2.2": True}, [HTTP]))
BOTH = {"b1:8080", "b2:8080"}


def last_run_log(proxy) -> str:
    """The log of the latest start only (every start appends to one file after a `### <command>` line)."""
    return proxy.log_text().rsplit("### ", 1)[-1]


def xdp_ids(env, dev: str) -> list[int]:
    """Ids of the XDP programs on a node device (any mode)."""
    link = json.loads(env.lab.exec(env.lab.node, "ip", "-j", "link", "show", "dev", dev).stdout)[0]
    xdp = link.get("xdp", {})
    ids = [a["prog"]["id"] for a in xdp.get("attached", [])]
    return sorted(set(ids + ([xdp["prog"]["id"]] if "prog" in xdp else [])))


# ------------------------------------------------------------------------------------------ 1. programs


def test_a_restart_without_xdp_devices_detaches_xdp_and_logs_it(make_env) -> None:
    env = make_env(2)
    env.write("web.yaml", *WEB)
    dev = env.lab.node_client_ifname
    proxy = env.start(xdp_devices=[dev])
    before = xdp_ids(env, dev)
    assert before, f"--xdp-devices={dev} attached no XDP program"
    assert proxy.terminate() == 0

    proxy = env.start()  # the same settings without --xdp-devices
    assert xdp_ids(env, dev) == [], f"XDP program {before} still on {dev} after a start without --xdp-devices"
    log = last_run_log(proxy)
    assert re.search(rf"detached XDP \((native|generic)\) from {dev}: not in --xdp-devices", log), log
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)  # TC alone serves it


def test_native_xdp_a_driver_refuses_is_an_error_naming_why_and_best_effort_falls_back(make_env) -> None:
    """A jumbo MTU (9000) on the client link: veth takes native XDP only up to about 3,500 bytes for a program
    without multi-buffer support. --bpf-xdp-mode=native: no XDP on the device, an error naming it, its MTU and the
    kernel's own reason, TC still serving; the default (best-effort): generic XDP, with a warning saying so."""
    env = make_env(2)
    env.write("web.yaml", *WEB)
    dev = env.lab.node_client_ifname
    env.lab.exec(env.lab.node, "ip", "link", "set", dev, "mtu", "9000")
    env.lab.exec(env.lab.client, "ip", "link", "set", PEER_IFNAME, "mtu", "9000")

    proxy = env.start(xdp_devices=[dev], args=["--bpf-xdp-mode=native"])
    log = last_run_log(proxy)
    assert re.search(rf"ERROR .*no XDP on {dev}: the driver refused native XDP: .*Peer MTU is too large.*MTU 9000",
                     log), log
    assert xdp_ids(env, dev) == [], "a native XDP program the driver refused, or a generic one not asked for"
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)
    assert proxy.terminate() == 0

    proxy = env.start(xdp_devices=[dev])
    log = last_run_log(proxy)
    assert re.search(rf"WARNING .*native XDP refused on {dev}: .*Peer MTU is too large.*MTU 9000.*generic XDP",
                     log), log
    link = json.loads(env.lab.exec(env.lab.node, "ip", "-j", "link", "show", "dev", dev).stdout)[0]
    assert link.get("xdp", {}).get("mode") == 2, f"not generic XDP (mode 2) on {dev}: {link.get('xdp')}"
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)


def test_a_restart_with_fewer_devices_detaches_the_others_and_logs_it(make_env) -> None:
    env = make_env(2)
    env.write("web.yaml", *WEB)
    proxy = env.start()
    attached = env.attached_programs()
    assert all(attached.values()), attached
    assert proxy.terminate() == 0

    client = env.lab.node_client_ifname
    proxy = env.start(devices=[client])
    attached = env.attached_programs()
    others = [dev for dev in env.lab.node_ifnames if dev != client]
    assert attached[client] and not any(attached[dev] for dev in others), attached
    log = last_run_log(proxy)
    for dev in others:
        assert f"detached tc ingress, tc egress from {dev}: not in --devices" in log, log
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)  # DNAT on the way in, reverse NAT on the client device's egress


# ------------------------------------------------------------------------------------------ 2. durations


@pytest.mark.parametrize(("flag", "message"), [
    ("--sync-period=0", "error: --sync-period must be positive"),
    ("--sync-period=0s", "error: --sync-period must be positive"),  # what kubeadm's ConfigMap holds
    ("--min-sync-period=-1", "error: --min-sync-period must not be negative"),
    ("--min-sync-period=2m", "error: --sync-period (30s) must not be shorter than --min-sync-period (2m0s)"),
    ("--conntrack-tcp-timeout-established=-1s", "error: --conntrack-tcp-timeout-established must not be negative"),
    ("--bpf-ct-tcp-syn-timeout=0", "error: --bpf-ct-tcp-syn-timeout must be positive"),
    ("--sync-period=fast", "error: argument --sync-period: not a duration"),
])
def test_a_duration_that_cannot_work_ends_pyproxy_at_once_naming_the_flag(make_env, flag: str,
                                                                          message: str) -> None:
    env = make_env(1)
    env.write("web.yaml", *WEB)
    cp = env.lab.python(env.lab.node, "-m", "pyproxy", "run", "--proxy-mode=bpf", f"--source={env.source}",
                        f"--bpf-pin-path={env.lab.pin_path}", f"--cgroup-root={env.lab.cgroup}", flag, check=False,
                        timeout=20)
    assert cp.returncode == 2, cp
    assert message in cp.stderr, cp.stderr
    assert not any(env.attached_programs().values()), "programs attached before the settings were checked"


# ------------------------------------------------------------------------------------------ 3. inspect


def test_inspect_under_ip_netns_exec_finds_the_running_dataplane(make_env) -> None:
    """pyproxy pins under the default /sys/fs/bpf/pyproxy, which `ip netns exec` makes private to each
    invocation: inspect, run the same way with no flag, still finds the maps through the attached programs."""
    env = make_env(2)
    env.write("web.yaml", *WEB)
    proxy = env.start(args=["--bpf-pin-path=/sys/fs/bpf/pyproxy"])
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)
    cp = env.lab.python(env.lab.node, "-m", "pyproxy", "inspect", check=False)
    assert cp.returncode == 0, cp
    line = next((line for line in cp.stdout.splitlines() if f"{WEB_IP}:80/TCP" in line), "")
    assert "default/web" in line and "10.201.1.2:8080" in line and "10.201.2.2:8080" in line, cp.stdout

    # Stopped, the programs still hold the maps: the frontends stay visible (the names map went with the
    # process's private bpffs, so the Service's name may be a placeholder).
    assert proxy.terminate() == 0
    cp = env.lab.python(env.lab.node, "-m", "pyproxy", "inspect", "--no-flows", check=False)
    assert cp.returncode == 0, cp
    assert re.search(rf"{re.escape(WEB_IP)}:80/TCP .*10\.201\.1\.2:8080", cp.stdout), cp.stdout


# ------------------------------------------------------------------------------------------ 4. settings


def test_bpf_mode_warns_about_settings_it_does_not_honour(make_env) -> None:
    env = make_env(2)
    env.write("web.yaml", *WEB)
    proxy = env.start(args=["--ipvs-scheduler=lc", "--iptables-masquerade-bit=13"])
    log = last_run_log(proxy)
    for flag in ("--ipvs-scheduler", "--iptables-masquerade-bit"):
        assert re.search(rf"WARNING .*bpf mode does not honour {flag}\b", log), log
    assert "--iptables-backend" not in log, log  # a flag left at its default is no setting of the user's
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)


def test_config_starts_the_mode_of_kubeadms_configmap(make_env) -> None:
    """kube-proxy's ConfigMap of a kubeadm cluster, as its DaemonSet mounts it: the file's mode (iptables) runs
    though the lab's command line says --proxy-mode=bpf, which is ignored beside --config as upstream, saying
    so. Its healthz and metrics addresses are upstream's defaults, the lab's; its clusterCIDR (10.244.0.0/16)
    does what upstream's does: the lab's client, outside it, is masqueraded."""
    env = make_env(2)
    env.write("web.yaml", *WEB)
    fixture = Path(__file__).parents[1] / "unit" / "kubeproxyconfig" / "kubeadm-iptables.configmap.yaml"
    config = env.source.parent / "config.conf"
    config.write_text(yaml.safe_load(fixture.read_text())["data"]["config.conf"])
    proxy = env.start(mode="bpf", args=[f"--config={config}"])
    log = last_run_log(proxy)
    assert "pyproxy running: mode=iptables" in log, log
    assert re.search(rf"WARNING .*--proxy-mode is ignored: --config {config} is given", log), log
    result = env.probe("tcp", WEB_IP, 80, 40)
    assert result["failures"] == 0 and set(result["replies"]) == BOTH, result
    assert env.lab.client_ip not in result["seen_from"], result["seen_from"]


# ------------------------------------------------------------------------------------------ 5. iptables


def filter_state(env, backend: str) -> tuple[list[str], dict[str, int]]:
    """The filter table's chains, and the packet counter of every rule in a built-in chain that jumps to one of
    ours (a chain deleted and made again takes its jumps with it: they come back at zero)."""
    out = env.lab.exec(env.lab.node, f"iptables-{backend}-save", "-c", "-t", "filter").stdout
    chains = sorted(line.split()[0][1:] for line in out.splitlines() if line.startswith(":"))
    jumps = {}
    for line in out.splitlines():
        found = re.match(r"\[(\d+):\d+\] -A (INPUT|FORWARD|OUTPUT) (.*-j KUBE-\S+)$", line)
        if found:
            jumps[f"{found.group(2)} {found.group(3)}"] = int(found.group(1))
    return chains, jumps


def nft_chain_handles(env) -> dict[str, int]:
    """Chain name -> handle in iptables-nft's filter table: a chain made again gets a new handle."""
    out = json.loads(env.lab.exec(env.lab.node, "nft", "-j", "-a", "list", "table", "ip", "filter").stdout)
    return {c["chain"]["name"]: c["chain"]["handle"] for c in out["nftables"] if "chain" in c}


@pytest.mark.parametrize("backend", ["legacy", "nft"])
def test_iptables_restarts_leave_their_own_chains_alone(make_env, backend: str) -> None:
    env = make_env(2)
    env.write("web.yaml", *WEB)
    args = [f"--iptables-backend={backend}"]
    proxy = env.start(mode="iptables", args=args)
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)  # counts on the FORWARD -> KUBE-SERVICES jump
    chains, jumps = filter_state(env, backend)
    assert "KUBE-SERVICES" in chains and any(n > 0 for n in jumps.values()), (chains, jumps)
    handles = nft_chain_handles(env) if backend == "nft" else {}
    for restart in range(10):
        assert proxy.terminate() == 0
        proxy = env.start(mode="iptables", args=args)
        log = last_run_log(proxy)
        assert "removed what proxy mode" not in log, f"restart {restart + 1}:\n{log}"
        after_chains, after_jumps = filter_state(env, backend)
        assert after_chains == chains, f"restart {restart + 1}"
        assert after_jumps.keys() == jumps.keys(), f"restart {restart + 1}: {after_jumps}"
        dropped = {rule: (jumps[rule], n) for rule, n in after_jumps.items() if n < jumps[rule]}
        assert not dropped, f"restart {restart + 1}: jump counters went back (deleted and made again): {dropped}"
        jumps = after_jumps
        if backend == "nft":
            assert nft_chain_handles(env) == handles, f"restart {restart + 1}: filter chains made again"
    env.assert_reaches("tcp", WEB_IP, 80, BOTH)
