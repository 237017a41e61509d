"""Tiny randomly initialised causal LMs built from a config (no downloads), and helpers shared by the tests."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

import torch
from transformers import LlamaForCausalLM, LogitsProcessorList, StoppingCriteriaList

from hf_specsample.core.transformers_api import CACHE
from hf_specsample_bench.tiny import BOS_ID as BOS
from hf_specsample_bench.tiny import PAD_ID as PAD
from hf_specsample_bench.tiny import char_tokenizer, tiny_llama  # noqa: F401  (re-exported for the tests)


def cache_of(output):
    """The cache an output object carries (`out.cache` from transformers 5.24 on, `out.past_key_values` before)."""
    return getattr(output, CACHE)


def with_cache(cache) -> dict:
    """The keyword argument that passes `cache` to `generate()` or a forward on the installed transformers."""
    return {CACHE: cache}


def second_turns(target, draft, plain, speculative, mask: torch.Tensor, prompt_length: int, **kwargs):
    """A second chat turn from each first call's returned cache: (plain `generate()`'s, `draft_model=`'s) sequences.

    `plain` / `speculative` are the first calls' outputs (`return_dict_in_generate=True`) on a prompt of
    `prompt_length` columns with `mask` `(batch, prompt_length)`; the turn appends 3 tokens to plain's whole
    conversation (as plain `generate()` wants the input ids with a cache). `kwargs`: the calls' generation options.
    """
    turn = torch.tensor([[11, 12, 13]] * plain.sequences.shape[0])
    ids = torch.cat([plain.sequences, turn], dim=1)
    answered = torch.ones_like(plain.sequences[:, prompt_length:])
    second_mask = torch.cat([mask, answered, torch.ones_like(turn)], dim=1)
    plain_2 = target.generate(ids, attention_mask=second_mask, **with_cache(cache_of(plain)), **kwargs)
    speculative_2 = target.generate(
        ids, attention_mask=second_mask, **with_cache(cache_of(speculative)), draft_model=draft, num_lookahead=3,
        **kwargs,
    )  # fmt: skip
    return plain_2, speculative_2


class FakeClock:
    """A stand-in for `time.perf_counter` (a test patches it in): the time only moves when the test says, by
    `advance`, and by `step` seconds per reading (a float, or an iterator of them: a machine whose speed varies).
    Timed decisions are tested on it, never on the wall clock."""

    def __init__(self, step: float | Iterator[float] = 0.0):
        self.now, self.steps = 0.0, step if isinstance(step, Iterator) else itertools.repeat(step)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        self.now += next(self.steps)
        return self.now


def tiny_lm(
    seed: int,
    vocab_size: int = 8,
    layers: int = 1,
    hidden: int = 16,
    init_range: float = 0.5,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A Llama with random weights (`tiny_llama` with the tests' defaults: 2 heads, 1 KV head, no EOS). A large
    `init_range` makes its next-token distributions far from uniform."""
    return tiny_llama(seed, vocab_size, layers, hidden, heads=2, kv_heads=1, init_range=init_range,
                      eos_token_id=eos_token_id, dtype=dtype)  # fmt: skip


class ForwardCounter:
    """Counts forward calls of the given models (a refusal must come before any); `remove()`, or use it in `with`."""

    def __init__(self, *models):
        self.calls = 0
        self.handles = [model.register_forward_hook(self._hook) for model in models]

    def _hook(self, *args):
        self.calls += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def perturbed_copy(model: LlamaForCausalLM, seed: int, scale: float) -> LlamaForCausalLM:
    """A copy of `model` with Gaussian noise of relative size `scale` on every weight: a draft close to it."""
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copied.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            spread = parameter.std() if parameter.numel() > 1 else parameter.abs()  # a scalar has no std
            parameter.add_(scale * spread * noise)
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


# Tiny configs of the architectures the matrix tests cover. Sliding-window variants use a window of 4 slots, so
# texts of a dozen tokens already reach past the window.
SLIDING_WINDOW = 4


def _llama_like(config_class, vocab_size: int, **overrides):
    settings = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.3,
    )  # fmt: skip
    settings.update(overrides)
    return config_class(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=None, pad_token_id=PAD, **settings)


