"""What every command shares on the command line: the error type and the
argparse helpers. The agent's settings (run, trace) are in
exporter/agent/config; starting the agent, its logs and its sinks are in
exporter/agent/ (start.py, logs.py, pipeline.py)."""

from __future__ import annotations

import argparse
import sys

from exporter.agent.config import SETTINGS, SetupError
from exporter.agent.config.values import parse_duration, positive_duration, positive_int
from exporter.agent.config.values import parse_listen as _parse_listen

# the value parsers the commands use, from one place
__all__ = ["CliError", "add_deprecated_alias", "add_lib_option", "parse_duration", "parse_listen",
           "positive_duration", "positive_int"]


class CliError(SetupError):
    """Bad input or an unusable host: printed as one line, exit 2 (like the
    agent's SetupError, which it is)."""


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' -> (host, port); a CliError naming `flag`."""
    try:
        return _parse_listen(text)
    except argparse.ArgumentTypeError as e:
        raise CliError(f"{flag} {e}") from None


def add_lib_option(sp) -> None:
    """--nccl-lib as `run` and `trace` have it (check)."""
    (lib,) = [s for s in SETTINGS if s.name == "nccl_lib"]
    sp.add_argument(lib.flag, action="append", metavar=lib.metavar, help=lib.help)


class _DeprecatedAlias(argparse.Action):
    """An old flag name: sets the new one's value, with a warning line on stderr."""

    def __init__(self, option_strings, dest, new, **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"nccl-exporter: warning: {option_string} is deprecated and goes in the next release; "
              f"use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser, old: str | tuple[str, ...], new: str) -> None:
    """`old` (one flag or several) does what `new` does for one more release,
    hidden from --help and warned about when used (docs/configuration.md)."""
    (action,) = [a for a in parser._actions if new in a.option_strings]
    olds = (old,) if isinstance(old, str) else tuple(old)
    parser.add_argument(*olds, dest=action.dest, action=_DeprecatedAlias, new=new, metavar=action.metavar,
                        type=action.type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
