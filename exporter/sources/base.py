"""What the agent's loop asks of every source: the one shape of a source.

A source is loaded by its row of SOURCES (agent/sources.py: how it loads,
where its records go, its Prometheus collector, its recording tables); what
it owns besides is answered here. A BPF source's text is its program's
(sources/bpf.py Program: bpf/<name>.c); a source without one (SchedTotals,
the NCCL reader of the probes' maps) is a Source all the same. Every hook is
a no-op here, so a source defines only what it does:

- tick(now): called on every turn of the loop (about 10 per second), without
  the agent's lock; a source that reads what a scrape reads holds `lock`;
  work due less often keeps its own schedule.
- prune(ttl, rank_label): forget what belongs to processes that are gone;
  series of an ended process stay `ttl` s. rank_label(pid) -> the rank label
  of a living process ("" when unknown). Called under the agent's lock, in
  reverse load order (a dependent before the source whose maps it reads).
- heat: a source with `node_wide` (the log's word for its tracepoints, e.g.
  "socket") has tracepoints that fire for every task or packet of the node;
  set_hot(False) detaches them while no process is traced (`tracing()` of
  any source says one is), `hot` says whether they are attached.
- losses(): records the kernel could not hand over, by recording meta key
  (the recording's lost_* counts).
- close(): unload; dependents are closed first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from exporter.records import contract


class Source:
    lock = contextlib.nullcontext()  # the agent's lock, given when the agent loads the source
    node_wide: str | None = None
    hot = False

    def tick(self, now: float) -> None:
        """Work due now (duty cycles, polls); each source keeps its own schedule."""

    def prune(self, ttl: float, rank_label: Callable[[int], str]) -> None:
        """Forget dead processes' entries (series after `ttl` s)."""

    def tracing(self) -> bool:
        """Whether a process is traced now (heat: node-wide tracepoints stay attached)."""
        return False

    def set_hot(self, on: bool) -> None:
        """Attach (on) or detach the node-wide tracepoints."""

    def losses(self) -> dict[str, int]:
        """Records the kernel could not hand over, by meta key (kernel_<what>)."""
        return {}

    def close(self) -> None:
        """Unload."""


def shared_counter(program, name: str) -> int:
    """One slot of the `counters` array every program shares (bpf/traced.h,
    contract.COUNTERS), read through any program that includes traced.h."""
    table = program["counters"]
    return table[table.Key(contract.COUNTERS[name])].value
