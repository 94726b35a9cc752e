"""Run pyproxy inside a lab's node namespace exactly as a user would: the CLI, in a subprocess.

Shared by `pyproxy demo` and the end-to-end tests, so both start, check, stop and clean up pyproxy alike:

    with Pyproxy(lab, source_dir, log_path=...) as proxy:
        proxy.start()
        proxy.wait_healthy()
        ... traffic ...
        assert proxy.terminate() == 0
        proxy.cleanup()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from labkit.netns import Lab, LabError
from labkit.traffic import ProbeResult

HEALTHZ_PORT = 10256
METRICS_PORT = 10249


PACKAGE = Path(__file__).resolve().parents[2] / "pyproxy"
"""This checkout's pyproxy package (the lab is not in it)."""


def newer_release(workdir: Path, bpf_object: Path, abi_edits: dict[str, str]) -> tuple[str, ...]:
    """A stand-in for a newer release of pyproxy, as an upgrade under test meets it: a copy of this package in
    `workdir` whose pyproxy/dataplane/bpf/abi.py has each line of `abi_edits` replaced by its value (a map's new
    name, say), run with `bpf_object` (built to match). Returns the command prefix that starts it, for
    Pyproxy(wrapper=...): the copy first on the path and the working directory, so `python -m pyproxy` finds it
    before this checkout."""
    tree = workdir / "newer-release"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(PACKAGE, tree / "pyproxy", ignore=shutil.ignore_patterns("__pycache__"))
    abi = tree / "pyproxy" / "dataplane" / "bpf" / "abi.py"
    lines = abi.read_text().splitlines(keepends=True)
    for old, new in abi_edits.items():
        at = [i for i, line in enumerate(lines) if line.rstrip("\n") == old]
        if len(at) != 1:
            raise LabError(f"{abi}: want one line {old!r} to replace, found {len(at)}")
        lines[at[0]] = new + "\n"
    abi.write_text("".join(lines))
    return ("env", "-C", str(tree), f"PYTHONPATH={tree}", f"PYPROXY_BPF_OBJECT={bpf_object}")


class PyproxyError(LabError):
    """pyproxy did not do what a user expects; the message ends with the tail of its log."""


