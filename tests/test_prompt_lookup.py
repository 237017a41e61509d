"""Prompt-lookup drafting (the suffix drafter over each row's own text): the search, and exactness through
generate()."""

import time

import numpy as np
import torch

from hf_specsample.proposers.suffix import Source, suffix_tree
from hf_specsample.proposers.suffix_store import MAX_MATCH, SEPARATOR, TokenIndex


def continuation(tokens, max_ngram=MAX_MATCH, num_tokens=4, usable=None):
    """The most probable path of the tree a row with these `tokens` drafts (its last `max_ngram` tokens matched)."""
    usable = [True] * len(tokens) if usable is None else [bool(flag) for flag in usable]
    index = TokenIndex(capacity=len(tokens) + 1, buckets=1 << 10)
    index.write(0, np.array([token if ok else SEPARATOR for token, ok in zip(tokens, usable)], dtype=np.int32))
    query = np.array([token for token, ok in zip(tokens, usable) if ok][-max_ngram:])
    tree, _, _ = suffix_tree(query, [(Source.CALL, index, len(tokens) - 1)], num_tokens, max_nodes=16)
    return tree.path().tokens


def test_continues_after_the_latest_earlier_occurrence():
    # (5, 6) at 0 and 4, each seen once: the latest wins the tie
    assert continuation([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], max_ngram=2) == [8, 2, 5, 6]
    assert continuation([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], max_ngram=2, num_tokens=2) == [8, 2]


def test_longest_match_first():
    # (9, 5, 6) occurs at 0 (followed by 7); (5, 6) alone occurs later at 5 (followed by 8): the longer match wins.
    assert continuation([9, 5, 6, 7, 1, 5, 6, 8, 9, 5, 6], max_ngram=3) == [7, 1, 5, 6]
    assert continuation([9, 5, 6, 7, 1, 5, 6, 8, 9, 5, 6], max_ngram=2) == [8, 9, 5, 6]


def test_continuation_stops_at_the_end_of_the_text():
    assert continuation([3, 4, 3, 4], max_ngram=2, num_tokens=10) == [3, 4]  # (3, 4) at 0: followed by 3, 4


def test_no_occurrence_and_padding():
    assert continuation([1, 2, 3, 4]) == []
    # (7, 8) occurs at 0, but inside prompt padding: no n-gram may touch padding.
    assert continuation([7, 8, 9, 1, 7, 8], max_ngram=2, usable=[0, 0, 1, 1, 1, 1]) == []
    assert continuation([7, 8, 9, 1, 7, 8], max_ngram=2) == [9, 1, 7, 8]


# --- through generate() ---------------------------------------------------------------------------------------------

import pytest  # noqa: E402
from exact import sampled_pvalue  # noqa: E402
from tiny import PAD, FakeClock, perturbed_copy, tiny_lm  # noqa: E402

from hf_specsample import SpeculativeConfig  # noqa: E402

PROMPT = torch.tensor([[1, 5, 2, 5, 3, 5, 2]])  # repeats itself: continuations exist from the first round
DRAFTS = {  # generate() arguments of the two prompt-lookup modes
    "lookup-only": dict(draft_model="prompt_lookup"),
    "lookup-only-4": dict(draft_model="prompt_lookup", prompt_lookup_num_tokens=4, max_matching_ngram_size=2),
    # with a model draft, which drafts K=2 every round: the tiny draft costs what its target costs, so the default
    # policy would not draft by model in a batch (and lookups only come with the model's rounds there)
    "lookup-then-model": dict(prompt_lookup_num_tokens=3, num_lookahead=2),
}


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch):
    """Greedy lookup rounds adapt K to their measured costs: here on a fake clock (every reading 1 ms after the
    last), so what a test asserts of the rounds (lookups accepted, fewer rounds than tokens) never rests on the
    machine's load."""
    monkeypatch.setattr(time, "perf_counter", FakeClock(1e-3))


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=8)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def arguments(mode, draft):
    kwargs = dict(DRAFTS[mode])
    kwargs.setdefault("draft_model", draft)
    return kwargs


