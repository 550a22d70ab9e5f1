"""Straggler analysis, the verdict and the data-based clock skew, on REAL recordings.

Each scenario is a 4-rank simulated job (exporter/simulator) recorded by
`nccl-exporter trace --db` (real BPF), one module-scoped fixture each:

- sleeping: rank 2 computes 30 ms longer before every collective;
- lossy:    5 % packet loss on rank 3's link, both ways (everyone slow alike);
- lossy_into: the same, only on the way into rank 3's host;
- starved:  ranks pinned (0, 2, 3 on CPU 0; 1 on CPU 1) and a SCHED_FIFO hog
            on CPU 1 (as tests/test_sched.py does): rank 1 starves;
- starved_totals: the same, recorded with `--sched totals` (run's default:
            each thread's waits per second from /proc, no per-call wait);
- healthy:  nothing wrong;
- late_onset: rank 2 SIGSTOPped 40 ms of every 100 ms from ONSET_S into the
            job on (bench/faults' compute straggler): its peers send
            tail-loss probes into it, and it is last in too few of the
            recording's collectives for the late-arriver test.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import pin

from conftest import REPO
from exporter.sinks.recording.read import Recording

NRANKS = 4
SLEEPER, LOSSY, STARVED = 2, 3, 1
JOB_S = 8
# late_onset, as bench/faults' straggler runs: every rank computes 20 ms before each collective of 16384
# floats; the stops start ONSET_S into a LATE_JOB_S job (a minority of its collectives)
ONSET_S, LATE_JOB_S = 9.0, 16

needs_root = pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: conftest


# --- making real recordings -------------------------------------------------------

def record_scenario(tmp: pathlib.Path, scenario: str, node: str = "simnode") -> pathlib.Path:
    """Run one scenario's job under a `trace --db` recorder; returns the .db. A scenario
    named X_totals is X recorded with --sched totals."""
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, start_job

    tmp = pathlib.Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    lib = build_library()
    db = tmp / f"{scenario}.db"
    log = open(tmp / f"{scenario}.log", "w+")
    sched = "totals" if scenario.endswith("_totals") else "waits"
    scenario = scenario.removesuffix("_totals")
    rec = subprocess.Popen([sys.executable, "-m", "exporter", "trace", "--db", str(db), "--node", node,
                            "--nccl-lib", str(lib), "--sched", sched], stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, cwd=REPO)
    hog = cycle = None
    try:
        deadline = time.monotonic() + 120
        while "also loaded:" not in pathlib.Path(log.name).read_text():
            assert rec.poll() is None, pathlib.Path(log.name).read_text()
            assert time.monotonic() < deadline, "recorder did not start"
            time.sleep(0.2)
        with Cluster(NRANKS) as cluster:
            if scenario in ("lossy", "lossy_into"):
                cluster.set_loss(LOSSY, 5, into_only=scenario == "lossy_into")
            job = start_job(cluster, lib, "train", iterations=10**9, rendezvous_dir=tmp / f"rdv-{scenario}",
                            truth_dir=tmp / f"truth-{scenario}",
                            count=16384 if scenario == "late_onset" else 64 * 1024,
                            compute_delay_ms={SLEEPER: 30} if scenario == "sleeping" else
                            {r: 20 for r in range(NRANKS)} if scenario == "late_onset" else None,
                            extra_env={"NCCL_SIM_DURATION_S": str(LATE_JOB_S if scenario == "late_onset"
                                                                  else JOB_S)})
            try:
                if scenario == "starved":
                    cpu_of = {r: (1 if r == STARVED else 0) for r in range(NRANKS)}
                    until = time.monotonic() + 2.0
                    while time.monotonic() < until:  # threads made since are pinned too
                        for rank, pid in enumerate(job.pids):
                            pin(pid, cpu_of[rank])
                        time.sleep(0.3)
                    hog = subprocess.Popen(["taskset", "-c", "1", "chrt", "-f", "1",
                                            sys.executable, "-c", "while True: pass"])
                if scenario == "late_onset":
                    from bench.faults.base import DutyCycle
                    time.sleep(ONSET_S)
                    cycle = DutyCycle([job.pids[SLEEPER]], 0.04, 0.1).start()
                result = job.wait(timeout=120)
                assert result.ok, result.summary()
            finally:
                if cycle is not None:
                    cycle.stop()
                if hog is not None:
                    hog.kill()
                    hog.wait()
                job.kill()
        time.sleep(1.0)  # the last events reach the ring buffers
        rec.send_signal(signal.SIGTERM)
        assert rec.wait(60) == 0, pathlib.Path(log.name).read_text()
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    return db


def split_by_rank(src, outdir, shift_ns: dict[int, int], combined: str | None = None) -> list[pathlib.Path]:
    """Split a one-node recording into one recording per rank, as if each rank ran on its own
    node `node<R>` whose clock is `shift_ns[R]` ahead: every timestamp of that rank's rows
    (nccl/tcp/sched events, processes, communicators) is shifted. With `combined`, also one file
    holding every node (what `merge` of the parts gives). Returns the per-node files."""
    from exporter.sinks.recording.schema import migrate

    outdir = pathlib.Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    src_conn = sqlite3.connect(src)
    rank_of = dict(src_conn.execute("SELECT pid, launcher_rank FROM processes"))
    targets = []
    for rank in sorted(set(rank_of.values())):
        targets.append((outdir / f"node{rank}.db", {rank}))
    if combined:
        targets.append((outdir / combined, set(rank_of.values())))
    tables = {t: [r[1] for r in src_conn.execute(f"PRAGMA table_info({t})")]
              for t in ("nccl_events", "tcp_events", "sched_events", "processes", "communicators")}
    time_col = {"processes": "first_seen_ns", "communicators": "first_seen_ns"}
    for path, ranks in targets:
        if path.exists():
            path.unlink()
        conn = sqlite3.connect(path)
        migrate(conn)
        with conn:
            for table, cols in tables.items():
                tcol = time_col.get(table, "timestamp_ns")
                ti, ni, pi = cols.index(tcol), cols.index("node"), cols.index("pid")
                rows = []
                for row in src_conn.execute(f"SELECT {', '.join(cols)} FROM {table}"):
                    rank = rank_of.get(row[pi])
                    if rank not in ranks:
                        continue
                    row = list(row)
                    row[ni] = f"node{rank}"
                    if row[ti] is not None:
                        row[ti] += shift_ns.get(rank, 0)
                    rows.append(row)
                conn.executemany(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                                 rows)
            meta = dict(src_conn.execute("SELECT key, value FROM meta"))
            if len(ranks) == 1:
                (rank,) = ranks
                meta.update(node=f"node{rank}", machine_id=f"machine{rank}", boot_id=f"boot{rank}")
            conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())
        conn.close()
    src_conn.close()
    return [t[0] for t in targets if len(t[1]) == 1]


if __name__ == "__main__":  # development: record the scenarios into a directory
    for name in sys.argv[2:]:
        print(record_scenario(pathlib.Path(sys.argv[1]), name), flush=True)


# --- the scenarios ----------------------------------------------------------------------

def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def _explain(db, *extra) -> dict:
    p = _cli("explain", db, "--format", "json", *extra)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert 3 <= len(out["evidence"]) <= 5, out
    return out


def _fixture(name):
    @pytest.fixture(scope="module")
    def rec(tmp_path_factory):
        return record_scenario(tmp_path_factory.mktemp(name), name)
    return rec


sleeping = _fixture("sleeping")
lossy = _fixture("lossy")
lossy_into = _fixture("lossy_into")
starved = _fixture("starved")
starved_totals = _fixture("starved_totals")
healthy = _fixture("healthy")
late_onset = _fixture("late_onset")


def _addr(rank: int) -> str:
    from exporter.simulator.cluster import Cluster

    return Cluster(NRANKS).hosts[rank].addr  # addresses are a function of the host index


@needs_root
def test_sleeping_straggler_is_named_with_its_lag(sleeping):
    out = _explain(sleeping)
    v = out["verdict"]
    assert v.startswith(f"straggler: rank {SLEEPER} on simnode arrives late"), out
    assert "busy before the call" in v, out  # not CPU, not network
    # the per-rank table: the sleeper is last almost always on the world communicator, ~30 ms late
    p = _cli("stragglers", sleeping, "--format", "json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    world = [r for r in rows if sum(1 for x in rows if x["comm"] == r["comm"]) == NRANKS]
    top = max(world, key=lambda r: r["last_pct"])
    assert top["rank"] == SLEEPER and top["last_pct"] >= 90, world
    assert 20 <= top["median_lag_ms"] <= 200, top
    assert top["retransmits_when_last"] <= 0.5 * top["last"], top


@needs_root
def test_lossy_link_is_named_with_its_rank(lossy):
    out = _explain(lossy)
    v = out["verdict"]
    # The wire loses packets both ways on the lossy host's link: its peers retransmit what
    # they send it, it retransmits what it sends. The verdict names that host's link.
    assert v.startswith(f"network: no rank arrives late, collectives are slow alike; the link of "
                        f"{_addr(LOSSY)} (rank {LOSSY}), both ways"), out
    links = [part.split(" ", 2)[1] for part in out["evidence"][0].split("; ") if part.startswith("link ")]
    assert len(links) >= 2 and all(_addr(LOSSY) in link.split("\u2192") for link in links), out
    assert {link.split("\u2192").index(_addr(LOSSY)) for link in links} == {0, 1}, out  # into and out of it


@needs_root
def test_one_lossy_direction_is_named_as_its_link(lossy_into):
    """Loss only into rank 3's host: the peer sending it the ring's data retransmits, one
    directed link stands out, named with the ranks at its ends and its socket's owner."""
    v = _explain(lossy_into)["verdict"]
    assert v.startswith("network: no rank arrives late, collectives are slow alike; link "), v
    link = v.split("; link ", 1)[1].split(" ", 1)[0]
    src, dst = link.split("\u2192")
    assert dst == _addr(LOSSY) and f"(rank {int(src.rsplit('.', 1)[1]) - 1} \u2192 rank {LOSSY})" in v, v
    assert "its socket owned by rank" in v, v


