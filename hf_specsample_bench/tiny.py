"""Tiny random models and a character tokenizer: a pair where loop overhead, not the models, dominates."""

from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-*/=()[]{}<>.,;:!?@#$%^&_ \n'\"|~`\\"


def char_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """A real (fast) tokenizer over `vocab_size` ids: 0 <pad>, 1 <s>, 2 </s>, then one character per id."""
    if not 4 <= vocab_size <= len(CHARACTERS) + 3:
        raise ValueError(f"vocab_size must be in [4, {len(CHARACTERS) + 3}], got {vocab_size}")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {CHARACTERS[i]: i + 3 for i in range(vocab_size - 3)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one character per token
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_llama(seed: int, vocab_size: int = 64, layers: int = 2, hidden: int = 64) -> LlamaForCausalLM:
    """A randomly initialised Llama (no download)."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_pair(vocab_size: int = 96):
    """(target, draft, tokenizer): a 4-layer target and a 1-layer draft sharing its embeddings' statistics."""
    target = tiny_llama(0, vocab_size, layers=4, hidden=128)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    return target, draft, char_tokenizer(vocab_size)
