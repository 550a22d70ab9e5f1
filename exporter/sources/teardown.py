"""Detaching an agent's probes without waiting for it: a child process that
holds the BPF descriptors and closes them all at once (Teardown)."""

from __future__ import annotations


class Teardown:
    """The kernel's side of detaching, handed to a child process.

    Detaching a uprobe or a tracepoint waits for RCU grace periods: a BCC
    perf event's detach under a kernel mutex that serialises them (~0.1 s
    each), a uprobe_multi link's (the NCCL probes: sources/uprobe_multi.py)
    once for all its probes, and links' waits overlap. A forked child holds
    a reference to every BPF and perf-event descriptor of this process (and
    closes all others at once), so that this process's own closes are quick;
    when this process has closed its references (`release()`, or its exit),
    the child closes them all at once, one thread each: the kernel detaches
    in those closes, which nobody waits for. The programs are inert
    meanwhile: nothing reads their maps or ring buffers. Meant for processes
    about to end (`trace`, `run`): the child outlives them by those waits,
    with no open socket or file but those descriptors. A new agent need not
    wait for it: its probes are its own, and its uretprobes are attached
    before its uprobes (sources/nccl/probes.py; bench/README.md, "Stopping",
    tells what was wrongly blamed on this overlap)."""

    NAME = "nccl-detach"  # the child's /proc/PID/comm
    KINDS = ("anon_inode:[perf_event]", "anon_inode:bpf-map", "anon_inode:bpf-prog",
             "anon_inode:bpf_link", "anon_inode:bpf-link")

    def __init__(self):
        import os

        self.pid = None
        self._w = None
        keep = []
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith(self.KINDS):
                    keep.append(int(name))
            except (OSError, ValueError):
                continue
        if not keep:
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: system calls only, then _exit
            try:
                import signal

                try:  # what `ps` and `top` show while it detaches
                    with open("/proc/self/comm", "w") as comm:
                        comm.write(self.NAME)
                except OSError:
                    pass
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                low = 0
                for fd in sorted(set(keep) | {r}):
                    os.closerange(low, fd)
                    low = fd + 1
                os.closerange(low, 1 << 20)
                os.read(r, 1)  # EOF: the parent has dropped its references
                # Each close returns once the kernel has released it, after
                # its grace periods: all at once, so that they overlap (a
                # uprobe_multi link's do; bench/stop_latency.py).
                import threading

                def close(fd):
                    try:
                        os.close(fd)
                    except OSError:
                        pass

                closers = [threading.Thread(target=close, args=(fd,)) for fd in keep]
                for t in closers:
                    t.start()
                for t in closers:
                    t.join()
            finally:
                os._exit(0)
        os.close(r)
        self.pid, self._w = pid, w

    def release(self) -> None:
        """This process has closed its BPF objects: the child may end (and detach)."""
        import os

        if self._w is not None:
            os.close(self._w)
            self._w = None
        if self.pid is not None:
            try:
                os.waitpid(self.pid, os.WNOHANG)  # reaped by init if still running
            except ChildProcessError:
                pass