@needs_root
def test_a_late_rank_whose_peers_retransmit_to_it_is_named_not_its_link(late_onset):
    """Rank 2 stopped 40 ms of every 100 ms from ONSET_S on: its ring predecessor's socket
    retransmits into it (probes of a late reader: nothing is lost) and it is last in too few of
    the recording's collectives for check 1. explain names the rank, not the link into it (the
    link was its verdict before it looked at who was late where the retransmits were)."""
    conn = sqlite3.connect(late_onset)
    into = conn.execute("SELECT COUNT(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb' AND daddr = ?",
                        (_addr(SLEEPER),)).fetchone()[0]
    conn.close()
    if into < 20:  # explain's MIN_LINK_RETRANSMITS: no link verdict to avoid
        pytest.skip(f"only {into} retransmits into rank {SLEEPER}'s host in this run: the premise is not met")
    out = _explain(late_onset)
    v = out["verdict"]
    assert v.startswith(f"straggler: rank {SLEEPER} on simnode arrives late"), out
    assert "its peers retransmit to it" in v and "not a lossy link" in v, out


@needs_root
def test_cpu_starved_rank_is_named(starved):
    out = _explain(starved)
    v = out["verdict"]
    assert f"rank {STARVED} on simnode" in v and ("CPU starvation" in v or "starved of CPU" in v), out


