"""Code editing, where outputs copy their inputs: prompt lookup against transformers' own, same run, interleaved.

    python -m hf_specsample_bench.code_editing --pair qwen-coder --num-prompts 3 --prompt-offset 20 --max-new-tokens 256

Prompts: stdlib functions to be rewritten with type hints (`PromptSet.CODE_EDIT`, through the chat template).
Greedy decoding, so every method produces the same text (the target's), stopping at EOS or --max-new-tokens; the
figure is new tokens per second over all prompts. Methods, each call interleaved with the others per prompt after
one warm-up round:

- target: plain `generate()`;
- transformers lookup: `generate(prompt_lookup_num_tokens=N)`, transformers' prompt-lookup decoding;
- lookup: `generate(draft_model="prompt_lookup", prompt_lookup_num_tokens=N)`;
- lookup default: `generate(draft_model="prompt_lookup")`, at the library's default depth (24);
- lookup compiled: the same with `speculative_config=SpeculativeConfig(compile=True)` (compiled verification,
  the kernel inside the graph where its plan serves every round width; the warm-up call compiles);
- lookup compiled kernel: the same with `SpeculativeConfig(compile=True, linear_kernel="on")` (compiled
  verification whose linears are the small-rows kernel's, whatever the plan);
- lookup compiled gemm: the same with `SpeculativeConfig(compile=True, linear_kernel="off")` (compiled
  verification on inductor's frozen GEMM);
- draft: `generate(draft_model=draft)` (the library default for a model draft);
- draft + lookup: `generate(draft_model=draft, prompt_lookup_num_tokens=N)`.

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import time

import hf_specsample

from .measure import cpu_name
from .pairs import BenchPair, load_bench_pair
from .prompts import PromptSet, load_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.code_editing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--prompt-offset", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lookup-tokens", type=int, default=10, help="N of prompt_lookup_num_tokens")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the methods (default: all)")
    args = parser.parse_args(argv)

    target, draft, tokenizer = load_bench_pair(args.pair)
    prepared = hf_specsample.prepare_draft(draft, target)  # what draft_model=draft runs, made outside the timing
    n = args.lookup_tokens
    methods = {
        "target": {},
        "transformers lookup": dict(prompt_lookup_num_tokens=n),
        "lookup": dict(draft_model="prompt_lookup", prompt_lookup_num_tokens=n),
        "lookup default": dict(draft_model="prompt_lookup"),
        "lookup compiled": dict(
            draft_model="prompt_lookup",
            prompt_lookup_num_tokens=n,
            speculative_config=hf_specsample.SpeculativeConfig(compile=True),
        ),  # fmt: skip
        "lookup compiled kernel": dict(
            draft_model="prompt_lookup",
            prompt_lookup_num_tokens=n,
            speculative_config=hf_specsample.SpeculativeConfig(compile=True, linear_kernel="on"),
        ),  # fmt: skip
        "lookup compiled gemm": dict(
            draft_model="prompt_lookup",
            prompt_lookup_num_tokens=n,
            speculative_config=hf_specsample.SpeculativeConfig(compile=True, linear_kernel="off"),
        ),  # fmt: skip
        "draft": dict(draft_model=prepared),
        "draft + lookup": dict(draft_model=prepared, prompt_lookup_num_tokens=n),
    }
    if args.methods:  # "target" and "transformers lookup" are the references of the ratios
        wanted = {"target", "transformers lookup", *args.methods.split(",")}
        methods = {name: extra for name, extra in methods.items() if name in wanted}
    prompts = load_prompts(PromptSet.CODE_EDIT, args.num_prompts, offset=args.prompt_offset)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    print(f"{args.pair}, {len(prompts)} code-editing prompts from #{args.prompt_offset}, greedy; CPU: {cpu_name()}")

    warm = prompts[0].encode(tokenizer)
    for name, extra in methods.items():  # the compiled methods compile here
        start = time.perf_counter()
        target.generate(**warm, **{**common, "max_new_tokens": 8}, **extra)
        print(f"  warm-up {name}: {time.perf_counter() - start:.1f} s", flush=True)
    seconds = {name: 0.0 for name in methods}
    tokens = {name: 0 for name in methods}
    texts = {}
    for prompt in prompts:
        inputs = prompt.encode(tokenizer)
        for name, extra in methods.items():
            start = time.perf_counter()
            out = target.generate(**inputs, **common, **extra)
            seconds[name] += time.perf_counter() - start
            tokens[name] += out.shape[1] - inputs["input_ids"].shape[1]
            texts.setdefault(prompt.prompt_id, set()).add(tuple(out[0].tolist()))
            rate = (out.shape[1] - inputs["input_ids"].shape[1]) / (time.perf_counter() - start)
            print(f"  {prompt.prompt_id} {name}: {rate:.2f} tok/s", flush=True)
    print(f"same text from every method: {all(len(outputs) == 1 for outputs in texts.values())}")
    base, reference = (
        tokens["target"] / seconds["target"],
        tokens["transformers lookup"] / seconds["transformers lookup"],
    )
    for name in methods:
        rate = tokens[name] / seconds[name]
        print(
            f"{name:>22}: {rate:6.2f} tok/s  {rate / base:5.2f}x target  {rate / reference:5.2f}x transformers lookup"
        )


if __name__ == "__main__":
    main()
