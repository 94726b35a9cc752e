"""Keeping node sockets off the SNAT ports (pyproxy/dataplane/bpf/snat.py), on a stand-in for /proc/sys/net/ipv4."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyproxy.dataplane.bpf import snat


def sysctl(tmp_path: Path, ephemeral: str, reserved: str = "") -> Path:
    (tmp_path / "ip_local_port_range").write_text(ephemeral + "\n")
    (tmp_path / "ip_local_reserved_ports").write_text(reserved + "\n")
    return tmp_path


def test_the_default_range_lies_above_linuxs_ephemeral_ports(tmp_path: Path) -> None:
    d = sysctl(tmp_path, "32768\t60999")
    assert snat.reserve((61000, 65535), d) is None
    assert (d / "ip_local_reserved_ports").read_text() == "\n", "nothing to reserve, nothing written"


def test_an_overlapping_range_is_reserved_beside_what_was(tmp_path: Path) -> None:
    d = sysctl(tmp_path, "1024\t65535", "30000-32767,8080")
    said = snat.reserve((61000, 65535), d)
    assert said and "61000-65535" in said and "1024-65535" in said
    assert snat.parse_ranges((d / "ip_local_reserved_ports").read_text()) == [(30000, 32767), (8080, 8080),
                                                                               (61000, 65535)]
    assert snat.reserve((61000, 65535), d) is None, "reserved already: a restart adds nothing"


@pytest.mark.parametrize(("ports", "ephemeral", "reserved", "reachable"), [
    ((61000, 61010), (32768, 61005), [], True),
    ((61000, 61010), (32768, 61005), [(61000, 61005)], False),
    ((61000, 61010), (61011, 65535), [], False),
])
def test_uncovered(ports: tuple[int, int], ephemeral: tuple[int, int], reserved: list[tuple[int, int]],
                   reachable: bool) -> None:
    assert snat.uncovered(ports, ephemeral, reserved) is reachable
