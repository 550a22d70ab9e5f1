"""The agent's logs: text or JSON lines on stderr, and its status lines
(where it serves, that it stopped). The keys of a JSON line are a contract
with log pipelines, like metric names (docs/troubleshooting.md, "Logs")."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# The keys of a --log-format json line (docs/troubleshooting.md, "Logs").
LOG_KEYS = ("time", "level", "message", "logger", "node")
LOG_CONTEXT_KEYS = ("comm", "rank")  # where the line is about one communicator rank
_ANNOUNCE = {"json": False}  # what setup_logging chose, for announce()


class _NodeFilter(logging.Filter):
    """Puts the agent's node name on every record (the `node` key of JSON lines)."""

    def __init__(self, node: str):
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "node", None):
            record.node = self.node
        return True


def setup_logging(level: str, fmt: str = "text", node: str = "") -> None:
    """Log records to stderr: text lines, or (fmt "json") one JSON object a
    line with the keys of LOG_KEYS, and those of LOG_CONTEXT_KEYS where a
    call passes them as `extra` (python-json-logger adds every extra)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "%(levelname)s %(message)s %(name)s", timestamp="time",
            rename_fields={"levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(_NodeFilter(node))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
    _ANNOUNCE["json"] = fmt == "json"


def announce(message: str, stream=None) -> None:
    """A status line of the agent (where it serves, that it stopped): as
    text on `stream` (default stdout), or with --log-format json a JSON
    record on stderr like every other line, whatever --log-level says (so a
    log pipeline sees only JSON)."""
    if _ANNOUNCE["json"]:
        status = logging.getLogger("nccl_exporter.status")
        status.setLevel(logging.INFO)
        status.info("%s", message)
    else:
        print(message, file=stream or sys.stdout, flush=True)


def json_logs() -> bool:
    """Whether setup_logging was asked for JSON lines."""
    return _ANNOUNCE["json"]
