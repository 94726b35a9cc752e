"""--cgroup-root on a node with systemd's hybrid cgroup layout (v1 controllers, the v2 hierarchy at `unified`):
the Vagrant lab's nodes boot so for kubelet 1.20, and the DaemonSet mounts the host's /sys/fs/cgroup whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyproxy.dataplane.bpf import cgroup, loader


def _mounts(monkeypatch: pytest.MonkeyPatch, types: dict[Path, str]) -> None:
    monkeypatch.setattr(loader, "fs_type", lambda path: types.get(Path(path), "tmpfs"))


def test_a_v2_root_is_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "unified").mkdir()
    _mounts(monkeypatch, {tmp_path: "cgroup2", tmp_path / "unified": "cgroup2"})
    assert cgroup.v2_directory(tmp_path) == tmp_path


def test_hybrid_layout_uses_its_unified_hierarchy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "unified").mkdir()
    (tmp_path / "cpu").mkdir()
    _mounts(monkeypatch, {tmp_path / "unified": "cgroup2", tmp_path / "cpu": "cgroup"})
    assert cgroup.v2_directory(tmp_path) == tmp_path / "unified"


def test_no_v2_hierarchy_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpu").mkdir()
    _mounts(monkeypatch, {tmp_path / "cpu": "cgroup"})
    with pytest.raises(loader.BpfUnavailable, match="not a cgroup v2 directory"):
        cgroup.v2_directory(tmp_path)
