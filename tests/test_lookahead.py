"""Choosing K: the adaptive policy's decisions, reproducibility, and exactness when K changes every round."""

import itertools
import random
import statistics

import pytest
import torch
from exact import sampled_pvalue
from tiny import PAD, perturbed_copy, tiny_lm

import hf_specsample.policy.lookahead as lookahead_module
import hf_specsample.policy.round_costs as round_costs
from hf_specsample import SpeculativeConfig
from hf_specsample.policy.lookahead import (
    AdaptiveLookahead,
    FixedLookahead,
    LookaheadPolicy,
    RoundLookahead,
    RoundRecord,
    StaticCosts,
    make_policy,
)
from hf_specsample.policy.round_costs import SETTLED_ROUNDS, MeasuredCosts
from hf_specsample.proposers.base import DraftBudget


def feed(policy: AdaptiveLookahead, rounds: int, alpha: float, draft_step: float, verify) -> list[int]:
    """Run the policy against synthetic rounds: acceptance `alpha`, costs `draft_step` and `verify(K)` seconds."""
    choices = []
    for _ in range(rounds):
        k = policy.choose()
        choices.append(k)
        accepted = round(alpha * k)
        policy.observe(RoundRecord(k, accepted, accepted + int(accepted < k), draft_step * k, verify(k)))
    return choices


def test_good_cheap_draft_drafts_far():
    choices = feed(AdaptiveLookahead(max_lookahead=8), 30, alpha=0.9, draft_step=0.02, verify=lambda k: 0.2)
    assert min(choices[10:]) >= 6


def test_useless_draft_stops_drafting_and_probes():
    policy = AdaptiveLookahead(max_lookahead=8, probe_every=12)
    choices = feed(policy, 60, alpha=0.0, draft_step=0.1, verify=lambda k: 0.2)
    tail = choices[20:]
    assert tail.count(0) >= 0.85 * len(tail)  # mostly plain decoding
    assert 1 in tail  # but keeps checking


def test_useless_draft_costs_few_draft_steps():
    """Every wasted draft step costs c of a token: over 96 tokens a useless draft may cost at most 8 of them.
    (With the earlier first K of 3, a prior worth 4 tested tokens and probes every 12 rounds it cost 13.)"""
    choices = feed(AdaptiveLookahead(), 96, alpha=0.0, draft_step=0.04, verify=lambda k: 0.3 + 0.005 * k)
    assert sum(choices) <= 8


def test_a_draft_no_cheaper_than_a_plain_round_is_never_probed_once_measured():
    """A draft step costing a plain round or more cannot pay even if every token were accepted: once both are
    measured over `SETTLED_ROUNDS` rounds the policy stops probing (a useless draft as large as the target then costs
    nothing more)."""
    policy = AdaptiveLookahead(max_lookahead=8, probe_every=12, draft_step_seconds=0.21)
    choices = feed(policy, 200, alpha=1.0, draft_step=0.21, verify=lambda k: 0.2)
    assert policy.perfect_draft_gain() < 0
    assert choices[0] == 2  # drafted before any cost was known
    probes = [i for i, k in enumerate(choices[1:], start=1) if k]
    assert [choices[i] for i in probes] == [1] * (SETTLED_ROUNDS - 1)  # then never again (else at 84 and 180 too)


def test_a_draft_reading_the_targets_bytes_does_not_draft_before_its_costs_are_known():
    """With weights at least the target's (c >= 1), the first rounds decode plainly; probes then measure the draft
    step, and a costly one is not probed again once `SETTLED_ROUNDS` rounds measured it."""
    untimed = AdaptiveLookahead(max_lookahead=8, probe_every=12, draft_cost_ratio=1.0)
    choices = feed(untimed, 200, alpha=0.9, draft_step=0.25, verify=lambda k: 0.2)
    assert choices[:11] == [0] * 11 and choices.count(1) == SETTLED_ROUNDS and sum(choices) == SETTLED_ROUNDS
    timed = AdaptiveLookahead(max_lookahead=8, probe_every=12, draft_cost_ratio=1.0, draft_step_seconds=0.25)
    assert sum(feed(timed, 200, alpha=0.9, draft_step=0.25, verify=lambda k: 0.2)) == SETTLED_ROUNDS
    # a cheap draft in fact (weights overstate a mixture of experts' step): the probe finds it and drafting starts
    moe = AdaptiveLookahead(max_lookahead=8, probe_every=12, draft_cost_ratio=3.0)
    assert min(feed(moe, 60, alpha=0.9, draft_step=0.02, verify=lambda k: 0.2)[30:]) >= 4


