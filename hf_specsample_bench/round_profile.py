"""One speculative round on the real pair, phase by phase, against the memory-bandwidth floor of each phase.

    python -m hf_specsample_bench.round_profile                  # Qwen2.5-Coder 1.5B target, 0.5B draft, K=4
    python -m hf_specsample_bench.round_profile --load-from gguf --lookahead 8 --context 256

Prints, on the machine it runs on (`lscpu`'s model name and flags first):
1. the machine's memory bandwidth: the median time to read a 1 GiB tensor (`sum`, the threads torch uses;
   `--bandwidth-gib`), and the rate the small-rows kernel reads a bf16 weight of half that size at one row (its path
   named);
2. per phase of one round, in ms (median of `--repeats`), the bytes it must read, the floor (bytes / bandwidth) and
   its multiple of the floor:
   - a draft step (one token) in each form the draft can take here (as given on the kernel where its routing puts
     one row, dynamic int8, int8 weights on the kernel);
   - the target's forward over 1 and over K+1 positions with the default kernel routing, split by module hooks into
     the linears (the LM head apart), attention (without its linears), norms, and the rest (embedding, rotary
     embedding, residuals, the model's Python, the hooks' own cost);
   - processors and acceptance (sampling, T=0.7, top_p=0.95, over K+1 positions of the real vocabulary);
   - the caches' rollback (a crop of the rejected positions) and the round's one host sync.
Whatever is far from its floor is the next thing to fix. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

import hf_specsample  # noqa: F401  (registers draft_model=)
from hf_specsample import DraftForm, LinearKernel
from hf_specsample.cache.compiled import CompileSettings, compiled_forward
from hf_specsample.core.model_facts import ModelFacts, Role
from hf_specsample.core.transformers_api import cache_kwargs, output_cache
from hf_specsample.kernels import small_rows
from hf_specsample.kernels.quantized_linear import Int4Linear, Int8Linear
from hf_specsample.kernels.routing import KernelRouting
from hf_specsample.policy.round_costs import weight_bytes
from hf_specsample.prepare.surgery import quantized_forms, without_siblings
from hf_specsample.sampling.processing import PositionwiseProcessor, probabilities
from hf_specsample.verify.rules import speculative_accept

from .measure import cpu_name, median_ms, read_bandwidth
from .models import LoadPath
from .pairs import BenchPair, load_bench_pair
from .prompts import PromptSet, load_prompts


def median_seconds(function, repeats: int) -> float:
    """Median seconds of `repeats` calls of `function` after one untimed call."""
    return median_ms(function, repeats, warm_up=1) / 1e3


def kernel_read_rate(repeats: int, gib: float) -> tuple[float, str]:
    """Bytes per second the small-rows kernel reads a bf16 weight of `gib` GiB at one row; its path."""
    weight = torch.randn(max(int(gib * 2**30) // 2048, 1), 1024).to(torch.bfloat16)
    x = torch.randn(1, 1024).to(torch.bfloat16)
    seconds = median_seconds(lambda: small_rows.small_rows_linear(x, weight), repeats)
    return weight.numel() * 2 / seconds, str(small_rows.best_path())


class ModuleClock:
    """Wall time spent in modules, by category, through forward pre/post hooks (nested categories subtract)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        head = model.get_output_embeddings()
        for module in model.modules():
            category = self.category(module, head)
            if category is not None:
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._leave(category)))
        self._stack: list[float] = []

    @staticmethod
    def category(module: torch.nn.Module, head: torch.nn.Module) -> str | None:
        name = type(module).__name__
        if module is head:
            return "LM head"
        if isinstance(module, (torch.nn.Linear, Int8Linear, Int4Linear)) or name == "Linear":  # "Linear": fbgemm's
            return "linears"
        if name.endswith("Attention"):
            return "attention (without its linears)"
        if "Norm" in name:
            return "norms"
        return None

    def _enter(self, module, args):
        self._stack.append(time.perf_counter())

    def _leave(self, category):
        def hook(module, args, output):
            start = self._stack.pop()
            elapsed = time.perf_counter() - start
            self.seconds[category] += elapsed
            if category == "linears" and self._stack:  # inside an attention module: not the attention's own time
                self.seconds["attention (without its linears)"] -= elapsed

        return hook

    def reset(self):
        self.seconds.clear()

    def remove(self):
        for handle in self.handles:
            handle.remove()


