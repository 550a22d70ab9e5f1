"""Which Kubernetes pod and container a traced process runs in (docs/deploy.md, "Pod identity").

Three sources, each with what it needs:

- The cgroup path (/proc/<pid>/cgroup; any user may read it) gives the pod
  UID and the container ID. The kubelet names a pod's cgroup after its UID
  and the runtime names the container's after its ID, for both cgroup
  drivers and both cgroup versions:

    systemd driver  .../kubepods-burstable-pod<uid, '_' for '-'>.slice/cri-containerd-<id>.scope
                    .../kubepods-pod<uid>.slice/crio-<id>.scope        (CRI-O)
                    .../kubepods-besteffort-pod<uid>.slice/docker-<id>.scope   (cri-dockerd)
    cgroupfs driver /kubepods/burstable/pod<uid>/<id>                  (containerd, docker)
                    /kubepods/pod<uid>/crio-<id>                       (CRI-O)

  Under a cgroup namespace the path is relative ("/../../kubepods-..."):
  the names are searched anywhere in it.
- The process's environment (/proc/<pid>/environ: the same user or
  CAP_DAC_READ_SEARCH, the file being mode 0400; docs/deploy.md,
  "Capabilities, and why"): POD_NAME and POD_NAMESPACE where the pod spec sets them
  from the downward API (docs/deploy.md shows the lines), else HOSTNAME,
  which the container runtime sets to the pod's name unless the pod sets
  `hostname:` or uses the host's network (then it is the node's name, and
  is not taken). The namespace also comes from the service-account file the
  kubelet mounts into the container (/proc/<pid>/root/run/secrets/
  kubernetes.io/serviceaccount/namespace, or /var/run/...; CAP_SYS_PTRACE
  and CAP_DAC_READ_SEARCH for another user's process) where the pod mounts
  one, taken only when it is a DNS label.
- The kubelet's pod list (GET <kubelet>/pods), only with --kubelet-url and
  --kubelet-token-file: a service-account token allowed `get` on
  `nodes/proxy`. It gives namespace and name by UID, and the container's
  name by its ID: the only source of the container's name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from exporter.sources.identity import read_environ

__all__ = ["CgroupIdentity", "PodIdentity", "parse_cgroup", "read_cgroup", "pod_from_environ",
           "KubeletPods", "PodResolver", "POD_FIELDS"]

log = logging.getLogger("nccl_exporter")

# The fields, in the order of the label sets and the recording's columns.
POD_FIELDS = ("namespace", "pod", "container", "pod_uid", "container_id")

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# A pod's cgroup: systemd driver "kubepods[-qos]-pod<uid>.slice", cgroupfs "pod<uid>".
# (kind and other kubelets in a container prefix it: "kubelet-kubepods-...-pod<uid>.slice")
_POD = re.compile(r"(?:^|/)(?:[a-z-]*kubepods(?:-[a-z]+)?-)?pod(" + _UID + r")(?:\.slice)?(?=/|$)")
# A container's cgroup, runtime prefix -> the name kube-state-metrics and the
# kubelet use in containerID ("containerd://<id>").
_CONTAINER = re.compile(r"(?:^|/)(cri-containerd-|crio-|docker-|)([0-9a-f]{64})(?:\.scope)?(?=/|$)")
_RUNTIMES = {"cri-containerd-": "containerd", "crio-": "cri-o", "docker-": "docker", "": ""}
# Docker outside Kubernetes: /docker/<id> (cgroupfs) or docker-<id>.scope (systemd).
_DOCKER_PARENT = re.compile(r"(?:^|/)docker/([0-9a-f]{64})(?=/|$)")

# Where the kubelet mounts the service account, below the container's root:
# /run first, because /var/run is often an absolute symlink to /run, which
# through /proc/<pid>/root would resolve against the agent's root instead.
SERVICE_ACCOUNT_NAMESPACE = ("run/secrets/kubernetes.io/serviceaccount/namespace",
                             "var/run/secrets/kubernetes.io/serviceaccount/namespace")
# A namespace is a DNS label (RFC 1123). Anything else read from a container's
# file system (a symlink planted to point outside it) is not taken.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class CgroupIdentity:
    pod_uid: str = ""       # 8-4-4-4-12 with dashes, as metadata.uid
    container_id: str = ""  # 64 hex digits
    runtime: str = ""       # containerd | cri-o | docker | "" (cgroupfs driver: not named)

    @property
    def container_ref(self) -> str:
        """The container as the kubelet and kube-state-metrics write it:
        "containerd://<id>", or the bare id when the path does not name the runtime."""
        if not self.container_id:
            return ""
        return f"{self.runtime}://{self.container_id}" if self.runtime else self.container_id


def _parse_path(path: str) -> CgroupIdentity | None:
    pod = _POD.search(path)
    containers = list(_CONTAINER.finditer(path))
    docker = _DOCKER_PARENT.search(path)
    if pod is None and not containers:
        return None
    uid = pod.group(1).replace("_", "-") if pod else ""
    if pod:  # the container is the first container-named cgroup below the pod's
        containers = [m for m in containers if m.start() >= pod.end()]
    if not containers:
        return CgroupIdentity(uid)
    m = containers[0]
    runtime = _RUNTIMES[m.group(1)]
    if not runtime and docker is not None and docker.group(1) == m.group(2):
        runtime = "docker"  # /docker/<id>: Docker's cgroupfs naming outside Kubernetes
    return CgroupIdentity(uid, m.group(2), runtime)


def parse_cgroup(text: str) -> CgroupIdentity:
    """Pod UID and container ID from /proc/<pid>/cgroup's text. The cgroup v2
    line ("0::/path") first, then the v1 hierarchies in order; the first
    path naming a pod or a container wins. Nothing found: all empty."""
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    lines.sort(key=lambda f: f[0] != "0")  # stable: v2 first
    best = None
    for _hier, _ctrl, path in lines:
        found = _parse_path(path.strip())
        if found is None:
            continue
        if found.pod_uid:
            return found
        best = best or found
    return best or CgroupIdentity()


def read_cgroup(pid: int | str, proc: str = "/proc") -> CgroupIdentity:
    try:
        with open(os.path.join(proc, str(pid), "cgroup")) as f:
            return parse_cgroup(f.read())
    except OSError:
        return CgroupIdentity()


def pod_from_environ(env: dict[str, str] | None, in_pod: bool, node_hostname: str = "") -> tuple[str, str]:
    """(namespace, pod name) from a process's environment: POD_NAMESPACE and
    POD_NAME (the downward API), else the pod name from HOSTNAME when the
    process is in a pod (in_pod) and HOSTNAME is not the node's own name."""
    env = env or {}
    name = env.get("POD_NAME", "").strip()
    if not name and in_pod:
        host = env.get("HOSTNAME", "").strip()
        if host and host != node_hostname:
            name = host
    return env.get("POD_NAMESPACE", "").strip(), name


