"""Benchmark: target alone vs transformers' `assistant_model=` vs hf_specsample, on the same models and prompts.

Run `python -m hf_specsample.bench --help` (or `hf-specsample-bench`). `run_benchmark` is the library entry point.
"""

from .methods import Method, MethodSpec, Mode
from .report import expected_speedup
from .runner import BenchmarkConfig, run_benchmark

__all__ = ["BenchmarkConfig", "Method", "MethodSpec", "Mode", "expected_speedup", "run_benchmark"]
