"""This checkout against an earlier commit of the library, in one process, interleaved: did a change cost speed?

    python -m hf_specsample_bench.versions --base 7c2921d --pair qwen-coder --num-prompts 4 --max-new-tokens 96

The earlier commit's `hf_specsample/` is extracted with `git archive` into a temporary folder under another package
name (the library imports itself only relatively), so both versions run on the same loaded models; where its
small-rows kernel source differs from this checkout's, the base's kernel is built under names of its own
(`own_kernel`), so a kernel change can be measured too. For every prompt and mode the calls alternate: the target
alone, this checkout's default, the base's default (after one warm-up round of each). Every call generates exactly
`--max-new-tokens` tokens (min_new_tokens = max_new_tokens). Both versions are called through transformers' own
`generate(custom_generate=...)`, so neither's registration wrapper is in the way. Printed: tokens/s per method, each
one's speed-up over the target alone, and this/base (also per prompt, median). `--levers-off` adds this checkout
with the levers that came after the base switched off (sort-free top-p, block verification), to tell the cost of a
refactor from the gain of a lever. Figures are printed, never asserted; this CPU drifts by about 10% between calls.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from transformers.generation.utils import GenerationMixin

import hf_specsample

from .measure import cpu_name
from .pairs import BenchPair, load_bench_pair
from .prompts import PromptSet, load_prompts

REPO = Path(__file__).resolve().parents[1]  # the checkout holding this package


def import_base(revision: str, folder: Path):
    """The library as of `revision`, imported as package `hf_specsample_base`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "hf_specsample"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "hf_specsample").rename(folder / "hf_specsample_base")
    own_kernel(folder / "hf_specsample_base")
    sys.path.insert(0, str(folder))
    return importlib.import_module("hf_specsample_base")


# The small-rows kernel's names that a process holds once: its operators' namespace and its extension's name.
KERNEL_NAMES = {
    "torch.ops.hf_specsample.": "torch.ops.hf_specsample_base.",
    "TORCH_LIBRARY(hf_specsample,": "TORCH_LIBRARY(hf_specsample_base,",
    "TORCH_LIBRARY_IMPL(hf_specsample,": "TORCH_LIBRARY_IMPL(hf_specsample_base,",
    '"hf_specsample::': '"hf_specsample_base::',
    '"hf_specsample_small_rows"': '"hf_specsample_base_small_rows"',
}


def own_kernel(package: Path) -> None:
    """Where the base's kernel source differs from this checkout's, its operators get names of their own.

    torch's dispatcher holds one library per namespace: a second build registering `hf_specsample` aborts the
    process. Renamed, the base's kernel is built beside this checkout's (in a build folder of its own source's key; a
    base older than `kernels/build.py` in torch's extension folder, where the last base's build is kept) and a kernel
    change can be measured. An identical source keeps sharing this checkout's operators (and build folder).
    """
    mine = REPO / "hf_specsample" / "kernels" / "small_rows.cpp"
    sources = sorted(package.rglob("small_rows.cpp"))
    if all(source.read_bytes() == mine.read_bytes() for source in sources):
        return
    for path in [*package.rglob("*.py"), *sources]:
        text = path.read_text()
        renamed = text
        for old, new in KERNEL_NAMES.items():
            renamed = renamed.replace(old, new)
        if renamed != text:
            path.write_text(renamed)


