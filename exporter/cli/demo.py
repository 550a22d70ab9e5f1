"""`nccl-exporter demo`: the exporter on a simulated 8-rank job (`make demo`).

Eight simulated hosts (network namespaces on one bridge) run a training-like
loop of AllReduce on three communicators through the simulated libnccl.
One rank's link drops packets, another rank computes longer before each
collective. The real exporter (`nccl-exporter run`) watches, and the demo
reads its /metrics like Prometheus would and says what a user should see.

With --gpu the job runs in the simulator's GPU-like mode (calls return once
enqueued, a stream thread runs each collective later) with nccl-exporter's
profiler plugin loaded the way NCCL loads it, and the demo shows host time
and GPU time of the same collectives side by side.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from exporter.agent.start import require_privileges
from exporter.cli.common.options import parse_listen
from exporter.records import contract, histogram, metrics

STRAGGLER_DELAY_MS = 40
COMPUTE_MS = 5  # every rank "computes" this long between collectives
GPU_KERNEL_US = 3000  # --gpu: the simulated GPU spends at least this long on each collective


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="run an 8-rank simulated job with loss and a straggler, "
                                    "and show what the exporter sees",
                       description="Build the simulated libnccl, start a cluster of network namespaces "
                                   "(one per rank, 198.18.0.0/15), drop packets on one rank's link, slow "
                                   "another, run the agent on it, and print what the exporter sees: per-rank "
                                   "call durations, retransmits by link, the straggler. Needs root; removes "
                                   "every namespace and nft table it made, also on Ctrl-C (docs/simulator.md).")
    d.add_argument("--ranks", type=int, default=8, help="ranks, one per simulated host (default 8)")
    d.add_argument("--seconds", type=float, default=30.0, help="how long the job runs (default 30)")
    d.add_argument("--lossy-rank", type=int, default=5, help="rank whose link drops packets (default 5)")
    d.add_argument("--loss-percent", type=int, default=3, help="packet loss on that link (default 3)")
    d.add_argument("--straggler-rank", type=int, default=2,
                   help="rank that computes longer before each collective (default 2)")
    d.add_argument("--gpu", action="store_true",
                   help="run the job in the simulator's GPU-like mode with the profiler plugin, and show "
                        "host time and GPU time side by side")
    d.add_argument("--listen", default=f"127.0.0.1:{contract.DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"where the demo's agent serves /metrics (default 127.0.0.1:{contract.DEFAULT_PORT})")
    d.set_defaults(func=main)


def scrape(url: str) -> list:
    with urllib.request.urlopen(url, timeout=5) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def allreduce_histograms(url: str, name: str = metrics.COLLECTIVE_DURATION) -> dict[tuple[str, str], list[int]]:
    """(comm, rank) -> the kernel's schema-3 slots of ALL_REDUCE in histogram
    family `name` (host time by default), from a protobuf scrape: its native
    histograms give quantiles within 9 % (docs/metrics.md, "The histogram")."""
    from exporter.sinks import protobuf

    req = urllib.request.Request(url, headers={"Accept": protobuf.CONTENT_TYPE})
    with urllib.request.urlopen(req, timeout=5) as r:
        families = protobuf.decode(r.read())
    out = {}
    for fam in families:
        if fam.name != name:
            continue
        for m in fam.metric:
            labels = {lp.name: lp.value for lp in m.label}
            if labels.get("op") == "ALL_REDUCE":
                out[(labels["comm"], labels["rank"])] = protobuf.native_slots(m.histogram, histogram.DURATION)
    return out


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the exporter exited with status {proc.returncode}")
        try:
            # /metrics answers as soon as the port is bound; the probes are
            # attached when the exporter reports them.
            if any(f.name == metrics.EXPORTER_PROBE_ATTACHED and f.samples for f in scrape(url)):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the exporter did not answer on {url} within {timeout:.0f} s")


def main(args) -> int:
    require_privileges()
    from exporter.simulator.build import build_library
    from exporter.simulator.cluster import Cluster, cleanup_stale, start_job

    ranks, lossy, straggler = args.ranks, args.lossy_rank, args.straggler_rank
    if ranks < 4:
        print("nccl-exporter: error: the demo needs at least 4 ranks", file=sys.stderr)
        return 2
    for name, r in (("--lossy-rank", lossy), ("--straggler-rank", straggler)):
        if not 0 <= r < ranks:
            print(f"nccl-exporter: error: {name} {r} is not a rank of 0..{ranks - 1}", file=sys.stderr)
            return 2
    host, port = parse_listen(args.listen)
    url = f"http://{host}:{port}/metrics"

    cleanup_stale()
    lib = build_library()
    print(f"simulated libnccl: {lib}")
    gpu_env = {}
    if args.gpu:
        from exporter.sources.plugin.build import build_plugin

        plugin = build_plugin()  # where `run` attaches it
        print(f"GPU-like mode, profiler plugin: {plugin}")
        gpu_env = {"NCCL_SIM_GPU": "1", "NCCL_SIM_GPU_KERNEL_US": str(GPU_KERNEL_US),
                   "NCCL_PROFILER_PLUGIN": str(plugin)}
    work = Path(tempfile.mkdtemp(prefix="nccl-demo-"))
    exporter = subprocess.Popen(
        [sys.executable, "-m", "exporter", "run", "--listen", f"{host}:{port}",
         "--node", "demo-node", "--nccl-lib", str(lib), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=open(work / "exporter.log", "wb"),
    )
    try:
        wait_for(url, exporter)
        print(f"exporter running: {url}  (curl it while the job runs)")
        with Cluster(ranks) as cluster:
            cluster.set_loss(lossy, args.loss_percent)
            print(f"{ranks} simulated hosts 198.18.0.1-{ranks}; {args.loss_percent}% packet loss on "
                  f"rank {lossy}'s link; rank {straggler} computes {STRAGGLER_DELAY_MS} ms longer "
                  f"before each collective")
            delays = {r: COMPUTE_MS for r in range(ranks)}
            delays[straggler] += STRAGGLER_DELAY_MS
            if args.gpu:
                # enqueue, "compute", synchronize the stream every 5 iterations: an
                # iteration takes about the straggler's compute plus one kernel
                per_iteration_s = (COMPUTE_MS + STRAGGLER_DELAY_MS + GPU_KERNEL_US / 1000) / 1000
                job = start_job(cluster, lib, "gpu", iterations=max(10, int(args.seconds / per_iteration_s)),
                                rendezvous_dir=work / "rdv", truth_dir=work / "truth", count=4096,
                                compute_delay_ms=delays, extra_env=gpu_env, extra_args=["--sync-every", "5"])
            else:
                job = start_job(cluster, lib, "train", iterations=1_000_000, rendezvous_dir=work / "rdv",
                                truth_dir=work / "truth", count=65536, compute_delay_ms=delays,
                                extra_env={"NCCL_SIM_DURATION_S": str(args.seconds)})
            started = time.monotonic()
            while any(rc is None for rc in job.poll()):
                elapsed = time.monotonic() - started
                if elapsed > args.seconds + 60:
                    job.kill()
                    break
                calls = sum(sum(c) for c in allreduce_histograms(url).values())
                print(f"\r  {elapsed:5.1f} s  AllReduce calls seen by the exporter: {calls}",
                      end="", flush=True)
                time.sleep(1)
            print()
            result = job.result()
            if not result.ok:
                print("the simulated job failed:\n" + result.summary(), file=sys.stderr)
                return 1
        final = scrape(url)
        if args.gpu:
            report_gpu(allreduce_histograms(url), allreduce_histograms(url, metrics.GPU_DURATION), straggler)
        else:
            report(allreduce_histograms(url), ranks, lossy, straggler)
        report_links(final, lossy)
        return 0
    finally:
        exporter.terminate()
        try:
            exporter.wait(10)
        except subprocess.TimeoutExpired:
            exporter.kill()
        for p in sorted(work.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        work.rmdir()


def report(hists, ranks: int, lossy: int, straggler: int) -> None:
    by_comm: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for (comm, rank), counts in hists.items():
        by_comm[comm][rank] = counts
    world = max(by_comm, key=lambda c: len(by_comm[c]))
    print(f"\nAllReduce on the world communicator {world} ({ranks} ranks), from /metrics:")
    print("  rank   calls      p50       p99")
    p50s = {}
    for rank in sorted(by_comm[world], key=lambda r: int(r) if r.isdigit() else 1 << 30):
        counts = by_comm[world][rank]
        p50, p99 = histogram.quantile(counts, 0.5), histogram.quantile(counts, 0.99)
        p50s[rank] = p50
        note = ""
        if rank == str(lossy):
            note = "  <- lossy link"
        elif rank == str(straggler):
            note = "  <- straggler"
        print(f"  {rank:>4} {sum(counts):7d} {p50 * 1e3:8.1f} ms {p99 * 1e3:8.1f} ms{note}")
    fastest = min(p50s, key=p50s.get)
    print(
        f"\nWhat this says: in a synchronous collective every rank waits for the last to arrive.\n"
        f"  * rank {straggler} arrives last (it computes {STRAGGLER_DELAY_MS} ms longer), so its own calls "
        f"are the SHORTEST\n    (lowest p50: rank {fastest}); the others' calls include the wait for it.\n"
        f"  * rank {lossy}'s lossy link slows the whole communicator alike: the p99 of every rank\n"
        f"    rises together (TCP retransmission timeouts), not only rank {lossy}'s."
    )


def report_gpu(host, gpu, straggler: int) -> None:
    """Host time and GPU time of the world communicator's AllReduce, per rank."""
    comms: dict[str, set] = defaultdict(set)
    for comm, rank in host:
        comms[comm].add(rank)
    world = max(comms, key=lambda c: len(comms[c]))
    print(f"\nAllReduce on the world communicator {world}, host time and GPU time, from /metrics:")
    print("  rank   calls   host p50   host p99  |  on GPU   GPU p50    GPU p99")
    for rank in sorted(comms[world], key=lambda r: int(r) if r.isdigit() else 1 << 30):
        h, g = host[(world, rank)], gpu.get((world, rank))
        gpu_cols = (f"{sum(g):7d} {histogram.quantile(g, 0.5) * 1e3:7.2f} ms "
                    f"{histogram.quantile(g, 0.99) * 1e3:7.2f} ms"
                    if g else "      -  (no GPU series: the plugin did not load)")
        note = "  <- straggler" if rank == str(straggler) else ""
        print(f"  {rank:>4} {sum(h):7d} {histogram.quantile(h, 0.5) * 1e3:7.3f} ms "
              f"{histogram.quantile(h, 0.99) * 1e3:7.3f} ms"
              f"  | {gpu_cols}{note}")
    print(
        f"\nWhat this says: on a GPU, ncclAllReduce returns once the collective is enqueued on the\n"
        f"  stream, so host time (the uprobes) is the enqueue, microseconds; the collective itself runs\n"
        f"  later on the GPU (at least {GPU_KERNEL_US / 1000:g} ms here), measured by the profiler plugin:\n"
        f"  nccl_collective_gpu_duration_seconds. Alerts, the straggler rule and the hang alert use GPU\n"
        f"  time where the plugin is active (label clock=\"gpu\"), host time elsewhere.")


