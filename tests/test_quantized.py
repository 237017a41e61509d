"""bitsandbytes targets and drafts on CPU (bitsandbytes >= 0.45 runs LLM.int8 and 4-bit there)."""

import pytest
import torch
from exact import sampled_pvalue
from tiny import PAD, cache_of, perturbed_copy, tiny_lm, with_cache
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

pytest.importorskip("bitsandbytes")

PROMPT = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 41]])

# Configurations whose per-token results do not depend on the other tokens of a forward.
FOUR_BIT = dict(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
SHAPE_INVARIANT = {
    "int8-no-outliers": dict(load_in_8bit=True, llm_int8_threshold=0.0),
    "nf4": dict(FOUR_BIT, bnb_4bit_quant_type="nf4"),
    "nf4-double-quant": dict(FOUR_BIT, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(FOUR_BIT, bnb_4bit_quant_type="fp4"),
    "fp4-double-quant": dict(FOUR_BIT, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
}
INT8_WITH_OUTLIERS = dict(load_in_8bit=True, llm_int8_threshold=6.0)  # LLM.int8's default


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny float model on disk (bitsandbytes quantizes at load time) and a float draft close to it."""
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64, init_range=0.3)
    model.save_pretrained(folder)
    return folder, perturbed_copy(model, seed=1, scale=0.1)


def load_quantized(folder, **settings):
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(**settings), device_map="cpu", dtype=torch.float32
    ).eval()


@torch.no_grad()
def neighbour_dependence(model) -> float:
    """Max |logit difference| for the same tokens decoded one at a time vs in one forward."""
    full = model(PROMPT).logits[0, 3:].float()
    out = model(PROMPT[:, :4], use_cache=True)
    cache, steps = cache_of(out), [out.logits[0, -1]]
    for t in range(4, PROMPT.shape[1]):
        steps.append(model(PROMPT[:, t : t + 1], **with_cache(cache), use_cache=True).logits[0, -1])
    return (full - torch.stack(steps).float()).abs().max().item()


def greedy(model, **kwargs):
    return model.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("name", sorted(SHAPE_INVARIANT))
def test_greedy_equals_the_quantized_targets_own(saved, name):
    folder, draft = saved
    target = load_quantized(folder, **SHAPE_INVARIANT[name])
    assert neighbour_dependence(target) < 1e-4
    expected = greedy(target)
    for lookahead in (1, 3, 5):
        assert torch.equal(greedy(target, draft_model=draft, num_lookahead=lookahead), expected)


def test_llm_int8_outliers_make_a_tokens_logits_depend_on_its_neighbours(saved):
    """What the README documents: with outlier decomposition (threshold > 0) the outlier columns are chosen over
    every token in the forward, so verifying K+1 tokens at once is not the same computation as decoding them one by
    one; without it (threshold 0) it is."""
    folder, draft = saved
    with_outliers = load_quantized(folder, **INT8_WITH_OUTLIERS)
    assert neighbour_dependence(with_outliers) > 1e-2
    assert neighbour_dependence(load_quantized(folder, **SHAPE_INVARIANT["int8-no-outliers"])) < 1e-4
    out = greedy(with_outliers, draft_model=draft, num_lookahead=3)  # still generates, just not bit-identically
    assert out.shape == (1, PROMPT.shape[1] + 24)


def test_quantized_draft_with_full_precision_target(saved):
    folder, _ = saved
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64, init_range=0.3)
    int8_draft = load_quantized(folder, load_in_8bit=True)
    nf4_draft = load_quantized(folder, load_in_4bit=True, bnb_4bit_quant_type="nf4")
    assert type(int8_draft.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"
    assert type(nf4_draft.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    expected = greedy(target)
    for draft in (int8_draft, nf4_draft):
        out = greedy(target, draft_model=draft, num_lookahead=4, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.speculative_stats.accepted_tokens > 0


@pytest.mark.parametrize("name", ["int8-no-outliers", "nf4-double-quant"])
def test_sampling_is_exact_with_respect_to_the_quantized_target(tmp_path, name):
    small = tiny_lm(seed=0, hidden=64)  # 8-token vocabulary: enumerable
    small.save_pretrained(tmp_path)
    target = load_quantized(tmp_path, **SHAPE_INVARIANT[name])
    draft = perturbed_copy(small, seed=1, scale=0.3)
    settings = dict(temperature=0.8, top_k=6)
    pvalue = sampled_pvalue(
        target, torch.tensor([[1, 5, 2, 5]]), 3, 6000, 5, settings, draft_model=draft, num_lookahead=2
    )
    assert pvalue > 1e-3
