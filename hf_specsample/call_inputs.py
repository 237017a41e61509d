"""One speculative `generate()` call's inputs, resolved and validated once at entry (`decoding.speculative_generate`).

`generate()` hands its prepared inputs to the `custom_generate` callable as keyword arguments (the library's own
ones prefixed `speculative_`, so that transformers passes them through); `CallInputs` holds them under one name each
from there on, so the loop never renames or reorders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .options import NamedDraft, SpeculativeConfig

if TYPE_CHECKING:
    from .prepare.prepared_draft import PreparedDraft


@dataclass(frozen=True, kw_only=True)
class CallInputs:
    """Everything one call decodes with.

    Attributes:
        model: the target causal LM.
        draft_model: the draft as the caller named it: a model, a `PreparedDraft`, or a `NamedDraft`.
        input_ids: `(batch, prompt_length)` long, the prepared (left-padded, expanded) prompt.
        model_kwargs: what `generate()` prepared for the model: `attention_mask` `(batch, prompt_length)`,
            `position_ids`, the cache under `transformers_api.CACHE` (empty, or holding an earlier turn),
            `use_cache`, ...
        logits_processor / stopping_criteria / generation_config: as `generate()` built them.
        config: the resolved `SpeculativeConfig` (`num_lookahead=` merged in).
        generator: the caller's `torch.Generator`, or None.
        streamer: where committed tokens go (the caller's `streamer=`), or None.
        caller_cache: the caller passed a cache (left holding what plain `generate()` leaves in it).
        lookup_tokens: transformers' `prompt_lookup_num_tokens` (n-gram tokens per lookup round), or None.
        max_ngram: transformers' `max_matching_ngram_size` (the longest n-gram looked up), or None.
        other_tokenizers: (target tokenizer, draft tokenizer) when the draft reads another vocabulary, else None.
    """

    model: PreTrainedModel
    draft_model: PreTrainedModel | PreparedDraft | NamedDraft
    input_ids: torch.LongTensor
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    generation_config: GenerationConfig
    config: SpeculativeConfig
    generator: torch.Generator | None = None
    streamer: BaseStreamer | None = None
    caller_cache: bool = False
    lookup_tokens: int | None = None
    max_ngram: int | None = None
    other_tokenizers: tuple[Any, Any] | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]
