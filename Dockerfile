# nccl-exporter's image: the agent, Debian's BCC (python3-bpfcc) and what
# `run` needs. Any builder builds it from a clone:
#
#   docker build -t nccl-exporter --build-arg VERSION=0.1.0 .
#   # or: podman build / buildah bud, with the same arguments
#
# `make image` builds this file with buildah, after making the two Debian
# base images below from Debian's package registry (scripts/lib-debian.sh),
# so that nothing is pulled from an image registry; `make test-image` tests
# the result. docs/deploy.md, "The image", says what is inside, what
# dominates its size and what the host mounts at run time.

# --- build: the wheels, the venv, the plugin, the fallback kernel headers ---
FROM debian:bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv gcc libc6-dev ca-certificates xz-utils "linux-headers-$(dpkg --print-architecture)"
# A site's CA bundle, where PyPI is reached through a TLS-inspecting proxy:
# `make image` passes the host's (mounted, never copied into a layer).
ARG PIP_CERT
# The version the wheel carries: the build context has no .git (.dockerignore),
# so setuptools-scm is told it (`make image` passes `git describe`'s); without
# it the wheel says 0.0.0.
ARG VERSION=0.0.0
ENV SETUPTOOLS_SCM_PRETEND_VERSION=$VERSION
WORKDIR /src
COPY . .
# The agent and its Python dependencies as wheels (PyPI), installed into the
# venv the image runs; it sees Debian's bcc through --system-site-packages.
RUN python3 -m venv /tmp/pip \
 && /tmp/pip/bin/pip install --quiet --upgrade pip \
 && /tmp/pip/bin/pip wheel --quiet --wheel-dir /wheels . \
 && python3 -m venv --system-site-packages /opt/nccl-exporter/venv \
 && /opt/nccl-exporter/venv/bin/pip install --quiet --no-compile --no-index --find-links /wheels nccl-exporter \
 && /opt/nccl-exporter/venv/bin/pip uninstall --quiet --yes pip setuptools
# The NCCL profiler plugin (docs/plugin.md): the DaemonSet's init container
# copies it to the node. Built after the venv, so it is newer than its
# sources there and `plugin-path` prints it instead of compiling one.
RUN NCCL_EXPORTER_PLUGIN_BUILD=/opt/nccl-exporter/plugin /opt/nccl-exporter/venv/bin/python -m exporter.sources.plugin.build
# Debian 12's kernel headers, compressed: the fallback when the host gives
# none (entrypoint.sh).
RUN sh deploy/image/kernel-headers.sh /opt/nccl-exporter/kernel-headers.tar.xz

# --- runtime: Debian slim, BCC, the venv; nothing to build with -------------
FROM debian:bookworm-slim
ARG VERSION=unknown
# python3 and Debian's BCC (libbcc with LLVM and clang), ca-certificates
# (OTLP over TLS), xz-utils (the kernel-header fallback). In the same layer:
# no apt lists, and no byte-code caches (13 MB: Python compiles in memory at
# start, under a second).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-bpfcc ca-certificates xz-utils \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/cache/debconf/*-old /var/log/apt /var/log/dpkg.log \
 && find /usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} +
COPY --from=build /opt/nccl-exporter /opt/nccl-exporter
COPY deploy/image/entrypoint.sh /usr/local/bin/nccl-exporter-entrypoint
# plugin-path prints the built plugin instead of compiling one (no gcc here)
ENV NCCL_EXPORTER_PLUGIN_BUILD=/opt/nccl-exporter/plugin \
    PYTHONDONTWRITEBYTECODE=1
RUN ln -s /opt/nccl-exporter/venv/bin/nccl-exporter /usr/local/bin/nccl-exporter \
 && /opt/nccl-exporter/venv/bin/python -c "import bcc, exporter, prometheus_client, opentelemetry.sdk"
LABEL org.opencontainers.image.title=nccl-exporter \
      org.opencontainers.image.version=$VERSION \
      org.opencontainers.image.source=https://github.com/nccl-exporter/nccl-exporter
EXPOSE 9862
ENTRYPOINT ["/usr/local/bin/nccl-exporter-entrypoint"]
CMD ["run"]
