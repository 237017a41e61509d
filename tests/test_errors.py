"""Bad input fails before any forward pass, with a message that says what to do instead."""

import copy

import pytest
import torch
from tiny import PAD, ForwardCounter, char_tokenizer, tiny_lm
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GenerationConfig,
    JambaConfig,
    JambaForCausalLM,
    LogitsProcessorList,
    MambaConfig,
    MambaForCausalLM,
)
from transformers.generation.logits_process import SynthIDTextWatermarkLogitsProcessor

from hf_specsample import SpeculativeConfig

PROMPT = torch.tensor([[1, 5, 6, 7]])


@pytest.fixture()
def target():
    return tiny_lm(seed=0, vocab_size=32)


@pytest.fixture()
def draft():
    return tiny_lm(seed=1, vocab_size=32)


def assert_fails_before_work(target, draft, match, error=ValueError, **kwargs):
    counter = ForwardCounter(target, draft)
    try:
        with pytest.raises(error, match=match):
            target.generate(PROMPT, max_new_tokens=5, pad_token_id=PAD, draft_model=draft, **kwargs)
    finally:
        counter.remove()
    assert counter.calls == 0


def test_draft_of_another_width_without_tokenizers(target):
    """A logit width far from the target's (not padding): another tokenizer, whose ids mean other strings. Without
    both tokenizers there is no telling which tokens they share, so the pair is refused up front
    (`test_cross_tokenizer.py` covers drafts with another tokenizer)."""
    assert_fails_before_work(
        target, tiny_lm(seed=1, vocab_size=400), match="look like models with different tokenizers"
    )


def _mamba():
    config = MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2)
    return MambaForCausalLM(config).eval()


def _jamba():
    config = JambaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2,
        mamba_d_state=4, mamba_expand=2, pad_token_id=PAD,
    )  # fmt: skip
    return JambaForCausalLM(config).eval()


def _minimax_full_attention():
    """MiniMax with full-attention layers only: attention, but transformers gives it a cache of its own."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    config = MiniMaxConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, pad_token_id=PAD,
        layer_types=["full_attention", "full_attention"],
    )  # fmt: skip
    return MiniMaxForCausalLM(config).eval()


def _gemma3n():
    """Gemma3n: attention only, but its last layers reuse earlier layers' keys and values."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=32, hidden_size=32, intermediate_size=[64] * 4, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=32, laurel_rank=4,
        altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4, pad_token_id=PAD,
    )  # fmt: skip
    return Gemma3nForCausalLM(config).eval()


@pytest.mark.parametrize(
    "make, reason",
    [(_minimax_full_attention, "cache of its own"), (_gemma3n, "shared with other layers")],
    ids=["minimax-full-attention", "gemma3n-shared-kv"],
)
def test_models_whose_cache_cannot_be_rolled_back_are_refused(target, make, reason):
    """Refused as draft and as target before any forward, with the model's own reason and what to use instead."""
    model = make()
    for role, pair in (("draft", (target, model)), ("target", (model, target))):
        match = f"The {role} model cannot be used.*{reason}.*rolls each row's cache back.*Use such a {role}"
        assert_fails_before_work(*pair, match=match)


@pytest.mark.parametrize("make", [_mamba, _jamba], ids=["mamba", "jamba"])
def test_mamba1_targets_are_refused_before_work(target, make):
    """Mamba-1 layers restart the scan of a multi-token forward from zero: such a target cannot verify in one forward
    (as a draft it is exact: `test_hybrid.py`)."""
    match = "The target model cannot be used.*Mamba-1 layers cannot continue.*serve as the draft"
    assert_fails_before_work(make(), target, match=match)


@pytest.mark.parametrize("bad", [0, -2])
def test_lookahead_below_one(target, draft, bad):
    assert_fails_before_work(target, draft, match="num_lookahead must be >= 1", num_lookahead=bad)


@pytest.mark.parametrize("bad", [1.5, True, "4"])
def test_lookahead_not_an_int(target, draft, bad):
    assert_fails_before_work(target, draft, match="num_lookahead must be an int", error=TypeError, num_lookahead=bad)


def test_config_validates_on_construction():
    with pytest.raises(ValueError, match=">= 1"):
        SpeculativeConfig(num_lookahead=0)


def test_beam_search(target, draft):
    assert_fails_before_work(target, draft, match=r"Beam search \(num_beams=3\).*num_beams=1", num_beams=3)


def test_contrastive_search(target, draft):
    assert_fails_before_work(target, draft, match="greedy decoding and sampling", penalty_alpha=0.6, top_k=4)


def test_encoder_decoder_target(draft):
    config = BartConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    bart = BartForConditionalGeneration(config).eval()
    assert_fails_before_work(bart, draft, match="encoder-decoder")


def test_draft_that_is_not_a_model(target):
    with pytest.raises(TypeError, match="draft_model must be a transformers causal LM"):
        target.generate(PROMPT, max_new_tokens=5, draft_model="HuggingFaceTB/SmolLM2-135M")


def test_both_draft_and_assistant(target, draft):
    assert_fails_before_work(target, draft, match="either `draft_model=`.*or `assistant_model=`", assistant_model=draft)


def test_speculative_arguments_without_draft(target):
    with pytest.raises(ValueError, match="pass `draft_model=`"):
        target.generate(PROMPT, max_new_tokens=5, num_lookahead=3)


def test_attentions_and_hidden_states(target, draft):
    assert_fails_before_work(
        target, draft, match="output_attentions", return_dict_in_generate=True, output_attentions=True
    )


