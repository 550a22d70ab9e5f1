"""Which rank never joined: the hang verdict of `nccl-exporter hang` and MCP `hang_status`.

Read from one or more agents' /metrics (each agent knows its own node):

- members of each communicator: `nccl_communicator_info` (rank, nranks, pid);
- the calls in flight: `nccl_inflight_oldest_seconds` (op, comm, rank, age),
  and with the profiler plugin those on the GPU only,
  `nccl_gpu_inflight_oldest_seconds` (on a GPU the host call returns once
  enqueued);
- where each rank is in each (comm, op) sequence: `nccl_collective_last_seq`
  (its latest returned call; the call in flight is that + 1) and
  `nccl_collective_last_return_timestamp_seconds`;
- its threads over the last second: `nccl_offcpu_seconds_total` and
  `nccl_runqueue_delay_seconds_sum` of two reads `interval` apart.

A communicator is hung when a call on it has been in flight for at least the
threshold. Its ranks are then grouped by the (op, seq) they are in; the group
of most ranks is the one waiting, ranks in another (op, seq) of the same
communicator are desynchronised, and member ranks in none never entered it.
What each missing rank was last seen doing is said from the same series.
docs/alerts.md ("NcclRankMissing") is the same logic in PromQL.

The package, by concern: fetch.py reads the agents (and checks the URLs and
threshold), model.py groups the ranks and finds the hangs, render.py says them
in words and as JSON; `analyse` and `hang_status` below join the three.
"""

from __future__ import annotations

import time

from exporter.offline.analysis.hang.fetch import (
    DEFAULT_THRESHOLD_S,
    INTERVAL_S,
    MAX_BYTES,
    READ_TIMEOUT_S,
    WANTED,
    HangInputError,
    Read,
    check_threshold,
    check_url,
    default_url,
    read,
)
from exporter.offline.analysis.hang.model import Call, Hang, Missing, Model, Where
from exporter.offline.analysis.hang.render import (
    Answer,
    call_name,
    evidence,
    missing_text,
    op_name,
    ranks_text,
    read_summary,
    short,
    verdict,
)
from exporter.records import metrics

__all__ = [
    "DEFAULT_THRESHOLD_S", "INTERVAL_S", "MAX_BYTES", "READ_TIMEOUT_S", "WANTED",
    "Answer", "Call", "Hang", "HangInputError", "Missing", "Model", "Read", "Where",
    "analyse", "call_name", "check_threshold", "check_url", "default_url", "evidence",
    "hang_status", "missing_text", "op_name", "ranks_text", "read", "read_summary", "short", "verdict",
]


def analyse(first: Read, second: Read | None, threshold_s: float) -> Answer:
    model = Model(first, second)
    last = second or first
    calls = sorted(({"node": c.node, "op": c.op, "comm": c.comm, "rank": c.rank, "oldest_s": c.age_s,
                     "on": "gpu" if c.gpu else "host"} for c in model.calls()), key=lambda d: -d["oldest_s"])
    oldest = calls[0]["oldest_s"] if calls else 0.0
    hangs = model.hangs(threshold_s)
    if hangs:
        h = hangs[0]
        return Answer(verdict(h), evidence(h, hangs[1:], last, threshold_s), True, hangs, oldest, calls,
                      len(last.answered))
    if not last.answered:
        v = "no agent answered: " + "; ".join(last.errors)
    elif calls:
        v = f"not hung: the oldest NCCL call in flight is {oldest:.3f} s old (threshold {threshold_s:g} s)"
    else:
        v = (f"not hung: no NCCL call in flight ({metrics.INFLIGHT_OLDEST} and {metrics.GPU_INFLIGHT_OLDEST} "
             f"absent)")
    return Answer(v, [read_summary(last)], False, [], oldest, calls, len(last.answered))


def hang_status(urls: list[str], threshold_s: float = DEFAULT_THRESHOLD_S,
                interval_s: float = INTERVAL_S, timeout: float = READ_TIMEOUT_S) -> Answer:
    """Two reads of every agent `interval_s` apart (the second only when the
    first shows a hang: the threads' recent state), then the verdict."""
    urls = [check_url(u) for u in urls]
    threshold_s = check_threshold(threshold_s)
    first = read(urls, timeout)
    second = None
    if interval_s > 0 and first.answered and Model(first).hangs(threshold_s):
        time.sleep(interval_s)
        second = read(urls, timeout)
        if not second.answered:
            second = None
    return analyse(first, second, threshold_s)
