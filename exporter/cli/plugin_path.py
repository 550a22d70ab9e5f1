"""`nccl-exporter plugin-path`: the absolute path of the NCCL profiler plugin.

    NCCL_PROFILER_PLUGIN=$(nccl-exporter plugin-path) torchrun ...

Builds the plugin first when it is missing or older than its sources
(exporter/sources/plugin/build.py; needs gcc). See docs/plugin.md.
"""

from __future__ import annotations

from exporter.cli.common.options import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("plugin-path", help="print the path of the NCCL profiler plugin (GPU time)",
                       description="Print the absolute path of nccl-exporter's NCCL profiler plugin "
                                   "(libnccl-profiler-exporter.so), building it if needed; set it as "
                                   "NCCL_PROFILER_PLUGIN to measure collectives on the GPU.")
    p.set_defaults(func=main)


def main(args) -> int:
    from exporter.sources.plugin.build import build_plugin

    try:
        path = build_plugin()
    except Exception as e:  # noqa: BLE001 - any build failure is the one-line error
        raise CliError(f"cannot build the profiler plugin: {str(e).splitlines()[0]}") from None
    print(path)
    return 0
