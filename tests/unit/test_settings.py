"""Settings: durations as upstream writes them, every setting checked before a start with its flag named, the
command line mapping flags onto the settings dataclasses (whose defaults are the only ones)."""

from __future__ import annotations

import dataclasses

import pytest

from pyproxy import cli
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.proxier import app, modes
from pyproxy.proxier.config import ProxySettings, SettingError, format_duration, parse_duration


@pytest.mark.parametrize(("text", "seconds"), [
    ("24h0m0s", 86400.0), ("1h", 3600.0), ("30s", 30.0), ("250ms", 0.25), ("1h30m", 5400.0), ("1.5h", 5400.0),
    ("2m0.5s", 120.5), ("1500us", 0.0015), ("1500\u00b5s", 0.0015), ("10ns", 1e-8), ("0s", 0.0), ("0", 0.0),
    ("-1s", -1.0), ("-1", -1.0), ("+5s", 5.0), ("90", 90.0), ("0.5", 0.5), (".5s", 0.5), (" 30s ", 30.0),
])
def test_durations_are_go_durations_or_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "fast", "1x", "1h 30m", "1d", "--1s", "inf", "nan", "1e3", "1h-5m", "-"])
def test_what_is_not_a_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [
    (86400.0, "24h0m0s"), (3600.0, "1h0m0s"), (120.0, "2m0s"), (30.0, "30s"), (0.25, "250ms"), (0.0, "0s"),
    (-1.0, "-1s"), (5400.5, "1h30m0.5s"),
])
def test_durations_print_as_go_prints_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


def problems(**changes: object) -> list[str]:
    s = ProxySettings()
    for path, value in changes.items():
        *parents, name = path.split("__")
        target = s
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return s.problems()


def test_the_defaults_are_valid() -> None:
    assert ProxySettings().problems() == []
    ProxySettings().validate()


@pytest.mark.parametrize(("changes", "expected"), [
    ({"sync_period": 0.0}, "--sync-period must be positive, not 0s"),
    ({"sync_period": -30.0}, "--sync-period must be positive, not -30s"),
    ({"min_sync_period": -1.0}, "--min-sync-period must not be negative, not -1s"),
    ({"min_sync_period": 60.0}, "--sync-period (30s) must not be shorter than --min-sync-period (1m0s)"),
    ({"full_sync_period": 0.0}, "the full sync period must be positive, not 0s"),
    ({"healthz_bind_address": "10256"}, "--healthz-bind-address: invalid bind address '10256'"),
    ({"metrics_bind_address": "127.0.0.1:99999"}, "--metrics-bind-address: invalid bind address"),
    ({"masquerade__masquerade_bit": 32}, "--iptables-masquerade-bit must be 0..31, not 32"),
    ({"masquerade__cluster_cidr": "10.244.0.0/33"}, "--cluster-cidr must be an IPv4 CIDR"),
    ({"ipvs__scheduler": ""}, "--ipvs-scheduler must name a scheduler"),
    ({"ipvs__graceful_termination_seconds": -1.0}, "IPVS graceful termination period must not be negative"),
    ({"bpf__devices": ("eth0",), "bpf__xdp_devices": ("eth1",)}, "--xdp-devices names eth1, which --devices"),
    ({"bpf__max_entries": {"pyproxy_ct_v3": 0}}, "the capacity of map pyproxy_ct_v3 must be"),
    ({"bpf__ct_timeouts": CtTimeouts(tcp_established=5e6)}, "tcp_established is too long"),
    ({"bpf__snat_ports": (61000, 70000)}, "--bpf-snat-port-range must be FIRST-LAST within 1024-65535"),
    ({"bpf__snat_ports": (62000, 61000)}, "--bpf-snat-port-range must be FIRST-LAST within 1024-65535"),
    ({"nodeport_addresses": ("10.0.0.0/33",)}, "--nodeport-addresses: '10.0.0.0/33' is not a CIDR"),
    ({"nodeport_addresses": ("10.0.0.1",)}, "--nodeport-addresses: '10.0.0.1' is not a CIDR"),
    ({"nodeport_addresses": ("primary", "10.0.0.0/8")}, "--nodeport-addresses: 'primary' is not a CIDR (or a lone"),
])
def test_each_wrong_setting_is_named_by_its_flag(changes: dict[str, object], expected: str) -> None:
    found = problems(**changes)
    assert len(found) == 1 and expected in found[0], found


