"""One speculative `generate()` call's inputs, resolved and validated once at entry (`call_plan.plan_call`).

`generate()` hands its prepared inputs to the `custom_generate` callable as keyword arguments (the library's own
ones prefixed `speculative_`, so that transformers passes them through); `CallInputs` holds them under one name each
from there on, so the loop never renames or reorders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..options import SpeculativeConfig
from ..policy import validation

CALIBRATION_TOKENS = 128  # the most prompt tokens an implicit draft's forms are weighed on
CALIBRATION_MIN_TOKENS = 16  # shorter prompts say too little of acceptance: the forms are compared by step time alone


@dataclass(frozen=True, kw_only=True)
class CallInputs:
    """Everything one call decodes with.

    Attributes:
        model: the target causal LM (`generate()` passes itself).
        draft_model: the draft as the caller named it (what it is is resolved once, by
            `prepare.prepared_draft.resolve_draft`): a causal LM of the target's tokenizer, or of another one given as
            `draft_tokenizer=` (with the target's as `tokenizer=`); "auto", a draft made from the target (a quantized
            copy on the CPU, a layer-skipping view elsewhere); "prompt_lookup", continuations from each row's own
            text; "suffix" or a `SuffixDraft`, suffix trees alone; or a `PreparedDraft` from
            `hf_specsample.prepare_draft`, run as it is.
        input_ids: `(batch, prompt_length)` long, the prepared (left-padded, expanded) prompt.
        model_kwargs: what `generate()` prepared for the model: `attention_mask` `(batch, prompt_length)`,
            `position_ids` `(batch, prompt_length)`, the cache under `transformers_api.CACHE` (empty, or holding the
            first tokens of `input_ids` from an earlier turn), the flags `generate()` sets (`use_cache`,
            `logits_to_keep`).
        logits_processor: the processors `generate()` built from the generation config and the caller; applied to
            draft and target alike, at every position with that position's own prefix.
        stopping_criteria: the criteria `generate()` built; checked after every committed token.
        generation_config: the resolved generation config (`do_sample`, `max_length`, `return_dict_in_generate`, ...).
        config: the resolved `SpeculativeConfig` (`num_lookahead=` merged in: draft tokens per round, K >= 1; None,
            the default, chooses K before every round from measured acceptance and costs, `AdaptiveLookahead`).
        generator: the caller's `torch.Generator` for every random draw (a seeded call repeats its sample), or None.
        streamer: where committed tokens go (the caller's `streamer=`, which transformers does not forward to custom
            decoding callables: the registered `generate()` passes it as `speculative_streamer`), or None.
        caller_cache: the caller passed a cache (`cache=`, or `past_key_values=` where transformers still takes it):
            that object is left holding what plain `generate()` leaves in it, even without `return_dict_in_generate`
            (a non-empty cache is taken to be the caller's in any case).
        lookup_tokens: transformers' `prompt_lookup_num_tokens` (the deepest lookup round; beside a model draft,
            lookup rounds where they promise more than the model's), or None.
        max_ngram: transformers' `max_matching_ngram_size` (the most of a row's last tokens a lookup matches), or None.
        tokenizers: (target tokenizer, draft tokenizer) as the caller gave them (`tokenizer=`, `draft_tokenizer=` /
            `assistant_tokenizer=`; the draft's None where only `tokenizer=` was given), or None; when their
            vocabularies differ, the draft reads its own ids and drafts over the tokens both share
            (`proposers.cross_tokenizer`), which the plan decides.
        suffix_draft: a `SuffixDraft` drafting beside the draft model (`suffix_draft=`), or None.
    """

    model: PreTrainedModel
    draft_model: Any
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
    tokenizers: tuple[Any, Any] | None = None
    suffix_draft: Any = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def calibration(self) -> torch.Tensor | None:
        """The first row's real prompt tokens (its last `CALIBRATION_TOKENS`), or None where it has too few: the text
        an implicit draft's forms are weighed on (`prepare.form_choice`)."""
        mask = self.model_kwargs.get("attention_mask")
        row = self.input_ids[0] if mask is None else self.input_ids[0][mask[0].bool()]
        return row[-CALIBRATION_TOKENS:] if row.numel() >= CALIBRATION_MIN_TOKENS else None

    @property
    def prompt_ends_in_padding(self) -> bool:
        """Whether some row's prompt ends in padding (right padding): its first round then drafts nothing."""
        mask = self.model_kwargs.get("attention_mask")
        return mask is not None and not bool(mask[:, -1].bool().all())


def resolve_inputs(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    speculative_config: SpeculativeConfig | None,
    num_lookahead: int | None,
    lookup_tokens: int | None,
    max_ngram: int | None,
    routed: bool,
    **fields: Any,
) -> CallInputs:
    """`CallInputs` from `speculative_generate`'s arguments: the config with `num_lookahead=` merged in.

    Refuses a call that hf_specsample's `generate()` wrapper did not route (`routed`: `validation.check_routed`) and
    one without `draft_model=`."""
    validation.check_routed(routed)
    if fields.get("draft_model") is None:
        raise ValueError(
            "speculative_generate needs `draft_model=` (a small causal LM sharing the target's tokenizer)."
        )
    return CallInputs(
        model=model,
        input_ids=input_ids,
        generation_config=generation_config,
        config=SpeculativeConfig.resolve(speculative_config, num_lookahead),
        lookup_tokens=lookup_tokens,
        max_ngram=max_ngram,
        **fields,
    )
