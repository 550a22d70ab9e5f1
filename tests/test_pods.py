"""Pod identity of traced processes (sources/pods.py): the cgroup path parsers
of each runtime and cgroup driver on fake /proc trees, the environment and
service-account sources, the kubelet's pod list over real HTTP. The same
with real cgroups and a traced process at the end."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading

import pytest

from exporter.sources.pods import (CgroupIdentity, KubeletPods, PodResolver, parse_cgroup,
                                   pod_from_environ)

UID = "5f1d8c2a-3b4e-4f60-9a7b-0c1d2e3f4a5b"
CID = "3c0a2e" + "0123456789abcdef" * 3 + "9f8e7d6c4b"
assert len(CID) == 64
UNDERSCORED = UID.replace("-", "_")


def v1(path: str, others: str = "/") -> str:
    """A cgroup v1 (hybrid) /proc/<pid>/cgroup: the pod path on the v1
    controllers, the v2 line at the root as on a hybrid host."""
    return (f"12:pids:{path}\n11:memory:{path}\n4:cpu,cpuacct:{path}\n"
            f"1:name=systemd:{path}\n0::{others}\n")


def v2(path: str) -> str:
    return f"0::{path}\n"


CASES = {
    # runtime, cgroup driver, version -> (file text, expected)
    "containerd systemd v2": (
        v2(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/"
           f"cri-containerd-{CID}.scope"),
        CgroupIdentity(UID, CID, "containerd")),
    "containerd systemd v2, guaranteed QoS": (
        v2(f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope"),
        CgroupIdentity(UID, CID, "containerd")),
    "containerd cgroupfs v1": (
        v1(f"/kubepods/burstable/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, "")),
    "containerd cgroupfs v2": (
        v2(f"/kubepods/besteffort/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, "")),
    "cri-o systemd v2": (
        v2(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UNDERSCORED}.slice/"
           f"crio-{CID}.scope"),
        CgroupIdentity(UID, CID, "cri-o")),
    "cri-o systemd v2, nested container cgroup": (
        v2(f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/crio-{CID}.scope/container"),
        CgroupIdentity(UID, CID, "cri-o")),
    "cri-o cgroupfs v1": (
        v1(f"/kubepods/pod{UID}/crio-{CID}"),
        CgroupIdentity(UID, CID, "cri-o")),
    "docker (cri-dockerd) systemd v1": (
        v1(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/"
           f"docker-{CID}.scope"),
        CgroupIdentity(UID, CID, "docker")),
    "docker (dockershim) cgroupfs v1": (
        v1(f"/kubepods/burstable/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, "")),
    "containerd systemd v2 seen from inside a cgroup namespace": (
        v2(f"/../../kubepods-burstable-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope"),
        CgroupIdentity(UID, CID, "containerd")),
    "kind (kubelet in a container)": (
        v2(f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
           f"kubelet-kubepods-besteffort-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope"),
        CgroupIdentity(UID, CID, "containerd")),
    "docker outside Kubernetes, cgroupfs": (
        v1(f"/docker/{CID}"),
        CgroupIdentity("", CID, "docker")),
    "docker outside Kubernetes, systemd v2": (
        v2(f"/system.slice/docker-{CID}.scope"),
        CgroupIdentity("", CID, "docker")),
    "pod sandbox or a pod-level process (no container)": (
        v2(f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice"),
        CgroupIdentity(UID, "", "")),
    "a plain systemd service": (
        v2("/system.slice/ssh.service"),
        CgroupIdentity()),
    "CRI-O's conmon is not the container": (
        v2(f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/crio-conmon-{CID}.scope"),
        CgroupIdentity(UID, "", "")),
    "a container id above the pod is not the pod's container": (
        v2(f"/docker/{CID}/kubepods/pod{UID}"),
        CgroupIdentity(UID, "", "")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cgroup_parsers(name):
    text, want = CASES[name]
    assert parse_cgroup(text) == want


def test_container_ref_is_what_kubelet_and_kube_state_metrics_write():
    assert CgroupIdentity(UID, CID, "containerd").container_ref == f"containerd://{CID}"
    assert CgroupIdentity(UID, CID, "cri-o").container_ref == f"cri-o://{CID}"
    assert CgroupIdentity(UID, CID, "").container_ref == CID
    assert CgroupIdentity(UID).container_ref == ""


def test_v2_line_first_then_the_v1_hierarchies():
    # hybrid host: v2 at the root, the pod in the v1 hierarchies
    assert parse_cgroup(v1(f"/kubepods/pod{UID}/{CID}")).pod_uid == UID
    # a pod on v2 wins over a docker path on v1
    text = f"12:pids:/docker/{CID}\n0::/kubepods/pod{UID}/{CID}\n"
    assert parse_cgroup(text) == CgroupIdentity(UID, CID, "")
    assert parse_cgroup("") == CgroupIdentity()
    assert parse_cgroup("garbage\n") == CgroupIdentity()


def test_environment_sources():
    assert pod_from_environ({"POD_NAME": "trainer-0", "POD_NAMESPACE": "ml"}, True) == ("ml", "trainer-0")
    # HOSTNAME is the pod's name in a pod ...
    assert pod_from_environ({"HOSTNAME": "trainer-1"}, True, "gpu-node-7") == ("", "trainer-1")
    # ... but the node's under hostNetwork, and means nothing outside a pod
    assert pod_from_environ({"HOSTNAME": "gpu-node-7"}, True, "gpu-node-7") == ("", "")
    assert pod_from_environ({"HOSTNAME": "trainer-1"}, False, "gpu-node-7") == ("", "")
    # POD_NAME wins over HOSTNAME
    assert pod_from_environ({"POD_NAME": "a", "HOSTNAME": "b"}, True) == ("", "a")
    assert pod_from_environ(None, True) == ("", "")


def fake_proc(root, pid: int, cgroup: str, environ: dict | None = None, namespace_file: str | None = None):
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    if environ is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    if namespace_file is not None:
        sa = d / "root" / "run/secrets/kubernetes.io/serviceaccount"
        sa.mkdir(parents=True)
        (sa / "namespace").write_text(namespace_file + "\n")


def test_resolver_on_fake_proc(tmp_path):
    path = f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope"
    fake_proc(tmp_path, 100, v2(path), {"POD_NAME": "trainer-0", "POD_NAMESPACE": "ml"})
    fake_proc(tmp_path, 101, v2(path), {"HOSTNAME": "trainer-0"}, namespace_file="ml-team")
    fake_proc(tmp_path, 102, v2("/user.slice/user-1000.slice"), {"HOSTNAME": "trainer-0",
                                                                 "POD_NAMESPACE": "x"})
    fake_proc(tmp_path, 103, v2(path))  # environ unreadable (another user, no CAP_SYS_PTRACE)
    r = PodResolver(proc=str(tmp_path), node_hostname="gpu-node-7")
    ref = f"containerd://{CID}"
    assert r.identify(100).fields() == ("ml", "trainer-0", "", UID, ref)
    assert r.identify(101).fields() == ("ml-team", "trainer-0", "", UID, ref)
    # outside a pod: no pod name from HOSTNAME, no service-account lookup
    assert r.identify(102).fields() == ("x", "", "", "", "")
    assert r.identify(103).fields() == ("", "", "", UID, ref)
    assert r.identify(999).fields() == ("", "", "", "", "")  # gone
    # what is not a namespace (a symlink planted to a host file) is not taken
    fake_proc(tmp_path, 104, v2(path), {}, namespace_file="root:$6$salt:19000:0:99999:7:::")
    assert r.identify(104).namespace == ""


class _Kubelet(http.server.BaseHTTPRequestHandler):
    pods: dict = {}
    token = "s3cret"
    requests: list = []

    def do_GET(self):
        type(self).requests.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps(self.pods).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def pod_list(uid: str, namespace: str, name: str, containers: dict[str, str]) -> dict:
    """A kubelet /pods answer (a v1 PodList) with one pod."""
    return {"kind": "PodList", "apiVersion": "v1", "items": [{
        "metadata": {"uid": uid, "namespace": namespace, "name": name},
        "status": {"containerStatuses": [{"name": n, "containerID": f"containerd://{cid}"}
                                         for cid, n in containers.items()],
                   "initContainerStatuses": [{"name": "copy-plugin", "containerID": "containerd://" + "e" * 64}]},
    }]}


@pytest.fixture
def kubelet():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Kubelet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Kubelet.requests = []
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_kubelet_pod_list(kubelet, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    _Kubelet.pods = pod_list(UID, "ml", "trainer-0", {CID: "pytorch"})
    url = f"http://127.0.0.1:{kubelet.server_address[1]}"
    k = KubeletPods(url, str(token), min_interval=30)
    assert k.lookup(UID, CID) == ("ml", "trainer-0", "pytorch")
    assert k.lookup(UID, "e" * 64) == ("ml", "trainer-0", "copy-plugin")
    assert _Kubelet.requests == [("/pods", "Bearer s3cret")]  # one fetch answers both
    # an unknown pod: no second fetch within min_interval
    assert k.lookup("0" * 8 + "-0000-0000-0000-" + "0" * 12) is None
    assert len(_Kubelet.requests) == 1
    # the kubelet wins over the environment; its container name fills `container`
    fake_proc(tmp_path / "proc", 100,
              v2(f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope"),
              {"HOSTNAME": "stale-name"})
    r = PodResolver(k, proc=str(tmp_path / "proc"), node_hostname="n")
    assert r.identify(100).fields() == ("ml", "trainer-0", "pytorch", UID, f"containerd://{CID}")


def test_kubelet_refused_or_down_answers_nothing(kubelet, tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("wrong")
    _Kubelet.pods = pod_list(UID, "ml", "trainer-0", {CID: "pytorch"})
    k = KubeletPods(f"http://127.0.0.1:{kubelet.server_address[1]}", str(token), min_interval=0)
    assert k.lookup(UID, CID) is None
    assert k.lookup(UID, CID) is None
    assert len([r for r in caplog.records if "kubelet pod list" in r.getMessage()]) == 1  # logged once
    port = kubelet.server_address[1]
    kubelet.shutdown()
    kubelet.server_close()
    down = KubeletPods(f"http://127.0.0.1:{port}", None, timeout=2, min_interval=0)
    assert down.lookup(UID, CID) is None


def test_kubelet_options_are_checked(tmp_path):
    from conftest import run_cli

    r = run_cli("run", "--kubelet-token-file", str(tmp_path / "t"))
    assert r.returncode == 2 and r.stderr.strip().endswith("--kubelet-token-file needs --kubelet-url"), r.stderr
    r = run_cli("run", "--kubelet-url", "10.0.0.1:10250")
    assert r.returncode == 2 and "http:// or https://" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("run", "--kubelet-url", "https://10.0.0.1:10250", "--kubelet-token-file",
                str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read it" in r.stderr


# --- real cgroups, a traced process, /metrics and the recording ------------------------

DRIVER = r"""
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
time.sleep(1)  # as a framework between loading NCCL and its first call: the agent attaches meanwhile
lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
comms = (ctypes.c_void_p * 1)()
assert lib.ncclCommInitAll(comms, 1, None) == 0
buf = (ctypes.c_float * 16)()
assert lib.ncclAllReduce(buf, buf, 16, 7, 0, comms[0], None) == 0  # ncclFloat32, ncclSum
print("ready", flush=True)
input()  # alive, with its communicator, until the test has looked
"""


def _cgroup_mounts() -> dict[str, str]:
    """{"v2": mount point of the cgroup2 hierarchy, "v1": of the v1 pids
    controller}, those that this host has (/proc/self/mountinfo)."""
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _src, opts = (post.split() + ["", "", ""])[:3]
            mnt, root = pre.split()[4], pre.split()[3]
            if root != "/":
                continue
            if fstype == "cgroup2":
                found.setdefault("v2", mnt)
            elif fstype == "cgroup" and "pids" in opts.split(","):
                found.setdefault("v1", mnt)
    return found


class KubeCgroups:
    """kubepods-like cgroup directories made for a test, and removed again
    whatever happens: processes still inside are moved to the hierarchy's
    root first, then every directory made is removed, deepest first."""

    def __init__(self):
        self.made: list[tuple[str, str]] = []  # (hierarchy mount, directory)

    def make(self, mount: str, relative: str) -> str:
        path = mount
        for part in relative.strip("/").split("/"):
            path = os.path.join(path, part)
            if not os.path.isdir(path):
                os.mkdir(path)
                self.made.append((mount, path))
        return path

    def cleanup(self) -> None:
        import time

        for mount, path in reversed(self.made):
            for _ in range(50):
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids = f.read().split()
                    for pid in pids:
                        with contextlib.suppress(OSError):
                            with open(os.path.join(mount, "cgroup.procs"), "w") as f:
                                f.write(pid)
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # a process exiting: its cgroup is busy a moment longer
        self.made.clear()


@pytest.fixture
def kube_cgroups(bpf):
    """Root and the heavy lock (conftest's `bpf`): it makes cgroups, and its
    test loads the agent's BPF programs."""
    cg = KubeCgroups()
    try:
        yield cg
    finally:
        cg.cleanup()


# A container's process, as far as the agent can tell: another user, in its
# own mount namespace, its libnccl on a file system only it sees.
CONTAINED = r"""
set -e
mkdir -p "$1"
mount -t tmpfs -o mode=0700,uid=65534 none "$1"
install -o 65534 -m 0755 "$2" "$1/libnccl.so.2"
exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all /usr/bin/python3 -c "$3" "$1/libnccl.so.2"
"""


def _spawn_in(cgroup_dir: str, lib, env: dict, contained_at: str | None = None):
    """The driver, moved into `cgroup_dir` before it execs (as a container
    runtime starts a container's process), so it maps libnccl from inside.
    contained_at: run it as a container's process (CONTAINED), its library
    copied to a private tmpfs mounted there."""
    import subprocess
    import sys

    def enter():
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    argv = [sys.executable, "-c", DRIVER, str(lib)]
    if contained_at:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", CONTAINED, "sh",
                contained_at, str(lib), DRIVER]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=enter)