def test_validate_raises_what_problems_lists() -> None:
    with pytest.raises(SettingError, match="--sync-period must be positive") as e:
        ProxySettings(sync_period=0.0).validate()
    assert e.value.problems == ProxySettings(sync_period=0.0).problems()


def test_zero_min_sync_period_means_no_pause_as_upstream() -> None:
    assert problems(min_sync_period=0.0) == []


def test_every_problem_is_reported_at_once() -> None:
    assert len(problems(sync_period=0.0, min_sync_period=-1.0, masquerade__masquerade_bit=40)) == 3


def test_a_start_with_wrong_settings_changes_nothing() -> None:
    with pytest.raises(app.StartupError, match="--sync-period must be positive"):
        app.run(ProxySettings(sync_period=0.0))  # before any mode starts (this would attach programs)


# -------------------------------------------------------------------------------------------- command line


def settings(*argv: str) -> ProxySettings:
    return cli.settings_from(cli.parser().parse_args(["run", *argv]))


def test_no_flag_means_the_dataclasses_defaults() -> None:
    assert settings() == ProxySettings()
    inspect = cli.settings_from(cli.parser().parse_args(["inspect"]))
    assert inspect.bpf.pin_path == ProxySettings().bpf.pin_path


def test_flags_set_their_settings() -> None:
    s = settings("--sync-period=1h", "--min-sync-period=250ms", "--masquerade-all", "--cluster-cidr=10.0.0.0/8",
                 "--iptables-backend=nft", "--devices=eth0,eth1", "--xdp-devices=eth0", "--bpf-pin-path=/run/x")
    assert (s.sync_period, s.min_sync_period) == (3600.0, 0.25)
    assert s.masquerade.masquerade_all and s.masquerade.cluster_cidr == "10.0.0.0/8"
    assert s.iptables.masquerade is s.masquerade and s.nftables.masquerade.masquerade_all
    assert s.iptables.backend == s.ipvs.iptables_backend == "nft"
    assert s.bpf.devices == ("eth0", "eth1") and s.bpf.xdp_devices == ("eth0",) and str(s.bpf.pin_path) == "/run/x"
    assert settings("--sync-period=45").sync_period == 45.0


def test_cluster_cidr_takes_one_cidr_per_family_as_upstream() -> None:
    s = settings("--cluster-cidr=10.244.0.0/16,fd00:10:244::/56")
    assert (s.masquerade.cluster_cidr, s.masquerade.cluster_cidr6) == ("10.244.0.0/16", "fd00:10:244::/56")
    assert s.masquerade.cluster_cidr_of(6) == "fd00:10:244::/56"
    s = settings("--cluster-cidr=fd00:10:244::/56")
    assert (s.masquerade.cluster_cidr, s.masquerade.cluster_cidr6) == (None, "fd00:10:244::/56")
    with pytest.raises(SettingError, match="--cluster-cidr '10.0.0.0/8,10.1.0.0/16' holds 2 IPv4 and 0 IPv6 CIDRs"):
        settings("--cluster-cidr=10.0.0.0/8,10.1.0.0/16")
    with pytest.raises(SettingError, match="--cluster-cidr must be an IPv4 CIDR .* not 'pods'"):
        settings("--cluster-cidr=pods,fd00::/56")


