"""Tooling beside the hf_specsample library: the benchmark, the demo and the checkpoint fetcher.

Nothing here is imported by `hf_specsample`; install its needs with the `bench` extra (`pip install
'hf-specsample[bench]'`).

- `python -m hf_specsample_bench --help` (or `hf-specsample-bench`): target alone vs transformers'
  `assistant_model=` vs hf_specsample, on the same models and prompts. `run_benchmark` is the Python entry point.
- `hf-specsample-demo` (or `python examples/quickstart.py`): the README's main job on real checkpoints.
- `python -m hf_specsample_bench.models` (or `hf-specsample-fetch`): fetch and convert the real checkpoints ahead
  of time.
- `hf-specsample-weightless`: the benchmark without model files, on any device.
- `python -m hf_specsample_bench.<module>` for `compiled_verification`, `code_editing`, `round_profile`,
  `draft_weight_forms`, `hybrid_rollback`, `versions`: one measurement each (docs/benchmarks.md).
"""

from .methods import Method, MethodSpec, Mode
from .report import expected_speedup
from .runner import BenchmarkConfig, run_benchmark

__all__ = ["BenchmarkConfig", "Method", "MethodSpec", "Mode", "expected_speedup", "run_benchmark"]
