#!/usr/bin/env bash
# `make test-image`: build the image, then inside it (buildah run, chroot
# isolation: the host's PID namespace, /proc and /sys, as a DaemonSet pod
# with hostPID sees them) run `nccl-exporter --version`, `check`, and a short
# `trace` of a simulated NCCL job started on the host, with exactly the
# capabilities the DaemonSet grants. The working container is removed
# whatever happens. docs/deploy.md, "The image".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

. scripts/lib-debian.sh   # STORAGE: the store make image builds into
PY=.venv/bin/python
VERSION=$($PY -c 'import exporter; print(exporter.__version__)')
: "${IMAGE:?IMAGE (the registry path, without the tag) comes from the Makefile: run make test-image}"
REF=$IMAGE:${VERSION//+/-}  # an image tag has no '+'
# The capabilities of the DaemonSet and the systemd unit: one list, in the code.
CAPS=$($PY -c 'from exporter.agent.preflight import CAPABILITIES; print(",".join("CAP_" + c for c in CAPABILITIES))')
MASK=$($PY -c 'from exporter.agent.preflight import CAPABILITIES; print("%016x" % sum(1 << b for b, _ in CAPABILITIES.values()))')
# buildah's --cap-drop ALL also drops what --cap-add adds: drop its defaults
# one by one instead (containers.conf's default_capabilities), and check below.
DROP=CAP_CHOWN,CAP_DAC_OVERRIDE,CAP_FOWNER,CAP_FSETID,CAP_KILL,CAP_SETGID,CAP_SETUID,CAP_SETPCAP,CAP_NET_BIND_SERVICE,CAP_SYS_CHROOT,CAP_SETFCAP,CAP_NET_RAW,CAP_MKNOD,CAP_AUDIT_WRITE
work=$(mktemp -d)
ctr=""
job=""
cleanup() {
    [ -n "$job" ] && kill "$job" 2>/dev/null && wait "$job" 2>/dev/null || true
    [ -n "$ctr" ] && buildah "${STORAGE[@]}" rm "$ctr" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

scripts/build-image.sh
ctr=$(buildah "${STORAGE[@]}" from --quiet --pull=never "$REF")
# What the DaemonSet mounts from the host (hostPath) and grants; kernel
# headers are left out on purpose: the image's fallback is what is tested.
IN=(buildah "${STORAGE[@]}" run --isolation chroot --cap-drop "$DROP" --cap-add "$CAPS"
    -v /sys/kernel/tracing:/sys/kernel/tracing -v /sys/fs/bpf:/sys/fs/bpf "$ctr" --)
RUN=("${IN[@]}" /usr/local/bin/nccl-exporter-entrypoint)

status=$("${IN[@]}" cat /proc/self/status)
eff=$(echo "$status" | awk '/^CapEff:/ {print $2}')
[ "$eff" = "$MASK" ] || { echo "test-image: FAIL: the container has capabilities $eff, not $CAPS ($MASK)" >&2; exit 1; }
echo "$status" | grep -q '^Seccomp:[[:space:]]*2' || { echo "test-image: FAIL: no seccomp filter in the container" >&2; exit 1; }

echo "test-image: nccl-exporter --version"
out=$("${RUN[@]}" --version | head -n1)
[ "$out" = "nccl-exporter $VERSION" ] || { echo "test-image: FAIL: --version said '$out'" >&2; exit 1; }

# check and trace load BPF: under the shared lock of this machine's heavy tests
exec 9>/tmp/nccl-heavy.lock
flock 9
echo "test-image: nccl-exporter check (capabilities $CAPS)"
if ! "${RUN[@]}" check > "$work/check.txt" 2>&1; then
    cat "$work/check.txt" >&2; echo "test-image: FAIL: check" >&2; exit 1
fi
grep -q "ready to run" "$work/check.txt" && grep -q "^ok    kernel headers .*BCC_KERNEL_SOURCE" "$work/check.txt" \
    || { cat "$work/check.txt" >&2; echo "test-image: FAIL: check output" >&2; exit 1; }

echo "test-image: nccl-exporter trace of a simulated job"
lib=$($PY -m exporter.simulator build)
# The job: maps the simulated libnccl, waits for the go file, then one
# communicator and 20 AllReduces.
python3 - "$lib" "$work/go" > "$work/job.txt" 2>&1 <<'PYEOF' &
import ctypes, os, sys, time
lib = ctypes.CDLL(sys.argv[1])
lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
comms = (ctypes.c_void_p * 1)()
assert lib.ncclCommInitAll(comms, 1, None) == 0
buf = (ctypes.c_float * 256)()
for _ in range(20):
    assert lib.ncclAllReduce(buf, buf, 256, 7, 0, comms[0], None) == 0
print("job done", flush=True)
PYEOF
job=$!
"${RUN[@]}" trace --duration 15s --format json --pid "$job" > "$work/trace.txt" 2> "$work/trace.err" &
tracer=$!
for _ in $(seq 1 600); do   # BCC compiles the probes first (seconds to a minute)
    grep -q "tracing NCCL calls" "$work/trace.err" && break
    kill -0 "$tracer" 2>/dev/null || break
    sleep 0.1
done
touch "$work/go"
wait "$job" || { cat "$work/job.txt" >&2; echo "test-image: FAIL: the simulated job" >&2; exit 1; }
job=""
wait "$tracer" || { cat "$work/trace.err" >&2; echo "test-image: FAIL: trace exited with an error" >&2; exit 1; }
n=$(grep -c '"op": "ALL_REDUCE"' "$work/trace.txt" || true)
if [ "$n" != 20 ]; then
    cat "$work/trace.err" >&2; head -n 5 "$work/trace.txt" >&2
    echo "test-image: FAIL: trace showed $n of the job's 20 AllReduce calls" >&2; exit 1
fi
echo "test-image: ok: --version, check, and trace saw all 20 AllReduce calls of the simulated job inside $REF"
