"""Choosing K, the draft tokens per round.

`AdaptiveLookahead` (the default) picks K before every round by Leviathan et al.'s Theorem 3.8, from estimates it
keeps up to date while generating:

- alpha, the probability that a tested draft token is accepted (decayed counts of accepted / tested tokens);
- d, the cost of one draft step (seconds per drafted token), starting from the draft's step time measured before
  the call where `draft_quantization="auto"` timed it (`MeasuredCosts`' prior);
- v(K), the cost of everything else in a round that verifies K draft tokens: the target forward over K+1
  positions, logits processing, acceptance and bookkeeping, and for a hybrid target the forwards that restore its
  recurrent states after a rejection (`cache.checkpoints`: timed as part of the round, or counted by
  `StaticCosts`). It grows with K where verification is compute-bound
  (large batches, bitsandbytes 4-bit, eager bf16 on AVX2 CPUs), often convexly (compiled: flat up to a few
  positions, then steep), so it is kept per K observed and interpolated between them; K grows by at most one
  beyond the largest K observed (prompt lookup, whose drafting costs nothing: starts at 4 and may double it).

A round with K draft tokens yields E(K) = 1 + alpha + ... + alpha^K tokens per row in d K + v(K) seconds; the
policy takes the K in 0..max_lookahead with the highest E(K) / (d K + v(K)). With `StaticCosts` (used when a
`generator=` is given, and always under tensor parallelism) d and v come from the models' weight sizes instead of
the clock (`weight_bytes_ratio`: decoding a token reads every weight once), so the sequence of K's, and with it
every sample, is reproducible. K = 0 is plain decoding: when
drafting does not pay (a useless draft), the policy stops drafting and probes with K = 1 now and then to notice if
it starts paying, unless not even a draft accepted every time could pay at the measured costs (a draft step costing
about a plain round or more: a draft as large as the target, or a small one on a launch-bound GPU), where it stops
probing too; and a draft reading at least the target's weight bytes per step does not draft in the first rounds
either. Choosing K from past rounds never biases the output: each round is exact for any K.

`RoundLookahead` is the one owner of K in a call: built once (`RoundLookahead.for_call`, the only place a policy is
made for `generate()`), it asks the policy before every round and caps its choice (room left before `max_length`,
the first round of a prompt ending in padding, the width of a lookup round), handing the drafter `RoundWidths`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import PreTrainedModel

from .kernels.quantized_linear import Int4Linear, Int8Linear
from .options import DEFAULT_MAX_LOOKAHEAD

if TYPE_CHECKING:
    from .options import SpeculativeConfig

LOOKUP_FIRST_LOOKAHEAD = 4  # prompt lookup's K before its costs are measured (a model draft's: 2)
DEFAULT_LOOKUP_TOKENS = 10  # tokens per lookup round for draft_model="prompt_lookup" without prompt_lookup_num_tokens
# Clock-free verification cost per extra draft token and row, relative to a one-token target step: verifying
# K+1 positions of one row is nearly free while decoding is memory-bound (bf16 1.5B on CPU: 5 tokens ~ 1 token),
# but a batch verifies batch * (K+1) tokens and turns compute-bound.
STATIC_VERIFY_SLOPE = 0.02
# Probes are spaced by `probe_every` (doubling while they fail) times max(1, PROBE_GAIN / g), where g is what a draft
# accepted every time would gain over plain decoding at the measured costs (`AdaptiveLookahead.perfect_draft_gain`).
PROBE_GAIN = 0.25


@dataclass(frozen=True)
class RoundRecord:
    """What one round cost and yielded, summed over the batch's rows."""

    lookahead: int
    accepted: int  # draft tokens accepted, all rows
    tested: int  # draft tokens tested: accepted + one per row that saw a rejection
    draft_seconds: float
    verify_seconds: float  # everything in the round but drafting (a hybrid target's re-feeds after a rejection too)
    prefill: bool = False  # the first round also encodes the prompt: its costs say nothing about later rounds
    refeed_forwards: int = 0  # target forwards that re-fed kept positions to restore recurrent states (hybrids)


