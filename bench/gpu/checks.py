"""The GPU check's parsers and verdicts: pure standard library, no torch.

Inputs are text the run leaves behind: the plugin's logging-mode lines
(docs/plugin.md, "Logging mode"), and per rank the workload's JSON lines
(bench/gpu/workload.py on a GPU, bench/gpu/simworkload.py on the simulator):

  {"kind": "call", "rank": r, "world": n, "op": "AllReduce", "bytes": S,
   "elapsed_ns": E, "ok": true, "expect": {"coll": "AllReduce"} |
                                         {"Send": [b, ...], "Recv": [b, ...]}}
  {"kind": "result", "rank": r, "world": n, "pid": p, "nccl": "2.28.9", ...}

`expect` is what the call should produce in the plugin's records: one Coll
record of that name (bytes S), or one P2p record per entry (its bytes).
Every check returns a Verdict; a part's verdict is the worst of its checks.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict

# The plugin's record flags (plugin/nccl_exporter_plugin.h)
F_FINALIZED = 0x20
F_REJECTED = 0x380
# Timer error allowed between the plugin's GPU interval and the CUDA events'
# elapsed time of the same call: %globaltimer updates about every 1 us on
# current GPUs, CUDA events resolve ~0.5 us, and the cross-stream waits that
# order the NCCL stream between the two events add a little: 5 us.
TIMER_ERR_NS = 5_000
HALF_FROM_BYTES = 1 << 20  # from 1 MB up the GPU interval is at least half the events' time
# The interface version each NCCL release uses with this plugin (docs/plugin.md)
IFACE_FOR_NCCL = {(2, 27): 4, (2, 28): 5, (2, 29): 6, (2, 30): 6, (2, 31): 7, (2, 32): 7}
COLL_OPS = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "AlltoAll", "Gather", "Scatter")

ORDER = {"PASS": 0, "INFO": 0, "SKIP": 1, "FAIL": 2, "TIMEOUT": 2, "ERROR": 2}


@dataclasses.dataclass
class Verdict:
    part: str
    status: str  # PASS, FAIL, INFO (measured, nothing to pass), SKIP, TIMEOUT, ERROR
    lines: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        head = self.lines[0] if self.lines else ""
        return f"part {self.part}: {self.status}" + (f" - {head}" if head else "")

    def text(self) -> str:
        return "\n".join([self.line(), *("    " + l for l in self.lines[1:])])


def worst(part: str, verdicts: list[Verdict], head: str = "") -> Verdict:
    """One verdict for a part: the worst status of its checks, their lines kept."""
    status = "PASS"
    for v in verdicts:
        if ORDER[v.status] > ORDER[status]:
            status = v.status
    lines = [head] if head else []
    for v in verdicts:
        lines.append(f"{v.part}: {v.status}" + (f" - {v.lines[0]}" if v.lines else ""))
        lines += ["  " + l for l in v.lines[1:]]
    return Verdict(part, status, lines)


def final_line(verdicts: list[Verdict]) -> str:
    """The run's one verdict line: FAIL if any part failed, timed out or broke;
    PARTIAL if a part was skipped; PASS when every part passed (or, for the
    measuring parts e and b, reported)."""
    bad = [v for v in verdicts if v.status in ("FAIL", "TIMEOUT", "ERROR")]
    status = "FAIL" if bad else "PARTIAL" if any(v.status == "SKIP" for v in verdicts) or not verdicts else "PASS"
    parts = ", ".join(f"{v.part} {v.status}" for v in verdicts)
    return f"bench/gpu verdict: {status} ({parts})"


# --- parsing -------------------------------------------------------------------------

def parse_plugin_log(text: str) -> list[dict]:
    """The plugin's logging-mode lines as dicts of strings (other lines skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("nccl-exporter-profiler "):
            out.append(dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv))
    return out


# One network step of NCCL's Simple protocol (4 MiB buffers in 8 steps): the
# tolerance of the per-direction byte sums (a ring's last step may be short).
SIMPLE_STEP_BYTES = 512 * 1024


