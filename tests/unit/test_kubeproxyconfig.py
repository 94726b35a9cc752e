"""`--config FILE`: upstream's KubeProxyConfiguration read onto the settings, field by field; what pyproxy
refuses named with its field and file; the flags beside it as upstream treats them; `--write-config-to`
read back as the same settings; and kubeadm's ConfigMaps (tests/unit/kubeproxyconfig/) taken as they are."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from pyproxy import cli
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.proxier.config import ProxySettings
from pyproxy.proxier.kubeproxyconfig import ConfigFileError, dump, parse

FIXTURES = Path(__file__).parent / "kubeproxyconfig"
HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def configmap(name: str) -> str:
    """The config.conf of a ConfigMap fixture, as kube-proxy's DaemonSet mounts it."""
    return yaml.safe_load((FIXTURES / name).read_text())["data"]["config.conf"]


def read(body: str) -> ProxySettings:
    return parse(HEAD + body, Path("kp.yaml")).settings


def refused(body: str) -> list[str]:
    with pytest.raises(ConfigFileError) as e:
        parse(HEAD + body, Path("kp.yaml"))
    return e.value.problems


def run_settings(tmp_path: Path, body: str, *flags: str) -> ProxySettings:
    config = tmp_path / "kp.yaml"
    config.write_text(HEAD + body)
    return cli.settings_from(cli.parser().parse_args(["run", f"--config={config}", *flags]))


# ------------------------------------------------------------------------------------------ 1. kubeadm


def test_kubeadms_ipvs_configmap_with_scheduler_lc_works_unchanged() -> None:
    loaded = parse(configmap("kubeadm-ipvs-lc.configmap.yaml"), Path("config.conf"))
    expected = ProxySettings(mode="ipvs")
    expected.ipvs.scheduler = "lc"
    expected.masquerade.cluster_cidr = "10.244.0.0/16"
    expected.connection.kubeconfig = Path("/var/lib/kube-proxy/kubeconfig.conf")
    expected.logging.verbosity = 0  # kubeadm's `verbosity: 0`: upstream's level 0 too
    assert loaded.settings == expected
    assert loaded.warnings == []


def test_kubeadms_iptables_configmap_works_unchanged() -> None:
    loaded = parse(configmap("kubeadm-iptables.configmap.yaml"), Path("config.conf"))
    expected = ProxySettings(mode="iptables", min_sync_period=10.0)
    expected.masquerade.cluster_cidr = "10.244.0.0/16"
    expected.connection.kubeconfig = Path("/var/lib/kube-proxy/kubeconfig.conf")
    expected.logging.verbosity = 0  # kubeadm's `verbosity: 0`: upstream's level 0 too
    assert loaded.settings == expected
    assert loaded.warnings == []


def test_zero_values_are_the_defaults() -> None:
    """kubeadm writes every field; "", 0s, null and false mean "the default", as upstream's defaulting."""
    assert read("mode: ''\niptables: {syncPeriod: 0s, minSyncPeriod: 0s, masqueradeBit: null}\n"
                "conntrack: {tcpEstablishedTimeout: null, udpTimeout: 0s}\nhealthzBindAddress: ''\n") == \
        ProxySettings()
    assert read("") == ProxySettings()


# ------------------------------------------------------------------------------------------ 2. fields


