"""Which calls are slow: the thresholds the kernel compares each call with.

Only slow calls cross to user space (as ring-buffer events for spans).
Two kinds of threshold, both checked in bpf/nccl.c at the call's return:

- absolute, per op (default 50 ms for every collective);
- relative, per series (op, comm, rank): k x the series' recent p50. User
  space recomputes it every `interval` seconds from the change of the
  kernel's histogram since the last time, and writes it per series slot.
  A series with fewer than `min_calls` recent calls keeps the absolute one;
  the relative threshold never goes below `floor_ns`.
"""

from __future__ import annotations

import time

from exporter.records import contract, histogram

DEFAULT_THRESHOLD_NS = 50_000_000


class SlowCallPolicy:
    def __init__(self, probes, reader, absolute_ns: dict[str, int] | None = None,
                 relative_k: float | None = None, interval: float = 10.0,
                 min_calls: int = 20, floor_ns: int = 1_000_000):
        self.probes = probes
        self.reader = reader
        self.absolute_ns = {op: DEFAULT_THRESHOLD_NS for op in contract.COLLECTIVE_OPS.values()}
        self.absolute_ns.update(absolute_ns or {})
        self.relative_k = relative_k
        self.interval = interval
        self.min_calls = min_calls
        self.floor_ns = floor_ns
        self._last: dict[int, tuple[int, ...]] = {}
        self._next_refresh = 0.0
        for op, ns in self.absolute_ns.items():
            probes.set_slow_threshold(op, ns)

    def refresh(self, now: float | None = None) -> None:
        """Recompute relative thresholds when due (called from the agent loop)."""
        if not self.relative_k:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_refresh:
            return
        self._next_refresh = now + self.interval
        table = self.probes["series_threshold"]
        for s in self.reader.series():
            if s.op not in contract.COLLECTIVE_OPS.values() or s.slot < 0:
                continue
            before = self._last.get(s.slot, (0,) * len(s.buckets))
            recent = [a - b for a, b in zip(s.buckets, before)]
            self._last[s.slot] = s.buckets
            if sum(recent) < self.min_calls:
                continue
            p50_ns = histogram.quantile(recent, 0.5) * 1e9
            limit = max(self.floor_ns, int(self.relative_k * p50_ns))
            table[table.Key(s.slot)] = table.Leaf(limit)