@pytest.mark.parametrize("mode", list(DRAFTS))
def test_greedy_equals_plain(pair, mode):
    target, draft = pair
    rows = [[1, 5, 2, 5, 3, 5, 2], [1, 3, 3, 4]]
    ids = torch.tensor([[PAD] * (7 - len(row)) + row for row in rows])
    mask = (torch.arange(7)[None, :] >= torch.tensor([7 - len(row) for row in rows])[:, None]).long()
    for prompt, prompt_mask in ((PROMPT, None), (ids, mask)):
        kwargs = dict(attention_mask=prompt_mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
        expected = target.generate(prompt, **kwargs)
        got = target.generate(prompt, **kwargs, **arguments(mode, draft), return_dict_in_generate=True)
        assert torch.equal(got.sequences, expected)
        assert got.speculative_stats.accepted_tokens > 0  # the lookups proposed something the target kept


@pytest.mark.parametrize("verification", ["block", "token"])
@pytest.mark.parametrize("mode", list(DRAFTS))
def test_sampling_is_exact(pair, mode, verification):
    """A lookup proposal is a point-mass draft distribution: the samples follow the target exactly."""
    target, draft = pair
    p = sampled_pvalue(
        target, PROMPT, num_tokens=3, rows=8000, seed=4, settings=dict(temperature=0.8),
        speculative_config=SpeculativeConfig(verification=verification), **arguments(mode, draft),
    )  # fmt: skip
    assert p > 1e-3


def test_lookup_only_runs_no_model_and_lookup_rounds_skip_the_draft(pair):
    target, draft = pair
    out = target.generate(
        PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD, draft_model="prompt_lookup",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.speculative_stats.draft_forward_passes == 0 and out.speculative_stats.rounds < 24
    out = target.generate(
        PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD, draft_model=draft, num_lookahead=2,
        prompt_lookup_num_tokens=4, return_dict_in_generate=True,
    )  # fmt: skip
    stats = out.speculative_stats
    assert stats.draft_forward_passes < 2 * stats.rounds  # some rounds were lookups, with no draft forward


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_lookup_width_is_refused(pair, bad):
    target, _ = pair
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be a positive int"):
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model="prompt_lookup",
                        prompt_lookup_num_tokens=bad)  # fmt: skip


def test_model_options_with_prompt_lookup_are_refused_and_num_lookahead_sets_the_width(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="runs no draft model"):
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model="prompt_lookup",
                        speculative_config=SpeculativeConfig(draft_vocabulary=4))  # fmt: skip
    out = target.generate(
        PROMPT, do_sample=False, max_new_tokens=12, pad_token_id=PAD, draft_model="prompt_lookup", num_lookahead=2,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert set(out.speculative_stats.lookahead_per_round) <= {0, 1, 2}


def test_lookup_width_adapts_and_a_round_without_a_continuation_is_a_plain_step(pair):
    """`draft_model="prompt_lookup"` chooses its width like a model draft's K (up to prompt_lookup_num_tokens), and
    a round in which no row has a continuation verifies nothing extra (it used to pad ten copies of the last token)."""
    target, _ = pair
    never_repeats = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    first = target.generate(
        never_repeats, do_sample=False, max_new_tokens=1, pad_token_id=PAD, draft_model="prompt_lookup",
        num_lookahead=10, return_dict_in_generate=True,
    )  # fmt: skip
    assert first.speculative_stats.draft_tokens == 0  # nothing found: a plain step, whatever K was asked for
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=40, pad_token_id=PAD, draft_model="prompt_lookup",
        prompt_lookup_num_tokens=6, return_dict_in_generate=True, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    widths = out.speculative_stats.lookahead_per_round
    assert max(widths) <= 6 and len(set(widths)) > 1


# --- point masses travel as token ids -------------------------------------------------------------------------------


def test_every_drafter_implements_the_proposer_contract():
    from hf_specsample.proposers.base import Proposer
    from hf_specsample.proposers.draft_model import DraftModelProposer
    from hf_specsample.proposers.suffix import SuffixProposer
    from hf_specsample.proposers.suffix_then_model import SuffixThenModelProposer

    for drafter in (DraftModelProposer, SuffixProposer, SuffixThenModelProposer):
        assert issubclass(drafter, Proposer) and not drafter.__abstractmethods__, drafter


@pytest.mark.parametrize("verification", ["block", "token"])
@pytest.mark.parametrize("mode", list(DRAFTS))
def test_lookup_proposals_build_no_vocabulary_wide_draft_tensor(pair, monkeypatch, mode, verification):
    """Lookup tokens reach the acceptance rule as token ids: `draft_probs` None in a lookup round, and in a model's
    round with forced n-gram tokens the model's own distributions with a `point_mass` mask. No one-hot is built."""
    import hf_specsample.verify.verifier as verifier

    def no_one_hot(*args, **kwargs):
        raise AssertionError("a one-hot draft distribution was built")

    seen = []  # per round with draft tokens: (draft_probs is None, a point_mass mask was given)

    def recorded(rule):
        def checked(draft_tokens, draft_probs, target_probs, generator=None, uniform=None, point_mass=None, **draws):
            if draft_tokens.shape[1]:
                seen.append((draft_probs is None, point_mass is not None))
            return rule(draft_tokens, draft_probs, target_probs, generator, uniform, point_mass, **draws)

        return checked

    def recorded_tree(rule):  # a lookup tree: its nodes' token ids alone reach the walk
        def checked(tree, target_probs, draws):
            seen.append((True, False))
            return rule(tree, target_probs, draws)

        return checked

    monkeypatch.setattr(torch.nn.functional, "one_hot", no_one_hot)
    monkeypatch.setattr(verifier, "block_accept", recorded(verifier.block_accept))
    monkeypatch.setattr(verifier, "speculative_accept", recorded(verifier.speculative_accept))
    monkeypatch.setattr(verifier, "tree_accept", recorded_tree(verifier.tree_accept))
    target, draft = pair
    rows = [[1, 5, 2, 5, 3, 5, 2], [1, 3, 3, 4, 3, 3]]  # batched: rows with and without a continuation
    ids = torch.tensor([[PAD] * (7 - len(row)) + row for row in rows])
    mask = (ids != PAD).long()
    # (the model-draft mode fixes K, so that the model drafts with n-gram tokens forced where a row has some)
    config = SpeculativeConfig(verification=verification)
    for prompt, prompt_mask in ((PROMPT, None), (ids, mask)):
        target.generate(
            prompt, attention_mask=prompt_mask, do_sample=True, max_new_tokens=16, pad_token_id=PAD,
            generator=torch.Generator().manual_seed(0), speculative_config=config, **arguments(mode, draft),
        )  # fmt: skip
    assert (True, False) in seen  # lookup rounds: token ids only
    if mode == "lookup-then-model":
        assert (False, True) in seen  # a model round in which some row's tokens were forced
    else:
        assert set(seen) == {(True, False)}
