"""Tiny randomly initialised causal LMs built from a config (no downloads), and helpers shared by the tests."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, StoppingCriteriaList

from hf_specsample.bench.tiny import char_tokenizer  # noqa: F401  (re-exported for the tests)

BOS, PAD = 1, 0


def tiny_lm(
    seed: int,
    vocab_size: int = 8,
    layers: int = 1,
    hidden: int = 16,
    init_range: float = 0.5,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A Llama with random weights. A large `init_range` makes its next-token distributions far from uniform."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=BOS,
        eos_token_id=eos_token_id,
        pad_token_id=PAD,
        initializer_range=init_range,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def perturbed_copy(model: LlamaForCausalLM, seed: int, scale: float) -> LlamaForCausalLM:
    """A copy of `model` with Gaussian noise of relative size `scale` on every weight: a draft close to it."""
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copied.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(scale * parameter.std() * noise)
    return copied


def prepared_processors(
    model, input_ids: torch.Tensor, **generate_kwargs
) -> tuple[LogitsProcessorList, StoppingCriteriaList]:
    """The exact logits processors and stopping criteria `generate()` builds for these arguments.

    Captured through a `custom_generate` callable, i.e. the very lists the speculative loop receives.
    """
    captured = {}

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        captured.update(processors=logits_processor, criteria=stopping_criteria)
        return input_ids

    model.generate(input_ids, custom_generate=capture, **generate_kwargs)
    return captured["processors"], captured["criteria"]
