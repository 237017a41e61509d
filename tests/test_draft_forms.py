"""Draft levers: int8 copies, FR-Spec vocabulary subsets, draft_model="auto" — all exact."""

import copy

import pytest
import torch
from exact import sampled_pvalue
from tiny import PAD, char_tokenizer, implicit_draft, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig, frequent_tokens
from hf_specsample.kernels.quantized_linear import Int8Linear, SiblingProjection
from hf_specsample.options import DraftForm
from hf_specsample.policy.round_costs import weight_bytes
from hf_specsample.prepare.prepared_draft import prepare_draft
from hf_specsample.prepare.surgery import int8_dynamic_copy, restrict_vocabulary

INT8_LINEAR = torch.ao.nn.quantized.dynamic.Linear
PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def greedy(model, **kwargs):
    return model.generate(PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=PAD, **kwargs)


def test_int8_copy_quantizes_linears_and_leaves_the_original(pair):
    _, draft = pair
    quantized = int8_dynamic_copy(draft)
    assert isinstance(quantized.model.layers[0].mlp.up_proj, INT8_LINEAR)
    assert isinstance(draft.model.layers[0].mlp.up_proj, torch.nn.Linear)
    assert weight_bytes(quantized) < 0.3 * weight_bytes(draft.float())  # ~1 byte instead of 4 per weight


def test_int8_weight_bytes_without_unpacking(pair, monkeypatch):
    """Costing an int8 draft runs on every generate() call: unpacking its weights there cost 2.6 s on the 0.5B."""
    _, draft = pair
    quantized = int8_dynamic_copy(draft)
    int8_weights = sum(m.weight().numel() for m in quantized.modules() if isinstance(m, INT8_LINEAR))
    float_params = sum(p.numel() * p.element_size() for p in quantized.parameters())
    embedding = quantized.get_input_embeddings().weight  # shared with the draft, not a parameter of the copy
    untied = embedding is not getattr(quantized.get_output_embeddings(), "weight", None)
    counted = any(p is embedding for p in quantized.parameters())
    expected = int8_weights + float_params - (embedding.numel() * embedding.element_size() if untied and counted else 0)
    monkeypatch.setattr(INT8_LINEAR, "weight", lambda self: pytest.fail("weight() unpacks the packed weight"))
    assert weight_bytes(quantized) == expected


def test_auto_quantizes_float_cpu_drafts_once(pair, int8_steps_faster):
    target, draft = pair
    first = implicit_draft(draft, target, DraftForm.AUTO)
    assert isinstance(first.model.model.layers[0].mlp.up_proj, INT8_LINEAR)
    assert implicit_draft(draft, target, DraftForm.AUTO) is first  # cached per draft model
    assert implicit_draft(draft, target, DraftForm.AS_GIVEN).model is draft
    assert isinstance(prepare_draft(draft, target).model.model.layers[0].mlp.up_proj, INT8_LINEAR)
    assert prepare_draft(draft, target, form=DraftForm.AS_GIVEN).model is draft


@pytest.mark.parametrize("form", ["auto", "dynamic_int8", "as_given"])
def test_greedy_identity_whatever_the_draft_form(pair, form):
    target, draft = pair
    config = SpeculativeConfig(draft_form=form)
    assert torch.equal(greedy(target, draft_model=draft, speculative_config=config), greedy(target))


def test_int8_refused_for_a_dispatched_draft(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    target, draft = pair
    draft.save_pretrained(tmp_path)
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map={"": "disk"}, offload_folder=str(tmp_path / "o")
    )
    with pytest.raises(ValueError, match="needs a float draft on the CPU"):
        greedy(target, draft_model=offloaded, speculative_config=SpeculativeConfig(draft_form="dynamic_int8"))
    # AUTO leaves it as it is, and it still drafts exactly
    assert torch.equal(greedy(target, draft_model=offloaded), greedy(target))


def test_restricted_vocabulary_scores_only_the_subset(pair):
    _, draft = pair
    ids = torch.tensor([0, 2, 5, 9, 33])
    view = restrict_vocabulary(draft, ids)
    logits = view(PROMPT).logits
    assert logits.shape[-1] == 5
    torch.testing.assert_close(logits, draft(PROMPT).logits[..., ids])
    assert view.model is draft.model and draft.lm_head.weight.shape[0] == 64  # shared body, original head kept


