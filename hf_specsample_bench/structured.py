"""Structured output with a grammar: plain `generate()` against `draft_model=`, both with xgrammar's processor.

    python -m hf_specsample_bench.structured --problems 4
    python -m hf_specsample_bench.structured --pair tiny --problems 2 --max-new-tokens 32   # a quick check

For each HumanEval problem, the model is asked for a JSON object describing the function (its name, its arguments
with their types, its return type, a one-line summary and three example calls) under a fixed JSON schema, compiled
once by xgrammar for the target's tokenizer (laid out with an indent of 2, no other whitespace); each call gets a
fresh `xgrammar.contrib.hf.LogitsProcessor` of it.
Plain `generate()` and the default `draft_model=` call alternate per problem, after one warm-up call each, in each mode
of `--modes`: `greedy`; `sampling` (T = 0.7, ours seeded by `generator=`, which repeats in any process and chooses the
draft's form without the clock); `sampling-manual-seed` (T = 0.7, seeded by `torch.manual_seed` alone, as a user's
usual call: the draft's forms timed and weighed on the prompt, as in a greedy call). The new tokens (up to EOS) over
the summed times give tokens per second, and the ratio of those is printed with the tokens per target pass, the share
of accepted draft tokens the grammar forced (proposed without a draft forward: `speculative_stats.
grammar_forced_tokens`), the grammar processor's milliseconds per committed token (plain's timed around its calls,
ours from `speculative_stats.grammar_seconds`), whether each text parses as JSON with the schema's keys, and whether
greedy texts are identical. transformers' `assistant_model=` is tried once with the same processor and its outcome
printed. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from transformers import LogitsProcessor

import hf_specsample  # noqa: F401  (registers draft_model=)

from .measure import cpu_name
from .methods import Choice
from .pairs import BenchPair, load_bench_pair
from .prompts import load_problems


class Mode(Choice):
    GREEDY = "greedy"
    SAMPLING = "sampling"  # ours seeded by generator=: the draft's form chosen without the clock
    SAMPLING_MANUAL_SEED = "sampling-manual-seed"  # seeded by torch.manual_seed alone, as a user's usual call


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                "required": ["name", "type"],
            },
        },
        "returns": {"type": "string"},
        "summary": {"type": "string"},
        "examples": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
    },
    "required": ["name", "arguments", "returns", "summary", "examples"],
}
INSTRUCTION = (
    "Describe this Python function as a JSON object with its name, its arguments with their types, its return type, "
    "a one-line summary and three example calls.\n\n"
)


class Timed(LogitsProcessor):
    """Plain's grammar processor, its calls timed (`seconds`)."""

    def __init__(self, processor: Any):
        self.processor, self.seconds = processor, 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        started = time.perf_counter()
        out = self.processor(input_ids, scores)
        self.seconds += time.perf_counter() - started
        return out


def prompt_ids(tokenizer: Any, problem: dict) -> torch.Tensor:
    """`(1, length)` the chat prompt asking for the problem's function as JSON."""
    messages = [{"role": "user", "content": INSTRUCTION + problem["prompt"]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


def parses(text: str) -> bool:
    """Whether `text` is a JSON object with every key the schema requires."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and all(key in value for key in SCHEMA["required"])


def main(argv: list[str] | None = None) -> None:
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--modes", default="greedy,sampling", help=f"comma-separated, of {[str(m) for m in Mode]}")
    args = parser.parse_args(argv)
    target, draft, tokenizer = load_bench_pair(args.pair, progress=False)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=target.config.vocab_size)
    # laid out as json.dumps(indent=2) does: with any whitespace allowed, Qwen2.5-Coder greedy fills half the texts
    # with newlines until max_new_tokens (plain and ours alike), and they never parse
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, indent=2)
    eos = tokenizer.eos_token_id
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; pair {args.pair.value}; {args.problems} problems")
    problems = load_problems(args.problems)

    def run(ids: torch.Tensor, mode: Mode, ours: bool) -> tuple[float, list[int], float, float, float]:
        """(seconds, new tokens, grammar seconds, tokens per target pass, the grammar-forced share of accepted
        tokens) of one call."""
        timed = Timed(GrammarProcessor(grammar))
        settings: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, pad_token_id=eos)
        if mode is Mode.GREEDY:
            settings.update(do_sample=False)
        else:
            settings.update(do_sample=True, temperature=0.7, top_p=1.0, top_k=0)
            torch.manual_seed(0)
            if mode is Mode.SAMPLING:
                settings.update(generator=torch.Generator().manual_seed(0))
        if ours:
            settings.update(draft_model=draft, logits_processor=[timed.processor], return_dict_in_generate=True)
        else:
            settings.pop("generator", None)
            settings.update(logits_processor=[timed])
        started = time.perf_counter()
        out = target.generate(ids, **settings)
        seconds = time.perf_counter() - started
        sequences = out.sequences if ours else out
        new = sequences[0, ids.shape[1] :].tolist()
        new = new[: new.index(eos) + 1] if eos in new else new
        if ours:
            stats = out.speculative_stats
            forced = stats.grammar_forced_tokens / max(1, sum(stats.row_accepted_tokens))
            return seconds, new, stats.grammar_seconds, stats.tokens_per_target_pass, forced
        return seconds, new, timed.seconds, 1.0, 0.0

    for mode in [Mode(mode) for mode in args.modes.split(",") if mode]:
        totals = {False: [0.0, 0, 0.0], True: [0.0, 0, 0.0]}
        passes, shares, valid, same = [], [], {False: 0, True: 0}, 0
        for index, problem in enumerate(problems):
            ids = prompt_ids(tokenizer, problem)
            if index == 0:
                run(ids, mode, False), run(ids, mode, True)  # warm-up
            texts = {}
            for ours in (False, True):
                seconds, new, grammar_seconds, per_pass, forced_share = run(ids, mode, ours)
                totals[ours][0] += seconds
                totals[ours][1] += len(new)
                totals[ours][2] += grammar_seconds
                texts[ours] = new
                valid[ours] += parses(tokenizer.decode(new, skip_special_tokens=True))
                if ours:
                    passes.append(per_pass)
                    shares.append(forced_share)
            same += texts[False] == texts[True]
        rate = {ours: totals[ours][1] / totals[ours][0] for ours in (False, True)}
        ms = {ours: 1000 * totals[ours][2] / max(1, totals[ours][1]) for ours in (False, True)}
        count = len(problems)
        print(
            f"{mode!s:8}: plain {rate[False]:.2f} tok/s | draft_model= {rate[True]:.2f} tok/s "
            f"({rate[True] / rate[False]:.2f}x) | {sum(passes) / len(passes):.2f} tokens per target pass, "
            f"{100 * sum(shares) / len(shares):.0f}% of accepted tokens forced by the grammar | grammar ms "
            f"per token: plain {ms[False]:.2f}, ours {ms[True]:.2f} | valid JSON: plain {valid[False]}/{count}, "
            f"ours {valid[True]}/{count}" + (f" | identical texts {same}/{count}" if mode is Mode.GREEDY else "")
        )
    ids = prompt_ids(tokenizer, problems[0])
    try:
        target.generate(ids, max_new_tokens=16, assistant_model=draft, logits_processor=[GrammarProcessor(grammar)])
        print("assistant_model=: ran")
    except Exception as error:  # noqa: BLE001 (what transformers' own path does is the figure)
        print(f"assistant_model=: raises {type(error).__name__}: {str(error)[:120]}")


if __name__ == "__main__":
    main()
