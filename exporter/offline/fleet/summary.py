"""`fleet query --summary`: per node its row count, answer time, and the p50 and
max of one numeric column, against the fleet's median (docs/fleet-live.md);
`--clock`'s columns."""

from __future__ import annotations

import random
import statistics

SUMMARY_SAMPLE = 10_000    # values kept per node for the summary's p50 (reservoir)


class Stats:
    """One node's values of the summary column: count, max, and a reservoir sample for the p50."""

    def __init__(self):
        self.n, self.max, self.sample, self.rng = 0, None, [], random.Random(0)

    def add(self, v):
        self.n += 1
        self.max = v if self.max is None or v > self.max else self.max
        if len(self.sample) < SUMMARY_SAMPLE:
            self.sample.append(v)
        else:
            j = self.rng.randrange(self.n)
            if j < SUMMARY_SAMPLE:
                self.sample[j] = v

    def p50(self):
        return statistics.median(self.sample) if self.sample else None


class Summary:
    """Rows in, per node (by URL): which column is summarised, and its Stats."""

    def __init__(self, column: str | None = None):
        self.column = column       # --summary-column, else the first numeric column of a node's rows
        self.stats: dict[str, Stats] = {}
        self.col: dict[str, int] = {}

    def add(self, url: str, names: list, rows) -> None:
        s = self.stats.setdefault(url, Stats())
        i = self.col.get(url)
        for r in rows:
            if i is None:
                if self.column:
                    i = names.index(self.column)
                else:
                    i = next((k for k, v in enumerate(r)
                              if isinstance(v, (int, float)) and not isinstance(v, bool)), -1)
                self.col[url] = i
            v = r[i] if i >= 0 else None
            if isinstance(v, (int, float)):
                s.add(float(v))
            else:
                s.n += 1

    def table(self, names, answered, clock: bool) -> tuple[list[str], list[tuple]]:
        """(header, rows): the slowest p50 first."""
        idx = next((i for i in self.col.values() if i is not None and i >= 0), -1)
        colname = self.column or (names[idx] if names and idx >= 0 else "value")
        rows = []
        for r in answered:
            s = self.stats.get(r.url, Stats())
            rows.append([r.node, r.rows, round(r.elapsed_s * 1000, 1), s.p50(), s.max])
        p50s = [row[3] for row in rows if row[3] is not None]
        fleet = statistics.median(p50s) if p50s else None
        header = ["node", "rows", "answer_ms", f"p50_{colname}", f"max_{colname}", "x_fleet_median"]
        for row in rows:
            row.append(round(row[3] / fleet, 2) if fleet and row[3] is not None else None)
        if clock:
            header += ["clock_offset_ms", "clock_pm_ms"]
            for row, r in zip(rows, answered):
                row += clock_cols(r.clock)
        order = sorted(range(len(rows)), key=lambda k: (rows[k][3] is None, -(rows[k][3] or 0), rows[k][0]))
        return header, [tuple(rows[k]) for k in order]


def clock_cols(clock):
    if clock is None:
        return [None, None]
    return [round(clock.offset_ns / 1e6, 3), round(clock.uncertainty_ns / 1e6, 3)]


def clock_table(answered) -> tuple[list[str], list[tuple]]:
    rows = [(r.node, *clock_cols(r.clock), round(r.clock.rtt_ns / 1e6, 3) if r.clock else None)
            for r in answered]
    rows.sort(key=lambda r: -abs(r[1] or 0))
    return ["node", "clock_offset_ms", "clock_pm_ms", "best_rtt_ms"], rows