def report_links(families, lossy: int) -> None:
    """Retransmits per link from /metrics, and which host they point at."""
    links: dict[tuple[str, str, str], float] = defaultdict(float)
    for fam in families:
        for s in fam.samples:
            if s.name == metrics.TCP_RETRANSMITS:
                links[(s.labels["saddr"], s.labels["daddr"], s.labels["rank"])] += s.value
    if not links:
        print("\nNo TCP retransmits were seen.")
        return
    print("\nTCP retransmits by link (socket owner's rank), from /metrics:")
    for (saddr, daddr, rank), n in sorted(links.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {saddr:>12} -> {daddr:<12} rank {rank or '-':>2}  {int(n)}")
    per_host: dict[str, float] = defaultdict(float)
    for (saddr, daddr, _rank), n in links.items():
        per_host[saddr] += n
        per_host[daddr] += n
    host = max(per_host, key=per_host.get)
    rank = int(host.rsplit(".", 1)[-1]) - 1  # simulated host i is 198.18.0.(i+1), running rank i
    print(f"Verdict: {host} is on {int(per_host[host])} of {int(sum(links.values()))} retransmits: "
          f"rank {rank}'s link (the demo put the loss on rank {lossy}).\n"
          f"  Links into the straggler show some too, with no loss: tail-loss probes while it reads late.")
