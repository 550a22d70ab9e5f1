"""The C of the profiler plugin (plugin/) and of the simulator
(exporter/simulator/nccl_sim/) is layered: between its files, calls go one
way, so that each file can be read knowing only the files below it
(plugin/internal.h and nccl_sim.h list the layers).

The call graph between files comes from the object files themselves: each
file compiled on its own, `nm` gives what it defines and what it leaves
undefined; file A depends on file B when A needs a symbol B defines. Compiled
at -O0, so that no call the optimiser folds away hides an edge."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from exporter.simulator import build as sim_build
from exporter.sources.plugin import build as plugin_build

# nm's letters for a symbol an object file defines for other files (text,
# data, bss, read-only data, small data, weak, unique, indirect).
DEFINED = set("TDBRGSVWui")


def file_graph(src: Path, cflags: list[str], out: Path) -> dict[str, dict[str, set[str]]]:
    """{file: {other file: symbols of the other it uses}} over the .c files of src."""
    flags = [f for f in cflags if f not in ("-shared", "-O2", "-O1")] + ["-O0", "-I", str(src)]
    defined: dict[str, set[str]] = {}
    undefined: dict[str, set[str]] = {}
    for c in sorted(src.glob("*.c")):
        obj = out / (c.stem + ".o")
        subprocess.run(["gcc", *flags, "-c", str(c), "-o", str(obj)], check=True, capture_output=True, text=True)
        nm = subprocess.run(["nm", str(obj)], check=True, capture_output=True, text=True).stdout
        defined[c.name], undefined[c.name] = set(), set()
        for line in nm.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "U":
                undefined[c.name].add(parts[1])
            elif len(parts) == 3 and parts[1] in DEFINED:
                defined[c.name].add(parts[2])
    return {a: {b: undefined[a] & defined[b] for b in defined if b != a and undefined[a] & defined[b]}
            for a in defined}


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, set[str]]], comp: list[str]) -> str:
    return "; ".join(f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})"
                     for a in comp for b in sorted(graph[a]) if b in comp)


def test_cycle_finder_sees_a_circle():
    g = {"a.c": {"b.c": {"f"}}, "b.c": {"c.c": {"g"}}, "c.c": {"a.c": {"h"}}, "d.c": {"a.c": {"i"}}}
    assert cycles(g) == [["a.c", "b.c", "c.c"]]
    assert cycles({"a.c": {"b.c": {"f"}}, "b.c": {}, "d.c": {"a.c": {"i"}, "b.c": {"g"}}}) == []


@pytest.mark.parametrize("name", ["plugin", "simulator"])
def test_c_files_call_one_way(name, tmp_path):
    src, cflags = {"plugin": (REPO / "plugin", plugin_build.CFLAGS),
                   "simulator": (sim_build.SOURCE_DIR, sim_build.CFLAGS)}[name]
    graph = file_graph(src, cflags, tmp_path)
    # the graph is read at all: files of both depend on others
    assert sum(len(v) for v in graph.values()) >= 8, graph
    found = cycles(graph)
    assert not found, "calls in a circle between files: " + " | ".join(describe(graph, c) for c in found)


def test_plugin_files_are_small():
    """One concern a file (plugin/internal.h lists them): a few hundred lines each."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "plugin").glob("*.c")}
    assert len(sizes) > 1 and max(sizes.values()) <= 500, sizes
