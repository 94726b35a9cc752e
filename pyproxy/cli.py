"""The `pyproxy` command: flags (named as upstream kube-proxy's) mapped onto settings, nothing more."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pyproxy.proxier import app
from pyproxy.proxier.config import ProxySettings
from pyproxy.proxier.modes import AUTO, MODES


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v for v in (x.strip() for x in value.split(",")) if v)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bpf-pin-path", type=Path, default=Path("/sys/fs/bpf/pyproxy"),
                   help="where BPF maps are pinned (a bpffs is mounted when none is there)")
    p.add_argument("-v", "--v", type=int, default=2, help="log verbosity (0 quiet .. 4 debug)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pyproxy", description="A Kubernetes service proxy with an eBPF dataplane")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="watch Services and EndpointSlices and program the dataplane")
    run.add_argument("--proxy-mode", choices=MODES, default=AUTO,
                     help="the dataplane to program; auto: the first of bpf, ipvs, nftables, iptables that works")
    run.add_argument("--source", type=Path,
                     help="read a manifest file or folder (v1 Services, EndpointSlices) instead of the API")
    run.add_argument("--kubeconfig", type=Path, help="kubeconfig file of the API server to follow")
    run.add_argument("--master", help="the API server's URL (overrides the kubeconfig's server)")
    run.add_argument("--hostname-override", help="the name of this node (default: the host name)")
    run.add_argument("--devices", type=_csv, default=(),
                     help="comma-separated devices to attach to (default: every non-loopback Ethernet device)")
    run.add_argument("--xdp-devices", type=_csv, default=(), help="devices that also get the XDP program")
    run.add_argument("--cluster-cidr", help="masquerade ClusterIP traffic from outside this range (netfilter modes)")
    run.add_argument("--masquerade-all", action="store_true", help="masquerade all ClusterIP traffic (netfilter modes)")
    run.add_argument("--iptables-masquerade-bit", type=int, default=14, help="fwmark bit marking packets for SNAT")
    run.add_argument("--iptables-backend", choices=("auto", "legacy", "nft"), default="auto",
                     help="iptables flavour for the iptables and ipvs modes (auto: whatever `iptables` is here)")
    run.add_argument("--ipvs-scheduler", default="rr", help="IPVS scheduler: rr, wrr, lc, wlc, sh, dh, ...")
    run.add_argument("--healthz-bind-address", default="0.0.0.0:10256")
    run.add_argument("--metrics-bind-address", default="127.0.0.1:10249")
    run.add_argument("--min-sync-period", type=float, default=1.0, help="seconds between syncs at the least")
    run.add_argument("--sync-period", type=float, default=30.0, help="seconds between full resyncs at the most")
    _add_common(run)

    insp = sub.add_parser("inspect", help="show frontends, backends, counters and flows from the BPF maps")
    insp.add_argument("--no-flows", action="store_true", help="omit the connection-tracking table")
    _add_common(insp)

    clean = sub.add_parser("cleanup", help="remove every program, map, pin and qdisc of pyproxy")
    _add_common(clean)

    sub.add_parser("demo", help="run the namespace lab demo (root)")
    return ap


def settings_from(args: argparse.Namespace) -> ProxySettings:
    s = ProxySettings()
    s.bpf.pin_path = args.bpf_pin_path
    if args.command == "run":
        s.mode = args.proxy_mode
        s.source = args.source
        s.connection.kubeconfig = args.kubeconfig
        s.connection.master = args.master
        s.hostname_override = args.hostname_override
        s.healthz_bind_address = args.healthz_bind_address
        s.metrics_bind_address = args.metrics_bind_address
        s.min_sync_period = args.min_sync_period
        s.sync_period = args.sync_period
        s.masquerade.cluster_cidr = args.cluster_cidr
        s.masquerade.masquerade_all = args.masquerade_all
        s.masquerade.masquerade_bit = args.iptables_masquerade_bit
        s.iptables.backend = args.iptables_backend
        s.ipvs.iptables_backend = args.iptables_backend
        s.ipvs.scheduler = args.ipvs_scheduler
        s.bpf.devices = args.devices
        s.bpf.xdp_devices = args.xdp_devices
    return s


def _logging(verbosity: int) -> None:
    level = {0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO}.get(verbosity, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from pyproxy.lab.demo import run_demo

        return run_demo()
    _logging(args.v)
    settings = settings_from(args)
    try:
        if args.command == "run":
            return app.run(settings)
        if args.command == "inspect":
            print(app.inspect(settings, flows=not args.no_flows))
            return 0
        for line in app.cleanup(settings):
            print(f"removed {line}")
        return 0
    except (app.StartupError, ValueError) as e:
        logging.getLogger("pyproxy").error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
