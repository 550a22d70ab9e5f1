"""nccl-exporter: NCCL call latency and the kernel's view of it, as Prometheus metrics."""

__version__ = "0.1.0"
