"""The simulated cluster's signal handlers (exporter/simulator/cluster.py): an
interrupt tears the namespaces down, then does what the process would have
done; a signal the process ignores (SIGINT of a job a shell started in the
background) stays ignored: tearing the cluster down would kill the job under
a harness that goes on running it."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PROBE = """
import signal, sys
from exporter.simulator import cluster
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
c = object()
cluster._register(c)
during = signal.getsignal(signal.SIGINT)
cluster._unregister(c)
after = signal.getsignal(signal.SIGINT)
print(during is cluster._on_signal, during == signal.SIG_IGN, after is cluster._on_signal)
"""


def probe(mode: str) -> str:
    p = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_an_interrupt_is_caught_while_a_cluster_is_open_and_released_after():
    assert probe("default") == ["True", "False", "False"]


def test_an_ignored_interrupt_stays_ignored():
    assert probe("ignored") == ["False", "True", "False"]