def check_proxy(records: list[dict], world: int, clock_error_ns: int = 1_000_000) -> Verdict:
    """Part p: the plugin's network figures of ring AllReduces (logging mode:
    `event=peer_wait` lines beside each `event=done`). Real ProxyOp/ProxyStep
    events reached it; per operation and direction the bytes summed over
    peers are what a ring AllReduce moves, 2(n-1)/n x size per rank (within
    one step); no phase's wall time exceeds the operation's enqueue .. last
    KernelCh stop (docs/network.md)."""
    done = {(r.get("pid"), r.get("id")): r for r in records
            if r.get("event") == "done" and r.get("op") == "AllReduce" and r.get("nranks") == str(world)}
    waits: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("event") == "peer_wait":
            waits[(r.get("pid"), r.get("id"))].append(r)
    ops = [k for k in done if k in waits]
    if not ops:
        return Verdict("p", "FAIL", [f"no network figures: {len(done)} AllReduce done records, "
                                     f"{sum(map(len, waits.values()))} peer_wait lines (no ProxyOp/ProxyStep events?)"])
    bad = []
    for k in ops:
        d = done[k]
        size = int(d["bytes"])
        want = 2 * (world - 1) * size // world
        for direction in ("send", "recv"):
            got = sum(int(w["bytes"]) for w in waits[k] if w["direction"] == direction)
            if abs(got - want) > SIMPLE_STEP_BYTES:
                bad.append(f"rank {d['rank']} seq {d['seq']} {direction}: {got} bytes, a ring moves {want}")
        window = int(d["gpu_stop_mono_ns"]) - int(d["enqueue_mono_ns"]) + clock_error_ns
        for w in waits[k]:
            for key, v in w.items():
                if key.endswith("_wall_ns") and int(v) > window:
                    bad.append(f"rank {d['rank']} seq {d['seq']} peer {w['peer']} {key}={v} > enqueue..last "
                               f"KernelCh stop {window - clock_error_ns} ns")
    head = (f"{len(ops)} ring AllReduces of {world} ranks with network figures "
            f"({sum(map(len, waits.values()))} peer_wait lines)")
    return Verdict("p", "FAIL" if bad else "PASS", [head, *bad[:20]])


