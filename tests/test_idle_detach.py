"""`run --idle-detach`: with no traced process on the node, the agent detaches
the tracepoints that run at every context switch, wakeup and socket
send/receive of the node, and attaches them again as soon as a process maps
libnccl (docs/sched.md, "Between jobs"). The kernel side of the detach
itself (nothing counted while detached, no wait across the gap) is
tests/test_sched.py::test_detached_between_jobs_then_attached_again."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import sample_value

METRIC = "nccl_exporter_node_tracepoints_attached"

CHILD = """
import ctypes, sys
ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.read()
"""


def _wait_attached(exporter, want: float, sched: bool, timeout: float = 20) -> float:
    """Seconds until the TCP source reports `want`, and the scheduler source
    too with `sched` (--sched waits), 0 without (--sched totals attaches nothing)."""
    t0 = time.monotonic()
    while True:
        samples = exporter.samples()
        got = {s: sample_value(samples, METRIC, source=s) for s in ("sched", "tcp")}
        if got == {"sched": want if sched else 0, "tcp": want}:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"{METRIC} {got}, want {want}:\n{exporter.output()}"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["waits", "totals"])
def test_detached_without_a_traced_process_and_attached_when_libnccl_is_mapped(tmp_path, mode, launch_exporter,
                                                                                simulator_lib):

    lib = tmp_path / "libnccl.so.2"
    shutil.copy(simulator_lib, lib)
    waits = mode == "waits"
    with launch_exporter("--idle-detach", "1s", "--log-level", "info", "--sched", mode) as exporter:
        _wait_attached(exporter, 0, waits)  # nothing on this node uses NCCL
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(lib)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "loaded"
            _wait_attached(exporter, 1, waits)  # the mapping traced it
            if not waits:
                # The traced process's threads, from /proc: the run-queue
                # histogram has its +Inf bucket only, off-CPU time grows.
                _wait_for_series(exporter, 'nccl_offcpu_seconds_total{node=')
                page = exporter.scrape()
                assert re.search(r'nccl_runqueue_delay_seconds_bucket\{.*le="\+Inf".*thread="other"', page), page
                assert 'le="1e-06"' not in page, "--sched totals has no finite run-queue buckets"
        finally:
            child.stdin.close()
            child.wait()
        _wait_attached(exporter, 0, waits)  # 1 s after it exited
        log = exporter.output()
    what = "scheduler and socket" if waits else "socket"
    assert f"{what} tracepoints detached" in log
    assert f"a traced process: {what} tracepoints attached" in log


def _wait_for_series(exporter, prefix: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not any(line.startswith(prefix) for line in exporter.scrape().splitlines()):
        assert time.monotonic() < deadline, f"no {prefix} series:\n{exporter.output()}"
        time.sleep(0.2)
