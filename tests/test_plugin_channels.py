"""An operation's KernelCh channels in the plugin's bookkeeping (plugin/gpu.c):
the channel bitsets are also the counts (one atomic per KernelCh start and
stop), the first start's and the last stop's work is claimed once, and a
new operation takes the slot freed last. NCCL's side is played in Python
(tests/plugin/fake_nccl.py) in a subprocess, through every interface
version (v4 .. v7).

NCCL numbers channels below MAXCHANNELS = 64 (v2.28.9-1 src/include/device.h:86;
the same at v2.27.7, v2.29.7, v2.30.7), one bitset word; the plugin keeps four
words (a descriptor's channelId is a byte), and several words are where two
threads can each see the last stop at once: the claim decides.
"""

from __future__ import annotations

import pytest

from test_plugin_habits_ops import F_EXTRA_CHANNELS, log_records, play

VERSIONS = (4, 5, 6, 7)
WORDS = (0, 70, 130, 200)  # one channel in each bitset word


@pytest.mark.parametrize("version", VERSIONS)
def test_channels_in_every_bitset_word_end_the_operation_once(plugin, version, tmp_path):
    """Channels in all four words, stopped in another order than started and
    interleaved with starts: done once, after the last, with the interval over
    all four and every channel counted."""
    log = tmp_path / "log"
    out = play(plugin, version, """
        ctx = P.init(nranks=8, rank=0)
        h = P.coll(ctx, seq=0, nch=4); P.stop(h)
        t = GPU_T0
        k = {c: P.kch(ctx, h, c, t + c) for c in (0, 130)}
        P.kch_stop(k[130], t + 5000)
        out["after_one"] = P.stats()["completed"]
        k.update({c: P.kch(ctx, h, c, t + 1000 + c) for c in (200, 70)})
        for c in (0, 200):
            P.kch_stop(k[c], t + 6000 + c)
        out["after_three"] = P.stats()["completed"]
        P.kch_stop(k[70], t + 7000)
        P.kch_stop(k[70], t + 9000)  # a second stop of the channel: not counted
        out.update(P.stats())
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(log)})
    assert out["after_one"] == 0 and out["after_three"] == 0, out
    assert out["completed"] == 1 and out["abandoned"] == 0 and out["slots_used"] == 0, out
    done = [r for r in log_records(log) if r["event"] == "done"]
    assert len(done) == 1 and done[0]["channels"] == "4/4/4", done
    assert done[0]["gpu_ns"] == str(7000 - 0) and not int(done[0]["flags"], 16) & F_EXTRA_CHANNELS, done


@pytest.mark.parametrize("version", VERSIONS)
def test_channels_of_one_operation_on_four_threads_end_it_once(plugin, version, tmp_path):
    """Four threads start and stop one channel each (one per bitset word) of
    the same operation at once, 400 operations: each is done exactly once,
    with all four channels and its whole interval (ctypes calls run without
    the GIL: the threads meet inside the plugin)."""
    log = tmp_path / "log"
    out = play(plugin, version, f"""
        import struct, threading
        ctx = P.init(nranks=8, rank=0)
        N, CH = 400, {WORDS!r}
        bar = threading.Barrier(len(CH) + 1)
        cur = {{}}

        def channel(c):
            d = ctypes.create_string_buffer(136)
            a = ctypes.create_string_buffer(8)
            for i in range(N):
                bar.wait()
                desc = P._descr(EV_KERNEL_CH, cur["h"])
                struct.pack_into("<B", desc, 24, c)
                struct.pack_into("<Q", desc, 32, cur["t"] + c)
                ctypes.memmove(d, bytes(desc), 136)
                k = ctypes.c_void_p(0)
                P._start(ctx, ctypes.byref(k), d)
                struct.pack_into("<Q", a, 0, cur["t"] + 10_000 + c)
                P._record(k.value, ST_KERNEL_CH_STOP, a)
                P._stop(k.value)
                bar.wait()

        ts = [threading.Thread(target=channel, args=(c,)) for c in CH]
        for th in ts:
            th.start()
        for i in range(N):
            cur["h"] = P.coll(ctx, seq=i, nch=len(CH)); P.stop(cur["h"])
            cur["t"] = GPU_T0 + i * 1_000_000
            bar.wait()
            bar.wait()
        for th in ts:
            th.join()
        out.update(P.stats())
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(log)})
    assert out["completed"] == 400 and out["abandoned"] == 0 and out["stale"] == 0, out
    assert out["slots_used"] == 0, out
    done = [r for r in log_records(log) if r["event"] == "done"]
    assert len(done) == 400 and {r["channels"] for r in done} == {"4/4/4"}, done[:3]
    assert {r["gpu_ns"] for r in done} == {str(10_000 + 200 - 0)}, {r["gpu_ns"] for r in done}
    assert len({r["seq"] for r in done}) == 400