@pytest.mark.parametrize(("body", "attr", "value"), [
    ("mode: bpf", "mode", "bpf"),
    ("mode: nftables", "mode", "nftables"),
    ("hostnameOverride: ' Node-1 '", "hostname_override", "node-1"),
    ("healthzBindAddress: 127.0.0.1:9999", "healthz_bind_address", "127.0.0.1:9999"),
    ("healthzBindAddress: 127.0.0.1", "healthz_bind_address", "127.0.0.1:10256"),  # upstream appends the port
    ("metricsBindAddress: 0.0.0.0", "metrics_bind_address", "0.0.0.0:10249"),
    ("metricsBindAddress: 0.0.0.0:9100", "metrics_bind_address", "0.0.0.0:9100"),
    ("nodePortAddresses: [10.0.0.0/8, 192.168.0.0/16]", "nodeport_addresses", ("10.0.0.0/8", "192.168.0.0/16")),
    ("nodePortAddresses: [primary]", "nodeport_addresses", ("primary",)),
    ("nodePortAddresses: [all]", "nodeport_addresses", ()),
    ("iptables: {syncPeriod: 1m0s, minSyncPeriod: 2s}", "sync_period", 60.0),
    ("iptables: {minSyncPeriod: 2s}", "min_sync_period", 2.0),
    ("mode: ipvs\nipvs: {syncPeriod: 45s}\niptables: {syncPeriod: 1h}", "sync_period", 45.0),
    ("mode: ipvs\nipvs: {minSyncPeriod: 5s}", "min_sync_period", 5.0),
    ("mode: nftables\nnftables: {syncPeriod: 2m}\niptables: {syncPeriod: 1h}", "sync_period", 120.0),
    ("mode: bpf\niptables: {syncPeriod: 40s}", "sync_period", 40.0),  # every mode but ipvs/nftables: iptables'
    ("clusterCIDR: 10.244.0.0/16", "masquerade.cluster_cidr", "10.244.0.0/16"),
    ("clusterCIDR: 10.244.0.0/16,fd00:10:244::/56", "masquerade.cluster_cidr", "10.244.0.0/16"),
    ("clusterCIDR: 10.244.0.0/16, fd00:10:244::/56", "masquerade.cluster_cidr6", "fd00:10:244::/56"),
    ("clusterCIDR: fd00:10:244::/56", "masquerade.cluster_cidr", None),
    ("iptables: {masqueradeAll: true}", "masquerade.masquerade_all", True),
    ("iptables: {masqueradeBit: 0}", "masquerade.masquerade_bit", 0),  # a pointer: 0 is bit 0, not the default
    ("mode: nftables\nnftables: {masqueradeBit: 9, masqueradeAll: true}", "masquerade.masquerade_bit", 9),
    ("ipvs: {scheduler: sh}", "ipvs.scheduler", "sh"),
    ("clientConnection: {kubeconfig: /etc/kp.conf}", "connection.kubeconfig", Path("/etc/kp.conf")),
    ("conntrack: {tcpEstablishedTimeout: 2h0m0s}", "bpf.ct_timeouts.tcp_established", 7200.0),
    ("conntrack: {tcpCloseWaitTimeout: 30m}", "bpf.ct_timeouts.tcp_closing", 1800.0),
    ("conntrack: {udpTimeout: 10s}", "bpf.ct_timeouts.udp_new", 10.0),
    ("conntrack: {udpStreamTimeout: 5m}", "bpf.ct_timeouts.udp_established", 300.0),
    ("bpf: {tcpSynTimeout: 20s}", "bpf.ct_timeouts.tcp_new", 20.0),
    ("bpf: {tcpCloseTimeout: 5s}", "bpf.ct_timeouts.tcp_closed", 5.0),
    ("bpf: {devices: [eth0, eth1]}", "bpf.devices", ("eth0", "eth1")),
    ("bpf: {devices: [eth0], xdpDevices: [eth0]}", "bpf.xdp_devices", ("eth0",)),
    ("iptables: {localhostNodePorts: false}", "localhost_nodeports", False),  # a pointer: false is "off"
    ("iptables: {localhostNodePorts: null}", "localhost_nodeports", True),
    ("bpf: {socketLB: false}", "bpf.socket_lb", False),
    ("bpf: {socketLBHostNamespaceOnly: true}", "bpf.socket_lb_hostns_only", True),
    ("bpf: {endpointCounters: true}", "bpf.endpoint_counters", True),
    ("bpf: {endpointCounters: false}", "bpf.endpoint_counters", False),
    ("bpf: {cgroupRoot: /sys/fs/cgroup/kubepods}", "bpf.cgroup_root", Path("/sys/fs/cgroup/kubepods")),
    ("bpf: {snatPortRange: 50000-50999}", "bpf.snat_ports", (50000, 50999)),
    ("bpf: {scheduler: maglev}", "bpf.scheduler", "maglev"),
    ("bpf: {xdpMode: native}", "bpf.xdp_mode", "native"),
    ("bpf: {maglevTableSize: 4093}", "bpf.maglev_table_size", 4093),
    ("bpf: {mapSizes: {ct: 1048576, backends: 65536}}", "bpf.max_entries",
     {abi.MAP_CT: 1048576, abi.MAP_BACKENDS: 65536}),
    ("logging: {verbosity: 4}", "logging.verbosity", 4),
    ("logging: {verbosity: 0}", "logging.verbosity", 0),  # kubeadm's: upstream's level 0, not "the default"
    ("logging: {format: json}", "logging.format", "json"),
    ("udpIdleTimeout: 2s", "userspace.udp_idle_timeout", 2.0),  # upstream's userspace proxy's; pyproxy's now
    ("udpIdleTimeout: 0s", "userspace.udp_idle_timeout", 0.25),  # kubeadm's zero: the default
    ("logging: {flushFrequency: 0, options: {json: {infoBufferSize: '0'}}}", "logging.verbosity", 2),
])
def test_each_field_sets_its_setting(body: str, attr: str, value: object) -> None:
    s: object = read(body + "\n")
    for name in attr.split("."):
        s = getattr(s, name)
    assert s == value