@needs_root
def test_cpu_starved_rank_is_named_with_its_cause_from_per_second_totals(starved_totals):
    """run's default --sched totals records no wait per call, only each second's per thread kind
    (sched_intervals): enough to tell the starved rank's cause."""
    conn = sqlite3.connect(starved_totals)
    assert conn.execute("SELECT COUNT(*) FROM sched_events").fetchone()[0] == 0
    assert dict(conn.execute("SELECT key, value FROM meta"))["sched"] == "totals"
    rows = conn.execute("SELECT rank, SUM(runq_wait_ns) FROM sched_intervals WHERE thread IN ('caller', 'proxy') "
                        "GROUP BY rank ORDER BY 2 DESC").fetchall()
    assert rows and rows[0][0] == STARVED, rows
    out = _explain(starved_totals)
    v = out["verdict"]
    assert f"rank {STARVED} on simnode" in v and ("CPU starvation" in v or "starved of CPU" in v), out
    assert any("--sched totals" in e for e in out["evidence"]), out


@needs_root
def test_healthy_job_has_no_straggler(healthy):
    out = _explain(healthy)
    assert out["verdict"].startswith("no straggler"), out
    p = _cli("stragglers", healthy, "--collectives", "--op", "ALL_REDUCE", "--format", "csv")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("comm,op,seq,ranks,complete,first_arrival_ns,last_rank")


