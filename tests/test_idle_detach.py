"""`run --idle-detach`: with no traced process on the node, the agent detaches
the tracepoints that run at every context switch, wakeup and socket
send/receive of the node, and attaches them again as soon as a process maps
libnccl (docs/sched.md, "Between jobs"). The kernel side of the detach
itself (nothing counted while detached, no wait across the gap) is
tests/test_sched.py::test_detached_between_jobs_then_attached_again."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from conftest import require_root, running_exporter, sample_value

METRIC = "nccl_exporter_node_tracepoints_attached"

CHILD = """
import ctypes, sys
ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.read()
"""


def _wait_attached(exporter, want: float, timeout: float = 20) -> float:
    """Seconds until both sources report `want`."""
    t0 = time.monotonic()
    while True:
        samples = exporter.samples()
        got = {s: sample_value(samples, METRIC, source=s) for s in ("sched", "tcp")}
        if got == {"sched": want, "tcp": want}:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"{METRIC} {got}, want {want}:\n{exporter.output()}"
        time.sleep(0.1)


def test_detached_without_a_traced_process_and_attached_when_libnccl_is_mapped(tmp_path):
    require_root()
    from exporter.simulator.build import build_library

    lib = tmp_path / "libnccl.so.2"
    shutil.copy(build_library(), lib)
    with running_exporter("--idle-detach", "1s", "--log-level", "info") as exporter:
        _wait_attached(exporter, 0)  # nothing on this node uses NCCL
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(lib)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "loaded"
            _wait_attached(exporter, 1)  # the mapping traced it
        finally:
            child.stdin.close()
            child.wait()
        _wait_attached(exporter, 0)  # 1 s after it exited
        log = exporter.output()
    assert "scheduler and socket tracepoints detached" in log
    assert "a traced process: scheduler and socket tracepoints attached" in log