def test_the_masquerade_setting_is_shared_by_every_mode() -> None:
    s = read("iptables: {masqueradeAll: true, masqueradeBit: 12}\n")
    assert s.iptables.masquerade is s.masquerade and s.ipvs.masquerade is s.masquerade
    assert s.bpf.masquerade.masquerade_bit == 12


@pytest.mark.parametrize(("body", "warning"), [
    ("oomScoreAdj: -999", "oomScoreAdj (-999) has no effect: pyproxy leaves its oom_score_adj"),
    ("conntrack: {maxPerCore: 32768, min: 131072}", "conntrack.maxPerCore (32768) has no effect"),
    ("configSyncPeriod: 15m0s", "configSyncPeriod ('15m0s') has no effect: pyproxy's watches never resync"),
    ("featureGates: {SomeGate: true}", "featureGates ({'SomeGate': True}) has no effect"),
    ("nftables: {masqueradeAll: true}", "nftables.masqueradeAll (True) is not used: mode auto reads "
                                         "iptables.masqueradeAll"),
    ("logging: {flushFrequency: 5s}", "logging.flushFrequency ('5s') has no effect: pyproxy writes each log line"),
    ("logging: {options: {json: {infoBufferSize: 64Ki}}}", "logging.options.json.infoBufferSize ('64Ki') has no "
                                                            "effect"),
])
def test_fields_without_effect_here_are_accepted_with_a_warning(body: str, warning: str) -> None:
    loaded = parse(HEAD + body + "\n", Path("kp.yaml"))
    assert any(line.startswith("kp.yaml: ") and warning in line for line in loaded.warnings), loaded.warnings


# ------------------------------------------------------------------------------------------ 3. refusals


