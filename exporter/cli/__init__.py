"""nccl-exporter's command line: one module per command in this package,
each with `add_parser(sub)` and `main(args)`; what they share is in common/.
To add a command, add a module here: it is found by name (the core commands
come first in --help, the others in alphabetical order)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from exporter import __version__
from exporter.records import contract
from exporter.agent.config import SetupError
from exporter.agent.preflight import CAPABILITIES

CORE = ("check", "run", "trace", "query", "demo")
NOT_COMMANDS = {"common"}


def commands() -> list:
    """The command modules of this package, core ones first."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_COMMANDS]
    ordered = [n for n in CORE if n in names] + sorted(n for n in names if n not in CORE)
    return [importlib.import_module(f"{__name__}.{n}") for n in ordered]

EPILOG = """\
examples:
  nccl-exporter check                      # can this node run the agent?
  nccl-exporter run                        # export metrics on :%d/metrics
  nccl-exporter run --nccl-lib /opt/nccl/lib/libnccl.so.2 --node gpu-017
  nccl-exporter trace --duration 10s       # print every NCCL call for 10 s
  nccl-exporter demo                       # an 8-rank simulated job, with loss

Without --nccl-lib the agent attaches to every libnccl that running
processes have mapped (wheels under site-packages included) and keeps
watching for new ones. It needs the capabilities %s (root has
them; in a container grant exactly these: docs/deploy.md), tracefs and kernel
headers: 'nccl-exporter check' says what is missing.
""" % (contract.DEFAULT_PORT, ", ".join(f"CAP_{c}" for c in CAPABILITIES))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error: 'nccl-exporter: error: ...', exit 2."""

    def error(self, message):
        self.exit(2, f"nccl-exporter: error: {message}; see '{self.prog} --help'\n")


def version_text() -> str:
    """`--version`: what a bug report needs to name the build and its contracts."""
    from exporter.sinks.recording.schema import SCHEMA_VERSION
    from exporter.sources.plugin.build import interface_versions

    try:
        plugin = ", ".join(f"ncclProfiler_v{v}" for v in interface_versions())
    except RuntimeError as e:  # no plugin sources: a broken install
        plugin = str(e)
    return (f"nccl-exporter {__version__}\n"
            f"profiler plugin interfaces: {plugin}\n"
            f"recording schema: {SCHEMA_VERSION}\n")


class _Version(argparse.Action):
    """Like action="version", computed only when asked for."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(version_text())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nccl-exporter",
        description="eBPF agent that measures NCCL calls (uprobes on libnccl) and exports "
                    "them as Prometheus metrics.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Version, nargs=0,
                   help="the version, the NCCL profiler interfaces the plugin offers and the "
                        "recording schema, then exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in commands():
        command.add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SetupError as e:  # CliError is one
        print(f"nccl-exporter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