def test_offloaded_static_cache(target, draft):
    """Static caches work (tests/test_static_cache.py); an offloaded one is refused."""
    assert_fails_before_work(target, draft, match="offloaded static layers", cache_implementation="offloaded_static")


def test_stateful_watermark_processor(target, draft):
    watermark = SynthIDTextWatermarkLogitsProcessor(
        ngram_len=2, keys=[1, 2], sampling_table_size=2**8, sampling_table_seed=0, context_history_size=8,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert_fails_before_work(
        target,
        draft,
        match="keeps state across calls",
        do_sample=True,
        logits_processor=LogitsProcessorList([watermark]),
    )


def test_draft_tokenizer_without_the_targets(target, draft):
    assert_fails_before_work(
        target, draft, match="pass the target's as `tokenizer=`", draft_tokenizer=char_tokenizer(32)
    )


def test_batch_with_per_row_stop_criteria_and_no_eos_is_refused(target, draft):
    """Plain keeps generating rows whose criterion fired when no EOS id is set: refused instead of differing."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOn(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 12

    counter = ForwardCounter(target, draft)
    try:
        with pytest.raises(ValueError, match="plain generate\\(\\) keeps generating rows whose criterion fired"):
            target.generate(
                PROMPT.expand(2, -1), max_new_tokens=5, pad_token_id=PAD, draft_model=draft,
                stopping_criteria=StoppingCriteriaList([StopOn()]),
            )  # fmt: skip
    finally:
        counter.remove()
    assert counter.calls == 0
    # One row, or an EOS id (rows are then padded after they stop, as plain pads them): accepted.
    target.generate(
        PROMPT,
        max_new_tokens=5,
        pad_token_id=PAD,
        draft_model=draft,
        stopping_criteria=StoppingCriteriaList([StopOn()]),
    )


def test_draft_without_weights_is_refused(target):
    """A draft on the meta device (never loaded) is refused with what to do, not torch's device error mid-forward;
    a target likewise."""
    unloaded = tiny_lm(seed=1, vocab_size=32).to("meta")
    assert_fails_before_work(target, unloaded, match="draft model's weights are on the meta device.*load its weights")
    assert_fails_before_work(unloaded, target, match="target model's weights are on the meta device")


@pytest.mark.parametrize("do_sample", [False, True])
def test_generator_that_is_not_a_generator(target, draft, do_sample):
    assert_fails_before_work(
        target, draft, match="generator= takes a torch.Generator", error=TypeError, generator=3, do_sample=do_sample
    )


def test_draft_vocabulary_of_non_integer_ids_or_too_wide():
    for ids in (torch.tensor([3.0, 7.9, 12.5]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match="token ids must be integers"):
            SpeculativeConfig(draft_vocabulary=ids)


def test_draft_vocabulary_wider_than_the_models(target, draft):
    config = SpeculativeConfig(draft_vocabulary=1000)
    assert_fails_before_work(target, draft, match="draft_vocabulary=1000 exceeds the 32 ids", speculative_config=config)


@pytest.mark.parametrize(
    ("setting", "instead"),
    [
        ({"num_assistant_tokens": 5}, r"num_lookahead=5"),
        ({"num_assistant_tokens_schedule": "heuristic"}, r"K adapts by default.*max_lookahead"),
        ({"assistant_confidence_threshold": 0.2}, r"K adapts by default.*max_lookahead"),
        ({"assistant_early_exit": 1}, r"draft_model='auto'"),
        ({"assistant_lookbehind": 4}, r"draft_tokenizer="),
        ({"target_lookbehind": 4}, r"draft_tokenizer="),
        ({"assistant_ensemble_weight": 0.5}, r"exactly from the target's distribution"),
        ({"speculation_type": "dflash"}, r"names the draft"),
    ],
)
def test_assistant_settings(target, draft, setting, instead):
    """transformers' assisted-generation settings are not read by `draft_model=`: refused, naming what does their job
    here, whether passed as arguments or set on a passed `generation_config=`."""
    (name,) = setting
    match = f"`{name}=.*assisted generation.*{instead}"
    assert_fails_before_work(target, draft, match=match, **setting)
    config = copy.deepcopy(target.generation_config)
    config.update(**setting)
    assert_fails_before_work(target, draft, match=match, generation_config=config)


def test_assistant_settings_left_at_their_defaults(draft):
    """Values the call did not set are not refused: transformers' defaults (`num_assistant_tokens=20`, ...) on a
    passed config, and whatever the model's own generation config holds (a checkpoint may set them)."""
    target = tiny_lm(seed=0, vocab_size=32)
    expected = target.generate(PROMPT, max_new_tokens=5, pad_token_id=PAD)
    defaults = GenerationConfig._get_default_generation_params()
    with_defaults = GenerationConfig(**defaults, max_new_tokens=5, pad_token_id=PAD)
    assert with_defaults.num_assistant_tokens == 20
    out = target.generate(PROMPT, generation_config=with_defaults, draft_model=draft)
    assert torch.equal(out, expected)
    target.generation_config.num_assistant_tokens = 5
    target.generation_config.assistant_confidence_threshold = 0.2
    out = target.generate(PROMPT, max_new_tokens=5, pad_token_id=PAD, draft_model=draft)
    assert torch.equal(out, expected)
    config = copy.deepcopy(target.generation_config)
    config.update(max_new_tokens=5, pad_token_id=PAD)
    out = target.generate(PROMPT, generation_config=config, draft_model=draft)
    assert torch.equal(out, expected)
