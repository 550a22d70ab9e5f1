"""End to end with the real binaries: the exporter (real uprobes) on a
simulated 8-rank training job with a lossy link and a straggler, a real
Prometheus scraping it every second with a short-interval copy of
alerts/*.yml, a real Alertmanager, and a webhook receiver in this test.

Asserts that the expected alerts reach the webhook with the right labels,
that every PromQL expression of every dashboard evaluates against that
Prometheus and returns data, and that every template variable has values.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from exporter.records import metrics
from conftest import ExporterProcess, free_port
from conftest import check_promql
from tests.test_dashboards import DASHBOARDS, dashboard_queries, empty_variables, instant_targets

from conftest import REPO
PROMETHEUS = "/usr/bin/prometheus"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"

NRANKS = 8
LOSSY_RANK = 2          # packet loss on this rank's link: enough RTOs for the p99 alert
LOSS_PERCENT = 5
STRAGGLER_RANK = 5      # computes 40 ms longer before every collective
STRAGGLER_DELAY_MS = 40
COMPUTE_MS = 5
TIME_SCALE = 20         # windows and `for:` of the rules divided by this (5m -> 15s)
ALERT_TIMEOUT_S = 120   # from the job's start

# Dashboard expressions allowed to return no series in this run: the metric
# legitimately has none (nothing fails, nothing is reset while the job runs).
EMPTY_OK = {metrics.spec(n).name for n in (
    metrics.CALL_ERRORS,              # no NCCL call fails in this job
    metrics.TCP_RESETS,               # connections are reset, if at all, when the job ends
    metrics.TCP_RETRANSMIT_FAILURES,  # 3 % loss never makes a retransmission fail to send
    metrics.NETWORK_WAIT,             # the profiler plugin's proxy steps: this job runs without the plugin
)}
# Targets allowed to be empty: ops this workload does not call ("train" runs
# only ALL_REDUCE).
EMPTY_OK_TARGETS = {
    ("nccl-fleet-overview.json", "Bus bandwidth estimate (busbw)", "B"),  # ALL_GATHER|REDUCE_SCATTER
    ("nccl-fleet-overview.json", "Bus bandwidth estimate (busbw)", "C"),  # the other ops
    # ranks missing from a hung collective: none (tests/test_hang.py has a hang)
    ("nccl-fleet-overview.json", "Hang: ranks missing from a collective, and where every rank is", "A"),
    # node_exporter's infiniband collector: no node_exporter and no IB port here
    *(("nccl-network.json", "InfiniBand / RoCE ports of these nodes (node_exporter)", ref) for ref in "ABC"),
}
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("bpf", "netns", "prometheus"),  # markers, root and the heavy lock: conftest
    pytest.mark.skipif(not (os.access(PROMETHEUS, os.X_OK) and os.access(ALERTMANAGER, os.X_OK)),
                       reason="prometheus / prometheus-alertmanager not installed (make deps)"),
]


def _seconds(n: str, unit: str) -> int:
    return int(n) * {"s": 1, "m": 60, "h": 3600}[unit]


def short_rules(text: str, scale: int = TIME_SCALE) -> str:
    """alerts/*.yml with every range window and `for:` divided by `scale`
    (windows at least 4 s, `for:` at least 2 s); thresholds unchanged."""
    text = re.sub(r"\[(\d+)([smh])\]", lambda m: f"[{max(4, _seconds(*m.groups()) // scale)}s]", text)
    return re.sub(r"(\bfor: )(\d+)([smh])\b",
                  lambda m: f"{m.group(1)}{max(2, _seconds(m.group(2), m.group(3)) // scale)}s", text)


class Webhook:
    """Alertmanager webhook receiver: remembers every alert it is sent."""

    def __init__(self):
        self.alerts: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.lock:
                    outer.alerts.extend(json.loads(body).get("alerts", []))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def firing(self, name: str) -> list[dict]:
        with self.lock:
            return [a["labels"] for a in self.alerts
                    if a.get("status") == "firing" and a["labels"].get("alertname") == name]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def http_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {timeout} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen | None):
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def uniq(dicts: list[dict], keys: tuple[str, ...]) -> set[tuple]:
    return {tuple(d.get(k, "") for k in keys) for d in dicts}


@pytest.fixture(scope="module")
def run():
    """Runs the whole scenario once; the tests below assert on what it saw."""
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job

    work = Path(tempfile.mkdtemp(prefix="nccl-e2e-prom-"))
    # A private copy of the simulated library: uprobes belong to the file, so
    # only this test's job is traced, not other tests using build/sim.
    lib = build_library(work / "lib")
    cleanup_stale()
    hook = Webhook()
    exporter = am = prom = None
    seen: dict = {"t0": time.monotonic()}
    try:
        exporter = ExporterProcess(nccl_libs=[lib], startup_timeout=180)
        exporter.__enter__()
        seen["exporter_ready_s"] = time.monotonic() - seen["t0"]

        rules = work / "rules"
        rules.mkdir()
        for f in sorted((REPO / "alerts").glob("*.yml")):
            (rules / f.name).write_text(short_rules(f.read_text()))
        am_port, prom_port = free_port(), free_port()
        (work / "am.yml").write_text(json.dumps({
            "route": {"receiver": "test", "group_by": ["..."], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1m"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": hook.url, "send_resolved": True}]}],
        }))
        (work / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules / "*.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "nccl-exporter",
                                "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        }))
        am_log, prom_log = work / "alertmanager.log", work / "prometheus.log"
        am = subprocess.Popen(
            [ALERTMANAGER, f"--config.file={work / 'am.yml'}", f"--storage.path={work / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            stdout=open(am_log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=open(prom_log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_ready(f"http://127.0.0.1:{am_port}/-/ready", am, am_log)
        wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", prom, prom_log)
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        with Cluster(NRANKS) as cluster:
            cluster.set_loss(LOSSY_RANK, LOSS_PERCENT)
            delays = {r: COMPUTE_MS for r in range(NRANKS)}
            delays[STRAGGLER_RANK] += STRAGGLER_DELAY_MS
            job = start_job(cluster, lib, "train", iterations=10_000_000, rendezvous_dir=work / "rdv",
                            truth_dir=work / "truth", count=65536, compute_delay_ms=delays,
                            extra_env={"NCCL_SIM_DURATION_S": str(ALERT_TIMEOUT_S + 60)})
            job_t0 = time.monotonic()
            families: set[str] = set()
            comm_info: list[dict] = []
            while time.monotonic() - job_t0 < ALERT_TIMEOUT_S:
                if any(rc not in (None, 0) for rc in job.poll()):
                    pytest.fail("the simulated job failed:\n" + job.result().summary())
                fams = exporter.scrape()
                families |= {smp.name for f in fams for smp in f.samples}
                info = ExporterProcess.samples(fams, metrics.COMMUNICATOR_INFO)
                if info:
                    comm_info = [s.labels for s in info]
                world = {c["comm"] for c in comm_info if c["nranks"] == str(NRANKS)}
                got_p99 = any(a["comm"] in world for a in hook.firing("NcclAllReduceP99High"))
                got_straggler = bool(hook.firing("NcclStragglerRank"))
                got_tcp = bool(hook.firing("NcclTcpRetransmits"))
                if got_p99 and got_straggler and got_tcp:
                    break
                time.sleep(1)
            seen["alerts_after_s"] = time.monotonic() - job_t0
            time.sleep(3)  # let alerts of the same evaluation arrive too
            seen["families"] = families | {smp.name for f in exporter.scrape() for smp in f.samples}
            seen["comm_info"] = comm_info
            # Every dashboard expression, while the job still runs, as Grafana runs it: an
            # instant query where the target says so, else a range query (here the last
            # minute; a gauge such as the oldest call in flight need not have a series at
            # one instant).
            queries, instant, now = [], instant_targets(), time.time()
            for dash, title, ref, expr in dashboard_queries(rate_interval="15s"):
                if (dash, title, ref) in instant:
                    url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
                else:
                    url = f"{api}/query_range?" + urllib.parse.urlencode(
                        {"query": expr, "start": now - 60, "end": now, "step": 5})
                try:
                    r = http_json(url)
                    queries.append((dash, title, ref, expr, r.get("status"), r["data"]["result"], None))
                except urllib.error.HTTPError as e:
                    queries.append((dash, title, ref, expr, "error", [], e.read().decode()[:500]))
            seen["queries"] = queries
            # Every template variable's query, as Grafana sends it (earlier variables at All)
            seen["empty_variables"] = empty_variables(DASHBOARDS, lambda selector, label: http_json(
                f"{api}/label/{label}/values?" + urllib.parse.urlencode(
                    {"match[]": selector, "start": now - 60, "end": now}))["data"])
            seen["rule_health"] = [
                (r["name"], r.get("health"), r.get("lastError", ""))
                for g in http_json(f"{api}/rules")["data"]["groups"] for r in g["rules"]]
            job.kill()
        seen["alerts"] = list(hook.alerts)
        seen["elapsed_s"] = time.monotonic() - seen["t0"]
        yield seen
    finally:
        stop(prom)
        stop(am)
        if exporter is not None:
            exporter.__exit__(None, None, None)
        hook.close()
        shutil.rmtree(work, ignore_errors=True)


def firing(run, name: str) -> list[dict]:
    return [a["labels"] for a in run["alerts"]
            if a.get("status") == "firing" and a["labels"]["alertname"] == name]


def world_comm(run) -> str:
    (world,) = {c["comm"] for c in run["comm_info"] if c["nranks"] == str(NRANKS)}
    return world


def pid_of(run, comm: str, rank: str) -> str:
    (pid,) = {c["pid"] for c in run["comm_info"] if c["comm"] == comm and c["rank"] == rank}
    return pid


def test_rules_are_healthy(run):
    bad = [r for r in run["rule_health"] if r[1] != "ok"]
    assert not bad, bad


def test_p99_alert_for_the_slowed_communicator(run):
    alerts = firing(run, "NcclAllReduceP99High")
    print(f"NcclAllReduceP99High: {sorted(uniq(alerts, ('comm', 'clock')))}")
    assert world_comm(run) in {a["comm"] for a in alerts}, alerts


def test_straggler_alert_names_the_delayed_rank_only(run):
    alerts = firing(run, "NcclStragglerRank")
    print(f"NcclStragglerRank: {sorted(uniq(alerts, ('comm', 'rank', 'node', 'op')))}")
    world = world_comm(run)
    assert (world, str(STRAGGLER_RANK)) in uniq(alerts, ("comm", "rank")), alerts
    # In the split communicator the same process has another rank: compare processes.
    straggler_pid = pid_of(run, world, str(STRAGGLER_RANK))
    for a in alerts:
        assert pid_of(run, a["comm"], a["rank"]) == straggler_pid, f"another rank named a straggler: {a}"


def test_retransmit_alert_names_the_lossy_link_and_rank_only(run):
    assert metrics.TCP_RETRANSMITS in run["families"], "the exporter exports no retransmits"
    lossy_addr = f"198.18.0.{LOSSY_RANK + 1}"
    alerts = firing(run, "NcclTcpRetransmits")
    print(f"NcclTcpRetransmits: {sorted(uniq(alerts, ('saddr', 'daddr', 'rank', 'node')))}")
    assert alerts, "no retransmit alert"
    # Both directions of the lossy link may alert: data the lossy host sends
    # (its sockets: rank LOSSY_RANK) and data sent to it (the peer's socket,
    # the peer's rank). The wire loses both ways: which crosses the threshold
    # first depends on timing.
    assert any(lossy_addr in (a["saddr"], a["daddr"]) for a in alerts), alerts
    owner = {f"198.18.0.{r + 1}": str(r) for r in range(NRANKS)}
    for a in alerts:
        assert a["rank"] == owner[a["saddr"]], f"retransmits attributed to another rank than the sender's: {a}"
    # Links into the straggler retransmit too, with no loss at all: it reads
    # its sockets 40 ms late, its kernel delays the ACKs, and the senders'
    # tail-loss probes fire (nstat in the namespaces: TcpExtTCPLossProbes ==
    # TcpRetransSegs on a loss-free run with a straggler). Any other link
    # alerting would be a false alert.
    straggler_addr = f"198.18.0.{STRAGGLER_RANK + 1}"
    for a in alerts:
        assert lossy_addr in (a["saddr"], a["daddr"]) or a["daddr"] == straggler_addr, \
            f"retransmit alert on a link with neither loss nor a late reader: {a}"


def test_no_false_alerts(run):
    for name in ("NcclCollectiveHung", "NcclRankDesync", "NcclCallErrors", "NcclExporterDown",
                 "NcclExporterAbsent", "NcclExporterEventsLost", "NcclExporterMapFull"):
        assert not firing(run, name), (name, firing(run, name))


def test_every_dashboard_expression_evaluates_and_returns_data(run):
    errors, empty = [], []
    for dash, title, ref, expr, status, result, err in run["queries"]:
        if status != "success":
            errors.append(f"{dash} / {title} / {ref}: {err}")
            continue
        if result:
            continue
        names = check_promql(expr, f"{dash} / {title}")
        if not names & EMPTY_OK and (dash, title, ref) not in EMPTY_OK_TARGETS:
            empty.append(f"{dash} / {title} / {ref}: {expr}")
    assert not errors, "\n".join(errors)
    assert not empty, "no data:\n" + "\n".join(empty)
    # The kernel-side families are all there (the panels above read them).
    for m in (metrics.TCP_RETRANSMITS, metrics.RUNQUEUE_DELAY + "_bucket", metrics.TCP_SRTT + "_bucket",
              metrics.OFFCPU):
        assert m in run["families"], f"{m} is not exported"


def test_every_dashboard_variable_has_values(run):
    """A dropdown of the live job is never empty (only namespace and pod, which
    processes outside a pod do not have)."""
    assert not run["empty_variables"], "no values:\n" + "\n".join(run["empty_variables"])


def test_runtime(run):
    print(f"exporter ready after {run['exporter_ready_s']:.0f} s, alerts {run['alerts_after_s']:.0f} s "
          f"after the job started, whole scenario {run['elapsed_s']:.0f} s")
    assert run["elapsed_s"] < 240
