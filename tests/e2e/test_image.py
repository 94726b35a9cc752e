"""The container image of `make image`: it runs pyproxy's CLI, and serves a lab's traffic the way the DaemonSet
runs it (privileged, the node's network namespace, host paths), started by runc from the OCI layout, no registry.

Builds the image first: the Debian base comes from ~/.cache/pyproxy/image when its inputs are unchanged (a
fresh build takes about a minute), the pyproxy layer is rebuilt from this tree every time (seconds)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import ocirun
import pytest
from labkit.netns import BPFFS_DIR, CGROUP_DIR, ensure_bpffs, ensure_cgroup2
from scenarios import assert_core_traffic, write_core_manifests

from pyproxy import __version__

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    image = ocirun.build_image()
    assert image.endswith(f":{__version__}"), image
    yield ocirun.unpack(image, tmp_path_factory.mktemp("image") / "bundle")


def test_the_image_has_the_product_and_no_lab(rootfs: Path) -> None:
    """The lab is development tooling (tests/labkit): neither the wheel nor so the image has it. Both BPF objects
    are there (the datapath, and the socket destroyer beside it)."""
    lab = [str(p.relative_to(rootfs)) for p in rootfs.rglob("*") if p.name in ("labkit", "lab") and p.is_dir()]
    assert not lab, f"lab code in the image: {lab}"
    assert list(rootfs.rglob("site-packages/pyproxy/cli.py")), "no pyproxy package in the image"
    for obj in ("pyproxy.bpf.o", "sockdestroy.bpf.o"):
        assert (rootfs / "usr/lib/pyproxy" / obj).is_file(), obj


def test_the_image_runs_the_cli(rootfs: Path, tmp_path: Path) -> None:
    out = ocirun.run(rootfs, ["--help"], [], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "{run,inspect,cleanup" in out.stdout, out.stdout
    # --version arrives with --config (issue 12): checked once the CLI has it.
    if "--version" in out.stdout:
        out = ocirun.run(rootfs, ["--version"], [], tmp_path)
        assert out.returncode == 0 and __version__ in out.stdout + out.stderr, out


def test_the_image_serves_a_lab(make_env, rootfs: Path, tmp_path: Path) -> None:
    env = make_env(3)
    write_core_manifests(env)
    ensure_bpffs()
    ensure_cgroup2()
    binds = [str(BPFFS_DIR), str(CGROUP_DIR), str(env.source)]
    wrapper = [sys.executable, ocirun.__file__, "--rootfs", str(rootfs), "--state", str(tmp_path),
               *(f"--bind={b}" for b in binds), "--"]
    proxy = env.start(wrapper=wrapper)
    containers = env.lab.exec(env.lab.node, "runc", "--root", str(tmp_path / "runc"), "list").stdout
    assert " running " in containers, f"pyproxy is not the image's, in a container:\n{containers}"
    assert_core_traffic(env)
    prog_ids = {i for ids in env.attached_programs().values() for i in ids}
    assert prog_ids, "no BPF programs attached by the image's pyproxy"
    assert proxy.terminate(10.0) == 0
    # `pyproxy cleanup` from the image too: what the migration back to kube-proxy runs first.
    env.lab.exec(env.lab.node, *ocirun.command(rootfs, ["cleanup", f"--bpf-pin-path={env.lab.pin_path}"], binds,
                                               tmp_path))
    assert env.leftovers(prog_ids) == []
