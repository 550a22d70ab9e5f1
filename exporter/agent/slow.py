"""Which calls are slow: the thresholds the kernel compares each call with.

Only slow calls cross to user space (as ring-buffer events for spans).
Two kinds of threshold, both checked in bpf/nccl.c at the call's return:

- absolute, per op (default 50 ms for every collective);
- relative, per series (op, comm, rank): k x the series' recent p50 (host
  time only: GPU operations, from bpf/plugin.c, use the absolute ones). User
  space recomputes it every `interval` seconds from the change of the
  kernel's histogram since the last time, and writes it per series slot.
  A series with fewer than `min_calls` recent calls uses the absolute one:
  a relative threshold set earlier is cleared then (and when the series'
  slot is freed or reused); the relative threshold never goes below `floor_ns`.
"""

from __future__ import annotations

import time

from exporter.records import contract, histogram

DEFAULT_THRESHOLD_NS = 50_000_000


class SlowCallPolicy:
    def __init__(self, probes, reader, absolute_ns: dict[str, int] | None = None,
                 relative_k: float | None = None, interval: float = 10.0,
                 min_calls: int = 20, floor_ns: int = 1_000_000, plugin=None):
        self.probes = probes
        self.reader = reader
        self.absolute_ns = {op: DEFAULT_THRESHOLD_NS for op in contract.COLLECTIVE_OPS.values()}
        self.absolute_ns.update(absolute_ns or {})
        self.relative_k = relative_k
        self.interval = interval
        self.min_calls = min_calls
        self.floor_ns = floor_ns
        # slot -> (the series' labels, its buckets at the last refresh)
        self._last: dict[int, tuple[tuple, tuple[int, ...]]] = {}
        self._relative: set[int] = set()  # slots with a relative threshold written
        # the same thresholds by series (op, comm, rank, nranks), for is_slow()
        self._relative_by_series: dict[tuple, int] = {}
        self._next_refresh = 0.0
        for op, ns in self.absolute_ns.items():
            probes.set_slow_threshold(op, ns)
            if plugin is not None:  # GPU time: the absolute thresholds only
                plugin.set_slow_threshold(op, ns)

    def refresh(self, now: float | None = None) -> None:
        """Recompute relative thresholds when due (called from the agent loop)."""
        if not self.relative_k:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_refresh:
            return
        self._next_refresh = now + self.interval
        table = self.probes["series_threshold"]
        last, self._last = self._last, {}
        by_series: dict[tuple, int] = {}
        for s in self.reader.series():
            if (s.op not in contract.COLLECTIVE_OPS.values() or s.slot < 0
                    or s.comm == contract.SERIES_OVERFLOW_COMM):
                continue
            labels = (s.op, s.comm, s.rank, s.nranks)
            seen_labels, before = last.get(s.slot, (labels, ()))
            if seen_labels != labels or len(before) != len(s.buckets):
                before = ()  # the slot holds another series now
            recent = [a - b for a, b in zip(s.buckets, before or (0,) * len(s.buckets))]
            self._last[s.slot] = (labels, s.buckets)
            if sum(recent) < self.min_calls:
                if s.slot in self._relative:  # back to the op's absolute threshold
                    table[table.Key(s.slot)] = table.Leaf(0)
                    self._relative.discard(s.slot)
                continue
            p50_ns = histogram.quantile(recent, 0.5) * 1e9
            limit = max(self.floor_ns, int(self.relative_k * p50_ns))
            table[table.Key(s.slot)] = table.Leaf(limit)
            self._relative.add(s.slot)
            by_series[labels] = limit
        # Slots no longer holding a series: their thresholds were cleared when freed.
        self._relative &= set(self._last)
        self._relative_by_series = by_series  # only live series: bounded by the map

    def threshold_ns(self, op: str, comm: int = 0, rank: int = -1, nranks: int = 0) -> int:
        """The threshold the kernel compares a call of this series with (0: none)."""
        limit = self._relative_by_series.get((op, comm, rank, nranks))
        return limit if limit else self.absolute_ns.get(op, 0)

    def is_slow(self, event) -> bool:
        """Whether a call is slow by the kernel's rule, for sinks that receive every
        call (`run --db` records them all): the span sink keeps only slow ones."""
        limit = self.threshold_ns(event.op, event.comm, event.rank, event.nranks)
        return bool(limit) and event.duration_ns >= limit

    def forget(self, slots) -> None:
        """Slots whose series were expired (the reader cleared their thresholds)."""
        for slot in slots:
            labels = self._last.pop(slot, (None,))[0]
            self._relative.discard(slot)
            self._relative_by_series.pop(labels, None)
