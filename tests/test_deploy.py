"""deploy/: the systemd unit, the Kubernetes manifests, and the PrometheusRule
generated from alerts/ (which must equal alerts/ exactly)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_alerts import load_yaml

from conftest import REPO
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
# SYS_ADMIN: without it the kernel refuses the uprobe perf PMU and BCC's
# tracefs fallback fails for real library paths (docs/deploy.md, measured).
NEEDED_CAPS = {"BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH", "SYS_ADMIN"}


def test_prometheusrule_is_up_to_date():
    p = subprocess.run([sys.executable, str(DEPLOY / "gen_prometheusrule.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_prometheusrule_groups_equal_alerts():
    rule = load_yaml(K8S / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    groups = [g for f in sorted((REPO / "alerts").glob("*.yml")) for g in load_yaml(f)["groups"]]
    assert rule["spec"]["groups"] == groups


def test_generator_output_is_valid_for_promtool(tmp_path, prometheus):
    """The generated groups, as a plain rules file, load in promtool."""
    import shutil
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make deps)")
    text = (K8S / "prometheusrule.yaml").read_text()
    body = text.split("\nspec:\n", 1)[1]
    rules = tmp_path / "rules.yml"
    rules.write_text("\n".join(line[2:] for line in body.splitlines()) + "\n")
    p = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_daemonset():
    ds = load_yaml(K8S / "daemonset.yaml")
    assert ds["kind"] == "DaemonSet"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc.get("privileged") is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == NEEDED_CAPS, "only the capabilities docs/deploy.md justifies"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug", "/lib/modules", "/usr/src"):
        assert path in mounts, path
        assert volumes[mounts[path]]["hostPath"]["path"] == path
    assert {p["containerPort"] for p in c["ports"]} == {9862}
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_EXPORTER_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert c["args"][0] == "run"
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert ready["path"] == "/-/ready" and ready["port"] == "metrics"
    assert live["path"] == "/-/healthy" and live["port"] == "metrics"
    assert c["startupProbe"]["httpGet"]["path"] == "/-/healthy"


def test_service_and_servicemonitor_select_the_pods():
    ds = load_yaml(K8S / "daemonset.yaml")
    svc = load_yaml(K8S / "service.yaml")
    sm = load_yaml(K8S / "servicemonitor.yaml")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["metadata"]["name"] == "nccl-exporter", "the job label the alerts expect"
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "metrics" and port["port"] == 9862
    assert sm["kind"] == "ServiceMonitor"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]


def unit_file(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    cur = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            cur = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        cur.setdefault(key, []).append(value)
    return sections


def test_systemd_unit():
    u = unit_file(DEPLOY / "systemd" / "nccl-exporter.service")
    svc = u["Service"]
    (exec_start,) = svc["ExecStart"]
    assert exec_start.split()[0].endswith("/.venv/bin/nccl-exporter") and exec_start.split()[1] == "run"
    assert svc["Restart"] == ["on-failure"]
    caps = {c.removeprefix("CAP_") for c in svc["CapabilityBoundingSet"][0].split()}
    assert caps == NEEDED_CAPS
    assert {c.removeprefix("CAP_") for c in svc["AmbientCapabilities"][0].split()} == NEEDED_CAPS
    assert svc["Type"] == ["notify"] and svc["NotifyAccess"] == ["main"]
    assert u["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_unit_verifies(tmp_path):
    """`systemd-analyze verify` accepts the unit (ExecStart pointed at this venv's
    binary: the unit names /opt/nccl-exporter, which this host need not have)."""
    import shutil
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    binary = Path(sys.executable).parent / "nccl-exporter"
    if not binary.is_file():
        pytest.skip(f"{binary} missing: the venv has no console script (pip install -e .)")
    text = (DEPLOY / "systemd" / "nccl-exporter.service").read_text()
    assert "/opt/nccl-exporter/.venv/bin/nccl-exporter" in text
    unit = tmp_path / "nccl-exporter.service"
    unit.write_text(text.replace("/opt/nccl-exporter/.venv/bin/nccl-exporter", str(binary)))
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    # verify exits 0 on unknown keys and bad values but warns: no output is the pass
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr
    # the check has teeth: a bad value is reported
    unit.write_text(unit.read_text().replace("Type=notify", "Type=notifyy"))
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert "notifyy" in p.stdout + p.stderr


def test_capabilities_are_justified_in_docs():
    doc = (REPO / "docs" / "deploy.md").read_text()
    for cap in NEEDED_CAPS | {"SYS_ADMIN"}:
        assert f"CAP_{cap}" in doc, cap
    for word in ("hostPID", "hostNetwork", "/sys/kernel/tracing", "/lib/modules", "/usr/src"):
        assert word in doc
