"""Every NCCL habit the simulator's GPU mode reproduces (docs/plugin.md and
docs/simulator.md, "NCCL habits"), run with the profiler plugin built with
-fsanitize=address,undefined (exporter/sources/plugin/build.py:
build_plugin_sanitized; every report fatal), through each interface version
where NCCL has the habit: no report, and the job ends normally.

The scenarios are the habit tests' own jobs (tests/test_plugin_habits_proxy.py,
tests/test_plugin_habits_ops.py, tests/test_sim_gpu.py), so what the sanitizers
see is what those tests check. `test_every_simulator_habit_switch_is_sanitized`
keeps the table whole: a new NCCL_SIM_GPU_* switch in the simulator's C must
get a scenario here, or be named a plain setting.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest

from exporter.sources.plugin.build import build_plugin_sanitized, sanitizer_env

import test_plugin_habits_ops as ops
from conftest import REPO
from test_plugin_habits_ops import A2A, BATCH, GRAPH
from test_plugin_habits_proxy import HABITS as PROXY_HABITS
from test_sim_gpu import BCAST, INPROC

ALL, GE_2_29, LE_2_30 = (4, 5, 6, 7), (6, 7), (4, 5, 6)
# The plugin's sweep, fast (an announcer period of 100 ms, a 200 ms wait for a
# stop NCCL may never send), and a pause before the job's end to let it act.
SWEEP = {"NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "100", "NCCL_EXPORTER_PROFILER_SETTLE_MS": "200",
         "INPROC_PAUSE_S": "1.0"}
# The two-rank in-process job of tests/test_sim_gpu.py: AllReduces, and Send/Recv every other iteration.
INPROC_JOB = (INPROC, ["2", "6", "destroy"], "inproc ok")

# name: (script, its arguments after the library, what it prints at the end, environment, interface versions)
SCENARIOS = {
    **{name: (*INPROC_JOB, dict(SWEEP, **env), ALL) for name, env in PROXY_HABITS.items()},
    "collnet_no_channel_count": (*INPROC_JOB, {"NCCL_SIM_GPU_COLLNET": "1"}, ALL),
    "mask_counts": (*INPROC_JOB, {"NCCL_EXPORTER_PROFILER_MASK": "counts"}, ALL),
    "mask_gpu": (*INPROC_JOB, {"NCCL_EXPORTER_PROFILER_MASK": "gpu"}, ALL),
    "kernelch_start_after_kernel": (*INPROC_JOB, {"NCCL_SIM_GPU_LATE_EVERY": "1"}, ALL),
    "unload_failed_init": (INPROC, ["2", "4", "destroy"], "inproc ok",
                           {"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_FAILED_INIT": "2",
                            "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "5", "NCCL_SIM_GPU_KERNEL_US": "20000"}, ALL),
    "unload_init_error_2_30": (INPROC, ["2", "4", "destroy"], "inproc ok",
                               {"NCCL_SIM_GPU_UNLOAD": "1", "NCCL_SIM_GPU_INIT_ERROR_UNLOADS": "1",
                                "NCCL_SIM_GPU_FAILED_INIT": "1", "NCCL_EXPORTER_PROFILER_ANNOUNCE_MS": "5"}, (6, 7)),
    "abort_stalled_stream": (INPROC, ["2", "6", "abort"], "inproc ok",
                             {"NCCL_SIM_GPU_STALL_RANK": "1", "NCCL_SIM_GPU_STALL_AFTER": "2", "RANK": ""}, ALL),
    "pools_full": (*INPROC_JOB, dict(SWEEP, NCCL_EXPORTER_PROFILER_POOL="16", NCCL_EXPORTER_PROFILER_POOL_MAX="16",
                                     NCCL_EXPORTER_PROFILER_PROXY_POOL="16", NCCL_SIM_GPU_PROXY_NO_STOP="1"), ALL),
    "graph_replays": (GRAPH, ["4"], "graph ok", {"NCCL_SIM_GPU_GRAPH_REPLAYS": "3"}, ALL),
    "batched_collectives": (BATCH, ["5"], "batch ok", {"NCCL_SIM_GPU_BATCH": "1", "NCCL_SIM_GPU_LATE_EVERY": "0"},
                            ALL),
    "alltoall_as_p2p": (A2A, ["4"], "a2a ok", {"NCCL_SIM_GPU_ALLTOALL_P2P": "1"}, ALL),
    "broadcast_desync_early": (BCAST, ["8"], "bcast ok", {"NCCL_SIM_GPU_BCAST_DESYNC": "1"}, GE_2_29),
    "broadcast_desync_long": (BCAST, ["8"], "bcast ok", {"NCCL_SIM_GPU_BCAST_DESYNC": "2"}, GE_2_29),
    # collectives NCCL gives no Coll event (docs/simulator.md): the job's AllReduces have 256 elements
    "copy_engine_collectives": (*INPROC_JOB, {"NCCL_SIM_GPU_CE_COUNT": "256"}, (5, 6, 7)),
    "symmetric_kernels": (*INPROC_JOB, {"NCCL_SIM_GPU_SYMK_COUNT": "256"}, ALL),
}

# NCCL's side played in Python (tests/plugin/fake_nccl.py) by the habit tests
# themselves, called here with the sanitized plugin: name -> (test, arguments).
PLAYED = {
    "unload_closing_under_a_live_communicator":
        (ops.test_nccl_closing_the_plugin_under_a_live_communicator_crashes_nothing, {}),
    "unload_init_never_returns_an_error": (ops.test_init_never_returns_an_error, {}),
    "pools_alltoall_at_2048_ranks": (ops.test_two_alltoalls_at_2048_ranks_drop_nothing, {}),
    "pools_drop_counted_and_logged_once": (ops.test_a_drop_is_counted_and_logged_once, {}),
    "collnet_no_channel_count_played": (ops.test_collnet_collective_with_no_channel_count_is_timed, {}),
    "collnet_without_kernelch_ages_out": (ops.test_collnet_collective_without_kernelch_ages_out_untimed, {}),
    "mask_counts_played": (ops.test_activation_mask_is_configurable, {"mode": "counts", "mask": 0x6}),
    "mask_gpu_played": (ops.test_activation_mask_is_configurable, {"mode": "gpu", "mask": 0x46}),
    "mask_net_played": (ops.test_activation_mask_is_configurable, {"mode": "net", "mask": 0x5e}),
    "hung_collective_stays_in_flight": (ops.test_a_hung_collective_stays_in_flight_past_max_age, {}),
}

# Simulator settings that are not habits of NCCL's (sizes, clocks, the mode
# itself), the fault a test injects (a stalled stream: scenario above), and a
# habit on by default in every scenario (a count-0 collective discarded; =0
# is the simulator's old numbering).
SETTINGS = {"NCCL_SIM_GPU", "NCCL_SIM_GPU_PROFILER_VERSION", "NCCL_SIM_GPU_CHANNELS", "NCCL_SIM_GPU_KERNEL_US",
            "NCCL_SIM_GPU_TIMER_OFFSET_NS", "NCCL_SIM_GPU_DRIFT_PPM", "NCCL_SIM_GPU_QUEUE", "NCCL_SIM_GPU_NNODES",
            "NCCL_SIM_GPU_NET_STEPS", "NCCL_SIM_GPU_CHUNK", "NCCL_SIM_GPU_STEP_TRUTH", "NCCL_SIM_GPU_STALL_AFTER",
            "NCCL_SIM_GPU_DISCARD_EMPTY"}


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    return build_plugin_sanitized(tmp_path_factory.mktemp("asan"))


def run_job(lib, plugin, tmp_path, script: str, args: list[str], ok: str, env: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(script)
    e = dict(os.environ, NCCL_SIM_GPU="1", NCCL_SIM_GPU_KERNEL_US="300", NCCL_PROFILER_PLUGIN=str(plugin),
             NCCL_EXPORTER_PROFILER_LOG=str(tmp_path / "plugin.log"), NCCL_SIM_TRUTH=str(tmp_path / "truth.jsonl"),
             PYTHONPATH=str(REPO))
    e.update(env)
    p = subprocess.run([sys.executable, str(path), str(lib), *args], env=e, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and ok in p.stdout, f"exit {p.returncode}: {p.stdout[-1000:]}{p.stderr[-4000:]}"
    return p


@pytest.mark.slow
@pytest.mark.parametrize("habit", sorted(SCENARIOS))
def test_sanitizers_report_nothing(lib, sanitized, tmp_path, habit):
    """The habit's job with the sanitized plugin, through every interface
    version NCCL has it in: exit 0, no sanitizer line, and the plugin ran
    (an init line in its log and, unless NCCL closed the plugin, operations
    that ended)."""
    script, args, ok, env, versions = SCENARIOS[habit]
    for version in versions:
        d = tmp_path / f"v{version}"
        d.mkdir()
        p = run_job(lib, sanitized, d, script, args, ok,
                    dict(sanitizer_env(), NCCL_SIM_GPU_PROFILER_VERSION=str(version), **env))
        assert "Sanitizer" not in p.stderr and "runtime error" not in p.stderr, p.stderr[-4000:]
        log = (d / "plugin.log").read_text()
        assert "event=init" in log and f"iface=v{version}" in log, (habit, version, log[-2000:])
        if "NCCL_SIM_GPU_UNLOAD" not in env:   # else NCCL may close the plugin before any operation
            assert "event=done" in log or "event=abandoned" in log, (habit, version)


@pytest.mark.slow
@pytest.mark.parametrize("habit", sorted(PLAYED))
def test_sanitizers_report_nothing_when_nccl_is_played(sanitized, tmp_path, monkeypatch, habit):
    """The habit tests whose NCCL is played in Python, with all their checks,
    run on the sanitized plugin through v4..v7: a sanitizer report ends the
    played process (exit 86 or 87), which fails the test."""
    for k, v in sanitizer_env().items():
        monkeypatch.setenv(k, v)   # the played process's environment (play() copies os.environ)
    test, kw = PLAYED[habit]
    for version in ALL:
        d = tmp_path / f"v{version}"
        d.mkdir()
        call = dict(kw, plugin=sanitized, version=version)
        if "tmp_path" in inspect.signature(test).parameters:
            call["tmp_path"] = d
        test(**call)


def test_every_simulator_habit_switch_is_sanitized():
    """Each NCCL_SIM_GPU_* variable the simulator's C reads is a setting or is
    switched on by some scenario above."""
    src = "".join(p.read_text() for p in (REPO / "exporter/simulator/nccl_sim").glob("*.c"))
    read = set(re.findall(r'(?:env_int|getenv)\("(NCCL_SIM_GPU[A-Z0-9_]*)"', src))
    assert read >= {"NCCL_SIM_GPU_PXN", "NCCL_SIM_GPU_BATCH", "NCCL_SIM_GPU_KERNEL_US"}, read
    switched = {k for s in SCENARIOS.values() for k, v in s[3].items() if k.startswith("NCCL_SIM_GPU_") and v != "0"}
    missing = read - SETTINGS - switched
    assert not missing, f"habit switches no sanitizer scenario turns on: {sorted(missing)}"


def table_tests(markdown: str) -> list[str]:
    """The test ids the test column of docs/plugin.md's "NCCL habits" table
    names: `file::name[id]`, then `[id]` alone for more ids of the same test;
    `[4-7]` is [4] .. [7], `[x-4-7]` is [x-4] .. [x-7]."""
    section = markdown.split("## NCCL habits", 1)[1].split("\n## ", 1)[0]
    table = next(b for b in section.split("\n\n") if b.startswith("| habit"))
    out = []
    for row in table.splitlines()[2:]:
        cell = re.split(r"(?<!\\) \| ", row.strip().strip("|"))[-1]
        test = None
        for tok in re.findall(r"`([^`]+)`", cell):
            m = re.fullmatch(r"(tests/[\w/]+\.py::\w+)(\[[^\]]*\])?", tok)
            if m:
                test, tok = m.group(1), m.group(2)
                if tok is None:
                    out.append(test)
                    continue
            if test is None or not re.fullmatch(r"\[[^\]]*\]", tok):
                continue
            ids = tok[1:-1]
            r = re.fullmatch(r"(.*?-?)4-7", ids)
            out += [f"{test}[{r.group(1)}{v}]" for v in range(4, 8)] if r else [f"{test}[{ids}]"]
    return out


def test_the_habits_table_names_tests_that_exist():
    """Every test the habits table names, with every id, is one pytest collects."""
    named = table_tests((REPO / "docs" / "plugin.md").read_text())
    files = sorted({t.split("::")[0] for t in named})
    assert len(named) > 60 and "tests/test_plugin_habits_proxy.py" in files, named
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    collected = {line.strip() for line in p.stdout.splitlines()}
    missing = [t for t in named if t not in collected and t not in {c.split("[")[0] for c in collected}]
    assert not missing, missing


def test_the_table_parser_sees_a_wrong_id():
    """The check can fail: a table naming an id or a test that does not exist."""
    md = ("## NCCL habits\n\nintro\n\n| habit | test |\n|---|---|\n| a | x | "
          "`tests/t.py::test_a[4-7]`, `[b-4-7]`, `tests/t.py::test_b` |\n\nafter\n")
    assert table_tests(md) == [f"tests/t.py::test_a[{v}]" for v in range(4, 8)] + \
        [f"tests/t.py::test_a[b-{v}]" for v in range(4, 8)] + ["tests/t.py::test_b"]
