"""Batched speculative sampling vs plain batched generate() (transformers' assisted generation refuses batches)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from .measure import Measurement, timed_generate
from .methods import MethodDrafts, MethodSpec, Mode, sampling_kwargs
from .prompts import Prompt
from .report import Row, summarise
from .runner import BenchmarkConfig


def batch_inputs(tokenizer, prompts: Sequence[Prompt], batch_size: int) -> dict[str, torch.Tensor]:
    """`batch_size` different prompts (cycling through `prompts`), left-padded into one batch."""
    texts = [prompts[i % len(prompts)].text for i in range(batch_size)]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        return dict(tokenizer(texts, return_tensors="pt", padding=True))
    finally:
        tokenizer.padding_side = side


def run_batch_sweep(
    target, draft, tokenizer, prompts: Sequence[Prompt], batch_sizes: Sequence[int], methods: Sequence[MethodSpec],
    mode: Mode, config: BenchmarkConfig, c: float | Mapping[str, float] | None = None, repeats: int = 1,
) -> list[Row]:  # fmt: skip
    """Tokens/s of each method at each batch size; the row's mode reads e.g. "sampling B=4", speedups per B.

    `draft`: the draft as loaded, or the run's `MethodDrafts`.
    """
    drafts = MethodDrafts.wrap(target, draft, tokenizer)
    short = BenchmarkConfig(max_new_tokens=4, progress=False)
    for spec in methods:  # warm-up: one-time costs (e.g. preparing an int8 draft) stay out of the timings
        _batched_call(target, drafts, tokenizer, batch_inputs(tokenizer, prompts, 1), spec, mode, short, 1)
    measurements = []
    runs = [(batch_size, repeat) for batch_size in batch_sizes for repeat in range(repeats)]
    with tqdm(total=len(runs) * len(methods), desc="batch sweep", disable=not config.progress) as bar:
        for batch_size, repeat in runs:
            inputs = batch_inputs(tokenizer, prompts, batch_size)
            for j in range(len(methods)):
                spec = methods[(repeat + j) % len(methods)]
                measurements.append(_batched_call(target, drafts, tokenizer, inputs, spec, mode, config, batch_size))
                bar.update()
    return summarise(measurements, c)


def _batched_call(
    target, drafts: MethodDrafts, tokenizer, inputs, spec: MethodSpec, mode: Mode, config: BenchmarkConfig,
    batch_size: int,
) -> Measurement:  # fmt: skip
    kwargs = dict(
        max_new_tokens=config.max_new_tokens, min_new_tokens=config.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id, **sampling_kwargs(mode, config.temperature, config.top_p),
        **drafts.generate_kwargs(spec, mode),
    )  # fmt: skip
    torch.manual_seed(config.seed)
    counted = drafts.counted_model(spec, mode)
    output, seconds, target_passes, draft_passes = timed_generate(target, counted, inputs, kwargs)
    sequences = output.sequences if hasattr(output, "sequences") else output
    stats = getattr(output, "speculative_stats", None)
    new_tokens = batch_size * (sequences.shape[1] - inputs["input_ids"].shape[1])
    return Measurement(
        label=spec.label, mode=f"{mode.value} B={batch_size}", prompt_id=f"batch of {batch_size}", seconds=seconds,
        new_tokens=new_tokens, target_passes=target_passes * batch_size, draft_passes=draft_passes,
        stats=stats.to_dict() if stats is not None else None,
    )  # fmt: skip
