"""What keeping every row's KV cache hole-free costs: cache slots against real tokens, and the per-row realign.

    python benchmarks/cache_layout.py --pair qwen2.5-coder --batch 8 --lookahead 4 --new-tokens 64
    python benchmarks/cache_layout.py --pair tiny --batch 8 --lookahead 4 --new-tokens 300

Part 1 runs batched speculative sampling (HumanEval prompts, left-padded) and reports, at the end, the target
cache's slots against the longest row's tokens, the rounds that needed a per-row realign, and the time spent
realigning against the whole round. Part 2 times one realign of a cache shaped like the target's (every layer,
`--batch` rows, ragged shifts of up to K) at several context lengths: the cost per round and per token of context.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

import hf_specsample  # noqa: F401  (registers draft_model=)
from hf_specsample.cache import row_ops
from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.decoding import SpeculativeDecoder
from hf_specsample_bench.pairs import BenchPair, load_bench_pair
from hf_specsample_bench.prompts import PromptSet, load_prompts


class RealignClock:
    """Wraps `CachedModel._realign` and `SpeculativeDecoder.round` to add up their wall time."""

    def __init__(self):
        self.realign_seconds = self.round_seconds = 0.0
        self.realigns = self.rounds = 0
        self.final: tuple[int, int] | None = None  # (target cache slots, longest row) after the last full round

    def __enter__(self):
        self._realign, self._round = CachedModel._realign, SpeculativeDecoder.round
        clock = self

        def realign(model, *args, **kwargs):
            start = time.perf_counter()
            clock._realign(model, *args, **kwargs)
            clock.realign_seconds += time.perf_counter() - start
            clock.realigns += 1

        def round_(decoder, *args, **kwargs):
            start = time.perf_counter()
            clock._round(decoder, *args, **kwargs)
            clock.round_seconds += time.perf_counter() - start
            clock.rounds += 1
            if decoder.sequences.num_active == decoder.sequences.batch_size:
                clock.final = (decoder.target.slots, max(decoder.sequences.lengths))

        CachedModel._realign, SpeculativeDecoder.round = realign, round_
        return self

    def __exit__(self, *exc):
        CachedModel._realign, SpeculativeDecoder.round = self._realign, self._round


def run_batch(target, draft, tokenizer, batch: int, lookahead: int, new_tokens: int) -> None:
    tokenizer.padding_side = "left"
    texts = [prompt.text for prompt in load_prompts(PromptSet.HUMANEVAL, limit=batch)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(do_sample=True, temperature=0.7, top_p=0.95, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    target.generate(**inputs, draft_model=draft, num_lookahead=lookahead, max_new_tokens=4)  # warm-up
    with RealignClock() as clock:
        target.generate(**inputs, draft_model=draft, num_lookahead=lookahead, generator=torch.Generator(), **kwargs)
    slots, longest = clock.final
    print(f"B={batch} K={lookahead} {new_tokens} new tokens, prompt {inputs.input_ids.shape[1]} (padded)")
    print(f"  target cache after the last full round: {slots} slots for the longest row's {longest} tokens")
    print(
        f"  {clock.rounds} rounds, {clock.realigns} realigns (draft and target), "
        f"realign {1e3 * clock.realign_seconds / clock.rounds:.2f} ms per round = "
        f"{100 * clock.realign_seconds / clock.round_seconds:.1f}% of the round time "
        f"({1e3 * clock.round_seconds / clock.rounds:.0f} ms per round)"
    )


def time_realign(config, dtype: torch.dtype, batch: int, lookahead: int, contexts: list[int], repeats: int = 5):
    text = config.get_text_config()
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    print(f"realign alone: {text.num_hidden_layers} layers x {heads} KV heads x {head_dim} dims, {dtype}, B={batch}")
    for context in contexts:
        cache = DynamicCache(config=config)
        keys = torch.randn(batch, heads, context + lookahead + 1, head_dim).to(dtype)
        for layer in range(text.num_hidden_layers):
            cache.update(keys, keys.clone(), layer)
        total = context + lookahead + 1
        drops = [row % (lookahead + 1) for row in range(batch)]  # ragged: 0..K per row
        keep = [total - drop for drop in drops]
        best = float("inf")
        for _ in range(repeats):
            trial = row_ops.take_rows(cache, range(batch))
            start = time.perf_counter()
            row_ops.realign(trial, [0] * batch, [max(keep) - kept for kept in keep], keep, max(keep))
            best = min(best, time.perf_counter() - start)
        print(
            f"  context {context:5d}: {1e3 * best:7.2f} ms per realign, "
            f"{1e6 * best / (batch * context):.3f} us per token of context and row"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default=BenchPair.QWEN_CODER.value, choices=[p.value for p in BenchPair])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--skip-generate", action="store_true", help="only time the realign alone")
    arguments = parser.parse_args(argv)
    torch.manual_seed(0)
    target, draft, tokenizer = load_bench_pair(BenchPair(arguments.pair))
    if not arguments.skip_generate:
        run_batch(target, draft, tokenizer, arguments.batch, arguments.lookahead, arguments.new_tokens)
    contexts = [int(value) for value in arguments.contexts.split(",")]
    time_realign(target.config, target.dtype, arguments.batch, arguments.lookahead, contexts)


if __name__ == "__main__":
    main()
