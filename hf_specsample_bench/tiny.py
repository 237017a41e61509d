"""Tiny random models and a character tokenizer: a pair where loop overhead, not the models, dominates."""

from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the special ids of `char_tokenizer`, also set in every `tiny_llama` config
# One line per message, then the assistant's prefix.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-*/=()[]{}<>.,;:!?@#$%^&_ \n'\"|~`\\"


def char_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """A real (fast) tokenizer over `vocab_size` ids: 0 <pad>, 1 <s>, 2 </s>, then one character per id."""
    if not 4 <= vocab_size <= len(CHARACTERS) + 3:
        raise ValueError(f"vocab_size must be in [4, {len(CHARACTERS) + 3}], got {vocab_size}")
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID} | {CHARACTERS[i]: i + 3 for i in range(vocab_size - 3)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one character per token
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_llama(
    seed: int,
    vocab_size: int = 64,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    init_range: float = 0.3,
    eos_token_id: int | None = EOS_ID,
    dtype: torch.dtype = torch.float32,
    tie_embeddings: bool = False,
) -> LlamaForCausalLM:
    """A randomly initialised Llama (no download), the same for the same arguments: the one tiny-model builder of
    the benchmark's `tiny` pair and the tests.

    Args:
        seed: global torch seed set right before the weights are drawn.
        init_range: standard deviation of the initial weights; large values (0.3) make next-token distributions far
            from uniform, so that greedy runs vary and drafts get rejected.
        eos_token_id: the config's EOS id (None: generation stops at the length limit only).
    """
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048, bos_token_id=BOS_ID,
        eos_token_id=eos_token_id, pad_token_id=PAD_ID, initializer_range=init_range,
        tie_word_embeddings=tie_embeddings,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_pair(vocab_size: int = 96):
    """(target, draft, tokenizer): a 4-layer target and a 1-layer draft sharing its embeddings' statistics."""
    target = tiny_llama(0, vocab_size, layers=4, hidden=128)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    tokenizer = char_tokenizer(vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE  # chat-style prompt sets (code editing, pydoc) run on the tiny pair too
    return target, draft, tokenizer
