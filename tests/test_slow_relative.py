"""exporter/agent/slow.py: relative thresholds are set from recent calls and
cleared again (a threshold once set was never cleared)."""

from __future__ import annotations

from exporter.records import contract, histogram
from exporter.records.events import Series
from exporter.agent.slow import SlowCallPolicy


class Table(dict):
    Key = staticmethod(lambda k: k)
    Leaf = staticmethod(lambda v=0: v)


class FakeProbes:
    def __init__(self):
        self.tables = {"series_threshold": Table()}

    def set_slow_threshold(self, op, ns):
        pass

    def __getitem__(self, name):
        return self.tables[name]


class FakeReader:
    def __init__(self):
        self.list = []

    def series(self):
        return self.list


def series(calls_at_1ms: int, slot: int = 5, comm: int = 0xABC) -> Series:
    buckets = [0] * histogram.DURATION.slots
    buckets[histogram.bucket_of(1_000_000)] = calls_at_1ms
    return Series(op="ALL_REDUCE", comm=comm, rank=0, nranks=2, calls=calls_at_1ms, bytes=0,
                  sum_ns=calls_at_1ms * 1_000_000, buckets=tuple(buckets), slot=slot)


def test_relative_threshold_set_then_cleared_when_idle():
    probes, reader = FakeProbes(), FakeReader()
    policy = SlowCallPolicy(probes, reader, relative_k=3, interval=10, min_calls=20)
    table = probes["series_threshold"]
    reader.list = [series(100)]
    policy.refresh(now=0)
    assert table[5] >= 3 * 1_000_000 * 0.5  # k x p50, p50 within its bucket
    reader.list = [series(105)]  # only 5 calls in the last interval: back to absolute
    policy.refresh(now=10)
    assert table[5] == 0


def test_reused_slot_starts_from_zero_and_forget():
    probes, reader = FakeProbes(), FakeReader()
    policy = SlowCallPolicy(probes, reader, relative_k=3, interval=10, min_calls=20)
    table = probes["series_threshold"]
    reader.list = [series(1000)]
    policy.refresh(now=0)
    assert table[5]
    # The slot was freed (series expired) and now holds another series with 50 calls:
    # those are all recent, not 50 - 1000.
    policy.forget([5])
    table[5] = 0
    reader.list = [series(50, comm=0xDEF)]
    policy.refresh(now=10)
    assert table[5] > 0
    # Same without forget(): a different series in the slot is detected by its labels.
    reader.list = [series(40, comm=0x123)]
    policy.refresh(now=20)
    assert table[5] > 0


def test_overflow_series_never_get_a_relative_threshold():
    probes, reader = FakeProbes(), FakeReader()
    policy = SlowCallPolicy(probes, reader, relative_k=3, interval=10, min_calls=1)
    reader.list = [series(100, slot=77, comm=contract.SERIES_OVERFLOW_COMM)]
    policy.refresh(now=0)
    assert 77 not in probes["series_threshold"]
