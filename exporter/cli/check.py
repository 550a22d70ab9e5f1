"""`nccl-exporter check`: what works and what is missing on this host."""

from __future__ import annotations

import argparse

from exporter.cli.common.options import add_lib_option


def add_parser(sub) -> None:
    c = sub.add_parser(
        "check", help="say what works and what is missing on this host",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One line per check: 'ok', 'FAIL' (required: run cannot work) or\n"
                    "'warn' (optional: run works with less), and what to do.\n"
                    "  privileges      the capabilities run needs (docs/deploy.md)\n"
                    "  bpf syscall     a BPF map can be created (seccomp, lockdown, containers)\n"
                    "  tracefs         /sys/kernel/tracing is mounted\n"
                    "  uprobes         the kernel offers uprobe_events\n"
                    "  tracepoints     the TCP and scheduler tracepoints exist\n"
                    "  btf             /sys/kernel/btf/vmlinux (optional: --sched waits checks\n"
                    "                  tracepoint prototypes with it)\n"
                    "  schedstat       /proc/<pid>/schedstat (optional: --sched totals)\n"
                    "  kernel headers  for BCC to compile the BPF programs\n"
                    "  bcc module      Debian's python3-bpfcc, visible to this Python\n"
                    "  nccl libraries  libnccl found (optional: run attaches when a job loads one)\n"
                    "  plugin *        the profiler plugin: built, loads, its interfaces (optional:\n"
                    "                  GPU time)\n"
                    "Exit status 0 when every required check passes, else 1.\n"
                    "Symptoms and fixes: docs/troubleshooting.md.")
    add_lib_option(c)
    c.set_defaults(func=main)


def main(args) -> int:
    from exporter.agent import preflight

    return preflight.main(nccl_libs=args.nccl_lib or ())
