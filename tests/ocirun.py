"""Run pyproxy's OCI image (deploy/build-image.sh) here, with no registry and no container daemon.

`umoci unpack` turns the image into a runtime bundle; each run gets a config.json of its own, derived from the
image's (entrypoint, environment), made as the DaemonSet makes its pod (deploy/daemonset.yaml): privileged, in the
caller's network namespace (hostNetwork; under `ip netns exec` that is a lab node's), with host paths bind-mounted,
and started by Debian's runc in the foreground, so signals and the exit status pass through as for a process.

As a program it is the wrapper a lab's Pyproxy takes (`wrapper=`): it replaces the `python -m pyproxy` that
follows it with the image's entrypoint:

    python tests/ocirun.py --rootfs DIR [--bind PATH ...] -- python -m pyproxy run ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "deploy" / "build-image.sh"
# Capabilities by number (0 .. CAP_CHECKPOINT_RESTORE = 40).
CAP_NAMES = [f"CAP_{name}" for name in (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE")]
# The DaemonSet's host paths that exist on any machine (bpffs and cgroup2 are the lab's own, passed as binds).
DAEMONSET_BINDS = [("/lib/modules", True), ("/run/xtables.lock", False)]


def build_image() -> str:
    """`make image`'s work (the base comes from the cache when its inputs are unchanged); the image reference."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PY": sys.executable})
    if out.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} exited {out.returncode}:\n{out.stderr[-4000:]}")
    return out.stdout.strip().splitlines()[-1]


def unpack(image: str, dest: Path) -> Path:
    """The image as a runtime bundle in `dest` (config.json and rootfs/); returns its rootfs."""
    subprocess.run(["umoci", "unpack", "--image", image, str(dest)], check=True, capture_output=True, timeout=300)
    return dest / "rootfs"


def _privileged_caps() -> list[str]:
    """What `privileged: true` gives a container: every capability of the runtime's own bounding set (here a
    sandbox may lack some, e.g. CAP_SYS_RESOURCE, and runc fails asking for one it cannot have)."""
    status = Path("/proc/self/status").read_text()
    bounding = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapBnd:")), 16)
    return [name for bit, name in enumerate(CAP_NAMES) if bounding >> bit & 1]


def _config(rootfs: Path, args: list[str], binds: Sequence[str]) -> dict:
    image = json.loads((rootfs.parent / "config.json").read_text())
    entrypoint = image["process"]["args"][:1]  # umoci's args: entrypoint + cmd; the cmd is replaced by `args`
    mounts = [m for m in image["mounts"] if m["destination"] != "/sys"]
    # A privileged container's /sys is writable (sysctls live in /proc/sys, but bpffs and cgroups under /sys).
    mounts.append({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec",
                                                                                           "nodev", "rw"]})
    # /lib/modules only where the host has one (this machine's kernel has no modules, nor a folder).
    for path, readonly in [b for b in DAEMONSET_BINDS if Path(b[0]).exists()] + [(b, False) for b in binds]:
        mounts.append({"destination": path, "type": "bind", "source": path,
                       "options": ["rbind", "ro" if readonly else "rw"]})
    linux = image["linux"]
    # hostNetwork: no network namespace of its own; no cgroup namespace, so cgroup paths read as on the host.
    linux["namespaces"] = [n for n in linux["namespaces"] if n["type"] not in ("network", "cgroup")]
    linux.pop("maskedPaths", None)
    linux.pop("readonlyPaths", None)
    linux.pop("resources", None)
    linux.pop("uidMappings", None)
    linux.pop("gidMappings", None)
    process = image["process"]
    process.update(args=entrypoint + args, terminal=False, noNewPrivileges=False,
                   capabilities={k: _privileged_caps() for k in ("bounding", "effective", "inheritable", "permitted")},
                   rlimits=[])
    return {**image, "root": {"path": str(rootfs), "readonly": False}, "mounts": mounts, "linux": linux,
            "process": process}


def command(rootfs: Path, args: list[str], binds: Sequence[str], state: Path) -> list[str]:
    """The runc command line running the image's entrypoint with `args`, `binds` (host paths) mounted read-write
    at the same paths (its config written in a fresh bundle under `state`)."""
    bundle = state / f"bundle-{uuid.uuid4().hex[:8]}"
    bundle.mkdir(parents=True)
    Path("/run/xtables.lock").touch(exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(_config(rootfs, args, binds), indent=1))
    runc = ["runc", "--root", str(state / "runc"), "run", "--bundle", str(bundle), bundle.name]
    # runc finds cgroups at /sys/fs/cgroup only, and `ip netns exec` remounts /sys without them: in a mount
    # namespace of its own, the hierarchy goes back where runc looks.
    mount = "mountpoint -q /sys/fs/cgroup || mount -t cgroup2 cgroup2 /sys/fs/cgroup; exec \"$@\""
    return ["unshare", "--mount", "--propagation=private", "sh", "-c", mount, "sh", *runc]


def run(rootfs: Path, args: list[str], binds: Sequence[str], state: Path,
        timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(rootfs, args, binds, state), capture_output=True, text=True, timeout=timeout)


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    p = argparse.ArgumentParser(prog="ocirun")
    p.add_argument("--rootfs", type=Path, required=True)
    p.add_argument("--state", type=Path, required=True, help="a directory for bundles and runc's state")
    p.add_argument("--bind", action="append", default=[], help="a host path mounted at the same path, read-write")
    opts = p.parse_args(argv[:sep])
    rest = argv[sep + 1:]
    # `python -m pyproxy ARGS` (what a lab's Pyproxy runs): the image's entrypoint is pyproxy itself.
    if rest[1:3] == ["-m", "pyproxy"]:
        rest = rest[3:]
    cmd = command(opts.rootfs, rest, opts.bind, opts.state)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
