"""Reading the agents for `hang`: the URLs and threshold checked, then one
read of each agent's /metrics, keeping only the series the verdict uses."""

from __future__ import annotations

import math
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from exporter.records import contract, metrics

DEFAULT_THRESHOLD_S = 60.0
READ_TIMEOUT_S = 10.0
INTERVAL_S = 1.0        # between the two reads that give the threads' recent state
MAX_BYTES = 64 << 20    # of one /metrics page


class HangInputError(ValueError):
    """A bad URL or threshold: one line for the user."""


def default_url() -> str:
    return f"http://127.0.0.1:{contract.DEFAULT_PORT}/metrics"


def check_url(url) -> str:
    u = urllib.parse.urlsplit(url if isinstance(url, str) else "")
    if u.scheme not in ("http", "https") or not u.hostname:
        raise HangInputError(f"an http(s) URL of an agent's /metrics is needed, e.g. "
                             f"http://gpu-017:{contract.DEFAULT_PORT}/metrics, not {url!r}")
    return url


def check_threshold(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise HangInputError(f"threshold: seconds >= 0, not {value!r}")
    return float(value)



WANTED = {metrics.COMMUNICATOR_INFO, metrics.INFLIGHT_OLDEST, metrics.INFLIGHT_STOPPED, metrics.COLLECTIVE_LAST_SEQ,
          metrics.COLLECTIVE_LAST_RETURN, metrics.OFFCPU, metrics.RUNQUEUE_DELAY + "_sum",
          metrics.GPU_INFLIGHT_OLDEST}


@dataclass
class Read:
    """The samples of interest of one read of several agents."""
    at: float                                   # unix time of the read
    samples: list[tuple[str, dict, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # "URL: why"
    answered: list[str] = field(default_factory=list)


def read(urls: list[str], timeout: float = READ_TIMEOUT_S) -> Read:
    from prometheus_client.parser import text_string_to_metric_families

    out = Read(at=time.time())
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                text = r.read(MAX_BYTES).decode("utf-8", "replace")
        except (OSError, ValueError) as e:
            out.errors.append(f"{url}: {getattr(e, 'reason', None) or e}")
            continue
        try:
            got = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
                   for s in fam.samples if s.name in WANTED]
        except ValueError as e:
            out.errors.append(f"{url}: not a Prometheus exposition ({e})")
            continue
        out.samples += got
        out.answered.append(url)
    return out