def timed(model, inputs, **kwargs) -> float:
    start = time.perf_counter()
    GenerationMixin.generate(model, **inputs, **kwargs)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.versions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--base", required=True, help="git revision to compare with (e.g. a commit before a change)")
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-offset", type=int, default=0, help="skip this many HumanEval prompts first")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--modes", default="sampling,greedy")
    parser.add_argument(
        "--draft-shape",
        default=None,
        help="SpeculativeConfig(draft_shape=...) for both versions (chain, tree, auto); default: each one's default",
    )
    parser.add_argument(
        "--draft",
        choices=["model", "prompt_lookup"],
        default="model",
        help="what both versions draft with: the pair's draft model, or draft_model='prompt_lookup' (N = 10)",
    )
    parser.add_argument("--prompt-set", type=PromptSet, choices=list(PromptSet), default=PromptSet.HUMANEVAL)
    parser.add_argument(
        "--levers-off",
        action="store_true",
        help="also run this checkout without sort-free top-p "
        "and with token verification (the levers added after the base)",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder))
        hf_specsample.unregister()  # transformers' own generate() again (the base's import wrapped it too)
        target, draft, tokenizer = load_bench_pair(args.pair)
        prompts = load_prompts(args.prompt_set, args.num_prompts, offset=args.prompt_offset)
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(f"this checkout {head.stdout.strip()} vs base {args.base}; CPU: {cpu_name()}")
        print(
            f"pair {args.pair}, {len(prompts)} {args.prompt_set} prompts from #{args.prompt_offset}, "
            f"{args.max_new_tokens} tokens, drafting with {args.draft}"
        )
        # Both decoding functions as `custom_generate=` callables of transformers' own generate(), no streamer or
        # tokenizer given: each is told it was routed where its signature asks (this checkout's does).
        drafting = (
            dict(draft_model=draft)
            if args.draft == "model"
            else dict(draft_model="prompt_lookup", speculative_prompt_lookup_num_tokens=10)
        )
        methods = {
            "target": {},
            "this": dict(custom_generate=hf_specsample.speculative_generate, speculative_routed=True, **drafting),
            "base": dict(custom_generate=base.speculative_generate, **_routed(base), **drafting),
        }
        if args.draft_shape is not None:  # the same shape asked of both, each through its own config class
            methods["this"]["speculative_config"] = hf_specsample.SpeculativeConfig(draft_shape=args.draft_shape)
            methods["base"]["speculative_config"] = base.SpeculativeConfig(draft_shape=args.draft_shape)
        if args.levers_off:  # this checkout with sort-free top-p and block verification off: the base's levers
            shape = {"draft_shape": args.draft_shape} if args.draft_shape is not None else {}
            levers_off = hf_specsample.SpeculativeConfig(fast_processors=False, verification="token", **shape)
            methods["this-levers-off"] = dict(methods["this"], speculative_config=levers_off)
        n = args.max_new_tokens
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for mode in args.modes.split(","):
            sampling = (
                dict(do_sample=True, temperature=0.7, top_p=0.95) if mode == "sampling" else dict(do_sample=False)
            )
            common = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **sampling)
            warm = prompts[0].encode(tokenizer)
            short = {**common, "max_new_tokens": 8, "min_new_tokens": 8}
            for extra in methods.values():
                GenerationMixin.generate(target, **warm, **short, **extra)
            seconds = {name: [] for name in methods}
            for prompt in prompts:
                inputs = prompt.encode(tokenizer)
                for name, extra in methods.items():
                    seconds[name].append(timed(target, inputs, **common, **extra))
            rate = {name: len(prompts) * n / sum(times) for name, times in seconds.items()}
            cells = [f"{name} {rate[name]:.2f} tok/s ({rate[name] / rate['target']:.2f}x)" for name in methods]
            ratios = [
                f"{name}/base {rate[name] / rate['base']:.2f} (per-prompt median "
                f"{statistics.median(b / t for t, b in zip(seconds[name], seconds['base'])):.2f})"
                for name in methods
                if name.startswith("this")
            ]
            print(f"{mode:>8}: " + " | ".join(cells) + "\n          " + " | ".join(ratios))


def _routed(module) -> dict:
    """`speculative_routed=True` where the module's `speculative_generate` takes it (later commits refuse a call
    that transformers' own generate() made without the wrapper), else nothing."""
    takes = "speculative_routed" in inspect.signature(module.speculative_generate).parameters
    return {"speculative_routed": True} if takes else {}


if __name__ == "__main__":
    main()
