"""`RoundMemory`: a greedy call's adaptive K starts from the costs the last call like it measured; sampling and seeded
calls never read what an earlier call measured."""

import gc

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm

import hf_specsample.policy.lookahead as lookahead_module
from hf_specsample import SpeculativeConfig, prepare_draft
from hf_specsample.policy.lookahead import (
    MEMORY_KINDS,
    AdaptiveLookahead,
    RoundLookahead,
    RoundMemory,
    RoundRecord,
    memory_slot,
)
from hf_specsample.policy.round_costs import MeasuredCosts

PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


class Holder:
    """Something a user holds (a prepared draft, a target)."""


def owner(memory, holder=None, batch_size=1, lookup_only=False):
    config = SpeculativeConfig()
    slot = memory_slot(holder if holder is not None else Holder(), config, batch_size) if memory else None
    return RoundLookahead.for_call(
        config,
        clock_free=False,
        batch_size=batch_size,
        max_length=10_000,
        prompt_ends_in_padding=False,
        lookup_tokens=None,
        lookup_only=lookup_only,
        cost_ratio=0.1,
        memory=slot,
    )


def run_rounds(rounds: RoundLookahead, count: int, alpha: float = 0.9, draft_step: float = 0.01) -> list[int]:
    """Rounds of a draft accepted `alpha` of the time, verification flat (a cheap draft: the best K is the largest)."""
    chosen = []
    for _ in range(count):
        k = rounds.budget([10]).lookahead
        chosen.append(k)
        accepted = round(alpha * k)
        rounds.observe(RoundRecord(k, accepted, accepted + int(accepted < k), draft_step * k, 0.2), model_steps=k)
    return chosen


def test_a_call_starts_where_the_last_call_like_it_ended(monkeypatch):
    monkeypatch.setattr(lookahead_module, "ROUNDS", RoundMemory())
    holder = Holder()
    first = owner(True, holder)
    cold = run_rounds(first, 12)
    assert cold[:4] == [2, 3, 4, 5]  # from priors: K = 2, then one more than the largest timed
    assert cold[-1] == 8
    first.finished()
    warm = run_rounds(owner(True, holder), 6)
    assert warm == [8] * 6, "the next call starts at the K the last one ended at"
    fresh = run_rounds(owner(False, holder), 3)
    assert fresh[:2] == [2, 3], "without a memory slot: from priors"
    assert run_rounds(owner(True, Holder()), 2) == [2, 3], "another holder learned nothing"
    assert run_rounds(owner(True, holder, batch_size=4), 2) == [2, 3], "another batch size is another kind"


def test_the_prompt_lookups_doubling_is_remembered_too(monkeypatch):
    monkeypatch.setattr(lookahead_module, "ROUNDS", RoundMemory())
    holder = Holder()
    first = owner(True, holder, lookup_only=True)
    cold = run_rounds(first, 8)
    assert cold[:2] == [4, 8] and cold[-1] > 8
    first.finished()
    assert run_rounds(owner(True, holder, lookup_only=True), 1)[0] == cold[-1]


def test_a_call_that_did_not_finish_leaves_nothing(monkeypatch):
    monkeypatch.setattr(lookahead_module, "ROUNDS", RoundMemory())
    holder = Holder()
    run_rounds(owner(True, holder), 12)  # never `finished`: it raised
    assert run_rounds(owner(True, holder), 2) == [2, 3]


def test_recalled_costs_are_a_copy_and_processing_is_timed_afresh():
    memory, holder = RoundMemory(), Holder()
    slot = memory_slot(holder, SpeculativeConfig(), 1)
    policy = AdaptiveLookahead(max_lookahead=8)
    for k in (2, 3, 4, 5):
        policy.observe(RoundRecord(k, k, k, 0.01 * k, 0.3, verify_processing_seconds=0.1 * (k + 1)))
    memory.keep(slot, policy)
    recalled = memory.recall(slot)
    assert recalled.alpha == pytest.approx(policy.acceptance_rate())
    costs = recalled.costs
    assert costs.draft_seconds() == pytest.approx(0.01)  # d without the processors' share
    assert costs.unprocessed_seconds(4) == pytest.approx(policy.costs.unprocessed_seconds(4))
    assert not costs.processing.measured and not costs.settled
    costs.observe(RoundRecord(6, 0, 1, 5.0, 9.0))
    again = memory.recall(slot).costs
    assert again.draft_seconds() == pytest.approx(0.01) and 6 not in again.verify


