"""Issue 42's part 5 on a CUDA machine: graphs that are never skipped, exactness on CUDA, then the weightless table.

Run on a machine with a CUDA GPU, from the repository root. Where the machine's transformers is older than 5.24.0,
carry its wheel and regex's in `.whl/` (docs/benchmarks.md, "CUDA graphs", says how to fetch them) and install them
with pip's `--target` into a folder on PYTHONPATH; the one command:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 -m hf_specsample_bench.gpu_check --quick

What it does, in order, printing each row as it finishes:

1. `TORCHINDUCTOR_CUDAGRAPH_OR_ERROR=1` (set before torch is imported): a compiled forward that would skip its CUDA
   graph raises instead of printing a warning; inductor's counters (`cudagraph_skips`, recordings) are printed too.
2. Exactness on CUDA with tiny models (`compile=True`: both models' rounds on compiled runners): greedy identity
   with plain `generate()` on one row, a ragged (left-padded) batch, rows that end early on EOS, and a second chat
   turn on the returned cache; a chi-square of sampled two-token continuations against the exact distribution.
   A second call checks that nothing is compiled or recorded again (the caches and runners are kept).
3. `hf-specsample-weightless` rows on Qwen2.5-7B / 0.5B shapes in bf16, 128-token prompt, 128 new tokens: plain,
   plain static + compile, `assistant_model=` (one row; its draft gets the target's logit width, which it needs),
   ours default, ours with fixed K, ours with graphs (`--graphs`); greedy with every draft accepted on one row and
   sampling at acceptance 0.8 on 1 and 8 rows (and a 32B-shaped target with `--large`).

On a machine without CUDA it prints why and exits 0 (`tests/test_bench.py` runs it so).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

os.environ.setdefault("TORCHINDUCTOR_CUDAGRAPH_OR_ERROR", "1")  # before torch: inductor reads it at import

import torch  # noqa: E402


def inductor_graph_counters() -> dict[str, int]:
    """Inductor's CUDA-graph counters so far (skips, recordings), by name."""
    from torch._dynamo.utils import counters

    return {name: int(count) for name, count in counters["inductor"].items() if "cudagraph" in name}


def exactness_checks(device: torch.device) -> list[tuple[str, str]]:
    """(check, result) rows: greedy identity in four shapes and a chi-square, on `device`, under compile=True."""
    import hf_specsample  # noqa: F401  (registers draft_model=)
    from hf_specsample import SpeculativeConfig
    from hf_specsample_bench.tiny import PAD_ID, tiny_llama

    target = tiny_llama(0, 16, 2, 32).to(device)
    draft = tiny_llama(1, 16, 2, 32).to(device)
    config = SpeculativeConfig(compile=True, num_lookahead=3)
    rows: list[tuple[str, str]] = []

    def check(name: str, run: Callable[[], str]) -> None:
        """One row: its result, or the error it raised (the next checks still run)."""
        try:
            result = run()
        except Exception as error:  # noqa: BLE001  (a check that fails is a row of the table, not the end of it)
            traceback.print_exc()
            result = f"ERROR {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        rows.append((name, result))
        print(f"| {name} | {result} |", flush=True)

    def compare(ids: torch.Tensor, **kwargs) -> str:
        plain = target.generate(ids, pad_token_id=PAD_ID, do_sample=False, **kwargs)
        ours = target.generate(ids, pad_token_id=PAD_ID, do_sample=False, draft_model=draft, speculative_config=config,
                               **kwargs)  # fmt: skip
        return "identical" if torch.equal(plain, ours) else "DIFFERENT"

    def repeated() -> str:
        before = inductor_graph_counters()
        result = compare(one, max_new_tokens=24)
        after = inductor_graph_counters()
        moved = {name: after[name] - before.get(name, 0) for name in after}
        return f"{result}; counters moved: {moved}"

    one = torch.tensor([[1, 5, 2, 5]], device=device)
    ragged = torch.tensor([[1, 5, 2, 5, 3], [PAD_ID, PAD_ID, 3, 7, 2]], device=device)
    mask = (ragged != PAD_ID).long()
    check("greedy, 1 row", lambda: compare(one, max_new_tokens=24))
    check("greedy, ragged batch", lambda: compare(ragged, attention_mask=mask, max_new_tokens=24))
    check("greedy, rows ending early", lambda: compare(ragged, attention_mask=mask, max_new_tokens=24, eos_token_id=3))
    check("greedy, rows ending early, again", lambda: compare(ragged, attention_mask=mask, max_new_tokens=24,
                                                              eos_token_id=3))  # fmt: skip
    check("second chat turn on the returned cache", lambda: second_turn(target, draft, config, device))
    check("greedy, 1 row, again (graph counters moved)", repeated)
    check("chi-square, 2 tokens, temperature 0.9", lambda: chi_square(target, draft, config, device))
    return rows