@pytest.mark.parametrize(("body", "message"), [
    ("portRange: 30000-32767", "kp.yaml: portRange: '30000-32767' is not supported: upstream's userspace proxy "
                               "took its per-Service ports from it"),
    ("bindAddressHardFail: true", "kp.yaml: bindAddressHardFail: True is not supported"),
    ("enableProfiling: true", "kp.yaml: enableProfiling: True is not supported: pyproxy serves no /debug/pprof"),
    ("winkernel: {networkName: l2bridge}", "kp.yaml: winkernel.networkName: 'l2bridge' is not supported: "
                                           "pyproxy runs on Linux only"),
    ("detectLocalMode: NodeCIDR", "kp.yaml: detectLocalMode: 'NodeCIDR' is not supported"),
    ("detectLocal: {bridgeInterface: cbr0}", "kp.yaml: detectLocal.bridgeInterface: 'cbr0' is not supported"),
    ("ipvs: {strictARP: true}", "kp.yaml: ipvs.strictARP: True is not supported: pyproxy does not set arp_ignore"),
    ("ipvs: {tcpTimeout: 900s}", "kp.yaml: ipvs.tcpTimeout: '900s' is not supported"),
    ("ipvs: {excludeCIDRs: [10.0.0.0/8]}", "kp.yaml: ipvs.excludeCIDRs: ['10.0.0.0/8'] is not supported"),
    ("conntrack: {tcpBeLiberal: true}", "kp.yaml: conntrack.tcpBeLiberal: True is not supported"),
    ("logging: {vmodule: [{filePattern: proxier, verbosity: 5}]}", "kp.yaml: logging.vmodule: "),
    ("logging: {options: {text: {splitStream: true}}}", "kp.yaml: logging.options.text.splitStream: True is not "
                                                        "supported: pyproxy writes every log line to stderr"),
    ("logging: {format: logfmt}", "kp.yaml: logging.format: must be one of text, json, not 'logfmt'"),
    ("bindAddress: 192.168.1.5", "kp.yaml: bindAddress: '192.168.1.5' is not supported"),
    ("mode: kernelspace", "kp.yaml: mode: kernelspace is upstream's Windows mode (the Windows kernel's HNS load "
                          "balancer); pyproxy runs on Linux only"),
    ("mode: winuserspace", "kp.yaml: mode: winuserspace is upstream's Windows mode"),
    ("mode: kernelspac", "kp.yaml: mode: must be one of auto, bpf, ipvs, nftables, iptables, userspace (or empty: "
                         "auto), not 'kernelspac'"),
    ("conntrack: {tcpEstablishedTimeout: -1s}", "kp.yaml: conntrack.tcpEstablishedTimeout: must be positive"),
    ("clusterCIDR: 10.0.0.0/8,10.1.0.0/16", "kp.yaml: clusterCIDR: '10.0.0.0/8,10.1.0.0/16' holds 2 IPv4 and 0 "
                                            "IPv6 CIDRs; at most one of each"),
    ("clusterCIDR: fd00::/56,fd01::/56", "kp.yaml: clusterCIDR: 'fd00::/56,fd01::/56' holds 0 IPv4 and 2 IPv6"),
    ("clusterCIDR: fd00::/129", "kp.yaml: clusterCIDR must be an IPv4 CIDR such as 10.244.0.0/16 and/or an IPv6 one, "
                                 "comma-separated, not 'fd00::/129'"),
    ("bpf: {snatPortRange: many}", "kp.yaml: bpf.snatPortRange: must be FIRST-LAST"),
    ("bpf: {mapSizes: {pyproxy_ct_v3: 10}}", "kp.yaml: bpf.mapSizes: no map pyproxy_ct_v3: the maps are services,"),
    ("bpf: {mapSizes: {ct: 0}}", "kp.yaml: the capacity of map pyproxy_ct_v3 must be 1.."),
])
def test_what_pyproxy_cannot_honour_is_refused_naming_field_and_file(body: str, message: str) -> None:
    problems = refused(body + "\n")
    assert any(p.startswith(message) for p in problems), problems


@pytest.mark.parametrize(("body", "message"), [
    ("iptables: {syncPeriod: 5s, minSyncPeriod: 10s}",
     "kp.yaml: iptables.syncPeriod (5s) must not be shorter than iptables.minSyncPeriod (10s)"),
    ("mode: ipvs\nipvs: {syncPeriod: -5s}", "kp.yaml: ipvs.syncPeriod must be positive, not -5s"),
    ("mode: nftables\nnftables: {masqueradeBit: 40}", "kp.yaml: nftables.masqueradeBit must be 0..31, not 40"),
    ("clusterCIDR: pods", "kp.yaml: clusterCIDR must be an IPv4 CIDR"),
    ("nodePortAddresses: [eth0]", "kp.yaml: nodePortAddresses: 'eth0' is not a CIDR"),
    ("healthzBindAddress: 'localhost:x'", "kp.yaml: healthzBindAddress: invalid bind address"),
    ("bpf: {scheduler: fastest}", "kp.yaml: bpf.scheduler must be one of"),
    ("bpf: {xdpMode: fastest}", "kp.yaml: bpf.xdpMode must be one of native, best-effort, generic"),
    ("bpf: {maglevTableSize: 1000}", "kp.yaml: bpf.maglevTableSize must be one of"),
    ("bpf: {devices: [eth0], xdpDevices: [eth1]}", "kp.yaml: bpf.xdpDevices names eth1, which bpf.devices leaves out"),
])
def test_values_that_cannot_work_are_refused_naming_the_field(body: str, message: str) -> None:
    problems = refused(body + "\n")
    assert any(p.startswith(message) for p in problems), problems


