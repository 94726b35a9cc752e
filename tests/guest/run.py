"""Run one shell command as root inside the qemu guest built by build-image.sh, with this checkout shared.

    python3 tests/guest/run.py [--timeout 900] [--smp 1] -- python -m pytest -q tests/guest_ipvs

Why a guest at all: this machine's kernel has no IPVS and cannot load modules, so the IPVS dataplane is tested
on Debian's own kernel (shared notes, vm-lab.md). How:

- TCG, not KVM: /dev/kvm here is a paravirtual host on which stock kernels fail or hang. `-smp 2` boots a few
  seconds slower than 1, but the tests run several Python processes at once (pyproxy, servers, probes):
  the IPVS suite took 232 s with 2 CPUs against 372 s with 1.
- Direct kernel boot (-kernel/-initrd) of the cached image; the root image is attached with snapshot=on, so a
  run can write anywhere and leaves the image as it was.
- Two 9p shares: the checkout, read-only, mounted at the same path as on the host (PYTHONPATH points there,
  so the guest runs the current code, never a copy baked into the image), and a fresh output folder where the
  guest finds `run.sh` and leaves `output.log` and `rc`.
- The guest's PID 1 (pyproxy-guest-init, in the image) runs run.sh, writes its exit code and powers off; it
  never offers a shell. A run without an `rc` file (crash, panic, timeout) is a failure, never a pass.

Stdlib only: it runs before any venv exists. Importable: `run_in_guest(command) -> GuestResult`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = Path(__file__).resolve().with_name("build-image.sh")
GUEST_VENV = "/opt/pyproxy-venv"
GUEST_PYCACHE = "/var/tmp/pyproxy-pycache"
DEFAULT_TIMEOUT = 900.0
# What IPVS mode and its tests need, loaded in the guest's initial namespace before anything runs (modules
# are global: namespaces created later see them).
MODULES = (
    "ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_lc", "ip_vs_wlc", "ip_vs_sed", "ip_vs_nq", "ip_vs_sh", "ip_vs_dh",
    "ip_vs_mh", "nf_conntrack",
    "nf_nat", "ip_set", "ip_set_hash_ip", "ip_set_hash_ipport", "ip_set_hash_ipportip", "ip_set_hash_ipportnet",
    "xt_set", "xt_ipvs", "xt_mark", "xt_comment", "xt_addrtype", "xt_conntrack", "xt_MASQUERADE", "xt_nat",
    "iptable_nat", "iptable_filter", "nf_tables", "nft_compat", "nft_chain_nat", "nf_reject_ipv4", "nft_reject",
    "ipt_REJECT", "dummy", "veth",
    # IPv6: ip6tables' tables and REJECT (the ipsets' and xt matches' modules serve both families).
    "ip6table_nat", "ip6table_filter", "nf_reject_ipv6", "ip6t_REJECT",
)


class GuestError(RuntimeError):
    """The guest could not be started, or the image could not be built."""


@dataclass(frozen=True)
class GuestResult:
    returncode: int
    """The command's exit code; 124 when the run timed out, 125 when the guest left no exit code."""
    output: str
    """What the command printed (its stdout and stderr, as the guest recorded them)."""
    console: str
    """Everything qemu's serial console showed, kernel messages included (for diagnosing a failed boot)."""
    seconds: float


def build_image(log: TextIO = sys.stderr) -> Path:
    """Run build-image.sh (returns at once when the cached image is current); the cache directory."""
    try:
        cp = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=log, text=True,
                            timeout=1800)
    except subprocess.TimeoutExpired as e:
        raise GuestError(f"{BUILD_SCRIPT} did not finish within 30 minutes") from e
    if cp.returncode != 0:
        raise GuestError(f"{BUILD_SCRIPT} exited {cp.returncode} (its log is above)")
    return Path(cp.stdout.strip().splitlines()[-1])


