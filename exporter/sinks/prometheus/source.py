"""One source's part of /metrics, and what the parts of one scrape share.

Each source's collector is a SourceCollector in a file of its own here (like
node_exporter's collector/ directory), named by its row of SOURCES
(agent/sources.py); collector.py calls every part in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from exporter.records import histogram
from exporter.records.events import Communicator


@dataclass
class Scrape:
    """What the parts of one scrape share, read once, under the agent's lock."""

    node: str
    processes: Any  # the ProcessTable: ranks, launcher and pod identity
    alive: Callable[[int], bool]  # pid -> whether it lives (once per pid and scrape)
    now_ns: int  # CLOCK_MONOTONIC at the scrape's start: in-flight ages
    classic: Any = histogram.CLASSIC[histogram.DEFAULT_CLASSIC]  # text scrapes' classic buckets
    spans: Any = None  # the span sink (exemplars), when traces are exported
    comms: list[Communicator] = field(default_factory=list)  # the communicators shown (living processes')
    traced: set[int] = field(default_factory=set)  # the traced processes' pids
    counters: dict[str, int] = field(default_factory=dict)  # the shared counters (bpf/traced.h)
    made_collectives: set = field(default_factory=set)  # (comm, rank) whose process made a collective

    def rank_of(self, pid: int):
        """A process's rank (None: unknown), by the ProcessTable's rule."""
        return self.processes.rank_of(pid, self.comms)


class SourceCollector:
    """A source's part of /metrics. `source`: what its row loaded (None where an
    optional source did not load). Each scrape calls, in row order: `prepare`
    of every part, then `families` of every part, then the exporter's own
    families (self_metrics.py), which read `programs`, `tracepoints`,
    `map_full` and `exporter_families`. Every hook is empty here."""

    def __init__(self, source):
        self.source = source

    def prepare(self, scrape: Scrape) -> None:
        """Add what the other parts read of this source to `scrape`."""

    def families(self, scrape: Scrape) -> Iterable:
        """The source's metric families."""
        return ()

    def programs(self) -> Iterable[tuple[Any, dict[str, int]]]:
        """(BPF program, its maps' capacities): map fill and recursion misses."""
        return ()

    def tracepoints(self) -> dict[str, bool]:
        """Node-wide tracepoints by source name: whether attached now."""
        return {}

    def map_full(self, scrape: Scrape) -> dict[str, int]:
        """Inserts refused by a full map, by map name."""
        return {}

    def exporter_families(self, scrape: Scrape) -> Iterable:
        """nccl_exporter_* families of this source alone."""
        return ()

    def describe(self) -> Iterable:
        """Families not declared in records/metrics.py (their names for /metrics?name[]=)."""
        return ()
