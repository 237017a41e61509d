"""Timing a draft's forms on this machine, and measuring how often the target would accept each, so that
`DraftForm.AUTO` keeps the form that yields the most tokens per second.

Which form of a draft steps faster depends on the CPU: a dynamic-int8 copy ran a Qwen2.5-Coder-0.5B step in 46 ms
where bf16 took 93 ms on an AVX2-only EPYC, 27 ms against 50 ms on an EPYC with native bf16 instructions, and a CPU
with AMX bf16 tiles or the small-rows kernel's int8 / int4 weights can turn the order around. So AUTO times the
forms at first use instead of following a rule. A form that rounds the draft's weights coarsely (int4) also drafts
worse: `acceptance` measures each form's agreement with the target on calibration text, so that the choice weighs
tokens per round against step time (`round_costs.expected_speedup`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from ..core import transformers_api
from ..core.model_facts import position_limit

TIMED_STEPS = 3  # single-token forwards timed per form (after one untimed warm-up step); the minimum counts
TIMED_CONTEXT = 32  # tokens in the cache the timed steps attend to
TIMED_WIDE = 2  # forwards timed per model and width in `forward_seconds` (after one untimed warm-up forward)


@torch.inference_mode()
def decode_step_seconds(
    models: Sequence[PreTrainedModel],
    steps: int = TIMED_STEPS,
    context: int = TIMED_CONTEXT,
    contexts: Sequence[Callable[[int], Any]] | None = None,
) -> list[float]:
    """Seconds of one single-token forward of each model (batch 1, `context` cached tokens), interleaved.

    Each model is prefilled with the same `context` token ids, then the models take turns at single-token steps
    (so drift of the machine's speed hits all alike); a model's figure is its fastest step after one warm-up step.

    Args:
        contexts: per model, a function of a forward's rows returning the context it runs in, as the loop runs it
            (a `KernelRouting.applied`); None: plain forwards.

    Returns:
        One figure per model, in order; inf for a model whose forward raised a RuntimeError (an int8 copy cannot
        quantize NaN activations): that form is not chosen, and the one that is reports its own errors when it runs.
    """
    device = next(models[0].parameters()).device
    vocab = min(cast(torch.Tensor, model.get_input_embeddings().weight).shape[0] for model in models)
    positions = _positions(models)  # a short position table: fewer steps, a shorter context
    if positions < 3:  # no context and step fit: nothing to time
        return [math.inf] * len(models)
    steps = max(1, min(steps, positions - 2))
    context = max(1, min(context, positions - steps - 1))
    ids = (torch.arange(context + steps + 1, device=device) % vocab)[None, :]  # (1, context + steps + 1)
    contexts = contexts or [lambda rows: contextlib.nullcontext()] * len(models)
    caches = [_forward(model, ids[:, :context], None, contexts[index](context)) for index, model in enumerate(models)]
    best = [float("inf")] * len(models)
    for step in range(steps + 1):
        token = ids[:, context + step : context + step + 1]  # (1, 1)
        for index, model in enumerate(models):
            if caches[index] is None:
                continue
            start = time.perf_counter()
            caches[index] = _forward(model, token, caches[index], contexts[index](1))
            if step > 0 and caches[index] is not None:
                best[index] = min(best[index], time.perf_counter() - start)
    return best


@torch.inference_mode()
def forward_seconds(models: Sequence[PreTrainedModel], width: int, repeats: int = TIMED_WIDE) -> list[float]:
    """Seconds of one forward of each model over `width` positions from an empty cache (batch 1), interleaved; a
    model's figure is its fastest forward after one warm-up. inf where a model's forward raised a RuntimeError.

    What a prompt costs each form of a draft: the small-rows kernel that makes a quantized form's single-token step
    cheap reads its weights once per few rows, so over many rows a float GEMM can win (`PreparedDraft.wide`).
    """
    device = next(models[0].parameters()).device
    vocab = min(cast(torch.Tensor, model.get_input_embeddings().weight).shape[0] for model in models)
    ids = (torch.arange(min(width, _positions(models)), device=device) % vocab)[None, :]  # (1, width)
    best = [float("inf")] * len(models)
    failed = [False] * len(models)
    for attempt in range(repeats + 1):
        for index, model in enumerate(models):
            if failed[index]:
                continue
            start = time.perf_counter()
            failed[index] = _prompt_forward(model, ids) is None
            if attempt > 0 and not failed[index]:
                best[index] = min(best[index], time.perf_counter() - start)
    return [math.inf if fail else seconds for fail, seconds in zip(failed, best)]


def _positions(models: Sequence[PreTrainedModel]) -> int:
    """The most positions every one of `models` embeds (`model_facts.position_limit`; a large number where none
    has a position table)."""
    return min((limit for model in models if (limit := position_limit(model)) is not None), default=1 << 62)


def _prompt_forward(model: PreTrainedModel, ids: torch.Tensor):
    """The logits of the last of `ids`' `(1, n)` positions as the loop's prompt forward computes them (logits of the
    last position only, where the model takes `logits_to_keep`), or None where the forward raised a RuntimeError."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        return model(ids, use_cache=True, **keep).logits
    except RuntimeError:
        return None


def _forward(model: PreTrainedModel, ids: torch.Tensor, cache, context):
    """The cache after feeding `ids` `(1, n)` in `context`, or None where the forward raised a RuntimeError."""
    try:
        with context:
            output = model(ids, **transformers_api.cache_kwargs(model, cache), use_cache=True)
        return transformers_api.output_cache(output)
    except RuntimeError:
        return None


@torch.inference_mode()
def acceptance(
    target: PreTrainedModel,
    drafts: Sequence[PreTrainedModel],
    ids: torch.Tensor,
    target_context,
    vocabulary: torch.Tensor | None = None,
) -> list[float]:
    """Each draft's expected acceptance rate against the target on `ids`: the mean over positions of
    sum_v min(p(v), q(v)), with p the target's and q the draft's next-token distribution (temperature 1, no
    processors), which is the probability that speculative sampling accepts the draft's token there.

    Args:
        ids: `(length,)` token ids of representative text (a prompt).
        target_context: the context the target's forward runs in (its `KernelRouting.applied`, for the same rounding
            as the loop's; any context does: the figure only steers a choice).
        vocabulary: `(n,)` the target ids a draft's logit columns stand for (an FR-Spec head), or None: its columns
            are the target's ids ``0 .. width - 1``.

    Returns:
        One rate per draft, in [0, 1].
    """
    ids = ids.reshape(1, -1)[:, : _positions([target, *drafts])]  # no further than any model's position table
    with target_context:
        target_probs = torch.softmax(target(ids).logits[0].float(), dim=-1)  # (length, target vocab)
    rates = []
    for draft in drafts:
        logits = draft(ids.to(next(draft.parameters()).device)).logits[0].float()
        draft_probs = torch.zeros_like(target_probs)
        if vocabulary is not None:
            draft_probs[:, vocabulary] = torch.softmax(logits[:, : len(vocabulary)], dim=-1)
        else:
            width = min(logits.shape[-1], target_probs.shape[-1])
            draft_probs[:, :width] = torch.softmax(logits, dim=-1)[:, :width]
        rates.append(float(torch.minimum(target_probs, draft_probs).sum(-1).mean()))
    return rates
