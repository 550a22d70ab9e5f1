"""The profiler plugin where the training runs (docs/deploy.md, "Platforms";
docs/plugin.md, "Which glibc"): any glibc >= 2.17, x86-64 and aarch64.

- The built library (each architecture) needs no GLIBC_ version above 2.17,
  and names libdl.so.2 and libpthread.so.0, which define dlopen and
  pthread_create before glibc 2.34 (plugin/glibc_floor.h).
- aarch64: the plugin cross-built with Debian's aarch64-linux-gnu-gcc, driven
  under qemu-aarch64 (Debian's qemu-user, the aarch64 libc of
  libc6-arm64-cross via -L) by the same NCCL stand-in as on x86-64
  (tests/plugin/driver.c, the checks of tests/test_plugin_chain.py) and by the
  simulated libnccl.so.2 (exporter/simulator) through a C harness
  (tests/plugin/sim_harness.c), since no aarch64 Python runs here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from exporter.cbuild import build_shared
from exporter.simulator import build as sim_build
from exporter.sources.plugin import build as plugin_build
from tests.test_plugin_chain import done_by_key, key, run

from conftest import REPO
HELPERS = REPO / "tests" / "plugin"
GLIBC_FLOOR = (2, 17)
AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"  # libc6-arm64-cross
TOOLS = {"x86_64": {"cc": "gcc", "objdump": "objdump", "readelf": "readelf"},
         "aarch64": {"cc": "aarch64-linux-gnu-gcc", "objdump": "aarch64-linux-gnu-objdump",
                     "readelf": "aarch64-linux-gnu-readelf", "exec": ["qemu-aarch64", "-L", AARCH64_SYSROOT]}}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} missing: `make deps` installs it (scripts/setup-system.sh)")
    return path


def glibc_versions(lib: Path, objdump: str = "objdump") -> dict[str, tuple[int, ...]]:
    """{symbol: GLIBC_ version} of every versioned glibc symbol `lib` needs (objdump -T)."""
    out = subprocess.run([tool(objdump), "-T", str(lib)], capture_output=True, text=True, check=True).stdout
    need = {}
    for line in out.splitlines():
        m = re.search(r"\*UND\*\s+\S+\s+\(?GLIBC_([0-9.]+)\)?\s+(\S+)$", line)
        if m:
            need[m.group(2)] = tuple(int(x) for x in m.group(1).split("."))
    return need


def needed(lib: Path, readelf: str = "readelf") -> list[str]:
    out = subprocess.run([tool(readelf), "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(\S+)\]", out)


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """{arch: the plugin built for it}, x86-64 by `make plugin`'s path, aarch64 cross-built."""
    if plugin_build.host_arch() != "x86_64":
        pytest.skip("the cross builds here are from x86-64")
    tool("aarch64-linux-gnu-gcc")
    return {"x86_64": plugin_build.build_plugin(),
            "aarch64": plugin_build.build_plugin(tmp_path_factory.mktemp("aarch64"), "aarch64")}


@pytest.mark.parametrize("arch", ("x86_64", "aarch64"))
def test_plugin_loads_with_glibc_2_17(plugins, arch):
    lib = plugins[arch]
    need = glibc_versions(lib, TOOLS[arch]["objdump"])
    assert "dlopen" in need and "pthread_create" in need, "the parse found the plugin's glibc symbols"
    above = {s: ".".join(map(str, v)) for s, v in need.items() if v > GLIBC_FLOOR}
    assert not above, f"{arch} plugin needs glibc above 2.17 for {above} (plugin/glibc_floor.h)"
    # before glibc 2.34 dlopen and pthread_create are in these, not libc.so.6
    assert {"libdl.so.2", "libpthread.so.0", "libc.so.6"} <= set(needed(lib, TOOLS[arch]["readelf"]))


def test_glibc_check_has_teeth(tmp_path):
    """The same check on a library built without glibc_floor.h finds GLIBC_2.34."""
    src = tmp_path / "t.c"
    src.write_text("#include <pthread.h>\n#include <dlfcn.h>\n"
                   "static void *f(void *a) { return a; }\n"
                   "int g(void) { pthread_t t; void *d = dlopen(\"x\", RTLD_NOW); "
                   "return d != 0 || pthread_create(&t, 0, f, 0); }\n")
    lib = tmp_path / "t.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-pthread", "-o", str(lib), str(src), "-ldl"], check=True)
    assert max(glibc_versions(lib).values()) >= (2, 34)
    subprocess.run(["gcc", "-shared", "-fPIC", "-pthread", "-include", str(REPO / "plugin" / "glibc_floor.h"),
                    "-o", str(lib), str(src), *plugin_build.LIBS], check=True)
    assert max(glibc_versions(lib).values()) <= GLIBC_FLOOR


# --- aarch64 under qemu-aarch64 ---------------------------------------------------

@pytest.fixture(scope="module")
def arm(plugins, tmp_path_factory):
    tool("qemu-aarch64")
    if not Path(AARCH64_SYSROOT, "lib", "ld-linux-aarch64.so.1").exists():
        pytest.fail(f"{AARCH64_SYSROOT} has no aarch64 libc: `make deps` installs libc6-arm64-cross")
    d = tmp_path_factory.mktemp("arm-bins")
    cc = TOOLS["aarch64"]["cc"]
    subprocess.run([cc, "-O2", "-g", "-pthread", "-I", str(REPO / "plugin"), "-o", str(d / "driver"),
                    str(HELPERS / "driver.c"), "-ldl"], check=True)
    subprocess.run([cc, "-O2", "-g", "-pthread", "-o", str(d / "sim_harness"), str(HELPERS / "sim_harness.c"),
                    "-ldl"], check=True)
    sim = build_shared(d / sim_build.LIB_NAME, sim_build.SOURCES, sim_build.CFLAGS, depends=sim_build.HEADERS,
                       cc=cc)
    return {"driver": d / "driver", "harness": d / "sim_harness", "sim": sim, "plugin": plugins["aarch64"],
            "exec": TOOLS["aarch64"]["exec"], "dir": d}


