"""A call whose return probe never fired must not hide the thread's later calls.

bpf/nccl.c keeps one call slot per thread; a public call made while the slot
is busy is taken for NCCL calling itself (nested, not counted). If a call's
return is never seen, its slot stays busy: before the fix every later call on
that thread counted as nested, and the agent saw none of them again. That
happened to an agent attaching while a call entered between its entry and
return probes (a `trace` then recorded 0 of ~18,000 calls, tests/test_stopping.py
in CI). Here the lost return is made on purpose: the thread leaves a blocked
ncclCommInitRank with siglongjmp, past the return the uretprobe hijacked.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time

import pytest
from conftest import sample_value

# Rank 0 of 2 blocks in ncclCommInitRank (rank 1 never comes); a helper thread
# interrupts it after 1 s and the handler jumps out; then 5 ncclGetUniqueId.
PROGRAM = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
typedef struct { char internal[128]; } ncclUniqueId;
static sigjmp_buf jump;
static pthread_t main_thread;
static void on_signal(int sig) { (void)sig; siglongjmp(jump, 1); }
static void *interrupt_later(void *arg) {
  (void)arg;
  sleep(1);
  pthread_kill(main_thread, SIGUSR1);
  return NULL;
}
int main(int argc, char **argv) {
  void *lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  int (*get_id)(ncclUniqueId *) = (int (*)(ncclUniqueId *))dlsym(lib, "ncclGetUniqueId");
  int (*init_rank)(void **, int, ncclUniqueId, int) =
      (int (*)(void **, int, ncclUniqueId, int))dlsym(lib, "ncclCommInitRank");
  ncclUniqueId id;
  if (get_id(&id) != 0) { fprintf(stderr, "ncclGetUniqueId failed\n"); return 1; }
  main_thread = pthread_self();
  signal(SIGUSR1, on_signal);
  pthread_t t;
  pthread_create(&t, NULL, interrupt_later, NULL);
  void *comm = NULL;
  if (sigsetjmp(jump, 1) == 0) {
    init_rank(&comm, 2, id, 0);
    fprintf(stderr, "ncclCommInitRank returned\n");
    return 1;
  }
  pthread_join(t, NULL);
  for (int i = 0; i < 5; i++) {
    get_id(&id);
    usleep(20000);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def jumper(tmp_path_factory):
    d = tmp_path_factory.mktemp("jumper")
    (d / "jumper.c").write_text(PROGRAM)
    subprocess.run(["gcc", "-O1", "-o", str(d / "jumper"), str(d / "jumper.c"), "-ldl", "-lpthread"],
                   check=True)
    return d / "jumper"


def test_calls_after_a_missed_return_are_seen(launch_exporter, simulator_lib, jumper, tmp_path):
    db = tmp_path / "run.db"
    with launch_exporter("--nccl-lib", simulator_lib, "--db", db, "--node", "t") as e:
        r = subprocess.run([str(jumper), str(simulator_lib)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 10
        while True:  # the agent polls its ring buffer; give it a moment
            missed = sample_value(e.samples(), "nccl_exporter_returns_missed_total", node="t")
            if missed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert missed == 1
    conn = sqlite3.connect(db)
    try:
        ops = [op for (op,) in conn.execute("SELECT op FROM nccl_events WHERE kind = 'call' OR kind = 'lifecycle'"
                                            " ORDER BY timestamp_ns")]
    finally:
        conn.close()
    # the jumped-out ncclCommInitRank is in no row; the 5 calls after it are
    assert ops.count("GET_UNIQUE_ID") == 6, ops
    assert "COMM_INIT_RANK" not in ops
