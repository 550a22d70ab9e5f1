"""`nccl-exporter trace`: print every NCCL call as it returns, or record to SQLite.

Its options are the settings of exporter/agent/config that `trace` has; the
recording is opened by agent/pipeline.py, the printer is here."""

from __future__ import annotations

import json
import sys
import time

from exporter.records import render
from exporter.records.events import CallEvent
from exporter.agent import config
from exporter.cli.common.options import add_deprecated_alias


def add_parser(sub) -> None:
    t = sub.add_parser("trace", help="print every NCCL call as it returns, or record them to SQLite",
                       description="Attach the probes like 'run' and print every NCCL call of the node's "
                                   "processes as it returns (stdout; status lines on stderr), or with --db "
                                   "record every call, TCP retransmit/reset and scheduler wait to SQLite. "
                                   "Stops after --duration or at Ctrl-C, losing nothing already seen.")
    config.add_options(t, "trace")
    add_deprecated_alias(t, "--out", "--db")
    t.set_defaults(func=main)


def main(args) -> int:
    from contextlib import ExitStack

    from exporter.agent.logs import announce, json_logs, setup_logging
    from exporter.agent.pipeline import open_pipeline
    from exporter.agent.start import start_agent, stop_on_signals
    from exporter.cli.common.progress import Progress

    cfg = config.build("trace", args)
    setup_logging(cfg.log_level, cfg.log_format, cfg.node)
    counts = {"shown": 0}
    started = time.monotonic()
    with ExitStack() as opened:
        pipeline = open_pipeline(cfg, opened)  # the recording (--db): a bad path fails before the probes load
        recorder = pipeline.recorder
        agent = start_agent(cfg)
        opened.callback(agent.close, detach_in_background=True)  # the kernel's detaching outlives us (~0.13 s a probe)
        pipeline.attach(agent)
        scope = pipeline.scope

        def show(event):
            if not isinstance(event, CallEvent) or event.pid not in scope:
                return
            counts["shown"] += 1
            if cfg.format == "json":
                print(json.dumps(render.as_dict(event)), flush=True)
            else:
                print(render.text(event), flush=True)

        if recorder is None:
            pipeline.listen(show)
        what = f"for {cfg.duration:g} s" if cfg.duration else "until Ctrl-C"
        where = f" to {cfg.db} ({scope.describe()})" if recorder is not None else ""
        traced_at = time.monotonic()  # --duration counts from here, after the start-up
        announce(f"tracing NCCL calls {what}{where} (start-up took {traced_at - started:.1f} s)...", sys.stderr)
        stop = stop_on_signals()
        if recorder is not None:
            recorder.on_error = lambda _message: stop.set()  # end now; close() says why, exit 2
        deadline = traced_at + cfg.duration if cfg.duration else None
        # the progress line is for a person: none in JSON logs
        progress = Progress(recorder, sys.stderr) if recorder is not None and not json_logs() else None
        if progress is not None:
            opened.callback(progress.done)  # before the recording closes
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            agent.step()
            if progress is not None:
                recorder.set_kernel_lost(**agent.kernel_losses())
                progress.tick()
        agent.poll(0)  # what is already in the ring buffers is not lost
        lost = agent.reader.counters()["EVENTS_LOST"]
        pipeline.finish()
    startup = f" after {traced_at - started:.1f} s of start-up"
    if recorder is not None:
        announce(f"recorded in {time.monotonic() - traced_at:.1f} s{startup}: {recorder.summary()}", sys.stderr)
    else:
        announce(f"{counts['shown']} calls traced in {time.monotonic() - traced_at:.1f} s{startup}, {lost} lost",
                 sys.stderr)
    return 0