def guest_script(command: str, repo: Path, env: dict[str, str]) -> str:
    """run.sh: load the modules, enter the checkout with the guest's venv first on PATH, run `command`."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return "\n".join([
        "set -u",
        f"modprobe -a {' '.join(MODULES)} || echo 'guest: some modules did not load' >&2",
        # Bytecode of the checkout goes to the guest's own (throwaway) disk, never into the host's share: it
        # is compiled once per boot, not at every start of a Python process (seconds each under emulation).
        f"export PATH={GUEST_VENV}/bin:$PATH PYTHONPATH={shlex.quote(f'{repo}:{repo}/tests')} "
        f"PYTHONPYCACHEPREFIX={GUEST_PYCACHE} "
        f"PYTHONUNBUFFERED=1 {exports}".rstrip(),
        f"cd {shlex.quote(str(repo))}",
        command,
        "",
    ])


def qemu_argv(image: Path, repo: Path, out: Path, smp: int, memory_mb: int, extra: Sequence[str] = ()) -> list[str]:
    """qemu's command line; `extra` is appended (more devices: a restricted user-mode network, a share)."""
    append = " ".join([
        "console=ttyS0", "quiet", "loglevel=3", "panic=-1", "mitigations=off", "8250.nr_uarts=1",
        f"pyproxy.repo={repo}",
    ])
    return [
        "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(smp),
        "-m", str(memory_mb), "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none",
        "-monitor", "none", "-serial", "stdio",
        "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img"), "-append", append,
        "-drive", f"file={image / 'rootfs.img'},if=virtio,format=raw,snapshot=on",
        "-fsdev", f"local,id=repo,path={repo},security_model=none,readonly=on",
        "-device", "virtio-9p-pci,fsdev=repo,mount_tag=repo",
        "-fsdev", f"local,id=out,path={out},security_model=none",
        "-device", "virtio-9p-pci,fsdev=out,mount_tag=out",
        *extra,
    ]


def _pump(stream: TextIO, sink: list[str], echo: TextIO | None) -> None:
    for line in stream:
        sink.append(line)
        if echo is not None:
            echo.write(line.replace("\r", ""))
            echo.flush()


def run_in_guest(command: str, *, repo: Path = REPO, timeout: float = DEFAULT_TIMEOUT, smp: int = 2,
                 memory_mb: int = 2048, env: dict[str, str] | None = None, echo: TextIO | None = sys.stdout,
                 image: Path | None = None, qemu_args: Sequence[str] = ()) -> GuestResult:
    """Boot the guest, run `command` (a shell line) as root in the checkout, power off; never raises for a
    failing command, only when qemu cannot start at all. `echo` gets the console as it arrives (from another
    thread). `qemu_args` are added to qemu's command line (e.g. bench/guest.py's network to the API server
    and its share). qemu never outlives the call: it is killed at `timeout` and when the wait is interrupted
    (an exception in the calling thread, e.g. a signal handler's)."""
    if shutil.which("qemu-system-x86_64") is None and image is None:
        build_image()  # installs qemu too
    image = image or build_image()
    start = time.monotonic()
    out = Path(tempfile.mkdtemp(prefix="pyproxy-guest-"))
    try:
        (out / "run.sh").write_text(guest_script(command, repo.resolve(), env or {}))
        argv = qemu_argv(image, repo.resolve(), out, smp, memory_mb, qemu_args)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as e:
            raise GuestError(f"cannot start {argv[0]}: {e}") from e
        console: list[str] = []
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, console, echo), daemon=True)
        pump.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait(timeout=30)
        except BaseException:
            proc.kill()
            proc.wait(timeout=30)
            raise
        pump.join(timeout=10)
        rc_file = out / "rc"
        output = (out / "output.log").read_text(errors="replace") if (out / "output.log").exists() else ""
        if timed_out:
            rc = 124
            output += f"\n[run.py] timed out after {timeout:g}s: qemu killed\n"
        elif rc_file.exists() and rc_file.read_text().strip().lstrip("-").isdigit():
            rc = int(rc_file.read_text().strip())
        else:
            rc = 125
            output += f"\n[run.py] the guest left no exit code (qemu exited {proc.returncode})\n"
        return GuestResult(rc, output, "".join(console), round(time.monotonic() - start, 1))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="wall-clock seconds for the whole run")
    ap.add_argument("--smp", type=int, default=2, help="guest CPUs (emulated, one host thread each)")
    ap.add_argument("--memory", type=int, default=2048, help="guest memory in MB")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout to share (default: this one)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the shell command (after --)")
    args = ap.parse_args(argv)
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not words:
        ap.error("no command given")
    if os.geteuid() != 0:
        print("note: not root; the 9p share may not be readable as the guest's root expects", file=sys.stderr)
    result = run_in_guest(" ".join(words), repo=args.repo, timeout=args.timeout, smp=args.smp,
                          memory_mb=args.memory)
    print(f"[run.py] exit {result.returncode} after {result.seconds:g}s", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
