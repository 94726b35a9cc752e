"""Fixtures for the end-to-end tests: a namespace lab per test and pyproxy started as a user starts it.

Every test gets its own Lab (unique namespace names) and its own pin path, so tests can run in parallel with each
other and with other people's runs. Teardown always happens, failure or not: pyproxy killed, `pyproxy cleanup`
run, the lab removed; on failure pyproxy's whole log is printed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from cluster.cluster import Cluster, bridge_into_netns, stop_process
from emulation import bound
from labkit import Lab, ProbeResult, Pyproxy, describe, nonzero_checksum_errors, write_manifest
from labkit.manifests import documents
from labkit.netns import missing_stack_driver
from prometheus_client.parser import text_string_to_metric_families

GUEST_DIR = Path(__file__).resolve().parents[1] / "guest"
GUEST_PYTEST = "python -m pytest -q -p no:cacheprovider -ra"


def _guest_runner() -> ModuleType:
    # tests/guest/run.py is a stdlib-only script, not a package module: load it from its path.
    spec = importlib.util.spec_from_file_location("pyproxy_guest_run", GUEST_DIR / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GuestPytest = Callable[..., None]


@pytest.fixture(scope="session")
def guest_pytest() -> GuestPytest:
    """guest_pytest(selection, timeout, allowed_skips=(), env=None) runs `pytest SELECTION` inside the qemu guest
    booting Debian's kernel (tests/guest: the image built when missing or stale, this checkout shared read-only)
    and asserts it passed with nothing skipped but for a reason in `allowed_skips` (substrings): any other skip
    means a test did not really run on that kernel. The guest's output is printed (pytest shows it for a failure,
    or always with -s); bounded by `timeout` seconds of guest run; `env`: variables the guest's pytest gets."""
    run = _guest_runner()

    def go(selection: str, timeout: float, allowed_skips: Sequence[str] = (),
           env: dict[str, str] | None = None) -> None:
        image = run.build_image()
        # PYPROXY_TEST_EMULATED: tests whose time bounds are the host's relax them (tests/priv/test_gc.py).
        result = run.run_in_guest(f"{GUEST_PYTEST} {shlex.join(shlex.split(selection))}", timeout=timeout, echo=None,
                                  image=image, env={"PYPROXY_TEST_EMULATED": "1", **(env or {})})
        print(f"===== guest output ({result.seconds:g}s, exit {result.returncode}) =====\n{result.output}")
        if result.returncode in (124, 125):
            print(f"===== guest console =====\n{result.console[-20000:]}")
        assert result.returncode == 0, f"pytest in the guest exited {result.returncode}: {result.output[-3000:]}"
        lines = result.output.strip().splitlines()
        assert " passed" in lines[-1], lines[-1]
        skips = [line for line in lines if line.startswith("SKIPPED")]  # -ra lists each reason
        unexpected = [line for line in skips if not any(reason in line for reason in allowed_skips)]
        assert not unexpected and (skips or " skipped" not in lines[-1]), "\n".join(unexpected) or lines[-1]

    return go


