"""NCCL's habits the plugin must survive inside other people's jobs
(docs/plugin.md, "NCCL habits"): unloads under a running thread, large
AlltoAlls, CollNet/NVLS collectives with no channel count, graph replays,
batched collectives, the activation mask. Each habit is played either by
NCCL's side in Python (tests/plugin/fake_nccl.py, one exact callback
sequence, in a subprocess so that a crash is a failed test) or by the
simulator's GPU mode (its NCCL_SIM_GPU_* switch), for every profiler
interface version where NCCL has the habit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from exporter.sources.plugin.build import build_plugin
from exporter.simulator.build import build_library
from exporter.simulator.truth import load_truth

from conftest import REPO
from test_sim_gpu import inproc

VERSIONS = (4, 5, 6, 7)


@pytest.fixture(scope="module")
def plugin():
    return build_plugin()


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("simgpu-habits"))


def play(plugin, version: int, body: str, env: dict | None = None, timeout: int = 120) -> dict:
    """Run `body` with P = Plugin(plugin, version) in a fresh process; it sets `out` (a dict), printed as the
    last line. Returns it, or fails with the process's output (a crash: its signal)."""
    script = "import sys, os, time, json, ctypes, _ctypes\n" \
             f"sys.path.insert(0, {str(REPO / 'tests' / 'plugin')!r})\n" \
             "from fake_nccl import *\n" \
             f"P = Plugin({str(plugin)!r}, {version})\nout = {{}}\n" + textwrap.dedent(body) + \
             "\nprint(json.dumps(out), flush=True)\n"
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, timeout=timeout)
    sig = f" (signal {signal.Signals(-p.returncode).name})" if p.returncode < 0 else ""
    assert p.returncode == 0, f"exit {p.returncode}{sig}: {p.stdout[-2000:]}{p.stderr[-3000:]}"
    import json
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------ unloaded under a running thread --
@pytest.mark.parametrize("version", VERSIONS)
def test_nccl_closing_the_plugin_under_a_live_communicator_crashes_nothing(plugin, version):
    """NCCL dlcloses the plugin when its load count reaches 0; a communicator
    whose init failed before the plugin was loaded still unloads it in
    commFree (NCCL v2.28.9-1 init.cc:336 vs :1251, profiler.cc:107-119). The
    plugin's announcer thread must not then run in unmapped code: the library
    is pinned (-z nodelete, RTLD_NODELETE)."""
    out = play(plugin, version, """
        ctx = P.init(nranks=4)
        h = P.coll(ctx, seq=0, nch=1); P.stop(h)
        _ctypes.dlclose(P.dl._handle)     # the failed communicator's commFree
        time.sleep(0.2)                   # 40 announcer periods
        out["ok"] = 1
    """, env={"NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "5"})
    assert out == {"ok": 1}


def test_sim_failed_init_unload_leaves_the_job_running(lib, plugin, tmp_path):
    """The simulator's NCCL_SIM_GPU_UNLOAD=1 keeps NCCL's load count and
    NCCL_SIM_GPU_FAILED_INIT=2 plays two failed communicators' commFree after
    the first profiler init (ncclCommInitAll's two communicators run their
    inits in parallel): NCCL closes the plugin while communicators live, and
    the job goes on (without profiler events, as NCCL does)."""
    recs, log, p = inproc(lib, tmp_path, nranks=2, iters=4, plugin=plugin,
                          env={"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_FAILED_INIT": "2",
                               "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "5", "NCCL_SIM_GPU_KERNEL_US": "20000"})
    assert any(r.get("op") == "FAILED_COMM_FREE" for r in recs)
    assert p.returncode == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_init_never_returns_an_error(plugin, version):
    """NCCL 2.30.x unloads the plugin at once when init returns an error and
    again in commFree (v2.30.7-1 profiler.cc:253, :268): the plugin's init
    returns success whatever it is given or lacks."""
    out = play(plugin, version, """
        codes = []
        ctx = P.init(nranks=8); codes.append(P.last_init)
        P.init(nranks=0, with_mask=False); codes.append(P.last_init)
        P.init(nranks=-1, rank=-5); codes.append(P.last_init)
        P.init(nranks=1 << 30); codes.append(P.last_init)
        out["codes"] = codes
        out["fini"] = P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_POOL": "nonsense", "NCCL_EXPORTER_PROFILER_CHAIN": "/nonexistent.so",
              "NCCL_EXPORTER_PROFILER_LOG": "/nonexistent/dir/x.log", "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "-3"})
    assert out == {"codes": [0, 0, 0, 0], "fini": 0}