def stalled_first_round():
    """A good cheap draft (timed at 30 ms before the call) whose first timed round stalls: draft steps at 30 times
    their cost once (a first call's lazy set-up, another process), then as timed. The K's of 60 rounds."""
    policy = AdaptiveLookahead(max_lookahead=8, probe_every=12, draft_step_seconds=0.03)
    policy.costs.observe(RoundRecord(2, 2, 2, 2 * 0.9, 0.2))  # the stalled round
    return feed(policy, 60, alpha=0.9, draft_step=0.03, verify=lambda k: 0.2)


def test_a_round_without_a_valid_duration_teaches_nothing():
    costs = AdaptiveLookahead().costs
    costs.observe(RoundRecord(2, 2, 2, 0.02, 0.2))
    costs.observe(RoundRecord(4, 4, 4, 0.04, 0.3))
    before = (costs.draft_seconds(), [costs.verify_seconds(k) for k in range(6)])
    for draft, verify in ((float("nan"), 0.2), (0.02, float("nan")), (-1.0, 0.2), (0.02, float("inf"))):
        costs.observe(RoundRecord(3, 3, 3, draft, verify))
    assert (costs.draft_seconds(), [costs.verify_seconds(k) for k in range(6)]) == before


def test_one_stalled_round_does_not_stop_drafting(monkeypatch):
    """Each round's cost counts as at most `OUTLIER` times the estimate, and giving drafting up for good needs costs
    measured over `SETTLED_ROUNDS` rounds. The power check: with neither, the stalled round ends drafting for the
    call."""
    assert min(stalled_first_round()[10:]) >= 5  # as far as `test_good_cheap_draft_drafts_far`'s draft
    monkeypatch.setattr(round_costs, "OUTLIER", float("inf"))
    monkeypatch.setattr(round_costs, "SETTLED_ROUNDS", 1)
    assert sum(stalled_first_round()) == 0


def test_probes_are_rarer_where_a_perfect_draft_would_gain_little():
    """A draft step at 0.9 of a plain round can gain at most ~10%: probes come several times rarer than for a cheap
    draft, whose perfect gain is large."""
    probes = {}
    for draft_step in (0.02, 0.18):
        choices = feed(AdaptiveLookahead(probe_every=12), 400, alpha=0.0, draft_step=draft_step, verify=lambda k: 0.2)
        probes[draft_step] = choices[5:].count(1)
    assert 0 < probes[0.18] * 2 < probes[0.02]


def test_probes_back_off_while_drafting_does_not_pay():
    policy = AdaptiveLookahead(max_lookahead=8, probe_every=12)
    choices = feed(policy, 400, alpha=0.0, draft_step=0.1, verify=lambda k: 0.2)
    probes = [i for i, k in enumerate(choices) if k == 1 and i > 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] < gaps[-1] <= 8 * 12 + 1  # intervals grow, up to 8x
    assert len(probes) < 400 / 12 / 2


def test_verification_cost_growing_with_k_shortens_k():
    flat = feed(AdaptiveLookahead(), 40, alpha=0.85, draft_step=0.05, verify=lambda k: 0.2)
    steep = feed(AdaptiveLookahead(), 40, alpha=0.85, draft_step=0.05, verify=lambda k: 0.2 * (1 + 0.15 * k))
    assert sum(steep[20:]) < sum(flat[20:])


# The target's forward over M = K + 1 positions measured on an AVX2 EPYC (Qwen2.5-Coder-1.5B bf16, seconds), and the
# int8 0.5B draft's step with processing: compiled verification is flat to M = 3, then steep; eager is linear.
COMPILED_CURVE = [0.147, 0.146, 0.162, 0.222, 0.304, 0.38, 0.44, 0.5, 0.56, 0.62, 0.68]
EAGER_CURVE = [0.189, 0.342, 0.491, 0.639, 0.788, 0.94, 1.09, 1.24, 1.38, 1.53, 1.68]


