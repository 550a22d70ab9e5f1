"""One room per job, checked by reading the source (docs/architecture.md):

- a recording is read through its read side (exporter/sinks/recording/): no
  SQL SELECT in any other module of the package. Help texts, docstrings and
  error messages that name SELECT are prose, not SQL: the SQL a user types
  reaches a recording through sinks/recording/query.py;
- a command (exporter/cli/<command>.py) imports no other command: shared
  pieces live in exporter/cli/common/ or in the rooms below the commands.
"""

from __future__ import annotations

import ast
import re

from conftest import REPO

PACKAGE = REPO / "exporter"
RECORDING = PACKAGE / "sinks" / "recording"
# `SELECT <a column, *, a number or DISTINCT> ... FROM`: a statement, not a word in a sentence.
SELECT = re.compile(r"\bSELECT\s+(DISTINCT\s+)?[\w*{][^;]*?\bFROM\b", re.S)
PROSE_KEYWORDS = {"help", "description", "epilog", "usage"}


def _strings(tree: ast.AST):
    """The string constants of a module, f-strings' literal parts included, less docstrings
    and argparse's prose (help=, description=, epilog=, usage=)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg in PROSE_KEYWORDS:
            skip.update(id(n) for n in ast.walk(node.value))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            skip.update(id(v) for v in node.values)


def selects_outside_recording() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if RECORDING in path.parents:
            continue
        for line, text in _strings(ast.parse(path.read_text(), str(path))):
            if SELECT.search(text):
                found.append(f"{path.relative_to(REPO)}:{line}: {' '.join(text.split())[:90]}")
    return found


def test_no_select_outside_the_recording_package():
    found = selects_outside_recording()
    assert not found, ("SQL that reads a recording belongs to exporter/sinks/recording/ (read.py): "
                       f"{len(found)} SELECT(s) elsewhere:\n" + "\n".join(found))


def test_the_check_finds_a_select(tmp_path):
    """The check itself sees SQL in a plain string, an f-string and a concatenation,
    and not in prose."""
    src = ('x = conn.execute("SELECT node, pid FROM processes")\n'
           'y = conn.execute(f"SELECT {c} FROM {t} WHERE a = ?")\n'
           'z = ("SELECT COUNT(*) "\n     "FROM nccl_events")\n'
           'p.add_argument("sql", help="one SELECT (or WITH ...) statement, e.g. SELECT op FROM t")\n'
           'e = "sql: one read-only SELECT (or WITH ...) statement is required"\n')
    hits = sorted(line for line, text in _strings(ast.parse(src)) if SELECT.search(text))
    assert hits == [1, 2, 3]


COMMANDS = PACKAGE / "cli"


def test_no_command_imports_another_command():
    commands = {p.stem for p in COMMANDS.glob("*.py") if p.stem != "__init__"}
    found = []
    for path in sorted(COMMANDS.glob("*.py")):
        if path.stem == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "exporter.cli":
                    names = [a.name for a in node.names]
                elif node.module.startswith("exporter.cli."):
                    names = [node.module.split(".")[2]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[2] for a in node.names if a.name.startswith("exporter.cli.")]
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n in commands]
    assert not found, "a command imports another command (shared pieces go to exporter/cli/common/):\n" \
        + "\n".join(found)
