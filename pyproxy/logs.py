"""Logging as upstream kube-proxy's (klog) is read: `-v N` shows the info lines of verbosity N and below, and
`--logging-format=json` writes one JSON object a line with upstream's keys (ts, v, msg, and the line's own
key/value pairs; errors carry "err").

A line of verbosity N is logged at the Python level `vlevel(N)`: V(0) is INFO, each step down by 2, V(5) is DEBUG.
`kv(logger, v, msg, **pairs)` logs a structured line: text "msg key=value ...", JSON the pairs as fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

FORMATS = ("text", "json")
_STEP = 2


def vlevel(v: int) -> int:
    """The Python level of an info line of verbosity `v` (0: INFO)."""
    return max(1, logging.INFO - _STEP * v)


def verbosity_of(level: int) -> int:
    """The upstream verbosity of a record at `level` (0 for INFO and above)."""
    return 0 if level >= logging.INFO else (logging.INFO - level + _STEP - 1) // _STEP


def _value(v: object) -> str:
    text = str(v)
    return f'"{text}"' if not text or any(c in text for c in ' "=') else text


def kv(logger: logging.Logger, v: int, msg: str, **pairs: object) -> None:
    """Log `msg` at verbosity `v` with key/value pairs (a structured line, as upstream's InfoS)."""
    level = vlevel(v)
    if logger.isEnabledFor(level):
        text = " ".join([msg, *(f"{k}={_value(val)}" for k, val in pairs.items())])
        logger.log(level, "%s", text, extra={"kv_msg": msg, "kv": pairs}, stacklevel=2)


class JsonFormatter(logging.Formatter):
    """Upstream's JSON log lines (component-base's zap encoder): {"ts": <unix seconds>, "caller": ..., "msg":
    ..., "v": N} for info, {"ts", "caller", "msg", "err"} for errors, the line's pairs as further keys."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6), "caller": f"{record.module}.py:{record.lineno}",
                               "logger": record.name}
        pairs: dict[str, object] = getattr(record, "kv", {})
        out["msg"] = getattr(record, "kv_msg", None) or record.getMessage()
        if record.levelno >= logging.ERROR:
            out["err"] = out["msg"]
        elif record.levelno >= logging.WARNING:
            out["level"] = "warning"
        else:
            out["v"] = verbosity_of(record.levelno)
        for k, val in pairs.items():
            out.setdefault(k, val if isinstance(val, (int, float, bool)) or val is None else str(val))
        if record.exc_info:
            out["stacktrace"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if logging.DEBUG < record.levelno < logging.INFO:
            record.levelname = f"I{verbosity_of(record.levelno)}"  # an info line of verbosity N
        return super().format(record)


def setup(verbosity: int, fmt: str = "text", stream: Any = None) -> None:
    """Root logging for `-v verbosity` (negative: errors only) in `fmt` (FORMATS), to stderr."""
    level = logging.ERROR if verbosity < 0 else vlevel(verbosity)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    logging.Formatter.converter = time.localtime
