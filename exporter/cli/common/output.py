"""Rows as text for a terminal or a pipe: an aligned table, CSV, or JSON; all at once
(`write`) or streamed as rows arrive (`STREAM_WRITERS`: header(names), rows(rows),
end(sources))."""

from __future__ import annotations

import csv
import json
import sys

FORMATS = ["table", "csv", "json"]  # the --format of the commands that print rows


def add_format_option(parser) -> None:
    """--format of every command that prints rows (query, stragglers, fleet query)."""
    parser.add_argument("--format", choices=FORMATS, default="table",
                        help="table (default, aligned columns), csv (with a header row) "
                             "or json (an array of one object per row)")


TABLE_SAMPLE_ROWS = 1000   # a streamed table's column widths come from its first rows


def terminal_safe(text, limit: int = 300) -> str:
    """`text` on one line that a terminal shows as it is: control characters (NUL, CR,
    ESC, ...) and other unprintables escaped as \\xNN/\\uNNNN, at most `limit` characters."""
    text = str(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e15 else repr(v)
    if isinstance(v, bytes):
        return v.hex()
    return terminal_safe(v, 1 << 30)


class TableLayout:
    """Column widths and alignment of an aligned table, from the rows given
    (all of them, or a sample when rows are streamed): numbers right, text left."""

    def __init__(self, names: list[str], rows: list[tuple]):
        self.names = names
        cells = [[_cell(v) for v in row] for row in rows]
        self.widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
        self.numeric = [bool(rows) and all(isinstance(r[i], (int, float)) or r[i] is None for r in rows)
                        for i in range(len(names))]

    def header(self) -> str:
        """The column names and the rule under them."""
        return self._line(self.names) + "\n" + "  ".join("-" * w for w in self.widths) + "\n"

    def lines(self, rows) -> str:
        return "".join(self._line([_cell(v) for v in r]) + "\n" for r in rows)

    def _line(self, values) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, self.widths, self.numeric)).rstrip()


def format_table(names: list[str], rows: list[tuple]) -> str:
    layout = TableLayout(names, rows)
    return (layout.header() + layout.lines(rows)
            + f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")


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


# --- streamed: rows as they come -------------------------------------------------

class TableWriter:
    """The aligned table, streamed: column widths from the first TABLE_SAMPLE_ROWS rows."""

    def __init__(self, out):
        self.out, self.names, self.held, self.layout, self.n = out, None, [], None, 0

    def header(self, names):
        self.names = names

    def rows(self, rows):
        self.n += len(rows)
        if self.layout is None:
            self.held += rows
            if len(self.held) >= TABLE_SAMPLE_ROWS:
                self._start()
        else:
            self.out.write(self.layout.lines(rows))

    def _start(self):
        self.layout = TableLayout(self.names or [], self.held)
        self.out.write(self.layout.header() + self.layout.lines(self.held))
        self.held = []

    def end(self, nodes):
        if self.names is None:
            return
        if self.layout is None:
            self._start()
        self.out.write(f"({self.n} row{'s' if self.n != 1 else ''} from {nodes} "
                       f"node{'s' if nodes != 1 else ''})\n")


class CsvWriter:
    def __init__(self, out):
        self.w = csv.writer(out, lineterminator="\n")

    def header(self, names):
        self.w.writerow(names)

    def rows(self, rows):
        self.w.writerows(rows)

    def end(self, nodes):
        pass


class JsonWriter:
    def __init__(self, out):
        self.out, self.names, self.first = out, None, True

    def header(self, names):
        self.names = names
        self.out.write("[")

    def rows(self, rows):
        parts = [json.dumps(dict(zip(self.names, r))) for r in rows]
        if parts:
            self.out.write(("\n" if self.first else ",\n") + ",\n".join(parts))
            self.first = False

    def end(self, nodes):
        if self.names is not None:
            self.out.write("\n]\n" if not self.first else "]\n")


STREAM_WRITERS = {"table": TableWriter, "csv": CsvWriter, "json": JsonWriter}