@pytest.mark.parametrize(("body", "message"), [
    ("proxyMode: ipvs", "kp.yaml: unknown field 'proxyMode'"),
    ("ipvs: {schedular: lc}", "kp.yaml: unknown field 'ipvs.schedular'"),
    ("bpf: {mapSize: {}}", "kp.yaml: unknown field 'bpf.mapSize'"),
    ("iptables: {syncPeriod: 30}", "kp.yaml: field 'iptables.syncPeriod' must be a duration such as 30s or "
                                   "1h0m0s, not 30"),
    ("iptables: {masqueradeAll: 'yes'}", "kp.yaml: field 'iptables.masqueradeAll' must be true or false, not 'yes'"),
    ("nodePortAddresses: 10.0.0.0/8", "kp.yaml: field 'nodePortAddresses' must be a list of strings"),
    ("conntrack: 5", "kp.yaml: field 'conntrack' must be a mapping of maxPerCore"),
    ("bpf: {maglevTableSize: big}", "kp.yaml: field 'bpf.maglevTableSize' must be an integer, not 'big'"),
    ("logging: {verbosity: high}", "kp.yaml: field 'logging.verbosity' must be an integer, not 'high'"),
    ("logging: {verbose: 4}", "kp.yaml: unknown field 'logging.verbose'"),
])
def test_unknown_fields_and_wrong_types_are_refused_naming_field_and_file(body: str, message: str) -> None:
    problems = refused(body + "\n")
    assert any(p.startswith(message) for p in problems), problems


def test_the_api_version_and_kind_must_be_upstreams() -> None:
    with pytest.raises(ConfigFileError) as e:
        parse("apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n", Path("kp.yaml"))
    assert e.value.problems == [
        "kp.yaml: apiVersion: must be kubeproxy.config.k8s.io/v1alpha1, not 'kubeproxy.config.k8s.io/v1beta1'",
        "kp.yaml: kind: must be KubeProxyConfiguration, not 'KubeletConfiguration'"]


def test_a_missing_or_broken_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", f"--config={tmp_path / 'none.yaml'}"]) == 2
    assert f"pyproxy run: error: --config {tmp_path / 'none.yaml'}: No such file" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("mode: [\n")
    assert cli.main(["run", f"--config={broken}"]) == 2
    assert f"pyproxy run: error: {broken}: not YAML" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ 4. precedence


