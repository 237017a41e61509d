"""Drafts whose logit width differs from the target's (padded vocabularies, e.g. Qwen2.5-7B's 152064 rows against
its small siblings' 151936): exact, greedy-identical, and a wider draft never proposes an id the target lacks."""

import copy

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, perturbed_copy, prepared_processors, tiny_lm

from hf_specsample import SpeculativeConfig

PROMPT = torch.tensor([[1, 5, 7, 5]])  # 7 lies beyond the narrow draft's width: the draft must still run
NUM_TOKENS = 3
SAMPLES = 8_000
SETTINGS = dict(temperature=1.1)
ALPHA = 1e-3
TARGET_WIDTH = 8


@pytest.fixture(scope="module")
def target():
    return tiny_lm(seed=0, vocab_size=TARGET_WIDTH)


def resized(model, width: int):
    """A close draft of another width: the target's weights with noise, embeddings and head cut or extended."""
    draft = perturbed_copy(model, seed=1, scale=0.3)
    draft.resize_token_embeddings(width, mean_resizing=False)
    return draft


@pytest.fixture(scope="module")
def drafts(target):
    wide = resized(target, 12)
    with torch.no_grad():  # the ids the target lacks get the draft's highest logits: it would propose them first
        wide.lm_head.weight[TARGET_WIDTH:] = 10 * wide.lm_head.weight[:4]
    return {"narrow": resized(target, 6), "wide": wide}


def exact(target):
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, **SETTINGS)
    return exact_distribution(target, PROMPT, processors, NUM_TOKENS)


@pytest.mark.parametrize("kind", ["narrow", "wide"])
@pytest.mark.parametrize("quantization", ["as_given", "auto"])
@torch.no_grad()
def test_other_width_samples_follow_target(target, drafts, kind, quantization):
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=SAMPLES, pad_token_id=PAD,
        draft_model=drafts[kind], num_lookahead=2, generator=torch.Generator().manual_seed(3),
        speculative_config=SpeculativeConfig(draft_form=quantization), **SETTINGS,
    )  # fmt: skip
    assert int(out.max()) < TARGET_WIDTH
    assert chisquare_pvalue(exact(target), continuations(out, PROMPT.shape[1])) > ALPHA


@torch.no_grad()
def test_narrow_draft_with_a_frequent_token_subset(target, drafts):
    config = SpeculativeConfig(draft_vocabulary=4, draft_form="as_given")
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=SAMPLES, pad_token_id=PAD,
        draft_model=drafts["narrow"], speculative_config=config, num_lookahead=2,
        generator=torch.Generator().manual_seed(4), **SETTINGS,
    )  # fmt: skip
    assert chisquare_pvalue(exact(target), continuations(out, PROMPT.shape[1])) > ALPHA


@pytest.mark.parametrize("kind", ["narrow", "wide"])
@torch.no_grad()
def test_other_width_greedy_equals_plain(drafts, kind):
    target = tiny_lm(seed=5, vocab_size=TARGET_WIDTH, layers=2, hidden=32)
    draft = resized(target, 6 if kind == "narrow" else 12)
    prompts = torch.tensor([[1, 5, 7, 6, 2], [PAD, PAD, 1, 7, 3]])
    kwargs = dict(attention_mask=(prompts != PAD).long(), max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    plain = target.generate(prompts, **kwargs)
    assert target.generate(prompts, draft_model=draft, num_lookahead=3, **kwargs).tolist() == plain.tolist()


@torch.no_grad()
def test_a_wide_draft_proposing_foreign_ids_would_fail_the_test(target, drafts, monkeypatch):
    """Power: letting the wide draft's extra columns through (ids the target lacks) is caught."""
    from hf_specsample.prepare.prepared_draft import PreparedDraft

    monkeypatch.setattr(PreparedDraft, "ids_for", lambda self, target: None)  # every column of the draft's logits
    with pytest.raises((IndexError, RuntimeError)):
        copy.deepcopy(target).generate(
            PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=64, pad_token_id=PAD,
            draft_model=drafts["wide"], num_lookahead=2, generator=torch.Generator().manual_seed(3), **SETTINGS,
        )  # fmt: skip