@pytest.mark.parametrize("version", (4, 5, 6, 7))
def test_aarch64_plugin_under_the_driver(arm, tmp_path, version):
    """tests/test_plugin_chain.py's first check, on aarch64: one record per
    operation with the driver's exact GPU interval, count, bytes and rank."""
    res = run(arm, version, "ops", 40, tmp=tmp_path)
    by = done_by_key(res)
    assert len(res["truth"]) == 40 and len(by) == 40
    assert res["stats"]["completed"] == "40" and res["stats"]["dropped"] == "0"
    for t in res["truth"]:
        r = by[key(t)]
        assert int(r["gpu_start_timer"]) == int(t["gpu_start_timer"])
        assert int(r["gpu_stop_timer"]) == int(t["gpu_stop_timer"])
        assert int(r["gpu_ns"]) == int(t["stop_mono"]) - int(t["start_mono"])
        assert (r["count"], r["bytes"], r["rank"]) == (t["count"], t["bytes"], t["rank"])
        assert r["iface"] == f"v{version}"


def test_aarch64_network_waits_under_the_driver(arm, tmp_path):
    """The NET proxy events (v7) on aarch64: records per peer, none dropped."""
    res = run(arm, 7, "net", 20, tmp=tmp_path)
    assert res["stats"]["completed"] == "20" and res["stats"]["dropped"] == "0"
    assert [r for r in res["recs"] if r.get("event") == "done"]


def harness_records(bins: dict, tmp_path: Path, nranks: int, n: int) -> list[dict]:
    log = tmp_path / "plugin.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "DRIVER_"))}
    env.update(NCCL_SIM_GPU="1", NCCL_PROFILER_PLUGIN=str(bins["plugin"]), NCCL_EXPORTER_PROFILER_LOG=str(log))
    p = subprocess.run([*bins.get("exec", ()), str(bins["harness"]), str(bins["sim"]), str(nranks), str(n)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ok "), p.stdout + p.stderr
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in log.read_text().splitlines()]


def test_aarch64_plugin_in_the_simulator(arm, tmp_path):
    """The simulated NCCL (GPU-like mode) loads the aarch64 plugin and calls
    it as NCCL does: every rank's AllReduces come out, in order, with bytes."""
    recs = harness_records(arm, tmp_path, nranks=2, n=8)
    inits = [r for r in recs if r.get("event") == "init"]
    done = [r for r in recs if r.get("event") == "done"]
    assert {r["rank"] for r in inits} == {"0", "1"} and {r["nranks"] for r in inits} == {"2"}
    assert len({r["comm"] for r in inits}) == 1
    for rank in ("0", "1"):
        mine = [r for r in done if r["rank"] == rank]
        assert [int(r["seq"]) for r in mine] == list(range(8)), mine
        assert {(r["op"], r["bytes"], r["count"]) for r in mine} == {("AllReduce", "4096", "1024")}
        assert all(int(r["gpu_ns"]) > 0 for r in mine)


# --- the agent and another architecture's plugin ---------------------------------

def test_the_agent_never_probes_another_architectures_build(plugins, bpf, tmp_path):
    """qemu-user maps its guest's libraries, so an x86-64 process can map the
    aarch64 plugin: the agent's discovery finds it, and a uprobe there would
    write an x86 int3 over an aarch64 instruction (the aarch64 runs under
    qemu died of SIGILL while an agent ran). It is never probed, and
    --nccl-lib refuses another architecture's library in one line."""
    import sys

    from exporter.sources.bpf import ProbeError
    from exporter.sources.nccl import elf, libfind
    from exporter.sources.plugin.source import PluginSource, has_hooks, mapped_plugins

    arm = tmp_path / "libnccl-profiler-exporter.so"
    shutil.copy(plugins["aarch64"], arm)
    assert elf.runs_here(plugins["x86_64"]) and not elf.runs_here(arm)
    assert has_hooks(str(plugins["x86_64"])) and not has_hooks(str(arm))
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys; f = open(sys.argv[1], 'rb'); "
                               "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print('mapped', flush=True); "
                               "sys.stdin.read()", str(arm)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    from exporter.sources.nccl.probes import NcclProbes

    owner = NcclProbes()  # owns the maps plugin.c shares
    source = PluginSource()
    try:
        assert holder.stdout.readline() == "mapped\n"
        assert [os.path.realpath(p) for p in mapped_plugins([holder.pid])] == [str(arm)]
        assert source.discover([holder.pid]) == [] and source.paths == []
        with pytest.raises(ProbeError, match="not code for this machine's CPU"):
            source.attach(str(arm))
        assert source.paths == []
    finally:
        source.close()
        owner.close()
        holder.kill()
        holder.wait()
    with pytest.raises(libfind.LibraryError, match=r"is built for another CPU than this machine's \(x86_64\)"):
        libfind.find_libraries([str(arm)])
