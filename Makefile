# nccl-exporter: set-up, tests and demo on Debian 12 (run as root).
# Every target is idempotent and prints nothing when there is nothing to do.

SHELL      := /bin/bash
SYSPYTHON  := /usr/bin/python3
VENV       := .venv
PY         := $(VENV)/bin/python
BCC_SRC    := /usr/lib/python3/dist-packages/bcc
NCCL_WHEEL := nvidia-nccl-cu12==2.32.3
# The image's registry path, without the tag (the tag is the version), read
# from the one place it is named: the DaemonSet's image, so that
# `kubectl apply -k deploy/kubernetes` pulls what `make push-image` pushed
# (docs/deploy.md, "The image").
# `make image IMAGE=registry.example.com/ml/nccl-exporter` for another.
IMAGE      ?= $(shell sed -n 's|^ *image: *\([^:]*\):.*|\1|p' deploy/kubernetes/daemonset.yaml | head -n 1)
export IMAGE

MAKEFLAGS  += --no-print-directory

.PHONY: deps venv nccl-wheel demo lint test test-quick test-clean-room check clean plugin plugin-aarch64 image test-image push-image bench-faults bench-faults-quick

## deps: Debian packages, kernel-header links, tracefs (scripts/setup-system.sh)
deps:
	@$(SHELL) scripts/setup-system.sh

## venv: .venv with bcc (Debian's, via .pth) and `pip install -e .[test]`
venv: $(VENV)/.stamp-install
	@:

$(PY):
	@echo "venv: creating $(VENV) with $(SYSPYTHON)"
	@$(SYSPYTHON) -m venv $(VENV)

# Only the bcc package from dist-packages, not the rest of it.
$(VENV)/bcc-site/bcc: | $(PY)
	@test -d $(BCC_SRC) || { echo "venv: $(BCC_SRC) missing; run 'make deps' (python3-bpfcc)" >&2; exit 1; }
	@mkdir -p $(VENV)/bcc-site
	@ln -sfn $(BCC_SRC) $@
	@site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  echo "../../../bcc-site" > "$$site/bcc-site.pth" && \
	  echo "venv: bcc linked from $(BCC_SRC) via $$site/bcc-site.pth"

$(VENV)/.stamp-install: pyproject.toml | $(VENV)/bcc-site/bcc
	@echo "venv: pip install -e '.[test]'"
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

## nccl-wheel: the real libnccl.so.2 (NCCL 2.32.3) into .venv, for tests
nccl-wheel: $(VENV)/.stamp-nccl
	@:

$(VENV)/.stamp-nccl: | $(VENV)/.stamp-install
	@echo "nccl-wheel: pip install $(NCCL_WHEEL)"
	@$(PY) -m pip install -q '$(NCCL_WHEEL)'
	@touch $@

## demo: run the exporter against the simulated workload
demo: deps venv
	$(VENV)/bin/nccl-exporter demo

## plugin: the NCCL profiler plugin, build/plugin/libnccl-profiler-exporter.so (docs/plugin.md)
plugin: venv
	@$(PY) -m exporter.sources.plugin.build >/dev/null

## plugin-aarch64: the plugin cross-built for aarch64 (GH200/GB200), build/plugin/aarch64/ (docs/deploy.md, "Platforms")
plugin-aarch64: venv
	@$(PY) -m exporter.sources.plugin.build --arch aarch64 >/dev/null

## lint: ruff, with the rules in pyproject.toml ([tool.ruff]; a second)
lint: venv
	@$(VENV)/bin/ruff check --quiet .

## test: everything needed, then lint and the whole suite (what CI runs; budget 20 min here) in
## two passes: test-quick's tests on three workers as there, then the heavy ones (bpf, netns,
## real NCCL, Prometheus, slow) one at a time, the 25 slowest listed at the end (what to look
## at first when it grows); both passes always run, and either failing fails the target
test: deps venv nccl-wheel plugin lint
	@$(PY) -m pytest -q -n 3 --dist loadfile -m "not ($(HEAVY_MARKS))" tests/; light=$$?; \
	$(PY) -m pytest -v --durations=25 -m "$(HEAVY_MARKS)" tests/; heavy=$$?; \
	echo "make test: quick pass rc=$$light, heavy pass rc=$$heavy"; [ $$light = 0 ] && [ $$heavy = 0 ]

# The kinds of test conftest marks from the fixtures they use (tests/conftest.py).
HEAVY_MARKS := bpf or netns or real_nccl or prometheus or slow or require_root

## test-quick: lint, then pure logic, fake /proc, golden exposition: no root,
## BPF, netns or Prometheus (under 90 s); `make test` before you push. Three pytest-xdist
## workers, one test file each at a time (--dist loadfile: a module's fixtures
## stay in one process): most of its wall time is tests waiting on timeouts
## and child processes, which overlap (115 s serial, 46 s so, on 2 cores).
test-quick: lint
	$(PY) -m pytest -q -n 3 --dist loadfile -m "not ($(HEAVY_MARKS))" tests/

## test-clean-room: the README's install steps on a fresh Debian 12 (mmdebstrap,
## buildah chroot), from `git archive HEAD`, then test-quick (scripts/test-clean-room.sh)
test-clean-room:
	@$(SHELL) scripts/test-clean-room.sh

## image: $(IMAGE):<version> from the Dockerfile (buildah; the Debian base images made with mmdebstrap)
image: deps venv
	@$(SHELL) scripts/build-image.sh

## test-image: the image, then --version, check and a trace of a simulated job inside it
test-image: deps venv plugin
	@$(SHELL) scripts/test-image.sh

## push-image: push $(IMAGE):<version> (after `buildah login ghcr.io`; docs/deploy.md, "The image")
push-image: image
	@$(SHELL) scripts/build-image.sh --push

## bench-faults: the fault-injection benchmark, full set (~5.4 h; docs/benchmark.md), under the heavy lock;
## in two sittings: make bench-faults SEED=1 PART=1/2, then PART=2/2 (results in build/bench-faults-part1of2, ...)
PART ?= 1/1
SEED ?=
bench-faults: deps venv plugin
	flock /tmp/nccl-heavy.lock $(PY) -m bench.faults.run --set full --part $(PART) $(if $(SEED),--seed $(SEED)) \
		--out build/bench-faults$(if $(filter-out 1/1,$(PART)),-part$(subst /,of,$(PART)))

## bench-faults-quick: each fault type and healthy control once (~29 min)
bench-faults-quick: deps venv plugin
	flock /tmp/nccl-heavy.lock $(PY) -m bench.faults.run --set quick

## check: preflight checks of this host
check: venv
	@$(VENV)/bin/nccl-exporter check

clean:
	rm -rf build/ $(VENV)
