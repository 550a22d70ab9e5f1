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

REPO = Path(__file__).resolve().parent.parent
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


def github_anchor(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def runbook_anchors() -> set[str]:
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.M)}


def test_rule_files_exist():
    assert RULE_FILES and TEST_FILES


def test_promtool_check_rules():
    p = subprocess.run([promtool(), "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


def test_promtool_unit_tests():
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
    }.items():
        text = by_name[name]["annotations"]["summary"] + by_name[name]["annotations"]["description"]
        for label in labels:
            assert "$labels." + label in text, f"{name} does not name {label}"


def test_alert_expressions_use_contract_names_and_labels():
    """Every metric and label an alert reads is in exporter/records/metrics.py."""
    read = set()
    for r in alert_rules():
        read |= check_promql(r["expr"], r["alert"])
    assert "nccl_collective_duration_seconds" in read and "nccl_tcp_retransmits" in read


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
