"""Real-model smoke tests (slow): SmolLM2-135M-Instruct through its real tokenizer and chat template."""

import pytest
import torch
from conftest import thread_share

from hf_specsample.prepare.self_draft import default_layers_to_keep, layer_skip_draft
from hf_specsample_bench.models import KnownModel, load_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def skip_middle_layers(model):
    """A draft: `model` without its middle fifth of decoder layers, 12-17 (SmolLM2 has no smaller sibling)."""
    return layer_skip_draft(model, default_layers_to_keep(model.config.num_hidden_layers))


def chat_inputs(tokenizer):
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    torch.set_num_threads(thread_share(2))


def test_smollm2_sampling_through_chat_template():
    target, tokenizer = load_model(KnownModel.SMOLLM2_135M, dtype=torch.bfloat16)
    draft = skip_middle_layers(target)
    inputs = chat_inputs(tokenizer)
    out = target.generate(
        **inputs, draft_model=draft, num_lookahead=3, do_sample=True, temperature=0.7, top_p=0.95,
        max_new_tokens=64, return_dict_in_generate=True, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    stats = out.speculative_stats
    text = tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\nSmolLM2 bf16, draft = SmolLM2 without layers 12-17, K=3: {stats}\n{text[:200]!r}")
    assert "def" in text or "prime" in text.lower()
    assert stats.new_tokens == out.sequences.shape[1] - inputs["input_ids"].shape[1]
    assert stats.accepted_tokens > 0


def test_smollm2_greedy_is_token_for_token_in_float32():
    target, tokenizer = load_model(KnownModel.SMOLLM2_135M, dtype=torch.float32)
    draft = skip_middle_layers(target)
    inputs = chat_inputs(tokenizer)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=48)
    got = target.generate(**inputs, do_sample=False, max_new_tokens=48, draft_model=draft, num_lookahead=4)
    assert torch.equal(got, expected)