def _add_retransmits(src, dst, host: int, n: int) -> None:
    """Copy a recording and add n retransmits on host's links, alternately out of it (owned by
    its rank) and into it from its ring predecessor, each in the middle of one of the owner's
    ALL_REDUCE calls (spread over the job)."""
    import shutil

    shutil.copy(src, dst)
    conn = sqlite3.connect(dst)
    pid = dict(conn.execute("SELECT launcher_rank, pid FROM processes"))
    prev = (host - 1) % NRANKS
    for i in range(n):
        owner, saddr, daddr = ((host, _addr(host), _addr(0)) if i % 2 == 0 else
                               (prev, _addr(prev), _addr(host)))
        calls = conn.execute("SELECT timestamp_ns + duration_ns / 2 FROM nccl_events WHERE pid = ? AND "
                             "op = 'ALL_REDUCE' ORDER BY timestamp_ns", (pid[owner],)).fetchall()
        t = calls[(i * len(calls)) // n][0]
        conn.execute("INSERT INTO tcp_events (timestamp_ns, event, family, saddr, daddr, sport, dport, state, pid, "
                     "tid, rank, node) VALUES (?, 'tcp_retransmit_skb', 'ipv4', ?, ?, 40000, 50000, "
                     "'ESTABLISHED', ?, ?, ?, 'simnode')", (t, saddr, daddr, pid[owner], pid[owner], owner))
    conn.commit()
    conn.close()


@needs_root
def test_probes_gathered_on_one_host_are_not_a_lossy_link(healthy, tmp_path):
    """A healthy job's tail-loss probes once gathered on one host's links in CI (21, 68 % of all):
    explain named that host's link lossy. The count and share are no proof of loss; the rate is: the
    same healthy recording with 30 more retransmits on rank 3's links (under one per 20 collectives)
    stays healthy, with one per 3 collectives it is that host's link."""
    n = int(re.search(r"in the (\d+) collectives' windows", " ".join(_explain(healthy)["evidence"])).group(1))
    few, many = tmp_path / "few.db", tmp_path / "many.db"
    _add_retransmits(healthy, few, LOSSY, 30)
    assert 30 < n / 20, n  # the premise: 30 is under the rate bar
    out = _explain(few)
    assert out["verdict"].startswith("no straggler"), out
    assert any("tail-loss probes, not loss" in e for e in out["evidence"]), out
    _add_retransmits(healthy, many, LOSSY, n // 3)
    v = _explain(many)["verdict"]
    assert v.startswith("network:") and f"the link of {_addr(LOSSY)} (rank {LOSSY}), both ways" in v, v


SHIFT = {0: 0, 1: 50_000_000, 2: -50_000_000, 3: 20_000_000}


def _estimate(db, tmp_path):
    from exporter.offline.analysis import skew

    split_by_rank(db, tmp_path, SHIFT, combined="all.db")
    conn = sqlite3.connect(tmp_path / "all.db")
    try:
        return skew.estimate(Recording(conn))
    finally:
        conn.close()


@needs_root
@pytest.mark.parametrize("scenario", ["healthy", "lossy", "starved"])
def test_skew_recovered_within_1ms(scenario, request, tmp_path):
    """Each rank of a real recording becomes its own node with a shifted clock; the offsets
    estimated from the collectives' ends (within their causal bounds) are the shifts."""
    est = _estimate(request.getfixturevalue(scenario), tmp_path)
    assert est["node0"].reference == "node0"  # every node is in as many collectives: the first name
    for rank, s in SHIFT.items():
        o = est[f"node{rank}"]
        # The lossy rank's few, late ends cannot always pin it to 1 ms: once 2.0 ms off with
        # 22 collectives and bounds 5.3 ms wide (their middle 1.6 ms off), inside 2 residuals.
        allowed = max(1_000_000, 2 * o.residual_ns) if scenario == "lossy" and rank == LOSSY else 1_000_000
        assert abs(o.offset_ns - s) < allowed, est
        assert o.lower_ns <= s <= o.upper_ns, est
        if rank:
            assert o.collectives >= 20 and o.method.startswith(("host call ends", "causal bounds")), o


def _ring_ends(lags_ms, b_end_ms=0.1, shift_ms=-50):
    """Synthetic ends: b (clock shifted by shift_ms) arrives last; a leaves lag ms after b arrives,
    b leaves b_end_ms after it arrives (one per collective, 100 ms apart)."""
    ms, ends = 1_000_000, {}
    for i, x in enumerate(lags_ms):
        t = i * 100 * ms
        b_start, b_end, a_end = t + 30 * ms, t + 30 * ms + int(b_end_ms * ms), t + 30 * ms + int(x * ms)
        s = int(shift_ms * ms)
        ends[("c", "ALL_REDUCE", i)] = {"a": (a_end, a_end, t), "b": (b_end + s, b_end + s, b_start + s)}
    return ends


def test_a_seconds_wait_is_spread_over_the_windows_it_covers():
    """Pure logic. --sched totals' intervals (~1 s) against a collective's window (ms): the share
    of each interval's wait that falls in the window; intervals of two thread kinds overlap."""
    from exporter.offline.analysis.stragglers import _Spread

    sp = _Spread()
    sp.add("p", 1000, 1000, 500)     # 500 waited in [1000, 2000]
    sp.add("p", 2000, 1000, 100)     # 100 in [2000, 3000]
    sp.add("p", 1500, 1000, 1000)    # the other kind: 1000 in [1500, 2500]
    assert sp.window("p", 1000, 1100) == 50                    # a tenth of the first
    assert sp.window("p", 1900, 2100) == 50 + 10 + 200         # across a boundary, and the overlap
    assert sp.window("p", 0, 5000) == 1600                     # all of it
    assert sp.window("p", 3000, 4000) == 0 and sp.window("q", 0, 5000) == 0


def _late_reader_job(late_wait_ms: float, usual_wait_ms: float, estimated: bool = False, leaves_ms: int = 0):
    """Pure logic. 20 collectives of 4 ranks; rank 3 arrives 40 ms late to each, its peers'
    sockets retransmit into its address 198.18.0.7; its threads waited late_wait_ms for a CPU
    per collective, the others usual_wait_ms; it leaves each leaves_ms after the others."""
    from exporter.offline.analysis.stragglers import Arrival, Collective

    ms, out = 1_000_000, []
    for seq in range(20):
        t = seq * 200 * ms
        arr = []
        for r in range(4):
            start = t + (40 * ms if r == 3 else r * ms // 10)
            end = t + (60 + (leaves_ms if r == 3 else 0)) * ms
            a = Arrival(r, "n", 100 + r, 100 + r, start, end, t - 100 * ms, start, (t - 100 * ms, t + 60 * ms),
                        4096, None, runq_wait_ns=int((late_wait_ms if r == 3 else usual_wait_ms) * ms),
                        runq_estimated=estimated)
            if r == 2:
                a.retransmits, a.links = 1, {"198.18.0.6\u2192198.18.0.7": 1}
            arr.append(a)
        out.append(Collective("c0ffee00", "ALL_REDUCE", seq, 4, arr))
    return out


@pytest.mark.parametrize("late_wait_ms, estimated, starved", [(30.0, True, True), (30.0, False, True),
                                                               (1.0, True, False)])
def test_a_late_reader_starved_of_cpu_is_said_so(late_wait_ms, estimated, starved):
    """Pure logic. The late reader's verdict names CPU starvation when its threads waited
    for a CPU beyond the others by CPU_SHARE of its lag (40 ms: 12 ms), and says when the
    waits were spread from --sched totals' seconds."""
    from exporter.offline.analysis import explain, late_reader

    found = late_reader.find(_late_reader_job(late_wait_ms, 1.0, estimated), {"198.18.0.7"},
                             {"198.18.0.7": {("n", 103)}}, explain.MIN_LAG_NS)
    assert found is not None and found[0].rank == 3 and len(found[1]) == 20
    lines = late_reader.lines(found, lambda node, pid: f"rank {pid - 100} on {node}", "links", explain.MIN_LAG_NS,
                              explain.CPU_SHARE)
    assert lines[0].startswith("straggler: rank 3 on n is starved of CPU" if starved else
                               "straggler: rank 3 on n arrives late"), lines
    assert f"waited {late_wait_ms:.1f} ms for a CPU per collective it was last in (the other ranks: 1.0 ms)" \
        in lines[-1], lines
    assert ("--sched totals" in lines[-1]) == estimated


@pytest.mark.parametrize("leaves_ms, named", [(45, False), (40, False), (39, False), (37, True), (0, True)])
def test_a_rank_late_only_as_late_as_it_left_is_no_late_reader(leaves_ms, named):
    """Pure logic. A lossy link's receiver gets its data late, leaves the call late and arrives
    late at the next by as much: the link's doing, not a late reader (the fault benchmark once
    named one). Rank 3, 40 ms late to each call, counts only where that is 2 ms (MIN_LAG_NS) more
    than it left its previous call late."""
    from exporter.offline.analysis import explain, late_reader

    found = late_reader.find(_late_reader_job(1.0, 1.0, leaves_ms=leaves_ms), {"198.18.0.7"},
                             {"198.18.0.7": {("n", 103)}}, explain.MIN_LAG_NS)
    assert (found is not None) == named, found


def test_skew_takes_the_more_precise_of_ends_and_bounds():
    """Pure logic. A straggler's far bound is loose (~30 ms away): when the ends' median breaks
    the tight lower bound, the estimate is that bound, not the middle of the interval."""
    from exporter.offline.analysis import skew

    ms = 1_000_000
    est, k, resid, lower, upper, how = skew._pair(_ring_ends([0.2] + [2.0] * 9), "a", "b")
    assert (k, lower, resid) == (10, -50 * ms - ms // 5, 0) and upper > -21 * ms
    assert est == lower and how == "host call ends, moved to the nearest causal bound", (est, how)
    # Each side once last (bounds -50 +- 0.2 ms), ends that disagree by ms (median -48.5 ms,
    # residual 1.5 ms): the bounds are the more precise, their middle is the estimate.
    s, ends = -50 * ms, {}
    rows = [(30, 30.2, 0, 30.2), (0, 30.2, 30, 30.3)] + [(0, 30, 0, 30 + e) for e in (3, 1, 5, 2, 4, -1, 6, 0)]
    for i, (a0, a1, b0, b1) in enumerate(rows):
        t = i * 100 * ms
        a0, a1, b0, b1 = (t + int(x * ms) for x in (a0, a1, b0, b1))
        ends[("c", "ALL_REDUCE", i)] = {"a": (a1, a1, a0), "b": (b1 + s, b1 + s, b0 + s)}
    est, _, resid, lower, upper, how = skew._pair(ends, "a", "b")
    assert (lower, upper, resid) == (s - ms // 5, s + ms // 5, 3 * ms // 2), (lower, upper, resid)
    assert est == s and how.startswith("causal bounds"), (est, how)
    # A starved b returns ~3.5 ms late (ends that agree: residual 0.2 ms) and arrives last
    # but once: bounds -0.8..+0.9 ms around the truth, the ends' median 2.6 ms above them.
    # Moved to the nearest bound it would be 0.9 ms off; the middle is 0.05 ms off.
    ends = {}
    rows = [(30, 31, 0, 30.9)] + [(0, 30, 29.2, 33.5 + e) for e in (0, .2, -.2, .4, -.4, .1, -.1, .3, 0)]
    for i, (a0, a1, b0, b1) in enumerate(rows):
        t = i * 100 * ms
        a0, a1, b0, b1 = (t + int(round(x * ms)) for x in (a0, a1, b0, b1))
        ends[("c", "ALL_REDUCE", i)] = {"a": (a1, a1, a0), "b": (b1 + s, b1 + s, b0 + s)}
    est, _, resid, lower, upper, how = skew._pair(ends, "a", "b")
    assert (lower, upper) == (s - 4 * ms // 5, s + 9 * ms // 10) and resid == ms // 5, (lower, upper, resid)
    assert est == s + ms // 20 and how == "causal bounds (the host call ends' median is far outside them)", \
        (est, how)


@needs_root
def test_skew_with_a_straggler_and_the_order_right_after_alignment(sleeping, tmp_path):
    """One rank always last: the causal bounds are one-sided, the estimate rests on the ends
    alone (a ring's ends are not simultaneous: within the residual). The order is right."""
    est = _estimate(sleeping, tmp_path)
    for rank, s in SHIFT.items():
        o = est[f"node{rank}"]
        assert o.lower_ns <= s <= o.upper_ns, est
        assert abs(o.offset_ns - s) < max(1_000_000, 2 * o.residual_ns), est
    # aligned: the sleeper is the straggler; raw clocks: node1 (+50 ms) looks like one
    assert _explain(tmp_path / "all.db")["verdict"].startswith(f"straggler: rank {SLEEPER} on node{SLEEPER}")
    raw = _explain(tmp_path / "all.db", "--no-align")["verdict"]
    assert not raw.startswith(f"straggler: rank {SLEEPER}"), raw
    # merging the per-node files gives the same verdict, from the offsets stored in clock_skew
    p = _cli("merge", "--db", tmp_path / "merged.db", *sorted(tmp_path.glob("node*.db")))
    assert p.returncode == 0, p.stderr
    conn = sqlite3.connect(tmp_path / "merged.db")
    stored = dict(conn.execute("SELECT node, offset_ns FROM clock_skew"))
    conn.close()
    assert stored == {n: o.offset_ns for n, o in est.items()}
    assert _explain(tmp_path / "merged.db")["verdict"].startswith(f"straggler: rank {SLEEPER} on node{SLEEPER}")


@needs_root
def test_perfetto_timeline_of_a_real_recording(sleeping, tmp_path):
    """The sleeping job split into shifted nodes, merged, exported: a process per node, the
    world collectives' flows end on the sleeper, and the caller's run-queue waits nest in
    or between its calls (a thread cannot wait across its own call's start or end)."""
    split_by_rank(sleeping, tmp_path, SHIFT)
    merged = tmp_path / "merged.db"
    assert _cli("merge", "--db", merged, *sorted(tmp_path.glob("node*.db"))).returncode == 0
    p = _cli("export", "perfetto", merged, "-o", tmp_path / "t.json")
    assert p.returncode == 0, p.stderr
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == [f"node{r}" for r in range(NRANKS)]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    sleeper = next(k for k, v in threads.items() if v.startswith(f"rank {SLEEPER} (pid"))
    conn = sqlite3.connect(merged)
    n_calls = conn.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0]
    conn.close()
    calls = [e for e in ev if e["ph"] == "X" and e["cat"] in ("call", "lifecycle")]
    assert len(calls) == n_calls
    chains: dict = {}
    for e in ev:
        if e.get("cat") == "collective":
            chains.setdefault(e["id"], []).append(e)
    world = [c for c in chains.values() if len(c) == NRANKS]
    assert len(world) >= 50
    assert all([e["ts"] for e in c] == sorted(e["ts"] for e in c) for c in world)
    assert sum((c[-1]["pid"], c[-1]["tid"]) == sleeper for c in world) >= 0.9 * len(world)
    per_track: dict = {}
    for e in calls:
        per_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    waits = [e for e in ev if e["ph"] == "X" and e["cat"] == "sched" and e["args"]["thread"] == "caller"]
    assert waits
    for w in waits:
        a, b = w["ts"], w["ts"] + w["dur"]
        assert not any(a < s < b or a < t < b for s, t in per_track.get((w["pid"], w["tid"]), ())), w


def test_bad_input_is_one_line(tmp_path):
    for cmd in ("explain", "stragglers"):
        p = _cli(cmd, tmp_path / "missing.db")
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no such file" in p.stderr, p.stderr
        (tmp_path / "junk.db").write_text("not sqlite")
        p = _cli(cmd, tmp_path / "junk.db")
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr


@needs_root
def test_explain_asks_live_agents_and_gives_the_recordings_verdict(sleeping, tmp_path):
    """explain --nodes: each node's window fetched from its real query endpoint,
    merged with clocks aligned, and explained: the same verdict as offline."""
    from exporter.sinks.recording.endpoint import QueryEndpoint

    parts = split_by_rank(sleeping, tmp_path / "nodes", {r: 0 for r in range(NRANKS)})
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    eps = [QueryEndpoint(str(p), p.stem, "s3cret").start() for p in parts]
    try:
        p = _cli("explain", "--nodes", ",".join(e.url for e in eps), "--token-file", token,
                 "--since", "1h", "--format", "json")
    finally:
        for e in eps:
            e.close()
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["verdict"].startswith(f"straggler: rank {SLEEPER} on node{SLEEPER} arrives late"), out
    assert f"{NRANKS} of {NRANKS} nodes" in p.stderr
