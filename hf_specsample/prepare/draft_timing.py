"""Timing a draft's forms on this machine, so that `DraftQuantization.AUTO` keeps the faster one.

Which form of a draft steps faster depends on the CPU: a dynamic-int8 copy ran a Qwen2.5-Coder-0.5B step in 46 ms
where bf16 took 93 ms on an AVX2-only EPYC, 27 ms against 50 ms on an EPYC with native bf16 instructions, and a CPU
with AMX bf16 tiles can turn the order around. So AUTO times both forms at first use instead of following a rule.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from .. import transformers_api

TIMED_STEPS = 3  # single-token forwards timed per form (after one untimed warm-up step); the minimum counts
TIMED_CONTEXT = 32  # tokens in the cache the timed steps attend to


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
            (a `KernelPlan.applied`); None: plain forwards.

    Returns:
        One figure per model, in order; inf for a model whose forward raised a RuntimeError (an int8 copy cannot
        quantize NaN activations): that form is not chosen, and the one that is reports its own errors when it runs.
    """
    device = next(models[0].parameters()).device
    vocab = min(model.get_input_embeddings().weight.shape[0] for model in models)
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


def _forward(model: PreTrainedModel, ids: torch.Tensor, cache, context):
    """The cache after feeding `ids` `(1, n)` in `context`, or None where the forward raised a RuntimeError."""
    try:
        with context:
            output = model(ids, **transformers_api.cache_kwargs(model, cache), use_cache=True)
        return transformers_api.output_cache(output)
    except RuntimeError:
        return None
