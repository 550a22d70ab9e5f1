"""Generic fixtures: tiny shared libraries compiled with the system gcc."""

import shutil
import subprocess
from pathlib import Path

import pytest

FAKE_NCCL_C = r"""
typedef int ncclResult_t;
ncclResult_t pncclAllReduce(const void *s, void *r, unsigned long n, int t, int op,
                            void *comm, void *stream) { return (int)n; }
ncclResult_t ncclAllReduce(const void *s, void *r, unsigned long n, int t, int op,
                           void *comm, void *stream)
    __attribute__((weak, alias("pncclAllReduce")));
ncclResult_t pncclGroupStart(void) { return 0; }
ncclResult_t ncclGroupStart(void) __attribute__((weak, alias("pncclGroupStart")));
int nccl_internal_counter = 3;                       /* an object, not a function */
static int helper(int x) { return x + nccl_internal_counter; }
int uses_helper(int x) { return helper(x); }
__attribute__((visibility("hidden"))) int hidden_fn(void) { return 1; }
extern int getppid(void);                            /* undefined here, from libc */
int calls_external(void) { return getppid(); }
"""

PLAIN_C = r"""
int foo_plain(int x) { return x * 2; }
"""


def _compile(src: str, out: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed (make deps)")
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1",
         "-o", str(out), str(c)],
        check=True,
    )
    return out


@pytest.fixture(scope="session")
def fake_nccl_lib(tmp_path_factory) -> Path:
    """A tiny libnccl.so.2: pncclAllReduce + weak alias ncclAllReduce, etc."""
    d = tmp_path_factory.mktemp("fake-nccl")
    return _compile(FAKE_NCCL_C, d / "libnccl.so.2")


@pytest.fixture(scope="session")
def static_nccl_lib(tmp_path_factory) -> Path:
    """NCCL 'statically linked' into a library whose name is not libnccl*."""
    d = tmp_path_factory.mktemp("static-nccl")
    return _compile(FAKE_NCCL_C, d / "libtrainer_core.so")


@pytest.fixture(scope="session")
def plain_lib(tmp_path_factory) -> Path:
    """A shared library with no NCCL symbols at all."""
    d = tmp_path_factory.mktemp("plain")
    return _compile(PLAIN_C, d / "libplain.so")
