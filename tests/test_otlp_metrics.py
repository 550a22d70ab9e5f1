"""exporter/sinks/otlp_metrics.py: every family over OTLP, histograms as
exponential histograms with the kernel's buckets, into a real receiver that
decodes the OTLP protobuf; the agent end to end against a protobuf scrape."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client import CollectorRegistry

from exporter.records import histogram as h
from exporter.records import metrics
from exporter.sinks import protobuf
from exporter.sinks.otlp_metrics import OtlpMetricsPusher, StartTimes, default_interval_s, make_metric_exporter
from exporter.sinks.prometheus import Histograms, family_of
from otlp_receiver import MetricsReceiver


class _Families:
    def __init__(self):
        self.counts = [0] * h.DURATION.slots
        self.bytes = 0

    def collect(self):
        hist = Histograms(metrics.COLLECTIVE_DURATION, h.DURATION)
        hist.add(("n", "ALL_REDUCE", "c", "0"), list(self.counts), 500_000_000)
        return [hist.family(), family_of(metrics.COLLECTIVE_BYTES, {("n", "ALL_REDUCE", "c", "0"): self.bytes})]


def _otel_to_slots(dp, layout) -> list[int]:
    """An OTLP exponential data point back into slots: OTLP index i is Prometheus index i + 1."""
    slots = [0] * layout.slots
    slots[0] = dp.zero_count
    for k, n in enumerate(dp.positive.bucket_counts):
        prom_index = dp.positive.offset + k + 1
        slots[min(prom_index - h.ZERO_INDEX, layout.slots - 1)] += n
    return slots


def test_offset_is_prometheus_minus_one_and_counts_exact():
    fams = _Families()
    fams.counts[0], fams.counts[40], fams.counts[43], fams.counts[h.DURATION.slots - 1] = 2, 3, 4, 5
    fams.bytes = 100
    registry = CollectorRegistry(auto_describe=False)
    registry.register(fams)
    with MetricsReceiver() as rx:
        pusher = OtlpMetricsPusher(registry, make_metric_exporter("grpc", rx.endpoint), "n", 3600)
        try:
            assert pusher.export_now()
            resource, got = rx.latest()
            assert resource["service.name"] == "nccl-exporter" and resource["node"] == "n"
            (dp,) = got["nccl_collective_duration_seconds"].exponential_histogram.data_points
            assert dp.scale == 3 and dp.zero_count == 2 and dp.count == 14 and dp.sum == 0.5
            # slot 40 is Prometheus bucket -120 = (2^-15.125, 2^-15] s: OTLP bucket -121
            assert dp.positive.offset == h.DURATION.index_of_slot(40) - 1 == -121
            assert list(dp.positive.bucket_counts[:4]) == [3, 0, 0, 4]
            # the same counts as the native histogram of a protobuf scrape
            body = protobuf.encode(registry)
            (nh,) = [m.histogram for f in protobuf.decode(body) if f.name == "nccl_collective_duration_seconds"
                     for m in f.metric]
            assert _otel_to_slots(dp, h.DURATION) == protobuf.native_slots(nh, h.DURATION) == fams.counts
            assert nh.positive_span[0].offset == dp.positive.offset + 1
            (s,) = got["nccl_collective_bytes"].sum.data_points
            assert got["nccl_collective_bytes"].sum.is_monotonic and getattr(s, s.WhichOneof("value")) == 100
            first_start = s.start_time_unix_nano
            # a counter reset (a series that expired and came back): a new start time
            fams.bytes = 10
            assert pusher.export_now()
            (s,) = rx.latest()[1]["nccl_collective_bytes"].sum.data_points
            assert getattr(s, s.WhichOneof("value")) == 10 and s.start_time_unix_nano > first_start
        finally:
            pusher.shutdown()


def test_start_times_and_interval():
    st = StartTimes(100)
    assert st.of(("a",), 5, 200) == 100
    assert st.of(("a",), 7, 300) == 100
    assert st.of(("a",), 1, 400) == 400  # reset
    assert default_interval_s({"OTEL_METRIC_EXPORT_INTERVAL": "15000"}) == 15
    assert default_interval_s({}) == 60


def test_agent_pushes_what_a_scrape_shows(tmp_path, bpf, netns, simulator_lib):
    """The agent with --otlp-metrics-endpoint on a simulated job: the last
    export after the job ended holds exactly the scrape's counts and buckets,
    and after the series expire (--series-ttl) neither holds them."""
    from exporter.simulator.cluster import Cluster, run_job
    from conftest import ExporterProcess

    lib = simulator_lib
    with MetricsReceiver() as rx, ExporterProcess(
            nccl_libs=[lib], extra_args=["--otlp-metrics-endpoint", rx.endpoint, "--otlp-metrics-interval", "1s",
                                         "--series-ttl", "6s"]) as exporter, Cluster(2) as cluster:
        res = run_job(cluster, lib, "allreduce", iterations=50, rendezvous_dir=tmp_path / "rdv",
                      truth_dir=tmp_path / "truth", timeout=60)
        assert res.ok, res.summary()
        time.sleep(1.5)
        req = urllib.request.Request(f"http://127.0.0.1:{exporter.port}/metrics",
                                     headers={"Accept": protobuf.CONTENT_TYPE})
        with urllib.request.urlopen(req) as r:
            scraped = {tuple(lp.value for lp in m.label): protobuf.native_slots(m.histogram, h.DURATION)
                       for f in protobuf.decode(r.read()) if f.name == "nccl_collective_duration_seconds"
                       for m in f.metric}
        n = len(rx.requests)
        deadline = time.monotonic() + 10
        while len(rx.requests) <= n and time.monotonic() < deadline:
            time.sleep(0.1)
        _, got = rx.latest()
        pushed = {tuple(a.value.string_value for a in dp.attributes): _otel_to_slots(dp, h.DURATION)
                  for dp in got["nccl_collective_duration_seconds"].exponential_histogram.data_points}
        assert scraped and pushed == scraped
        assert sum(sum(v) for k, v in pushed.items() if "ALL_REDUCE" in k) == 2 * 50
        # the job's communicator ended: its series expire from both after the TTL
        time.sleep(12)
        _, got = rx.latest()
        left = [dp for dp in got.get("nccl_collective_duration_seconds", None).exponential_histogram.data_points
                if any(a.value.string_value == "ALL_REDUCE" for a in dp.attributes)] \
            if "nccl_collective_duration_seconds" in got else []
        assert not left
