"""--bpf-loader=bcc where BCC or its kernel headers are missing: a clear error naming what is missing and how to
install it, before anything is changed; bpf mode is then unavailable (auto moves on), and nothing ever picks BCC
unless asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyproxy.dataplane.bpf import bcc
from pyproxy.dataplane.bpf.backend import BpfDataplane
from pyproxy.dataplane.bpf.settings import BpfSettings
from pyproxy.proxier import modes
from pyproxy.proxier.config import ProxySettings


@pytest.fixture
def no_bcc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcc, "LIBBCC", "libbcc-not-installed.so.0")


@pytest.fixture
def no_headers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path / "linux-headers"))
    return tmp_path / "linux-headers"


def test_missing_bcc_names_the_package_and_the_make_target(no_bcc: None) -> None:
    problem = bcc.missing()
    assert problem is not None
    assert "BCC is not installed" in problem and "python3-bpfcc" in problem and "make install-bcc" in problem


def test_missing_headers_name_where_they_were_looked_for(no_headers: Path) -> None:
    if bcc.missing() is not None and "BCC is not installed" in str(bcc.missing()):
        pytest.skip("BCC itself is missing here: its message comes first")
    problem = bcc.missing()
    assert problem is not None
    assert str(no_headers) in problem and "BCC_KERNEL_SOURCE" in problem and "make install-bcc" in problem


def test_a_start_fails_before_it_changes_anything(no_bcc: None, tmp_path: Path) -> None:
    pins = tmp_path / "pins"
    with pytest.raises(bcc.BccUnavailable, match=r"^--bpf-loader=bcc: BCC is not installed"):
        BpfDataplane(BpfSettings(loader="bcc", pin_path=pins)).start()
    assert not pins.exists(), "the pin path was made before the loader was known to work"


def test_bpf_mode_says_why_it_cannot_run(no_bcc: None, tmp_path: Path) -> None:
    settings = ProxySettings(mode="bpf", bpf=BpfSettings(loader="bcc", pin_path=tmp_path / "pins"))
    with pytest.raises(modes.NoModeAvailable, match=r"--proxy-mode=bpf cannot run here: --bpf-loader=bcc: BCC is "
                                                    r"not installed .*python3-bpfcc"):
        modes.start_dataplane(settings)


def test_the_default_loader_is_libbpf_and_bcc_is_never_chosen_for_it() -> None:
    assert ProxySettings().bpf.loader == "libbpf"
    assert BpfSettings(loader="bpfcc").problems() == ["--bpf-loader must be one of libbpf, bcc, not 'bpfcc'"]
