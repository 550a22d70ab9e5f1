"""Alerting rules (alerts/*.yml) with the real promtool: they load, their unit
tests (alerts/tests/*.yml) pass, every alert has a firing AND a non-firing
test case, and every alert has summary, description and a runbook_url
pointing at an existing section of docs/alerts.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import check_promql
import yaml

from conftest import REPO
RULE_FILES = sorted((REPO / "alerts").glob("*.yml"))
TEST_FILES = sorted((REPO / "alerts" / "tests").glob("*.yml"))
RUNBOOK = REPO / "docs" / "alerts.md"
RUNBOOK_PREFIX = "https://github.com/nccl-exporter/nccl-exporter/blob/main/docs/alerts.md#"


def promtool() -> str:
    p = shutil.which("promtool")
    if p is None:
        pytest.skip("promtool not installed (make deps: Debian package prometheus)")
    return p


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict]:
    return [r for f in RULE_FILES for g in load_yaml(f)["groups"] for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for f in RULE_FILES for g in load_yaml(f)["groups"] for r in g["rules"] if "record" in r]


def recorded_names() -> set[str]:
    return {r["record"] for r in recording_rules()}


def names_of_recorded(expr: str) -> set[str]:
    """The recording-rule names (level:metric:operations) an expression reads."""
    return set(re.findall(r"\b(nccl:[a-z0-9_]+:[a-z0-9_]+)\b", expr))


def github_anchor(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def runbook_anchors() -> set[str]:
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.M)}


def test_rule_files_exist():
    assert RULE_FILES and TEST_FILES


def test_promtool_check_rules(prometheus):
    p = subprocess.run([promtool(), "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


def test_promtool_unit_tests(prometheus):
    p = subprocess.run([promtool(), "test", "rules", *map(str, TEST_FILES)], capture_output=True, text=True,
                       cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_alert_has_firing_and_quiet_cases():
    alerts = {r["alert"] for r in alert_rules()}
    firing, quiet = set(), set()
    for f in TEST_FILES:
        for t in load_yaml(f)["tests"]:
            for case in t.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert alerts - firing == set(), f"alerts with no firing test case: {alerts - firing}"
    assert alerts - quiet == set(), f"alerts with no non-firing test case: {alerts - quiet}"
    assert (firing | quiet) <= alerts, f"tests name unknown alerts: {(firing | quiet) - alerts}"


def test_annotations_and_runbook_links():
    anchors = runbook_anchors()
    rules = alert_rules()
    assert len(rules) >= 8
    for r in rules:
        a = r.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert a.get(key, "").strip(), f"{r['alert']}: no {key}"
        assert a["runbook_url"].startswith(RUNBOOK_PREFIX), r["alert"]
        anchor = a["runbook_url"][len(RUNBOOK_PREFIX):]
        assert anchor in anchors, f"{r['alert']}: docs/alerts.md has no section #{anchor}"
        assert anchor == github_anchor(r["alert"]), f"{r['alert']}: the section is named after the alert"
        assert r.get("labels", {}).get("severity") in ("warning", "critical"), r["alert"]


def test_alerts_name_rank_node_and_link_where_relevant():
    by_name = {r["alert"]: r for r in alert_rules()}
    for name, labels in {
        "NcclStragglerRank": ("rank", "node", "comm"),
        "NcclCollectiveHung": ("rank", "node", "comm"),
        "NcclRankDesync": ("rank", "node", "comm"),
        "NcclAllReduceP99High": ("comm",),
        "NcclTcpRetransmits": ("saddr", "daddr", "rank", "node"),
        "NcclPeerNetworkWaitHigh": ("rank", "peer", "node", "comm"),
    }.items():
        text = by_name[name]["annotations"]["summary"] + by_name[name]["annotations"]["description"]
        for label in labels:
            assert "$labels." + label in text, f"{name} does not name {label}"


def test_alert_expressions_use_contract_names_and_labels():
    """Every metric and label an alert or recording rule reads is in
    exporter/records/metrics.py; every recorded series it reads is recorded."""
    read = set()
    recorded = recorded_names()
    for r in alert_rules() + recording_rules():
        where = r.get("alert") or r["record"]
        read |= check_promql(r["expr"], where)
        missing = names_of_recorded(r["expr"]) - recorded
        assert not missing, f"{where} reads series no rule records: {missing}"
    for m in ("nccl_collective_duration_seconds", "nccl_collective_gpu_duration_seconds",
              "nccl_inflight_oldest_seconds", "nccl_gpu_inflight_oldest_seconds",
              "nccl_profiler_plugin_active", "nccl_collective_bytes", "nccl_tcp_retransmits"):
        assert m in read, m


def test_gpu_time_where_the_plugin_is_active_else_host_time():
    """One `or` per series, GPU first, for the collective time, and the alerts
    that judge durations read it (p99, straggler, hang: docs/alerts.md)."""
    rec = {r["record"]: r["expr"] for r in recording_rules()}
    for part in ("bucket", "sum", "count"):
        expr = rec[f"nccl:collective_time_seconds_{part}:rate5m"]
        gpu, host = expr.index(f"nccl_collective_gpu_duration_seconds_{part}"), \
            expr.index(f"nccl_collective_duration_seconds_{part}")
        assert gpu < expr.index("or on (job, node, op, comm, rank") < host, part
    for q in ("p50_5m", "p99_5m"):
        assert "nccl:collective_time_seconds_bucket:rate5m" in rec[f"nccl:collective_duration_seconds:{q}"]
    alerts = {r["alert"]: r["expr"] for r in alert_rules()}
    assert "nccl:collective_time_seconds_bucket:rate5m" in alerts["NcclAllReduceP99High"]
    assert "nccl:collective_duration_seconds:p50_5m" in alerts["NcclStragglerRank"]
    hung = alerts["NcclCollectiveHung"]
    assert hung.index('nccl_gpu_inflight_oldest_seconds{state="running"}') < hung.index("or on (") \
        < hung.index("nccl_inflight_oldest_seconds)")
    assert 'nccl_gpu_inflight_oldest_seconds{state="queued"}' in alerts["NcclGpuQueueStalled"]
    assert "nccl_profiler_plugin_active" in alerts["NcclProfilerPluginMissing"]
    assert "== 0" in alerts["NcclProfilerPluginMissing"]


def test_bandwidth_rules_follow_nccl_tests():
    rec = {r["record"]: r["expr"] for r in recording_rules()}
    size = rec["nccl:collective_size_bytes:rate5m"]
    assert "ALL_GATHER|REDUCE_SCATTER|ALL_TO_ALL|GATHER|SCATTER" in size
    assert "nccl:communicator_ranks:5m" in size
    assert "nccl:collective_time_seconds_sum:rate5m" in rec["nccl:collective_algbw_bytes_per_second:5m"]
    busbw = rec["nccl:collective_busbw_bytes_per_second:5m"]
    assert '{op="ALL_REDUCE"}' in busbw and "2 * (nccl:communicator_ranks:5m - 1)" in busbw
    assert "(nccl:communicator_ranks:5m - 1) / nccl:communicator_ranks:5m" in busbw
    assert 'op=~"BROADCAST|REDUCE|SEND|RECV"' in busbw
    # every op nccl-tests defines a bandwidth for has a factor (one-sided ops
    # such as PUT_SIGNAL have no nccl-tests definition and no busbw)
    from exporter.records import contract
    ops = set()
    for m in re.findall(r'op=~?"([A-Z_|]+)"', busbw):
        ops |= set(m.split("|"))
    assert ops <= set(contract.COLLECTIVE_OPS.values())
    assert ops == {"ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL", "GATHER", "SCATTER",
                   "BROADCAST", "REDUCE", "SEND", "RECV"}


def test_both_cases_are_unit_tested():
    """promtool cases where the plugin is active (GPU series) and absent (host
    series only) for the p99 and hang alerts."""
    text = "\n".join(f.read_text() for f in TEST_FILES)
    for alert in ("NcclAllReduceP99High", "NcclCollectiveHung"):
        fired = [case for f in TEST_FILES for t in load_yaml(f)["tests"]
                 for case in t.get("alert_rule_test", []) if case["alertname"] == alert and case.get("exp_alerts")]
        clocks = {a["exp_labels"].get("clock") for c in fired for a in c["exp_alerts"]}
        assert {"gpu", "host"} <= clocks, (alert, clocks)
    assert "promql_expr_test" in text and "nccl:collective_busbw_bytes_per_second:5m" in text


def test_required_alerts_and_metric_names():
    by_name = {r["alert"]: r["expr"] for r in alert_rules()}
    assert "nccl_inflight_oldest_seconds" in by_name["NcclCollectiveHung"]
    assert "nccl_tcp_retransmits_total" in by_name["NcclTcpRetransmits"]
    assert "up{" in by_name["NcclExporterDown"]
    assert "absent(nccl_exporter_build_info)" in by_name["NcclExporterAbsent"]
    assert "nccl_exporter_events_lost_total" in by_name["NcclExporterEventsLost"]
    assert "nccl_exporter_map_full_total" in by_name["NcclExporterMapFull"]
    # The straggler is the rank with SHORTER calls than its communicator's median.
    assert "< on (op, comm) group_left" in by_name["NcclStragglerRank"]
    assert "0.5 *" in by_name["NcclStragglerRank"]


def test_runbook_has_a_section_per_alert_and_no_orphans():
    alerts = {github_anchor(r["alert"]) for r in alert_rules()}
    sections = {github_anchor(h) for h in re.findall(r"^## (.+)$", RUNBOOK.read_text(), re.M)}
    assert alerts <= sections
    assert {s for s in sections if s.startswith("nccl")} == alerts