def _plain(config_class, vocab_size: int, **settings):
    config = config_class(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=None, pad_token_id=PAD, **settings)
    for name in ("initializer_range", "init_std"):  # peaked distributions, as for the llama-like configs
        if hasattr(config, name):
            setattr(config, name, 0.3)
    return config


def _architectures():
    import transformers as tf

    window = SLIDING_WINDOW
    return {
        "llama": lambda v: _llama_like(tf.LlamaConfig, v),
        "qwen2": lambda v: _llama_like(tf.Qwen2Config, v),
        "qwen2_sliding": lambda v: _llama_like(
            tf.Qwen2Config, v, use_sliding_window=True, sliding_window=window, max_window_layers=0
        ),
        "qwen3": lambda v: _llama_like(tf.Qwen3Config, v, head_dim=8),
        "mistral_sliding": lambda v: _llama_like(tf.MistralConfig, v, sliding_window=window),
        "mixtral": lambda v: _llama_like(tf.MixtralConfig, v, num_local_experts=4, num_experts_per_tok=2),
        "gemma": lambda v: _llama_like(tf.GemmaConfig, v, head_dim=8),
        "gemma2": lambda v: _llama_like(tf.Gemma2Config, v, head_dim=8, sliding_window=window),
        "gemma3_text": lambda v: _llama_like(
            tf.Gemma3TextConfig, v, head_dim=8, sliding_window=window, sliding_window_pattern=2
        ),
        "phi3": lambda v: _llama_like(tf.Phi3Config, v),
        "starcoder2": lambda v: _llama_like(tf.Starcoder2Config, v, sliding_window=window),
        "olmo2": lambda v: _llama_like(tf.Olmo2Config, v),
        "cohere": lambda v: _llama_like(tf.CohereConfig, v),
        "granite": lambda v: _llama_like(tf.GraniteConfig, v),
        "gpt2": lambda v: _plain(tf.GPT2Config, v, n_embd=32, n_layer=2, n_head=4, n_positions=256),
        "gpt_neox": lambda v: _plain(
            tf.GPTNeoXConfig,
            v,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=256,
        ),  # fmt: skip
        "gptj": lambda v: _plain(tf.GPTJConfig, v, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256),
        "opt": lambda v: _plain(
            tf.OPTConfig,
            v,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
        ),  # fmt: skip
        "bloom": lambda v: _plain(tf.BloomConfig, v, hidden_size=32, n_layer=2, n_head=4),
        "falcon": lambda v: _plain(
            tf.FalconConfig,
            v,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=False,
        ),  # fmt: skip
    }


ARCHITECTURES = tuple(_architectures())
SLIDING_ARCHITECTURES = ("qwen2_sliding", "mistral_sliding", "gemma2", "gemma3_text", "starcoder2")


def tiny_arch(name: str, seed: int, vocab_size: int = 48, dtype: torch.dtype = torch.float32):
    """A tiny randomly initialised causal LM of architecture `name` (one of `ARCHITECTURES`)."""
    from transformers import AutoModelForCausalLM

    config = _architectures()[name](vocab_size)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def arch_draft(target, seed: int, scale: float = 0.3):
    """A draft for a `tiny_arch` target: the target with noise (same architecture, same vocabulary)."""
    return perturbed_copy(target, seed=seed, scale=scale)


def implicit_draft(draft, target, form="auto", vocabulary=None, clock_free=False):
    """The prepared draft `generate(draft_model=draft)` runs with these options (the implicit cache's), as the
    call's routing asks for it (`call_plan._draft_plan`)."""
    from hf_specsample.core.model_facts import ModelFacts
    from hf_specsample.kernels.routing import KernelRouting
    from hf_specsample.options import DraftForm, LinearKernel
    from hf_specsample.prepare.implicit import draft_for_call
    from hf_specsample.prepare.prepared_draft import resolve_draft

    spec, target_facts = resolve_draft(draft), ModelFacts.of(target)
    draft_facts = ModelFacts.of(spec.model) if spec.model is not None else None
    routing = KernelRouting.for_model(target_facts, LinearKernel.AUTO, clock_free)
    return draft_for_call(
        spec, target_facts, draft_facts, DraftForm(form), vocabulary, [], routing, clock_free=clock_free
    )
