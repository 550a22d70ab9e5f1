"""The GPU check (docs/plugin.md, "Running the GPU check"): bench/gpu/run.sh.

checks.py holds the parsers and verdicts (standard library only, unit-tested
in tests/test_bench_gpu.py); workload.py is one torch rank; simworkload.py the
same calls on the simulator; __main__.py runs the parts a, d, c, e, b.
"""
