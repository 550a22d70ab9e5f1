"""Agent._attach when a scanned library is gone by the time it is attached:
its process exited between the scan of /proc/PID/maps and the attach (the
path runs through /proc/PID/root), which on a busy node happens. The agent
goes on; it did not, and `trace` died with a traceback. Pure logic: the
probes are a stand-in whose attach starts as NcclProbes.attach does, with
os.stat of the path."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from exporter.tools.agent import Agent


def test_a_library_gone_before_attach_is_skipped(tmp_path):
    seen = []
    gone = tmp_path / "proc-root-of-an-exited-process" / "libnccl.so.2"
    agent = SimpleNamespace(lock=threading.Lock(), probes=SimpleNamespace(attach=os.stat),
                            processes=SimpleNamespace(saw=lambda pid, path: seen.append((pid, path))))
    Agent._attach(agent, SimpleNamespace(path=str(gone), pids=[4242]))
    assert seen == [], "no process is noted for a library that was never attached"
