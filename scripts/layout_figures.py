"""The figures of the tree's layout, for a before/after note: rooms, arrows
between rooms, arrows back up the layers, import cycles, the largest modules,
SQL outside the recording package, the largest test files.

    .venv/bin/python scripts/layout_figures.py [TREE]

TREE is a checkout (default: the one this script is in); its `exporter`
package is read by grimp (imports inside functions included, as grimp sees
them) and its layers by pyproject.toml's [tool.importlinter] layers contract.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp

PACKAGE = "exporter"
RECORDING = "exporter/sinks/recording/"  # the recording package: its SQL is its own
SELECT = re.compile(r"\bSELECT\b")


def room(module: str) -> str:
    """exporter.sinks.spans -> sinks; exporter.cbuild -> cbuild; exporter -> (exporter)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else f"({PACKAGE})"


def layers(tree: Path) -> list[list[str]]:
    """The layers contract, top first: each layer a list of sibling rooms."""
    config = tomllib.loads((tree / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            return [[room(m.strip().strip("()")) for m in re.split(r"[|:]", layer)] for layer in contract["layers"]]
    return []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


def main() -> int:
    tree = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    sys.path.insert(0, str(tree))
    origin = Path(importlib.util.find_spec(PACKAGE).origin).resolve()
    if tree not in origin.parents:
        sys.exit(f"layout_figures: {PACKAGE} would be read from {origin}, not from {tree}")
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    modules = sorted(m for m in graph.modules if not m.endswith("._version"))
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in modules} for m in modules}
    print(f"tree: {tree}")

    sizes = Counter(room(m) for m in modules)
    print(f"\nrooms ({len(sizes)}; modules each):")
    for r, n in sorted(sizes.items(), key=lambda x: (-x[1], x[0])):
        print(f"  {r:<12} {n:4d}")

    arrows = Counter((room(a), room(b)) for a in modules for b in edges[a] if room(a) != room(b))
    print(f"\narrows between rooms ({len(arrows)} pairs, {sum(arrows.values())} module imports):")
    for (a, b), n in sorted(arrows.items()):
        print(f"  {a:>12} -> {b:<12} {n:4d}")

    stack = layers(tree)
    level = {r: i for i, layer in enumerate(stack) for r in layer}
    print("\nlayers (top first): " + " -> ".join(" | ".join(layer) for layer in stack))
    outside = sorted(set(sizes) - set(level))
    print(f"  outside the layers: {', '.join(outside) or 'none'}")
    up = [(a, b) for a in modules for b in edges[a] if room(a) in level and room(b) in level
          and (level[room(b)] < level[room(a)] or (level[room(b)] == level[room(a)] and room(a) != room(b)))]
    print(f"arrows back up (or across siblings of one layer): {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")

    module_cycles = cycles(edges)
    print(f"\ncircles between modules: {len(module_cycles)}")
    for c in module_cycles:
        print(f"  {len(c)} modules: {', '.join(c)}")
    room_edges: dict[str, set[str]] = {}
    for a, b in arrows:
        room_edges.setdefault(a, set()).add(b)
    room_cycles = cycles(room_edges)
    print(f"circles between rooms: {len(room_cycles)}")
    for c in room_cycles:
        print(f"  {' <-> '.join(c)}")

    files = [p for p in sorted((tree / PACKAGE).rglob("*.py"))
             if p.name != "_version.py" and "__pycache__" not in p.parts and not p.is_symlink()]
    by_size = sorted(((lines(p), p.relative_to(tree)) for p in files), reverse=True)
    print(f"\nlargest modules ({len(files)} in {PACKAGE}/, {sum(n > 400 for n, _ in by_size)} over 400 lines):")
    for n, p in by_size[:10]:
        print(f"  {n:5d}  {p}")

    select = Counter()
    for p in files:
        rel = p.relative_to(tree).as_posix()
        if not rel.startswith(RECORDING):
            select[rel] = sum(1 for line in p.read_text(errors="replace").splitlines() if SELECT.search(line))
    select = +select
    print(f"\nlines with SELECT in {PACKAGE}/ outside {RECORDING}: {sum(select.values())} in {len(select)} modules")
    for rel, n in select.most_common():
        print(f"  {n:4d}  {rel}")

    tests = sorted(((lines(p), p.relative_to(tree)) for p in (tree / "tests").glob("*.py")), reverse=True)
    print(f"\nlargest test files ({len(tests)} in tests/):")
    for n, p in tests[:5]:
        print(f"  {n:5d}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
