"""exporter/sinks/protobuf.py: delimited MetricFamily scrapes with native
histograms, the generated code, and the Accept negotiation over real HTTP."""

from __future__ import annotations

import random
import shutil
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from exporter.records import histogram as h
from exporter.records import metrics
from exporter.sinks import protobuf
from exporter.sinks.http import HttpServer
from exporter.sinks.prometheus import Histograms, family_of

PROMETHEUS_242_ACCEPT = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                         "encoding=delimited;q=0.7,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.mark.skipif(shutil.which("protoc") is None or not (protobuf.PROTO_ROOT / protobuf.PROTO_FILE).is_file(),
                    reason="protoc / client_model not installed (make deps)")
def test_generated_code_is_what_protoc_makes():
    assert protobuf.generate(None) == protobuf.GENERATED.read_text()


def test_accept_negotiation():
    assert protobuf.accepts_protobuf(content_type := protobuf.CONTENT_TYPE)
    assert protobuf.accepts_protobuf(PROMETHEUS_242_ACCEPT)
    assert not protobuf.accepts_protobuf("")
    assert not protobuf.accepts_protobuf("text/plain;version=0.0.4")
    assert not protobuf.accepts_protobuf("application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
    assert not protobuf.accepts_protobuf(content_type + ";q=0.2,text/plain;version=0.0.4;q=0.5")
    assert not protobuf.accepts_protobuf("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                                         "encoding=text")


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return list(self.families)


def _registry(series: dict[tuple, list[int]]):
    hist = Histograms(metrics.COLLECTIVE_DURATION, h.DURATION)
    for labels, counts in series.items():
        hist.add(labels, counts, 250_000_000)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([hist.family(),
                                 family_of(metrics.COLLECTIVE_BYTES, {("n", "ALL_REDUCE", "c", "0"): 7})]))
    return registry


def test_native_histogram_round_trip():
    rng = random.Random(3)
    series = {}
    for rank in range(4):
        counts = [0] * h.DURATION.slots
        for _ in range(500):
            counts[h.bucket_of(int(2 ** rng.uniform(9, 38)))] += 1
        series[("n", "ALL_REDUCE", "c", str(rank))] = counts
    fams = {f.name: f for f in protobuf.decode(protobuf.encode(_registry(series)))}
    hist = fams["nccl_collective_duration_seconds"]
    assert len(hist.metric) == 4
    for m in hist.metric:
        labels = tuple(lp.value for lp in m.label)
        want = series[labels]
        nh = m.histogram
        assert nh.schema == 3 and nh.zero_threshold == 2.0 ** -20
        assert nh.sample_count == sum(want) and nh.sample_sum == 0.25
        assert protobuf.native_slots(nh, h.DURATION) == want
        assert not nh.bucket  # no classic buckets unless asked
    counter = fams["nccl_collective_bytes_total"]
    assert counter.type == protobuf.pb.COUNTER and counter.metric[0].counter.value == 7


def test_classic_buckets_on_request_match_the_text_scrape():
    counts = [0] * h.DURATION.slots
    counts[0], counts[40], counts[h.DURATION.slots - 1] = 1, 2, 3
    body = protobuf.encode(_registry({("n", "ALL_REDUCE", "c", "0"): counts}), classic=True)
    (nh,) = [f for f in protobuf.decode(body) if f.name == "nccl_collective_duration_seconds"][0].metric
    classic = h.CLASSIC["coarse"]
    assert [b.upper_bound for b in nh.histogram.bucket] == classic.le_seconds(h.DURATION)
    assert [b.cumulative_count for b in nh.histogram.bucket] == classic.cumulative(h.DURATION, counts)[:-1]


def test_http_serves_protobuf_to_a_protobuf_accept_and_text_otherwise():
    counts = [0] * h.DURATION.slots
    counts[50] = 5
    server = HttpServer("127.0.0.1", 0, _registry({("n", "ALL_REDUCE", "c", "0"): counts}))
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": PROMETHEUS_242_ACCEPT})) as r:
            assert r.headers["Content-Type"] == protobuf.CONTENT_TYPE
            fams = protobuf.decode(r.read())
        assert {f.name for f in fams} == {"nccl_collective_duration_seconds", "nccl_collective_bytes_total"}
        with urllib.request.urlopen(url) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        # slot 50 is bucket -110, (2^-13.875, 2^-13.75] s: classic le 2^-13 s
        assert 'le="6.103515625e-05",node="n",op="ALL_REDUCE",rank="0"} 0.0' in text
        assert 'le="0.0001220703125",node="n",op="ALL_REDUCE",rank="0"} 5.0' in text
    finally:
        server.shutdown()
