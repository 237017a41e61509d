"""A costly logits processor against plain `generate()`: the default `draft_model=` call's time over plain's.

    python -m hf_specsample_bench.processor_cost
    python -m hf_specsample_bench.processor_cost --processor-ms 1 --pairs poor --threads 1

Every drafted and every verified position is processed with its own prefix, so a round of K draft tokens calls the
processors 2K + 1 times for at most K + 1 tokens; the default policy times them apart and lowers K (down to plain
decoding) where they cost too much (`round_costs.ProcessingCost`). This measures it with a processor that sleeps
`--processor-ms` per call (a grammar engine, a scorer in Python; not one of transformers' own, so the library does
not know its cost) on two tiny pairs: "poor", a random target and an unrelated random draft, and "close", a target
whose layers after the first change nothing (their output projections zeroed: 8 layers of cost, 1 of function) and
its first layer with 5% noise as the draft; "close" also runs without the processor (`--processor-ms` -1 for all).
Per case, plain and ours alternate, after two warm-up calls each, and the ratio of their medians is printed with the
K's of the last call, tokens per target pass and the processors' ms per position. Figures are printed, never
asserted; the machine may be shared, so they are indicative.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_specsample  # noqa: F401  (registers draft_model=)

from .measure import cpu_name
from .tiny import tiny_llama

PROMPT = torch.tensor([[1, 5, 9, 13, 17, 21]])


class SleepingProcessor(LogitsProcessor):
    """Costs `seconds` per call and changes nothing."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        time.sleep(self.seconds)
        return scores


def poor_pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A random target and an unrelated random draft (the tests' `tiny_lm` shapes): almost nothing is accepted."""
    target = tiny_llama(0, 64, layers=2, hidden=64, heads=2, kv_heads=1, init_range=0.5, eos_token_id=None)
    draft = tiny_llama(1, 64, layers=1, hidden=16, heads=2, kv_heads=1, init_range=0.5, eos_token_id=None)
    return target, draft


def close_pair(noise: float = 0.05) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A target of 8 layers computing what its first does, and that layer with `noise` as the draft."""
    target = tiny_llama(0, 64, layers=8, hidden=256, heads=2, kv_heads=1, init_range=0.5, eos_token_id=None)
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        draft = copy.deepcopy(target)
        draft.model.layers = draft.model.layers[:1]
        draft.config.num_hidden_layers = 1
        generator = torch.Generator().manual_seed(3)
        for parameter in draft.parameters():
            spread = parameter.std() if parameter.numel() > 1 else parameter.abs()
            parameter.add_(noise * spread * torch.randn(parameter.shape, generator=generator))
    return target, draft


def measure(target, draft, processor_ms: float, do_sample: bool, new_tokens: int, repeats: int) -> str:
    """One case's line: plain and ours alternating (`repeats` each, after two warm-up calls each)."""
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=do_sample)

    def call(**extra):
        processors = [SleepingProcessor(processor_ms / 1e3)] if processor_ms >= 0 else []
        start = time.perf_counter()
        out = target.generate(PROMPT, logits_processor=LogitsProcessorList(processors), **settings, **extra)
        return time.perf_counter() - start, out

    ours_kwargs = dict(draft_model=draft, return_dict_in_generate=True)
    for _ in range(2):
        call(), call(**ours_kwargs)
    plain, ours, per_pass = [], [], []
    for _ in range(repeats):
        plain.append(call()[0])
        seconds, out = call(**ours_kwargs)
        ours.append(seconds)
        per_pass.append(out.speculative_stats.tokens_per_target_pass)
    stats = out.speculative_stats
    return (
        f"plain {1e3 * statistics.median(plain):7.1f} ms  ours {1e3 * statistics.median(ours):7.1f} ms  "
        f"ratio {statistics.median(ours) / statistics.median(plain):.3f}  tokens/pass {statistics.mean(per_pass):.2f}  "
        f"processors {1e3 * stats.processing_seconds_per_position:.2f} ms/position  K's {stats.lookahead_per_round}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.processor_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--processor-ms", type=float, default=10.0, help="per call; -1: no processor")
    parser.add_argument("--pairs", default="poor,close", help="comma-separated: poor, close (default: %(default)s)")
    parser.add_argument("--modes", default="greedy,sampling", help="comma-separated (default: %(default)s)")
    parser.add_argument("--new-tokens", default="12,48", help="comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    pairs = {"poor": poor_pair, "close": close_pair}
    for pair in args.pairs.split(","):
        target, draft = pairs[pair]()
        processor_settings = [args.processor_ms] + ([-1.0] if pair == "close" and args.processor_ms >= 0 else [])
        for processor_ms in processor_settings:
            for mode in args.modes.split(","):
                for new_tokens in (int(n) for n in args.new_tokens.split(",")):
                    line = measure(target, draft, processor_ms, mode == "sampling", new_tokens, args.repeats)
                    processor = f"{processor_ms:g} ms processor" if processor_ms >= 0 else "no processor"
                    print(f"{pair:<5} {processor:<18} {mode:<8} {new_tokens:>3} tokens: {line}", flush=True)


if __name__ == "__main__":
    main()
