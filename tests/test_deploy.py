"""deploy/: the systemd unit, the Kubernetes manifests, and the PrometheusRule
generated from alerts/ (which must equal alerts/ exactly)."""

from __future__ import annotations

import shutil
import subprocess
import re
import sys
from pathlib import Path

import pytest

from exporter import __version__
from exporter.agent.preflight import CAPABILITIES
from tests.test_alerts import load_yaml
from tests.test_image_definition import makefile_image

from conftest import REPO
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
# The one list (exporter/agent/preflight.py, measured: docs/deploy.md).
NEEDED_CAPS = set(CAPABILITIES)
FIRST_RELEASE = "0.1.0"  # the manifests' tag until a vX.Y.Z tag exists (CHANGELOG.md: none yet)


def released_version() -> str:
    """The image tag the manifests name: the newest release tag (vX.Y.Z)
    reachable from this checkout, else FIRST_RELEASE. Between tags the
    package's version (__version__, from setuptools-scm) is a dev version,
    X.Y.Z.devN+g<commit>, which names no published image."""
    if re.fullmatch(r"\d+\.\d+\.\d+", __version__):
        return __version__  # built at a release tag
    if shutil.which("git") is None:
        return FIRST_RELEASE  # a copy without git (its version came from .git_archival.txt)
    p = subprocess.run(["git", "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*"], cwd=str(REPO),
                       capture_output=True, text=True)
    return p.stdout.strip()[1:] if p.returncode == 0 and p.stdout.strip() else FIRST_RELEASE


