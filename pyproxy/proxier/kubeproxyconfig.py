"""`--config FILE`: upstream's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1), as the kube-proxy
ConfigMap of a kubeadm cluster holds it, read onto ProxySettings; and `--write-config-to`, the way back.

Every field of upstream's v1alpha1 is known here, and each one either maps onto a setting (doing what
upstream's does), is accepted with a warning saying it has no effect in pyproxy, or is refused with a line
naming it and the file, but only when it holds a real value: kubeadm writes every field, most as zero values
("", 0s, null, false) meaning "the default", and those are the default here too. A field upstream does not
know, or a value of the wrong type, is refused the same way, before anything is changed: a misspelt field
would otherwise leave a setting at its default unnoticed. pyproxy's own settings go in a `bpf` block.

The sync periods and the masquerade settings come from the block of the file's mode (ipvs or nftables;
iptables for every other mode), as upstream converts v1alpha1. `dump` writes every block alike, so a file
it wrote reads back as the same settings whatever the mode.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from pyproxy import logs
from pyproxy.dataplane.bpf import abi
from pyproxy.proxier.config import WINDOWS_MODES, ProxySettings, SettingError, format_duration, parse_duration
from pyproxy.proxier.modes import MODES

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249


class Kind(NamedTuple):
    name: str
    """What a value must be, for messages ("a duration such as 30s")."""
    check: Callable[[object], bool]


STR = Kind("a string", lambda v: isinstance(v, str))
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
INT = Kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
NUMBER = Kind("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
DURATION = Kind("a duration such as 30s or 1h0m0s", lambda v: isinstance(v, str) and _is_duration(v))
STRINGS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
BOOL_MAP = Kind("a map of names to true or false",
                lambda v: isinstance(v, dict) and all(isinstance(x, bool) for x in v.values()))
INT_MAP = Kind("a map of names to integers",
               lambda v: isinstance(v, dict) and all(INT.check(x) for x in v.values()))
ANY = Kind("anything", lambda v: True)
FLUSH = Kind("a duration such as 5s, or nanoseconds",
             lambda v: INT.check(v) or (isinstance(v, str) and _is_duration(v)))
QUANTITY = Kind("a quantity such as 0 or 64Ki", lambda v: INT.check(v) or isinstance(v, str))


def _is_duration(text: str) -> bool:
    try:
        parse_duration(text)
    except ValueError:
        return False
    return True


Schema = Mapping[str, "Kind | Schema"]

# Upstream's v1alpha1 fields (k8s.io/kube-proxy/config/v1alpha1/types.go), with pyproxy's `bpf` block.
SCHEMA: Schema = {
    "apiVersion": STR, "kind": STR,
    "featureGates": BOOL_MAP,
    "clientConnection": {"kubeconfig": STR, "acceptContentTypes": STR, "contentType": STR, "qps": NUMBER,
                         "burst": INT},
    # component-base's LoggingConfiguration (logs/api/v1), which kubeadm writes from 1.27 on.
    "logging": {"format": STR, "verbosity": INT, "flushFrequency": FLUSH, "vmodule": ANY,
                "options": {"text": {"splitStream": BOOL, "infoBufferSize": QUANTITY},
                            "json": {"splitStream": BOOL, "infoBufferSize": QUANTITY}}},
    "hostnameOverride": STR, "bindAddress": STR, "healthzBindAddress": STR, "metricsBindAddress": STR,
    "bindAddressHardFail": BOOL, "enableProfiling": BOOL, "showHiddenMetricsForVersion": STR,
    "mode": STR,
    "iptables": {"masqueradeBit": INT, "masqueradeAll": BOOL, "localhostNodePorts": BOOL, "snatNodeInternalIP": BOOL,
                 "syncPeriod": DURATION, "minSyncPeriod": DURATION},
    "ipvs": {"syncPeriod": DURATION, "minSyncPeriod": DURATION, "scheduler": STR, "excludeCIDRs": STRINGS,
             "strictARP": BOOL, "tcpTimeout": DURATION, "tcpFinTimeout": DURATION, "udpTimeout": DURATION},
    "nftables": {"masqueradeBit": INT, "masqueradeAll": BOOL, "syncPeriod": DURATION, "minSyncPeriod": DURATION},
    "winkernel": {"networkName": STR, "sourceVip": STR, "enableDSR": BOOL, "rootHnsEndpointName": STR,
                  "forwardHealthCheckVip": BOOL},
    "detectLocalMode": STR, "detectLocal": {"bridgeInterface": STR, "interfaceNamePrefix": STR},
    "clusterCIDR": STR, "nodePortAddresses": STRINGS, "oomScoreAdj": INT,
    "conntrack": {"maxPerCore": INT, "min": INT, "tcpEstablishedTimeout": DURATION,
                  "tcpCloseWaitTimeout": DURATION, "tcpBeLiberal": BOOL, "udpTimeout": DURATION,
                  "udpStreamTimeout": DURATION},
    "configSyncPeriod": DURATION, "portRange": STR, "udpIdleTimeout": DURATION, "windowsRunAsService": BOOL,
    "bpf": {"devices": STRINGS, "xdpDevices": STRINGS, "xdpMode": STR, "socketLB": BOOL,
            "socketLBHostNamespaceOnly": BOOL, "cgroupRoot": STR, "snatPortRange": STR, "scheduler": STR,
            "loader": STR, "maglevTableSize": INT, "mapSizes": INT_MAP, "tcpSynTimeout": DURATION,
            "tcpSynRecvTimeout": DURATION, "tcpTimeWaitTimeout": DURATION, "tcpCloseTimeout": DURATION,
            "endpointCounters": BOOL},
}

# Fields pyproxy cannot honour: a real value is refused with the reason; a zero value passes.
REFUSED = {
    "bindAddressHardFail": "pyproxy always ends when it cannot bind its healthz or metrics address",
    "enableProfiling": "pyproxy serves no /debug/pprof",
    "showHiddenMetricsForVersion": "pyproxy has no hidden metrics",
    "portRange": "upstream's userspace proxy took its per-Service ports from it; pyproxy's listens on the Service "
                 "addresses themselves",
    "windowsRunAsService": "pyproxy runs on Linux only",
    "winkernel.networkName": "pyproxy runs on Linux only",
    "winkernel.sourceVip": "pyproxy runs on Linux only",
    "winkernel.enableDSR": "pyproxy runs on Linux only",
    "winkernel.rootHnsEndpointName": "pyproxy runs on Linux only",
    "winkernel.forwardHealthCheckVip": "pyproxy runs on Linux only",
    "detectLocal.bridgeInterface": "pyproxy tells local traffic by clusterCIDR only",
    "detectLocal.interfaceNamePrefix": "pyproxy tells local traffic by clusterCIDR only",
    "iptables.snatNodeInternalIP": "pyproxy masquerades to the egress device's address",
    "ipvs.excludeCIDRs": "pyproxy's ipvs mode owns every virtual server on the node and keeps none aside",
    "ipvs.strictARP": "pyproxy does not set arp_ignore/arp_announce; set them on the node (sysctl) instead",
    "ipvs.tcpTimeout": "pyproxy leaves the IPVS timeouts as the kernel has them (ipvsadm --set)",
    "ipvs.tcpFinTimeout": "pyproxy leaves the IPVS timeouts as the kernel has them (ipvsadm --set)",
    "ipvs.udpTimeout": "pyproxy leaves the IPVS timeouts as the kernel has them (ipvsadm --set)",
    "conntrack.tcpBeLiberal": "pyproxy does not set nf_conntrack_tcp_be_liberal",
    "logging.vmodule": "pyproxy has one verbosity for all its logs (logging.verbosity)",
    "logging.options.text.splitStream": "pyproxy writes every log line to stderr",
    "logging.options.json.splitStream": "pyproxy writes every log line to stderr",
}

# Fields accepted whatever they hold, with a warning when they hold a real value, as they change nothing here.
NO_EFFECT = {
    "featureGates": "pyproxy has no feature gates",
    "oomScoreAdj": "pyproxy leaves its oom_score_adj as it was started with",
    "configSyncPeriod": "pyproxy's watches never resync: they relist only when the API server expired them",
    "conntrack.maxPerCore": "pyproxy does not size the kernel's conntrack table (nf_conntrack_max)",
    "conntrack.min": "pyproxy does not size the kernel's conntrack table (nf_conntrack_max)",
    "logging.flushFrequency": "pyproxy writes each log line as it logs it",
    "logging.options.text.infoBufferSize": "pyproxy writes each log line as it logs it",
    "logging.options.json.infoBufferSize": "pyproxy writes each log line as it logs it",
}

# Settings problems name flags (ProxySettings.problems); in a file's they name its fields instead. The
# placeholders are the blocks the mode reads its sync periods ({sync}) and masquerade bit ({masq}) from.
FLAG_FIELDS = {
    "--sync-period": "{sync}.syncPeriod", "--min-sync-period": "{sync}.minSyncPeriod",
    "--iptables-masquerade-bit": "{masq}.masqueradeBit", "--cluster-cidr": "clusterCIDR",
    "--nodeport-addresses": "nodePortAddresses", "--healthz-bind-address": "healthzBindAddress",
    "--metrics-bind-address": "metricsBindAddress", "--ipvs-scheduler": "ipvs.scheduler",
    "--xdp-devices": "bpf.xdpDevices", "--devices": "bpf.devices", "--bpf-snat-port-range": "bpf.snatPortRange",
    "--bpf-scheduler": "bpf.scheduler", "--bpf-maglev-table-size": "bpf.maglevTableSize", "--bpf-loader": "bpf.loader",
    "--bpf-xdp-mode": "bpf.xdpMode",
    "--conntrack-tcp-timeout-established": "conntrack.tcpEstablishedTimeout",
    "--conntrack-tcp-timeout-close-wait": "conntrack.tcpCloseWaitTimeout",
    "--conntrack-udp-timeout-stream": "conntrack.udpStreamTimeout", "--conntrack-udp-timeout": "conntrack.udpTimeout",
    "--bpf-ct-tcp-syn-timeout": "bpf.tcpSynTimeout", "--bpf-ct-tcp-close-timeout": "bpf.tcpCloseTimeout",
    "--bpf-ct-tcp-syn-recv-timeout": "bpf.tcpSynRecvTimeout",
    "--bpf-ct-tcp-time-wait-timeout": "bpf.tcpTimeWaitTimeout",
    "--udp-timeout": "udpIdleTimeout", "--proxy-mode": "mode",
}

# conntrack and bpf timeout fields -> CtTimeouts fields.
CT_FIELDS = {
    "conntrack.tcpEstablishedTimeout": "tcp_established", "conntrack.tcpCloseWaitTimeout": "tcp_closing",
    "conntrack.udpTimeout": "udp_new", "conntrack.udpStreamTimeout": "udp_established",
    "bpf.tcpSynTimeout": "tcp_new", "bpf.tcpCloseTimeout": "tcp_closed",
    "bpf.tcpSynRecvTimeout": "tcp_syn_recv", "bpf.tcpTimeWaitTimeout": "tcp_time_wait",
}


# bpf.mapSizes names the maps as --bpf-map-sizes does (abi.RESIZABLE: "ct" for pyproxy_ct_v3), so a file
# outlives a change of a map's layout.
MAP_NAMES = abi.RESIZABLE


class ConfigFileError(SettingError):
    """A config file pyproxy cannot run with; each problem names the file and the field."""


class Loaded(NamedTuple):
    settings: ProxySettings
    warnings: list[str]
    """One line per field accepted that has no effect here (each naming the file and the field)."""


def _is_zero(value: object) -> bool:
    """Whether a value is what kubeadm writes for "the default": null, "", false, 0, 0s, [] or {}."""
    if isinstance(value, str) and value and _is_duration(value):
        return parse_duration(value) == 0
    return value is None or value in ("", False, 0, [], {})


def _flatten(doc: Mapping[str, Any], schema: Schema, prefix: str, problems: list[str]) -> dict[str, Any]:
    """path -> value of every field given (null ones included), checking each against the schema."""
    out: dict[str, Any] = {}
    for name, value in doc.items():
        path = f"{prefix}{name}"
        kind = schema.get(name) if isinstance(name, str) else None
        if kind is None:
            problems.append(f"unknown field {path!r}")
        elif isinstance(kind, Kind):
            if value is not None and not kind.check(value):
                problems.append(f"field {path!r} must be {kind.name}, not {value!r}")
            else:
                out[path] = value
        elif value is None:
            continue
        elif not isinstance(value, dict):
            problems.append(f"field {path!r} must be a mapping of {', '.join(kind)}, not {value!r}")
        else:
            out.update(_flatten(value, kind, f"{path}.", problems))
    return out


def _with_port(address: str, port: int) -> str:
    """An address with the default port appended when it has none, as upstream's AppendPortIfNeeded."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _port_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi)


