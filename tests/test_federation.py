"""deploy/federation/: two real Prometheus servers on loopback.

The first scrapes a small static /metrics page (nccl_* series and one other);
the second runs deploy/federation/prometheus-federate.yml (targets and
intervals shortened) and must receive the nccl_* series, with the agents'
labels, and nothing else. The remote-write example passes promtool.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import free_port, serve_text

from conftest import REPO
FED = REPO / "deploy" / "federation"
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"

pytestmark = [pytest.mark.usefixtures("prometheus"), pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK),
                                                         reason=f"{PROMETHEUS} not installed (make deps)")]

PAGE = """\
# HELP nccl_calls_total NCCL calls.
# TYPE nccl_calls_total counter
nccl_calls_total{node="gpu-017",op="ALL_REDUCE",comm="3f00aa",rank="5"} 1234
nccl_calls_total{node="gpu-017",op="ALL_REDUCE",comm="3f00aa",rank="4"} 1230
# HELP nccl_inflight_oldest_seconds Oldest call in flight.
# TYPE nccl_inflight_oldest_seconds gauge
nccl_inflight_oldest_seconds{node="gpu-017",op="ALL_REDUCE",comm="3f00aa",rank="5"} 0.25
# HELP process_open_fds Not an NCCL series.
# TYPE process_open_fds gauge
process_open_fds 17
"""


def start_prometheus(work: Path, name: str, config: dict, port: int) -> subprocess.Popen:
    cfg = work / f"{name}.yml"
    cfg.write_text(yaml.safe_dump(config))
    log = open(work / f"{name}.log", "wb")
    return subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={work / name}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def get_json(url: str, timeout: float = 2):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    return get_json(url)["data"]["result"]


def wait_for(what, check, procs, work, timeout):
    deadline = time.monotonic() + timeout
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited: {(work / f'{name}.log').read_text()[-2000:]}")
        try:
            got = check()
            if got:
                return got
        except OSError:
            pass
        if time.monotonic() > deadline:
            logs = "\n".join((work / f"{n}.log").read_text()[-1500:] for n in procs)
            raise AssertionError(f"{what} within {timeout} s\n{logs}")
        time.sleep(0.5)


def test_a_global_prometheus_federates_the_nccl_series(tmp_path):
    page = serve_text(PAGE)
    a_port, b_port = free_port(), free_port()
    rack = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "external_labels": {"cluster": "rack-01"}},
            "scrape_configs": [{"job_name": "nccl-exporter", "scrape_interval": "1s", "scrape_timeout": "1s",
                                "static_configs": [{"targets": [f"127.0.0.1:{page.server_address[1]}"]}]}]}
    fed = yaml.safe_load((FED / "prometheus-federate.yml").read_text())
    fed["global"].update(scrape_interval="1s", evaluation_interval="1s")
    job = fed["scrape_configs"][0]
    assert job["params"]["match[]"] == ['{__name__=~"nccl_.*"}'] and job["honor_labels"] is True
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["static_configs"] = [{"targets": [f"127.0.0.1:{a_port}"]}]
    procs = {}
    try:
        procs["rack"] = start_prometheus(tmp_path, "rack", rack, a_port)
        procs["global"] = start_prometheus(tmp_path, "global", fed, b_port)
        t0 = time.monotonic()
        got = wait_for("the global Prometheus has nccl_calls_total",
                       lambda: query(b_port, "nccl_calls_total"), procs, tmp_path, 45)
        waited = time.monotonic() - t0
        wait_for("and the gauge", lambda: query(b_port, "nccl_inflight_oldest_seconds"), procs, tmp_path, 10)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        page.shutdown()
    series = {(s["metric"]["rank"], s["value"][1]) for s in got}
    assert series == {("5", "1234"), ("4", "1230")}
    m = got[0]["metric"]
    # honor_labels: the agents' labels and the rack's external label arrive unchanged
    assert m["node"] == "gpu-017" and m["job"] == "nccl-exporter" and m["cluster"] == "rack-01"
    print(f"\nfederated series arrived {waited:.1f} s after start")


def test_the_global_prometheus_gets_nothing_else(tmp_path):
    """The federate endpoint answers only the match[]: process_open_fds stays home."""
    page = serve_text(PAGE)
    port = free_port()
    rack = {"global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "nccl-exporter", "scrape_interval": "1s", "scrape_timeout": "1s",
                                "static_configs": [{"targets": [f"127.0.0.1:{page.server_address[1]}"]}]}]}
    match = yaml.safe_load((FED / "prometheus-federate.yml").read_text())["scrape_configs"][0]["params"]["match[]"]
    procs = {"rack": start_prometheus(tmp_path, "rack", rack, port)}
    try:
        url = f"http://127.0.0.1:{port}/federate?" + urllib.parse.urlencode([("match[]", m) for m in match])

        def federated():
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode()
            return text if "nccl_calls_total" in text else None

        text = wait_for("the rack Prometheus federates nccl_*", federated, procs, tmp_path, 30)
    finally:
        procs["rack"].terminate()
        procs["rack"].wait(10)
        page.shutdown()
    assert "nccl_inflight_oldest_seconds" in text
    assert "process_open_fds" not in text


@pytest.mark.skipif(not os.access(PROMTOOL, os.X_OK), reason=f"{PROMTOOL} not installed")
def test_the_examples_pass_promtool():
    for name in ("prometheus-federate.yml", "prometheus-remote-write.yml"):
        r = subprocess.run([PROMTOOL, "check", "config", str(FED / name)], capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stdout, r.stderr)
