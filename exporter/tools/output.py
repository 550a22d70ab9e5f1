"""Rows as text for a terminal or a pipe: an aligned table, CSV, or JSON."""

from __future__ import annotations

import csv
import json
import sys


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e15 else repr(v)
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def format_table(names: list[str], rows: list[tuple]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(n) for n in names]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and bool(rows)
               for i in range(len(names))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(names), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"


def write(names, rows, fmt: str, out=None) -> None:
    out = out or sys.stdout
    if fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(names)
        w.writerows(rows)
    elif fmt == "json":
        out.write(json.dumps([dict(zip(names, (v.hex() if isinstance(v, bytes) else v for v in r)))
                              for r in rows], indent=1) + "\n")
    else:
        out.write(format_table(names, rows))