def test_flags_with_a_field_are_ignored_beside_config_as_upstream(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Upstream: "This parameter is ignored if a config file is specified by --config"; pyproxy says so."""
    with caplog.at_level(logging.WARNING):
        s = run_settings(tmp_path, "mode: iptables\nipvs: {scheduler: lc}\n", "--proxy-mode=bpf",
                         "--ipvs-scheduler=rr", "--sync-period=5s", "--conntrack-udp-timeout=5s")
    assert (s.mode, s.ipvs.scheduler, s.sync_period, s.bpf.ct_timeouts) == ("iptables", "lc", 30.0, CtTimeouts())
    ignored = [r.getMessage() for r in caplog.records]
    for flag in ("--proxy-mode", "--ipvs-scheduler", "--sync-period", "--conntrack-udp-timeout"):
        assert f"{flag} is ignored: --config {tmp_path / 'kp.yaml'} is given, whose settings are the file's " \
               "(as upstream's)" in ignored, ignored


@pytest.mark.parametrize(("body", "flags", "verbosity", "fmt"), [
    ("logging: {verbosity: 4, format: json}\n", [], 4, "json"),
    ("logging: {verbosity: 4, format: json}\n", ["-v=6", "--logging-format=text"], 6, "text"),
    ("mode: iptables\n", ["-v=3"], 3, "text"),  # upstream 1.28's regression (kubernetes#119864): -v reset to 0
    ("mode: iptables\n", [], 2, "text"),
])
def test_logging_comes_from_the_file_and_the_flags_win(tmp_path: Path, body: str, flags: list[str],
                                                       verbosity: int, fmt: str) -> None:
    s = run_settings(tmp_path, body, *flags)
    assert (s.logging.verbosity, s.logging.format) == (verbosity, fmt)


def test_the_files_logging_format_shapes_the_lines_logged(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """What an operator sees: with `logging: {format: json}` the file's own warnings already come as JSON."""
    config = tmp_path / "kp.yaml"
    config.write_text(HEAD + "logging: {format: json}\noomScoreAdj: -999\n")
    assert cli.main([f"--config={config}", f"--write-config-to={tmp_path / 'out.yaml'}"]) == 0
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert any("oomScoreAdj (-999) has no effect" in line["msg"] for line in lines), lines


def test_hostname_override_and_the_flags_without_a_field_apply_beside_config(tmp_path: Path) -> None:
    s = run_settings(tmp_path, "hostnameOverride: from-file\n", "--hostname-override=From-Flag",
                     "--master=https://10.0.0.1:6443", f"--source={tmp_path}", "--iptables-backend=nft",
                     "--bpf-pin-path=/sys/fs/bpf/elsewhere")
    assert s.hostname_override == "from-flag"  # upstream: the flag over the file
    assert (s.connection.master, s.source, s.iptables.backend, s.ipvs.iptables_backend, s.bpf.pin_path) == \
        ("https://10.0.0.1:6443", tmp_path, "nft", "nft", Path("/sys/fs/bpf/elsewhere"))


def test_the_daemonsets_cgroup_root_applies_beside_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """deploy/daemonset.yaml passes --cgroup-root (the host's hierarchy as mounted in the pod) beside the shared
    ConfigMap: it must reach the socket hooks, not be ignored as a flag with a field; it wins over the file's."""
    with caplog.at_level(logging.WARNING):
        s = run_settings(tmp_path, "bpf: {cgroupRoot: /from/file}\n", "--cgroup-root=/run/pyproxy/cgroup2")
    assert s.bpf.cgroup_root == Path("/run/pyproxy/cgroup2")
    assert not [r for r in caplog.records if "--cgroup-root is ignored" in r.getMessage()]
    assert run_settings(tmp_path, "bpf: {cgroupRoot: /from/file}\n").bpf.cgroup_root == Path("/from/file")


def test_without_a_subcommand_the_command_line_is_kube_proxys(tmp_path: Path) -> None:
    config = tmp_path / "kp.yaml"
    config.write_text(configmap("kubeadm-ipvs-lc.configmap.yaml"))
    out = tmp_path / "effective.yaml"
    assert cli.main([f"--config={config}", "--hostname-override=node-1", f"--write-config-to={out}"]) == 0
    s = parse(out.read_text(), out).settings
    assert (s.mode, s.ipvs.scheduler, s.hostname_override) == ("ipvs", "lc", "node-1")


@pytest.mark.parametrize(("flags", "mode", "sync", "min_sync"), [
    (["--iptables-sync-period=1m", "--iptables-min-sync-period=2s"], "iptables", 60.0, 2.0),
    (["--iptables-sync-period=1m", "--iptables-min-sync-period=2s"], "ipvs", 30.0, 1.0),  # upstream: not in ipvs
    (["--ipvs-sync-period=1m", "--ipvs-min-sync-period=2s"], "ipvs", 60.0, 2.0),
    (["--ipvs-sync-period=1m", "--ipvs-min-sync-period=2s"], "bpf", 30.0, 1.0),
    (["--iptables-sync-period=1m", "--sync-period=2m"], "auto", 120.0, 1.0),  # pyproxy's own flag wins
])
def test_upstreams_sync_flags_apply_in_their_modes(flags: list[str], mode: str, sync: float,
                                                   min_sync: float) -> None:
    s = cli.settings_from(cli.parser().parse_args(["run", f"--proxy-mode={mode}", *flags]))
    assert (s.sync_period, s.min_sync_period) == (sync, min_sync)


# ------------------------------------------------------------------------------------------ 5. round trip


def every_setting() -> ProxySettings:
    s = ProxySettings(mode="nftables", hostname_override="node-7", nodeport_addresses=("10.0.0.0/8", "fd00::/8"),
                      healthz_bind_address="0.0.0.0:20256", metrics_bind_address="127.0.0.1:20249",
                      min_sync_period=0.25, sync_period=90.0)
    s.connection.kubeconfig = Path("/var/lib/kube-proxy/kubeconfig.conf")
    s.masquerade.cluster_cidr, s.masquerade.masquerade_all, s.masquerade.masquerade_bit = "10.244.0.0/16", True, 0
    s.masquerade.cluster_cidr6 = "fd00:10:244::/56"  # the dual-stack pair, written back as one clusterCIDR
    s.ipvs.scheduler = "wlc"
    s.logging.verbosity, s.logging.format = 0, "json"
    b = s.bpf
    b.devices, b.xdp_devices, b.socket_lb, b.cgroup_root = ("eth0", "eth1"), ("eth0",), False, Path("/sys/fs/cgroup")
    b.snat_ports, b.scheduler, b.maglev_table_size, b.max_entries = (50000, 59999), "maglev", 251, {abi.MAP_CT: 4096}
    b.endpoint_counters = not b.endpoint_counters
    b.ct_timeouts = CtTimeouts(tcp_new=5.0, tcp_established=7200.0, tcp_closing=60.0, tcp_closed=2.5, udp_new=1.5,
                               udp_established=45.0)
    return s


@pytest.mark.parametrize("settings", [ProxySettings(), every_setting(), ProxySettings(mode="ipvs", sync_period=40.0)],
                         ids=["defaults", "every-setting", "ipvs"])
def test_write_config_to_reads_back_as_the_same_settings(settings: ProxySettings) -> None:
    loaded = parse(dump(settings), Path("effective.yaml"))
    assert loaded.settings == settings
    assert loaded.warnings == []


def test_write_config_to_writes_the_effective_settings_and_exits(tmp_path: Path) -> None:
    out = tmp_path / "effective.yaml"
    assert cli.main(["run", "--proxy-mode=ipvs", "--ipvs-scheduler=lc", "--ipvs-sync-period=45s",
                     "--cluster-cidr=10.244.0.0/16", f"--write-config-to={out}"]) == 0
    doc = yaml.safe_load(out.read_text())
    assert (doc["mode"], doc["ipvs"]["scheduler"], doc["ipvs"]["syncPeriod"], doc["clusterCIDR"]) == \
        ("ipvs", "lc", "45s", "10.244.0.0/16")
    again = tmp_path / "again.yaml"
    assert cli.main(["run", f"--config={out}", f"--write-config-to={again}"]) == 0
    assert again.read_text() == out.read_text()


# ------------------------------------------------------------------------------------------ 6. --version, --cleanup


def test_version_prints_pyprojects_version(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["run", "--version"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        assert capsys.readouterr().out.strip() == f"pyproxy {cli.version()}"
    assert cli.version() not in ("", "unknown (not installed)")


def test_cleanup_flag_does_what_the_cleanup_command_does(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    seen = []
    monkeypatch.setattr(cli.app, "cleanup", lambda s: seen.append(s) or ["bpf: /sys/fs/bpf/pyproxy"])
    monkeypatch.setattr(cli.app, "run", lambda s: pytest.fail("--cleanup must not run the proxy"))
    assert cli.main(["--cleanup", "--bpf-pin-path=/sys/fs/bpf/x"]) == 0
    assert seen[0].bpf.pin_path == Path("/sys/fs/bpf/x")
    assert capsys.readouterr().out == "removed bpf: /sys/fs/bpf/pyproxy\n"


def test_the_daemonsets_own_configmap_is_accepted() -> None:
    """deploy/configmap.yaml, the kube-proxy ConfigMap pyproxy's DaemonSet reads, loads without a refusal."""
    doc = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "configmap.yaml").read_text())
    loaded = parse(doc["data"]["config.conf"], Path("config.conf"))
    assert loaded.settings.connection.kubeconfig == Path("/var/lib/kube-proxy/kubeconfig.conf")
    assert loaded.settings.healthz_bind_address == "0.0.0.0:10256"
