"""Checks run before any forward pass, each failing with what to do instead."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

# Keyword arguments `generate()` hands to a decoding method that this loop understands.
KNOWN_MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep"})
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits: the LM head's output size, else the config's vocabulary size."""
    head = model.get_output_embeddings()
    out_features = getattr(head, "out_features", None)
    if out_features is None and getattr(head, "weight", None) is not None:
        out_features = head.weight.shape[0]
    return int(out_features) if out_features is not None else int(model.config.get_text_config().vocab_size)


def check_models(target: PreTrainedModel, draft: Any) -> None:
    """The draft must be a decoder-only LM with the target's vocabulary (or "auto")."""
    if isinstance(draft, str) and draft == "auto":
        draft = target
    if not isinstance(draft, PreTrainedModel):
        raise TypeError(
            f"draft_model must be a transformers causal LM (e.g. AutoModelForCausalLM.from_pretrained(...)) or "
            f"'auto' (a draft made from the target), got {draft!r}."
        )
    for role, model in (("target", target), ("draft", draft)):
        if model.config.is_encoder_decoder:
            raise ValueError(
                f"The {role} model is encoder-decoder ({type(model).__name__}); hf_specsample drafts for decoder-only "
                "causal LMs. For encoder-decoder models use transformers' `assistant_model=`."
            )
    target_vocab, draft_vocab = vocab_size(target), vocab_size(draft)
    if target_vocab != draft_vocab:
        raise ValueError(
            f"The draft's vocabulary size ({draft_vocab}) differs from the target's ({target_vocab}). Speculative "
            "sampling compares the two models' distributions token id by token id, so the draft must use the "
            "target's tokenizer and logits of the same width: pick a smaller model of the same family, or use "
            "transformers' `assistant_model=` with `assistant_tokenizer=` for a draft with another tokenizer."
        )


def check_generation_config(config: GenerationConfig) -> None:
    """Only greedy decoding and multinomial sampling can be sped up exactly."""
    mode = config.get_generation_mode()
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={config.num_beams}) cannot be combined with `draft_model=`: speculative sampling "
            "verifies one sequence per row. Use num_beams=1 (greedy or do_sample=True), or drop `draft_model=`."
        )
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"`draft_model=` speeds up greedy decoding and sampling, not {mode.value}. Use num_beams=1 and "
            "no penalty_alpha / prompt_lookup_num_tokens / assistant settings, or drop `draft_model=`."
        )
    if config.output_attentions or config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not returned by speculative decoding (the target scores "
            "several positions per pass). Drop those flags, or generate without `draft_model=`."
        )


def check_inputs(input_ids: torch.Tensor, model_kwargs: dict[str, Any], streamer: Any = None) -> None:
    """Reject inputs the loop does not handle, instead of ignoring them."""
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"streamer= takes one row, but this call generates {input_ids.shape[0]} (batch x num_return_sequences): "
            "rows of a speculative batch commit different numbers of tokens per round. Stream one row per call."
        )
    unknown = sorted(key for key, value in model_kwargs.items() if key not in KNOWN_MODEL_KWARGS and value is not None)
    if unknown:
        raise ValueError(
            f"Model inputs {unknown} are not supported with `draft_model=` (text-only decoder LMs: input_ids and "
            "attention_mask). Generate without `draft_model=` for these inputs."
        )
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, Cache) or cache.get_seq_length() > 0 or not cache.is_croppable):
        raise ValueError(
            "`draft_model=` needs an empty, croppable KV cache (the default DynamicCache): pass no `past_key_values` "
            "and no static `cache_implementation`."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("`draft_model=` needs a non-empty prompt (at least a BOS token).")
