"""Compiling a draft's single-position step before the first round, on a throwaway cache made as the call's is."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, DynamicCache

from ..core.model_facts import ModelFacts
from .compiled import CompiledForward, contiguous_attention


def warm_step(
    step: CompiledForward,
    model: Any,
    like: Cache,
    facts: ModelFacts,
    cache_name: str,
    rows: int,
    masked_now: bool,
    device: torch.device,
) -> None:
    """Compile the single-position step now, on a throwaway cache like this one, so that no round pays for it.

    Two positions of id 0 eagerly, then single positions through `step` (the keys made contiguous first, as
    `_forward` does: dynamo guards on their strides); with several rows also with an attention mask (rows that
    commit different counts leave masked slots: a mask is another graph), and with one only where this call's
    slots are masked already. The call's cache (`like`) is not touched.
    """
    for masked in (True,) if masked_now else (False, True) if rows > 1 else (False,):
        # made as this cache was (dynamo guards on how a cache makes its layers): from the config, or layer by
        # layer as it grows (a draft with another tokenizer keeps full layers: `DynamicCache()`)
        grown = getattr(like, "layer_class_to_replicate", None) is not None
        scratch = DynamicCache() if grown else DynamicCache(config=model.config)
        scratch.activate_past_recording()  # as this cache records (sliding windows): one code path, one graph
        kwargs = {cache_name: scratch, "use_cache": True}
        first = {"position_ids": torch.arange(2, device=device).repeat(rows, 1)} if facts.takes_position_ids else {}
        model(input_ids=torch.zeros((rows, 2), dtype=torch.long, device=device), **kwargs, **first)
        then: dict[str, Any] = (
            {"position_ids": torch.full((rows, 1), 2, device=device)} if facts.takes_position_ids else {}
        )
        if facts.takes_logits_to_keep:
            then["logits_to_keep"] = 1
        contiguous_attention(scratch)  # as `_forward` hands every step its keys: one layout, one graph
        if masked:
            then["attention_mask"] = torch.ones((rows, 3), dtype=torch.long, device=device)
        step(input_ids=torch.zeros((rows, 1), dtype=torch.long, device=device), **kwargs, **then)
    step.warm(rows)  # steps of this many rows (one, or several) run compiled; a batch that shrinks to one
    # row finishes eagerly rather than compile again in the middle of a call (as the target's compiled forward)
