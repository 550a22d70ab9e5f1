"""Bad input and unusable hosts: one clear line on stderr, no traceback, exit != 0.

Every case runs the real CLI as a subprocess.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

from conftest import CLI, free_port, run_cli

TRACEFS_DIRS = ("/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events")


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The CLI failed with exactly one `nccl-exporter: error: ...` line on stderr."""
    err = result.stderr
    assert "Traceback" not in err, err
    assert result.returncode != 0, (result.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    line = lines[0]
    assert line.startswith("nccl-exporter: error: "), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def _listen() -> str:
    return f"127.0.0.1:{free_port()}"


# --- libraries ---------------------------------------------------------------------------

def test_nccl_lib_not_nccl(bpf):
    r = run_cli("run", "--listen", _listen(), "--nccl-lib", "/bin/ls")
    assert_one_line_error(r, "/bin/ls", "not an NCCL library")


def test_nccl_lib_missing(bpf):
    r = run_cli("run", "--listen", _listen(), "--nccl-lib", "/nonexistent")
    assert_one_line_error(r, "/nonexistent", "No such file")


# --- listening ---------------------------------------------------------------------------

def test_port_in_use():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("run", "--listen", f"127.0.0.1:{port}", "--nccl-lib", "/nonexistent")
    assert_one_line_error(r, f"127.0.0.1:{port}", "in use")


@pytest.mark.parametrize("value,fragment", [
    ("nope", "expected HOST:PORT"),
    ("127.0.0.1:http", "expected HOST:PORT"),
    ("127.0.0.1:", "expected HOST:PORT"),
    ("127.0.0.1:0", "port must be 1-65535"),
    ("127.0.0.1:70000", "port must be 1-65535"),
    ("no-such-host.invalid:9999", "cannot listen on"),
])
def test_bad_listen(value, fragment):
    r = run_cli("run", "--listen", value, "--nccl-lib", "/nonexistent")
    assert_one_line_error(r, fragment)


# --- config file -------------------------------------------------------------------------

@pytest.mark.parametrize("text,fragments", [
    ('nodee = "gpu-1"\n', ["unknown key(s) nodee", "known: db, histogram_resolution,", "listen, log_format, "
                                                                                     "log_level, nccl_lib, node"]),
    ('log_format = "xml"\n', ["log_format 'xml'", "one of text, json"]),
    ('log_level = "verbose"\n', ["log_level 'verbose'", "one of debug, info, warning, error"]),
    ('node = "gpu-1"\nlisten_addr = ":1"\n', ["unknown key(s) listen_addr"]),
    ('node = \n', ["not valid TOML"]),
    ('nccl_libs = 3\n', ["nccl_lib 3", "a string or a list of them"]),
    ('series_ttl = "soon"\n', ["series_ttl 'soon'", "not a duration"]),
    ('protobuf_classic_buckets = "yes"\n', ["protobuf_classic_buckets 'yes'", "true or false"]),
])
def test_bad_config(tmp_path, text, fragments):
    cfg = tmp_path / "nccl-exporter.toml"
    cfg.write_text(text)
    r = run_cli("run", "--config", cfg, "--listen", _listen(), "--nccl-lib", "/nonexistent")
    assert_one_line_error(r, str(cfg), *fragments)


def test_missing_config(tmp_path):
    cfg = tmp_path / "absent.toml"
    r = run_cli("run", "--config", cfg, "--listen", _listen())
    assert_one_line_error(r, str(cfg), "does not exist")


# --- argument syntax -------------------------------------------------------------------

@pytest.mark.parametrize("value", ["10x", "-1", "", "1.5.2s", "ten"])
def test_bad_trace_duration(value):
    r = run_cli("trace", "--duration", value)
    assert_one_line_error(r, "--duration", "not a duration", "nccl-exporter trace --help")


def test_trace_pid_of_no_process():
    r = run_cli("trace", "--pid", "999999999", "--duration", "1s")
    assert r.returncode == 2
    assert_one_line_error(r, "--pid 999999999: no such process")


def test_stragglers_filter_matching_nothing(tmp_path):
    """--op/--comm that match no collective: said, with what the recording holds, exit 2."""
    from exporter.records.events import CallEvent
    from exporter.sinks.recording.writer import Recorder

    db = tmp_path / "r.db"
    rec = Recorder(str(db), node="n", identify_processes=False)
    for seq in range(3):
        for rank in range(2):
            t = 1_700_000_000_000_000_000 + seq * 10_000_000 + rank * 1000
            rec(CallEvent(kind=1, op="ALL_REDUCE", pid=100 + rank, tid=100 + rank, start_ns=t, end_ns=t + 5000,
                          start_real_ns=t, comm_ptr=1, comm=0xAB, nccl_comm_hash=0, seq=seq, rank=rank, nranks=2,
                          count=4, bytes=16, datatype=7, red_op=0, root=-1, peer=-1, stream=0, result=0,
                          color=-1))
    rec.close()
    assert run_cli("stragglers", str(db)).returncode == 0
    r = run_cli("stragglers", str(db), "--op", "BROADCAST")
    assert r.returncode == 2
    assert_one_line_error(r, "no collective matches --op BROADCAST", "ALL_REDUCE on 00000000000000ab (6 calls)")
    r = run_cli("stragglers", str(db), "--comm", "ffff")
    assert r.returncode == 2
    assert_one_line_error(r, "no collective matches --comm ffff")


@pytest.mark.parametrize("flag,value,fragment", [
    ("--owner-window", "0", "above 0 or 'always'"),
    ("--owner-window", "soon", "above 0 or 'always'"),
    ("--srtt-sampling", "5s/1s", "WINDOW/PERIOD"),
    ("--idle-detach", "never", "not a duration"),
])
def test_bad_run_duty_cycle(flag, value, fragment):
    r = run_cli("run", flag, value)
    assert_one_line_error(r, flag, fragment, "nccl-exporter run --help")


def test_unknown_command():
    r = run_cli("serve")
    assert_one_line_error(r, "invalid choice: 'serve'")


# --- host -----------------------------------------------------------------------------------

@pytest.mark.require_root
def test_no_privileges():
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) not installed")
    nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    probe = subprocess.run([*nobody, *CLI, "--version"], capture_output=True, text=True,
                           timeout=60, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"the venv is not usable by uid 65534 (make it world-readable): "
                    f"{probe.stderr.strip()[-200:]}")
    r = run_cli("run", "--listen", _listen(), "--nccl-lib", "/nonexistent", prefix=nobody)
    assert_one_line_error(r, "needs CAP_SYS_ADMIN", "as root", "docs/deploy.md")


@pytest.mark.require_root
def test_no_tracefs():
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) not installed")
    host_before = [os.path.isdir(d) for d in TRACEFS_DIRS]
    if not any(host_before):
        pytest.skip("tracefs is not mounted on this host to begin with")
    cli = " ".join(f"'{a}'" for a in CLI)
    script = (
        "umount -l /sys/kernel/tracing 2>/dev/null; "
        "umount -l /sys/kernel/debug/tracing 2>/dev/null; "
        "umount -l /sys/kernel/debug 2>/dev/null; "
        # Only go on when tracefs is really gone in this mount namespace.
        + "".join(f"if [ -e {d} ]; then echo STILL-THERE {d}; exit 97; fi; " for d in TRACEFS_DIRS)
        + "echo TRACEFS-GONE; "
        f"exec {cli} run --listen {_listen()} --nccl-lib /nonexistent"
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 97, r.stdout
    assert "TRACEFS-GONE" in r.stdout, (r.stdout, r.stderr)
    assert_one_line_error(r, "tracefs is not mounted")
    assert [os.path.isdir(d) for d in TRACEFS_DIRS] == host_before, "the host's tracefs changed"