def test_pods_in_real_cgroups_label_communicator_and_plugin_series(kube_cgroups, kubelet, tmp_path):
    """Two simulated ranks in kubepods cgroups made on this host: one in a
    containerd pod named by the systemd driver on cgroup v2 with the downward
    API's POD_NAME/POD_NAMESPACE; one in a cgroupfs-named pod on cgroup v1
    (hybrid hosts) with only HOSTNAME, named by the kubelet's pod list, run
    as another user in its own mount namespace. The agent has exactly the
    DaemonSet's capabilities. Their nccl_communicator_info and
    nccl_profiler_plugin_active carry namespace, pod and container, and the
    recording's processes rows the same."""
    import sqlite3
    import uuid

    from conftest import ExporterProcess
    from exporter.records import metrics
    from exporter.simulator.build import build_library

    mounts = _cgroup_mounts()
    if "v2" not in mounts:
        pytest.skip("no cgroup2 hierarchy mounted")
    lib = build_library()
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    cid_a, cid_b = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2
    dir_a = kube_cgroups.make(mounts["v2"], (
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_a.replace('-', '_')}.slice/"
        f"cri-containerd-{cid_a}.scope"))
    # cgroup v1 where the host has it (hybrid), else the cgroupfs names on v2
    dir_b = kube_cgroups.make(mounts.get("v1", mounts["v2"]), f"kubepods/besteffort/pod{uid_b}/{cid_b}")
    token = tmp_path / "token"
    token.write_text("s3cret")
    _Kubelet.pods = pod_list(uid_b, "team-b", "trainer-b-0", {cid_b: "pytorch"})
    kubelet_url = f"http://127.0.0.1:{kubelet.server_address[1]}"
    db = tmp_path / "pods.db"
    env = {k: v for k, v in os.environ.items() if k not in ("POD_NAME", "POD_NAMESPACE", "HOSTNAME")}
    procs = []
    # The agent with exactly the capabilities the DaemonSet grants (measured:
    # docs/deploy.md); library discovery, as deployed (no --nccl-lib).
    from exporter.agent.preflight import CAPABILITIES
    exporter = ExporterProcess(nccl_libs=[], extra_args=[
        "--db", str(db), "--kubelet-url", kubelet_url, "--kubelet-token-file", str(token)])
    bounding = "-all," + ",".join(f"+{c.lower()}" for c in CAPABILITIES)
    exporter.argv = ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", *exporter.argv]
    import tempfile
    private = tempfile.mkdtemp(prefix="nccl-exporter-pod-")  # a mount point the other user can reach
    os.chmod(private, 0o755)
    with contextlib.ExitStack() as stack:
        stack.callback(os.rmdir, private)  # the tmpfs went with the namespace
        stack.enter_context(exporter)
        try:
            procs.append(_spawn_in(dir_a, lib, {**env, "POD_NAME": "trainer-a-0", "POD_NAMESPACE": "team-a",
                                                "HOSTNAME": "trainer-a-0"}))
            # B: another user's process in its own mount namespace (its
            # environ is 0400 of that user, its library reachable only
            # through /proc/<pid>/root): what a container looks like
            procs.append(_spawn_in(dir_b, lib, {**env, "HOSTNAME": "some-other-name"}, contained_at=private))
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            with open(f"/proc/{procs[0].pid}/cgroup") as f:
                assert uid_a.replace("-", "_") in f.read()
            import time
            deadline = time.monotonic() + 20
            while True:
                families = exporter.scrape()
                info = {s.labels["pid"]: s.labels for s in exporter.samples(families, metrics.COMMUNICATOR_INFO)
                        if int(s.labels["pid"]) in {p.pid for p in procs}}
                active = {s.labels["pid"]: (s.labels, s.value)
                          for s in exporter.samples(families, metrics.PROFILER_PLUGIN_ACTIVE)
                          if int(s.labels["pid"]) in {p.pid for p in procs}}
                if (len(info) == 2 and len(active) == 2
                        and all(a[0]["collectives"] == "yes" for a in active.values())) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
        finally:
            for p in procs:
                with contextlib.suppress(OSError):
                    p.stdin.close()
                p.wait(30)
    a, b = str(procs[0].pid), str(procs[1].pid)
    want = {
        a: {"namespace": "team-a", "pod": "trainer-a-0", "container": "", "pod_uid": uid_a,
            "container_id": f"containerd://{cid_a}"},
        b: {"namespace": "team-b", "pod": "trainer-b-0", "container": "pytorch", "pod_uid": uid_b,
            "container_id": cid_b},  # cgroupfs names no runtime
    }
    for pid, labels in want.items():
        assert {k: info[pid][k] for k in labels} == labels, info[pid]
        got, value = active[pid]
        assert {k: got[k] for k in labels} == labels, got
        # without the plugin; the simulator is NCCL 2.32.3 and made an AllReduce
        assert (value, got["libnccl_version"], got["collectives"]) == (0, "2.32.3", "yes"), got
    rows = sqlite3.connect(db).execute(
        "SELECT pid, namespace, pod, container, pod_uid, container_id, libnccl_version FROM processes").fetchall()
    rows = {str(r[0]): r[1:] for r in rows if str(r[0]) in want}
    for pid, labels in want.items():
        assert rows[pid] == (*labels.values(), "2.32.3"), rows