class LookaheadPolicy(ABC):
    """Decides K before each round and learns from each round's record."""

    @abstractmethod
    def choose(self) -> int:
        """K for the next round; called exactly once before each round. Any K >= 0 is allowed: the caller caps it
        by the room left before `max_length`."""

    def observe(self, record: RoundRecord) -> None:  # noqa: B027 (optional hook)
        """Learn from a finished round."""

    @property
    def needs_timing(self) -> bool:
        """Whether `observe` uses the round's wall-clock durations (on CUDA, timing costs a sync per phase)."""
        return True


class FixedLookahead(LookaheadPolicy):
    """Always the same K (`num_lookahead=K`)."""

    def __init__(self, lookahead: int):
        self.lookahead = lookahead

    def choose(self) -> int:
        return self.lookahead

    @property
    def needs_timing(self) -> bool:
        return False


class _DecayedMean:
    """Exponentially decayed mean: recent rounds count most; `weight` is the prior's weight in observations."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.total, self.count, self.decay = prior * weight, weight, decay

    def add(self, value: float, count: float = 1.0) -> None:
        self.total = self.decay * self.total + value
        self.count = self.decay * self.count + count

    @property
    def value(self) -> float:
        return self.total / self.count


class MeasuredCosts:
    """Round costs from the wall clock: d per draft step, and v(K) as a line through the K's observed.

    Args:
        decay: per round, how much earlier observations still count.
        growth: how far K may go beyond the largest K observed: to ``max(largest + 1, growth * largest)``. 1 (a
            model draft): one more, since each extra draft step costs d for sure and v's line is a guess. 2 (prompt
            lookup): doubling, since an unobserved width then risks only the verification's slope and an n-gram
            continuation is either copied whole or rejected early (the +1 ramp took 8 of a code edit's 25 rounds to
            reach the 10 tokens transformers' lookup proposes from its first round).
        draft_step_prior: seconds of one draft step measured before the call (`PreparedDraft.step_seconds`, where
            `draft_quantization="auto"` timed the draft's forms), the starting estimate of d; it counts as one
            drafted token (a bare single-row forward, without the processing and sampling a round adds) and fades
            with `decay`. None: d is unknown until a round drafts.
    """

    def __init__(self, decay: float, draft_step_prior: float | None = None, growth: float = 1.0):
        if growth < 1:
            raise ValueError(f"growth must be at least 1, got {growth}.")
        self.decay, self.growth = decay, growth
        prior_weight = 0.0 if draft_step_prior is None else 1.0
        self.draft_step = _DecayedMean(draft_step_prior or 0.0, weight=prior_weight, decay=decay)
        self.verify: dict[int, _DecayedMean] = {}  # K -> decayed mean of v(K)

    @property
    def ready(self) -> bool:
        return bool(self.verify) and self.draft_step.count > 0

    @property
    def knows_plain_step(self) -> bool:
        """Whether a draft step and a round without drafts (v(0)) have both been measured."""
        return 0 in self.verify and self.draft_step.count > 0

    def observe(self, record: RoundRecord) -> None:
        if record.prefill:
            return
        if record.lookahead > 0:
            self.draft_step.add(record.draft_seconds, record.lookahead)
        self.verify.setdefault(record.lookahead, _DecayedMean(0.0, 0.0, self.decay)).add(record.verify_seconds)

    def draft_seconds(self) -> float:
        return self.draft_step.value

    def verify_seconds(self, lookahead: int) -> float:
        """v(K): the decayed mean where K was observed; between observed K's, the straight line joining the nearest
        two; outside them, the slope of the nearest segment (flat with a single K observed).

        Not one line through every K: verification cost is convex where it turns compute-bound (compiled on an
        AVX2 CPU: 146, 162, 222, 304 ms for K = 1..4), and a line through such points puts v(0) below the real cost
        and makes drafting look dear.
        """
        if lookahead in self.verify:
            return max(1e-9, self.verify[lookahead].value)
        points = sorted((k, mean.value) for k, mean in self.verify.items())
        below = [point for point in points if point[0] < lookahead]
        above = [point for point in points if point[0] > lookahead]
        if below and above:
            (k0, v0), (k1, v1) = below[-1], above[0]
        elif above:  # below every K observed
            (k0, v0), (k1, v1) = above[0], above[1] if len(above) > 1 else above[0]
        else:  # above every K observed
            (k0, v0), (k1, v1) = below[-2] if len(below) > 1 else below[-1], below[-1]
        slope = max(0.0, (v1 - v0) / (k1 - k0)) if k1 != k0 else 0.0
        return max(1e-9, v0 + slope * (lookahead - k0))

    def largest_lookahead(self, max_lookahead: int) -> int:
        """The largest K worth trying now: one beyond the largest K observed, or `growth` times it (its cost is a
        guess until then)."""
        largest = max(self.verify, default=0)
        return min(max_lookahead, max(largest + 1, math.ceil(self.growth * largest)))


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes of weights a decoding step reads: every parameter and int8-packed linear, except the input embedding
    (a step reads one row of it) unless it is tied to the LM head."""
    embedding = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    skipped = {id(embedding)} if head is not embedding else set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            # One byte per int8 weight. Not `module.weight().numel()`: that unpacks the weight (~15 ms a layer).
            total += module.in_features * module.out_features
        if isinstance(module, (Int8Linear, Int4Linear)):  # their weights are buffers: values and scales
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
        total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if id(p) not in skipped)
    return total


def expected_speedup(alpha: float, cost_ratio: float, max_lookahead: int = DEFAULT_MAX_LOOKAHEAD) -> float:
    """Leviathan et al.'s Theorem 3.8 at the best K: tokens per unit of time over plain decoding's, for a draft
    accepted at rate `alpha` whose step costs `cost_ratio` target steps (verification as `StaticCosts` models it).
    1.0 where drafting does not pay (K = 0)."""
    costs = StaticCosts(cost_ratio)

    def rate(lookahead: int) -> float:
        tokens = sum(alpha**i for i in range(lookahead + 1))
        return tokens / (costs.draft_seconds() * lookahead + costs.verify_seconds(lookahead))

    return max(rate(lookahead) for lookahead in range(max_lookahead + 1))


def weight_bytes_ratio(draft: PreTrainedModel, target: PreTrainedModel) -> float:
    """Draft over target weight bytes per step: a clock-free estimate of c for memory-bound decoding."""
    return weight_bytes(draft) / max(1, weight_bytes(target))


class StaticCosts:
    """Costs in units of one target step, without a clock: d = c, v(K) = 1 + slope K + r(K), where r(K) is the
    number of forwards a hybrid target re-feeds per round to restore its recurrent states after rejections
    (`cache.checkpoints`; each costs about one target step: it reads every weight once), counted from the rounds
    themselves: a decayed mean per K observed, the nearest K's for others, 0 before any round and for models
    without recurrent states. The choice of K then depends only on the tokens drawn: runs with the same generator
    repeat exactly, and tensor-parallel ranks agree.

    Args:
        cost_ratio: c, the draft step's cost in target steps (`weight_bytes_ratio`).
        verify_slope: v(K)'s growth per draft token (`STATIC_VERIFY_SLOPE` per row verified together).
        decay: per round, how much earlier re-feed counts still count.
    """

    ready = True
    knows_plain_step = True

    def __init__(self, cost_ratio: float, verify_slope: float = STATIC_VERIFY_SLOPE, decay: float = 0.85):
        self.cost_ratio, self.verify_slope, self.decay = cost_ratio, verify_slope, decay
        self.refeeds: dict[int, _DecayedMean] = {}  # K -> decayed mean of re-feed forwards per round

    def observe(self, record: RoundRecord) -> None:
        if record.lookahead > 0 and not record.prefill:
            mean = self.refeeds.setdefault(record.lookahead, _DecayedMean(0.0, 0.0, self.decay))
            mean.add(record.refeed_forwards)

    def draft_seconds(self) -> float:
        return self.cost_ratio

    def verify_seconds(self, lookahead: int) -> float:
        return 1.0 + self.verify_slope * lookahead + self.refeed_steps(lookahead)

    def refeed_steps(self, lookahead: int) -> float:
        """r(K): re-feed forwards per round with K drafts (see the class doc)."""
        if lookahead == 0 or not self.refeeds:
            return 0.0
        nearest = min(self.refeeds, key=lambda observed: (abs(observed - lookahead), observed))
        return self.refeeds[nearest].value

    def largest_lookahead(self, max_lookahead: int) -> int:
        """Every K up to `max_lookahead` (the costs are fixed in advance, none is a guess)."""
        return max_lookahead


class AdaptiveLookahead(LookaheadPolicy):
    """Theorem 3.8 with an online estimate of alpha and a cost model (see the module docstring)."""

    def __init__(
        self,
        max_lookahead: int = DEFAULT_MAX_LOOKAHEAD,  # caps K
        costs: MeasuredCosts | StaticCosts | None = None,  # default: measured on the wall clock
        first_lookahead: int = 2,  # K while no cost is known yet (the first two rounds)
        alpha_prior: float = 0.6,  # until a few tokens are tested; a fair draft of the same family
        alpha_prior_weight: float = 2.0,  # the prior counts as this many tested tokens: a useless draft is found
        # out after about three rejections, a good one is not abandoned after one unlucky round
        probe_every: int = 16,  # when not drafting, a K=1 round this often re-measures alpha (~2% cost at c=0.3);
        # the interval doubles (up to 8x) while probes keep confirming that drafting does not pay
        decay: float = 0.85,  # per round: estimates follow the last ~7 rounds (prompts change character)
        draft_step_seconds: float | None = None,  # a draft step timed before the call: the measured costs' prior
        growth: float = 1.0,  # how fast K may exceed the K's observed (`MeasuredCosts`' growth)
        # draft/target weight bytes per step (`weight_bytes_ratio`): until costs are measured, a draft reading at
        # least the target's bytes per step (c >= 1) cannot pay even if every token were accepted, so the first
        # rounds decode plainly instead of drafting first_lookahead tokens; None: unknown
        draft_cost_ratio: float | None = None,
    ):
        self.max_lookahead = max_lookahead
        self.costs = costs if costs is not None else MeasuredCosts(decay, draft_step_seconds, growth)
        self.first_lookahead = min(first_lookahead, max_lookahead)
        self.draft_cost_ratio = draft_cost_ratio
        self.probe_every = probe_every
        self.alpha = _DecayedMean(alpha_prior, weight=alpha_prior_weight, decay=decay)
        self._rounds_without_drafting = 0
        self._probe_interval = probe_every
        self._probed = False

    @property
    def needs_timing(self) -> bool:
        return isinstance(self.costs, MeasuredCosts)

    def observe(self, record: RoundRecord) -> None:
        if record.tested:
            self.alpha.add(record.accepted, record.tested)
        self.costs.observe(record)

    def expected_rate(self, lookahead: int) -> float:
        """Expected tokens per second per row with K = lookahead: E(K) / (d K + v(K))."""
        alpha = self.alpha.value
        tokens = sum(alpha**i for i in range(lookahead + 1))
        return tokens / (self.costs.draft_seconds() * lookahead + self.costs.verify_seconds(lookahead))

    def perfect_draft_gain(self) -> float:
        """How much faster than plain decoding a draft whose every token were accepted would be at the costs known
        now: the best (K + 1) v(0) / (d K + v(K)) over K >= 1, minus 1. Infinite until a draft step and a plain
        round are both measured (only drafting tells then); 0 or less where a draft step costs about a plain round
        or more (a draft as large as the target; a small one on a launch-bound GPU)."""
        if not self.costs.knows_plain_step:
            return math.inf
        plain, draft = self.costs.verify_seconds(0), self.costs.draft_seconds()
        best = max(
            (lookahead + 1) * plain / (draft * lookahead + self.costs.verify_seconds(lookahead))
            for lookahead in range(1, self.max_lookahead + 1)
        )
        return best - 1.0

    def choose(self) -> int:
        if self.costs.ready:
            # K grows by at most one beyond the K's observed: a line extrapolated from few rounds is a guess, and a
            # guessed-cheap wide round (compute-bound verification) costs a lot and tells little about alpha.
            choice = max(range(self.costs.largest_lookahead(self.max_lookahead) + 1), key=self.expected_rate)
        elif self.draft_cost_ratio is None or self.draft_cost_ratio < 1:
            return self.first_lookahead  # nothing measured yet: drafting measures the costs
        else:
            choice = 0  # a draft step reads the target's bytes or more: plain rounds until a probe measures it
        if choice > 0:
            self._rounds_without_drafting, self._probe_interval = 0, self.probe_every
            return choice
        gain = self.perfect_draft_gain()
        if gain <= 0:
            return 0  # not even a perfect draft would pay at these costs: no probes either
        if self._rounds_without_drafting == 0 and self._probed:  # the last probe did not make drafting pay
            self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)
        self._probed = False
        self._rounds_without_drafting += 1
        # A probe costs a draft forward or two (the draft catches up with the rounds it skipped) to find a gain of at
        # most `gain`: the smaller that gain, the rarer the probes (a draft costing 0.9 of a plain round can gain
        # 10% at best: a probe every ~40 rounds instead of 16).
        interval = self._probe_interval * max(1.0, PROBE_GAIN / gain)
        if self._rounds_without_drafting >= interval:  # is drafting paying again?
            self._rounds_without_drafting, self._probed = 0, True
            return 1
        return 0


