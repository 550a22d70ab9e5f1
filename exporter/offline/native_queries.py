"""Native-histogram versions of the recording rules, alerts and dashboards.

alerts/nccl.yml and dashboards/grafana/*.json query the classic buckets of
the duration, run-queue and srtt histograms (`<name>_bucket` with `le`,
`_sum`, `_count`), which a Prometheus without native histograms stores. A
Prometheus that scrapes protobuf with native histograms on stores each
histogram as one series named `<name>` instead (docs/metrics.md, "Native
histograms"), so the same questions are asked differently:

    rate(X_bucket[w]) ... by (..., le)   ->  rate(X[w]) ... by (...)
    rate(X_sum[w])                       ->  histogram_sum(rate(X[w]))
    rate(X_count[w]), increase(...)      ->  histogram_count(rate(X[w]))
    irate(X_sum[w]), irate(X_count[w])   ->  histogram_sum(rate(X[w])), ... : Prometheus
        2.42 has no irate() of a native histogram (3.3 brought it); over 10 s at
        5 s scrapes rate() has the same last two scrapes, unless a third falls
        exactly on the window's start
    histogram_quantile(q, nccl:collective_time_seconds_bucket:rate5m ...) -> taken
        from the scraped histograms directly (_inline_time_histogram says why)
    label_values(X_count{...}, l)        ->  label_values(X{...}, l)   (template variables)

A family that can be scraped without buckets (BUCKETLESS) stays classic in
that mode, so its `_sum`/`_count` become `(native or classic)`.

Everything else (names of the other recorded series, thresholds, `for:`,
labels, annotations) is kept, so alerts/native/nccl.yml is a drop-in
replacement for alerts/nccl.yml and the dashboards under
dashboards/grafana/native/ for those above them. They are generated, never
edited by hand:

    .venv/bin/python -m exporter.offline.native_queries          # write them
    .venv/bin/python -m exporter.offline.native_queries --check  # exit 1 if stale

tests/test_native_histograms.py checks they are current, and evaluates them
in a real Prometheus that scrapes the agent.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

from exporter.records import metrics

REPO = Path(__file__).resolve().parents[2]
HISTOGRAMS = sorted(m.name for m in metrics.ALL if m.kind == "histogram")
_NAMES = "|".join(re.escape(n) for n in HISTOGRAMS)
RECORDED_BUCKETS: dict[str, str] = {}  # classic recorded bucket series -> native (none: see below)
# Histograms some mode exports with no buckets, only a count and a sum: the
# run-queue delay under `run --sched totals` (sources/schedstat.py,
# SchedTotals.layout is None). Prometheus stores such a protobuf histogram as
# a classic one (`_count`, `_sum`) even with native histograms on, and as a
# native one under `--sched waits` (docs/metrics.md, "Native histograms").
BUCKETLESS = {metrics.RUNQUEUE_DELAY}
HEADER = ("# GENERATED from alerts/nccl.yml by exporter/offline/native_queries.py for Prometheus\n"
          "# with native histograms (docs/metrics.md, \"Native histograms\"): load it INSTEAD of\n"
          "# alerts/nccl.yml. Do not edit: change alerts/nccl.yml and regenerate.\n")


def _range_call(fn: str, suffix: str):
    """fn(NAME_suffix{...}[w]) with a balanced selector and range."""
    return re.compile(rf"\b{fn}\(\s*({_NAMES}){suffix}(\{{[^}}]*\}})?(\[[^\]]+\])\s*\)")


def native_expr(expr: str) -> str:
    """A PromQL expression on classic buckets, rewritten for native histograms."""
    out = expr
    for old, new in RECORDED_BUCKETS.items():
        out = out.replace(old, new)
    def moment(fn: str, suffix: str):
        def sub(m: re.Match) -> str:
            sel, rng = m[2] or "", m[3]
            native = f"histogram{suffix}({'rate' if fn == 'irate' else fn}({m[1]}{sel}{rng}))"
            if m[1] in BUCKETLESS:  # classic in one mode, native in the other
                return f"({native} or {fn}({m[1]}{suffix}{sel}{rng}))"
            return native
        return sub

    for fn in ("rate", "increase", "irate"):
        out = _range_call(fn, "_bucket").sub(lambda m, fn=fn: f"{fn}({m[1]}{m[2] or ''}{m[3]})", out)
        out = _range_call(fn, "_sum").sub(moment(fn, "_sum"), out)
        out = _range_call(fn, "_count").sub(moment(fn, "_count"), out)
    # a template variable's series: the native histogram's one name
    out = re.sub(rf"\blabel_values\(\s*({_NAMES})_(?:bucket|sum|count)\b",
                 lambda m: m[0] if m[1] in BUCKETLESS else f"label_values({m[1]}", out)
    # `le` leaves every grouping and matching clause
    out = re.sub(r"\b(by|on|without|ignoring)\s*\(([^)]*)\)",
                 lambda m: f"{m[1]} ({', '.join(x.strip() for x in m[2].split(',') if x.strip() not in ('', 'le'))})",
                 out)
    return out


def native_rules(text: str) -> str:
    """alerts/nccl.yml's text with every `expr:` block rewritten (comments and layout kept)."""
    lines = _inline_time_histogram(text).split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)(- )?(expr|record): ?(.*)$", line)
        if m and m[3] == "record":
            out.append(line.replace(m[4], RECORDED_BUCKETS.get(m[4].strip(), m[4])))
            i += 1
            continue
        if m and m[3] == "expr" and m[4].strip() in ("|", "|-", ">", ">-"):
            indent = len(m[1]) + (2 if m[2] else 0)
            block = [line]
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():  # trailing blank lines belong after the block
                i -= 1
                body.pop()
            out += block + native_expr("\n".join(body)).split("\n")
            continue
        if m and m[3] == "expr":
            out.append(line.replace(m[4], native_expr(m[4])))
            i += 1
            continue
        out.append(line)
        i += 1
    return HEADER + "\n".join(out)


