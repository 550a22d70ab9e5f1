"""A simulated NCCL (libnccl.so.2 over TCP on host memory) and a simulated
cluster of hosts in network namespaces, with ground truth for every call."""

from exporter.simulator.build import build_library
from exporter.simulator.truth import load_truth, calls, lifecycle

__all__ = ["build_library", "load_truth", "calls", "lifecycle"]