VERSION = released_version()


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
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, "measured: docs/deploy.md"
    # the image, tagged with this version; the init container from the same image
    assert c["image"] == f"{makefile_image()}:{VERSION}", "the published image: the base deploys as shipped"
    (init,) = spec["initContainers"]
    assert init["image"] == c["image"]
    capabilities = init["securityContext"]["capabilities"]
    assert capabilities["drop"] == ["ALL"] and "add" not in capabilities
    script = " ".join(init["command"])
    assert "/opt/nccl-exporter/plugin/libnccl-profiler-exporter.so" in script
    assert "mv -f" in script and script.rstrip().endswith("/host/opt/nccl-exporter/libnccl-profiler-exporter.so")
    (plugin_mount,) = init["volumeMounts"]
    plugin_volume = {v["name"]: v for v in spec["volumes"]}[plugin_mount["name"]]
    assert plugin_mount["mountPath"] == "/host/opt/nccl-exporter"
    assert plugin_volume["hostPath"] == {"path": "/opt/nccl-exporter", "type": "DirectoryOrCreate"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug", "/sys/fs/bpf", "/lib/modules", "/usr/src"):
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
    # the pod labels of nccl_communicator_info are the traced process's, not the target's
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert svc["metadata"]["namespace"] in scraped_namespaces(sm)


def scraped_namespaces(sm: dict) -> list[str]:
    """Where the Prometheus Operator looks for a ServiceMonitor's Services:
    namespaceSelector.matchNames, else (no selector, or an empty one) the
    ServiceMonitor's own namespace. `any: true` is not used here."""
    sel = sm["spec"].get("namespaceSelector") or {}
    assert not sel.get("any"), "scrape every namespace: not what the manifests mean"
    return sel.get("matchNames") or [sm["metadata"]["namespace"]]


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


def test_capabilities_are_the_same_everywhere():
    """One list: the DaemonSet and the unit (above), --help, README, docs."""
    from exporter.cli import EPILOG

    caps = ", ".join(f"CAP_{c}" for c in CAPABILITIES)
    assert caps in " ".join(EPILOG.split())
    run_help = subprocess.run([sys.executable, "-m", "exporter", "run", "--help"], capture_output=True,
                              text=True, cwd=REPO).stdout
    assert caps in " ".join(run_help.split())
    readme = " ".join((REPO / "README.md").read_text().split())
    assert caps in readme
    doc = (REPO / "docs" / "deploy.md").read_text()
    table = [line for line in doc.splitlines() if line.startswith("| `CAP_")]
    assert [line.split("`")[1] for line in table] == [f"CAP_{c}" for c in CAPABILITIES]


def test_capabilities_are_justified_in_docs():
    doc = (REPO / "docs" / "deploy.md").read_text()
    for cap in NEEDED_CAPS | {"SYS_ADMIN", "BPF", "PERFMON", "SYS_RESOURCE"}:
        assert f"CAP_{cap}" in doc, cap
    for word in ("hostPID", "hostNetwork", "/sys/kernel/tracing", "/lib/modules", "/usr/src"):
        assert word in doc


# --- kustomize: the base and the example overlay, rendered by kubectl ----------------------

def kustomize(path: Path) -> list[dict]:
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl missing: make deps installs Debian's kubernetes-client")
    p = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    out = {}
    for d in docs:
        assert d["kind"] not in out, f"two {d['kind']}s"
        out[d["kind"]] = d
    return out


def test_kustomize_base_is_the_manifests():
    docs = by_kind(kustomize(K8S))
    assert set(docs) == {"Namespace", "DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"}
    assert docs["DaemonSet"] == load_yaml(K8S / "daemonset.yaml")
    assert docs["PrometheusRule"]["spec"] == load_yaml(K8S / "prometheusrule.yaml")["spec"]


def test_kustomize_overlay_templates_image_resources_nodes_and_operator():
    """deploy/overlays/gpu-cluster: what a cluster changes, changed."""
    docs = by_kind(kustomize(DEPLOY / "overlays" / "gpu-cluster"))
    assert {"Namespace", "DaemonSet", "Service", "ServiceMonitor", "PrometheusRule", "ServiceAccount", "ClusterRole",
            "ClusterRoleBinding"} == set(docs)
    spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    (init,) = spec["initContainers"]
    image = f"registry.example.com/ml-infra/nccl-exporter:{VERSION}"
    assert c["image"] == image and init["image"] == image
    assert c["resources"] == {"requests": {"cpu": "200m", "memory": "384Mi"}, "limits": {"memory": "1536Mi"}}
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true"}
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
    # the security context and mounts survive the patch
    base = load_yaml(K8S / "daemonset.yaml")["spec"]["template"]["spec"]["containers"][0]
    assert c["securityContext"] == base["securityContext"] and c["volumeMounts"] == base["volumeMounts"]
    # pod names from the kubelet: the flags, and a service account allowed nodes/proxy
    args = c["args"]
    assert args[args.index("--kubelet-url") + 1] == "https://$(NODE_IP):10250"
    assert spec["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    assert docs["ClusterRole"]["rules"] == [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert docs[kind]["metadata"]["labels"]["release"] == "prometheus"
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["honorLabels"] is True


def kustomize_version() -> tuple[int, ...]:
    """The kustomize inside kubectl (kubectl >= 1.21 prints it; 1.20's is v2.0.3)."""
    import re

    out = subprocess.run([shutil.which("kubectl") or "kubectl", "version", "--client"], capture_output=True,
                         text=True).stdout
    m = re.search(r"Kustomize Version: v(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (2, 0)


def overlay_in(tmp_path: Path, base: Path, namespace: str) -> Path:
    """A user's overlay: `base` moved into `namespace` by kustomize's transform."""
    import os

    d = tmp_path / f"overlay-{namespace}"
    d.mkdir()
    (d / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"namespace: {namespace}\nresources:\n  - {os.path.relpath(base, d)}\n")
    return d


# (what is rendered, the namespace everything must be in)
RENDERINGS = {
    "base": (lambda tmp: K8S, "nccl-exporter"),
    "gpu-cluster": (lambda tmp: DEPLOY / "overlays" / "gpu-cluster", "nccl-exporter"),
    "native-histograms": (lambda tmp: DEPLOY / "overlays" / "native-histograms", "nccl-exporter"),
    "base in another namespace": (lambda tmp: overlay_in(tmp, K8S, "ml-observability"), "ml-observability"),
    "gpu-cluster in another namespace": (
        lambda tmp: overlay_in(tmp, DEPLOY / "overlays" / "gpu-cluster", "gpu-monitoring"), "gpu-monitoring"),
}


@pytest.mark.parametrize("rendering", list(RENDERINGS))
def test_kustomize_deploys_into_one_privileged_namespace(tmp_path, rendering):
    """`kubectl apply -k` on a stock cluster with the Prometheus Operator
    (docs/deploy.md, "Kustomize"): the Namespace comes with it, labelled for
    Pod Security Admission's `privileged` level (the agent's hostPID, hostPath
    and CAP_SYS_ADMIN), every object is in it, the ServiceMonitor scrapes the
    Service where it is, and the ServiceMonitor and the PrometheusRule carry
    the same `release` label (what the Operator's selectors match)."""
    path_of, namespace = RENDERINGS[rendering]
    if "another namespace" in rendering and kustomize_version() < (4, 0):
        pytest.skip("kustomize < 4 (kubectl 1.20) does not rename a Namespace object; docs/deploy.md")
    docs = by_kind(kustomize(path_of(tmp_path)))
    ns = docs["Namespace"]
    assert ns["metadata"]["name"] == namespace
    labels = ns["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "privileged", mode
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for kind, d in docs.items():
        if kind not in cluster_scoped:
            assert d["metadata"].get("namespace") == namespace, kind
    if "ClusterRoleBinding" in docs:
        for s in docs["ClusterRoleBinding"]["subjects"]:
            assert s["namespace"] == namespace and s["name"] == docs["ServiceAccount"]["metadata"]["name"]
    sm, svc = docs["ServiceMonitor"], docs["Service"]
    assert svc["metadata"]["namespace"] in scraped_namespaces(sm)
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    release = sm["metadata"]["labels"].get("release")
    assert release and docs["PrometheusRule"]["metadata"]["labels"].get("release") == release


def test_native_histogram_rules_variant():
    """deploy/overlays/native-histograms: the base with the groups of
    alerts/native/ instead of alerts/ (docs/alerts.md), nothing else changed."""
    native = by_kind(kustomize(DEPLOY / "overlays" / "native-histograms"))
    base = by_kind(kustomize(K8S))
    groups = [g for f in sorted((REPO / "alerts" / "native").glob("*.yml")) for g in load_yaml(f)["groups"]]
    assert native["PrometheusRule"]["spec"]["groups"] == groups
    assert native["PrometheusRule"]["spec"] != base["PrometheusRule"]["spec"]
    assert native["PrometheusRule"]["metadata"] == base["PrometheusRule"]["metadata"]
    assert {k: v for k, v in native.items() if k != "PrometheusRule"} == \
        {k: v for k, v in base.items() if k != "PrometheusRule"}


def test_manifests_point_only_at_files_that_exist():
    """Every deploy/... path a manifest's comment names exists."""
    import re

    for f in sorted(DEPLOY.rglob("*.yaml")):
        for ref in re.findall(r"(?<![\w/.])((?:deploy/)?overlays/[\w.-]+|deploy/[\w./-]+)", f.read_text()):
            ref = ref.rstrip(".")
            path = REPO / ref if ref.startswith("deploy/") else DEPLOY / ref
            assert path.exists(), f"{f.relative_to(REPO)} names {ref}, which does not exist"
