"""do_sample=False: token-for-token the target's own greedy output, whatever the draft."""

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig

AS_GIVEN = SpeculativeConfig(draft_form="as_given")  # run the draft exactly as passed (no int8 copy)

VOCAB = 64
PROMPTS = [torch.tensor([[1, 17, 42, 5, 9]]), torch.tensor([[1, 3]]), torch.tensor([[1, 60, 61, 62, 63, 7, 7, 7]])]


@pytest.fixture(scope="module")
def target():
    return tiny_lm(seed=0, vocab_size=VOCAB, layers=2, hidden=32, init_range=0.3)


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "close": perturbed_copy(target, seed=1, scale=0.1),
        "far": tiny_lm(seed=2, vocab_size=VOCAB, layers=1, hidden=32, init_range=0.3),
    }


def greedy(model, prompt, **kwargs):
    return model.generate(prompt, do_sample=False, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("lookahead", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("draft_kind", ["close", "far"])
def test_identical_to_target_greedy(target, drafts, draft_kind, lookahead):
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=40)
        got = greedy(target, prompt, max_new_tokens=40, draft_model=drafts[draft_kind], num_lookahead=lookahead)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("lookahead", [1, 3, 6])
def test_identical_with_eos_in_the_middle(target, drafts, lookahead):
    prompt = PROMPTS[0]
    free_run = greedy(target, prompt, max_new_tokens=40)[0, prompt.shape[1] :].tolist()
    eos = free_run[11]  # a token the target emits mid-run; its first occurrence ends generation there
    expected = greedy(target, prompt, max_new_tokens=40, eos_token_id=eos)
    assert expected.shape[1] < prompt.shape[1] + 40, "EOS must end generation early for this test to mean anything"
    for draft in (drafts["close"], target):
        got = greedy(
            target,
            prompt,
            max_new_tokens=40,
            eos_token_id=eos,
            draft_model=draft,
            num_lookahead=lookahead,
            speculative_config=AS_GIVEN,
        )
        assert torch.equal(got, expected)


def test_identical_with_prefix_dependent_processors(target, drafts):
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[5, 6]], min_new_tokens=4)
    for prompt in PROMPTS:
        expected = greedy(target, prompt, max_new_tokens=30, **settings)
        got = greedy(target, prompt, max_new_tokens=30, draft_model=drafts["close"], num_lookahead=4, **settings)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("lookahead", [1, 4])
def test_draft_identical_to_target_accepts_everything(target, lookahead):
    prompt = PROMPTS[0]
    out = greedy(
        target,
        prompt,
        max_new_tokens=30,
        draft_model=target,
        num_lookahead=lookahead,
        return_dict_in_generate=True,
        speculative_config=AS_GIVEN,
    )
    stats = out.speculative_stats
    assert torch.equal(out.sequences, greedy(target, prompt, max_new_tokens=30))
    assert stats.acceptance_rate == 1.0
    # every round commits K + 1 tokens, except the last, which only drafts up to max_length
    assert stats.target_forward_passes == -(-30 // (lookahead + 1))


def test_bfloat16_draft_with_float32_target(target, drafts):
    draft = perturbed_copy(target, seed=1, scale=0.1).to(torch.bfloat16)
    prompt = PROMPTS[0]
    got = greedy(target, prompt, max_new_tokens=30, draft_model=draft, num_lookahead=3)
    assert torch.equal(got, greedy(target, prompt, max_new_tokens=30))
