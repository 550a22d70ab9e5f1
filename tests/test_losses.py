"""Nothing lost silently, and state that does not grow with every process ever
seen: a failing SQLite writer (disk full, locked database, read-only file
system) says so once and counts what it did not write; the span sink makes
spans of slow calls only, whatever the kernel sends; the span sink's tracer
providers and the recorder's per-process state are forgotten once a process
is gone. Unit level, with real SQLite failures (tmpfs mounts need root)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from types import SimpleNamespace

import pytest

from conftest import require_root
from exporter.records import contract, metrics
from exporter.records.events import CallEvent
from exporter.sinks.recording.schema import RecordingError
from exporter.sinks.recording.writer import Recorder
from exporter.agent.slow import SlowCallPolicy
from exporter.sinks.spans import SpanSink
from exporter.sources.processes import ProcessTable

DEAD_PID = 4_000_000  # above any pid this test host gives out


def call(pid: int = os.getpid(), i: int = 0, duration_ns: int = 1_000_000, op: str = "ALL_REDUCE",
         comm: int = 0xC0FFEE, rank: int = 0, nranks: int = 2) -> CallEvent:
    start = time.monotonic_ns() - duration_ns
    return CallEvent(kind=contract.EVENT_CALL, op=op, pid=pid, tid=pid, start_ns=start,
                     end_ns=start + duration_ns, start_real_ns=time.time_ns() - duration_ns,
                     comm_ptr=0x1000, comm=comm, nccl_comm_hash=comm, seq=i + 1, rank=rank,
                     nranks=nranks, count=1024, bytes=4096, datatype=7, red_op=0, root=-1,
                     peer=-1, stream=0, result=0, color=0)


def wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@contextlib.contextmanager
def tmpfs(path, size: str, options: str = ""):
    require_root()
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "nccl-test", str(path)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def feed(rec: Recorder, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        rec(call(i=i))


# --- a failing writer -----------------------------------------------------------

def test_disk_full_is_reported_once_and_counted(tmp_path):
    with tmpfs(tmp_path / "small", "1m") as d:
        messages: list[str] = []
        rec = Recorder(str(d / "rec.db"), node="n", batch_rows=500, batch_seconds=0.01,
                       identify_processes=False)
        rec.on_error = messages.append
        offered = 0
        while not rec.failed and offered < 200_000:
            feed(rec, 500, offered)
            offered += 500
            time.sleep(0.005)
        assert wait_until(lambda: rec.failed), "a 256 KiB file system never filled"
        feed(rec, 100, offered)  # after the failure: counted, not queued
        offered += 100
        assert len(messages) == 1, messages
        assert "full" in messages[0] and str(d / "rec.db") in messages[0]
        assert "\n" not in messages[0]
        with pytest.raises(RecordingError) as e:
            rec.close()
        assert str(e.value) == messages[0]
        drops = rec.drops()
        assert drops["write_failed"] > 0
        # every offered event is written, or counted as dropped
        assert rec.total_recorded + drops["write_failed"] + drops["queue_full"] == offered
        assert rec.total_lost >= drops["write_failed"]


def test_locked_database_is_reported_and_counted(tmp_path):
    path = str(tmp_path / "rec.db")
    messages: list[str] = []
    rec = Recorder(path, node="n", batch_rows=10, batch_seconds=0.01, identify_processes=False)
    rec.on_error = messages.append
    feed(rec, 10)
    assert wait_until(lambda: rec.total_recorded == 10)
    holder = sqlite3.connect(path, isolation_level=None, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        feed(rec, 50, 10)  # the writer waits its busy timeout (5 s), then fails
        assert wait_until(lambda: rec.failed, timeout=30), "the writer never gave up"
        feed(rec, 7, 60)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(messages) == 1 and "locked" in messages[0], messages
    with pytest.raises(RecordingError, match="locked"):
        rec.close()
    assert rec.drops()["write_failed"] == 57
    assert rec.total_recorded == 10


def test_full_disk_at_open_is_one_line(tmp_path):
    with tmpfs(tmp_path / "tiny", "16k") as d:
        with pytest.raises(RecordingError) as e:
            Recorder(str(d / "rec.db"), node="n", identify_processes=False)
    assert "\n" not in str(e.value) and "rec.db" in str(e.value)


def test_read_only_file_system_fails_at_open(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", "ro") as d:
        with pytest.raises(RecordingError) as e:
            Recorder(str(d / "rec.db"), node="n", identify_processes=False)
    assert "\n" not in str(e.value) and "rec.db" in str(e.value)


def test_no_failure_no_drops(tmp_path):
    rec = Recorder(str(tmp_path / "ok.db"), node="n", batch_seconds=0.01, identify_processes=False)
    feed(rec, 100)
    rec.close()
    assert rec.drops() == {"queue_full": 0, "write_failed": 0} and not rec.failed
    assert rec.error_message is None and rec.total_recorded == 100


def test_recording_dropped_metric_is_declared():
    m = metrics.spec("nccl_exporter_recording_dropped_total")
    assert m.kind == "counter" and m.labels == ("node", "reason")


def test_collector_exposes_the_recorder_drops():
    from exporter.sinks.prometheus import Collector, self_metrics
    import inspect

    assert "recorder" in inspect.signature(Collector.__init__).parameters
    src = inspect.getsource(self_metrics.exporter_families)
    assert "EXPORTER_RECORDING_DROPPED" in src


# --- spans of slow calls only --------------------------------------------------------

class _Table(dict):
    Key = Leaf = staticmethod(lambda v=0: v)


class _Probes:
    def __init__(self):
        self.thresholds = {}
        self.tables = {"series_threshold": _Table()}

    def set_slow_threshold(self, op, ns):
        self.thresholds[op] = ns

    def __getitem__(self, name):
        return self.tables[name]


class _NoExport:
    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=0):
        return True


def test_policy_is_slow_absolute_and_relative():
    probes = _Probes()
    policy = SlowCallPolicy(probes, SimpleNamespace(series=lambda: []), {"ALL_REDUCE": 20_000_000})
    assert policy.is_slow(call(duration_ns=25_000_000))
    assert not policy.is_slow(call(duration_ns=5_000_000))
    assert policy.is_slow(call(op="BROADCAST", duration_ns=60_000_000))  # default 50 ms
    assert not policy.is_slow(call(op="BROADCAST", duration_ns=40_000_000))
    # a relative threshold of one series applies to that series only
    policy._relative_by_series[("ALL_REDUCE", 0xC0FFEE, 0, 2)] = 2_000_000
    assert policy.is_slow(call(duration_ns=3_000_000))
    assert not policy.is_slow(call(duration_ns=3_000_000, rank=1))


def test_span_sink_keeps_only_slow_calls_when_sent_every_call():
    policy = SlowCallPolicy(_Probes(), SimpleNamespace(series=lambda: []), {"ALL_REDUCE": 10_000_000})
    sink = SpanSink("n", _NoExport(), None, settle_s=0, slow=policy.is_slow)
    try:
        for i in range(100):  # what `run --db` gets: every call
            sink(call(i=i, duration_ns=30_000_000 if i % 10 == 0 else 1_000_000))
        assert wait_until(lambda: sink.built == 10)
        assert sink.not_slow == 90
    finally:
        sink.close()
    assert sink.built == 10


def test_span_sink_without_a_rule_trusts_the_kernel():
    sink = SpanSink("n", _NoExport(), None, settle_s=0)
    try:
        for i in range(5):
            sink(call(i=i, duration_ns=1_000))
        assert wait_until(lambda: sink.built == 5)
    finally:
        sink.close()


def test_run_passes_the_rule_when_recording_every_call():
    import inspect

    from exporter.agent import pipeline

    src = inspect.getsource(pipeline.start_spans)
    assert "slow=agent.slow.is_slow if agent.config.record_all" in src


# --- bounded state ---------------------------------------------------------------------

def test_span_sink_forgets_dead_processes(tmp_path):
    proc = tmp_path / "proc"
    (proc / "100").mkdir(parents=True)
    (proc / "200").mkdir()
    sink = SpanSink("n", _NoExport(), None, settle_s=0, prune_interval_s=3600, proc=str(proc),
                    exemplar_keep_s=60)
    try:
        sink(call(pid=100, i=0))
        sink(call(pid=200, i=1))
        assert wait_until(lambda: sink.built == 2)
        assert set(sink.providers) == {100, 200}
        (proc / "200").rmdir()
        sink.prune()
        assert set(sink.providers) == {100}
        assert len(sink.exemplars) == 1  # one series (same op/comm/rank)
        sink.prune(time.time_ns() + 120 * 10**9)  # two minutes later: exemplars aged out
        assert sink.exemplars == {}
    finally:
        sink.close()


def test_tracer_providers_register_no_atexit_hook():
    import atexit

    sink = SpanSink("n", _NoExport(), None, settle_s=0)
    try:
        before = atexit._ncallbacks()
        for pid in range(1000, 1050):
            sink._provider(pid)
        assert atexit._ncallbacks() == before
    finally:
        sink.close()


def test_process_table_forgets_dead_processes(tmp_path):
    table = ProcessTable(None, proc=str(tmp_path))
    table._known[DEAD_PID] = {"rank": 3}
    table._known[os.getpid()] = {"rank": 0}
    table.forget_dead()
    assert DEAD_PID not in table._known


def test_recorder_forgets_dead_processes(tmp_path):
    proc = tmp_path / "proc"
    (proc / "100").mkdir(parents=True)
    (proc / "200").mkdir()
    from exporter.sinks.recording.scope import Scope

    rec = Recorder(str(tmp_path / "r.db"), node="n", batch_seconds=0.01, identify_processes=False,
                   scope=Scope(proc=str(proc)))
    try:
        for pid in (100, 200):
            rec(call(pid=pid, comm=pid))
        assert wait_until(lambda: rec.total_recorded == 2)
        time.sleep(0.1)
        assert {100, 200} <= rec._seen_pids and {100, 200} <= set(rec._world)
        (proc / "200").rmdir()
        rec.dead_grace_s = 30
        assert rec.forget_dead_processes(now=1000.0) == []  # gone, within the grace period
        assert rec.forget_dead_processes(now=1031.0) == [200]
        assert 200 not in rec._seen_pids and 200 not in rec._world
        assert all(pid != 200 for pid, _ in rec._seen_comms)
        assert 100 in rec._seen_pids and 100 in rec._world
        assert rec._dead_since == {}
    finally:
        rec.close()


def test_recorder_state_is_flat_over_many_processes(tmp_path):
    """A thousand short-lived processes: nothing per process stays."""
    proc = tmp_path / "proc"
    proc.mkdir()
    from exporter.sinks.recording.scope import Scope

    rec = Recorder(str(tmp_path / "r.db"), node="n", batch_seconds=0.01, identify_processes=False,
                   scope=Scope(proc=str(proc)))
    try:
        rec.dead_grace_s = 0
        for pid in range(10_000, 11_000):  # each gone when the writer looks
            rec(call(pid=pid, comm=pid))
        assert wait_until(lambda: rec.total_recorded == 1000)
        time.sleep(0.1)
        rec.forget_dead_processes(now=time.monotonic())
        assert not rec._seen_pids and not rec._seen_comms and not rec._world
    finally:
        rec.close()
