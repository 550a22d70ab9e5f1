"""One verdict line and its evidence, from a recording (`nccl-exporter explain`).

The checks, in order (docs/fleet.md; thresholds below):

0. the profiler plugin's per-peer network waits name a slow link or a GPU
   straggler (check 3's evidence, below): that comes first. The waits are
   measured in GPU time; the host arrivals of a GPU job show the queueing
   of launches behind the GPU, so the slow GPU's rank, or the one after it
   in the ring, can look late on the host. A rank that is late on the host
   does not inflate its own send_gpu_wait: NCCL posts the proxy's steps
   when the call enqueues them, so the wait for the GPU starts no earlier
   than its late launch;
1. a late arriver: on the communicator with the most ranks first, a rank
   that arrived last in at least STRAGGLER_SHARE of the collectives (and at
   least twice what chance gives, one over the ranks that arrived), with a
   median lag of at least MIN_LAG_NS. Its cause, from its windows when it was last: CPU (its
   threads waited runnable, per collective, at least CPU_SHARE of the median
   lag more than the other ranks' threads usually do), network (its own
   sockets retransmitted, per collective, at least 0.5 times more than the
   other ranks' usually do, and 5 times in all), or
   else work before the call (compute, a sleep, host-side I/O: nothing the
   agent sees was in the way);
2. CPU starvation inside the calls: a rank whose caller and proxy threads
   waited for a CPU at least STARVE_RATIO times the other ranks' median and
   at least STARVE_SHARE of its time in collectives (a starved rank often
   arrives early and stalls inside the call: everyone waits for it there);
3. a slow link, from the profiler plugin's per-peer network waits
   (recording table nccl_peer_waits; any NET transport: analysis/network.py):
   a receiver's recv_wait from one peer and that peer's send_wait to it both
   at least network.RATIO times the communicator's median pair. When the
   sender's send_wait is not high but its send_gpu_wait is, the sender is a
   GPU (compute) straggler instead, and the network is cleared;
4. a lossy link: no rank arrives late, but one link carries at least
   LINK_SHARE of the job's retransmits, LINK_RATIO times the next link, and
   at least MIN_LINK_RETRANSMITS and MIN_LINK_RATE per collective (a busy
   host retransmits a little on every link: tail-loss probes; on the 2-core
   test host a healthy job's probes once gathered 21 on one host's links, one
   per 120 collectives; 5 % loss gave one per 2 or more);
5. a lossy host link: no one link stands out, but the links with one address
   at an end (data into the host, retransmitted by its peers, and out of it,
   retransmitted by the host) carry at least LINK_SHARE of the retransmits,
   LINK_RATIO times those of every other link, and MIN_LINK_RETRANSMITS: a
   link that loses packets both ways. Two such addresses (a 2-host job): the
   link between them. Also at least MIN_LINK_RATE per collective;
   4 and 5 only when the link's receiving end is not a late reader, a rank
   whose peers retransmit to it because it is late (late_reader.py); then
   the verdict names that rank, and its cause where it waited for a CPU
   (that test has its own bar, so MIN_LINK_RATE does not apply to it);
6. otherwise: no straggler.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from exporter.offline.analysis import late_reader, network, skew, stragglers
from exporter.offline.analysis.words import ms as _ms
from exporter.sinks.recording.read import Recording

STRAGGLER_SHARE = 0.5
MIN_LAG_NS = 2_000_000
MIN_COLLECTIVES = 10
CPU_SHARE = 0.3
STARVE_RATIO = 2.0
STARVE_SHARE = 0.2
LINK_SHARE = 0.5
LINK_RATIO = 2.0
MIN_LINK_RETRANSMITS = 20
MIN_LINK_RATE = 0.05  # retransmits per collective in the recording: one per 20


def _addr_ranks(rec: Recording) -> dict[str, str]:
    """Local address -> 'rank R' of the processes whose sockets used it (their rank:
    Recording.process_ranks; unknown ones are left out)."""
    ranks = rec.process_ranks()
    seen: dict[str, set] = defaultdict(set)
    for saddr, node, pid in rec.local_addresses():
        r = ranks.get((node, pid))
        if r is not None:
            seen[saddr].add(r)
    return {a: "rank " + ",".join(str(r) for r in sorted(rs)) for a, rs in seen.items()}


def _lossy_hosts(links: dict[tuple, int], total: int) -> list[str]:
    """The addresses (one, or the two of one link) whose links carry the job's retransmits:
    at least LINK_SHARE of them and LINK_RATIO times those on links away from it."""
    touching: dict[str, int] = defaultdict(int)
    for (_node, link), n in links.items():
        for addr in set(link.split("\u2192")):
            touching[addr] += n
    out = sorted(a for a, n in touching.items()
                 if n >= MIN_LINK_RETRANSMITS and n >= LINK_SHARE * total and n >= LINK_RATIO * max(total - n, 1))
    return out if len(out) in (1, 2) else []


def _durations(collectives, comm, op) -> str:
    d = sorted(a.end - a.start for c in collectives if c.comm == comm and c.op == op for a in c.arrivals)
    if not d:
        return ""
    p90 = d[min(len(d) - 1, int(0.9 * len(d)))]
    n = sum(1 for c in collectives if c.comm == comm and c.op == op)
    return (f"median {op} call on comm {comm[:8]}… took {_ms(statistics.median(d))} (p90 {_ms(p90)}) "
            f"over {n} collectives")


def _no_collectives(rec: Recording) -> list[str]:
    """What the recording lacked, and what to run instead."""
    calls, nodes, local, comms = rec.call_counts()
    if not calls:
        return ["no collectives: the recording holds no NCCL call (was the job running, and traced? "
                "'nccl-exporter check', then 'trace --duration 30s' to see calls as they come)",
                "nccl_events rows: 0"]
    if local:
        return ["no collectives: the calls are on communicators made before the recording began "
                "(comm local-<pid>-<n> or unknown) and their ranks could not be aligned by call sequence "
                "(different op orders or sizes, or one rank per node: merge every node's recording, or "
                "record from the job's start: 'trace --db' before the job, or 'run --db')",
                f"{local} of {calls} calls on communicators without a job-wide id, {nodes} node(s)"]
    hint = ("merge every node's recording first: each communicator here was seen on one rank"
            if comms else "no collective communicator")
    return [f"no collectives: the recording holds no collective seen on two or more ranks ({hint})",
            f"nccl_events rows: {calls} calls on {comms} communicator(s), {nodes} node(s)"]


def explain(rec: Recording, align: bool = True) -> list[str]:
    """[verdict, evidence...]"""
    collectives, offsets = stragglers.load(rec, align=align)
    measured = network.load(rec)
    slow = network.judge(measured)
    if not collectives:
        if slow:  # e.g. one node's recording: its ranks' waits on peers elsewhere
            return _network(slow) + _no_collectives(rec)[:1]
        return _no_collectives(rec)
    stats = stragglers.per_rank(collectives)
    prank = rec.process_ranks()
    addr_rank = _addr_ranks(rec)
    addr_procs: dict[str, set] = defaultdict(set)
    for saddr, node, pid in rec.local_addresses():
        addr_procs[saddr].add((node, pid))
    nodes = sorted({a.node for c in collectives for a in c.arrivals})

    def who(node, pid):
        r = prank.get((node, pid))
        return f"rank {r if r is not None else '?'} on {node}"

    def link_text(link):
        s, _, d = link.partition("\u2192")
        return f"{link} ({addr_rank.get(s, '?')} \u2192 {addr_rank.get(d, '?')})"

    # Per process over all its windows: run-queue waits, retransmits per link, time in windows.
    proc_wait: dict[tuple, int] = defaultdict(int)
    proc_time: dict[tuple, int] = defaultdict(int)
    links: dict[str, int] = defaultdict(int)
    link_owner: dict[str, tuple] = {}
    for c in collectives:
        for a in c.arrivals:
            key = (a.node, a.pid)
            proc_wait[key] += a.runq_wait_ns
            proc_time[key] += a.end - a.window_start
            for link, n in (a.links or {}).items():
                links[(a.node, link)] += n
                link_owner[(a.node, link)] = key
    total_retx = sum(links.values())
    ranked_links = sorted(links.items(), key=lambda kv: -kv[1])

    if len(nodes) > 1 and align:
        found = skew.stored(rec) or skew.estimate(rec)
        worst = max((abs(o.offset_ns) for o in found.values()), default=0)
        resid = max((o.residual_ns for o in found.values()), default=0)
        clocks = (f"clocks: {len(nodes)} nodes aligned by collective ends (largest offset {_ms(worst)}, "
                  f"residual up to {_ms(resid)}); --no-align shows raw clocks")
    elif len(nodes) > 1:
        clocks = f"clocks: {len(nodes)} nodes, raw clocks (--no-align)"
    else:
        clocks = f"clocks: one node ({nodes[0]}), one clock: no alignment needed"

    # 1. a late arriver, largest communicators first
    by_comm = defaultdict(list)
    for s in stats:
        by_comm[(s.comm, s.op)].append(s)
    size = {k: max((c.nranks for c in collectives if (c.comm, c.op) == k), default=0) for k in by_comm}
    main = max(by_comm, key=lambda k: (size[k], by_comm[k][0].collectives))
    s = _late_arriver(by_comm, size)
    # 0. the plugin's waits name a slow link or a GPU straggler (GPU time) before a host-time late arriver
    if slow and slow[0].verdict in (network.SLOW_LINK, network.GPU_STRAGGLER):
        return _network(slow) + [_durations(collectives, *main), _no_late(stats), clocks]
    if s:
        group = by_comm[(s.comm, s.op)]
        name = who(s.node, s.pid)
        arrived = (f"{name} arrived last in {100 * s.last_share:.0f} % of {s.op} on comm {s.comm[:8]}… "
                   f"({s.last} of {s.collectives}), median lag {_ms(s.median_lag_ns)} "
                   f"(last arrival - median arrival)")
        top = sorted(s.links_when_last.items(), key=lambda kv: -kv[1])
        retx = (f"its sockets retransmitted {s.retransmits_when_last} times in those windows"
                + (f", most on {link_text(top[0][0])} ({top[0][1]})" if top else ""))
        # What the straggler's windows had beyond the other ranks' usual (per collective window):
        # a busy host makes every rank wait for CPUs and retransmit a little.
        rest = [st for st in group if st is not s]
        cpu_usual = statistics.median([st.runq_wait_ns / st.collectives for st in rest] or [0])
        retx_usual = statistics.median([st.retransmits / st.collectives for st in rest] or [0])
        cpu_excess = s.runq_wait_when_last_ns / s.last - cpu_usual
        retx_excess = s.retransmits_when_last / s.last - retx_usual
        cpu = (f"its caller and proxy threads waited {_ms(s.runq_wait_when_last_ns)} for a CPU in those windows, "
               f"{_ms(s.runq_wait_when_last_ns / s.last)} per collective (the other ranks: {_ms(cpu_usual)})"
               + (" (--sched totals: each second's wait spread over its collectives)" if s.runq_estimated else "")
               if s.runq_measured else
               "its threads' CPU waits were not recorded (no sched_events or sched_intervals: a recording "
               "older than schema 10 made with --sched totals)")
        if s.runq_measured and cpu_excess >= CPU_SHARE * s.median_lag_ns:
            verdict = (f"straggler: {name} is starved of CPU: it arrived last in {100 * s.last_share:.0f} % "
                       f"of {s.op} (median lag {_ms(s.median_lag_ns)}) and waited for a CPU "
                       f"{_ms(s.runq_wait_when_last_ns)} in those windows")
            lines = [verdict, arrived, cpu, retx]
        elif s.retransmits_when_last >= 5 and retx_excess >= 0.5:
            verdict = (f"straggler: {name} is held up by the network: it arrived last in "
                       f"{100 * s.last_share:.0f} % of {s.op} (median lag {_ms(s.median_lag_ns)}) with "
                       f"{s.retransmits_when_last} retransmits on its sockets in those windows")
            lines = [verdict, arrived, retx, cpu]
        elif s.runq_measured:
            verdict = (f"straggler: {name} arrives late (median lag {_ms(s.median_lag_ns)}, last in "
                       f"{100 * s.last_share:.0f} % of {s.op} on comm {s.comm[:8]}…) with no CPU wait or "
                       f"retransmits to explain it: it is busy before the call (compute, a sleep, host I/O)")
            lines = [verdict, arrived, cpu, retx]
        else:  # no CPU waits recorded to rule starvation in or out
            verdict = (f"straggler: {name} arrives late (median lag {_ms(s.median_lag_ns)}, last in "
                       f"{100 * s.last_share:.0f} % of {s.op} on comm {s.comm[:8]}…) with no retransmits to "
                       f"explain it; its CPU waits were not recorded (see its "
                       f"nccl_runqueue_delay_seconds, NcclRankCpuStarved): busy before the call or starved of CPU")
            lines = [verdict, arrived, cpu, retx]
        return lines + [_durations(collectives, s.comm, s.op), clocks]

    # 2. CPU starvation inside the calls
    if len(proc_wait) >= 2:
        for key, wait in sorted(proc_wait.items(), key=lambda kv: -kv[1])[:1]:
            rest = [w for k, w in proc_wait.items() if k != key]
            med = statistics.median(rest)
            if wait >= STARVE_RATIO * max(med, 1) and wait >= STARVE_SHARE * max(proc_time[key], 1):
                name = who(*key)
                mine = [st for st in stats if (st.node, st.pid) == key]
                lasts = ", ".join(f"{100 * st.last_share:.0f} % of {st.op} on comm {st.comm[:8]}…" for st in mine)
                estimated = (" (--sched totals: each second's wait spread over its collectives)"
                             if any(st.runq_estimated for st in mine) else "")
                return [f"CPU starvation: {name} waited for a CPU {_ms(wait)} of its {_ms(proc_time[key])} "
                        f"in collectives ({wait / max(med, 1):.1f}× the other ranks' median): every collective waits "
                        f"for it inside the call",
                        f"{name}: caller and proxy threads runnable but not running {_ms(wait)} (summed over "
                        f"its threads); the other ranks' median {_ms(med)}" + estimated,
                        f"it arrived last in {lasts or 'none'}: it stalls inside the calls, not before them",
                        _durations(collectives, *main),
                        f"retransmits: {total_retx} on all links in the collectives' windows", clocks]

    # 3. a slow link (or a GPU straggler) from the per-peer network waits
    if slow:
        return _network(slow) + [_durations(collectives, *main), _no_late(stats), clocks]

    # 4. a lossy link
    if ranked_links:
        (node_link, top), second = ranked_links[0], (ranked_links[1][1] if len(ranked_links) > 1 else 0)
        if top >= MIN_LINK_RETRANSMITS and top >= LINK_SHARE * total_retx and top >= LINK_RATIO * max(second, 1):
            node, link = node_link
            late = late_reader.find(collectives, {link.partition("\u2192")[2]}, addr_procs, MIN_LAG_NS)
            if late:
                return late_reader.lines(late, who, f"link {link_text(link)}: {top} retransmits, "
                                         f"{100 * top / total_retx:.0f} % of all", MIN_LAG_NS, CPU_SHARE) + [
                    _durations(collectives, *main), clocks]
            if top >= MIN_LINK_RATE * len(collectives):
                owner = link_owner[node_link]
                with_retx = sum(1 for c in collectives if any(a.retransmits for a in c.arrivals))
                return [f"network: no rank arrives late, collectives are slow alike; link {link_text(link)} "
                        f"on {node} retransmitted {top} times ({100 * top / total_retx:.0f} % of all), "
                        f"its socket owned by {who(*owner)}",
                        f"link {link_text(link)}: {top} retransmits; the next link {second}; all links {total_retx}",
                        f"{with_retx} of {len(collectives)} collectives had retransmits in their windows",
                        _durations(collectives, *main),
                        _no_late(stats), clocks]

    # 5. a lossy host link: the retransmitting links share one address
    hosts = _lossy_hosts(links, total_retx)
    late = late_reader.find(collectives, set(hosts), addr_procs, MIN_LAG_NS) if hosts else None
    if late:
        return late_reader.lines(late, who, "the links of " + " and ".join(hosts) + " carry most retransmits",
                                 MIN_LAG_NS, CPU_SHARE) + [
            _durations(collectives, *main), clocks]
    mine = [(nl, n) for nl, n in ranked_links if hosts and set(hosts) <= set(nl[1].split("\u2192"))]
    n = sum(v for _, v in mine)
    if hosts and n >= MIN_LINK_RATE * len(collectives):
        named = " and ".join(f"{a} ({addr_rank.get(a, '?')})" for a in hosts)
        where = "the link between " + named if len(hosts) == 2 else f"the link of {named}, both ways"
        return [f"network: no rank arrives late, collectives are slow alike; {where}: its connections "
                f"retransmitted {n} times ({100 * n / total_retx:.0f} % of all)",
                "; ".join(f"link {link_text(link)} on {node}: {v} retransmits, "
                          f"socket of {who(*link_owner[(node, link)])}"
                          for (node, link), v in mine[:4]) + f"; all links {total_retx}",
                _durations(collectives, *main),
                _no_late(stats), clocks]

    # 6. healthy
    return [f"no straggler: no rank arrived last in more than chance would give with a lag over "
            f"{_ms(MIN_LAG_NS)}, no rank starved of CPU, no link stands out",
            _no_late(stats),
            f"retransmits: {total_retx} in the {len(collectives)} collectives' windows"
            + (f", spread over {len(ranked_links)} links (most: {ranked_links[0][1]})" if ranked_links else "")
            + (f"; none reaches one per {1 / MIN_LINK_RATE:.0f} collectives: tail-loss probes, not loss"
               if total_retx else ""),
            "run-queue waits per rank (caller and proxy threads): "
            + ", ".join(f"{who(*k).split(' on ')[0]} {_ms(w)}" for k, w in sorted(proc_wait.items(),
                                                                               key=lambda kv: prank.get(kv[0], 0))),
            _durations(collectives, *main), clocks] + ([
            f"network waits (profiler plugin): {len(measured)} links measured, no receiver waited for one "
            f"peer {network.RATIO:g}× its communicator's median pair"] if measured else [])


def _late_arriver(by_comm: dict, size: dict):
    """Check 1's rank: on the largest communicators first, one last in STRAGGLER_SHARE of the
    collectives (and twice chance, among the ranks that arrived: where a rank never came,
    one of three is last a third of the time) with a median lag of MIN_LAG_NS; None if none."""
    for key in sorted(by_comm, key=lambda k: (-size[k], -by_comm[k][0].collectives, k)):
        group = by_comm[key]
        cand = [s for s in group if s.collectives >= MIN_COLLECTIVES and s.last_share >= STRAGGLER_SHARE
                and s.last_share >= min(0.9, 2.0 * s.chance_last) and s.median_lag_ns >= MIN_LAG_NS]
        if cand:
            return max(cand, key=lambda s: sum(s.lags_when_last))
    return None


def _network(slow: list) -> list[str]:
    """The worst link's verdict and evidence, then the other links judged."""
    top = slow[0]
    lines = [network.verdict_line(top), *network.evidence(top)]
    others = slow[1:4]
    if others:
        lines.append("also: " + "; ".join(f"{lk.verdict}: {network.headline(lk)}" for lk in others)
                     + (f"; and {len(slow) - 4} more ('stragglers --links')" if len(slow) > 4 else ""))
    return lines


def _no_late(stats) -> str:
    s = max(stats, key=lambda s: (s.last_share, s.median_lag_ns))
    return (f"most often last: rank {s.rank} of comm {s.comm[:8]}… in {100 * s.last_share:.0f} % of "
            f"{s.op} ({s.collectives} collectives), median lag {_ms(s.median_lag_ns)}")
