"""Running the comparison: every method on every prompt, interleaved, in one process."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .measure import Measurement, cost_ratio, method_cost_ratios, timed_generate
from .methods import Method, MethodDrafts, MethodSpec, Mode, sampling_kwargs
from .prompts import Prompt
from .report import Row, summarise


@dataclass
class BenchmarkConfig:
    """Settings of one benchmark run; every default is what `python -m hf_specsample_bench` uses."""

    methods: list[MethodSpec] = field(
        default_factory=lambda: [
            MethodSpec(Method.TARGET),
            MethodSpec(Method.ASSISTED),
            MethodSpec(Method.SPECULATIVE),
            MethodSpec(Method.SPECULATIVE, 4),
        ]
    )
    modes: list[Mode] = field(default_factory=lambda: [Mode.GREEDY, Mode.SAMPLING])
    max_new_tokens: int = 128  # every call generates exactly this many (min_new_tokens = max_new_tokens)
    temperature: float = 0.7  # sampling mode
    top_p: float = 0.95  # sampling mode
    seed: int = 0
    progress: bool = True


@dataclass
class BenchmarkResult:
    measurements: list[Measurement]
    rows: list[Row]
    cost: dict[str, float]  # target/draft forward seconds and c of the draft as given
    method_c: dict[str, float] = field(default_factory=dict)  # c of each hf_specsample method's prepared draft


def _call(
    target, drafts: MethodDrafts, tokenizer, prompt: Prompt, spec: MethodSpec, mode: Mode, config: BenchmarkConfig,
    seed: int,
) -> Measurement:  # fmt: skip
    inputs = prompt.encode(tokenizer)
    kwargs = dict(
        max_new_tokens=config.max_new_tokens, min_new_tokens=config.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **sampling_kwargs(mode, config.temperature, config.top_p), **drafts.generate_kwargs(spec, mode),
    )  # fmt: skip
    torch.manual_seed(seed)
    counted = drafts.counted_model(spec, mode)
    output, seconds, target_passes, draft_passes = timed_generate(target, counted, inputs, kwargs)
    sequences = output.sequences if hasattr(output, "sequences") else output
    prompt_length = inputs["input_ids"].shape[1]
    stats = getattr(output, "speculative_stats", None)
    if stats is not None:  # hf_specsample may run a prepared copy of the draft (e.g. int8), which hooks miss
        draft_passes = stats.draft_forward_passes
    return Measurement(
        label=spec.label, mode=mode.value, prompt_id=prompt.prompt_id, seconds=seconds,
        new_tokens=sequences.shape[1] - prompt_length, target_passes=target_passes, draft_passes=draft_passes,
        stats=stats.to_dict() if stats is not None else None,
        text=tokenizer.decode(sequences[0, prompt_length:], skip_special_tokens=True),
    )  # fmt: skip


def run_measurements(
    target, drafts: MethodDrafts, tokenizer, prompts: Sequence[Prompt], methods: Sequence[MethodSpec],
    modes: Sequence[Mode], config: BenchmarkConfig, description: str = "benchmark",
) -> list[Measurement]:  # fmt: skip
    """Every method on every prompt and mode; the method order rotates per prompt so none always runs first."""
    runs = [(i, prompt, mode) for i, prompt in enumerate(prompts) for mode in modes]
    measurements = []
    with tqdm(total=len(runs) * len(methods), desc=description, disable=not config.progress) as bar:
        for i, prompt, mode in runs:
            for j in range(len(methods)):
                spec = methods[(i + j) % len(methods)]
                bar.set_postfix_str(f"{prompt.prompt_id} {mode.value} {spec.label}")
                measurements.append(_call(target, drafts, tokenizer, prompt, spec, mode, config, config.seed + i))
                bar.update()
    return measurements


def warm_up(
    target, drafts: MethodDrafts, tokenizer, prompt: Prompt, methods: Sequence[MethodSpec], config: BenchmarkConfig
) -> None:
    """One short call per method, so one-time costs (allocations, lazy init) stay out of the figures."""
    short = BenchmarkConfig(max_new_tokens=4, progress=False)
    for spec in methods:
        for mode in config.modes:
            _call(target, drafts, tokenizer, prompt, spec, mode, short, config.seed)


def run_benchmark(
    target, draft, tokenizer, prompts: Sequence[Prompt], config: BenchmarkConfig | None = None
) -> BenchmarkResult:
    """Measure c, prepare and warm up every method, then run every method on every prompt and summarise.

    Args:
        draft: the draft as loaded, or a `MethodDrafts` shared with the run's other sections.
    """
    config = config or BenchmarkConfig()
    drafts = MethodDrafts.wrap(target, draft, tokenizer)
    input_ids = prompts[0].encode(tokenizer)["input_ids"]
    cost = cost_ratio(target, drafts.draft, input_ids, draft_input_ids=drafts.draft_input_ids(input_ids))
    warm_up(target, drafts, tokenizer, prompts[0], config.methods, config)
    method_c = method_cost_ratios(drafts, config.methods, input_ids, cost["target_forward_s"])
    measurements = run_measurements(target, drafts, tokenizer, prompts, config.methods, config.modes, config)
    return BenchmarkResult(measurements, summarise(measurements, method_c), cost, method_c)