class RoundWidths(NamedTuple):
    """How many tokens a round may draft, decided by `RoundLookahead` alone; each drafter reads its own field.

    Attributes:
        model: K, the tokens a draft model drafts (the policy's choice, capped by the room left).
        lookup: the most tokens an n-gram lookup may propose in this round: K when drafting by lookup alone,
            ``max(K, N)`` (capped by the room left) with a model draft and `prompt_lookup_num_tokens=N`, else 0.
    """

    model: int
    lookup: int


def most_draft_tokens(config: SpeculativeConfig, lookup_tokens: int | None, lookup_only: bool) -> int:
    """The most draft tokens a round of this call verifies under the built-in policies (a custom `lookahead_policy`
    may ask for more): with lookup alone, N (`prompt_lookup_num_tokens`, else `num_lookahead`, else
    `DEFAULT_LOOKUP_TOKENS`) or a larger `num_lookahead`; with a model draft, the largest of `max_lookahead`,
    `num_lookahead` and N."""
    if lookup_only:
        return max(lookup_tokens or config.num_lookahead or DEFAULT_LOOKUP_TOKENS, config.num_lookahead or 0)
    return max(config.max_lookahead, config.num_lookahead or 0, lookup_tokens or 0)


class RoundLookahead:
    """The one owner of K in a `generate()` call: the policy's choice in, the round's capped widths out.

    `widths` is called once before every round and asks the policy once (`LookaheadPolicy.choose`), except in a
    first round whose prompt ends in padding, which drafts nothing. Its choice is then capped:

    - room: a row never holds more than `max_length` tokens, so a round drafts at most ``max_length - longest row -
      1`` tokens (the recovered/bonus token takes the last place); the token buffer then needs `max_length + 1`
      columns whatever K a policy asks for;
    - first round: where the prompt ends in padding in some row (right padding), the logits of that padding
      position can come from an attention row with every key masked (a sliding window over padding), which
      eager/SDPA attention fills by averaging over every key of the forward, so the target's first forward must
      cover exactly the prompt, as plain decoding's does;
    - lookup width: drafting by lookup alone, the policy's K (its `max_lookahead` widened to N at construction);
      with a model draft and N, a round one row drafts by lookup alone may be ``max(K, N)`` wide.

    `observe` passes each round's record to the policy, except a lookup round of a model draft, which says nothing
    about the model's acceptance or cost.
    """

    def __init__(
        self,
        policy: LookaheadPolicy,
        max_length: int,
        prompt_ends_in_padding: bool = False,
        lookup_tokens: int | None = None,
        lookup_only: bool = False,
    ):
        """
        Args:
            policy: chooses K (a fresh one per call).
            max_length: `generate()`'s max_length.
            prompt_ends_in_padding: some row's prompt ends in padding: the first round drafts nothing.
            lookup_tokens: N (`prompt_lookup_num_tokens`) with a model draft: the width of a lookup round; None: no
                lookup.
            lookup_only: drafting by lookup alone (`draft_model="prompt_lookup"`): lookup rounds are K wide.
        """
        self.policy, self.max_length = policy, max_length
        self.prompt_ends_in_padding = prompt_ends_in_padding
        self.lookup_tokens, self.lookup_only = lookup_tokens, lookup_only
        self._first_round = True

    @classmethod
    def for_call(
        cls,
        config: SpeculativeConfig,
        *,
        reproducible: bool,
        batch_size: int,
        max_length: int,
        prompt_ends_in_padding: bool,
        lookup_tokens: int | None,
        lookup_only: bool,
        cost_ratio: float = 0.0,
        draft_step_seconds: float | None = None,
    ) -> RoundLookahead:
        """The K owner of one `generate()` call, with a fresh policy (`SpeculativeConfig.make_policy`).

        Args:
            config: the call's options (`num_lookahead`, `max_lookahead`, `lookahead_policy`).
            reproducible: K must not depend on the clock (a generator was given, or tensor-parallel ranks must
                agree).
            batch_size: rows verified together.
            max_length: `generate()`'s max_length.
            prompt_ends_in_padding: some row's prompt ends in padding.
            lookup_tokens: `prompt_lookup_num_tokens` (N), or None.
            lookup_only: no draft model (`draft_model="prompt_lookup"`): K adapts as for a model draft (drafting
                costs only the lookup) up to N (default `DEFAULT_LOOKUP_TOKENS`); `num_lookahead=` fixes it.
            cost_ratio: draft/target cost of a step (`weight_bytes_ratio`); ignored by lookup alone (cost 0).
            draft_step_seconds: the draft's step time measured before the call (`PreparedDraft.
                measured_step_seconds`): the starting estimate of the adaptive policy's draft cost; None: none.
        """
        if lookup_only:
            config = replace(config, max_lookahead=most_draft_tokens(config, lookup_tokens, lookup_only=True))
            policy = config.make_policy(reproducible, cost_ratio=0.0, batch_size=batch_size, lookup_only=True)
            return cls(policy, max_length, prompt_ends_in_padding, lookup_only=True)
        policy = config.make_policy(reproducible, cost_ratio, batch_size, draft_step_seconds=draft_step_seconds)
        return cls(policy, max_length, prompt_ends_in_padding, lookup_tokens)

    @property
    def needs_timing(self) -> bool:
        """Whether the policy learns from wall-clock durations (`LookaheadPolicy.needs_timing`)."""
        return self.policy.needs_timing

    def widths(self, lengths: Sequence[int]) -> RoundWidths:
        """This round's widths; call exactly once before each round.

        Args:
            lengths: per active row, its committed length.
        """
        first_round, self._first_round = self._first_round, False
        if first_round and self.prompt_ends_in_padding:
            return RoundWidths(model=0, lookup=0)
        room = self.max_length - max(lengths) - 1
        lookahead = max(0, min(self.policy.choose(), room))
        if self.lookup_only:
            return RoundWidths(model=lookahead, lookup=lookahead)
        if self.lookup_tokens is None:
            return RoundWidths(model=lookahead, lookup=0)
        return RoundWidths(model=lookahead, lookup=max(0, min(max(lookahead, self.lookup_tokens), room)))

    def observe(self, record: RoundRecord, model_steps: int) -> None:
        """Let the policy learn from a finished round.

        Args:
            record: the round's width (the proposal's), acceptance and durations.
            model_steps: draft-model forwards of the round's proposal (0 and a nonzero width: a lookup round).
        """
        if record.lookahead > 0 and model_steps == 0 and not self.lookup_only:
            return  # a lookup round of a model draft says nothing about the model's acceptance or cost
        self.policy.observe(record)
