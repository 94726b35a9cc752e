"""The `pyproxy` command: flags (named as upstream kube-proxy's) mapped onto settings, nothing more.

Every flag that sets a setting defaults to None, "not given": the defaults are the settings dataclasses' own
(pyproxy/proxier/config.py and each dataplane's), written once there. A value no setting can hold ends the
command with status 2 and one line per wrong flag, before anything is changed.

With `--config FILE` the settings are the file's (pyproxy/proxier/kubeproxyconfig.py) and, as upstream's
kube-proxy does, the flags that have a field in it are ignored, each with a warning; only the flags with no
field there still apply (ALONGSIDE_CONFIG), --hostname-override over the file's hostnameOverride as upstream.
A command line without a subcommand is `run`'s, so kube-proxy's `--config FILE --hostname-override=NAME`
works as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import sys
from pathlib import Path
from typing import NamedTuple

from pyproxy import logs
from pyproxy.dataplane import trace
from pyproxy.dataplane.bpf import abi
from pyproxy.dataplane.bpf.conntrack import CtTimeouts
from pyproxy.dataplane.bpf.settings import LOADERS, XDP_MODES
from pyproxy.model import inspection
from pyproxy.proxier import app, kubeproxyconfig
from pyproxy.proxier.config import WINDOWS_MODES, ProxySettings, SettingError, format_duration, parse_duration
from pyproxy.proxier.modes import MODES

DEFAULTS = ProxySettings()

# The flags that set one setting each: argparse's dest -> the settings attributes (dotted paths) it sets.
SETTINGS: dict[str, tuple[str, ...]] = {
    "bpf_pin_path": ("bpf.pin_path",),
    "proxy_mode": ("mode",),
    "source": ("source",),
    "kubeconfig": ("connection.kubeconfig",),
    "master": ("connection.master",),
    "hostname_override": ("hostname_override",),
    "devices": ("bpf.devices",),
    "xdp_devices": ("bpf.xdp_devices",),
    "bpf_xdp_mode": ("bpf.xdp_mode",),
    "bpf_socket_lb": ("bpf.socket_lb",),
    "bpf_socket_lb_hostns_only": ("bpf.socket_lb_hostns_only",),
    "cgroup_root": ("bpf.cgroup_root",),
    "bpf_snat_port_range": ("bpf.snat_ports",),
    "bpf_scheduler": ("bpf.scheduler",),
    "bpf_loader": ("bpf.loader",),
    "bpf_maglev_table_size": ("bpf.maglev_table_size",),
    "bpf_map_sizes": ("bpf.max_entries",),
    "bpf_endpoint_counters": ("bpf.endpoint_counters",),
    "cluster_cidr": ("masquerade.cluster_cidr",),
    "masquerade_all": ("masquerade.masquerade_all",),
    "iptables_masquerade_bit": ("masquerade.masquerade_bit",),
    "iptables_backend": ("iptables.backend", "ipvs.iptables_backend"),
    "ipvs_scheduler": ("ipvs.scheduler",),
    "udp_timeout": ("userspace.udp_idle_timeout",),
    "nodeport_addresses": ("nodeport_addresses",),
    "iptables_localhost_nodeports": ("localhost_nodeports",),
    "healthz_bind_address": ("healthz_bind_address",),
    "metrics_bind_address": ("metrics_bind_address",),
    "min_sync_period": ("min_sync_period",),
    "sync_period": ("sync_period",),
    "v": ("logging.verbosity",),
    "logging_format": ("logging.format",),
}

# Flags with no field in a KubeProxyConfiguration, which apply beside --config (upstream: --master, and
# --hostname-override over the file's hostnameOverride); -v and --logging-format, which win over the file's
# `logging` block as upstream's since 1.28 (kubernetes#119864: a file without the block reset -v to 0); and
# --cgroup-root over the file's bpf.cgroupRoot: where the host's cgroup hierarchy is mounted is the pod's
# business (deploy/daemonset.yaml), not the ConfigMap's, which every node and kube-proxy itself share.
ALONGSIDE_CONFIG = frozenset({"source", "master", "hostname_override", "iptables_backend", "bpf_pin_path", "v",
                              "logging_format", "cgroup_root"})


class SyncFlag(NamedTuple):
    setting: str
    ipvs: bool
    """Whether upstream applies it in ipvs mode only (else in every mode but ipvs)."""


# Upstream's per-mode sync flags onto the one pair of settings, applied as upstream's processV1Alpha1Flags does;
# pyproxy's own --sync-period and --min-sync-period, in every mode, win over them.
SYNC_FLAGS = {
    "--iptables-sync-period": SyncFlag("sync_period", False),
    "--iptables-min-sync-period": SyncFlag("min_sync_period", False),
    "--ipvs-sync-period": SyncFlag("sync_period", True),
    "--ipvs-min-sync-period": SyncFlag("min_sync_period", True),
}

# Connection-tracking timeout flags: the CtTimeouts field each sets, and whether 0 means "the default".
# Upstream's --conntrack-* flags take 0 as "leave the kernel's value as it is", which here is the default (the
# defaults are the kernel's and kube-proxy's); the --bpf-ct-* flags are pyproxy's own and must be positive.
class CtFlag(NamedTuple):
    flag: str
    field: str
    zero_keeps_default: bool
    what: str


CT_FLAGS = (
    CtFlag("--conntrack-tcp-timeout-established", "tcp_established", True, "a TCP flow past its handshake"),
    CtFlag("--conntrack-tcp-timeout-close-wait", "tcp_closing", True, "a TCP flow half-closed by a FIN"),
    CtFlag("--conntrack-udp-timeout", "udp_new", True, "a UDP flow with no reply yet, or a single exchange"),
    CtFlag("--conntrack-udp-timeout-stream", "udp_established", True,
           "a UDP stream (replies, and packets more than 2 s after the first)"),
    CtFlag("--bpf-ct-tcp-syn-timeout", "tcp_new", False, "a TCP flow whose SYN got no answer yet"),
    CtFlag("--bpf-ct-tcp-syn-recv-timeout", "tcp_syn_recv", False,
           "a half-open TCP flow: SYN-ACK seen, not yet the client's ACK"),
    CtFlag("--bpf-ct-tcp-time-wait-timeout", "tcp_time_wait", False, "a TCP flow after FINs both ways"),
    CtFlag("--bpf-ct-tcp-close-timeout", "tcp_closed", False, "a TCP flow after a RST"),
)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v for v in (x.strip() for x in value.split(",")) if v)


def _duration(value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _go_bool(value: str) -> bool:
    """A boolean flag's value as upstream's (Go's strconv.ParseBool): --flag=false turns a default-true one off."""
    lowered = value.strip().lower()
    if lowered in ("1", "t", "true"):
        return True
    if lowered in ("0", "f", "false"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def _port_range(value: str) -> tuple[int, int]:
    """FIRST-LAST, as upstream's --service-node-port-range."""
    lo, _, hi = value.partition("-")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST, such as 61000-65535, not {value!r}") from None


def _map_sizes(value: str) -> dict[str, int]:
    """NAME=ENTRIES,... with abi.RESIZABLE's short names -> BpfSettings.max_entries (by map name)."""
    sizes = {}
    for item in _csv(value):
        name, _, n = item.partition("=")
        if name.strip() not in abi.RESIZABLE or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"expected NAME=ENTRIES with NAME one of {', '.join(abi.RESIZABLE)}, not {item!r}")
        sizes[abi.RESIZABLE[name.strip()]] = int(n)
    return sizes


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def version() -> str:
    try:
        return importlib.metadata.version("pyproxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _add_common(p: argparse.ArgumentParser, nested: bool = False) -> None:
    # A nested subcommand's flags must not overwrite, with their defaults, what was given before its name.
    p.add_argument("--bpf-pin-path", type=Path, default=argparse.SUPPRESS if nested else None,
                   help=f"where BPF maps are pinned, a bpffs mounted there when none is (default: "
                        f"{DEFAULTS.bpf.pin_path})")
    p.add_argument("-v", "--v", type=int, default=argparse.SUPPRESS if nested else None,
                   help=f"log verbosity as upstream's: info lines of this verbosity and below (0: only what every "
                        f"operator needs; 2: sync summaries; 5 and more: debug; default: "
                        f"{DEFAULTS.logging.verbosity}); over --config's logging.verbosity")
    p.add_argument("--logging-format", choices=logs.FORMATS, default=argparse.SUPPRESS if nested else None,
                   help=f"text or json: one JSON object a line with upstream's keys (ts, v, msg, ...) (default: "
                        f"{DEFAULTS.logging.format}); over --config's logging.format")


def parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    ap = argparse.ArgumentParser(prog="pyproxy", description="A Kubernetes service proxy with an eBPF dataplane")
    ap.add_argument("--version", action="version", version=f"pyproxy {version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="watch Services and EndpointSlices and program the dataplane",
                         epilog="Durations take Go's form (24h0m0s, 1h, 30s, 250ms) or plain seconds.")
    run.add_argument("--version", action="version", version=f"pyproxy {version()}")
    run.add_argument("--config", type=Path, metavar="FILE",
                     help="a KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1), as in kube-proxy's "
                          "ConfigMap; the flags it has fields for are then ignored, as upstream")
    run.add_argument("--write-config-to", type=Path, metavar="FILE",
                     help="write the effective settings as a KubeProxyConfiguration to FILE and exit")
    run.add_argument("--cleanup", action="store_true", help="do what `pyproxy cleanup` does, then exit (upstream's)")
    run.add_argument("--proxy-mode", choices=(*MODES, *WINDOWS_MODES), metavar="{" + ",".join(MODES) + "}",
                     help=f"the dataplane to program; auto: the first of bpf, ipvs, nftables, iptables, userspace "
                          f"that works (default: {d.mode})")
    run.add_argument("--source", type=Path,
                     help="read a manifest file or folder (v1 Services, EndpointSlices) instead of the API")
    run.add_argument("--kubeconfig", type=Path, help="kubeconfig file of the API server to follow")
    run.add_argument("--master", help="the API server's URL (overrides the kubeconfig's server)")
    run.add_argument("--hostname-override", help="the name of this node (default: the host name)")
    run.add_argument("--devices", type=_csv,
                     help="comma-separated devices to attach to (default: every non-loopback Ethernet device)")
    run.add_argument("--xdp-devices", type=_csv, help="devices that also get the XDP program (bpf mode)")
    run.add_argument("--bpf-xdp-mode", choices=XDP_MODES,
                     help="bpf mode: native, the driver's XDP or an error naming why not (the device keeps TC); "
                          "best-effort, native else generic with a warning; generic, always skb mode "
                          f"(default: {d.bpf.xdp_mode})")
    run.add_argument("--bpf-socket-lb", action=argparse.BooleanOptionalAction,
                     help="bpf mode: the node's own processes reach Services through cgroup socket hooks "
                          f"(default: {'on' if d.bpf.socket_lb else 'off'})")
    run.add_argument("--bpf-socket-lb-hostns-only", action=argparse.BooleanOptionalAction,
                     help="bpf mode: the socket hooks translate the node's own network namespace only; pods' "
                          "connections keep their Service address and are translated by TC (default: "
                          f"{'on' if d.bpf.socket_lb_hostns_only else 'off'})")
    run.add_argument("--cgroup-root", type=Path,
                     help="bpf mode: the cgroup v2 directory the socket hooks go on (default: the root of the "
                          "node's cgroup v2 hierarchy)")
    run.add_argument("--bpf-snat-port-range", type=_port_range, metavar="FIRST-LAST",
                     help="bpf mode: the source ports SNAT gives out; reserved from the node's ephemeral ports "
                          f"where they overlap (default: {d.bpf.snat_ports[0]}-{d.bpf.snat_ports[1]})")
    run.add_argument("--bpf-scheduler",
                     help="bpf mode: how a new flow's endpoint is chosen where a Service's pyproxy.io/scheduler "
                          f"annotation does not say: random, rr, wrr, lc, sed, nq, sh, dh, maglev "
                          f"(default: {d.bpf.scheduler})")
    run.add_argument("--bpf-loader", choices=LOADERS,
                     help="bpf mode: what loads the programs: libbpf, the prebuilt bpf/build/pyproxy.bpf.o; bcc, "
                          "bpf/ compiled at start by BCC (make install-bcc; slower to start) "
                          f"(default: {d.bpf.loader})")
    run.add_argument("--bpf-maglev-table-size", type=int,
                     help="bpf mode: entries of each Maglev lookup table, a prime: 251, 509, 1021, 2039, 4093, "
                          f"8191, 16381, 32749, 65521 (default: {d.bpf.maglev_table_size})")
    run.add_argument("--bpf-map-sizes", type=_map_sizes, metavar="NAME=ENTRIES,...",
                     help="bpf mode: map capacities, by " + ", ".join(abi.RESIZABLE) + " (default: the "
                          "PYPROXY_MAX_* of bpf/include/pyproxy/abi.h)")
    run.add_argument("--bpf-endpoint-counters", action=argparse.BooleanOptionalAction,
                     help="bpf mode: count packets and bytes per endpoint address:port for "
                          "pyproxy_endpoint_packets_total and pyproxy_endpoint_bytes_total (default: "
                          f"{'on' if d.bpf.endpoint_counters else 'off'})")
    run.add_argument("--cluster-cidr", help="masquerade ClusterIP traffic from outside this range (one CIDR per "
                                            "family, comma-separated)")
    run.add_argument("--masquerade-all", action="store_true", default=None,
                     help="masquerade all ClusterIP traffic")
    run.add_argument("--iptables-masquerade-bit", type=int,
                     help=f"fwmark bit marking packets for SNAT (default: {d.masquerade.masquerade_bit})")
    run.add_argument("--iptables-backend", choices=("auto", "legacy", "nft"),
                     help="iptables flavour for the iptables and ipvs modes; auto: whatever `iptables` is "
                          f"here (default: {d.iptables.backend})")
    run.add_argument("--ipvs-scheduler", help=f"IPVS scheduler: rr, wrr, lc, wlc, sh, dh, ... for Services "
                                              f"whose pyproxy.io/scheduler names none IPVS has "
                                              f"(default: {d.ipvs.scheduler})")
    run.add_argument("--udp-timeout", type=_duration, metavar="DURATION",
                     help="userspace mode: how long an idle UDP session lasts (upstream's flag; default: "
                          f"{format_duration(d.userspace.udp_idle_timeout)})")
    run.add_argument("--nodeport-addresses", type=_csv,
                     help="comma-separated CIDRs of either family: NodePorts are served on the node addresses in "
                          "them (a family given none: all its addresses); 'primary': on the node's primary address "
                          "of each family (default: every node address)")
    run.add_argument("--iptables-localhost-nodeports", type=_go_bool, nargs="?", const=True, metavar="BOOL",
                     help="NodePorts are also served on 127.0.0.1 to the node's own processes, when "
                          "--nodeport-addresses is unset or holds it (bpf mode, through its socket hooks; "
                          f"upstream's flag; default: {str(d.localhost_nodeports).lower()})")
    run.add_argument("--healthz-bind-address", help=f"default: {d.healthz_bind_address}")
    run.add_argument("--metrics-bind-address", help=f"default: {d.metrics_bind_address}")
    run.add_argument("--min-sync-period", type=_duration,
                     help=f"time between syncs at the least; 0: none (default: {format_duration(d.min_sync_period)})")
    run.add_argument("--sync-period", type=_duration,
                     help="the longest time between two syncs, positive: a sync applies what changed, and "
                          f"without changes one runs this often (default: {format_duration(d.sync_period)})")
    for flag, sync in SYNC_FLAGS.items():
        run.add_argument(flag, type=_duration, metavar="DURATION",
                         help=f"upstream's: --{sync.setting.replace('_', '-')} in "
                              f"{'ipvs mode' if sync.ipvs else 'every mode but ipvs'}, unless that is given")
    for ct in CT_FLAGS:
        zero = "; 0: the default" if ct.zero_keeps_default else ""
        run.add_argument(ct.flag, type=_duration, metavar="DURATION",
                         help=f"bpf mode: idle timeout of {ct.what} (default: "
                              f"{format_duration(getattr(d.bpf.ct_timeouts, ct.field))}{zero})")
    _add_common(run)

    insp = sub.add_parser("inspect", help="show frontends, backends, counters and flows, read from the dataplane "
                                          "of this network namespace (any mode)")
    insp.add_argument("--no-flows", action="store_true", help="omit the connection-tracking table")
    insp.add_argument("--service", metavar="NS/NAME", help="only this Service's frontends and flows")
    insp.add_argument("--frontend", metavar="IP:PORT[/PROTO]",
                      help="only this frontend and its flows (IPv6 in brackets: [fd00:10:96::1]:80/tcp)")
    insp.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    _add_common(insp)
    views = insp.add_subparsers(dest="view")
    trace = views.add_parser(
        "trace", help="where a packet from SRC to DST goes: its frontend, the policy, its flow's endpoint or the "
                      "endpoints a new flow could get",
        epilog="SRC is ADDR or ADDR:PORT: without a port, the source's flows to the frontend are listed and a new "
               "flow's choice is shown. DST is ADDR:PORT/PROTO (tcp when no /PROTO). IPv6: SRC fd00::2 or "
               "[fd00::2]:PORT, DST [fd00:10:96::1]:80/tcp.")
    trace.add_argument("src", metavar="SRC")
    trace.add_argument("dst", metavar="DST")
    trace.add_argument("-o", "--output", choices=("text", "json"), default=argparse.SUPPRESS, help="output format")
    _add_common(trace, nested=True)

    clean = sub.add_parser("cleanup", help="remove every program, map, pin and qdisc of pyproxy")
    _add_common(clean)

    return ap


def _set(settings: object, path: str, value: object) -> None:
    *parents, name = path.split(".")
    for parent in parents:
        settings = getattr(settings, parent)
    setattr(settings, name, value)


def _ct_timeouts(args: argparse.Namespace, timeouts: CtTimeouts) -> tuple[CtTimeouts, list[str]]:
    problems = []
    for ct in CT_FLAGS:
        value = getattr(args, _dest(ct.flag), None)
        if value is None or (value == 0 and ct.zero_keeps_default):
            continue
        if value <= 0:
            rule = "not be negative" if ct.zero_keeps_default else "be positive"
            problems.append(f"{ct.flag} must {rule}, not {format_duration(value)}")
            continue
        timeouts = dataclasses.replace(timeouts, **{ct.field: value})
    return timeouts, problems


def _sync_flags(args: argparse.Namespace, s: ProxySettings) -> None:
    log = logging.getLogger("pyproxy")
    for flag, sync in SYNC_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        own = f"--{sync.setting.replace('_', '-')}"
        if getattr(args, sync.setting, None) is not None:
            log.warning("%s is ignored: %s is given", flag, own)
        elif (s.mode == "ipvs") != sync.ipvs:
            log.warning("%s is ignored in %s mode (upstream applies it %s)", flag, s.mode,
                        "in ipvs mode only" if sync.ipvs else "in every mode but ipvs")
        else:
            setattr(s, sync.setting, value)


def _given(args: argparse.Namespace) -> list[str]:
    """The flags given that have a field in a config file, as written on the command line."""
    dests = [*SETTINGS, *(_dest(ct.flag) for ct in CT_FLAGS), *(_dest(f) for f in SYNC_FLAGS)]
    return [f"--{d.replace('_', '-')}" for d in dests
            if d not in ALONGSIDE_CONFIG and getattr(args, d, None) is not None]


def _from_config(args: argparse.Namespace, warnings: list[str]) -> ProxySettings:
    """The config file's settings with the flags that apply beside it; the others are named in `warnings`."""
    loaded = kubeproxyconfig.load(args.config)
    for dest in ALONGSIDE_CONFIG:
        value = getattr(args, dest, None)
        if value is not None:
            for path in SETTINGS[dest]:
                _set(loaded.settings, path, value)
    if args.hostname_override is not None:
        loaded.settings.hostname_override = args.hostname_override.strip().lower()
    warnings += loaded.warnings
    warnings += [f"{flag} is ignored: --config {args.config} is given, whose settings are the file's (as "
                 "upstream's)" for flag in _given(args)]
    return loaded.settings


def settings_from(args: argparse.Namespace, warnings: list[str] | None = None) -> ProxySettings:
    """The settings with every given flag applied (or --config's file, see the module's docstring);
    SettingError naming each flag or field whose value cannot work. What is accepted but has no effect goes to
    `warnings`, else it is logged."""
    if getattr(args, "config", None) is None:
        return settings_from_flags(args)
    lines: list[str] = []
    settings = _from_config(args, lines)
    if warnings is None:
        for line in lines:
            logging.getLogger("pyproxy").warning("%s", line)
    else:
        warnings += lines
    return settings


def settings_from_flags(args: argparse.Namespace) -> ProxySettings:
    """The settings the flags ask for, whatever --config says; SettingError naming each flag whose value cannot
    work."""
    s = ProxySettings()
    for dest, paths in SETTINGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            for path in paths:
                _set(s, path, value)
    _sync_flags(args, s)
    s.bpf.ct_timeouts, problems = _ct_timeouts(args, s.bpf.ct_timeouts)
    if getattr(args, "cluster_cidr", None) is not None:  # a pair, one per family, as upstream's: split
        problems += s.masquerade.set_cluster_cidrs(args.cluster_cidr)
    problems += s.problems()
    if problems:
        raise SettingError(problems)
    return s


def _logging(settings: ProxySettings) -> None:
    logs.setup(settings.logging.verbosity, settings.logging.format)


def _inspect(args: argparse.Namespace, settings: ProxySettings) -> str:
    if args.view == "trace":
        # Checked before any I/O: a typo answers at once, and never as "not a Service".
        inspection.parse_flow(args.src, args.dst)
        found = trace.trace(app.inspect_view(settings), args.src, args.dst)
        if args.output == "json":
            return json.dumps(dataclasses.asdict(found), indent=2)
        return inspection.trace_text(found)
    flows = not args.no_flows
    view = inspection.filtered(app.inspect_view(settings, flows), args.service, args.frontend)
    return json.dumps(dataclasses.asdict(view), indent=2) if args.output == "json" else inspection.report(view, flows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["run", *argv]  # kube-proxy's command line has no subcommand
    args = parser().parse_args(argv)
    warnings: list[str] = []
    try:
        settings = settings_from(args, warnings)
    except SettingError as e:
        for problem in e.problems:
            print(f"pyproxy {args.command}: error: {problem}", file=sys.stderr)
        return 2
    # Set up once the settings are known, so a config file's warnings already come in the format it asks for.
    _logging(settings)
    for line in warnings:
        logging.getLogger("pyproxy").warning("%s", line)
    try:
        if args.command == "run" and args.write_config_to is not None:
            try:
                args.write_config_to.write_text(kubeproxyconfig.dump(settings))
            except OSError as e:
                raise app.StartupError(f"--write-config-to {args.write_config_to}: {e.strerror or e}") from e
            logging.getLogger("pyproxy").info("wrote the configuration to %s", args.write_config_to)
            return 0
        if args.command == "run" and not args.cleanup:
            return app.run(settings)
        if args.command == "inspect":
            print(_inspect(args, settings))
            return 0
        for line in app.cleanup(settings):
            print(f"removed {line}")
        return 0
    except (app.StartupError, ValueError) as e:
        logging.getLogger("pyproxy").error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
