"""Logits processors' cost in the choice of K: a round pays them at 2K + 1 positions for at most K + 1 tokens, so a
costly processor lowers K, and one costing a plain step or more stops drafting from the first round; free processors
change nothing. Timed decisions are tested on injected timings and on `tiny.FakeClock`, never on the wall clock."""

import time

import pytest
import torch
from test_lookahead import PROMPT, feed
from tiny import PAD, FakeClock, tiny_lm
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

from hf_specsample import SpeculativeConfig
from hf_specsample.policy.lookahead import AdaptiveLookahead, make_policy, times_unknown_processors
from hf_specsample.policy.round_costs import ProcessingCost, RoundRecord, StaticCosts
from hf_specsample.policy.round_timer import PhaseTimer
from hf_specsample.sampling.processing import PositionwiseProcessor, cost_unknown

DRAFT_STEP, PLAIN_STEP = 0.02, 0.2  # a draft forward and a target step without processors, in seconds


def feed_processed(
    policy: AdaptiveLookahead, rounds: int, alpha: float, processing: float, prompt: bool = True
) -> list[int]:
    """Run the policy against synthetic rounds as the loop times them (`round_timer.PhaseTimer`): a flat target step,
    and `processing` seconds per processed position, one per drafted token and K + 1 verified; the first round
    encodes the prompt where `prompt`."""
    choices = []
    for round_ in range(rounds):
        k = policy.choose()
        choices.append(k)
        accepted = round(alpha * k)
        record = RoundRecord(
            k, accepted, accepted + int(accepted < k), (DRAFT_STEP + processing) * k,
            PLAIN_STEP + (k + 1) * processing, prefill=prompt and round_ == 0, draft_processing_seconds=processing * k,
            verify_processing_seconds=(k + 1) * processing,
        )  # fmt: skip
        policy.observe(record)
    return choices


def test_costly_processors_lower_k():
    """A good cheap draft drafts far without processors; processors at 5%, 25% and half of a plain step per position
    lower K, each more, and drafting still pays at half a step."""
    mean_k = {
        processing: sum(feed_processed(AdaptiveLookahead(), 40, 0.9, processing)[10:]) / 30
        for processing in (0.0, 0.01, 0.05, 0.1)
    }
    assert mean_k[0.0] > mean_k[0.01] > mean_k[0.05] > mean_k[0.1] >= 1


@pytest.mark.parametrize("processors_unknown", [False, True], ids=["known", "unknown"])
def test_processors_costing_a_plain_step_stop_drafting_without_probes(processors_unknown):
    """At a plain step's cost per position or more no draft pays, however good: processors of unknown cost are timed
    in a first round that drafts nothing, and drafting never starts; known ones (timed all the same in a greedy
    call) stop it after the first round."""
    policy = AdaptiveLookahead(draft_step_seconds=DRAFT_STEP, processors_unknown=processors_unknown)
    choices = feed_processed(policy, 100, alpha=1.0, processing=1.1 * PLAIN_STEP)
    assert policy.costs.processing_outweighs_step
    assert sum(choices) == (0 if processors_unknown else 2)  # the first round's K = 2, blind, then none: no probes


def test_free_processors_change_nothing():
    """With processing free, the decomposed costs are the old ones: the same K's round for round as the rounds
    timed without any processing apart, and as processors costing a microsecond a position."""
    free = feed_processed(AdaptiveLookahead(), 60, 0.7, 0.0, prompt=False)
    assert free == feed(AdaptiveLookahead(), 60, 0.7, DRAFT_STEP, lambda k: PLAIN_STEP)
    assert feed_processed(AdaptiveLookahead(), 60, 0.7, 1e-6, prompt=False) == free


def test_the_costs_add_the_processing_per_position():
    """v(K) is the rest of the round and p per verified position; d a draft forward and its position's processing,
    which before any round drafted is the verified positions' p."""
    policy = AdaptiveLookahead(draft_step_seconds=DRAFT_STEP)
    feed_processed(policy, 3, alpha=0.0, processing=0.01)  # K = 2 blind, then K = 2 measured
    costs = policy.costs
    assert costs.processing.seconds() == pytest.approx(0.01)
    assert costs.verify_seconds(0) == pytest.approx(PLAIN_STEP + 0.01)  # one processed position, not K + 1's
    assert costs.verify_seconds(3) == pytest.approx(PLAIN_STEP + 0.04)
    assert costs.draft_seconds() == pytest.approx(DRAFT_STEP + 0.01)
    primed = AdaptiveLookahead(draft_step_seconds=DRAFT_STEP, processors_unknown=True)
    feed_processed(primed, 1, alpha=0.0, processing=0.01)  # a plain first round: processing timed, no draft yet
    assert primed.costs.draft_seconds() == pytest.approx(DRAFT_STEP + 0.01)
    lookup = make_policy(SpeculativeConfig(), clock_free=False, cost_ratio=0.0, lookup_only=True)
    feed_processed(lookup, 1, alpha=0.0, processing=0.01)
    assert lookup.costs.draft_processing_seconds() == 0.0  # a lookup's drafts are not processed