def best_lookahead(alpha: float, draft_step: float, curve: list[float]) -> int:
    rates = [sum(alpha**i for i in range(k + 1)) / (draft_step * k + curve[k]) for k in range(len(curve))]
    return max(range(len(curve)), key=rates.__getitem__)


def test_convex_compiled_costs_settle_on_the_best_k_without_wide_guesses():
    """A line through every observed K put v(0) far below its cost on this curve (the K=5 point pulled it down),
    so the policy stopped drafting though K=2 is 1.5x faster; and after one observation it guessed K=5 cheap. The
    fit turns into a parabola once four widths show the curve: one round of K = 4 (one beyond the widest measured,
    as K always grows) measures it, and K = 2 holds from then on."""
    assert best_lookahead(0.85, 0.045, COMPILED_CURVE) == 2
    choices = feed(AdaptiveLookahead(), 60, alpha=0.85, draft_step=0.045, verify=COMPILED_CURVE.__getitem__)
    assert max(choices) <= 4 and choices.count(4) <= 1  # never a guessed-cheap wide round
    assert choices[10:].count(2) >= 0.9 * len(choices[10:])


class PerWidthMeans(MeasuredCosts):
    """The power check's cost model, the one the fit replaced: each width's own mean where it was measured, the line
    joining the nearest two between them, the nearest segment's slope outside."""

    def verify_seconds(self, lookahead: int) -> float:
        if lookahead in self.verify:
            return self.verify[lookahead].value
        points = sorted((k, mean.value) for k, mean in self.verify.items())
        below = [point for point in points if point[0] < lookahead]
        above = [point for point in points if point[0] > lookahead]
        if below and above:
            (k0, v0), (k1, v1) = below[-1], above[0]
        elif above:
            (k0, v0), (k1, v1) = above[0], above[1] if len(above) > 1 else above[0]
        else:
            (k0, v0), (k1, v1) = below[-2] if len(below) > 1 else below[-1], below[-1]
        slope = max(0.0, (v1 - v0) / (k1 - k0)) if k1 != k0 else 0.0
        return max(1e-9, v0 + slope * (lookahead - k0))


def noisy_rounds(seed: int, costs: type[MeasuredCosts] = MeasuredCosts) -> list[int]:
    """60 rounds of a good cheap draft (alpha 0.95, 40 ms a step) on nearly flat verification (0.2 + 0.005 K
    seconds) whose every round's duration varies by -15% to +25%, as a CPU's do; the K's chosen."""
    rng = random.Random(seed)
    policy = AdaptiveLookahead(max_lookahead=8, draft_step_seconds=0.04)
    policy.costs.__class__ = costs
    choices = []
    for _ in range(60):
        k = policy.choose()
        choices.append(k)
        accepted = 0
        while accepted < k and rng.random() < 0.95:
            accepted += 1
        verify = (0.2 + 0.005 * k) * rng.uniform(0.85, 1.25)
        policy.observe(RoundRecord(k, accepted, accepted + int(accepted < k), 0.04 * k, verify))
    return choices


def test_noisy_round_costs_do_not_hold_k_down():
    """K = 8 is best (`best_lookahead`); each round's v varies by 40%. The fit over every round's (width, v) keeps K
    at 7-8 after 20 rounds whatever the noise drew. The power check: each width's own mean, a width measured once too
    high is not tried again, and several seeds hold K at 4-6 for the rest of the call."""
    assert best_lookahead(0.95, 0.04, [0.2 + 0.005 * k for k in range(9)]) == 8
    assert all(statistics.median(noisy_rounds(seed)[20:]) >= 7 for seed in range(16))
    held = [seed for seed in range(16) if statistics.median(noisy_rounds(seed, PerWidthMeans)[20:]) <= 6]
    assert len(held) >= 4, held


def test_a_cost_step_does_not_stop_drafting_for_good():
    """Verification flat to K = 3, then a step (a kernel's row limit, a compiled shape's bucket): no line fits it, and
    the line's extrapolation put v(0) at nothing; a K = 0 round clipped to `OUTLIER` times that estimate confirmed it,
    plain decoding looked free and drafting stopped for the rest of the call, where K = 3 is 1.7x faster."""
    step = [0.2] * 4 + [0.5] * 5
    assert best_lookahead(0.9, 0.02, step) == 3
    choices = feed(AdaptiveLookahead(max_lookahead=8), 60, alpha=0.9, draft_step=0.02, verify=step.__getitem__)
    assert choices[10:].count(0) == 0, choices