DESELECTED = pytest.StashKey[dict[str, list[str]]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `stack_driver(STACK)` (a lab client_stack whose driver this kernel lacks: VLAN and bond here, no
    8021q or bonding) are deselected, not skipped: they cannot run on this kernel and say nothing about it, and
    `make guest-test` runs them in the qemu guest, whose kernel has the drivers. The reason is printed at the end."""
    missing: dict[str, str | None] = {}
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("stack_driver")
        if marker is not None:
            stack = marker.args[0]
            if stack not in missing:
                missing[stack] = missing_stack_driver(stack)
            if missing[stack]:
                drop.append(item)
                config.stash.setdefault(DESELECTED, {}).setdefault(str(missing[stack]), []).append(item.nodeid)
                continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for reason, nodeids in config.stash.get(DESELECTED, {}).items():
        terminalreporter.write_line(f"deselected {len(nodeids)} test{'s' * (len(nodeids) > 1)}: {reason}; "
                                    "`make guest-test` runs them in the qemu guest "
                                    "(tests/e2e/test_stacked_devices_guest.py)", yellow=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Tests marked `root` skip for this one reason only: anything else missing (BPF objects, the CLI) fails.
    if item.get_closest_marker("root") and os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, BPF)")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # Keep each phase's report on the item, so fixtures can tell at teardown whether the test failed.
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(getattr(getattr(request.node, f"report_{when}", None), "failed", False)
               for when in ("setup", "call"))


class Env:
    """One test's world: a started Lab with traffic servers, a manifest folder, and pyproxy (not yet started)."""

    def __init__(self, lab: Lab, source: Path, log_path: Path) -> None:
        self.lab = lab
        self.source = source
        self.log_path = log_path
        self.proxy: Pyproxy | None = None
        self.bridge: subprocess.Popen[bytes] | None = None

    # ---- manifests and pyproxy

    def write(self, name: str, *docs: str) -> Path:
        return write_manifest(self.source, name, documents(*docs))

    def write_raw(self, name: str, text: str) -> Path:
        return write_manifest(self.source, name, text)

    def start(self, *, xdp_devices: list[str] | None = None, devices: list[str] | None = None,
              mode: str = "bpf", args: Sequence[str] = (), wrapper: Sequence[str] = ()) -> Pyproxy:
        """pyproxy in `mode` on the manifest folder; `args` are more flags; `wrapper` runs it (see Pyproxy)."""
        self.proxy = Pyproxy(self.lab, self.source, log_path=self.log_path, xdp_devices=xdp_devices,
                             devices=devices, extra_args=args, mode=mode, wrapper=wrapper)
        self.proxy.start()
        # BCC compiles the programs at start (some 20 s here, more beside other tests).
        self.proxy.wait_healthy(120.0 if "--bpf-loader=bcc" in args else bound(20.0))
        return self.proxy

    def start_api(self, cluster: Cluster, *, node: str = "lab-node", args: Sequence[str] = ()) -> Pyproxy:
        """pyproxy following `cluster` as a user runs it: `--kubeconfig` with the admin token, reaching the API
        server through a bridge to the node namespace's own 127.0.0.1:6443."""
        self.bridge = bridge_into_netns(self.lab.node, cluster.apiserver_port)
        kubeconfig = cluster.write_kubeconfig(self.source / "kubeconfig", cluster.admin_token,
                                              server="https://127.0.0.1:6443")
        self.proxy = Pyproxy(self.lab, None, log_path=self.log_path,
                             extra_args=[f"--kubeconfig={kubeconfig}", f"--hostname-override={node}", *args])
        self.proxy.start()
        self.proxy.wait_healthy(30.0)
        return self.proxy

    def metrics(self) -> dict[str, float]:
        """pyproxy's /metrics as {"name{label=value,...}": value} (labels sorted)."""
        result = self.lab.http_get(self.lab.node, self.running.metrics_url, expect=200)
        assert result["status"] == 200, result
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(result["body"]):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    @property
    def running(self) -> Pyproxy:
        assert self.proxy is not None, "pyproxy not started"
        return self.proxy

    # ---- traffic

    def probe(self, proto: str, ip: str, port: int, count: int = 30, **kw: Any) -> ProbeResult:
        return self.lab.probe(proto, ip, port, count, **kw)

    def assert_reaches(self, proto: str, ip: str, port: int, expected: set[str], count: int = 60) -> ProbeResult:
        """`count` new flows to ip:port all answered, by exactly the `expected` NAME:PORT set, and the
        backends saw the client's own address (ClusterIP traffic is not SNATed)."""
        result = self.probe(proto, ip, port, count)
        assert result["failures"] == 0, f"{proto} {ip}:{port}: {describe(result)}"
        assert set(result["replies"]) == expected, f"{proto} {ip}:{port}: {describe(result)}"
        assert set(result["seen_from"]) == {self.lab.client_ip}, f"source seen by backends: {result['seen_from']}"
        return result

    def assert_no_checksum_errors(self) -> None:
        errors = nonzero_checksum_errors(self.lab.checksum_errors())
        assert not errors, f"receivers counted checksum errors: {errors}"

    def poll(self, check: Callable[[], bool], deadline: float, interval: float = 0.05) -> float | None:
        """Seconds until `check()` first held, or None if it did not within `deadline` seconds."""
        start = time.monotonic()
        while True:
            if check():
                return time.monotonic() - start
            if time.monotonic() - start >= deadline:
                return None
            time.sleep(interval)

    # ---- what pyproxy left on the node

    def attached_programs(self) -> dict[str, list[int]]:
        """Per node device, the ids of BPF programs attached there (tc ingress/egress filters and XDP)."""
        result: dict[str, list[int]] = {}
        for dev in self.lab.node_ifnames:
            ids = []
            for direction in ("ingress", "egress"):
                out = self.lab.exec(self.lab.node, "tc", "-j", "filter", "show", "dev", dev, direction,
                                    check=False).stdout
                for f in json.loads(out or "[]"):
                    prog = f.get("options", {}).get("prog")
                    if prog:
                        ids.append(prog["id"])
            link = json.loads(self.lab.exec(self.lab.node, "ip", "-j", "link", "show", "dev", dev).stdout)[0]
            for attached in link.get("xdp", {}).get("attached", []):
                ids.append(attached["prog"]["id"])
            if "xdp" in link and "prog" in link["xdp"]:
                ids.append(link["xdp"]["prog"]["id"])
            result[dev] = sorted(set(ids))
        return result

    def netfilter_leftovers(self) -> list[str]:
        """What of pyproxy's netfilter modes is still in the node: KUBE-* chains in either iptables backend,
        the nftables table, ipsets, kube-ipvs0."""
        found = []
        for save in ("iptables-legacy-save", "iptables-nft-save"):
            out = self.lab.exec(self.lab.node, save, check=False).stdout
            found += [f"{save}: {line}" for line in out.splitlines() if "KUBE-" in line]
        nft = self.lab.exec(self.lab.node, "nft", "list", "tables").stdout
        found += [f"nft: {line}" for line in nft.splitlines() if line.strip() == "table ip pyproxy"]
        sets = self.lab.exec(self.lab.node, "ipset", "list", "-n", check=False).stdout
        found += [f"ipset {name}" for name in sets.split() if name.startswith("KUBE-")]
        if self.lab.exec(self.lab.node, "ip", "link", "show", "kube-ipvs0", check=False).returncode == 0:
            found.append("link kube-ipvs0")
        return found

    def cgroup_programs(self) -> list[str]:
        """The programs attached to the lab's cgroup (where pyproxy's socket hooks go), as bpftool lists them."""
        out = self.lab.exec(self.lab.node, "bpftool", "cgroup", "show", str(self.lab.cgroup)).stdout
        return [line for line in out.splitlines() if line.strip() and not line.startswith("ID")]

    def leftovers(self, prog_ids: set[int]) -> list[str]:
        """What of pyproxy is still on the node: filters, clsact qdiscs, XDP, pins, or any of `prog_ids`."""
        found = []
        for dev in self.lab.node_ifnames:
            for direction in ("ingress", "egress"):
                out = self.lab.exec(self.lab.node, "tc", "filter", "show", "dev", dev, direction,
                                    check=False).stdout.strip()
                if out:
                    found.append(f"tc filter {dev} {direction}: {out}")
            qdiscs = self.lab.exec(self.lab.node, "tc", "qdisc", "show", "dev", dev).stdout
            # The lab never adds a clsact (or ingress) qdisc: any there is pyproxy's.
            found += [f"qdisc {dev}: {q}" for q in qdiscs.splitlines() if "clsact" in q or "ingress" in q]
            link = self.lab.exec(self.lab.node, "ip", "-d", "link", "show", "dev", dev).stdout
            found += [f"{dev}: {line.strip()}" for line in link.splitlines() if "prog/xdp" in line]
        net = self.lab.exec(self.lab.node, "bpftool", "net", "show").stdout
        found += [f"bpftool net: {line}" for line in net.splitlines() if " id " in line]
        found += [f"cgroup {self.lab.cgroup}: {line}" for line in self.cgroup_programs()]
        pins = Path(self.lab.pin_path)
        if pins.exists():
            found += [f"pin {p}" for p in pins.rglob("*")]
        progs = json.loads(self.lab.exec(self.lab.node, "bpftool", "-j", "prog", "show").stdout or "[]")
        found += [f"program still loaded: {p}" for p in progs if p.get("id") in prog_ids]
        return found


@pytest.fixture
def make_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Env]]:
    """`make_env(backends=3, distro=False, ...)` -> a started Env; torn down whatever happens."""
    envs: list[Env] = []

    def make(backends: int = 3, **lab_kwargs: Any) -> Env:
        lab = Lab(backends, **lab_kwargs)
        source = tmp_path / f"manifests{len(envs)}"
        source.mkdir()
        env = Env(lab, source, tmp_path / f"pyproxy{len(envs)}.log")
        envs.append(env)
        lab.start()
        lab.start_servers(tcp=[8080, 9090], udp=[5353], timeout=bound(10.0))
        return env

    yield make

    for env in envs:
        try:
            if env.proxy is not None:
                env.proxy.close()  # kill if running, then `pyproxy cleanup`
        finally:
            if env.bridge is not None:
                stop_process(env.bridge)
            env.lab.close()
        if _failed(request) and env.proxy is not None:
            print(f"\n===== pyproxy log ({env.log_path}) =====\n{env.proxy.log_text()}")