def forward_profile(model, ids, context_ids, width: int, routing: KernelRouting, repeats: int) -> dict[str, float]:
    """Median seconds of a forward over `width` positions after `context_ids`, and its split by module category."""
    cache = output_cache(model(context_ids, use_cache=True))
    step = ids[:, -width:]

    def forward():
        with routing.applied(width):
            model(step, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=width)
        cache.crop(-width)

    total = median_seconds(forward, repeats)
    clock = ModuleClock(model)
    splits = []
    for _ in range(repeats):
        clock.reset()
        forward()
        splits.append(dict(clock.seconds))
    clock.remove()
    split = {key: statistics.median(entry.get(key, 0.0) for entry in splits) for key in splits[0]}
    split["rest (embedding, rotary, residuals, Python, hooks)"] = total - sum(split.values())
    return {"total": total, **split}


def compiled_step_seconds(model, ids, context_ids, repeats: int) -> tuple[float, float]:
    """Median seconds of a compiled single-token step of a quantized draft after `context_ids` (its sibling-free view,
    `CompileSettings.for_draft_steps`, as the loop runs it), and the seconds its compilation took."""
    view = without_siblings(model)  # held here: the compiled forward refers to it weakly
    compiled = compiled_forward(view, CompileSettings.for_draft_steps())
    cache = output_cache(model(context_ids, use_cache=True))
    step = ids[:, -1:].clone()
    position = torch.tensor([[context_ids.shape[1]]])

    def forward():
        compiled(input_ids=step, **cache_kwargs(model, cache), use_cache=True, position_ids=position)
        cache.crop(-1)

    for _ in range(2):  # compiles (keys as the prompt left them, then as a rollback leaves them)
        forward()
    return median_seconds(forward, repeats), compiled.compile_seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.round_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pair", type=BenchPair, choices=list(BenchPair), default=BenchPair.QWEN_CODER)
    parser.add_argument("--load-from", type=LoadPath, choices=list(LoadPath), default=LoadPath.CHECKPOINT)
    parser.add_argument("--lookahead", type=int, default=4, help="K: the round verifies K+1 positions")
    parser.add_argument("--context", type=int, default=128, help="tokens in the caches before the round")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="GiB read to measure the bandwidth")
    parser.add_argument(
        "--compiled-draft", action="store_true",
        help="also time the kernel forms' steps compiled (compile_draft=True; about 40 s of compiling per form)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}")
    gib = args.bandwidth_gib
    bandwidth = read_bandwidth(args.repeats, gib)
    problem = small_rows.load().problem
    kernel_rate, path = kernel_read_rate(args.repeats, gib / 2) if problem is None else (float("nan"), problem)
    print(f"memory bandwidth (reading {gib:g} GiB, sum): {bandwidth / 1e9:.1f} GB/s; the small-rows kernel ({path}) "
          f"reads a {gib / 2:g} GiB bf16 weight at one row at {kernel_rate / 1e9:.1f} GB/s")  # fmt: skip
    target, draft, tokenizer = load_bench_pair(args.pair, torch.bfloat16, path=args.load_from)
    print(f"{args.pair} pair, bf16, loaded from {args.load_from}; K={args.lookahead}, "
          f"{args.context} cached tokens")  # fmt: skip
    text = load_prompts(PromptSet.HUMANEVAL, 1, offset=100)[0].text
    ids = tokenizer(text * 8, return_tensors="pt")["input_ids"][:, : args.context + args.lookahead + 1]
    context_ids, width = ids[:, : args.context], args.lookahead + 1
    rows = []

    def row(phase: str, seconds: float, read_bytes: float | None):
        floor = read_bytes / bandwidth if read_bytes else None
        rows.append((phase, seconds * 1e3, read_bytes, floor))

    # 1. the draft's single-token step, in each form
    forms = {DraftForm.AS_GIVEN: draft, **{form: make(draft) for form, make in quantized_forms(draft).items()}}
    for form, model in forms.items():
        routing = KernelRouting.for_model(ModelFacts.of(model), LinearKernel.AUTO, role=Role.DRAFT)
        profile = forward_profile(model, ids, context_ids, 1, routing, args.repeats)
        row(f"draft step, {form}", profile["total"], weight_bytes(model))
        for key, seconds in profile.items():
            if key != "total":
                row(f"  {key}", seconds, None)
    if args.compiled_draft:  # the kernel forms' steps as `SpeculativeConfig(compile_draft=True)` runs them
        for form in (DraftForm.INT8_WEIGHTS, DraftForm.INT4_WEIGHTS):
            if form in forms:
                seconds, compiling = compiled_step_seconds(forms[form], ids, context_ids, args.repeats)
                row(f"draft step, {form}, compiled ({compiling:.0f} s compiling)", seconds, weight_bytes(forms[form]))

    # 2. the target's forward over 1 and K+1 positions, split
    routing = KernelRouting.for_model(ModelFacts.of(target), LinearKernel.AUTO, role=Role.TARGET)
    print(f"target kernel routing: {routing.reason}")
    target_bytes = weight_bytes(target)
    head = target.get_output_embeddings().weight
    head_bytes = head.numel() * head.element_size()
    for positions in (1, width):
        profile = forward_profile(target, ids, context_ids, positions, routing, args.repeats)
        row(f"target forward, {positions} position(s)", profile["total"], target_bytes)
        for key, seconds in profile.items():
            if key != "total":
                share = {"LM head": head_bytes, "linears": target_bytes - head_bytes}.get(key)
                row(f"  {key}", seconds, share)

    # 3. processors and acceptance over K+1 positions: the models' own logits on the prompt's text
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.95)])
    processor = PositionwiseProcessor(processors, batch_size=1)
    logits = target(ids).logits[:, -width:].float()  # (1, K + 1, vocab)
    draft_logits = draft(ids).logits[:, -width:-1].float()  # (1, K, vocab)
    draft_probs = probabilities(processor(ids, [ids.shape[1] - width], draft_logits, [0]))
    tokens = ids[:, -args.lookahead :]
    generator = torch.Generator().manual_seed(0)

    def accept():
        scores = processor(ids, [ids.shape[1] - width], logits, [0])
        return speculative_accept(tokens, draft_probs, probabilities(scores), generator)

    row(f"processors + acceptance (T=0.7, top_p=0.95), {width} positions", median_seconds(accept, args.repeats), None)
    verdict = accept()
    row("host sync (num_accepted.tolist())", median_seconds(lambda: verdict.num_accepted.tolist(), args.repeats), None)

    # 4. rollback: both caches drop the rejected half of the round's positions
    def rollback():
        for model in (target, draft):
            cache = DynamicCache(config=model.config)
            model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            start = time.perf_counter()
            cache.crop(-(width // 2))
            rollback.seconds += time.perf_counter() - start

    rollback.seconds = 0.0
    for _ in range(3):
        rollback()
    row("rollback (crop both caches)", rollback.seconds / 3, None)

    print(f"\n{'phase':<58} {'ms':>8} {'MB read':>8} {'floor ms':>8} {'x floor':>7}")
    for phase, ms, read_bytes, floor in rows:
        mb = f"{read_bytes / 1e6:8.0f}" if read_bytes else f"{'':>8}"
        floor_text = f"{floor * 1e3:8.1f} {ms / (floor * 1e3):6.2f}x" if floor else ""
        print(f"{phase:<58} {ms:8.1f} {mb} {floor_text}")


if __name__ == "__main__":
    main()
