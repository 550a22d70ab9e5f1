"""Label rules and counter/gauge families shared by the collectors of this
package: every family is one of records/metrics.py, built here by name."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from exporter.records import metrics


def rank_label(value: int) -> str:
    """rank / nranks label: the number, or 'unknown' (-1)."""
    return str(value) if value >= 0 else "unknown"


def owner_rank_label(rank_of, pid: int) -> str:
    """A kernel-side series' rank label: the owner's rank, '' when unknown."""
    if not pid:
        return ""
    r = rank_of(pid)
    return "" if r is None or r == -1 else str(r)


def pod_labels(who: dict) -> tuple[str, ...]:
    """The metrics.POD labels of a ProcessTable identity ("" where unknown)."""
    return tuple(who.get(k) or "" for k in metrics.POD)


def optional_label(v) -> str:
    return "" if v is None else str(v)


def empty_family(name: str):
    """An empty counter or gauge family of a metric of the contract (exporter/records/metrics.py)."""
    m = metrics.spec(name)
    make = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[m.kind]
    return make(m.name, m.help, labels=list(m.labels))


def family_of(name: str, values: dict[tuple, float], per_second: int | None = None):
    """A counter or gauge family with one sample per label tuple, in sorted order.
    per_second: the values are integer totals in a unit of which this many make a
    second (ns: 10**9), summed exactly and divided here, once (Histograms says why)."""
    f = empty_family(name)
    for label_values, v in sorted(values.items()):
        f.add_metric(list(label_values), v / per_second if per_second else v)
    return f
