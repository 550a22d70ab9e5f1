import io
import re

import pytest

from exporter.agent import preflight
from tests.fixtures.paths import REPO


def _by_name(checks):
    return {c.name: c for c in checks}


@pytest.fixture
def fake_tracefs(tmp_path):
    root = tmp_path / "tracing"
    for tp in preflight.TRACEPOINTS:
        (root / "events" / tp).mkdir(parents=True)
    (root / "uprobe_events").write_text("")
    return root


@pytest.fixture
def fake_modules(tmp_path):
    root = tmp_path / "modules"
    (root / "6.99.0-test" / "build" / "include").mkdir(parents=True)
    return root


@pytest.mark.require_root
def test_real_host_required_checks_pass():
    """As root after `make deps`, every required check passes on this host."""
    out = io.StringIO()
    rc = preflight.main(out=out)
    text = out.getvalue()
    assert rc == 0, text
    lines = text.splitlines()
    assert len(lines) == len(preflight.run_checks()) + 1
    assert lines[-1].startswith("all required checks passed")
    checks = _by_name(preflight.run_checks())
    assert checks["bpf syscall"].ok and checks["bcc module"].ok
    assert not checks["nccl libraries"].required


def test_all_ok_with_fakes(fake_tracefs, fake_modules, tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000280004\n")  # SYS_ADMIN, SYS_PTRACE, DAC_READ_SEARCH
    checks = preflight.run_checks(
        tracefs_roots=[str(fake_tracefs)], modules_root=str(fake_modules),
        kernel_release="6.99.0-test", euid=1000, status_path=str(status),
        bpf_probe=lambda: (True, "fine"))
    by = _by_name(checks)
    for name in ("privileges", "bpf syscall", "tracefs", "uprobes", "tracepoints", "kernel headers"):
        assert by[name].ok, by[name]
    assert by["privileges"].detail == "uid 1000 with CAP_SYS_ADMIN CAP_SYS_PTRACE CAP_DAC_READ_SEARCH"
    assert by["tracefs"].detail == str(fake_tracefs)


def test_failure_rendering(tmp_path):
    status = tmp_path / "status"
    status.write_text("CapEff:\t0000000000000000\n")
    out = io.StringIO()
    rc = preflight.main(
        out=out, tracefs_roots=[str(tmp_path / "no-tracing")], modules_root=str(tmp_path / "mods"),
        kernel_release="6.18.0-x", btf_path=str(tmp_path / "vmlinux"), euid=1000,
        status_path=str(status), bcc_module="bcc_does_not_exist_xyz",
        bpf_probe=lambda: (False, "bpf(BPF_MAP_CREATE) failed: Operation not permitted (errno 1)"))
    assert rc == 1
    lines = out.getvalue().splitlines()
    by = {l[6:22].strip(): l for l in lines[:-1]}  # status(6) + name column(16)
    assert by["kernel headers"] == (
        f"FAIL  kernel headers  {tmp_path}/mods/6.18.0-x/build missing — run 'make deps' "
        "(installs linux-headers-amd64 and links them)")
    assert by["tracefs"].startswith("FAIL  tracefs ") and "mount -t tracefs" in by["tracefs"]
    assert by["uprobes"].startswith("FAIL") and by["tracepoints"].startswith("FAIL")
    assert by["privileges"].startswith("FAIL") and "run as root" in by["privileges"]
    assert by["bpf syscall"].startswith("FAIL") and "Operation not permitted" in by["bpf syscall"]
    assert by["bcc module"].startswith("FAIL") and "python3-bpfcc" in by["bcc module"]
    assert by["btf"].startswith("warn  btf")  # optional: warn, not FAIL
    assert lines[-1].startswith("7 required checks failed: privileges, bpf syscall, tracefs")


def test_missing_uprobes_and_tracepoint(fake_tracefs):
    (fake_tracefs / "uprobe_events").unlink()
    (fake_tracefs / "events" / "tcp" / "tcp_retransmit_skb").rmdir()
    by = _by_name(preflight.run_checks(tracefs_roots=[str(fake_tracefs)]))
    assert by["tracefs"].ok
    assert not by["uprobes"].ok and "CONFIG_UPROBE_EVENTS" in by["uprobes"].detail
    assert not by["tracepoints"].ok
    assert by["tracepoints"].detail.startswith("missing tcp/tcp_retransmit_skb under")


def test_missing_signal_deliver_tracepoint(fake_tracefs):
    """NcclRankDied needs the signal a rank died of (bpf/nccl.c, signal_deliver)."""
    (fake_tracefs / "events" / "signal" / "signal_deliver").rmdir()
    c = _by_name(preflight.run_checks(tracefs_roots=[str(fake_tracefs)]))["tracepoints"]
    assert not c.ok and c.detail.startswith("missing signal/signal_deliver under"), c.detail


def test_every_tracepoint_the_bpf_programs_attach_is_checked():
    """A tracepoint a BPF file attaches but `check` does not look for fails the
    agent's load on a host `check` called fine (it happened: four were missing)."""
    attached = set()
    for c in (REPO / "bpf").glob("*.c"):
        attached |= {f"{cat}/{name}" for cat, name in
                     re.findall(r"^TRACEPOINT_PROBE\((\w+),\s*(\w+)\)", c.read_text(), re.M)}
    assert attached, "no TRACEPOINT_PROBE found: the pattern no longer matches bpf/*.c"
    assert attached == set(preflight.TRACEPOINTS), (
        f"attached, not checked: {sorted(attached - set(preflight.TRACEPOINTS))}; "
        f"checked, not attached: {sorted(set(preflight.TRACEPOINTS) - attached)}")


def test_second_tracefs_root_is_used(tmp_path, fake_tracefs):
    c = preflight.check_tracefs([str(tmp_path / "absent"), str(fake_tracefs)])
    assert c.ok and c.detail == str(fake_tracefs)


def test_headers_dir_without_include(tmp_path):
    (tmp_path / "5.0" / "build").mkdir(parents=True)
    c = preflight.check_kernel_headers(str(tmp_path), "5.0")
    assert not c.ok and c.required and "build/include missing" in c.detail


def test_privileges_are_the_capabilities_whatever_the_uid(tmp_path):
    """Root in a container has only what the runtime granted: the check reads
    the effective set, names each missing capability and what fails without it."""
    status = tmp_path / "status"
    status.write_text("CapEff:\t0000000000280004\n")  # SYS_ADMIN, SYS_PTRACE, DAC_READ_SEARCH
    assert preflight.check_privileges(0, str(status), "6.18.0").ok
    assert preflight.check_privileges(1000, str(status), "6.18.0").ok
    # kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK: SYS_RESOURCE too
    old = preflight.check_privileges(0, str(status), "5.10.0-28-amd64")
    assert not old.ok and "CAP_SYS_RESOURCE (raise RLIMIT_MEMLOCK" in old.detail
    status.write_text("CapEff:\t000000c000000000\n")  # CAP_BPF + CAP_PERFMON: not enough to attach uprobes
    c = preflight.check_privileges(0, str(status), "6.18.0")
    assert not c.ok and c.detail.startswith("root lacks CAP_SYS_ADMIN (load the BPF programs")
    assert "CAP_SYS_PTRACE (reach other users' processes' files through /proc/<pid>/root" in c.detail
    status.write_text("CapEff:\t000001ffffffffff\n")  # root with everything
    assert preflight.check_privileges(0, str(status), "6.18.0").ok
    assert preflight.required_capabilities("6.18.0") == preflight.CAPABILITIES


def test_headers_from_bcc_kernel_source(tmp_path):
    """The image's fallback: BCC_KERNEL_SOURCE names the tree BCC compiles against."""
    (tmp_path / "kh" / "include").mkdir(parents=True)
    c = preflight.check_kernel_headers(str(tmp_path / "none"), "6.18.0", str(tmp_path / "kh"))
    assert c.ok and c.detail == f"{tmp_path}/kh (BCC_KERNEL_SOURCE)"
    c = preflight.check_kernel_headers(str(tmp_path / "none"), "6.18.0", str(tmp_path / "empty"))
    assert not c.ok and "BCC_KERNEL_SOURCE" in c.detail


def test_nccl_check(fake_nccl_lib, plain_lib, tmp_path):
    empty_proc = tmp_path / "proc"
    empty_proc.mkdir()
    c = preflight.check_nccl((), proc=str(empty_proc))
    assert not c.ok and not c.required
    assert c.detail == "none mapped now; run will attach when a job loads libnccl"
    c = preflight.check_nccl([str(fake_nccl_lib)], proc=str(empty_proc))
    assert c.ok and c.detail == str(fake_nccl_lib)
    c = preflight.check_nccl([str(plain_lib)], proc=str(empty_proc))
    assert not c.ok and c.required and "is not an NCCL library" in c.detail


def test_bpf_probe_for_real(bpf):
    ok, detail = preflight.bpf_map_create_works()
    assert ok, detail


# --- the profiler plugin -----------------------------------------------------------

@pytest.fixture(scope="module")
def built_plugin(tmp_path_factory):
    from exporter.sources.plugin import build
    try:
        return build.build_plugin(tmp_path_factory.mktemp("plugin"))
    except RuntimeError as e:
        pytest.skip(f"cannot build the plugin here: {e}")


def test_plugin_built_loads_and_exports_v7_to_v4(built_plugin):
    by = _by_name(preflight.check_plugin(str(built_plugin)))
    assert by["plugin build"].ok and by["plugin build"].detail.startswith(str(built_plugin))
    assert by["plugin load"].ok and by["plugin load"].detail == "dlopen ok"
    assert by["plugin ifaces"].ok
    assert by["plugin ifaces"].detail == "v7, v6, v5, v4 (NCCL uses the newest one it knows)"
    assert not any(c.required for c in by.values()), "GPU time is optional: the agent runs on host time"


def test_plugin_missing(tmp_path):
    checks = preflight.check_plugin(str(tmp_path / "libnccl-profiler-exporter.so"))
    assert [c.name for c in checks] == ["plugin build", "plugin load", "plugin ifaces"]
    assert not any(c.ok or c.required for c in checks)
    assert "missing — GPU time off (host time only)" in checks[0].detail
    assert "nccl-exporter plugin-path" in checks[0].detail


def test_plugin_that_does_not_load(tmp_path):
    bad = tmp_path / "libnccl-profiler-exporter.so"
    bad.write_text("not an ELF file\n")
    by = _by_name(preflight.check_plugin(str(bad)))
    assert by["plugin build"].ok
    assert not by["plugin load"].ok and by["plugin load"].detail.startswith("dlopen failed: ")
    assert not by["plugin ifaces"].ok and "does not load" in by["plugin ifaces"].detail


def test_library_without_profiler_interfaces(plain_lib):
    by = _by_name(preflight.check_plugin(str(plain_lib)))
    assert by["plugin load"].ok
    assert not by["plugin ifaces"].ok and "exports none of ncclProfiler_v7" in by["plugin ifaces"].detail


def test_plugin_lines_in_the_report(built_plugin, fake_tracefs, fake_modules, tmp_path):
    status = tmp_path / "status"
    status.write_text("CapEff:\t0000000000280004\n")  # the three capabilities of preflight.CAPABILITIES
    out = io.StringIO()
    rc = preflight.main(out=out, tracefs_roots=[str(fake_tracefs)], modules_root=str(fake_modules),
                        kernel_release="6.99.0-test", euid=1000, status_path=str(status),
                        bpf_probe=lambda: (True, "fine"), plugin_path=str(built_plugin))
    lines = out.getvalue().splitlines()
    assert f"ok    plugin build    {built_plugin}" in lines
    assert "ok    plugin load     dlopen ok" in lines
    assert "ok    plugin ifaces   v7, v6, v5, v4 (NCCL uses the newest one it knows)" in lines
    # a missing plugin is optional: a warning, never a failure of `check`
    out = io.StringIO()
    rc2 = preflight.main(out=out, tracefs_roots=[str(fake_tracefs)], modules_root=str(fake_modules),
                         kernel_release="6.99.0-test", euid=1000, status_path=str(status),
                         bpf_probe=lambda: (True, "fine"), plugin_path=str(tmp_path / "absent.so"))
    text = out.getvalue()
    assert "warn  plugin build    " in text and "plugin build" in text.splitlines()[-1]
    assert rc2 == rc


def test_default_plugin_path_is_the_build_output():
    from exporter.sources.plugin import build
    assert preflight.plugin_library() == str(build.default_outdir() / build.LIB_NAME)


def test_scheduler_totals_check(tmp_path):
    """`run --sched totals` needs /proc/<pid>/schedstat: present here, optional."""
    here = preflight.check_schedstat()
    assert here.ok and not here.required, here
    (tmp_path / "self").mkdir()
    gone = preflight.check_schedstat(str(tmp_path))
    assert not gone.ok and not gone.required and "--sched waits" in gone.detail