def test_fitted_verification_cost_never_falls_with_more_positions():
    """A parabola through a step (flat at K = 2..4, then K = 5 dear) has its vertex inside: left of it, v(K) is the
    vertex's, not the parabola's rising branch (which put v(0) at 4x its cost and made plain decoding look dear)."""
    costs = MeasuredCosts(0.85)
    for k in (2, 3, 4, 4, 5):
        costs.observe(RoundRecord(k, 0, 1, 0.02 * k, 0.2 if k < 5 else 0.5))
    fitted = [costs.verify_seconds(k) for k in range(9)]
    assert fitted == sorted(fitted) and fitted[0] < 0.25, fitted


def test_linear_eager_costs_stop_drafting_quickly():
    # Eager on the same CPU: every extra position costs ~0.8 of a step, so drafting cannot pay (best K = 0).
    assert best_lookahead(0.9, 0.046, EAGER_CURVE) == 0
    choices = feed(AdaptiveLookahead(), 96, alpha=0.9, draft_step=0.046, verify=EAGER_CURVE.__getitem__)
    assert choices[:4] == [2, 3, 0, 0]  # K=2 measures v(2), K=3 the slope; then plain decoding
    assert sum(choices) <= 12  # then plain decoding, and rare K=1 probes


def test_interpolated_verification_cost():
    policy = AdaptiveLookahead()
    for k in (1, 3):
        policy.observe(RoundRecord(k, 0, 1, draft_seconds=0.01 * k, verify_seconds=0.1 * (k + 1)))
    costs = policy.costs
    assert costs.verify_seconds(1) == pytest.approx(0.2) and costs.verify_seconds(2) == pytest.approx(0.3)
    assert costs.verify_seconds(0) == pytest.approx(0.1)  # below: the nearest segment's slope
    assert costs.verify_seconds(6) == pytest.approx(0.7)  # above: likewise
    assert costs.largest_lookahead(8) == 4 and costs.largest_lookahead(2) == 2


def test_expected_rate_is_theorem_3_8():
    policy = AdaptiveLookahead(costs=StaticCosts(cost_ratio=0.45, verify_slope=0.0))
    policy.alpha.total, policy.alpha.count = 0.8, 1.0  # alpha = 0.8
    for k in range(1, 6):  # Theorem 3.8, up to the plain-decoding rate 1/v(0) = 1
        assert policy.expected_rate(k) == pytest.approx((1 - 0.8 ** (k + 1)) / ((1 - 0.8) * (0.45 * k + 1)))
    assert policy.choose() == max(range(9), key=policy.expected_rate)


def test_expected_tokens_is_one_formula_for_the_policy_the_forms_and_the_report():
    """E(K) (Theorem 3.8) lives in `round_costs.expected_tokens`: the sum 1 + alpha + ... + alpha^K for a whole K,
    the closed form for a mean K between whole ones, K + 1 at alpha = 1; the policy's rate, AUTO's expected speedup
    and the benchmark report's prediction all read it."""
    from hf_specsample.policy.round_costs import expected_speedup, expected_tokens
    from hf_specsample_bench.report import expected_speedup as predicted_speedup

    for alpha in (0.0, 0.3, 0.8, 0.999999):
        for k in range(6):
            assert expected_tokens(alpha, k) == sum(alpha**i for i in range(k + 1))
            assert expected_tokens(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha), rel=1e-9)
        assert expected_tokens(alpha, 2.5) == pytest.approx((1 - alpha**3.5) / (1 - alpha))
        assert expected_tokens(alpha, 2) <= expected_tokens(alpha, 2.5) <= expected_tokens(alpha, 3)
    assert expected_tokens(1.0, 3) == expected_tokens(1.0, 3.0) == 4 and expected_tokens(1.0, 2.5) == 3.5
    costs = StaticCosts(cost_ratio=0.45)
    policy = AdaptiveLookahead(costs=costs)
    policy.alpha.total, policy.alpha.count = 0.8, 1.0
    assert expected_speedup(0.8, 0.45) == max(policy.expected_rate(k) for k in range(9))
    assert predicted_speedup(0.8, 2.5, 0.45) == expected_tokens(0.8, 2.5) / (2.5 * 0.45 + 1)


