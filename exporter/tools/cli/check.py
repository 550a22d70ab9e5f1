"""`nccl-exporter check`: what works and what is missing on this host."""

from __future__ import annotations

from exporter.tools.cli.options import add_lib_option


def add_parser(sub) -> None:
    c = sub.add_parser("check", help="say what works and what is missing on this host")
    add_lib_option(c)
    c.set_defaults(func=main)


def main(args) -> int:
    from exporter.tools import preflight

    return preflight.main(nccl_libs=args.nccl_lib or ())
