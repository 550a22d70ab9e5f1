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

import pytest

from exporter.agent.loop import Agent


@pytest.mark.parametrize("uses_links", [True, False])
def test_a_library_gone_before_attach_is_skipped(tmp_path, uses_links):
    seen = []
    gone = tmp_path / "proc-root-of-an-exited-process" / "libnccl.so.2"
    agent = SimpleNamespace(lock=threading.Lock(), probes=SimpleNamespace(attach=os.stat, uses_links=uses_links),
                            _learn=SimpleNamespace(put=seen.append))
    Agent._attach(agent, SimpleNamespace(path=str(gone), pids=[4242]))
    assert seen == [], "no process is learned for a library that was never attached"