def second_turn(target, draft, config, device: torch.device) -> str:
    from hf_specsample.core.transformers_api import CACHE
    from hf_specsample_bench.tiny import PAD_ID

    prompt = torch.tensor([[1, 5, 2, 5]], device=device)
    kwargs = dict(max_new_tokens=10, pad_token_id=PAD_ID, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(prompt, **kwargs)
    ours = target.generate(prompt, draft_model=draft, speculative_config=config, **kwargs)
    turn = torch.tensor([[11, 12, 13]], device=device)
    cache_name = CACHE
    again = {"max_new_tokens": 10, "pad_token_id": PAD_ID, "do_sample": False}
    plain_2 = target.generate(torch.cat([plain.sequences, turn], 1), **{cache_name: getattr(plain, cache_name)},
                              **again)  # fmt: skip
    ours_2 = target.generate(torch.cat([ours.sequences, turn], 1), **{cache_name: getattr(ours, cache_name)},
                             draft_model=draft, speculative_config=config, **again)  # fmt: skip
    return "identical" if torch.equal(plain_2, ours_2) else "DIFFERENT"


def chi_square(target, draft, config, device: torch.device, samples: int = 1000) -> str:
    """Two-token continuations sampled with temperature 0.9 against their exact probabilities (enumerated, EOS
    barred as `min_new_tokens` bars it); one row per call, so that every call reuses the kept caches and runners
    (`tests/test_runner.py` samples a batch whose rows stop apart, on spare rows, on the CPU)."""
    from hf_specsample_bench.tiny import PAD_ID

    prompt = torch.tensor([[1, 5, 2, 5]], device=device)
    eos = target.generation_config.eos_token_id  # min_new_tokens=2 bars it from both positions

    def processed(logits: torch.Tensor) -> torch.Tensor:  # (..., vocab) -> probabilities as generate() draws them
        logits = logits.double() / 0.9
        if eos is not None:
            logits[..., eos] = -float("inf")
        return torch.softmax(logits, -1)

    with torch.no_grad():
        first = processed(target(prompt).logits[0, -1])  # (vocab,)
        both = torch.cat([prompt.repeat(16, 1), torch.arange(16, device=device)[:, None]], 1)
        second = processed(target(both).logits[:, -1])  # (vocab, vocab)
    exact = (first[:, None] * second).flatten().cpu()
    generator = torch.Generator(device=device).manual_seed(0)
    index = []
    for _ in range(samples):
        out = target.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=True, temperature=0.9, top_k=0,
                              top_p=1.0, pad_token_id=PAD_ID, draft_model=draft, speculative_config=config,
                              generator=generator)  # fmt: skip
        index.append(int(out[0, -2]) * 16 + int(out[0, -1]))
    observed = torch.bincount(torch.tensor(index), minlength=256).double()
    expected = exact * samples
    keep = expected >= 5  # pool the rare cells, as the tests' chi-square does
    observed_cells = torch.cat([observed[keep], observed[~keep].sum()[None]])
    expected_cells = torch.cat([expected[keep], expected[~keep].sum()[None]])
    statistic = float(((observed_cells - expected_cells) ** 2 / expected_cells.clamp_min(1e-12)).sum())
    df = int(keep.sum())
    try:
        from scipy import stats

        return f"p = {stats.chi2.sf(statistic, df):.3g} (statistic {statistic:.1f}, {df} df, {samples} samples)"
    except ImportError:
        return f"statistic {statistic:.1f} on {df} df, {samples} samples (scipy absent: see a chi-square table)"


def weightless_rows(large: bool, quick: bool) -> None:
    """The weightless tables for the issue's shapes (printed by `hf_specsample_bench.weightless`): greedy with every
    draft accepted on one row, sampling at acceptance 0.8 on one row and on eight, and with `large` a 32B-shaped
    target sampling on one row. On an H200 (2026-11-27, `--quick`) the checks took 66 s, one row of both settings
    198 s and eight rows 218 s, compiles included."""
    from hf_specsample_bench import weightless

    common = ["--dtype", "bfloat16", "--compiled-plain", "--graphs", "--repeats", "1" if quick else "3"]
    seven = ["--target", "qwen2.5-7b", "--draft", "qwen2.5-0.5b", *common]
    weightless.main([*seven, "--settings", "greedy-all-accepted,sampling", "--rows", "1"])
    weightless.main([*seven, "--settings", "sampling", "--rows", "8"])
    if large:
        weightless.main(["--target", "qwen2.5-32b", "--draft", "qwen2.5-0.5b", *common, "--settings", "sampling",
                         "--rows", "1"])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one timed call per method: fits a 10-minute device call")
    parser.add_argument("--large", action="store_true", help="also a 32B-shaped target (80 GB of bf16 weights)")
    parser.add_argument("--no-bench", action="store_true", help="the graph and exactness checks only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a machine with a CUDA GPU).")
        return 0
    import transformers

    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"# TORCHINDUCTOR_CUDAGRAPH_OR_ERROR={os.environ.get('TORCHINDUCTOR_CUDAGRAPH_OR_ERROR')}")
    print("| check | result |\n| --- | --- |", flush=True)
    exactness_checks(device)  # prints its rows as they finish
    print(f"| inductor CUDA-graph counters | {inductor_graph_counters()} |", flush=True)
    if not args.no_bench:
        weightless_rows(args.large, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
