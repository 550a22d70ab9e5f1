"""The tree is the data path: import rules (import-linter contracts in
pyproject.toml), no import cycles, every BPF program compiles on its own,
and the constants the C side uses come from the Python contract."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from exporter.records import contract


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        lint = shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency (pip install -e '.[test]')"
    p = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml")], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph("exporter")
    modules = sorted(graph.modules)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("exporter")}
             for m in modules}
    # A package imports its own __init__ implicitly; only module-to-module edges count.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in edges.get(m, ()):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if not state.get(n):
                visit(n)
        stack.pop()
        state[m] = 2

    for m in modules:
        if not state.get(m):
            visit(m)


def test_a_wrong_way_import_fails_the_contracts(tmp_path):
    """The contracts can fail: a records module that imports a sink breaks them."""
    lint = Path(sys.executable).parent / "lint-imports"
    copy = tmp_path / "tree"
    shutil.copytree(REPO / "exporter", copy / "exporter", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    bad = copy / "exporter" / "records" / "contract.py"
    bad.write_text(bad.read_text() + "\nfrom exporter.sinks import prometheus  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    p = subprocess.run([str(lint), "--config", str(copy / "pyproject.toml"), "--no-cache"],
                       cwd=copy, capture_output=True, text=True, env=env)
    assert p.returncode != 0 and "BROKEN" in p.stdout, p.stdout[-2000:]


def test_c_constants_come_from_the_contract():
    """No BPF file #defines a name the generated header defines: one definition."""
    from exporter.sources.bpf import generated_header

    generated = set(re.findall(r"^#define (\w+)", generated_header(), re.M))
    for c in sorted((REPO / "bpf").glob("*.[ch]")):
        defined = set(re.findall(r"^\s*#define (\w+)", c.read_text(), re.M))
        assert not defined & generated, f"{c.name} redefines {defined & generated}"
    assert {f"CNT_{n}" for n in contract.COUNTERS} <= generated
    assert {"EVENT_CALL", "EVENT_LIFECYCLE", "TCP_EV_RETRANSMIT", "SCHED_KIND_PROXY"} <= generated


def test_each_bpf_program_compiles_alone_and_shares_the_owners_maps(bpf):
    from exporter.sources.bpf import ProbeError
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.sched import SchedSource
    from exporter.sources.tcp import TcpSource

    # Without the owner loaded, a dependent source says what it needs.
    with pytest.raises(ProbeError, match="needs bpf/nccl.c loaded first"):
        TcpSource()

    nccl = NcclProbes()
    tcp = sched = None
    try:
        tcp, sched = TcpSource(), SchedSource()
        counters = nccl["counters"]
        slot = contract.COUNTERS["SOCKETS_FULL"]
        before = counters[counters.Key(slot)].value
        counters[counters.Key(slot)] = counters.Leaf(before + 7)
        for dependent in (tcp, sched):  # the same map, seen through "extern" tables
            seen = dependent["counters"]
            assert seen[seen.Key(slot)].value == before + 7
        counters[counters.Key(slot)] = counters.Leaf(before)
        tcp["tcp_links"], tcp["sock_owner"]  # its own maps
        with pytest.raises(KeyError):
            tcp["series_stats"]  # the NCCL program's own map is not shared
    finally:
        for program in (sched, tcp, nccl):
            if program is not None:
                program.close()


def test_an_owner_loaded_again_shares_its_new_maps(bpf):
    """BCC keeps an exported map's name for the whole process: an owner loaded
    a second time (tests, benches) must hand its dependents its own new maps."""
    from exporter.sources.nccl.probes import NcclProbes
    from exporter.sources.tcp import TcpSource

    for _ in range(2):
        nccl = NcclProbes()
        tcp = TcpSource()
        try:
            bits = nccl["traced_threads"]
            bits[bits.Key(1)] = bits.Leaf(0b101)
            seen = tcp["traced_threads"]
            assert seen[seen.Key(1)].value == 0b101
        finally:
            tcp.close()
            nccl.close()