_BUCKET_QUANTILE = re.compile(
    r"histogram_quantile\((?P<q>[0-9.]+),\s*sum by \((?P<by>[^)]*)\) \(\s*"
    r"nccl:collective_time_seconds_bucket:rate5m(?P<sel>\{[^}]*\})?\)\)")
_BUCKET_RECORD = re.compile(
    r"(?P<indent> *)- record: nccl:collective_time_seconds_bucket:rate5m\n.*?(?=^(?P=indent)- )", re.S | re.M)
SERIES = "job, node, op, comm, rank"


def _inline_time_histogram(text: str) -> str:
    """The classic rules record nccl:collective_time_seconds_bucket:rate5m (GPU
    time where the plugin measures a series, host time elsewhere, labelled
    `clock`) and take quantiles of it. Prometheus 2.42 cannot record that as a
    native histogram: label_replace() turns a histogram sample into 0, and a
    recorded rate() fails its own count check by a rounding error. So the
    native rules take the quantiles from the scraped series directly, and
    label the float results."""
    text = _BUCKET_RECORD.sub("", text)

    def expand(m: re.Match) -> str:
        q, sel = m["q"], m["sel"] or ""
        by = ", ".join(x.strip() for x in m["by"].split(",") if x.strip() not in ("le", "clock", ""))
        gpu = f"sum by ({SERIES}) (rate(nccl_collective_gpu_duration_seconds{sel}[5m]))"
        host = (f"sum by ({SERIES}) (rate(nccl_collective_duration_seconds{sel}[5m]))\n"
                f"    unless on ({SERIES}) {gpu}")
        return (f'label_replace(histogram_quantile({q}, sum by ({by}) (\n    {gpu})),\n  "clock", "gpu", "", "")\n'
                f"or\n"
                f'label_replace(histogram_quantile({q}, sum by ({by}) (\n    {host})),\n  "clock", "host", "", "")')

    def expr_block(m: re.Match) -> str:
        indent = m["indent"]
        body = textwrap.dedent(m["body"])
        new = _BUCKET_QUANTILE.sub(expand, body)
        return m["head"] + textwrap.indent(new, indent)

    return re.sub(r"(?P<head>^(?P<hi> *)expr: \|\n)"
                  r"(?P<body>(?:(?P<indent>(?P=hi)  +)\S.*\n(?:(?P=indent).*\n|\s*\n)*))",
                  expr_block, text, flags=re.M)


def native_dashboard(text: str, title_suffix: str = " (native histograms)") -> str:
    """A Grafana dashboard's JSON with every target's expression rewritten."""
    dash = json.loads(text)

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "expr" and isinstance(v, str):
                    node[k] = native_expr(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash)
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            var["definition"] = native_expr(var.get("definition", ""))
            if isinstance(var.get("query"), dict):
                var["query"]["query"] = native_expr(var["query"]["query"])
    dash["title"] = dash.get("title", "") + title_suffix
    if dash.get("uid"):
        dash["uid"] = (dash["uid"] + "-native")[:40]
    return json.dumps(dash, indent=2, ensure_ascii=False) + "\n"


def outputs() -> dict[Path, str]:
    """Every generated file and its text."""
    files = {REPO / "alerts/native/nccl.yml": native_rules((REPO / "alerts/nccl.yml").read_text())}
    for path in sorted((REPO / "dashboards/grafana").glob("*.json")):
        files[REPO / "dashboards/grafana/native" / path.name] = native_dashboard(path.read_text())
    return files


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stale = []
    for path, text in outputs().items():
        if path.is_file() and path.read_text() == text:
            continue
        if "--check" in argv:
            stale.append(str(path.relative_to(REPO)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print("stale (run python -m exporter.offline.native_queries): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
