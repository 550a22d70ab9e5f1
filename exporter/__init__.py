"""nccl-exporter: NCCL call latency and the kernel's view of it, as Prometheus metrics."""

try:  # written by setuptools-scm from the git tag when the package is built or installed
    from exporter._version import version as __version__
except ImportError:  # a source tree never built or installed: no version to claim
    __version__ = "0.0.0+unknown"
