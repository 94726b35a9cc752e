"""Logging as upstream's: -v levels, structured lines, --logging-format=json."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyproxy import logs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _log(verbosity: int, fmt: str) -> list[str]:
    out = io.StringIO()
    logs.setup(verbosity, fmt, stream=out)
    log = logging.getLogger("pyproxy.test")
    log.info("Using bpf Proxier")
    logs.kv(log, 2, "SyncProxyRules complete", elapsed="1.5ms", fullSync=True, services=3)
    log.debug("a debug line")
    log.warning("a warning")
    log.error("an error")
    return out.getvalue().splitlines()


@pytest.mark.usefixtures("restore_root")
def test_v_shows_info_lines_of_that_verbosity_and_below() -> None:
    assert [line.split(": ", 1)[1] for line in _log(0, "text")] == ["Using bpf Proxier", "a warning", "an error"]
    two = _log(2, "text")
    assert any(line.endswith("SyncProxyRules complete elapsed=1.5ms fullSync=True services=3") for line in two)
    assert " I2 " in next(line for line in two if "SyncProxyRules" in line)
    assert not any("a debug line" in line for line in two)
    assert any("a debug line" in line for line in _log(5, "text"))
    assert [line.split(": ", 1)[1] for line in _log(-1, "text")] == ["an error"]


@pytest.mark.usefixtures("restore_root")
def test_json_lines_carry_upstreams_keys() -> None:
    lines = [json.loads(line) for line in _log(2, "json")]
    using, sync, warning, error = lines
    assert using["msg"] == "Using bpf Proxier" and using["v"] == 0 and isinstance(using["ts"], float)
    assert sync == {**sync, "msg": "SyncProxyRules complete", "v": 2, "elapsed": "1.5ms", "fullSync": True,
                    "services": 3}
    assert sync["caller"].startswith("test_logs.py:") and "v" not in error
    assert error["err"] == "an error"
    assert warning["msg"] == "a warning"


def test_the_cli_writes_json_lines_with_logging_format_json(tmp_path: Path) -> None:
    out = tmp_path / "config.yaml"
    done = subprocess.run([sys.executable, "-m", "pyproxy.cli", "--logging-format=json", "-v", "2",
                           f"--write-config-to={out}"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert lines, done.stderr
    assert any(line["msg"].startswith("wrote the configuration to") and line["v"] == 0 for line in lines)