def test_a_call_the_draft_missed_does_not_stop_the_next_one_drafting(monkeypatch):
    """The acceptance is the text's: a call ending at K = 0 (nothing accepted) leaves its costs, not its verdict."""
    monkeypatch.setattr(lookahead_module, "ROUNDS", RoundMemory())
    holder = Holder()
    missed = owner(True, holder)
    assert run_rounds(missed, 12, alpha=0.0)[-1] == 0
    missed.finished()
    assert run_rounds(owner(True, holder), 1)[0] > 0
    # a costlier draft (0.7 of a round a step), which pays at this text's acceptance (0.95) but not at the prior's
    # (0.6): the carried costs alone would start the call plain, waiting for a probe
    costly = owner(True, holder := Holder())
    assert run_rounds(costly, 12, alpha=0.95, draft_step=0.14)[-1] > 0
    costly.finished()
    missed = owner(True, holder)
    assert run_rounds(missed, 12, alpha=0.0, draft_step=0.14)[-1] == 0
    missed.finished()
    assert min(run_rounds(owner(True, holder), 8, alpha=1.0, draft_step=0.14)) > 0


def test_memory_is_bounded_and_goes_with_its_holder():
    memory, holder = RoundMemory(), Holder()
    policy = AdaptiveLookahead(max_lookahead=8)
    policy.observe(RoundRecord(2, 2, 2, 0.02, 0.2))
    slots = [memory_slot(holder, SpeculativeConfig(), rows) for rows in range(MEMORY_KINDS + 2)]
    for slot in slots:
        memory.keep(slot, policy)
    assert memory.recall(slots[0]) is None and memory.recall(slots[1]) is None  # the oldest kinds dropped
    assert all(memory.recall(slot) is not None for slot in slots[2:])
    del holder, slots, slot
    gc.collect()
    assert len(memory._kept) == 0
    unready = AdaptiveLookahead(max_lookahead=8)
    kept = memory_slot(Holder(), SpeculativeConfig(), 1)
    memory.keep(kept, unready)
    assert memory.recall(kept) is None, "a call that timed no round teaches nothing"


def test_options_that_cannot_be_a_key_remember_nothing():
    assert memory_slot(Holder(), SpeculativeConfig(), [1]) is None
    assert memory_slot(object(), SpeculativeConfig(), 1) is None  # cannot be held weakly


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def kept_kinds(memory: RoundMemory, holder) -> int:
    return len(memory._kept.get(holder, {}))


@pytest.mark.parametrize("held", ["prepared", "model"])
def test_greedy_calls_remember_and_stay_exact(pair, monkeypatch, held):
    """Kept by what the caller holds: a `PreparedDraft`, or the draft model (whose implicit prepared draft is made
    anew around it in every call)."""
    memory = RoundMemory()
    monkeypatch.setattr(lookahead_module, "ROUNDS", memory)
    target, draft = pair
    prepared = prepare_draft(draft, target) if held == "prepared" else draft
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=PAD)
    recalls = []
    recall = memory.recall
    monkeypatch.setattr(memory, "recall", lambda slot: recalls.append(recall(slot)) or recalls[-1])
    for _ in range(3):
        got = target.generate(PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=PAD, draft_model=prepared)
        assert torch.equal(got, expected)
    assert kept_kinds(memory, prepared) == 1
    assert recalls[0] is None and all(isinstance(learned.costs, MeasuredCosts) for learned in recalls[1:])


def test_sampling_and_seeded_calls_neither_read_nor_leave_a_memory(pair, monkeypatch):
    memory = RoundMemory()
    monkeypatch.setattr(lookahead_module, "ROUNDS", memory)
    target, draft = pair
    prepared = prepare_draft(draft, target)

    def sample():
        torch.manual_seed(3)
        return target.generate(
            PROMPT, do_sample=True, max_new_tokens=30, pad_token_id=PAD, draft_model=prepared,
            return_dict_in_generate=True,
        )  # fmt: skip

    before = sample()
    assert kept_kinds(memory, prepared) == 0
    target.generate(PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=PAD, draft_model=prepared)
    assert kept_kinds(memory, prepared) == 1
    after = sample()  # a greedy call's memory exists now: the sampled call must not read it
    assert torch.equal(before.sequences, after.sequences)
    assert before.speculative_stats.lookahead_per_round == after.speculative_stats.lookahead_per_round
    seeded = target.generate(
        PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=PAD, draft_model=prepared,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert seeded.shape[1] > PROMPT.shape[1]
    assert kept_kinds(memory, prepared) == 1, "a clock-free greedy call (generator=) keeps nothing either"