def _service_account_namespace(pid: int | str, proc: str) -> str:
    for path in SERVICE_ACCOUNT_NAMESPACE:
        try:
            with open(os.path.join(proc, str(pid), "root", path), "rb") as f:
                text = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            continue
        return text if _NAMESPACE.fullmatch(text) else ""
    return ""


@dataclass
class PodIdentity:
    namespace: str = ""
    pod: str = ""
    container: str = ""     # the container's name: only the kubelet knows it
    pod_uid: str = ""
    container_id: str = ""  # "containerd://<id>", as kube-state-metrics' container_id

    def fields(self) -> tuple[str, ...]:
        return tuple(getattr(self, f) for f in POD_FIELDS)


@dataclass
class _Pod:
    namespace: str
    name: str
    containers: dict[str, str] = field(default_factory=dict)  # container id (64 hex) -> name


class KubeletPods:
    """The kubelet's pod list (GET <url>/pods, bearer token), looked up by pod
    UID. Fetched when a UID is not in the last list, at most every
    `min_interval` s; a failure is logged once per kind and answers nothing."""

    def __init__(self, url: str, token_file: str | None = None, ca_file: str | None = None,
                 insecure: bool = False, timeout: float = 5.0, min_interval: float = 30.0):
        self.url = url.rstrip("/") + "/pods"
        self.token_file = token_file
        self.timeout = timeout
        self.min_interval = min_interval
        self._context = None
        if self.url.startswith("https:"):
            self._context = ssl.create_default_context(cafile=ca_file)
            if insecure:  # the kubelet's self-signed serving certificate (metrics-server's --kubelet-insecure-tls)
                self._context.check_hostname = False
                self._context.verify_mode = ssl.CERT_NONE
        self._pods: dict[str, _Pod] = {}
        self._fetched = float("-inf")
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.fetches = 0

    def _token(self) -> str:
        if not self.token_file:
            return ""
        with open(self.token_file) as f:  # re-read: projected tokens rotate
            return f.read().strip()

    def _fetch(self) -> None:
        headers = {"Accept": "application/json"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout, context=self._context) as r:
            body = json.load(r)
        pods = {}
        for item in body.get("items") or ():
            meta = item.get("metadata") or {}
            uid = meta.get("uid")
            if not uid:
                continue
            containers = {}
            status = item.get("status") or {}
            for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
                for c in status.get(key) or ():
                    cid = (c.get("containerID") or "").rpartition("://")[2]
                    if cid and c.get("name"):
                        containers[cid] = c["name"]
            pods[uid] = _Pod(meta.get("namespace", ""), meta.get("name", ""), containers)
        self._pods = pods
        self.fetches += 1

    def lookup(self, pod_uid: str, container_id: str = "") -> tuple[str, str, str] | None:
        """(namespace, pod name, container name or "") of a pod UID, or None."""
        if not pod_uid:
            return None
        with self._lock:
            pod = self._pods.get(pod_uid)
            stale = pod is None or (container_id and container_id not in pod.containers)
            if stale and time.monotonic() - self._fetched >= self.min_interval:
                self._fetched = time.monotonic()
                try:
                    self._fetch()
                except (OSError, ValueError, urllib.error.URLError) as e:
                    kind = type(e).__name__
                    if kind not in self._logged:
                        self._logged.add(kind)
                        log.warning("kubelet pod list %s: %s (pod names from the environment only)",
                                    self.url, getattr(e, "reason", None) or e)
                pod = self._pods.get(pod_uid)
        if pod is None:
            return None
        return pod.namespace, pod.name, pod.containers.get(container_id, "")


class PodResolver:
    """PodIdentity of a process: cgroup, then environment and service-account
    file, then (opt-in) the kubelet, which wins where it answers."""

    def __init__(self, kubelet: KubeletPods | None = None, proc: str = "/proc",
                 node_hostname: str | None = None):
        self.kubelet = kubelet
        self.proc = proc
        self.node_hostname = socket.gethostname() if node_hostname is None else node_hostname

    def identify(self, pid: int | str, env: dict[str, str] | None = None) -> PodIdentity:
        cg = read_cgroup(pid, self.proc)
        if env is None:
            env = read_environ(pid, self.proc)
        in_pod = bool(cg.pod_uid)
        namespace, name = pod_from_environ(env, in_pod, self.node_hostname)
        if in_pod and not namespace:
            namespace = _service_account_namespace(pid, self.proc)
        who = PodIdentity(namespace, name, "", cg.pod_uid, cg.container_ref)
        if self.kubelet is not None and in_pod:
            found = self.kubelet.lookup(cg.pod_uid, cg.container_id)
            if found is not None:
                who.namespace, who.pod, who.container = found[0] or namespace, found[1] or name, found[2]
        return who