class Pyproxy:
    """`python -m pyproxy run --proxy-mode=bpf ...` in `lab.node`, logging to `log_path`.

    The healthz and metrics addresses are on the node namespace's own loopback, so the default ports never
    clash between parallel labs. The pin path is the lab's own (under the labs' bpffs outside /sys)."""

    def __init__(self, lab: Lab, source: Path | str | None, *, log_path: Path | str | None = None,
                 devices: Sequence[str] | None = None, xdp_devices: Sequence[str] | None = None,
                 extra_args: Sequence[str] = (), healthz_port: int = HEALTHZ_PORT,
                 metrics_port: int = METRICS_PORT, mode: str = "bpf", wrapper: Sequence[str] = ()) -> None:
        self.lab = lab
        self.source = Path(source) if source is not None else None
        """Manifests to read; None when `extra_args` name an API server (--kubeconfig)."""
        self.log_path = Path(log_path) if log_path is not None else lab.workdir / "pyproxy.log"
        self.devices = devices
        self.xdp_devices = xdp_devices
        self.extra_args = tuple(extra_args)
        self.mode = mode
        """--proxy-mode: bpf, nftables, iptables, ipvs or auto."""
        self.wrapper = tuple(wrapper)
        """A command that runs pyproxy's command line, e.g. capsh dropping capabilities; it must exec it."""
        self.healthz_url = f"http://127.0.0.1:{healthz_port}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self._healthz_address = f"127.0.0.1:{healthz_port}"
        self._metrics_address = f"127.0.0.1:{metrics_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._cleaned = False

    @property
    def pin_path(self) -> str:
        return self.lab.pin_path

    def command(self) -> list[str]:
        argv = [*self.wrapper, sys.executable, "-m", "pyproxy", "run", f"--proxy-mode={self.mode}",
                f"--bpf-pin-path={self.pin_path}", f"--healthz-bind-address={self._healthz_address}",
                f"--metrics-bind-address={self._metrics_address}"]
        if self.mode in ("bpf", "auto"):
            # The socket hooks act on the lab's own cgroup: on the machine's root cgroup they would act on every
            # process here. (Other modes would only warn that they do not honour it.)
            argv.append(f"--cgroup-root={self.lab.cgroup}")
        if self.source is not None:
            argv.append(f"--source={self.source}")
        if self.devices is not None:
            argv.append(f"--devices={','.join(self.devices)}")
        if self.xdp_devices is not None:
            argv.append(f"--xdp-devices={','.join(self.xdp_devices)}")
        return argv + list(self.extra_args)

    # ---- lifecycle

    def __enter__(self) -> Pyproxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        if self.running:
            raise PyproxyError("pyproxy already running")
        self._cleaned = False
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log.write(f"### {' '.join(self.command())}\n".encode())
        self._log.flush()
        self.proc = self.lab.popen(self.lab.node, *self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                   stderr=subprocess.STDOUT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, deadline: float = 20.0) -> float:
        """Wait until /healthz answers 200 (asked from inside the node); returns the seconds it took."""
        start = time.monotonic()
        end = start + deadline
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise PyproxyError(f"pyproxy exited with status {self.proc.returncode} before it was healthy"
                                   + self._tail())
            remaining = end - time.monotonic()
            # Short polls, so an early exit of pyproxy is noticed without waiting out the whole deadline.
            result = self.lab.http_get(self.lab.node, self.healthz_url, timeout=1.0, wait=min(2.0, remaining),
                                       expect=200)
            if result["status"] == 200:
                return time.monotonic() - start
            if time.monotonic() >= end:
                raise PyproxyError(f"/healthz not 200 within {deadline:g}s (last: status={result['status']} "
                                   f"error={result['error']} body={result['body'][:200]!r})" + self._tail())

    def terminate(self, timeout: float = 10.0) -> int | None:
        """SIGTERM; the exit status, or None if it had not exited within `timeout` (it is then killed)."""
        if self.proc is None:
            raise PyproxyError("pyproxy was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        """Kill pyproxy if it still runs, then `pyproxy cleanup`; failures only logged."""
        self.kill()
        if self.proc is not None and not self._cleaned:
            try:
                self.cleanup()
            except LabError as exc:
                self._write_log(f"### cleanup at close failed: {exc}\n")
        if self._log is not None:
            self._log.close()
            self._log = None

    # ---- other subcommands

    def cli(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """`python -m pyproxy ARGS --bpf-pin-path=...` in the node namespace (cleanup needs its devices)."""
        cp = self.lab.python(self.lab.node, "-m", "pyproxy", *args, f"--bpf-pin-path={self.pin_path}",
                             check=False, timeout=timeout)
        self._write_log(f"### pyproxy {' '.join(args)} -> {cp.returncode}\n{cp.stdout}{cp.stderr}")
        if check and cp.returncode != 0:
            raise PyproxyError(f"pyproxy {' '.join(args)} exited {cp.returncode}:\n{cp.stdout}{cp.stderr}")
        return cp

    def inspect(self) -> str:
        return self.cli("inspect").stdout

    def cleanup(self) -> subprocess.CompletedProcess[str]:
        cp = self.cli("cleanup")
        self._cleaned = True
        return cp

    # ---- log

    def _write_log(self, text: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(text)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _tail(self) -> str:
        return f"\n--- pyproxy log tail ({self.log_path}) ---\n{self.log_tail()}"

    def wait_for_log(self, text: str, deadline: float = 5.0) -> bool:
        """Poll the log until it contains `text` (bounded); whether it did."""
        end = time.monotonic() + deadline
        while text not in self.log_text():
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)
        return True


def write_manifest(directory: Path | str, name: str, text: str) -> Path:
    """Write a manifest atomically (temp file + rename), so a watching pyproxy never reads half a file.

    The temp file is a dotfile without a .yaml suffix, which no manifest loader should pick up."""
    path = Path(directory) / name
    tmp = path.with_name(f".{name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def describe(result: ProbeResult) -> str:
    """A one-line summary of a probe result for messages."""
    replies = ", ".join(f"{k}={v}" for k, v in result["replies"].items()) or "none"
    return f"replies: {replies}; failures: {result['failures']} {result['errors'] or ''}".rstrip()