def test_static_costs_draft_less_for_large_batches():
    single = make_policy(SpeculativeConfig(), clock_free=True, cost_ratio=0.3, batch_size=1)
    batch = make_policy(SpeculativeConfig(), clock_free=True, cost_ratio=0.3, batch_size=32)
    assert batch.choose() < single.choose()


def test_static_costs_count_a_hybrid_targets_refeeds():
    """A hybrid target's rollback re-feeds (`cache.checkpoints`) cost about a target step each: counted per K from the
    rounds, they make wide rounds dearer, so the policy drafts fewer tokens than for a target without them."""
    plain, hybrid = AdaptiveLookahead(costs=StaticCosts(0.1)), AdaptiveLookahead(costs=StaticCosts(0.1))
    for policy, refeeds in ((plain, 0), (hybrid, 1)):
        for k in (1, 2, 3, 4, 5, 6):  # every K rejected at its second draft; a re-feed per round for the hybrid
            policy.observe(RoundRecord(k, min(k, 1), min(k, 2), 0.0, 0.0, refeed_forwards=refeeds * int(k > 1)))
    assert hybrid.costs.refeed_steps(4) == pytest.approx(1.0) and hybrid.costs.refeed_steps(1) == 0.0
    assert hybrid.costs.refeed_steps(8) == pytest.approx(1.0)  # an unobserved K: the nearest observed one's
    assert plain.costs.refeed_steps(4) == 0.0
    assert hybrid.costs.verify_seconds(4) == pytest.approx(plain.costs.verify_seconds(4) + 1.0)
    assert hybrid.choose() < plain.choose()


def test_static_costs_need_no_clock():
    policy = AdaptiveLookahead(costs=StaticCosts(0.3))
    assert not policy.needs_timing and policy.choose() > 0
    assert not FixedLookahead(3).needs_timing and AdaptiveLookahead().needs_timing


PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def test_default_policy_with_a_generator_is_reproducible(pair):
    target, draft = pair

    def sample():
        return target.generate(
            PROMPT, do_sample=True, max_new_tokens=40, pad_token_id=PAD, draft_model=draft,
            generator=torch.Generator().manual_seed(9), return_dict_in_generate=True,
        )  # fmt: skip

    first, second = sample(), sample()
    assert torch.equal(first.sequences, second.sequences)
    assert first.speculative_stats.lookahead_per_round == second.speculative_stats.lookahead_per_round


class CyclingLookahead(LookaheadPolicy):
    """K = 0, 3, 1, 5, 2, ... : every kind of round, including plain ones, one after another."""

    def __init__(self):
        self.cycle = itertools.cycle([0, 3, 1, 5, 2])

    def choose(self) -> int:
        return next(self.cycle)


def test_greedy_identity_when_k_changes_every_round(pair):
    target, draft = pair
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=40, pad_token_id=PAD)
    config = SpeculativeConfig(lookahead_policy=CyclingLookahead)
    got = target.generate(
        PROMPT, do_sample=False, max_new_tokens=40, pad_token_id=PAD, draft_model=draft, speculative_config=config,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(got.sequences, expected)
    assert 0 in got.speculative_stats.lookahead_per_round


@pytest.mark.parametrize(
    "config", [SpeculativeConfig(lookahead_policy=CyclingLookahead), SpeculativeConfig()], ids=["cycling", "default"]
)
def test_sampling_is_exact_when_k_changes(config):
    target = tiny_lm(seed=0)  # 8-token vocabulary: enumerable
    draft = perturbed_copy(target, seed=1, scale=0.3)
    settings = dict(temperature=0.9, top_p=0.9)
    pvalue = sampled_pvalue(
        target, torch.tensor([[1, 5, 2, 5]]), 4, 10_000, 3, settings, draft_model=draft, speculative_config=config
    )
    assert pvalue > 1e-3


class GreedyForK(LookaheadPolicy):
    """Asks for a huge K every round and counts how often it is asked."""

    def __init__(self, lookahead: int = 1000):
        self.lookahead, self.calls, self.observed = lookahead, 0, 0

    def choose(self) -> int:
        self.calls += 1
        return self.lookahead

    def observe(self, record: RoundRecord) -> None:
        self.observed += 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_a_huge_k_near_max_length_is_capped_and_exact(pair, max_new_tokens):
    """K is capped by the room left before max_length, so the token buffer needs no room for the policy's K."""
    target, draft = pair
    policies = []
    config = SpeculativeConfig(lookahead_policy=lambda: policies.append(GreedyForK()) or policies[-1])
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD)
    got = target.generate(PROMPT, draft_model=draft, speculative_config=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(got.sequences, target.generate(PROMPT, **kwargs))
    assert max(got.speculative_stats.lookahead_per_round) <= max_new_tokens - 1


def test_choose_is_called_once_per_round(pair):
    target, draft = pair
    policies = []
    config = SpeculativeConfig(lookahead_policy=lambda: policies.append(GreedyForK(3)) or policies[-1])
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=30, pad_token_id=PAD, draft_model=draft, speculative_config=config,
        return_dict_in_generate=True,
    )  # fmt: skip
    (policy,) = policies
    assert policy.calls == policy.observed == out.speculative_stats.rounds > 1