@pytest.mark.parametrize("version", VERSIONS)
def test_a_stale_kernelch_handle_into_the_reused_slot_is_ignored(plugin, version, tmp_path):
    """A new operation takes the slot the last one freed (in cache): the old
    operation's KernelCh handle, used again (NCCL <= 2.30's stale
    sub->kernelEventHandle, docs/plugin.md "NCCL habits"), carries the old
    generation and changes nothing in the new operation."""
    log = tmp_path / "log"
    out = play(plugin, version, """
        ctx = P.init(nranks=8, rank=0)
        a = P.coll(ctx, seq=0, nch=1); P.stop(a)
        ka = P.kch(ctx, a, 3, GPU_T0)
        P.kch_stop(ka, GPU_T0 + 1000)
        b = P.coll(ctx, seq=1, nch=1); P.stop(b)
        out["same_slot"] = (a >> 9) & 0x7fffff == (b >> 9) & 0x7fffff and a != b
        kb = P.kch(ctx, b, 3, GPU_T0 + 10_000)
        P.kch_stop(ka, GPU_T0 + 10_000_000)  # through the old operation's handle
        out["b_done_early"] = P.stats()["completed"] == 2
        P.kch_stop(kb, GPU_T0 + 12_000)
        out.update(P.stats())
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_LOG": str(log)})
    assert out["same_slot"], out
    assert not out["b_done_early"] and out["completed"] == 2 and out["stale"] == 1, out
    done = [r for r in log_records(log) if r["event"] == "done"]
    assert [r["gpu_ns"] for r in done] == ["1000", "2000"] and [r["seq"] for r in done] == ["0", "1"], done


@pytest.mark.parametrize("version", VERSIONS)
def test_an_operation_in_the_reused_slot_of_an_idle_job_is_swept(plugin, version, tmp_path):
    """The announcer sweeps an idle job's records when operations started
    since its last sweep (docs/plugin.md, "Events never stopped"): one that
    took the slot freed last, lost a channel and is the job's last is still
    ended within SETTLE_MS and a quarter of it, with no other operation after it."""
    out = play(plugin, version, """
        ctx = P.init(nranks=8, rank=0)
        a = P.coll(ctx, seq=0, nch=1); P.stop(a)
        P.kch_stop(P.kch(ctx, a, 0, GPU_T0), GPU_T0 + 1000)
        time.sleep(0.4)  # the announcer's sweeps find nothing in flight
        b = P.coll(ctx, seq=1, nch=2); P.stop(b)
        out["same_slot"] = (a >> 9) & 0x7fffff == (b >> 9) & 0x7fffff
        P.kch_stop(P.kch(ctx, b, 0, GPU_T0 + 10_000), GPU_T0 + 11_000)  # channel 1 never comes
        t0 = time.monotonic()
        while P.stats()["completed"] < 2 and time.monotonic() - t0 < 3:
            time.sleep(0.02)
        out["ended_after_s"] = time.monotonic() - t0
        out.update(P.stats())
        P.finalize(ctx)
    """, env={"NCCL_EXPORTER_PROFILER_SETTLE_MS": "200"})
    assert out["same_slot"], out
    assert out["completed"] == 2 and out["ended_after_s"] < 1.0, out