def test_endpoint_counters_are_a_flag_and_its_negation() -> None:
    assert settings("--bpf-endpoint-counters").bpf.endpoint_counters is True
    assert settings("--no-bpf-endpoint-counters").bpf.endpoint_counters is False
    assert settings().bpf.endpoint_counters is ProxySettings().bpf.endpoint_counters


def test_udp_timeout_sets_the_userspace_modes_udp_idle_timeout(capsys) -> None:
    assert ProxySettings().userspace.udp_idle_timeout == 0.25  # upstream's udpIdleTimeout default
    assert settings("--udp-timeout=2s").userspace.udp_idle_timeout == 2.0
    assert modes.unhonoured(settings("--udp-timeout=2s"), "bpf") == [
        "bpf mode does not honour --udp-timeout (set to 2s): only the userspace mode does"]
    with pytest.raises(SettingError, match="--udp-timeout must be positive"):
        settings("--udp-timeout=0")


@pytest.mark.parametrize("mode", ["kernelspace", "winuserspace"])
def test_upstreams_windows_modes_end_the_command_saying_linux_only(monkeypatch, capsys, mode: str) -> None:
    monkeypatch.setattr(app, "run", lambda _s: pytest.fail("pyproxy started in a Windows mode"))
    assert cli.main(["run", f"--proxy-mode={mode}"]) == 2
    what = {"kernelspace": "the Windows kernel's HNS load balancer", "winuserspace": "a userspace proxy for Windows"}
    assert capsys.readouterr().err == (f"pyproxy run: error: --proxy-mode: {mode} is upstream's Windows mode "
                                       f"({what[mode]}); pyproxy runs on Linux only (its last fallback: userspace)\n")
    with pytest.raises(modes.NoModeAvailable, match="pyproxy runs on Linux only"):
        modes.start_dataplane(ProxySettings(mode=mode))


def test_the_snat_port_range_is_first_dash_last(capsys) -> None:
    assert settings("--bpf-snat-port-range=40000-40100").bpf.snat_ports == (40000, 40100)
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--bpf-snat-port-range=40000"])
    assert exited.value.code == 2 and "expected FIRST-LAST" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [
    ("--nodeport-addresses=10.0.0.0/8, 192.168.1.0/24", ("10.0.0.0/8", "192.168.1.0/24")),
    ("--nodeport-addresses=primary", ("primary",)),
    ("--nodeport-addresses=", ()),  # empty: the default, every node address
])
def test_nodeport_addresses_take_cidrs_or_primary(flag: str, value: tuple[str, ...]) -> None:
    assert settings(flag).nodeport_addresses == value


