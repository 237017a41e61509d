"""Timing one generate() call, counting forward passes, and measuring the draft/target cost ratio c."""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_specsample.core.transformers_api import cache_kwargs, output_cache


def median_ms(function, repeats: int, warm_up: int = 0) -> float:
    """Median wall time of `repeats` calls of `function`, in ms, after `warm_up` untimed calls."""
    for _ in range(warm_up):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class ForwardCounter:
    """Counts forward calls of a model through a forward hook (works for every generate() path)."""

    def __init__(self, model: torch.nn.Module | None):
        self.calls = 0
        self._handle = model.register_forward_hook(self._count) if model is not None else None

    def _count(self, *args) -> None:
        self.calls += 1

    def __enter__(self) -> "ForwardCounter":
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Measurement:
    """One generate() call."""

    label: str
    mode: str
    prompt_id: str
    seconds: float
    new_tokens: int
    target_passes: int  # forward calls of the target (prefill included)
    draft_passes: int  # forward calls of the draft
    stats: dict[str, Any] | None = None  # SpeculativeStats.to_dict() for hf_specsample
    text: str = field(default="", repr=False)


def timed_generate(target, draft, inputs: dict, generate_kwargs: dict) -> tuple[Any, float, int, int]:
    """Run `target.generate(**inputs, **generate_kwargs)`; return (output, seconds, target passes, draft passes)."""
    with ForwardCounter(target) as target_counter, ForwardCounter(draft) as draft_counter:
        _synchronize()
        start = time.perf_counter()
        output = target.generate(**inputs, **generate_kwargs)
        _synchronize()
        seconds = time.perf_counter() - start
    return output, seconds, target_counter.calls, draft_counter.calls


@torch.no_grad()
def forward_seconds(model, input_ids: torch.Tensor, new_tokens: int = 1, repeats: int = 5) -> float:
    """Median seconds of one cached forward over `new_tokens` tokens after the prompt `input_ids` `(1, length)`."""
    device = model.get_input_embeddings().weight.device
    cache = output_cache(model(input_ids=input_ids.to(device), use_cache=True))
    step = input_ids[:, -new_tokens:].to(device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        _synchronize()
        start = time.perf_counter()
        model(input_ids=step, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=new_tokens)
        _synchronize()
        times.append(time.perf_counter() - start)
        cache.crop(-new_tokens)
    return statistics.median(times[1:])


def method_cost_ratios(drafts, methods, input_ids: torch.Tensor, target_seconds: float) -> dict[str, float]:
    """c of each hf_specsample method, timing the prepared draft it runs (e.g. the int8 copy, the restricted head).

    Args:
        drafts: the run's `MethodDrafts` (the very objects the methods pass to generate()).
        input_ids: `(1, length)` the target's ids of a prompt (re-encoded for a draft with its own tokenizer).
    """
    from .methods import Method

    ratios = {}
    draft_ids = drafts.draft_input_ids(input_ids)
    for spec in methods:
        if spec.method is Method.SPECULATIVE and spec.uses_draft and spec.label not in ratios:
            ratios[spec.label] = forward_seconds(drafts.prepared(spec).model, draft_ids) / target_seconds
    return ratios


def cost_ratio(
    target, draft, input_ids: torch.Tensor, repeats: int = 5, draft_input_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """Leviathan et al.'s c: time of one draft forward over time of one target forward (1 token, with a cache).

    `draft_input_ids`: the prompt in the draft's ids, when its tokenizer differs (default: `input_ids`).
    """
    target_seconds = forward_seconds(target, input_ids, 1, repeats)
    draft_ids = input_ids if draft_input_ids is None else draft_input_ids
    draft_seconds = forward_seconds(draft, draft_ids, 1, repeats)
    return {"target_forward_s": target_seconds, "draft_forward_s": draft_seconds, "c": draft_seconds / target_seconds}


def read_bandwidth(repeats: int = 5, gib: float = 1.0) -> float:
    """Bytes per second of reading a `gib` GiB fp32 tensor (`sum`) with torch's threads: the memory bandwidth a
    memory-bound decoding step is up against."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    seconds = median_ms(lambda: data.sum(), repeats, warm_up=1) / 1e3
    return data.numel() * 4 / seconds


def cpu_name() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("Flags"))
        extras = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
        return f"{name} ({torch.get_num_threads()} threads; {', '.join(extras)})"
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown CPU"