def test_one_owner_caps_k_and_sets_the_lookup_width():
    """`RoundLookahead` asks the policy once per round and caps its K by the room left; it alone widens lookup
    rounds (max(K, N) with a model draft) and keeps the first round of a prompt ending in padding plain."""
    policy = GreedyForK(5)
    lookahead = RoundLookahead(policy, max_length=20, lookup_tokens=8)
    assert lookahead.budget([10, 12]) == DraftBudget(lookahead=5, lookup_lookahead=7)  # room: 20 - 12 - 1 = 7
    assert lookahead.budget([16]) == DraftBudget(lookahead=3, lookup_lookahead=3)
    assert policy.calls == 2
    assert RoundLookahead(GreedyForK(5), max_length=20).budget([4]) == DraftBudget(lookahead=5, lookup_lookahead=0)

    padded = RoundLookahead(GreedyForK(5), max_length=20, prompt_ends_in_padding=True, lookup_tokens=8)
    assert padded.budget([4]) == DraftBudget(lookahead=0, lookup_lookahead=0) and padded.policy.calls == 0
    assert padded.budget([5]) == DraftBudget(lookahead=5, lookup_lookahead=8) and padded.policy.calls == 1

    lookahead.observe(RoundRecord(4, 2, 3, 0.0, 0.1), model_steps=0)  # a lookup round of a model draft
    lookahead.observe(RoundRecord(2, 1, 2, 0.1, 0.1), model_steps=2)
    lookahead.observe(RoundRecord(0, 0, 0, 0.0, 0.1), model_steps=0)  # a plain step teaches the policy too
    assert policy.observed == 2


def test_lookup_alone_adapts_k_up_to_n_through_the_same_factory():
    alone = RoundLookahead.for_call(
        SpeculativeConfig(), clock_free=True, batch_size=1, max_length=100, prompt_ends_in_padding=False,
        lookup_tokens=12, lookup_only=True,
    )  # fmt: skip
    assert alone.policy.max_lookahead == 12
    budget = alone.budget([10])
    assert budget.lookahead == budget.lookup_lookahead and 0 < budget.lookup_lookahead <= 12
    tested = alone.policy.alpha.count
    alone.observe(RoundRecord(budget.lookup_lookahead, 1, 2, 0.0, 0.1), model_steps=0)  # lookup rounds are its rounds
    assert alone.policy.alpha.count > tested
    fixed = RoundLookahead.for_call(
        SpeculativeConfig(num_lookahead=3), clock_free=False, batch_size=1, max_length=100,
        prompt_ends_in_padding=False, lookup_tokens=None, lookup_only=True,
    )  # fmt: skip
    assert fixed.budget([10]) == DraftBudget(lookahead=3, lookup_lookahead=3, nodes=15) and not fixed.needs_timing


