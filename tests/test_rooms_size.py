"""No Python module of the product over MAX_LINES lines: a module that grows
past it holds more than one concern and is split by concern (a package whose
__init__ keeps the names callers import, as offline/analysis/hang/ and
sinks/serving/ do)."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO

MAX_LINES = 400


def oversized(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """{path relative to the repository: lines} of every .py under root over limit."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        lines = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if lines > limit:
            out[path.relative_to(root.parent).as_posix()] = lines
    return out


def report(found: dict[str, int]) -> str:
    return f"over {MAX_LINES} lines (split by concern): " + ", ".join(
        f"{p} ({n})" for p, n in sorted(found.items(), key=lambda kv: -kv[1]))


def test_no_module_is_over_400_lines():
    found = {p: n for p, n in oversized(REPO / "exporter").items()}
    assert not found, report(found)


def test_the_count_sees_a_module_one_line_over(tmp_path):
    """The check can fail: a module of MAX_LINES + 1 lines is reported, one of
    MAX_LINES is not, and neither are caches."""
    pkg = tmp_path / "exporter" / "room"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (pkg / "fits.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "__pycache__" / "big.py").write_text("x = 1\n" * (MAX_LINES + 5))
    assert oversized(tmp_path / "exporter") == {"exporter/room/big.py": MAX_LINES + 1}