def parse_jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def by_pid(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if "pid" in r:
            out[int(r["pid"])].append(r)
    return out


def gpu_ns(r: dict) -> int:
    a, b = int(r.get("gpu_start_timer", 0)), int(r.get("gpu_stop_timer", 0))
    return b - a if a and b >= a else 0


# --- part a: correctness -------------------------------------------------------------

def check_rank(calls: list[dict], recs: list[dict], nccl_version: tuple | None = None) -> Verdict:
    """One rank's calls against the plugin records of its process (and, where
    several ranks share a process as in the simulator, of its rank)."""
    rank = calls[0]["rank"] if calls else "?"
    world = calls[0]["world"] if calls else "?"
    name = f"rank {rank}/{world}"
    fails: list[str] = []
    info: list[str] = []
    inits = [r for r in recs if r.get("event") == "init"]
    done = [r for r in recs if r.get("event") == "done"]
    abandoned = [r for r in recs if r.get("event") == "abandoned"]
    fins = [r for r in recs if r.get("event") == "finalize"]
    bad_calls = [c for c in calls if not c.get("ok", False)]
    if bad_calls:
        fails.append(f"{len(bad_calls)} calls gave wrong results "
                     f"(first: {bad_calls[0]['op']} {bad_calls[0]['bytes']} B)")
    # the interface version NCCL chose
    ifaces = sorted({r.get("iface", "?") for r in inits})
    info.append(f"interface {','.join(ifaces) or 'none'} over {len(inits)} communicator init(s)")
    if not inits:
        fails.append("no communicator init in the plugin's log: the plugin was not loaded")
    elif nccl_version and tuple(nccl_version[:2]) in IFACE_FOR_NCCL:
        want = f"v{IFACE_FOR_NCCL[tuple(nccl_version[:2])]}"
        if ifaces != [want]:
            fails.append(f"NCCL {'.'.join(map(str, nccl_version))} chose {ifaces}, docs/plugin.md says {want}")
    phase = [r["mask"] for r in inits if int(r.get("mask", "0"), 16) & 0x8000]
    if phase:  # KernelPhase (bit 15): never ours to ask for (docs/plugin.md)
        fails.append(f"NCCL's activation mask has KernelPhase events: {phase[0]}")
    if abandoned:
        fails.append(f"{len(abandoned)} abandoned records (flags {sorted({r['flags'] for r in abandoned})})")
    rejected = [r for r in done if int(r.get("flags", "0"), 16) & F_REJECTED]
    if rejected:
        fails.append(f"{len(rejected)} intervals judged implausible: "
                     f"{Counter((r['op'], r['flags']) for r in rejected).most_common(4)}")
    pending = sum(int(r.get("pending", 0)) for r in fins)
    if pending:
        fails.append(f"finalize found {pending} records still open")

    # collectives: one Coll record per call, seq per (comm, op) from 0, bytes equal
    colls = [r for r in done if r.get("kind") == "coll"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in colls:
        groups[(r["comm"], r["op"])].append(r)
    for (comm, op), rs in sorted(groups.items()):
        seqs = sorted(int(r["seq"]) for r in rs)
        if seqs != list(range(len(seqs))):
            fails.append(f"{op} on {comm}: seq {seqs[:8]}... not 0..{len(seqs) - 1} once each")
    want_colls: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        if "coll" in c.get("expect", {}):
            want_colls[c["expect"]["coll"]].append(c)
    framework: list[str] = []
    timing_fail: list[str] = []
    matched = 0
    for op in sorted(set(want_colls) | {op for _, op in groups}):
        rs = sorted((r for r in colls if r["op"] == op), key=lambda r: int(r["enqueue_mono_ns"]))
        cs = want_colls.get(op, [])
        extra = len(rs) - len(cs)
        if extra < 0:
            fails.append(f"{op}: {len(cs)} calls, {len(rs)} Coll records ({-extra} missing)")
            continue
        # calls the framework makes itself come first (a barrier at init): counted and named
        for r in rs[:extra]:
            framework.append(f"{op} {r['bytes']} B seq {r['seq']}")
        for c, r in zip(cs, rs[extra:]):
            matched += 1
            if int(r["bytes"]) != int(c["bytes"]):
                fails.append(f"{op}: call of {c['bytes']} B has a record of {r['bytes']} B")
                continue
            timing_fail += _timing(op, c, gpu_ns(r))
    # point-to-point: the records NCCL makes for AllToAll and Send/Recv
    p2p = sorted((r for r in done if r.get("kind") == "p2p"), key=lambda r: int(r["enqueue_mono_ns"]))
    want_p2p = [c for c in calls if "coll" not in c.get("expect", {})]
    want_n = sum(len(c["expect"].get("Send", [])) + len(c["expect"].get("Recv", [])) for c in want_p2p)
    stated = Counter(c["op"] for c in want_p2p)
    if want_p2p:
        info.append("P2p records expected: " + ", ".join(
            f"{op} x{n}: {len(want_p2p_of(want_p2p, op)[0]['expect'].get('Send', []))} Send + "
            f"{len(want_p2p_of(want_p2p, op)[0]['expect'].get('Recv', []))} Recv each"
            for op, n in sorted(stated.items())))
    if len(p2p) != want_n:
        fails.append(f"P2p: {want_n} records expected, {len(p2p)} found "
                     f"({Counter(r['op'] for r in p2p)})")
    else:
        i = 0
        for c in want_p2p:
            n = len(c["expect"].get("Send", [])) + len(c["expect"].get("Recv", []))
            chunk, i = p2p[i:i + n], i + n
            got = Counter((r["op"], int(r["bytes"])) for r in chunk)
            want = Counter([("Send", b) for b in c["expect"].get("Send", [])] +
                           [("Recv", b) for b in c["expect"].get("Recv", [])])
            if got != want:
                fails.append(f"{c['op']} {c['bytes']} B: records {sorted(got.items())} != {sorted(want.items())}")
                continue
            starts = [int(r["gpu_start_timer"]) for r in chunk]
            stops = [int(r["gpu_stop_timer"]) for r in chunk]
            timing_fail += _timing(c["op"], c, max(stops) - min(starts))
            matched += 1
    fails += timing_fail[:6]
    if len(timing_fail) > 6:
        fails.append(f"... {len(timing_fail) - 6} more timing failures")
    info.append(f"{matched} calls matched to records; framework calls: "
                + (", ".join(f"{k} x{n}" for k, n in Counter(framework).items()) or "none"))
    return Verdict(name, "FAIL" if fails else "PASS", (fails or ["every call recorded once, seq from 0, bytes and "
                                                                 "GPU time within the CUDA events'"]) + info)


def want_p2p_of(calls: list[dict], op: str) -> list[dict]:
    return [c for c in calls if c["op"] == op]


def _timing(op: str, call: dict, g: int) -> list[str]:
    e = float(call.get("elapsed_ns", 0))
    if e <= 0:
        return [f"{op} {call['bytes']} B: no CUDA event time"]
    if g <= 0:
        return [f"{op} {call['bytes']} B: no GPU interval"]
    if g > e + TIMER_ERR_NS:
        return [f"{op} {call['bytes']} B: GPU {g / 1e3:.1f} us > events {e / 1e3:.1f} us + {TIMER_ERR_NS / 1e3:.0f} us"]
    if int(call["bytes"]) >= HALF_FROM_BYTES and g < e / 2:
        return [f"{op} {call['bytes']} B: GPU {g / 1e3:.1f} us < half the events' {e / 1e3:.1f} us"]
    return []


def check_control(calls: list[dict], want_calls: int) -> Verdict:
    """A run without the plugin: the same event-based checks (results right,
    every call timed by its events)."""
    rank = calls[0]["rank"] if calls else "?"
    fails = []
    if len(calls) != want_calls:
        fails.append(f"{len(calls)} calls made, {want_calls} planned")
    if [c for c in calls if not c.get("ok")]:
        fails.append(f"{sum(not c.get('ok') for c in calls)} calls gave wrong results")
    if [c for c in calls if float(c.get("elapsed_ns", 0)) <= 0]:
        fails.append("calls without CUDA event time")
    return Verdict(f"control rank {rank}", "FAIL" if fails else "PASS", fails or [f"{len(calls)} calls, results right"])


def check_correctness(runs: list[dict]) -> Verdict:
    """runs: [{"label": "2 ranks", "calls": [...], "records": [...], "results": [...],
    "control": bool, "planned": int}]. Records are matched to a rank by pid and rank."""
    vs = []
    for run in runs:
        calls_by_rank: dict[int, list[dict]] = defaultdict(list)
        for c in run["calls"]:
            calls_by_rank[c["rank"]].append(c)
        results = {r["rank"]: r for r in run["results"]}
        ranks = sorted(set(calls_by_rank) | set(results))
        if not ranks:
            vs.append(Verdict(run["label"], "FAIL", ["no rank reported anything"]))
            continue
        for rank in ranks:
            res = results.get(rank)
            if res is None or res.get("error"):
                vs.append(Verdict(f"{run['label']} rank {rank}", "FAIL",
                                  [f"the rank failed: {(res or {}).get('error', 'no result')}"]))
                continue
            cs = calls_by_rank[rank]
            if run.get("control"):
                v = check_control(cs, run["planned"])
            else:
                pid = res["pid"]
                # one process per rank on a GPU (all its communicators); the
                # simulator runs a world's ranks in one process: its rank's lines
                recs = [r for r in run["records"] if int(r.get("pid", -1)) == pid
                        and (not res.get("shared_pid") or int(r.get("rank", -1)) == rank)]
                v = check_rank(cs, recs, tuple(res.get("nccl_version") or ()) or None)
            v.part = f"{run['label']}, {v.part}"
            vs.append(v)
    return worst("a", vs)


# --- part d: faults ------------------------------------------------------------------

def check_faults(plugin: list[dict], control: list[dict], records: list[dict]) -> Verdict:
    """plugin / control: the survivors' results ({"rank", "outcome": exception type
    or "completed", "t_error_s": seconds from the kill to the error, "rc"}); records:
    the plugin run's log. Same outcome, time to error within max(5 s, 20 %) of the
    control's, no crash or hang, abandoned records reported and finalize releasing
    everything."""
    fails, info = [], []
    if not control:
        fails.append("the control run reported no survivor")
    if not plugin:
        fails.append("the plugin run reported no survivor")
    for r in plugin + control:
        if r.get("rc") not in (0, None) or r.get("outcome") in (None, "hung", "crashed"):
            fails.append(f"rank {r.get('rank')} ({'plugin' if r in plugin else 'control'}): "
                         f"{r.get('outcome')} rc={r.get('rc')}")
    po = sorted({r.get("outcome") for r in plugin})
    co = sorted({r.get("outcome") for r in control})
    info.append(f"outcome with plugin {po}, without {co}")
    if po != co:
        fails.append(f"outcome differs: with plugin {po}, without {co}")
    tp = [r["t_error_s"] for r in plugin if r.get("t_error_s") is not None]
    tc = [r["t_error_s"] for r in control if r.get("t_error_s") is not None]
    if tp and tc:
        p, c = max(tp), max(tc)
        tol = max(5.0, 0.2 * c)
        info.append(f"time to error {p:.1f} s with plugin, {c:.1f} s without (tolerance {tol:.1f} s)")
        if abs(p - c) > tol:
            fails.append(f"time to error {p:.1f} s vs {c:.1f} s without the plugin (> {tol:.1f} s apart)")
    inits = [r for r in records if r.get("event") == "init"]
    fins = [r for r in records if r.get("event") == "finalize"]
    ab = [r for r in records if r.get("event") == "abandoned"]
    fin_ab = [r for r in ab if int(r.get("flags", "0"), 16) & F_FINALIZED]
    info.append(f"{len(inits)} inits, {len(fins)} finalizes, {len(ab)} abandoned records "
                f"({len(fin_ab)} at finalize), pending at finalize {sum(int(r['pending']) for r in fins)}")
    live = Counter((r["pid"], r["comm"]) for r in inits) - Counter((r["pid"], r["comm"]) for r in fins)
    if live:
        fails.append(f"{sum(live.values())} communicator(s) never finalized (records not released): "
                     f"{sorted(live)[:3]}")
    if sum(int(r["pending"]) for r in fins) != len(fin_ab):
        fails.append("finalize's pending counts differ from the abandoned records it emitted")
    if not ab:
        fails.append("no abandoned record: the collective cut off by the kill was not reported")
    return Verdict("d", "FAIL" if fails else "PASS",
                   (fails or ["survivors fail as without the plugin; "
                              "abandoned records reported, finalize released all"]) + info)


# --- part c: CUDA graphs -------------------------------------------------------------

def check_graphs(result: dict, records: list[dict]) -> Verdict:
    """result: {"replays": R, "captured": {"AllReduce": bytes, ...}, "replay_elapsed_ns": [..]}
    (rank 0's). NCCL with KernelCh active makes Coll and KernelCh events at every
    replay: one done record per captured op and replay (the capture itself may
    add one)."""
    fails, info = [], []
    replays = int(result.get("replays", 0))
    done = [r for r in records if r.get("event") == "done" and int(r.get("pid", -1)) == result.get("pid")]
    ab = [r for r in records if r.get("event") == "abandoned" and int(r.get("pid", -1)) == result.get("pid")]
    for op, nbytes in sorted(result.get("captured", {}).items()):
        rs = [r for r in done if r["op"] == op and int(r["bytes"]) == int(nbytes)]
        seqs = [int(r["seq"]) for r in rs]
        info.append(f"{op} {nbytes} B: {len(rs)} records for {replays} replays; seq {sorted(set(seqs))[:5]}"
                    f"{'...' if len(set(seqs)) > 5 else ''} ({len(set(seqs))} distinct)")
        if len(rs) not in (replays, replays + 1):
            fails.append(f"{op}: {len(rs)} GPU records for {replays} replays "
                         "(the GPU series would not count the replays)")
        rej = [r for r in rs if int(r.get("flags", "0"), 16) & F_REJECTED]
        if rej:
            fails.append(f"{op}: {len(rej)} replayed intervals judged implausible "
                         f"(flags {sorted({r['flags'] for r in rej})})")
        el = result.get("replay_elapsed_ns") or []
        if el and rs:
            longest = max(gpu_ns(r) for r in rs)
            if longest > max(el) + TIMER_ERR_NS:
                fails.append(f"{op}: a GPU interval of {longest / 1e3:.0f} us is longer than any replay "
                             f"({max(el) / 1e3:.0f} us)")
    if ab:
        fails.append(f"{len(ab)} abandoned records")
    return Verdict("c", "FAIL" if fails else "PASS", (fails or ["every replay recorded"]) + info)


# --- part e: cost --------------------------------------------------------------------

def summarize_cost(rows: dict[str, list[float]]) -> list[str]:
    """rows: condition -> per-iteration seconds of each run (alternating runs)."""
    import statistics

    out = []
    base = rows.get("none") or []
    for cond, vals in rows.items():
        if not vals:
            continue
        med = statistics.median(vals)
        line = f"{cond:7s} {med * 1e3:9.3f} ms/iteration (runs {', '.join(f'{v * 1e3:.3f}' for v in vals)})"
        if base and cond != "none":
            ratios = [v / b for v, b in zip(vals, base)]
            line += f"  / none {statistics.median(ratios):.4f} ({100 * (statistics.median(ratios) - 1):+.2f} %)"
        out.append(line)
    return out


# --- part b: the agent there ---------------------------------------------------------

def check_agent_env(facts: dict) -> Verdict:
    """facts: what bench/gpu found about the kernel and BCC ({"kernel",
    "uprobe": "ok" | reason, "bpf_syscall": "ok" | reason, "bcc": "ok" | reason,
    "headers": "ok" | reason, "btf": bool}). INFO: it states what stops the agent."""
    blockers = [f"{k}: {facts[k]}" for k in ("uprobe", "bpf_syscall", "bcc", "headers")
                if not str(facts.get(k)).startswith("ok")]
    head = ("the agent could run here" if not blockers else "the agent cannot run here: " + "; ".join(blockers))
    lines = [head, f"kernel {facts.get('kernel', '?')}, BTF {'yes' if facts.get('btf') else 'no'}, "
                   f"BCC {facts.get('bcc', '?')}"]
    return Verdict("b", "INFO", lines)
