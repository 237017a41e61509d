"""Ours against llama.cpp's speculative decoding: the same CPU, pair and prompts, the same work counted the same way.

    python -m hf_specsample_bench.llama_cpp --bin LLAMA_CPP/build/bin \\
        --target-gguf qwen-1.5b-bf16.gguf --draft-gguf qwen-0.5b-bf16.gguf --num-prompts 8

llama.cpp's `llama-speculative-simple` prints its prompt's time ("encoded") apart from its decoding's ("decoded"), and
stops at the end-of-text token. A `generate()` call's tokens/s, as the benchmark tool reports it, counts the prompt's
forwards too and, with `min_new_tokens = max_new_tokens`, keeps decoding past the end of the text, where a draft
agrees less. So here ours runs as llama.cpp does: greedy, stopping where its text ends, each call's seconds split into
its prefill (forwards over more than `PREFILL_POSITIONS` positions, timed by hooks on the target and on the draft's
models) and its decoding. Ours' target verifies the first round's draft in the prompt's forward, so that round's
tokens count toward the whole call only; llama.cpp's prompt's forward leaves out the prompt's last token, fed with its
first round's draft in decoding, so all its tokens count toward its decoding. For each prompt: the tokens each
generated, decoding tok/s, whole-call tok/s (the prompt included); then both rates over the prompts on which every
method ran to `--max-new-tokens` (equal texts, equal lengths; a text that ends early is dominated by its first rounds)
and over all prompts. Ours stops at every token llama.cpp ends a text at (`LLAMA_CPP_END_TEXTS`, beside the
checkpoint's `eos_token_id`); texts can still differ where bf16 arithmetic flips a near-tie. llama.cpp runs as a
subprocess, one at a time, after ours (not beside it). Its GGUF files should hold the same weights as the checkpoint
folders ours loads (`convert_hf_to_gguf.py --outtype bf16` of those folders). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import hf_specsample
from hf_specsample import SpeculativeConfig

from .measure import cpu_name
from .pairs import BenchPair, load_bench_pair
from .prompts import PromptSet, load_prompts

BINARY = "llama-speculative-simple"
# Tokens llama.cpp ends a text at by their text, beside its GGUF's eos (`special_eog_ids` in its src/llama-vocab.cpp):
# Qwen2.5's vocabulary has five of them, where its checkpoint's `eos_token_id` names one.
LLAMA_CPP_END_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
PREFILL_POSITIONS = 16  # forwards over more positions are a prompt's (a round verifies at most 16)


@dataclass(frozen=True)
class Run:
    """One call: tokens generated, seconds of its prompt's forwards, seconds of its decoding, and the tokens its
    decoding made: all of llama.cpp's (its prompt's forwards leave the prompt's last token to its first round), all
    but ours' first round's (the target verifies the first draft in the prompt's forward, a prefill by its width)."""

    tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int

    @property
    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_seconds

    @property
    def whole_rate(self) -> float:
        return self.tokens / (self.prefill_seconds + self.decode_seconds)


def parse_speculative(output: str) -> Run:
    """The `encoded ... tokens in ... seconds` and `decoded ... tokens in ... seconds` lines of
    `llama-speculative-simple`'s output.

    Raises:
        ValueError: either line is missing (the output is quoted, shortened, to say what ran instead).
    """
    encoded = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", output)
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", output)
    if encoded is None or decoded is None:
        raise ValueError(f"no 'encoded'/'decoded' timing lines in llama-speculative-simple's output: {output[-800:]!r}")
    return Run(int(decoded.group(1)), float(encoded.group(2)), float(decoded.group(2)), int(decoded.group(1)))


class LlamaCppFailed(RuntimeError):
    """`llama-speculative-simple` exited with an error status or printed no timing lines; the message quotes the
    command and the end of its output."""


def problems(binaries: Path, target: Path | None, draft: Path | None) -> list[str]:
    """What keeps llama.cpp from running, in words, checked before any model is loaded (empty: nothing)."""
    found = []
    binary = binaries / BINARY
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        found.append(
            f"no executable {BINARY} in {binaries}: build it (`cmake -B build && cmake --build build --target "
            f"{BINARY}` in a llama.cpp checkout) and pass its build/bin folder as --bin"
        )
    for option, path in (("--target-gguf", target), ("--draft-gguf", draft)):
        if path is not None and not path.is_file():
            found.append(
                f"{option} {path}: no such file (llama.cpp's `convert_hf_to_gguf.py --outtype bf16` of the checkpoint "
                "folder makes it)"
            )
    return found


def llama_speculative(binaries: Path, target: Path, draft: Path, prompt: str, tokens: int, draft_max: int) -> Run:
    """One greedy `llama-speculative-simple` run (2 threads for each model, as this machine has).

    Raises:
        LlamaCppFailed: it exited with an error status, or its output has no timing lines.
    """
    with tempfile.TemporaryDirectory(prefix="hf_specsample_llama_") as folder:
        prompt_file = Path(folder) / "prompt.txt"
        # llama.cpp's `-f` drops the file's last newline (common/arg.cpp): one more keeps the prompt's own, which a
        # HumanEval prompt ends with (without it the model continues another text)
        prompt_file.write_text(prompt + "\n")
        command = [
            str(binaries / BINARY), "-m", str(target), "-md", str(draft), "-f", str(prompt_file),
            "-n", str(tokens), "--temp", "0", "--top-k", "1", "-t", str(torch.get_num_threads()),
            "-td", str(torch.get_num_threads()), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max),
            "-c", "4096",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = done.stderr + done.stdout
    if done.returncode != 0:
        raise LlamaCppFailed(
            f"{BINARY} exited with status {done.returncode}; run it by hand to see why:\n  {' '.join(command)}\n"
            f"the end of its output: {output[-800:]!r}"
        )
    try:
        return parse_speculative(output)
    except ValueError as error:
        raise LlamaCppFailed(f"{error}\n(the command: {' '.join(command)})") from error


class PrefillClock:
    """Seconds spent in forwards over more than `PREFILL_POSITIONS` positions of the hooked models, summed."""

    def __init__(self, models: list[torch.nn.Module]):
        self.seconds = 0.0
        self._started: float | None = None
        self.handles = []
        for model in {id(model): model for model in models}.values():
            self.handles.append(model.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(model.register_forward_hook(self._leave, with_kwargs=True))

    @staticmethod
    def _wide(args, kwargs) -> bool:
        """Whether a forward's `input_ids` hold more than `PREFILL_POSITIONS` positions."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        return ids is not None and ids.shape[-1] > PREFILL_POSITIONS

    def _enter(self, module, args, kwargs):
        if self._started is None and self._wide(args, kwargs):
            self._started = time.perf_counter()

    def _leave(self, module, args, kwargs, output):
        if self._started is not None and self._wide(args, kwargs):
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def remove(self):
        for handle in self.handles:
            handle.remove()


def end_ids(tokenizer, eos_token_id: int | list[int] | None) -> list[int]:
    """The ids llama.cpp ends a text at: the checkpoint's `eos_token_id` and the vocabulary's `LLAMA_CPP_END_TEXTS`."""
    own = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    vocabulary = tokenizer.get_vocab()
    return sorted(set(own) | {vocabulary[text] for text in LLAMA_CPP_END_TEXTS if text in vocabulary})


def ours(
    target, prepared, clock: PrefillClock, input_ids: torch.Tensor, tokens: int, config, ends: list[int] | None = None
) -> Run:
    """One greedy `generate(draft_model=prepared, speculative_config=config)` call, stopping where its text ends (at
    any of `ends`, else at the checkpoint's `eos_token_id`). Its first round's tokens (accepted + 1) are left out of its
    decoding's: the prompt's forward verified them."""
    kwargs = {"max_new_tokens": tokens, "do_sample": False, "draft_model": prepared, "speculative_config": config}
    if ends:
        kwargs["eos_token_id"] = ends
    clock.seconds = 0.0
    start = time.perf_counter()
    out = target.generate(input_ids, return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    made = out.sequences.shape[1] - input_ids.shape[1]
    depths = out.speculative_stats.accepted_depth_per_round  # one row: whole tokens; none where no round drafted
    first_round = min(made, round(depths[0]) + 1 if depths else 1)  # without a draft, the prompt's forward's token
    return Run(made, clock.seconds, seconds - clock.seconds, made - first_round)


def summary(runs: dict[str, list[Run]], keep: list[bool]) -> dict[str, tuple[float, float]]:
    """Per method: (decoding tok/s, whole-call tok/s) over the prompts `keep` marks."""
    rates = {}
    for name, method_runs in runs.items():
        kept = [run for run, kept in zip(method_runs, keep, strict=True) if kept]
        if kept:
            decode = sum(run.decode_tokens for run in kept) / sum(run.decode_seconds for run in kept)
            whole = sum(run.tokens for run in kept) / sum(run.decode_seconds + run.prefill_seconds for run in kept)
            rates[name] = (decode, whole)
    return rates


OUR_METHODS = {
    "ours, default": SpeculativeConfig(),
    "ours, chain of 8": SpeculativeConfig(num_lookahead=8, draft_shape="chain"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.llama_cpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bin", type=Path, help="llama.cpp's build/bin folder (none: ours only)")
    parser.add_argument("--target-gguf", type=Path)
    parser.add_argument("--draft-gguf", type=Path)
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-offset", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-max", default="3,8", help="llama.cpp's --spec-draft-n-max values, comma-separated")
    args = parser.parse_args(argv)
    if args.bin is not None and (args.target_gguf is None or args.draft_gguf is None):
        parser.error("--bin needs --target-gguf and --draft-gguf")
    if args.pair is BenchPair.QWEN_CODER_SMOLLM2:  # llama.cpp's draft-simple refuses a draft of another vocabulary
        shared = ", ".join(pair.value for pair in BenchPair if pair is not args.pair)
        parser.error(f"--pair {args.pair.value}: its draft has its own tokenizer; choose a pair with one ({shared})")
    if args.bin is not None and (found := problems(args.bin, args.target_gguf, args.draft_gguf)):
        parser.error("; ".join(found))
    try:
        draft_maxes = [int(value) for value in args.draft_max.split(",")]
    except ValueError:
        parser.error(f"--draft-max {args.draft_max!r}: whole numbers, comma-separated (for example 3,8)")
    torch.set_grad_enabled(False)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; {torch.get_num_threads()} threads")
    target, draft, tokenizer = load_bench_pair(args.pair, torch.bfloat16, progress=False)
    prepared = hf_specsample.prepare_draft(draft, target)
    prompts = load_prompts(PromptSet.HUMANEVAL, args.num_prompts, offset=args.prompt_offset)
    clock = PrefillClock([target, draft, prepared.model])
    ends = end_ids(tokenizer, target.generation_config.eos_token_id)  # texts end where llama.cpp's end
    methods = dict(OUR_METHODS)
    warm = tokenizer(prompts[0].text, return_tensors="pt").input_ids
    for config in methods.values():  # one call each first: kernel timings, the draft's forms, first-call costs
        ours(target, prepared, clock, warm, 16, config, ends)
    runs: dict[str, list[Run]] = {name: [] for name in methods}
    names = list(methods)
    for index, prompt in enumerate(prompts):
        input_ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        for name in names[index % len(names) :] + names[: index % len(names)]:  # the order rotates
            runs[name].append(ours(target, prepared, clock, input_ids, args.max_new_tokens, methods[name], ends))
    clock.remove()
    if args.bin is not None:
        for draft_max in draft_maxes:
            name = f"llama.cpp, draft max {draft_max}"
            try:
                runs[name] = [
                    llama_speculative(args.bin, args.target_gguf, args.draft_gguf, prompt.text, args.max_new_tokens,
                                      draft_max)
                    for prompt in prompts
                ]  # fmt: skip
            except LlamaCppFailed as error:
                parser.exit(1, f"{parser.prog}: error: llama.cpp failed (draft max {draft_max}): {error}\n")
    for index in range(len(prompts)):
        print(f"prompt {index + args.prompt_offset}:")
        for name, method_runs in runs.items():
            run = method_runs[index]
            print(f"  {name:<28} {run.tokens:4d} tokens, decoding {run.decode_rate:6.2f} tok/s, "
                  f"whole call {run.whole_rate:6.2f} tok/s (prefill {run.prefill_seconds:.2f} s)")  # fmt: skip
    full = [
        all(method_runs[index].tokens >= args.max_new_tokens for method_runs in runs.values())
        for index in range(len(prompts))
    ]
    for label, keep in ((f"the {sum(full)} prompts every method ran to {args.max_new_tokens} tokens", full),
                        (f"all {len(prompts)} prompts", [True] * len(prompts))):  # fmt: skip
        rates = summary(runs, keep)
        if not rates:
            continue
        print(f"\nover {label}: decoding tok/s, whole-call tok/s")
        llama = [rate for name, rate in rates.items() if name.startswith("llama.cpp")]
        # each rate against llama.cpp's best at that rate (its best decoding and best whole call may differ in K)
        best = (max(rate[0] for rate in llama), max(rate[1] for rate in llama)) if llama else None
        for name, (decode, whole) in rates.items():
            against = f"  ({decode / best[0]:.2f}x, {whole / best[1]:.2f}x llama.cpp's best)" if best else ""
            print(f"  {name:<28} {decode:6.2f} {whole:6.2f}{against}")
    median_prefill = statistics.median(run.prefill_seconds for run in runs["ours, default"])
    print(f"\nours: a call's prefill takes {median_prefill:.2f} s (median)")


if __name__ == "__main__":
    main()