def test_lookup_alone_starts_at_four_and_doubles_its_widest_k():
    """Drafting by lookup costs nothing per token: a good copy reaches N in three rounds, not eight (+1 per round)."""
    alone = RoundLookahead.for_call(
        SpeculativeConfig(), clock_free=False, batch_size=1, max_length=1000, prompt_ends_in_padding=False,
        lookup_tokens=10, lookup_only=True,
    )  # fmt: skip
    widths = []
    for round_ in range(6):
        k = alone.budget([10]).lookup_lookahead
        widths.append(k)
        record = RoundRecord(k, k, k, 0.0, 0.15 + 0.001 * k, prefill=round_ == 0)  # all accepted, flat costs
        alone.observe(record, model_steps=0)
    assert widths[:2] == [4, 4] and widths[2] == 8 and widths[3:] == [10, 10, 10]
    # a model draft keeps the one-step growth: each extra token costs a draft step for sure
    model = AdaptiveLookahead(max_lookahead=10)
    for k in (2, 2):
        model.observe(RoundRecord(k, k, k, 0.01 * k, 0.15))
    assert model.costs.largest_lookahead(10) == 3


def test_measured_costs_growth():
    costs = AdaptiveLookahead(growth=2.0).costs
    costs.observe(RoundRecord(3, 0, 1, 0.03, 0.2))
    assert costs.largest_lookahead(16) == 6 and costs.largest_lookahead(5) == 5
    with pytest.raises(ValueError, match="growth must be at least 1"):
        AdaptiveLookahead(growth=0.5)


def test_a_measured_draft_step_is_the_starting_estimate_of_the_draft_cost():
    blind, primed = AdaptiveLookahead(), AdaptiveLookahead(draft_step_seconds=0.05)
    assert primed.costs.draft_seconds() == 0.05 and not primed.costs.ready  # v(K) is not known yet
    assert blind.choose() == primed.choose() == 2
    record = RoundRecord(2, 1, 2, draft_seconds=0.02, verify_seconds=0.2)
    for policy in (blind, primed):
        policy.observe(record)
    assert blind.costs.draft_seconds() == pytest.approx(0.01)
    assert primed.costs.draft_seconds() == pytest.approx((0.85 * 0.05 + 0.02) / (0.85 + 2))  # one step, fading
    plain = AdaptiveLookahead(draft_step_seconds=0.05)
    plain.observe(RoundRecord(0, 0, 0, draft_seconds=0.0, verify_seconds=0.2))  # a plain step measures v alone
    assert plain.costs.ready and not AdaptiveLookahead().costs.ready


@pytest.mark.parametrize("quantization, expected", [("auto", 0.001), ("as_given", None)])
def test_the_drafts_timed_step_reaches_the_policy(pair, int8_steps_faster, monkeypatch, quantization, expected):
    """Where `draft_form="auto"` timed the draft's forms, the running form's step time is the policy's
    starting draft cost (the fixture's timing: int8 1 ms, as given 2 ms); a draft run as given is not timed."""
    target, _ = pair
    draft = perturbed_copy(target, seed=2, scale=0.1)  # not in the implicit cache of drafts prepared before
    priors = []
    real = lookahead_module.make_policy

    def recording(*args, **kwargs):
        priors.append(kwargs.get("draft_step_seconds"))
        return real(*args, **kwargs)

    monkeypatch.setattr(lookahead_module, "make_policy", recording)
    config = SpeculativeConfig(draft_form=quantization)
    target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model=draft, speculative_config=config)
    assert priors == [expected]


def test_a_launch_bound_gpu_costs_a_draft_step_by_its_layers():
    """Eager steps on a GPU cost about their layers' kernel launches, not their bytes: a narrow draft of 2 layers
    against a wide target of 4 costs half a target step there (its bytes say far less), and where no GPU bounds
    the steps by launches, the bytes decide; at half a step a sampling call at acceptance 0.8 gains little."""
    draft, target = tiny_lm(seed=0, layers=2, hidden=16), tiny_lm(seed=1, layers=4, hidden=64)
    by_bytes = round_costs.weight_bytes_ratio(draft, target)
    assert by_bytes < 0.2
    assert round_costs.step_cost_ratio(draft, target, launch_bound=False) == by_bytes
    assert round_costs.step_cost_ratio(draft, target, launch_bound=True) == 0.5
    wide_draft = round_costs.step_cost_ratio(target, draft, launch_bound=True)
    assert wide_draft == round_costs.weight_bytes_ratio(target, draft), "the larger of the two ratios"
    assert round_costs.expected_speedup(0.8, 0.5) < 1.2 < round_costs.expected_speedup(0.8, by_bytes)
