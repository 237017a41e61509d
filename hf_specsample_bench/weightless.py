"""The speed of speculative decoding on any device, without model files: random weights of the real shapes.

    hf-specsample-weightless --target qwen2.5-7b --draft qwen2.5-0.5b --dtype bfloat16     # on a GPU
    hf-specsample-weightless --target narrow --draft narrow --dtype float32                # the CPU proxy

A forward's cost does not depend on its weights' values, so random-weight models of a real pair's shapes cost what
the real pair costs. What random weights do not give is acceptance; it is set through the final norms instead:

- greedy, every draft accepted (`Setting.ALL_ACCEPTED`): both final norms zeroed, so every logit is 0 and both
  models' argmax is id 0 at every position;
- sampling at acceptance alpha (`Setting.SAMPLED`, T=1, no top-k / top-p): the draft's final norm zeroed (a uniform
  draft, q = 1 / V over its logit width) and the target's scaled until the per-token acceptance sum(min(p, q)),
  averaged over the prompt's positions, is alpha (bisection on the scale);
- a useless draft (`Setting.USELESS`, greedy and sampling): the draft another random model whose distributions
  are peaked elsewhere (greedy: never the target's argmax; sampling: acceptance about 0), run with the library's
  default settings, which should then draft almost nothing and cost what plain `generate()` costs.

Rows (methods), timed interleaved and repeated in one process, best time kept: plain eager `generate()`; plain with
`cache_implementation="static"` and a compiled forward (transformers' compiled decoding, `--compiled-plain`);
transformers' `assistant_model=` with its defaults and with fixed K (`assistant_confidence_threshold=0`); ours with
its defaults and with fixed K. A per-round split of ours (draft steps, the target's verification forward, processors
and acceptance, the rest) and operator counts per forward pass (`torch.profiler`: each operator is at least one
kernel launch on a GPU) come after. `NARROW` (hidden 64, 2 layers, Qwen2.5's 151,936-token vocabulary) is the CPU
proxy of a GPU's launch-bound balance: its forward costs about what the loop's own work costs. Figures are printed,
never asserted (a test runs the script with tiny shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import transformers
from transformers import CompileConfig, Qwen2Config, Qwen2ForCausalLM

import hf_specsample  # noqa: F401  (registers draft_model=)
from hf_specsample import SpeculativeConfig
from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.decoding import SpeculativeDecoder
from hf_specsample.proposers.draft_model import DraftModelProposer

from .measure import ForwardCounter, cpu_name


class Shape(str, Enum):
    """Model shapes (Qwen2.5's configs; `NARROW` and `TINY` for the CPU)."""

    QWEN_0_5B = "qwen2.5-0.5b"
    QWEN_1_5B = "qwen2.5-1.5b"
    QWEN_7B = "qwen2.5-7b"
    QWEN_32B = "qwen2.5-32b"
    NARROW = "narrow"  # the CPU proxy: hidden 64, 2 layers, the real vocabulary
    TINY = "tiny"  # tests: a few hundred ids

    def __str__(self) -> str:
        return self.value


# hidden, intermediate, layers, heads, key/value heads, vocabulary (logit width), tied embeddings
_SHAPES: dict[Shape, tuple[int, int, int, int, int, int, bool]] = {
    Shape.QWEN_0_5B: (896, 4864, 24, 14, 2, 151_936, True),
    Shape.QWEN_1_5B: (1536, 8960, 28, 12, 2, 151_936, True),
    Shape.QWEN_7B: (3584, 18944, 28, 28, 4, 152_064, False),
    Shape.QWEN_32B: (5120, 27648, 64, 40, 8, 152_064, False),
    Shape.NARROW: (64, 128, 2, 4, 2, 151_936, False),
    Shape.TINY: (32, 64, 2, 4, 2, 512, False),
}


class Setting(str, Enum):
    """How acceptance is set (module docstring)."""

    ALL_ACCEPTED = "greedy-all-accepted"
    SAMPLED = "sampling"
    USELESS_GREEDY = "greedy-useless-draft"
    USELESS_SAMPLED = "sampling-useless-draft"
    DRAFT_IS_TARGET = "greedy-draft-is-target"  # the loop's own cost: a round against plain steps of one model

    def __str__(self) -> str:
        return self.value

    @property
    def useless(self) -> bool:
        return self in (Setting.USELESS_GREEDY, Setting.USELESS_SAMPLED)

    @property
    def do_sample(self) -> bool:
        return self in (Setting.SAMPLED, Setting.USELESS_SAMPLED)


def build(
    shape: Shape, seed: int, dtype: torch.dtype, device: torch.device, vocab: int | None = None
) -> Qwen2ForCausalLM:
    """A Qwen2 model of `shape` with random weights (the same for the same seed), on `device`, in eval mode;
    `vocab`: its logit width instead of the shape's."""
    hidden, intermediate, layers, heads, kv_heads, shape_vocab, tied = _SHAPES[shape]
    vocab = vocab or shape_vocab
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
        max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def acceptance(target, draft, input_ids: torch.Tensor) -> float:
    """Mean over the prompt's positions of sum_x min(p(x), q(x)): the per-token acceptance of a sampled draft at T=1
    (p the target's distribution, q the draft's, over the ids both models have)."""
    target_probs = torch.softmax(target(input_ids).logits.float(), dim=-1)
    draft_probs = torch.softmax(draft(input_ids).logits.float(), dim=-1)
    width = min(target_probs.shape[-1], draft_probs.shape[-1])
    draft_probs = draft_probs[..., :width] / draft_probs[..., :width].sum(-1, keepdim=True)
    return float(torch.minimum(target_probs[..., :width], draft_probs).sum(-1).mean())


@torch.no_grad()
def set_acceptance(target, draft, setting: Setting, input_ids: torch.Tensor, alpha: float) -> float:
    """Set the models' final norms for `setting` (module docstring) and return the measured acceptance on the prompt
    (sampling) or the share of positions where the argmaxes agree (greedy)."""
    if setting is Setting.DRAFT_IS_TARGET:
        return 1.0
    if setting is Setting.ALL_ACCEPTED:
        target.model.norm.weight.zero_()
        draft.model.norm.weight.zero_()
        return 1.0
    if setting is Setting.SAMPLED:
        draft.model.norm.weight.zero_()
        original = target.model.norm.weight.clone()
        low, high = 0.0, 1.0
        while acceptance(_scaled(target, original, high), draft, input_ids) > alpha and high < 1e6:
            low, high = high, 4 * high
        for _ in range(30):
            middle = (low + high) / 2
            if acceptance(_scaled(target, original, middle), draft, input_ids) > alpha:
                low = middle
            else:
                high = middle
        _scaled(target, original, (low + high) / 2)
        return acceptance(target, draft, input_ids)
    # A useless draft: both peaked (final norms scaled up until each holds little mass on a uniform draw), on
    # different random weights, so they rarely agree.
    for model in (target, draft):
        original = model.model.norm.weight.clone()
        scale = 1.0
        while _uniform_overlap(_scaled(model, original, scale), input_ids) > USELESS_OVERLAP and scale < 1e6:
            scale *= 2
    if setting is Setting.USELESS_SAMPLED:
        return acceptance(target, draft, input_ids)
    target_ids, draft_ids = target(input_ids).logits.argmax(-1), draft(input_ids).logits.argmax(-1)
    return float((target_ids == draft_ids).float().mean())


USELESS_OVERLAP = 0.02  # a useless draft's models each put at most this much mass where a uniform draft would


def _uniform_overlap(model, input_ids: torch.Tensor) -> float:
    """sum_x min(p(x), 1 / V), averaged over the prompt: how close the model's distributions are to uniform."""
    probs = torch.softmax(model(input_ids).logits.float(), dim=-1)
    return float(probs.clamp(max=1.0 / probs.shape[-1]).sum(-1).mean())


def _scaled(model, original: torch.Tensor, scale: float):
    model.model.norm.weight.copy_(original * scale)
    return model


class Method(str, Enum):
    """The rows of the table."""

    PLAIN = "plain"
    PLAIN_COMPILED = "plain static+compile"
    ASSISTANT = "assistant_model= default"
    ASSISTANT_FIXED = "assistant_model= fixed K"
    OURS = "draft_model= default"
    OURS_FIXED = "draft_model= fixed K"
    OURS_GRAPHS = "draft_model= fixed K, compile=True"  # both models' rounds as graphs on CUDA (compiled runners)

    def __str__(self) -> str:
        return self.value


def method_kwargs(
    method: Method, draft, lookahead: int, device: torch.device, ours: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`generate()` keyword arguments of `method`; `ours`: more of them for our two methods."""
    if method is Method.PLAIN:
        return {}
    if method is Method.PLAIN_COMPILED:
        config = CompileConfig(fullgraph=False, dynamic=False)
        if device.type != "cuda":
            config._compile_all_devices = True  # transformers compiles decoding on accelerators only by default
        return {"cache_implementation": "static", "compile_config": config}
    if method is Method.ASSISTANT:
        return {"assistant_model": draft}
    if method is Method.ASSISTANT_FIXED:
        return {
            "assistant_model": draft, "num_assistant_tokens": lookahead,
            "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0,
        }  # fmt: skip
    if method is Method.OURS:
        return {"draft_model": draft, **(ours or {})}
    if method is Method.OURS_GRAPHS:
        given = (ours or {}).get("speculative_config") or SpeculativeConfig()
        config = dataclasses.replace(given, compile=True)
        return {"draft_model": draft, "num_lookahead": lookahead, **(ours or {}), "speculative_config": config}
    return {"draft_model": draft, "num_lookahead": lookahead, **(ours or {})}


@dataclass
class Timing:
    """One method's best call."""

    seconds: float
    new_tokens: int
    tokens_per_pass: float | None = None  # ours: committed tokens per target forward, per row

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_methods(
    target,
    draft,
    input_ids: torch.Tensor,
    setting: Setting,
    methods: list[Method],
    new_tokens: int,
    lookahead: int,
    repeats: int,
    ours: dict[str, Any] | None = None,
) -> dict[Method, Timing | str]:
    """Best wall time of each method over `repeats` interleaved calls, after one warm-up call each."""
    device = input_ids.device
    common = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": setting.do_sample}
    if setting.do_sample:
        common |= {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    calls: dict[Method, Callable[[], Any]] = {}
    results: dict[Method, Timing | str] = {}
    for method in methods:
        kwargs = method_kwargs(method, draft, lookahead, device, ours)
        if method in (Method.ASSISTANT, Method.ASSISTANT_FIXED) and input_ids.shape[0] > 1:
            results[method] = "refuses batches"
            continue
        calls[method] = lambda kwargs=kwargs, extra=None: target.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **common, **kwargs, **(extra or {})
        )
    for call in calls.values():
        call()  # warm-up: compiles, the kernel routings, the implicit draft's form
    best: dict[Method, float] = {}
    for _ in range(repeats):
        for method, call in calls.items():
            _synchronize(device)
            start = time.perf_counter()
            call()
            _synchronize(device)
            seconds = time.perf_counter() - start
            best[method] = min(best.get(method, seconds), seconds)
    passes = {  # from one more call each (returning the statistics returns the cache too: not in the timed calls)
        method: call(extra={"return_dict_in_generate": True}).speculative_stats.tokens_per_target_pass
        for method, call in calls.items()
        if method in (Method.OURS, Method.OURS_FIXED)
    }
    for method in calls:
        results[method] = Timing(best[method], new_tokens * input_ids.shape[0], passes.get(method))
    return {method: results[method] for method in methods}  # in the table's order


@dataclass
class RoundSplit:
    """Seconds per round of ours, by phase (each phase synchronised on CUDA: launch-bound timings change)."""

    rounds: int
    draft: float  # drafting: the draft's forwards, its processors and draws
    draft_forwards: float  # of which the draft's forwards
    verify_forward: float  # the target's forward over K + 1 positions
    processing: float  # the target's processors, acceptance
    rest: float  # commit (stops, bookkeeping, rollbacks), the policy, everything else in a round

    def __str__(self) -> str:
        parts = (
            ("draft steps", self.draft - self.draft_forwards), ("draft forwards", self.draft_forwards),
            ("verification forward", self.verify_forward), ("processors and acceptance", self.processing),
            ("the rest", self.rest),
        )  # fmt: skip
        total = self.draft + self.verify_forward + self.processing + self.rest
        text = ", ".join(f"{name} {1e3 * seconds / self.rounds:.2f} ms" for name, seconds in parts)
        return f"{self.rounds} rounds, {1e3 * total / self.rounds:.2f} ms per round: {text}"


class _PhaseClock:
    """Wall time of a round's phases, from wrappers around the loop's methods (a model forward inside drafting
    counts as the draft's, whichever model runs it: an implicit draft's copy, or the target itself)."""

    def __init__(self, device: torch.device):
        self.device, self.totals, self.drafting = device, Counter(), False

    def _now(self) -> float:
        _synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def method(self, owner: type, name: str, key: str) -> Iterator[None]:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start, was_drafting = self._now(), self.drafting
            self.drafting = was_drafting or key == "draft"
            try:
                return original(*args, **kwargs)
            finally:
                self.drafting = was_drafting
                if key == "forward":
                    key_now = "draft_forwards" if was_drafting else "target"
                    self.totals[key_now] += self._now() - start
                else:
                    self.totals[key] += self._now() - start

        setattr(owner, name, wrapper)
        try:
            yield
        finally:
            setattr(owner, name, original)


def round_split(target, input_ids: torch.Tensor, generate_kwargs: dict[str, Any]) -> RoundSplit:
    """Run ours once with each phase of its rounds timed (`RoundSplit`)."""
    clock = _PhaseClock(input_ids.device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(clock.method(SpeculativeDecoder, "round", "round"))
        stack.enter_context(clock.method(DraftModelProposer, "get_candidates", "draft"))
        stack.enter_context(clock.method(SpeculativeDecoder, "verify", "verify"))
        stack.enter_context(clock.method(CachedModel, "_forward", "forward"))  # each model forward of either model
        out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs)
    totals = clock.totals
    processing = totals["verify"] - totals["target"]  # `verify` scores the round and judges it (`Verifier`)
    rest = totals["round"] - totals["draft"] - totals["verify"]
    rounds = out.speculative_stats.rounds
    return RoundSplit(rounds, totals["draft"], totals["draft_forwards"], totals["target"], processing, rest)


def operator_counts(target, input_ids: torch.Tensor, generate_kwargs: dict[str, Any]) -> dict[str, float]:
    """Operators (`aten::` events of `torch.profiler`, nested ones included) per model forward of one call (ours:
    each forward of either model; plain: the target's), its `aten::to` calls and host syncs
    (`aten::_local_scalar_dense`, what `.item()` / `.tolist()` / `bool()` run) per forward."""
    ours = "draft_model" in generate_kwargs
    clock = _PhaseClock(input_ids.device)
    with contextlib.ExitStack() as stack:
        counter = None if ours else stack.enter_context(ForwardCounter(target))
        if ours:
            stack.enter_context(clock.method(CachedModel, "_forward", "forward"))
            calls = Counter()
            original = CachedModel._forward

            def counted(*args, **kwargs):
                calls["forwards"] += 1
                return original(*args, **kwargs)

            stack.enter_context(_replaced(CachedModel, "_forward", counted))
        profile = stack.enter_context(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
        target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs)
    events = Counter(event.name for event in profile.events() if event.name.startswith("aten::"))
    forwards = calls["forwards"] if ours else counter.calls
    return {
        "operators per forward": sum(events.values()) / forwards,
        "aten::to per forward": events["aten::to"] / forwards,
        "host syncs per forward": events["aten::_local_scalar_dense"] / forwards,
    }


@contextlib.contextmanager
def _replaced(owner: type, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def describe_machine(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    return f"{name}; {versions}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Shape, choices=list(Shape), default=Shape.NARROW)
    parser.add_argument("--draft", type=Shape, choices=list(Shape), default=Shape.NARROW)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--settings", type=lambda text: [Setting(s) for s in text.split(",")],
                        default=list(Setting), help=f"comma-separated: {', '.join(map(str, Setting))}")  # fmt: skip
    parser.add_argument("--rows", type=lambda text: [int(r) for r in text.split(",")], default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.8, help="acceptance of the sampling setting")
    parser.add_argument("--greedy-k", type=int, default=8, help="fixed K of greedy rows")
    parser.add_argument("--sampling-k", type=int, default=4, help="fixed K of sampling rows")
    parser.add_argument("--same-k", type=int, default=4, help=f"fixed K of {Setting.DRAFT_IS_TARGET}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled-plain", action="store_true", help="add plain static+compile (compiles per shape)")
    parser.add_argument("--no-assistant", action="store_true", help="leave transformers' assistant_model= out")
    parser.add_argument("--split", action="store_true", help="a per-round split and operator counts of ours")
    parser.add_argument("--graphs", action="store_true", help="add ours with compile=True (graphs on CUDA)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"# {describe_machine(device)}")
    print(f"# target {args.target}, draft {args.draft}, {args.dtype}, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, best of {args.repeats} interleaved calls")  # fmt: skip
    methods = [Method.PLAIN] + ([Method.PLAIN_COMPILED] if args.compiled_plain else [])
    methods += [] if args.no_assistant else [Method.ASSISTANT, Method.ASSISTANT_FIXED]
    methods += [Method.OURS, Method.OURS_FIXED] + ([Method.OURS_GRAPHS] if args.graphs else [])
    print("| setting | rows | acceptance | " + " | ".join(map(str, methods)) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in methods) + " |")
    splits = []
    for setting in args.settings:
        target = build(args.target, 0, dtype, device)
        same = setting is Setting.DRAFT_IS_TARGET
        # transformers' assistant_model= refuses logit widths that differ (Qwen2.5-7B's 152,064 against 0.5B's
        # 151,936: "different tokenizers"): its rows get a draft of the target's width, which costs the same
        vocab = target.config.vocab_size if Method.ASSISTANT in methods else None
        draft = target if same else build(args.draft, 1, dtype, device, vocab)
        # the draft that is the target runs as given (the default would draft with an int8 copy on the CPU)
        ours = {"speculative_config": SpeculativeConfig(draft_form="as_given")} if same else {}
        generator = torch.Generator().manual_seed(2)
        vocab = min(target.config.vocab_size, draft.config.vocab_size)
        prompt = torch.randint(1, vocab, (1, args.prompt_tokens), generator=generator).to(device)
        measured = set_acceptance(target, draft, setting, prompt, args.alpha)
        lookahead = args.same_k if same else args.sampling_k if setting.do_sample else args.greedy_k
        for rows in args.rows:
            input_ids = prompt.repeat(rows, 1)
            timings = time_methods(
                target, draft, input_ids, setting, methods, args.new_tokens, lookahead, args.repeats, ours
            )
            plain = timings[Method.PLAIN]
            cells = [timing if isinstance(timing, str) else _cell(timing, plain) for timing in timings.values()]
            kind = f"argmax agreement {measured:.2f}" if not setting.do_sample else f"alpha {measured:.2f}"
            fixed = timings.get(Method.OURS_FIXED)
            if same and isinstance(fixed, Timing) and fixed.tokens_per_pass:
                # a round's cost in plain steps: (ours / plain seconds) x new tokens per round (= per target pass)
                steps = fixed.seconds / plain.seconds * fixed.tokens_per_pass
                kind = f"a K={lookahead} round costs {steps:.2f} plain steps"
            print(f"| {setting} | {rows} | {kind} | " + " | ".join(cells) + " |", flush=True)
            if args.split:
                common = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens,
                          "do_sample": setting.do_sample}  # fmt: skip
                if setting.do_sample:
                    common |= {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
                method = (
                    Method.OURS if setting in (Setting.USELESS_GREEDY, Setting.USELESS_SAMPLED) else Method.OURS_FIXED
                )
                kwargs = {**method_kwargs(method, draft, lookahead, device, ours), **common}
                split = round_split(target, input_ids, {**kwargs, "return_dict_in_generate": True})
                counts = (operator_counts(target, input_ids, kwargs), operator_counts(target, input_ids, common))
                splits.append((setting, rows, method, split, *counts))
        del target, draft
    if device.type == "cuda":
        from torch._dynamo.utils import counters

        graphs = {name: int(count) for name, count in counters["inductor"].items() if "cudagraph" in name}
        print(f"# inductor's CUDA-graph counters: {graphs}", flush=True)
    for setting, rows, label, split, ours, plain_ops in splits:  # noqa: B007
        print(f"\n## {setting}, {rows} rows, {label}: {split}")
        print("   " + "; ".join(_versus(name, ours[name], plain_ops[name]) for name in ours))


def _cell(timing: Timing, plain: Timing) -> str:
    cell = f"{timing.tokens_per_second:.1f} tok/s ({timing.tokens_per_second / plain.tokens_per_second:.3f}x)"
    return cell if timing.tokens_per_pass is None else f"{cell}, {timing.tokens_per_pass:.2f}/pass"


def _versus(name: str, ours: float, plain: float) -> str:
    return f"{name}: ours {ours:.2f}, plain {plain:.2f} ({ours / plain if plain else float('nan'):.3f}x)"


if __name__ == "__main__":
    main()
