"""Compiled verification on the real pair: the target's cost curve over M positions, and the methods side by side.

    python -m hf_specsample_bench.compiled_verification            # Qwen2.5-Coder 1.5B target, 0.5B draft
    python -m hf_specsample_bench.compiled_verification --prompts 3 --new-tokens 96 --load-from gguf

Prints, on the machine it runs on (`lscpu`'s model name and flags first):
1. the target's forward over M = 1..9 positions on a static cache, eager, compiled
   (`hf_specsample.cache.compiled.CompileSettings.for_device`) and eager with the small-rows linear kernel
   (`hf_specsample.kernels.small_rows`), in ms and in one-position steps; compile seconds;
2. per mode (greedy; sampling T=0.7, top_p=0.95), tokens/s on held-out HumanEval prompts (problems 100..): plain
   `generate()` eager; plain `generate()` with the small-rows kernel on every forward (`target + kernel`); plain
   `generate()` with the same static cache and compilation; `assistant_model=`, eager and (where the installed
   transformers runs it: 5.24 on) with the same static cache and compilation;
   hf_specsample eager (default options: the small-rows kernel where it pays); hf_specsample eager without it
   (`linear_kernel="off"`); hf_specsample with `SpeculativeConfig(compile=True)` (the kernel inside the compiled
   graph where its plan serves every round width), with `compile=True, linear_kernel="on"` (always the kernel's
   linears; `compile_draft=True` too, opt-in) and with `compile=True, linear_kernel="off"` (inductor's frozen
   GEMM). Calls are interleaved per prompt, after a warm-up call of every method (compilation stays out of the
   timings and is reported).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import transformers
from transformers import CompileConfig, StaticCache

import hf_specsample  # noqa: F401  (registers draft_model=)
from hf_specsample import SpeculativeConfig, prepare_draft
from hf_specsample.cache.compiled import CompileSettings, compiled_forward, positions_to_keep
from hf_specsample.cache.row_ops import full_static_cache
from hf_specsample.core.transformers_api import cache_kwargs
from hf_specsample.kernels import small_rows

from .measure import cpu_name, median_ms
from .methods import Mode, sampling_kwargs
from .models import LoadPath
from .pairs import BenchPair, load_bench_pair
from .prompts import PromptSet, load_prompts

HELD_OUT = 100  # HumanEval problems from here on were never looked at while tuning


@torch.no_grad()  # as generate() runs: dynamo guards on the grad mode, so the loop reuses this graph
def cost_curve(target, prompt_ids: torch.Tensor, repeats: int, widths=range(1, 10)) -> None:
    """The target's forward over M positions after the prompt, on a static cache: eager, compiled, and eager with the
    small-rows linear kernel (hf_specsample's default on CPU where it pays)."""
    capacity = 2 * prompt_ids.shape[1] + 64
    cache = StaticCache(config=target.config, max_cache_len=capacity)
    full_static_cache(cache, target.config, capacity)
    prompt_length = prompt_ids.shape[1]
    mask = torch.zeros((1, capacity), dtype=torch.long)
    compiled = compiled_forward(target, CompileSettings.for_device(torch.device("cpu")))

    def forward(function, width: int, start: int = prompt_length, keep: int | None = None):
        """One forward over `width` positions from `start`, returning `keep` logits (default all), rolled back."""
        keep = width if keep is None else keep

        def run():
            for layer in cache.layers:  # the write pointer at `start`
                layer.cumulative_length.fill_(start)
            mask[:, : start + width] = 1
            mask[:, start + width :] = 0
            source = prompt_ids if width <= prompt_length else prompt_ids.repeat(1, 2)
            ids = source[:, -width:].clone(memory_format=torch.contiguous_format)  # row-major, as the loop's
            positions = torch.arange(start, start + width).repeat(1, 1)  # (1, width), not a view (as the loop's)
            # generate()'s arguments in the loop's order (dynamo guards on it): the loop reuses this compiled graph;
            # compiled code gets the kept positions as a tensor, as the loop passes them (an int is specialised)
            to_keep = positions_to_keep(width, keep, torch.device("cpu"), compiled=function is compiled)
            kwargs = dict(**cache_kwargs(target, cache), use_cache=True, attention_mask=mask, position_ids=positions)
            function(input_ids=ids, **kwargs, logits_to_keep=to_keep)
            for layer in cache.layers:  # roll back: the next call writes the same slots
                layer.cumulative_length.fill_(prompt_length)
            mask[:, prompt_length:] = 0

        return run

    # As the loop does (`CachedModel.warm_up`): two positions at slot 0 eagerly (allocating the cache), then
    # compiled (compiling), then the prompt through the same graph, then the rounds' widths after it.
    forward(target, 2, start=0)()
    start = time.perf_counter()
    forward(compiled, 2, start=0)()
    print(f"compiling the target (dynamic M): {time.perf_counter() - start:.0f} s "
          f"(of which compile {compiled.compile_seconds:.0f} s, {compiled.compilations} compilations)")  # fmt: skip
    compilations = compiled.compilations
    prompt_fast = median_ms(forward(compiled, prompt_length, start=0, keep=1), 2)
    prompt_eager = median_ms(forward(target, prompt_length, start=0, keep=1), 1)  # leaves the prompt in the cache
    kernel_problem = small_rows.load().problem

    def kernel(**kwargs):  # eager, with the small-rows linear kernel (`SpeculativeConfig(linear_kernel=...)`)
        with small_rows.SmallRowsLinear():
            return target(**kwargs)

    rows = []
    for width in widths:
        eager = median_ms(forward(target, width), repeats)
        # The loop feeds one position as two through compiled code (one graph, one frozen weight copy).
        fast = median_ms(forward(compiled, max(width, 2)), repeats)
        kernel_ms = median_ms(forward(kernel, width), repeats) if kernel_problem is None else float("nan")
        rows.append((width, eager, fast, kernel_ms))
    eager_1, fast_1 = rows[0][1], rows[0][2]
    print(f"\nprompt ({prompt_length} tokens; eager as plain generate() encodes it): eager {prompt_eager:.0f} ms, "
          f"compiled {prompt_fast:.0f} ms ({prompt_eager / prompt_fast:.1f}x); recompilations after the warm-up: "
          f"{compiled.compilations - compilations}")  # fmt: skip
    print(f"\nforward over M positions (prompt of {prompt_length} tokens; median of {repeats}; compiled M=1 runs "
          "as M=2)")  # fmt: skip
    if kernel_problem is not None:
        print(f"small-rows kernel: {kernel_problem}")
    kernel_1 = rows[0][3]
    print(
        f"{'M':>2} {'eager ms':>9} {'x eager M=1':>11} {'compiled ms':>12} {'x compiled M=1':>14} {'x eager M=1':>11}"
        f" {'kernel ms':>10} {'x kernel M=1':>12} {'x eager M=1':>11}"
    )
    for width, eager, fast, kernel_ms in rows:
        print(f"{width:>2} {eager:>9.1f} {eager / eager_1:>11.2f} {fast:>12.1f} {fast / fast_1:>14.2f} "
              f"{fast / eager_1:>11.2f} {kernel_ms:>10.1f} {kernel_ms / kernel_1:>12.2f} "
              f"{kernel_ms / eager_1:>11.2f}")  # fmt: skip


def methods(target, draft, prepared, compile_plain: CompileConfig) -> dict[str, dict]:
    """generate() arguments of each compared method."""
    return {
        "target eager": {},
        # one cache size for every call: transformers allocates a larger static cache for a longer call, and its
        # frozen compiled code (inductor `freezing` freezes `mark_static_address` tensors) then indexes the old one
        # ("index out of bounds" in compiled code, measured here); our loop clears
        # the mark there (cache.static_addresses.mark)
        # plain generate() with the same linear kernel (every forward of up to 1024 rows, the prompt included): what
        # the kernel alone gives, so that the rest is speculation's
        "target + kernel": dict(context=lambda: small_rows.SmallRowsLinear(small_rows.PROMPT_ROWS)),
        "target static+compiled": dict(
            cache_implementation="static", compile_config=compile_plain, max_cache_len=512, inductor_cpu=True
        ),
        "assistant_model=": dict(assistant_model=draft),
        # transformers' own speculative decoding with the same static cache and compilation as `target
        # static+compiled` (from 5.24 it compiles its verification forward; 5.23 refuses static caches there: the
        # warm-up then drops this row and says why)
        "assistant static+compiled": dict(
            assistant_model=draft,
            cache_implementation="static",
            compile_config=compile_plain,
            max_cache_len=512,
            inductor_cpu=True,
        ),
        "hf_specsample eager": dict(draft_model=prepared),  # the default: the small-rows kernel where it pays
        "hf_specsample no kernel": dict(
            draft_model=prepared, speculative_config=SpeculativeConfig(linear_kernel="off")
        ),
        "hf_specsample compiled": dict(draft_model=prepared, speculative_config=SpeculativeConfig(compile=True)),
        "hf_specsample compiled gemm": dict(
            draft_model=prepared, speculative_config=SpeculativeConfig(compile=True, linear_kernel="off")
        ),
        # compiled verification whose round-width linears are the small-rows kernel's (no frozen copy)
        "hf_specsample compiled kernel": dict(
            draft_model=prepared, speculative_config=SpeculativeConfig(compile=True, linear_kernel="on")
        ),
        "hf_specsample compiled kernel+draft": dict(
            draft_model=prepared,
            speculative_config=SpeculativeConfig(compile=True, linear_kernel="on", compile_draft=True),
        ),
        # the default with the draft's single-token steps compiled (its warm-up call compiles them)
        "hf_specsample compiled draft": dict(
            draft_model=prepared, speculative_config=SpeculativeConfig(compile_draft=True)
        ),
        # a fixed K (opt-in rows): the draft's step cost alone, apart from the adaptive policy's choices
        "hf_specsample K=5": dict(draft_model=prepared, num_lookahead=5),
        "hf_specsample K=5 compiled draft": dict(
            draft_model=prepared, num_lookahead=5, speculative_config=SpeculativeConfig(compile_draft=True)
        ),
    }


# Rows run only when named in --methods. transformers 5.24.0's compiled assisted generation (static cache,
# compile_config) ran at 0.52 tok/s on the first held-out prompt (its eager assisted generation: 4.10) and then
# aborted the whole process at the second, inside its compiled kernel ("index out of bounds: 0 <= tmp10 < ks1";
# Xeon-SPR, 2026-11-25): by default it would take every other row down with it.
OPT_IN = {
    "assistant static+compiled",
    "hf_specsample K=5",
    "hf_specsample K=5 compiled draft",
    "hf_specsample compiled kernel+draft",
}


def run_method(target, inputs, kwargs: dict, settings: dict, new_tokens: int, pad: int):
    """(new tokens, seconds, stats) of one call; inductor's CPU options are on for transformers' compiled
    generate() (`inductor_cpu`); hf_specsample's compiled forwards set their own."""
    kwargs = dict(kwargs)
    options = (
        dict(CompileSettings.for_device(torch.device("cpu")).inductor_options)
        if kwargs.pop("inductor_cpu", False)
        else {}
    )
    context = kwargs.pop("context", contextlib.nullcontext)
    start = time.perf_counter()
    with torch._inductor.config.patch(options), context():
        out = target.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                              return_dict_in_generate=True, **settings, **kwargs)  # fmt: skip
    seconds = time.perf_counter() - start
    return out.sequences.shape[1] - inputs["input_ids"].shape[1], seconds, getattr(out, "speculative_stats", None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.compiled_verification",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5, help="cost-curve repeats per M")
    parser.add_argument("--load-from", type=LoadPath, choices=list(LoadPath), default=LoadPath.CHECKPOINT)
    parser.add_argument("--modes", default="sampling,greedy")
    parser.add_argument("--skip-curve", action="store_true")
    parser.add_argument(
        "--methods", default=None, help="comma-separated subset of the method names (default: all but OPT_IN)"
    )
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}")
    target, draft, tokenizer = load_bench_pair(args.pair, torch.bfloat16, path=args.load_from)
    print(f"{args.pair} pair, bf16, loaded from {args.load_from}")
    prompts = load_prompts(PromptSet.HUMANEVAL, args.prompts, offset=HELD_OUT)
    encoded = [prompt.encode(tokenizer) for prompt in prompts]
    if not args.skip_curve:
        cost_curve(target, encoded[0]["input_ids"], args.repeats)

    prepared = prepare_draft(draft, target) if args.methods is None or "hf_specsample" in args.methods else None
    compile_plain = CompileConfig(fullgraph=False, dynamic=True, mode=None)
    compile_plain._compile_all_devices = True  # transformers compiles on CPU only with this set
    table = methods(target, draft, prepared, compile_plain)
    if args.methods:  # each compiled graph holds its own frozen weights: two may not fit in memory together
        table = {name: kwargs for name, kwargs in table.items() if name in args.methods.split(",")}
    else:
        table = {name: kwargs for name, kwargs in table.items() if name not in OPT_IN}
    pad = tokenizer.pad_token_id
    for mode in [Mode(name) for name in args.modes.split(",")]:
        settings = sampling_kwargs(mode, 0.7, 0.95)
        print(f"\n=== {mode}: warm-up (compilation) ===")
        for name, kwargs in list(table.items()):
            start = time.perf_counter()
            try:
                _, _, stats = run_method(target, encoded[0], kwargs, settings, 8, pad)
            except ValueError as error:  # a method the installed transformers refuses
                print(f"{name:<24} refused by transformers {transformers.__version__}: {error}")
                del table[name]
                continue
            extra = f", stats compile_seconds {stats.compile_seconds}" if stats is not None else ""
            print(f"{name:<24} first call {time.perf_counter() - start:.1f} s{extra}", flush=True)
        totals = {name: [0, 0.0] for name in table}
        alphas, lookaheads = {}, {}
        for index, inputs in enumerate(encoded):
            for name, kwargs in table.items():
                torch.manual_seed(index)
                tokens, seconds, stats = run_method(target, inputs, kwargs, settings, args.new_tokens, pad)
                totals[name][0] += tokens
                totals[name][1] += seconds
                if stats is not None:
                    alphas.setdefault(name, []).append(stats.alpha)
                    lookaheads.setdefault(name, []).append(stats.mean_lookahead)
                print(f"  {prompts[index].prompt_id} {name:<24} {tokens / seconds:6.2f} tok/s", flush=True)
        rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
        base = rates.get("target eager", float("nan"))
        compiled_base = rates.get("target static+compiled", float("nan"))
        assisted = rates.get("assistant_model=", float("nan"))
        print(f"\n=== {mode}, {len(encoded)} held-out HumanEval prompts x {args.new_tokens} tokens ===")
        print(f"{'method':<24} {'tok/s':>6} {'x target':>8} {'x target compiled':>17} {'x assisted':>10} "
              f"{'alpha':>5} {'mean K':>6}")  # fmt: skip
        for name, rate in rates.items():
            alpha = f"{statistics.mean(alphas[name]):.2f}" if name in alphas else "-"
            mean_k = f"{statistics.mean(lookaheads[name]):.1f}" if name in lookaheads else "-"
            print(f"{name:<24} {rate:>6.2f} {rate / base:>7.2f}x {rate / compiled_base:>16.2f}x "
                  f"{rate / assisted:>9.2f}x {alpha:>5} {mean_k:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
