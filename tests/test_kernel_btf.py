"""The running kernel's raw-tracepoint prototypes (exporter/sources/kernel_btf.py),
read from the real /sys/kernel/btf/vmlinux, and the refusal when they differ
from what bpf/sched.c reads."""

from __future__ import annotations

import os

import pytest

from exporter.sources import kernel_btf, sched
from exporter.sources.bpf import ProbeError

needs_btf = pytest.mark.skipif(not os.path.exists(kernel_btf.VMLINUX), reason="kernel without BTF")


@needs_btf
def test_sched_prototypes_from_the_running_kernel():
    found = kernel_btf.tracepoint_args(["sched_switch", "sched_wakeup", "sched_process_exit", "no_such_tp"])
    assert found["sched_switch"] == ["bool", "struct task_struct *", "struct task_struct *", "unsigned int"]
    assert found["sched_wakeup"] == ["struct task_struct *"]
    assert found["sched_process_exit"][0] == "struct task_struct *"
    assert found["no_such_tp"] is None
    sched.check_raw_tracepoints()  # what bpf/sched.c reads is what this kernel passes


@needs_btf
def test_a_different_prototype_is_refused(monkeypatch):
    # sched_switch before Linux 5.18: (bool preempt, prev, next) - prev_state was not an argument
    monkeypatch.setitem(sched.RAW_TRACEPOINTS, "sched_switch",
                        ["bool", "struct task_struct *", "struct task_struct *"])
    with pytest.raises(ProbeError, match=r"raw tracepoint sched_switch takes \(bool, .*unsigned int\)"):
        sched.check_raw_tracepoints()


def test_not_btf_is_no_answer(tmp_path):
    bogus = tmp_path / "vmlinux"
    bogus.write_bytes(b"\x7fELF not btf at all")
    assert kernel_btf.tracepoint_args(["sched_switch"], str(bogus)) is None
    assert kernel_btf.tracepoint_args(["sched_switch"], str(tmp_path / "missing")) is None