def test_a_clock_free_policy_reads_the_clock_only_for_the_verdict():
    """A sampling call's K stays clock-free (`StaticCosts`): with processors of unknown cost its first round drafts
    nothing, then the K's are the clock-free ones, whatever cheap processors cost; at a plain step's cost per
    position, less what a draft step and the verification's slope take of it (c = 0.05, 0.02: 0.186 s), it never
    drafts."""
    static = feed_processed(AdaptiveLookahead(costs=StaticCosts(0.05)), 30, 0.8, 0.0)
    shifted = [0] + static[:-1]  # a first round that drafts nothing, then the same K's
    for processing, expected in ((0.0, shifted), (0.02, shifted), (0.18, shifted), (0.19, [0] * 30)):
        costs = StaticCosts(0.05, processing=ProcessingCost())
        policy = AdaptiveLookahead(costs=costs, processors_unknown=True)
        assert policy.needs_timing
        assert feed_processed(policy, 30, 0.8, processing) == expected
    assert not AdaptiveLookahead(costs=StaticCosts(0.05)).needs_timing  # no processing to time: no clock


class SlowProcessor(LogitsProcessor):
    """A user's processor costing `seconds` per call on the fake clock (a grammar engine, say)."""

    def __init__(self, clock: FakeClock, seconds: float):
        self.clock, self.seconds = clock, seconds

    def __call__(self, input_ids, scores):
        self.clock.advance(self.seconds)
        return scores


@pytest.fixture(scope="module")
def pair():
    """A target and a draft of a tenth of its weight bytes (a clock-free policy drafts with it)."""
    return tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64), tiny_lm(seed=1, vocab_size=64, layers=1, hidden=16)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_processor_slower_than_a_step_keeps_the_call_plain(pair, monkeypatch, do_sample):
    """End to end on the fake clock: a processor of 10 ms a call against forwards of a few clock readings keeps
    every round plain (as many processor calls as plain `generate()` makes); the stats report its cost per
    position. Without it the same call drafts (after its first round, with a processor costing nothing)."""
    target, draft = pair
    clock = FakeClock(1e-5)
    monkeypatch.setattr(time, "perf_counter", clock)
    config = SpeculativeConfig(draft_form="as_given")
    kwargs = dict(do_sample=do_sample, max_new_tokens=16, pad_token_id=PAD, return_dict_in_generate=True)
    kwargs |= dict(draft_model=draft, speculative_config=config)
    slow = target.generate(PROMPT, logits_processor=LogitsProcessorList([SlowProcessor(clock, 0.010)]), **kwargs)
    stats = slow.speculative_stats
    assert stats.lookahead_per_round == [0] * 16 and stats.processed_positions == 16
    assert stats.processing_seconds_per_position == pytest.approx(0.010, rel=0.01)
    assert "logits processors 10.0" in str(stats)
    free = target.generate(PROMPT, logits_processor=LogitsProcessorList([SlowProcessor(clock, 0.0)]), **kwargs)
    assert free.speculative_stats.lookahead_per_round[0] == 0 and sum(free.speculative_stats.lookahead_per_round)
    if not do_sample:
        plain = target.generate(PROMPT, do_sample=False, max_new_tokens=16, pad_token_id=PAD)
        assert torch.equal(slow.sequences, plain)


def test_a_seeded_call_never_times_its_processors(pair, monkeypatch):
    """With `generator=` no choice reads the clock: processors of unknown cost are not timed for K, so the first
    round drafts as without them."""
    target, draft = pair
    clock = FakeClock(1e-5)
    monkeypatch.setattr(time, "perf_counter", clock)
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=8, pad_token_id=PAD, draft_model=draft, return_dict_in_generate=True,
        generator=torch.Generator().manual_seed(0), logits_processor=LogitsProcessorList([SlowProcessor(clock, 0.01)]),
    )  # fmt: skip
    assert out.speculative_stats.lookahead_per_round[0] > 0


def test_processors_are_timed_only_where_k_may_read_the_host_clock():
    """Not under `generator=` or tensor parallelism (K never reads the clock), nor on CUDA, whose rounds are timed by
    events a processor's host seconds cannot be set against (one that reads a tensor waits for the forward)."""
    own, cpu, cuda = [SlowProcessor(FakeClock(), 0.0)], torch.device("cpu"), torch.device("cuda")
    assert times_unknown_processors(own, clock_free=False, device=cpu)
    assert not times_unknown_processors(own, clock_free=True, device=cpu)
    assert not times_unknown_processors(own, clock_free=False, device=cuda)
    assert not times_unknown_processors([lp.TemperatureLogitsWarper(0.7)], clock_free=False, device=cpu)
    processor = PositionwiseProcessor(own, batch_size=1)
    assert PhaseTimer(True, cpu, processor).processor is processor
    assert PhaseTimer(True, cuda, processor).processor is None


def test_positionwise_processor_counts_its_seconds_and_positions(monkeypatch):
    """The processors' seconds (from `time.perf_counter`) and positions (rows x positions) per call; nothing is read
    or counted without processors. Processors other than transformers' own listed are of unknown cost."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    tokens, scores = torch.zeros((2, 12), dtype=torch.long), torch.zeros((2, 3, 16))
    processor = PositionwiseProcessor([SlowProcessor(clock, 0.002)], batch_size=2)
    processor(tokens, [5, 6], scores)
    assert processor.positions == 6 and processor.seconds == pytest.approx(4 * 0.002)  # 4 prefix lengths
    empty = PositionwiseProcessor([], batch_size=2)
    empty(tokens, [5, 6], scores)
    assert empty.positions == 0 and empty.seconds == 0.0 and clock.now == pytest.approx(4 * 0.002)
    known = [
        lp.TemperatureLogitsWarper(0.7),
        lp.RepetitionPenaltyLogitsProcessor(1.2),
        lp.MinLengthLogitsProcessor(3, 2),
    ]
    assert not cost_unknown(known) and cost_unknown(known + [SlowProcessor(clock, 0.0)])
    assert cost_unknown([lp.PrefixConstrainedLogitsProcessor(lambda batch, ids: [1], num_beams=1)])
