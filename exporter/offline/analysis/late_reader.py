"""A late reader: the rank at the receiving end of a link's retransmits, when it
is the cause rather than the link (explain's checks 4 and 5, a lossy link
and a lossy host link, apply only when it is not).

A rank that arrives late makes the peers sending to it retransmit (tail-loss
probes and timeouts while it does not read or ack), so the links into a slow
rank carry retransmits although nothing is lost. When the rank at the
receiving end arrived last, at least explain's MIN_LAG_NS after the median,
in more of the collectives whose windows had retransmits into its address
than chance gives (1/nranks of them) by LATE_SDS binomial standard
deviations, and in at least MIN_LATE_READS of them, the verdict names that
rank, a straggler, and its links as victims. A lossy link's receiver is not
late to the calls (its data arrives late inside them, after it arrived): it
is last there as often as chance gives, or less. Not half of them, as check
1 asks: a retransmit falls in the sender's window, which can end before the
receiver it waits for is late to the next call.

A collective counts only where the rank is late by its own time between
calls: its lag there less how late it left its previous call (its end
after that collective's median end) is still at least the lag floor. A
lossy link's receiver gets its data late, leaves the call late and so
arrives late at the next one by as much; that is the link's doing (the
fault benchmark once named a lossy link's receiver a late reader, last in
36 of ~100 such collectives). A straggler leaves with the others (they
waited for it) and is late again by its own work.

Its cause, as in check 1: starved of CPU when its caller and proxy threads
waited runnable, per collective it was last in, at least CPU_SHARE of the
median lag more than the other ranks' threads did in the same collectives.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict

from exporter.offline.analysis.words import ms as _ms

# A late reader (checks 4 and 5): last (by MIN_LAG_NS) in the collectives with retransmits into its
# address at least LATE_SDS standard deviations more often than chance (binomial, 1/nranks; the lag floor
# makes chance rarer still: the test is conservative), one-sided p ~ 0.02 at 2; and in at least
# MIN_LATE_READS of them, so a handful of collectives is no evidence.
LATE_SDS = 2.0
MIN_LATE_READS = 5


def find(collectives, addrs: set, addr_procs: dict, min_lag_ns: int):
    """The process at the receiving end (addrs) of the retransmits if it is a late reader (by
    min_lag_ns): (its arrival, the collectives it was late to, the collectives with retransmits into
    addrs); None if it is not."""
    # The receiving end's processes: those whose own sockets used the address. A rank that never
    # retransmitted has no such socket in the recording: then any process but the senders.
    procs = set().union(*(addr_procs.get(a, set()) for a in addrs))
    probed, senders = [], set()
    for c in collectives:
        into = [a for a in c.arrivals if any(n and link.partition("\u2192")[2] in addrs
                                             for link, n in (a.links or {}).items())]
        if into:
            probed.append(c)
            senders |= {(a.node, a.pid) for a in into}
    left_late = _left_late(collectives)
    late: dict[tuple, list] = defaultdict(list)
    for c in probed:
        key = (c.last.node, c.last.pid)
        if (key in procs if procs else key not in senders) and c.lag_ns - left_late(c.last) >= min_lag_ns:
            late[key].append(c)
    if not late:
        return None
    mine = max(late.values(), key=len)
    p = 1 / max(2, max(c.nranks for c in probed))
    chance = len(probed) * p
    if len(mine) >= MIN_LATE_READS and len(mine) >= chance + LATE_SDS * (chance * (1 - p)) ** 0.5:
        return mine[0].last, mine, probed
    return None


def _left_late(collectives):
    """f(arrival) -> how late (ns, >= 0) its process left its previous call: that call's end
    after its collective's median end; 0 where the previous call is not in the collectives."""
    calls: dict[tuple, list] = defaultdict(list)   # process -> [(start, late leaving)], sorted
    for c in collectives:
        med_end = statistics.median(a.end for a in c.arrivals)
        for a in c.arrivals:
            calls[(a.node, a.pid)].append((a.start, max(0, int(a.end - med_end))))
    for v in calls.values():
        v.sort()

    def left_late(a) -> int:
        mine = calls.get((a.node, a.pid), [])
        i = bisect.bisect_left(mine, (a.start, -1)) - 1
        return mine[i][1] if i >= 0 else 0
    return left_late


def lines(late, who, links: str, min_lag_ns: int, cpu_share: float) -> list[str]:
    """The verdict naming a late reader (find's answer), its links' retransmits the victims, and
    its run-queue waits: starved of CPU when they exceed the other ranks' by cpu_share of its lag
    (as explain's check 1)."""
    a, mine, probed = late
    comms = defaultdict(int)   # named in its largest communicator (its rank there: usually the world's)
    for c in mine:
        comms[(c.nranks, c.comm)] += 1
    comm = max(comms, key=lambda k: (k[0], comms[k]))[1]
    rank = next(c.last.rank for c in mine if c.comm == comm)
    node = a.node
    lag = statistics.median(c.lag_ns for c in mine)
    out = [f"straggler: rank {rank} on {node} arrives late (comm {comm[:8]}…) and its peers retransmit to it: "
             f"it arrived last in {len(mine)} of the {len(probed)} collectives whose windows had retransmits "
             f"into its address (median lag {_ms(lag)}): probes of a late reader, not a lossy link",
             f"{who(a.node, a.pid)}: last in {len(mine)} of {len(probed)} collectives with retransmits into it, "
             f"each at least {_ms(min_lag_ns)} after the median arrival; {links}",
             "a lossy link delays data inside the calls, after its receiver arrived: its receiver is not the "
             "late arriver"]
    if all(c.last.runq_measured for c in mine):
        waited = sum(c.last.runq_wait_ns for c in mine) / len(mine)
        usual = statistics.median(statistics.median([x.runq_wait_ns for x in c.arrivals if x is not c.last])
                                  for c in mine)
        estimated = " (--sched totals: each second's wait spread over its collectives)" \
            if any(c.last.runq_estimated for c in mine) else ""
        out.append(f"its caller and proxy threads waited {_ms(waited)} for a CPU per collective it was last in "
                     f"(the other ranks: {_ms(usual)}){estimated}")
        if waited - usual >= cpu_share * lag:
            out[0] = (f"straggler: rank {rank} on {node} is starved of CPU: it arrives late (comm {comm[:8]}…, "
                        f"median lag {_ms(lag)}) waiting {_ms(waited)} for a CPU per collective, and its peers "
                        f"retransmit to it (probes of a late reader, not a lossy link)")
    return out
