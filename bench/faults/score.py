"""Score detectors against injected faults: time to the first right naming of
the culprit, precision of the namings, false alarms on healthy runs
(docs/benchmark.md, "Scoring"). Pure: reads two JSON-lines files, so any tool
that writes its answers in the same format is scored the same way.

    .venv/bin/python -m bench.faults.score truth.jsonl detections.jsonl [truth2.jsonl detections2.jsonl ...]

truth.jsonl, one line per run, written BEFORE the fault is injected:
    {"run": "r03", "fault": "straggler", "healthy": false,
     "culprit": {"rank": 2} | {"link": {"to": "198.18.0.3"}}
                | {"link": {"from": "198.18.0.2", "to": "198.18.0.3"}} | null,
     "cause": "late_arrival", "start": T0, "onset": T1, "wait_s": 90,
     "commit": "0123abcd4567"}
  a link with "to" only: any named link with that end is right (a lossy
  link into a host, whose peers all send into it); with "from" too (one
  directed link between two ranks, as a slow link): only that link,
  named [from, to].
  start: the job's start (Unix s), onset: the fault's (or the healthy
  control's event's), wait_s: a culprit not named by onset + wait_s is a miss.
  commit (optional): the code the detectors ran from; runs from different
  commits are scored together only with --mixed-commits.
detections.jsonl, one line per answer that names a culprit:
    {"run": "r03", "detector": "prometheus", "t": T,
     "culprit": {"rank": 2} | {"link": ["198.18.0.1", "198.18.0.3"]},
     "cause": "late_arrival", "what": "NcclRankLate"}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out


def names_culprit(truth: dict, named: dict) -> bool:
    """Whether a detection's culprit is the injected one: the same rank, or a
    link with the injected link's receiving end (and, where the truth names
    it, its sending end: that directed link)."""
    want = truth.get("culprit")
    if not want or not named:
        return False
    if "rank" in want:
        return named.get("rank") == want["rank"]
    if "link" in want:
        link = list(named.get("link") or [])
        if "from" in want["link"]:
            return link == [want["link"]["from"], want["link"]["to"]]
        return want["link"]["to"] in link
    return False


def quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between order statistics (None if empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Cell:
    """One (fault, detector): what it found."""
    runs: int = 0
    latencies: list[float] = field(default_factory=list)   # onset -> first right naming, per detected run
    right: int = 0      # namings (distinct culprits per run) that were right
    wrong: int = 0      # namings of another culprit within the run's window
    cause_right: int = 0  # runs where a right naming also gave the injected cause
    cause_latencies: list[float] = field(default_factory=list)  # onset -> first right culprit with right cause

    def row(self) -> dict:
        named = self.right + self.wrong
        return {"runs": self.runs, "detected": len(self.latencies),
                "median_s": _r(statistics.median(self.latencies)) if self.latencies else None,
                "p90_s": _r(quantile(self.latencies, 0.9)),
                "right": self.right, "wrong": self.wrong,
                "precision": _r(self.right / named) if named else None,
                "cause_right": self.cause_right,
                "cause_median_s": _r(statistics.median(self.cause_latencies)) if self.cause_latencies else None}


def _r(x):
    return None if x is None else round(x, 1)


def score(truths: list[dict], detections: list[dict], detectors: list[str] | None = None) -> dict:
    """{"faults": {fault: {detector: row}}, "healthy": {detector: {"hours", "false_alarms", "per_hour"}}}.

    Per run and detector, each distinct culprit named counts once. The cause
    is right in a run if any naming of the right culprit in its window gave
    the injected cause (a detector may name the culprit first with a symptom,
    "late_arrival", then with the cause). In a fault run, namings from the
    onset to onset + wait_s are right or wrong; namings between the job's
    start and the onset are false alarms on a healthy job, as is every
    naming in a healthy run (from its start to onset + wait_s)."""
    by_run: dict[str, list[dict]] = {}
    for d in detections:
        by_run.setdefault(d["run"], []).append(d)
    detectors = detectors or sorted({d["detector"] for d in detections})
    faults: dict[str, dict[str, Cell]] = {}
    healthy_s = 0.0
    alarms = {det: 0 for det in detectors}
    for t in truths:
        end = t["onset"] + t["wait_s"]
        healthy_s += (end if t.get("healthy") else t["onset"]) - t["start"]
        for det in detectors:
            seen: dict[str, tuple[float, dict]] = {}   # culprit key -> first naming
            for d in sorted(by_run.get(t["run"], []), key=lambda d: d["t"]):
                if d["detector"] == det and t["start"] <= d["t"] <= end:
                    seen.setdefault(json.dumps(d["culprit"], sort_keys=True), (d["t"], d))
            if t.get("healthy"):
                alarms[det] += len(seen)
                continue
            cell = faults.setdefault(t["fault"], {}).setdefault(det, Cell())
            cell.runs += 1
            first = None
            for when, d in seen.values():
                if when < t["onset"]:
                    alarms[det] += 1
                elif names_culprit(t, d["culprit"]):
                    cell.right += 1
                    first = when if first is None else min(first, when)
                else:
                    cell.wrong += 1
            if first is not None:
                cell.latencies.append(first - t["onset"])
                with_cause = [d["t"] for d in by_run.get(t["run"], []) if d["detector"] == det
                              and t["onset"] <= d["t"] <= end and names_culprit(t, d["culprit"])
                              and d.get("cause") == t.get("cause")]
                if with_cause:
                    cell.cause_right += 1
                    cell.cause_latencies.append(min(with_cause) - t["onset"])
    hours = healthy_s / 3600
    totals = {det: (sum(c[det].right for c in faults.values() if det in c),
                    sum(c[det].wrong for c in faults.values() if det in c)) for det in detectors}
    return {"faults": {f: {det: c.row() for det, c in cells.items()} for f, cells in faults.items()},
            "healthy": {det: {"hours": round(hours, 3), "false_alarms": n,
                              "per_hour": round(n / hours, 2) if hours else None} for det, n in alarms.items()},
            # every naming in the fault runs' windows, all faults together: how often the culprit named is right
            "namings": {det: {"right": r, "wrong": w, "precision": round(r / (r + w), 3) if r + w else None}
                        for det, (r, w) in totals.items()}}


def table(result: dict) -> str:
    """The Markdown table of docs/benchmark.md."""
    lines = ["| fault | detector | runs | named | median s | p90 s | precision | cause right | cause median s |",
             "|---|---|---|---|---|---|---|---|---|"]
    dash = lambda x: "–" if x is None else x  # noqa: E731
    for fault, cells in sorted(result["faults"].items()):
        for det, r in sorted(cells.items()):
            lines.append(f"| {fault} | {det} | {r['runs']} | {r['detected']} | {dash(r['median_s'])} | "
                         f"{dash(r['p90_s'])} | {dash(r['precision'])} | {r['cause_right']} | "
                         f"{dash(r.get('cause_median_s'))} |")
    lines += ["", "| detector | namings in fault runs | right | precision | healthy hours | false alarms | per hour |",
              "|---|---|---|---|---|---|---|"]
    for det, h in sorted(result["healthy"].items()):
        n = result["namings"][det]
        lines.append(f"| {det} | {n['right'] + n['wrong']} | {n['right']} | {dash(n['precision'])} | "
                     f"{h['hours']} | {h['false_alarms']} | {dash(h['per_hour'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Formats: see the module's docstring (python -m bench.faults.score).")
    p.add_argument("files", type=Path, nargs="+", metavar="TRUTH DETECTIONS",
                   help="pairs of files: ground truth, then the detectors' namings (JSON lines); several "
                        "pairs (separate sessions) are scored together, their run ids need not differ")
    p.add_argument("--format", choices=["markdown", "json"], default="markdown")
    p.add_argument("--mixed-commits", action="store_true",
                   help="score runs whose detectors ran from different commits together")
    a = p.parse_args(argv)
    if len(a.files) % 2:
        p.error("give files in pairs: TRUTH DETECTIONS")
    try:
        truths, detections = [], []
        for i in range(0, len(a.files), 2):
            tag = f"{i // 2}:"   # run ids are per session
            truths += [dict(t, run=tag + t["run"]) for t in read_jsonl(a.files[i])]
            detections += [dict(d, run=tag + d["run"]) for d in read_jsonl(a.files[i + 1])]
        commits = sorted({t.get("commit", "") for t in truths} - {""})
        if len(commits) > 1 and not a.mixed_commits:
            raise ValueError(f"the runs come from different commits ({', '.join(commits)}): "
                             "their detectors may differ (--mixed-commits to score them together)")
        result = score(truths, detections)
        result["commits"] = commits
    except (OSError, ValueError, KeyError) as e:
        print(f"score: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if a.format == "json" else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
