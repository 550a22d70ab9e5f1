"""Opening a recording for a command: the read side's one-line error as the CLI's."""

from __future__ import annotations

from exporter.cli.common.options import CliError
from exporter.sinks.recording.read import ReadError, Recording


def open_recording(path: str) -> Recording:
    """Read-only; CliError (one line) when it is missing or not a recording."""
    try:
        return Recording.open(path)
    except ReadError as e:
        raise CliError(str(e)) from None