class _Reader:
    """One file's fields onto settings; the problems and warnings, each naming the file and the field."""

    def __init__(self, path: Path, fields: dict[str, Any]) -> None:
        self.path = path
        self.fields = fields
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def given(self, path: str) -> Any:
        """The field's value, or None when it is absent or a zero value ("the default")."""
        value = self.fields.get(path)
        return None if _is_zero(value) else value

    def refuse(self, path: str, why: str) -> None:
        self.problems.append(f"{path}: {why}")

    def settings(self) -> ProxySettings:
        s = ProxySettings()
        for path, why in REFUSED.items():
            value = self.given(path)
            if value is not None:
                self.refuse(path, f"{value!r} is not supported: {why}")
        for path, why in NO_EFFECT.items():
            value = self.given(path)
            if value is not None:
                self.warnings.append(f"{self.path}: {path} ({value!r}) has no effect: {why}")
        self._general(s)
        self._mode_blocks(s)
        self._conntrack(s)
        self._bpf(s)
        self._logging(s)
        return s

    def _logging(self, s: ProxySettings) -> None:
        # Verbosity 0 is a level, not "the default": kubeadm's ConfigMaps say `verbosity: 0` and upstream then
        # logs at 0. Only an absent field keeps pyproxy's default.
        if (verbosity := self.fields.get("logging.verbosity")) is not None:
            s.logging.verbosity = verbosity
        if (fmt := self.given("logging.format")) is not None:
            if fmt in logs.FORMATS:
                s.logging.format = fmt
            else:
                self.refuse("logging.format", f"must be one of {', '.join(logs.FORMATS)}, not {fmt!r}")

    def _general(self, s: ProxySettings) -> None:
        api = self.fields.get("apiVersion")
        if api != API_VERSION:
            self.refuse("apiVersion", f"must be {API_VERSION}, not {api!r}")
        if self.fields.get("kind") != KIND:
            self.refuse("kind", f"must be {KIND}, not {self.fields.get('kind')!r}")
        if (mode := self.given("mode")) is not None:
            if mode in MODES or mode in WINDOWS_MODES:  # the latter refused by ProxySettings.problems
                s.mode = mode
            else:
                self.refuse("mode", f"must be one of {', '.join(MODES)} (or empty: {s.mode}), not {mode!r}")
        if (name := self.given("hostnameOverride")) is not None:
            s.hostname_override = name.strip().lower()
        if (bind := self.given("bindAddress")) is not None and bind not in ("0.0.0.0", "::"):
            self.refuse("bindAddress", f"{bind!r} is not supported: pyproxy takes the node's primary address from "
                                       "its Node object (or default-route device); leave it empty or 0.0.0.0")
        if (healthz := self.given("healthzBindAddress")) is not None:
            s.healthz_bind_address = _with_port(healthz, HEALTHZ_PORT)
        if (metrics := self.given("metricsBindAddress")) is not None:
            s.metrics_bind_address = _with_port(metrics, METRICS_PORT)
        if (local := self.given("detectLocalMode")) is not None and local != "ClusterCIDR":
            self.refuse("detectLocalMode", f"{local!r} is not supported: pyproxy tells local traffic by "
                                           "clusterCIDR only (ClusterCIDR, or empty)")
        if (kubeconfig := self.given("clientConnection.kubeconfig")) is not None:
            s.connection.kubeconfig = Path(kubeconfig)
        if (addresses := self.given("nodePortAddresses")) is not None:
            # Upstream's keyword for "every address" is pyproxy's unset list.
            s.nodeport_addresses = () if addresses == ["all"] else tuple(addresses)
        # A pointer upstream: null is the default (true), false turns it off.
        if (localhost := self.fields.get("iptables.localhostNodePorts")) is not None:
            s.localhost_nodeports = bool(localhost)
        if (cidrs := self.given("clusterCIDR")) is not None:
            self._cluster_cidr(s, cidrs)
        # Upstream's userspace proxy's (removed in 1.26; ConfigMaps kubeadm wrote before carry 250ms): the userspace
        # mode's. Upstream refused 0; here 0s is kubeadm's "the default", as every zero value.
        if (idle := self.given("udpIdleTimeout")) is not None:
            s.userspace.udp_idle_timeout = parse_duration(idle)

    def _cluster_cidr(self, s: ProxySettings, text: str) -> None:
        """Upstream's dual-stack pair (one CIDR per family), or one CIDR."""
        for problem in s.masquerade.set_cluster_cidrs(text):
            self.refuse("clusterCIDR", problem.removeprefix("--cluster-cidr "))

    def blocks(self, mode: str) -> tuple[str, str]:
        """The blocks `mode` reads its sync periods and its masquerade settings from (upstream's conversion)."""
        sync = mode if mode in ("ipvs", "nftables") else "iptables"
        return sync, "nftables" if mode == "nftables" else "iptables"

    def _mode_blocks(self, s: ProxySettings) -> None:
        sync, masq = self.blocks(s.mode)
        if (period := self.given(f"{sync}.syncPeriod")) is not None:
            s.sync_period = parse_duration(period)
        if (period := self.given(f"{sync}.minSyncPeriod")) is not None:
            s.min_sync_period = parse_duration(period)
        # A pointer upstream: null is the default, 0 is bit 0.
        if (bit := self.fields.get(f"{masq}.masqueradeBit")) is not None:
            s.masquerade.masquerade_bit = bit
        s.masquerade.masquerade_all = bool(self.given(f"{masq}.masqueradeAll"))
        other = "iptables" if masq == "nftables" else "nftables"
        for name in ("masqueradeBit", "masqueradeAll"):
            value = self.fields.get(f"{other}.{name}")
            if value not in (None, False) and value != self.fields.get(f"{masq}.{name}"):
                self.warnings.append(f"{self.path}: {other}.{name} ({value!r}) is not used: mode {s.mode} reads "
                                     f"{masq}.{name}")
        if (scheduler := self.given("ipvs.scheduler")) is not None:
            s.ipvs.scheduler = scheduler

    def _conntrack(self, s: ProxySettings) -> None:
        timeouts = {}
        for path, name in CT_FIELDS.items():
            value = self.given(path)
            if value is None:
                continue
            seconds = parse_duration(value)
            if seconds <= 0:
                self.refuse(path, f"must be positive, not {value}")
            else:
                timeouts[name] = seconds
        s.bpf.ct_timeouts = dataclasses.replace(s.bpf.ct_timeouts, **timeouts)

    def _bpf(self, s: ProxySettings) -> None:
        b = s.bpf
        for path, attr in (("bpf.devices", "devices"), ("bpf.xdpDevices", "xdp_devices")):
            if (value := self.fields.get(path)) is not None:
                setattr(b, attr, tuple(value))
        if (socket_lb := self.fields.get("bpf.socketLB")) is not None:
            b.socket_lb = socket_lb
        if (hostns_only := self.fields.get("bpf.socketLBHostNamespaceOnly")) is not None:
            b.socket_lb_hostns_only = hostns_only
        if (counters := self.fields.get("bpf.endpointCounters")) is not None:
            b.endpoint_counters = counters
        if (root := self.given("bpf.cgroupRoot")) is not None:
            b.cgroup_root = Path(root)
        if (ports := self.given("bpf.snatPortRange")) is not None:
            try:
                b.snat_ports = _port_range(ports)
            except ValueError:
                self.refuse("bpf.snatPortRange", f"must be FIRST-LAST, such as 61000-65535, not {ports!r}")
        if (scheduler := self.given("bpf.scheduler")) is not None:
            b.scheduler = scheduler
        if (bpf_loader := self.given("bpf.loader")) is not None:
            b.loader = bpf_loader
        if (xdp_mode := self.given("bpf.xdpMode")) is not None:
            b.xdp_mode = xdp_mode
        if (size := self.fields.get("bpf.maglevTableSize")) is not None:
            b.maglev_table_size = size
        if (sizes := self.fields.get("bpf.mapSizes")) is not None:
            unknown = sorted(set(sizes) - set(MAP_NAMES))
            if unknown:
                self.refuse("bpf.mapSizes", f"no map {', '.join(unknown)}: the maps are {', '.join(MAP_NAMES)}")
            b.max_entries = {MAP_NAMES[name]: n for name, n in sizes.items() if name in MAP_NAMES}

    def field_names(self, problem: str, mode: str) -> str:
        """A settings problem with the flags it names turned into this file's fields."""
        sync, masq = self.blocks(mode)
        for flag in sorted(FLAG_FIELDS, key=len, reverse=True):
            problem = problem.replace(flag, FLAG_FIELDS[flag].format(sync=sync, masq=masq))
        return problem


