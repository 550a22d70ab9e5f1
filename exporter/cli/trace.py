"""`nccl-exporter trace`: print every NCCL call as it returns, or record to SQLite."""

from __future__ import annotations

import json
import sys
import time

from exporter.records import render
from exporter.records.events import CallEvent
from exporter.cli.common.options import (
    CliError,
    add_lib_option,
    add_log_options,
    announce,
    json_logs,
    add_pod_options,
    add_sched_options,
    open_recorder,
    parse_duration,
    recording_scope,
    setup_logging,
    start_agent,
    stop_on_signals,
)


def add_parser(sub) -> None:
    t = sub.add_parser("trace", help="print every NCCL call as it returns, or record them to SQLite",
                       description="Attach the probes like 'run' and print every NCCL call of the node's "
                                   "processes as it returns (stdout; status lines on stderr), or with --out "
                                   "record every call, TCP retransmit/reset and scheduler wait to SQLite. "
                                   "Stops after --duration or at Ctrl-C, losing nothing already seen.")
    t.add_argument("--duration", type=parse_duration, default=0.0, metavar="D",
                   help="stop after D (30s, 2m, ...); default: until Ctrl-C")
    t.add_argument("--format", choices=["text", "json"], default="text",
                   help="how calls are printed: text (default, one aligned line) or json (one object a "
                        "line, the recording's column names)")
    t.add_argument("--out", metavar="DB",
                   help="record every NCCL call, TCP retransmit/reset and scheduler wait to this "
                        "SQLite file instead of printing (docs/schema.md; read it with 'query')")
    t.add_argument("--pid", type=int, action="append", help="only this process (repeatable)")
    t.add_argument("--netns", metavar="PATH|INODE",
                   help="only processes in this network namespace (/run/netns/NAME, "
                        "/proc/PID/ns/net, or its inode number)")
    t.add_argument("--node", metavar="NAME",
                   help="node name stored in the recording (default: $NCCL_EXPORTER_NODE, hostname)")
    add_log_options(t, "warning")
    add_sched_options(t, "waits", "with --out")
    add_lib_option(t)
    add_pod_options(t)
    t.set_defaults(func=main)


def main(args) -> int:
    from exporter.sinks.recording.schema import RecordingError
    from exporter.sources.identity import node_name
    from exporter.agent.pipeline import Pipeline
    from exporter.cli.common.progress import Progress

    setup_logging(args.log_level, args.log_format or "text", node_name(args.node))
    scope = recording_scope(args)
    recorder = open_recorder(args.out, node_name(args.node), scope) if args.out else None
    try:
        agent, node = start_agent(args, {}, record_all=True,
                                    runq_event_min_ns=args.runq_wait_min if args.out else 0)
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise
    counts = {"shown": 0}

    def show(event):
        if not isinstance(event, CallEvent) or event.pid not in scope:
            return
        counts["shown"] += 1
        if args.format == "json":
            print(json.dumps(render.as_dict(event)), flush=True)
        else:
            print(render.text(event), flush=True)

    pipeline = Pipeline(agent, node)
    if recorder is not None:
        recorder.note(clock_offset_ns=agent.reader.clock.offset_ns)
        recorder.identify = agent.processes.describe  # pod and library version as on /metrics
        pipeline.listen(recorder)
    else:
        pipeline.listen(show)
    what = f"for {args.duration:g} s" if args.duration else "until Ctrl-C"
    where = f" to {args.out} ({scope.describe()})" if recorder is not None else ""
    announce(f"tracing NCCL calls {what}{where}...", sys.stderr)
    stop = stop_on_signals()
    if recorder is not None:
        recorder.on_error = lambda _message: stop.set()  # end now; close() says why, exit 2
    started = time.monotonic()
    deadline = started + args.duration if args.duration else None
    # the progress line is for a person: none in JSON logs
    progress = Progress(recorder, sys.stderr) if recorder is not None and not json_logs() else None
    lost = 0
    try:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            agent.step()
            if progress is not None:
                recorder.set_kernel_lost(**agent.kernel_losses())
                progress.tick()
        agent.poll(0)  # what is already in the ring buffers is not lost
        lost = agent.reader.counters()["EVENTS_LOST"]
        if recorder is not None:
            recorder.set_kernel_lost(**agent.kernel_losses())
    finally:
        agent.close(detach_in_background=True)  # the kernel's detaching outlives us (~0.13 s a probe)
        if recorder is not None:
            if progress is not None:
                progress.done()
            try:
                recorder.close()
            except RecordingError as e:
                raise CliError(str(e)) from None
    if recorder is not None:
        announce(f"recorded in {time.monotonic() - started:.1f} s: {recorder.summary()}", sys.stderr)
    else:
        announce(f"{counts['shown']} calls traced in {time.monotonic() - started:.1f} s, {lost} lost",
                 sys.stderr)
    return 0