def test_a_wrong_nodeport_address_ends_the_command_naming_the_flag(monkeypatch, capsys) -> None:
    monkeypatch.setattr(app, "run", lambda _s: 0)
    assert cli.main(["run", "--nodeport-addresses=10.0.0.0/8,eth0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pyproxy run: error: --nodeport-addresses: 'eth0' is not a CIDR (or a lone 'primary')"]


@pytest.mark.parametrize(("flag", "field"), [(ct.flag, ct.field) for ct in cli.CT_FLAGS])
def test_conntrack_flags_set_their_timeout(flag: str, field: str) -> None:
    s = settings(f"{flag}=1h2m3s")
    assert s.bpf.ct_timeouts == dataclasses.replace(CtTimeouts(), **{field: 3723.0})


def test_upstreams_conntrack_flags_take_zero_as_the_default_and_pyproxys_refuse_it() -> None:
    assert settings("--conntrack-tcp-timeout-established=0s", "--conntrack-udp-timeout=0").bpf.ct_timeouts == \
        CtTimeouts()
    with pytest.raises(SettingError, match="--bpf-ct-tcp-close-timeout must be positive, not 0s"):
        settings("--bpf-ct-tcp-close-timeout=0")
    with pytest.raises(SettingError, match="--conntrack-udp-timeout-stream must not be negative, not -5s"):
        settings("--conntrack-udp-timeout-stream=-5s")


def test_the_command_line_refuses_wrong_settings_with_status_2(monkeypatch, capsys) -> None:
    def started(_settings: ProxySettings) -> int:
        raise AssertionError("pyproxy started with settings it should have refused")

    monkeypatch.setattr(app, "run", started)
    assert cli.main(["run", "--sync-period=0", "--min-sync-period=-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["pyproxy run: error: --sync-period must be positive, not 0s (0 would sync without a pause, "
                   "spinning a core)", "pyproxy run: error: --min-sync-period must not be negative, not -1s"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--sync-period=soon"])
    assert exit_.value.code == 2
    assert "argument --sync-period: not a duration: 'soon'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- what each mode honours


def test_defaults_warn_of_nothing_in_any_mode() -> None:
    assert all(modes.unhonoured(ProxySettings(), mode) == [] for mode in modes.AUTO_ORDER)


def test_a_setting_the_mode_does_not_act_on_is_named() -> None:
    s = settings("--masquerade-all", "--cluster-cidr=10.244.0.0/16", "--xdp-devices=eth0", "--ipvs-scheduler=lc")
    assert modes.unhonoured(s, "bpf") == [
        "bpf mode does not honour --ipvs-scheduler (set to lc): only the ipvs mode does",
    ], "every mode masquerades as --masquerade-all and --cluster-cidr say"
    assert [line.split(" (")[0] for line in modes.unhonoured(s, "iptables")] == [
        "iptables mode does not honour --xdp-devices", "iptables mode does not honour --ipvs-scheduler"]
    assert [line.split(" (")[0] for line in modes.unhonoured(s, "ipvs")] == ["ipvs mode does not honour --xdp-devices"]
    ct = settings("--conntrack-udp-timeout=1m")
    assert modes.unhonoured(ct, "bpf") == []
    assert modes.unhonoured(ct, "nftables") == [
        "nftables mode does not honour --conntrack-udp-timeout (set to 1m0s): only the bpf mode does"]


def test_the_table_names_real_flags_and_every_mode_setting() -> None:
    run = cli.parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    flags = {o for action in run._actions for o in action.option_strings}
    listed = {h.flag for h in modes.HONOURED_BY}
    assert listed <= flags
    # The flags that set a mode's own settings (bpf.*, masquerade.*, iptables.*, ipvs.*) are all in the table,
    # but the pin path (every mode's start cleans up the bpf mode's pins) and the masquerade policy every mode
    # follows; and the node's own setting only some modes serve (NodePorts on 127.0.0.1).
    mode_flags = {f"--{dest.replace('_', '-')}" for dest, paths in cli.SETTINGS.items()
                  if paths[0].split(".")[0] in ("bpf", "masquerade", "iptables", "ipvs", "nftables", "userspace")}
    every_mode = {"--bpf-pin-path", "--cluster-cidr", "--masquerade-all"}
    node = {"--iptables-localhost-nodeports"}
    assert mode_flags - every_mode | {ct.flag for ct in cli.CT_FLAGS} | node == listed


@pytest.mark.parametrize(("args", "value"), [((), True), (("--iptables-localhost-nodeports=false",), False),
                                             (("--iptables-localhost-nodeports",), True),
                                             (("--iptables-localhost-nodeports=true",), True)])
def test_localhost_nodeports_is_upstreams_flag_and_on_by_default(args: tuple[str, ...], value: bool) -> None:
    assert settings(*args).localhost_nodeports is value


def test_a_localhost_nodeports_value_that_is_no_boolean_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings("--iptables-localhost-nodeports=maybe")
    assert "expected true or false, not 'maybe'" in capsys.readouterr().err


def test_socket_lb_hostns_only_is_a_flag_and_off_by_default() -> None:
    assert settings("--bpf-socket-lb-hostns-only").bpf.socket_lb_hostns_only is True
    assert settings("--no-bpf-socket-lb-hostns-only").bpf.socket_lb_hostns_only is False
    assert settings().bpf.socket_lb_hostns_only is False