def parse(text: str, path: Path) -> Loaded:
    """The settings a config file's text asks for; ConfigFileError naming the file and each wrong field."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError([f"{path}: not YAML: {e}"]) from e
    if not isinstance(doc, dict):
        raise ConfigFileError([f"{path}: not a {KIND} (a mapping of its fields)"])
    problems: list[str] = []
    reader = _Reader(path, _flatten(doc, SCHEMA, "", problems))
    settings = reader.settings()
    problems += reader.problems
    if not problems:
        problems = [reader.field_names(p, settings.mode) for p in settings.problems()]
    if problems:
        raise ConfigFileError([f"{path}: {p}" for p in problems])
    return Loaded(settings, reader.warnings)


def load(path: Path) -> Loaded:
    """The settings the file at `path` asks for (see `parse`)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigFileError([f"--config {path}: {e.strerror or e}"]) from e
    return parse(text, path)


def dump(s: ProxySettings) -> str:
    """The settings as a KubeProxyConfiguration with every field written (as upstream's --write-config-to),
    which `parse` reads back as the same settings. Settings only flags set (--source, --master,
    --iptables-backend, --bpf-pin-path) are not part of it."""
    periods = {"syncPeriod": format_duration(s.sync_period), "minSyncPeriod": format_duration(s.min_sync_period)}
    masq = {"masqueradeAll": s.masquerade.masquerade_all, "masqueradeBit": s.masquerade.masquerade_bit}
    ct = s.bpf.ct_timeouts
    map_sizes = {short: s.bpf.max_entries[name] for short, name in MAP_NAMES.items() if name in s.bpf.max_entries}
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bindAddress": "0.0.0.0",
        "clientConnection": {"kubeconfig": str(s.connection.kubeconfig or "")},
        "clusterCIDR": ",".join(c for c in (s.masquerade.cluster_cidr, s.masquerade.cluster_cidr6) if c),
        "conntrack": {"tcpEstablishedTimeout": format_duration(ct.tcp_established),
                      "tcpCloseWaitTimeout": format_duration(ct.tcp_closing),
                      "udpTimeout": format_duration(ct.udp_new),
                      "udpStreamTimeout": format_duration(ct.udp_established)},
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": s.healthz_bind_address,
        "udpIdleTimeout": format_duration(s.userspace.udp_idle_timeout),
        "hostnameOverride": s.hostname_override or "",
        "iptables": {**masq, **periods, "localhostNodePorts": s.localhost_nodeports},
        "logging": {"format": s.logging.format, "verbosity": s.logging.verbosity},
        "ipvs": {**periods, "scheduler": s.ipvs.scheduler},
        "metricsBindAddress": s.metrics_bind_address,
        "mode": s.mode,
        "nftables": {**masq, **periods},
        "nodePortAddresses": list(s.nodeport_addresses) or None,
        "bpf": {"devices": list(s.bpf.devices), "xdpDevices": list(s.bpf.xdp_devices),
                "xdpMode": s.bpf.xdp_mode, "socketLB": s.bpf.socket_lb,
                "socketLBHostNamespaceOnly": s.bpf.socket_lb_hostns_only,
                "cgroupRoot": str(s.bpf.cgroup_root or ""),
                "snatPortRange": f"{s.bpf.snat_ports[0]}-{s.bpf.snat_ports[1]}", "scheduler": s.bpf.scheduler,
                "loader": s.bpf.loader, "maglevTableSize": s.bpf.maglev_table_size, "mapSizes": map_sizes,
                "tcpSynTimeout": format_duration(ct.tcp_new), "tcpSynRecvTimeout": format_duration(ct.tcp_syn_recv),
                "tcpTimeWaitTimeout": format_duration(ct.tcp_time_wait),
                "tcpCloseTimeout": format_duration(ct.tcp_closed),
                "endpointCounters": s.bpf.endpoint_counters},
    }
    return yaml.safe_dump(doc, sort_keys=False)
