"""`nccl-exporter run`: the agent, serving /metrics (and spans, and a recording).

Its options are the settings of exporter/agent/config (each also a key of
`run --config FILE`); the sinks they name are opened by agent/pipeline.py."""

from __future__ import annotations

import argparse

from exporter.records import contract
from exporter.agent import config
from exporter.agent.preflight import CAPABILITIES


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="attach the probes and serve /metrics",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Attach uprobes to libnccl and serve Prometheus metrics "
                                   f"(default port {contract.DEFAULT_PORT}). Needs "
                                   + ", ".join(f"CAP_{c}" for c in CAPABILITIES)
                                   + " (root has them; docs/deploy.md says why each). Every option is "
                                     "also a key of --config FILE; a flag beats the file, which beats "
                                     "environment variables (docs/configuration.md).")
    config.add_options(r, "run", config_flag=True)
    r.set_defaults(func=main)


def main(args) -> int:
    from contextlib import ExitStack

    from exporter.agent.logs import announce, setup_logging
    from exporter.agent.pipeline import open_pipeline
    from exporter.agent.start import start_agent, stop_on_signals

    cfg = config.build("run", args)
    setup_logging(cfg.log_level, cfg.log_format, cfg.node)
    # What is opened is closed in the reverse order, also when a later step fails.
    with ExitStack() as opened:
        pipeline = open_pipeline(cfg, opened)  # bad input or a busy port: before the probes load
        agent = start_agent(cfg)
        # the kernel's detaching (~0.13 s a probe) outlives the process: docs/deploy.md "Stopping"
        opened.callback(agent.close, detach_in_background=True)
        pipeline.attach(agent)
        stop = stop_on_signals()
        try:
            agent.run_until(stop)
        finally:
            pipeline.finish()
    announce("nccl-exporter: stopped")
    return 0