@pytest.mark.parametrize("vocabulary", [40, torch.arange(0, 64, 2)])
def test_greedy_identity_with_a_vocabulary_subset(pair, vocabulary):
    target, draft = pair
    config = SpeculativeConfig(draft_vocabulary=vocabulary)
    out = greedy(target, draft_model=draft, speculative_config=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(target))


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0.9, top_p=0.9), dict(temperature=0.9, repetition_penalty=1.5)],
    ids=["compact-processing", "full-vocabulary-processing"],
)
def test_sampling_exact_with_a_vocabulary_subset(settings):
    target = tiny_lm(seed=0)  # 8 tokens: enumerable; the draft may only propose 5 of them
    draft = perturbed_copy(target, seed=1, scale=0.3)
    prompt = torch.tensor([[1, 5, 2, 5]])
    subset = torch.tensor([0, 2, 3, 5, 6])  # tokens 1, 4 and 7 can only come from the target
    config = SpeculativeConfig(draft_vocabulary=subset, num_lookahead=2)
    assert sampled_pvalue(target, prompt, 3, 10_000, 4, settings, draft_model=draft, speculative_config=config) > 1e-3
    # the compact path really drafts from the subset only
    out = target.generate(prompt, do_sample=True, max_new_tokens=8, draft_model=draft, speculative_config=config,
                          return_dict_in_generate=True, pad_token_id=PAD, **settings)  # fmt: skip
    assert out.speculative_stats.draft_tokens > 0


def test_auto_self_draft_on_cpu_is_an_int8_copy_of_the_target(pair):
    target, _ = pair
    prepared = prepare_draft("auto", target)  # the target's int8 or int8-weights copy, whichever steps faster
    up = prepared.model.model.layers[1].mlp.up_proj
    assert isinstance(up.fused if isinstance(up, SiblingProjection) else up, (INT8_LINEAR, Int8Linear))
    assert len(prepared.model.model.layers) == len(target.model.layers)
    assert torch.equal(greedy(target, draft_model="auto"), greedy(target))  # the default (adaptive) policy
    # A fixed K: the adaptive K follows wall-clock costs, so its acceptance rate varied with the machine's load.
    out = greedy(target, draft_model="auto", num_lookahead=4, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(target))
    assert out.speculative_stats.acceptance_rate > 0.8  # a quantized copy of the target agrees with it


def test_frequent_tokens_ranks_by_count_and_keeps_special_tokens():
    tokenizer = char_tokenizer(64)
    ids = frequent_tokens(tokenizer, 3, texts=["aaaa bbb cc", "a b"])
    letters = set(tokenizer.convert_ids_to_tokens(ids.tolist()))
    assert {"a", "b"} <= letters and {"<pad>", "<s>", "</s>"} <= letters
    assert ids.tolist() == sorted(ids.tolist())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(draft_form="fp8"), ValueError, "draft_form must be one of"),
        (dict(draft_vocabulary=0), ValueError, "positive number"),
        (dict(draft_vocabulary="top"), TypeError, "draft_vocabulary must be"),
    ],
)
def test_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig(**kwargs)


def test_vocabulary_ids_out_of_range(pair):
    target, draft = pair
    config = SpeculativeConfig(draft_vocabulary=torch.tensor([1, 2, 99]))
    with pytest.raises(ValueError, match=r"outside \[0, 64\)"):
        greedy(target, draft_model=draft, speculative_config=config)


def test_a_gguf_loaded_draft_gets_the_int8_copy(pair, int8_steps_faster):
    """A GGUF-loaded model keeps transformers' GGUF quantizer although its weights are plain floats, and refuses
    `.float()`: it was silently run as given (1.40x instead of 2.1x on the Qwen pair). It now gets the int8 copy."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    target, draft = pair
    gguf_draft = copy.deepcopy(draft)
    gguf_draft.hf_quantizer = GgufHfQuantizer(GgufConfig())
    gguf_draft.is_quantized = True  # as from_pretrained(..., gguf_file=...) sets them
    with pytest.raises(ValueError, match="not supported for quantized model"):
        copy.deepcopy(gguf_draft).float()  # what a GGUF-loaded model does
    prepared = prepare_draft(gguf_draft, target)
    assert prepared.form is DraftForm.DYNAMIC_INT8
    assert isinstance(prepared.model.model.layers[0].mlp.up_proj, INT8_LINEAR)
    assert torch.equal(greedy(target, draft_model=gguf_draft, num_lookahead=3), greedy(target))


def test_a_linear_subclass_with_its_own_forward_is_left_as_it_is():
    """Llama-4's router is an `nn.Linear` whose forward returns a tuple: the compact forms keep it (a replacement
    linear would return one tensor), and `draft_model="auto"` gives plain greedy's tokens."""
    import transformers as tf

    config = tf.Llama4TextConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0,
        no_rope_layers=[1, 0], interleave_moe_layer_step=1,
    )  # fmt: skip
    torch.manual_seed(0)
    target = tf.Llama4ForCausalLM(config).eval()
    prompt = torch.tensor([[1, 5, 9, 13, 7]])
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=8, do_sample=False, draft_model="auto"), expected)
