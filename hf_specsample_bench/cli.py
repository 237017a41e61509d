"""`python -m hf_specsample_bench`: how much faster is generate() with a draft, and does it sample the same?"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from .batch import run_batch_sweep
from .measure import cost_ratio, method_cost_ratios
from .methods import LEVER_METHODS, LOOKUP_LEVER_METHODS, Method, MethodDrafts, MethodSpec, Mode, parse_methods
from .models import LoadPath
from .pairs import PAIR_HELP, BenchPair, Quantization, load_bench_models, randomize
from .passk import pass_at_1
from .prompts import PromptSet, load_problems, load_prompts
from .report import format_table, to_json
from .runner import BenchmarkConfig, run_benchmark
from .sweep import plot_sweep, run_sweep

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hf_specsample_bench", description=__doc__)
    parser.add_argument(
        "--pair",
        type=BenchPair,
        choices=list(BenchPair),
        default=BenchPair.QWEN_CODER,
        help="target/draft pair (default: %(default)s): "
        + "; ".join(f"{pair.value}: {text}" for pair, text in PAIR_HELP.items()),
    )
    parser.add_argument(
        "--prompts",
        type=PromptSet,
        choices=list(PromptSet),
        nargs="+",
        default=[PromptSet.HUMANEVAL],
        help="prompt sets: humaneval (code completion), pydoc (summarise Python docs, chat template)",
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per set (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per call, fixed (default: %(default)s)")
    parser.add_argument(
        "--methods",
        type=parse_methods,
        default="target,assisted,hf_specsample,hf_specsample:4",
        help="comma list of target, assisted, lookup[:N] (transformers' prompt lookup), hf_specsample, "
        "hf_specsample:K[:quantization[:vocabulary]][:verify=token|block][:processors=plain|fast][:lookup=N]"
        "[:draft=prompt_lookup][:shape=tree|chain] (default: %(default)s)",
    )
    parser.add_argument(
        "--levers",
        action="store_true",
        help="the lever table: the methods become the default, each lever of hf_specsample switched off or forced "
        "on its own (K=4, draft as given, int8 draft, token verification, transformers' processors), and the peers; "
        "with --prompts code-edit also the prompt-lookup drafters and transformers' prompt lookup",
    )
    parser.add_argument(
        "--load-from",
        type=LoadPath,
        choices=list(LoadPath),
        default=LoadPath.CHECKPOINT,
        help="load the real pair from its checkpoint folders or from its GGUF files as users do (default: %(default)s)",
    )
    parser.add_argument("--modes", type=Mode, choices=list(Mode), nargs="+", default=[Mode.GREEDY, Mode.SAMPLING])
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling mode (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.95, help="sampling mode (default: %(default)s)")
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(k) for k in text.split(",")],
        default=None,
        help="also sweep fixed K over this comma list, e.g. 1,2,3,4,6,8",
    )
    parser.add_argument("--sweep-mode", type=Mode, choices=list(Mode), default=Mode.SAMPLING)
    parser.add_argument("--plot", type=Path, default=Path("speculative_sweep.png"), help="PNG of the sweep")
    parser.add_argument(
        "--batch-sizes",
        type=lambda text: [int(b) for b in text.split(",")],
        default=None,
        help="also compare batched generate() with and without the draft at these batch sizes, e.g. 1,4,8",
    )
    parser.add_argument(
        "--batch-methods",
        type=parse_methods,
        default="target,hf_specsample",
        help="methods of the batch comparison (assisted refuses batches; default: %(default)s)",
    )
    parser.add_argument("--batch-mode", type=Mode, choices=list(Mode), default=Mode.SAMPLING)
    parser.add_argument("--skip-main", action="store_true", help="skip the per-prompt comparison (run only extras)")
    parser.add_argument(
        "--pass-at-1",
        type=int,
        default=0,
        metavar="N",
        help="also run HumanEval functional correctness on N problems, target alone vs hf_specsample",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure and measurement here")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--target-quantization",
        type=Quantization,
        choices=list(Quantization),
        default=Quantization.NONE,
        help="load the target with bitsandbytes (default: %(default)s)",
    )
    parser.add_argument(
        "--draft-quantization",
        type=Quantization,
        choices=list(Quantization),
        default=Quantization.NONE,
        help="load the draft with bitsandbytes (Qwen pair; default: %(default)s)",
    )
    parser.add_argument(
        "--random-draft",
        action="store_true",
        help="re-draw the draft's weights at random: the useless-draft check (defaults must stay >= 0.95x)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """The `hf-specsample-bench` console script: `run`, printing the tables (a console script's return value is
    its exit status, so this returns nothing)."""
    run(argv)


def run(argv: list[str] | None = None) -> dict:
    """Parse arguments, load the pair, run the requested comparisons; return (and optionally save) the report."""
    args = build_parser().parse_args(argv)
    if args.levers:
        with_lookup = PromptSet.CODE_EDIT in args.prompts
        args.methods = parse_methods(LEVER_METHODS + ("," + LOOKUP_LEVER_METHODS if with_lookup else ""))
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BenchmarkConfig(
        methods=args.methods, modes=args.modes, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed, progress=not args.no_progress,
    )  # fmt: skip
    target, draft, tokenizer, draft_tokenizer = load_bench_models(
        args.pair, DTYPES[args.dtype], config.progress, args.target_quantization, args.draft_quantization,
        args.load_from,
    )  # fmt: skip
    if args.random_draft:
        draft = randomize(draft if args.pair is not BenchPair.SMOLLM2 else _copy_for_randomizing(draft))
    prompts = [prompt for prompt_set in args.prompts for prompt in load_prompts(prompt_set, args.num_prompts)]
    # Every section runs the same prepared drafts, each made once by hf_specsample.prepare_draft.
    run = (target, MethodDrafts(target, draft, tokenizer, draft_tokenizer), tokenizer, prompts)

    report = _compare(args, config, *run)
    target_seconds = report["meta"]["cost"]["target_forward_s"]
    if args.sweep:
        sweep_c = _method_c([MethodSpec(Method.SPECULATIVE, k) for k in args.sweep], target_seconds, *run)
        report["sweep"] = _sweep(args, config, sweep_c, *run)
    if args.batch_sizes:
        batch_c = _method_c(args.batch_methods, target_seconds, *run)
        report["batches"] = _batches(args, config, batch_c, *run)
    if args.pass_at_1:
        report["pass_at_1"] = _pass_at_1(args, config, *run)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"json: {args.json}")
    return report


def _meta(args: argparse.Namespace, prompts: list) -> dict:
    return {
        "pair": args.pair.value,
        "dtype": args.dtype,
        "load_from": args.load_from.value,
        "target_quantization": args.target_quantization.value,
        "draft_quantization": args.draft_quantization.value,
        "random_draft": args.random_draft,
        "prompts": [p.value for p in args.prompts],
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }


def _compare(args, config: BenchmarkConfig, target, drafts: MethodDrafts, tokenizer, prompts) -> dict:
    """The per-prompt comparison of every method (or only the cost ratio with --skip-main)."""
    meta = _meta(args, prompts)
    if drafts.draft_tokenizer is not None:
        meta["shared_vocabulary"] = drafts.prepared(MethodSpec(Method.SPECULATIVE)).shared_vocabulary.size
    if args.skip_main:
        input_ids = prompts[0].encode(tokenizer)["input_ids"]
        meta["cost"] = cost_ratio(target, drafts.draft, input_ids, draft_input_ids=drafts.draft_input_ids(input_ids))
        report = to_json([], [], meta)
    else:
        result = run_benchmark(target, drafts, tokenizer, prompts, config)
        meta.update(cost=result.cost, method_c=result.method_c)
        report = to_json(result.rows, result.measurements, meta)
    cost = meta["cost"]
    if "shared_vocabulary" in meta:
        print(f"\nthe draft has its own tokenizer: it drafts over the {meta['shared_vocabulary']} tokens both share")
    quantized = f", target {args.target_quantization.value}, draft {args.draft_quantization.value}"
    loaded = f", loaded from {args.load_from}" if args.pair is not BenchPair.TINY else ""
    print(f"\n{args.pair.value}, {args.dtype}{loaded}{quantized}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens; "
          f"target forward {cost['target_forward_s'] * 1000:.0f} ms, draft {cost['draft_forward_s'] * 1000:.0f} ms, "
          f"c = {cost['c']:.2f}")  # fmt: skip
    if not args.skip_main:
        prepared = ", ".join(f"{label}: {c:.2f}" for label, c in meta["method_c"].items())
        forms = sorted({m.stats["draft_form"] for m in result.measurements if m.stats and m.stats.get("draft_form")})
        print(f"c of each method's prepared draft: {prepared}\ndrafts run: {'; '.join(forms)}")
        print(format_table(result.rows))
    return report


def _method_c(methods, target_seconds: float, target, drafts: MethodDrafts, tokenizer, prompts) -> dict[str, float]:
    """c of the draft each method really runs (the int8 copy by default), not of the draft as loaded."""
    input_ids = prompts[0].encode(tokenizer)["input_ids"]
    return method_cost_ratios(drafts, methods, input_ids, target_seconds)


def _sweep(
    args, config: BenchmarkConfig, c: dict[str, float], target, drafts: MethodDrafts, tokenizer, prompts
) -> list[dict]:
    rows = run_sweep(target, drafts, tokenizer, prompts, args.sweep, args.sweep_mode, config, c)
    print(f"\nK sweep ({args.sweep_mode.value}):\n{format_table(rows)}")
    title = f"{args.pair.value} ({args.dtype}, {args.sweep_mode.value}): speculative sampling vs K"
    print(f"plot: {plot_sweep(rows, args.plot, title)}")
    return to_json(rows, [], {})["summary"]


def _batches(
    args, config: BenchmarkConfig, c: dict[str, float], target, drafts: MethodDrafts, tokenizer, prompts
) -> list[dict]:
    rows = run_batch_sweep(
        target, drafts, tokenizer, prompts, args.batch_sizes, args.batch_methods, args.batch_mode, config, c
    )
    print(f"\nbatches ({args.batch_mode.value}, tokens/s over all rows):\n{format_table(rows)}")
    return to_json(rows, [], {})["summary"]


def _pass_at_1(args, config: BenchmarkConfig, target, drafts: MethodDrafts, tokenizer, prompts) -> dict:
    methods = parse_methods("target,hf_specsample")
    scores = pass_at_1(target, drafts, tokenizer, load_problems(args.pass_at_1), methods, config)
    print("\nHumanEval pass@1 (sampling, one sample per problem):")
    for label, score in scores.items():
        print(f"  {label:>20}: {score['pass@1']:.3f} ({score['passed']}/{score['total']})")
    return scores


def _copy_for_randomizing(draft):
    """The SmolLM2 draft shares the target's weights: randomize a private copy instead."""
    import copy

    return copy.deepcopy(draft)


if __name__ == "__main__":
    main()
