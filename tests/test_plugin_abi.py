"""The profiler plugin's view of NCCL's interface, checked against NCCL itself.

Every struct the plugin declares (plugin/profiler_abi.h: descriptors, state
args and function tables of interface v4, v5, v6, v7) is read back from the
DWARF of the plugin as compiled (gdb `ptype /o` on the built .so) and compared
member by member -- offset, size, and for function pointers the parameter
list -- with the same struct in the DWARF of the real NCCL 2.32.3 library
(the wheel's libnccl.so.2, which carries all four versions for its adapters).
No expected offset is typed into this file.

Also checked: the event-type and state enum values, the exported symbols, and
the record layout the BPF side will rely on (against its documented offsets
in plugin/nccl_exporter_plugin.h).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from exporter.sources.nccl.elf import exported_functions, vaddr_to_offset
from exporter.sources.plugin.build import build_plugin
from conftest import REPO
VERSIONS = (4, 5, 6, 7)
HOOKS = ("coll_queued", "gpu_start", "gpu_done", "abandoned", "comm_init", "comm_fini", "comm_live")  # nccl_exporter_*

# our type name -> NCCL's type name
TYPE_PAIRS = {f"nxp_descr_v{v}": f"ncclProfilerEventDescr_v{v}_t" for v in VERSIONS}
TYPE_PAIRS.update({f"nxp_profiler_v{v}": f"ncclProfiler_v{v}_t" for v in VERSIONS})
STATE_ARGS = {f"ncclProfilerEventStateArgs_v{v}_t" for v in VERSIONS}

# type spellings that differ only by name (checked for equal size separately)
NAME_MAP = {
    "nxp_result_t": "ncclResult_t",
    "nxp_logger_t": "ncclDebugLogger_t",
    "nxp_state_args *": "STATEARGS *",
    "int pid": "ncclPid_t pid",
}


def _gdb(lib: Path, commands: list[str]) -> str:
    if shutil.which("gdb") is None:
        pytest.skip("gdb not installed")
    args = ["gdb", "-batch", "-nx"]
    for c in commands:
        args += ["-ex", c]
    out = subprocess.run(args + [str(lib)], capture_output=True, text=True, timeout=120)
    return out.stdout


LEAF = re.compile(r"^/\*\s+(\d+)\s+\|\s+(\d+)\s+\*/\s+(.*);\s*$")
OPEN = re.compile(r"^/\*.*\*/\s+(?:type = )?(?:struct|union)\b[^{]*\{\s*$|^\s*type = (?:struct|union)\b[^{]*\{\s*$")
CLOSE = re.compile(r"^\s*\}\s*(\w*)\s*;?\s*$")
TOTAL = re.compile(r"total size \(bytes\):\s+(\d+)")


def _name(decl: str) -> str:
    m = re.search(r"\(\*(\w+)\)", decl)
    if m:
        return m.group(1)
    m = re.search(r"(\w+)\s*(\[\d+\])*\s*$", decl)
    assert m, decl
    return m.group(1)


def parse_ptype(text: str) -> tuple[dict[str, tuple[int, int, str]], int]:
    """{member path: (offset, size, declaration)}, total size of one `ptype /o`.

    Anonymous structs/unions add nothing to a path ("coll.seqNumber" for the
    member seqNumber of the struct coll inside the descriptor's anonymous union).
    """
    frames: list[dict] = []          # each: {"members": {relpath: (...)}, "size": int}
    for line in text.splitlines():
        if OPEN.match(line):
            frames.append({"members": {}, "size": -1})
            continue
        m = TOTAL.search(line)
        if m and frames:
            frames[-1]["size"] = int(m.group(1))
            continue
        m = CLOSE.match(line)
        if m and frames:
            done = frames.pop()
            if not frames:
                assert done["size"] > 0, f"no total size in:\n{text[:400]}"
                return done["members"], done["size"]
            prefix = m.group(1)
            for rel, v in done["members"].items():
                frames[-1]["members"][f"{prefix}.{rel}" if prefix else rel] = v
            continue
        m = LEAF.match(line)
        if m and frames:
            decl = m.group(3).strip()
            frames[-1]["members"][_name(decl)] = (int(m.group(1)), int(m.group(2)), decl)
    raise AssertionError(f"unterminated ptype output:\n{text[:400]}")


def split_types(text: str) -> list[str]:
    """Split a gdb batch output of several `ptype /o` into one chunk each."""
    chunks, cur = [], []
    for line in text.splitlines():
        if "type = " in line and cur:
            chunks.append("\n".join(cur))
            cur = []
        cur.append(line)
    if cur:
        chunks.append("\n".join(cur))
    return chunks


@pytest.fixture(scope="module")
def layouts(real_nccl):
    nccl = Path(real_nccl)
    plugin = build_plugin()
    ours_out = _gdb(plugin, [f"ptype /o {t}" for t in TYPE_PAIRS] + ["ptype /o nxp_state_args"])
    theirs_out = _gdb(nccl, [f"ptype /o {t}" for t in TYPE_PAIRS.values()]
                      + [f"ptype /o {t}" for t in sorted(STATE_ARGS)])
    ours_chunks = split_types(ours_out)
    theirs_chunks = split_types(theirs_out)
    assert len(ours_chunks) == len(TYPE_PAIRS) + 1, ours_out[:2000]
    assert len(theirs_chunks) == len(TYPE_PAIRS) + len(STATE_ARGS), theirs_out[:2000]
    ours = {name: parse_ptype(c) for name, c in zip(list(TYPE_PAIRS) + ["nxp_state_args"], ours_chunks)}
    theirs = {name: parse_ptype(c) for name, c in
              zip(list(TYPE_PAIRS.values()) + sorted(STATE_ARGS), theirs_chunks)}
    return ours, theirs, plugin, nccl


def _normalize(decl: str, version: int) -> str:
    d = decl
    d = re.sub(r"nxp_descr_v(\d) \*", r"ncclProfilerEventDescr_v\1_t *", d)
    for a, b in NAME_MAP.items():
        d = d.replace(a, b)
    d = d.replace(f"ncclProfilerEventStateArgs_v{version}_t *", "STATEARGS *")
    # the state parameter is an enum in NCCL, an int in our table (sizes checked below)
    d = d.replace(f"ncclProfilerEventState_v{version}_t", "int")
    return re.sub(r"\s+", " ", d)


@pytest.mark.parametrize("ours_name", list(TYPE_PAIRS))
def test_struct_matches_nccl_dwarf(layouts, ours_name):
    ours, theirs, _, _ = layouts
    nccl_name = TYPE_PAIRS[ours_name]
    version = int(ours_name[-1])
    our_leaves, our_size = ours[ours_name]
    their_leaves, their_size = theirs[nccl_name]
    assert our_size == their_size, f"sizeof {ours_name}={our_size}, NCCL {nccl_name}={their_size}"
    assert len(our_leaves) >= 6
    for path, (off, size, decl) in our_leaves.items():
        assert path in their_leaves, f"{ours_name}.{path}: no such member in NCCL's {nccl_name}"
        toff, tsize, tdecl = their_leaves[path]
        assert (off, size) == (toff, tsize), \
            f"{ours_name}.{path}: ours @{off} size {size}, NCCL @{toff} size {tsize}"
        if "(*" in decl:  # function pointer: same parameter list
            assert _normalize(decl, version) == _normalize(tdecl, version), (decl, tdecl)


def test_every_member_we_read_is_covered(layouts):
    """The members the plugin reads exist, per version, in our checked structs."""
    ours, _, _, _ = layouts
    need = {"type", "parentObj", "rank", "coll.seqNumber", "coll.func", "coll.count", "coll.datatype",
            "coll.nChannels", "coll.root", "p2p.func", "p2p.count", "p2p.datatype", "p2p.peer",
            "p2p.nChannels", "kernelCh.channelId", "kernelCh.pTimer"}
    for v in VERSIONS:
        leaves, _ = ours[f"nxp_descr_v{v}"]
        assert need <= set(leaves), f"v{v} lacks {need - set(leaves)}"
    assert {"name", "init", "startEvent", "stopEvent", "recordEventState", "finalize"} <= \
        set(ours["nxp_profiler_v7"][0])


def test_state_args_match(layouts):
    ours, theirs, _, _ = layouts
    our_leaves, our_size = ours["nxp_state_args"]
    for t in sorted(STATE_ARGS):
        their_leaves, their_size = theirs[t]
        assert our_size == their_size, t
        for path, (off, size, _) in our_leaves.items():
            assert their_leaves[path][:2] == (off, size), (t, path)


# our enum constant -> NCCL's enumerator (values read from both DWARFs)
ENUMS = {
    "NXP_EV_GROUP": "ncclProfileGroup", "NXP_EV_COLL": "ncclProfileColl", "NXP_EV_P2P": "ncclProfileP2p",
    "NXP_EV_PROXY_OP": "ncclProfileProxyOp", "NXP_EV_PROXY_STEP": "ncclProfileProxyStep",
    "NXP_EV_PROXY_CTRL": "ncclProfileProxyCtrl", "NXP_EV_KERNEL_CH": "ncclProfileKernelCh",
    "NXP_EV_NET_PLUGIN": "ncclProfileNetPlugin", "NXP_EV_GROUP_API": "ncclProfileGroupApi",
    "NXP_EV_COLL_API": "ncclProfileCollApi", "NXP_EV_P2P_API": "ncclProfileP2pApi",
    "NXP_EV_KERNEL_LAUNCH": "ncclProfileKernelLaunch", "NXP_EV_CE_COLL": "ncclProfileCeColl",
    "NXP_EV_CE_SYNC": "ncclProfileCeSync", "NXP_EV_CE_BATCH": "ncclProfileCeBatch",
    "NXP_EV_KERNEL_PHASE": "ncclProfileKernelPhase",
    "NXP_STATE_PROXY_STEP_FIRST": "ncclProfilerProxyStepSendGPUWait",
    "NXP_STATE_SEND_GPU_WAIT": "ncclProfilerProxyStepSendGPUWait",
    "NXP_STATE_SEND_WAIT": "ncclProfilerProxyStepSendWait",
    "NXP_STATE_RECV_WAIT": "ncclProfilerProxyStepRecvWait",
    "NXP_STATE_RECV_FLUSH_WAIT": "ncclProfilerProxyStepRecvFlushWait",
    "NXP_STATE_RECV_GPU_WAIT": "ncclProfilerProxyStepRecvGPUWait",
    "NXP_STATE_SEND_PEER_WAIT": "ncclProfilerProxyStepSendPeerWait_v4",
    "NXP_STATE_NET_PLUGIN_UPDATE": "ncclProfilerNetPluginUpdate",
    "NXP_STATE_KERNEL_CH_STOP": "ncclProfilerKernelChStop",
    "NXP_STATE_GROUP_START_API_STOP": "ncclProfilerGroupStartApiStop",
    "NXP_STATE_GROUP_END_API_START": "ncclProfilerGroupEndApiStart",
    "NXP_STATE_CE_FIRST": "ncclProfilerCeCollStart",
    "NXP_STATE_CE_LAST": "ncclProfilerCeBatchComplete",
    "NXP_STATE_KERNEL_PHASE_STOP": "ncclProfilerKernelPhaseStop",
}


def _values(lib: Path, names) -> dict[str, int]:
    names = list(names)
    out = _gdb(lib, [f"print (long){n}" for n in names])
    vals = re.findall(r"^\$\d+ = (-?\d+)$", out, re.M)
    assert len(vals) == len(names), out[-2000:]
    return dict(zip(names, map(int, vals)))


def test_enum_values_match(layouts):
    _, _, plugin, nccl = layouts
    ours = _values(plugin, ENUMS)
    theirs = _values(nccl, ENUMS.values())
    for a, b in ENUMS.items():
        assert ours[a] == theirs[b], f"{a}={ours[a]} but NCCL {b}={theirs[b]}"
    sizes = _values(nccl, [f"sizeof(ncclProfilerEventState_v{v}_t)" for v in VERSIONS] + ["sizeof(ncclResult_t)"])
    assert set(sizes.values()) == {4}, sizes  # passed as int by our tables


def test_exports(layouts):
    _, _, plugin, _ = layouts
    out = subprocess.run(["nm", "-D", "--defined-only", str(plugin)], capture_output=True, text=True).stdout
    syms = {l.split()[-1]: l.split()[1] for l in out.splitlines() if l.strip()}
    for v in VERSIONS:
        assert syms.get(f"ncclProfiler_v{v}") in ("D", "R"), f"ncclProfiler_v{v} not exported"
    for v in (1, 2, 3):  # no GPU timers: not exported on purpose
        assert f"ncclProfiler_v{v}" not in syms
    for h in HOOKS:
        assert syms.get(f"nccl_exporter_{h}") == "T", h
    # nothing else leaks into the dynamic symbol table
    ours = {s for s in syms if not s.startswith("_")}
    assert ours == {f"ncclProfiler_v{v}" for v in VERSIONS} | \
        {f"nccl_exporter_{h}" for h in (*HOOKS, "profiler_stats", "profiler_pools")}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the nop5 hook entry is x86-64's")
def test_hooks_start_with_a_five_byte_nop():
    """Each hook's first instruction is the 5-byte nop the kernel can turn
    into a call to its uprobe trampoline (plugin/hooks.c):
    with a `ret` there every hit costs a trap and a single-step."""
    plugin = build_plugin()
    addresses = exported_functions(plugin)
    data = plugin.read_bytes()
    for h in HOOKS:
        offset = vaddr_to_offset(plugin, addresses[f"nccl_exporter_{h}"])
        assert data[offset:offset + 6] == b"\x0f\x1f\x44\x00\x00\xc3", (h, data[offset:offset + 6].hex())


def test_record_layout_is_the_documented_one(layouts):
    """The BPF side copies the record blindly: the compiled layout must be the
    one documented in the header comments (offset comments = DWARF offsets)."""
    _, _, plugin, _ = layouts
    header = (REPO / "plugin" / "nccl_exporter_plugin.h").read_text()
    for struct in ("nccl_exporter_record", "nccl_exporter_comm"):
        body = header.split(f"struct {struct} {{", 1)[1].split("};", 1)[0]
        documented = {}
        for line in body.splitlines():
            m = re.match(r"\s*[\w ]+?\s+(\w+)(\[\d+\])?;\s*/\*\s*(\d+)", line)
            if m:
                documented[m.group(1)] = int(m.group(3))
        size_doc = int(re.search(rf"struct {struct} {{.*?}};\s*/\*\s*(\d+) bytes", header, re.S).group(1))
        leaves, total = parse_ptype(_gdb(plugin, [f"ptype /o struct {struct}"]))
        assert total == size_doc, struct
        assert {k: v[0] for k, v in leaves.items()} == documented, struct
        for k, (off, size, _) in leaves.items():
            assert off % min(size, 8) == 0, f"{struct}.{k} not naturally aligned"
