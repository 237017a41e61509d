"""What a round that drafts nothing (K = 0) costs against a plain decoding step: the loop's own overhead.

    python benchmarks/k0_round.py --pair tiny --batch 1,8 --new-tokens 64
    python benchmarks/k0_round.py --pair qwen-coder --batch 1,8 --new-tokens 32

When drafting does not pay (a compute-bound batch, a useless draft) the adaptive policy drafts nothing, and each
round is a plain decoding step plus hf_specsample's bookkeeping. This times, in the same process and interleaved,
plain `generate()` and `generate(draft_model=..., lookahead_policy=K=0)` on the same left-padded HumanEval prompts
(fixed length: `min_new_tokens` = `max_new_tokens`), and prints seconds per step and their ratio. Greedy decoding,
so both produce the same tokens. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_specsample  # noqa: F401  (registers draft_model=)
from hf_specsample import SpeculativeConfig
from hf_specsample.lookahead import FixedLookahead
from hf_specsample_bench.pairs import BenchPair, load_bench_pair
from hf_specsample_bench.prompts import PromptSet, load_prompts

NO_DRAFTING = SpeculativeConfig(lookahead_policy=lambda: FixedLookahead(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.TINY)
    parser.add_argument("--batch", type=lambda text: [int(b) for b in text.split(",")], default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed calls per method")
    args = parser.parse_args()
    target, draft, tokenizer = load_bench_pair(args.pair, progress=False)
    tokenizer.padding_side = "left"
    prompts = [prompt.text for prompt in load_prompts(PromptSet.HUMANEVAL, max(args.batch))]
    print(f"{'batch':>5}  {'plain s/step':>12}  {'K=0 s/round':>11}  {'ratio':>6}  same tokens")
    for batch in args.batch:
        inputs = tokenizer(prompts[:batch], return_tensors="pt", padding=True)
        common = dict(
            do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        runs = {
            "plain": lambda inputs=inputs, common=common: target.generate(**inputs, **common),
            "k0": lambda inputs=inputs, common=common: target.generate(
                **inputs, draft_model=draft, speculative_config=NO_DRAFTING, **common
            ),
        }
        outputs = {name: run() for name, run in runs.items()}  # warm-up (and the int8 copy of the draft)
        seconds = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                seconds[name].append((time.perf_counter() - start) / args.new_tokens)
        plain, k0 = (statistics.median(seconds[name]) for name in ("plain", "k0"))
        same = torch.equal(outputs["plain"], outputs["k0"])
        print(f"{batch:>5}  {plain:>12.5f}  {k0:>11.5f}  {k0 / plain:>5.2f}x  {same}")


if __name__ == "__main__":
    main()
