"""explain's check 1 (a late arriver) on collectives built by hand: last twice as often as
chance counts the ranks that arrived, not the communicator's size."""

from __future__ import annotations

from collections import defaultdict

from exporter.offline.analysis import explain
from exporter.offline.analysis.stragglers import Arrival, Collective, per_rank

MS = 1_000_000


def collectives(order_of, n: int, nranks: int = 4) -> list[Collective]:
    """n AllReduces of a 4-rank communicator; order_of(i): the ranks that arrived, in order,
    each 3 ms after the one before."""
    out = []
    for i in range(n):
        t0 = i * 100 * MS
        arr = [Arrival(r, "node", 100 + r, 100 + r, t0 + k * 3 * MS, t0 + 50 * MS, t0 - 10 * MS, t0 + k * 3 * MS,
                       (t0 - 10 * MS, t0 + 50 * MS), 4096, 0) for k, r in enumerate(order_of(i))]
        out.append(Collective("c0ffee", "ALL_REDUCE", i, nranks, arr))
    return out


def late_arriver(cs):
    by_comm = defaultdict(list)
    for s in per_rank(cs):
        by_comm[(s.comm, s.op)].append(s)
    return explain._late_arriver(by_comm, {k: 4 for k in by_comm})


def test_a_rank_last_half_the_time_of_four_is_named():
    """Every rank arrived; rank 1 last in 10 of 20: 50 %, twice the chance of one in four."""
    s = late_arriver(collectives(lambda i: [0, 2, 3, 1] if i % 2 else [0, 1, 3, 2], 20))
    assert s is not None and s.rank == 1 and s.last_share == 0.5


def test_last_half_the_time_of_three_that_came_is_chance():
    """Rank 0 never came (stopped): among the three that did, rank 1 last in 10 of 20 is
    under twice the chance of one in three; no late arriver (a rank that stopped is
    not a straggler of the others: `hang`'s and NcclRankNotJoined's)."""
    s = late_arriver(collectives(lambda i: [2, 3, 1] if i % 2 else [1, 3, 2], 20))
    assert s is None


def test_last_always_of_three_that_came_is_named():
    s = late_arriver(collectives(lambda i: [2, 3, 1] if i % 2 else [3, 2, 1], 20))
    assert s is not None and s.rank == 1
