"""NCCL's habits on its proxy thread, reproduced by the simulator's GPU-like
mode (docs/simulator.md, "NCCL habits"; docs/plugin.md, "NCCL habits"), and
what the profiler plugin does with them: foreign PXN contexts, stale KernelCh
handles, ProxyOps never stopped, several GPUs of one process sharing a proxy,
restarted receive steps.

Every habit is run through each profiler interface version the simulator can
present (NCCL_SIM_GPU_PROFILER_VERSION: v4 as NCCL 2.27, v5 as 2.28, v6 as
2.29/2.30, v7 as 2.31+) where NCCL has it.
"""

from __future__ import annotations

import pytest

from exporter.simulator.build import build_library
from exporter.simulator.truth import gpu_events
from exporter.sources.plugin.build import build_plugin

from test_sim_gpu import inproc

VERSIONS = [4, 5, 6, 7]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("simgpu"))


@pytest.fixture(scope="module")
def plugin():
    return build_plugin()


def run(lib, plugin, tmp_path, version, env, **kw):
    e = {"NCCL_SIM_GPU_PROFILER_VERSION": str(version)}
    e.update(env)
    recs, log, proc = inproc(lib, tmp_path, plugin=plugin, env=e, **kw)
    assert {r["iface"] for r in gpu_events(recs, "PROFILER_INIT")} == {version}
    return recs, log, proc


def finals(log):
    return [r for r in log if r["event"] == "finalize"]


@pytest.mark.parametrize("version", VERSIONS)
def test_pxn_foreign_context_is_never_read(lib, plugin, tmp_path, version):
    """NCCL_SIM_GPU_PXN=1: every batch also gets a ProxyOp of another pid with
    that process's context (an inaccessible page here) and a parent shaped like
    the plugin's own handles, then its steps under the NULL the ProxyOp start
    returned, with the same context. The plugin decides "foreign" from the pid
    and the parent before it touches the context: no crash, the foreign ops are
    counted, every operation completes."""
    recs, log, _ = run(lib, plugin, tmp_path, version, {"NCCL_SIM_GPU_PXN": "1"})
    done = [r for r in log if r["event"] == "done"]
    assert len([r for r in done if r["kind"] == "coll"]) == 12 and len([r for r in done if r["kind"] == "p2p"]) == 12
    assert not [r for r in log if r["event"] == "abandoned"]
    fin = finals(log)
    assert len(fin) == 2 and max(int(r["proxy_foreign"]) for r in fin) > 0
    assert all(r["pending"] == "0" for r in fin)
