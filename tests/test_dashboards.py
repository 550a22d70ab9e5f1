"""Grafana dashboards (dashboards/grafana/*.json): importable JSON, every panel
has a datasource and targets, the template variables exist, and every PromQL
expression can be extracted for tests/test_e2e_prometheus.py (which runs
them against a real Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import check_promql
from exporter.records import contract, metrics
import yaml

from conftest import REPO
DASHBOARD_DIR = REPO / "dashboards" / "grafana"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))

# Variables every dashboard has; comm/op only where the panels are per call.
COMMON_VARS = {"datasource", "tempo", "job", "node", "namespace", "pod", "rank"}
PER_CALL_VARS = {"comm", "op"}

def recorded_names() -> set[str]:
    """Series the recording rules of alerts/*.yml record (a contract too)."""
    return {r["record"] for f in sorted((REPO / "alerts").glob("*.yml"))
            for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "record" in r}


def recorded_read(expr: str) -> set[str]:
    return set(re.findall(r"\b(nccl:[a-z0-9_]+:[a-z0-9_]+)\b", expr))


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows
    return out


def substitute(expr: str, rate_interval: str = "15s") -> str:
    """Grafana variables -> something Prometheus accepts: `$__rate_interval` -> a
    duration, every other $var / ${var} (all used with =~) -> `.*`."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr)


GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__all"}


def variables(dash: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def variable_queries(path: Path) -> list[tuple[str, str, str]]:
    """[(variable, selector, label)] of every `label_values(selector, label)`
    query variable of a dashboard, in the order Grafana refreshes them, with
    the variables defined before it set to All (`.*`). A variable the
    dashboard does not define stays `$name`: Grafana sends it literally, so
    it matches nothing."""
    out, defined = [], set()
    for name, v in variables(load(path)).items():
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)", q.strip(), re.S)
            assert m, f"{path.name} / {name}: not label_values(selector, label): {q}"
            sel = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                         lambda x: ".*" if x[1] in defined else x[0], m[1])
            out.append((name, sel.strip(), m[2]))
        defined.add(name)
    return out


# Variables allowed to have no values in the tests' jobs: the simulated ranks
# run in no Kubernetes pod, so nccl_communicator_info's namespace and pod are
# empty (Prometheus stores no empty label; All still selects everything).
VARIABLES_EMPTY_OK = {"namespace", "pod"}


def empty_variables(paths, values_of) -> list[str]:
    """The template variables of `paths` whose query returns nothing:
    values_of(selector, label) -> the label's values, as Grafana asks
    Prometheus (the label-values API with the selector as match[])."""
    empty = []
    for path in paths:
        for name, selector, label in variable_queries(path):
            if not values_of(selector, label) and name not in VARIABLES_EMPTY_OK:
                empty.append(f"{path.name} / ${name}: label_values({selector}, {label})")
    return empty


def dashboard_queries(rate_interval: str = "15s") -> list[tuple[str, str, str, str]]:
    """[(dashboard file, panel title, refId, PromQL ready to run)] of every target."""
    out = []
    for path in DASHBOARDS:
        for p in panels(load(path)):
            for t in p.get("targets", []):
                out.append((path.name, p["title"], t["refId"], substitute(t["expr"], rate_interval)))
    return out


def instant_targets() -> set[tuple[str, str, str]]:
    """(dashboard file, panel title, refId) of the targets Grafana runs as instant queries."""
    return {(path.name, p["title"], t["refId"]) for path in DASHBOARDS for p in panels(load(path))
            for t in p.get("targets", []) if t.get("instant")}


def test_there_are_four_dashboards():
    assert {p.name for p in DASHBOARDS} == {
        "nccl-fleet-overview.json", "nccl-stragglers.json", "nccl-network.json", "nccl-cpu.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_importable(path):
    d = load(path)
    assert d["schemaVersion"] >= 36, "Grafana 10 dashboards"
    assert d["title"].startswith("NCCL / ") and d["uid"]
    assert d.get("id") is None, "no instance-specific id in an importable dashboard"
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_template_variables(path):
    d = load(path)
    vars_ = {v["name"]: v for v in d["templating"]["list"]}
    want = COMMON_VARS | (PER_CALL_VARS if path.name in ("nccl-fleet-overview.json", "nccl-stragglers.json") else set())
    assert want <= set(vars_), f"missing variables {want - set(vars_)}"
    assert vars_["datasource"]["type"] == "datasource" and vars_["datasource"]["query"] == "prometheus"
    assert vars_["tempo"]["type"] == "datasource" and vars_["tempo"]["query"] == "tempo"
    for name in want - {"datasource", "tempo"}:
        v = vars_[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert v["includeAll"] and v["allValue"] == ".*", f"{name}: All must be a regex for =~"
        assert "label_values(" in v["query"]["query"]


NATIVE_DASHBOARDS = sorted((DASHBOARD_DIR / "native").glob("*.json"))


@pytest.mark.parametrize("path", DASHBOARDS + NATIVE_DASHBOARDS, ids=lambda p: p.parent.name + "/" + p.name)
def test_variables_used_are_defined(path):
    """A `$var` the dashboard does not define reaches Prometheus literally and
    matches nothing: an empty dropdown or panel. Variables refer only to
    those defined before them (Grafana refreshes them in order)."""
    d = load(path)
    names = list(variables(d))
    for i, (name, v) in enumerate(variables(d).items()):
        q = json.dumps(v.get("query", ""))
        for used in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", q):
            assert used in names[:i] or used in GRAFANA_BUILTINS, f"variable {name} reads ${used}"
    for p in panels(d):
        for t in p.get("targets", []):
            for used in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", t["expr"]):
                assert used in names or used in GRAFANA_BUILTINS, f"{p['title']} reads ${used}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_datasource_and_targets(path):
    d = load(path)
    assert panels(d)
    for p in panels(d):
        assert p.get("type") != "row", "no rows: every panel has queries"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p.get("description"), f"{p['title']}: says what it shows"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert t["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_expressions_use_contract_names_and_variables(path):
    d = load(path)
    for p in panels(d):
        for t in p["targets"]:
            expr = t["expr"]
            names = check_promql(expr, p["title"])  # names and labels of exporter/records/metrics.py
            recorded = recorded_read(expr)
            assert recorded <= recorded_names(), f"{p['title']}: no rule records {recorded - recorded_names()}"
            assert names or recorded, f"{p['title']}: reads an nccl_* metric or recording rule"
            assert 'job=~"$job"' in expr, f"{p['title']}: filtered by $job"
            if "[" in expr:
                assert "$__rate_interval" in expr, f"{p['title']}: uses $__rate_interval"
            for op in re.findall(r'op=~?"([A-Z_|]+)"', expr):
                for o in op.split("|"):
                    assert o in contract.COLLECTIVE_OPS.values(), f"{p['title']}: op {o}"


def test_required_panels_exist():
    exprs = {name: " ".join(t["expr"] for p in panels(load(DASHBOARD_DIR / name)) for t in p["targets"])
             for name in (p.name for p in DASHBOARDS)}
    fleet = exprs["nccl-fleet-overview.json"]
    for needle in ("histogram_quantile(0.5", "histogram_quantile(0.99", "nccl_collective_duration_seconds_count",
                   "nccl_collective_bytes_total", "nccl_call_errors_total", "nccl_inflight_oldest_seconds"):
        assert needle in fleet, needle
    busbw = [p for p in panels(load(DASHBOARD_DIR / "nccl-fleet-overview.json")) if "busbw" in p["title"]][0]
    for formula in ("2(n−1)/n", "(n−1)/n", "× 1"):
        assert formula in busbw["description"]
    assert "nccl:collective_busbw_bytes_per_second:5m" in " ".join(t["expr"] for t in busbw["targets"])
    assert any(p["type"] == "heatmap" for p in panels(load(DASHBOARD_DIR / "nccl-stragglers.json")))
    assert "quantile by (op, comm) (0.5" in exprs["nccl-stragglers.json"]
    for m in (metrics.TCP_RETRANSMITS, metrics.TCP_RESETS, metrics.TCP_SRTT):
        assert m in exprs["nccl-network.json"]
    for m in (metrics.RUNQUEUE_DELAY, metrics.OFFCPU):
        assert m in exprs["nccl-cpu.json"]
    assert "thread" in exprs["nccl-cpu.json"]


def test_exemplars_on_duration_panels():
    found = 0
    for path in DASHBOARDS:
        for p in panels(load(path)):
            for t in p["targets"]:
                if "nccl_collective_duration_seconds_bucket" in t["expr"] and p["type"] != "table":
                    if t.get("exemplar"):
                        found += 1
    assert found >= 4


def test_substitution_leaves_no_variables():
    """Only label_replace's capture references ($1) are left: PromQL, not Grafana."""
    for _dash, title, _ref, expr in dashboard_queries():
        assert "$" not in re.sub(r'"\$\d"', "", expr), f"{title}: {expr}"


def test_expressions_parse_with_promtool(tmp_path, prometheus):
    """Every extracted expression is valid PromQL: promtool parses them as
    recording rules (no server needed; the e2e test also evaluates them)."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make deps: Debian package prometheus)")
    lines = ["groups:", "  - name: dashboards", "    rules:"]
    for i, (_dash, _title, _ref, expr) in enumerate(dashboard_queries()):
        lines += [f"      - record: dashboard:expr_{i}", f"        expr: {json.dumps(expr)}"]
    rules = tmp_path / "dashboards.yml"
    rules.write_text("\n".join(lines) + "\n")
    p = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_contract_check_can_fail():
    """check_promql refuses an unknown metric, a label the metric lacks, and a
    grouping label no metric of the expression has."""
    for bad in ('nccl_no_such_metric_total', 'nccl_collective_duration_seconds_bucket{bogus="x"}',
                'sum by (saddr) (rate(nccl_collective_duration_seconds_count[5m]))'):
        with pytest.raises(AssertionError):
            check_promql(bad, "test")
    assert check_promql('sum by (op, le) (rate(nccl_collective_duration_seconds_bucket{job="x"}[5m]))',
                        "test") == {"nccl_collective_duration_seconds"}


def test_gpu_time_panels():
    """GPU vs host time per op and rank (docs/dashboards.md), busbw from the recording
    rules, and the processes without the profiler plugin visible."""
    fleet = panels(load(DASHBOARD_DIR / "nccl-fleet-overview.json"))
    by_title = {p["title"]: p for p in fleet}
    gvh = " ".join(t["expr"] for t in by_title["GPU time vs host time per op and rank"]["targets"])
    assert metrics.GPU_DURATION + "_bucket" in gvh and metrics.COLLECTIVE_DURATION + "_bucket" in gvh
    assert '"clock", "gpu"' in gvh and '"clock", "host"' in gvh
    for t in by_title["GPU time vs host time per op and rank"]["targets"]:
        assert "sum by (op, comm, rank, le)" in t["expr"] and "{{clock}}" in t["legendFormat"]
    plugin = by_title["Profiler plugin per traced process"]
    assert plugin["type"] == "table" and metrics.PROFILER_PLUGIN_ACTIVE in plugin["targets"][0]["expr"]
    texts = {o["text"] for m in plugin["fieldConfig"]["defaults"]["mappings"] for o in m["options"].values()}
    assert texts == {"host time only", "GPU time (plugin)"}
    without_plugin = by_title["Traced processes without the profiler plugin"]
    assert "1 - nccl_profiler_plugin_active" in without_plugin["targets"][0]["expr"]
    assert "not on GPU hardware" in by_title["GPU time vs host time per op and rank"]["description"]


def test_network_wait_matrix_and_infiniband_companion():
    """A rank × peer matrix of recv_wait and one of send_wait (a slow link is high in
    both, docs/network.md), the senders' send_gpu_wait, and node_exporter's
    infiniband ports joined to the agent's nodes by `node`."""
    by_title = {p["title"]: p for p in panels(load(DASHBOARD_DIR / "nccl-network.json"))}
    for title, direction, phase in (("Network wait matrix: rank ← peer (recv_wait)", "recv", "recv_wait"),
                                    ("Network wait matrix: rank → peer (send_wait)", "send", "send_wait")):
        p = by_title[title]
        (t,) = p["targets"]
        assert metrics.NETWORK_WAIT in t["expr"] and "sum by (rank, peer)" in t["expr"]
        assert f'direction="{direction}"' in t["expr"] and f'phase="{phase}"' in t["expr"]
        assert 'comm=~"$comm"' in t["expr"] and t["instant"] and t["format"] == "table"
        (m,) = p["transformations"]
        assert m["id"] == "groupingToMatrix" and (m["options"]["rowField"], m["options"]["columnField"]) == \
            ("rank", "peer")
    own_gpu = by_title["Senders waiting for their own GPU (send_gpu_wait)"]
    assert 'phase="send_gpu_wait"' in own_gpu["targets"][0]["expr"]
    ib = by_title["InfiniBand / RoCE ports of these nodes (node_exporter)"]
    for t in ib["targets"]:
        assert "node_infiniband_" in t["expr"] and '"node", "$1", "instance"' in t["expr"]
        assert "on (node) group_left ()" in t["expr"] and metrics.EXPORTER_BUILD_INFO in t["expr"]
    vars_ = {v["name"] for v in load(DASHBOARD_DIR / "nccl-network.json")["templating"]["list"]}
    assert "comm" in vars_
