"""Choosing K, the draft tokens per round.

`AdaptiveLookahead` (the default) picks K before every round by Leviathan et al.'s Theorem 3.8, from estimates it
keeps up to date while generating:

- alpha, the probability that a tested draft token is accepted (decayed counts of accepted / tested tokens);
- d, the cost of one draft step (seconds per drafted token), starting from the draft's step time measured before
  the call where `draft_form="auto"` timed it (`MeasuredCosts`' prior);
- v(K), the cost of everything else in a round that verifies K draft tokens: the target forward over K+1
  positions, logits processing, acceptance and bookkeeping, and for a hybrid target the forwards that restore its
  recurrent states after a rejection (`cache.checkpoints`: timed as part of the round, or counted by
  `StaticCosts`). It grows with K where verification is compute-bound
  (large batches, bitsandbytes 4-bit, eager bf16 on AVX2 CPUs), often convexly (compiled: flat up to a few
  positions, then steep), so it is fitted to every round's (K, v), recent rounds weighing most: a line, or a
  parabola where the rounds show the curve (`MeasuredCosts.unprocessed_seconds`); K grows by at most one beyond the
  largest K observed (prompt lookup, whose drafting costs nothing: starts at 4 and may double it);
- p, the logits processors' seconds per position (`round_costs.ProcessingCost`), timed apart: d and v are fitted
  without them and p is added back per processed position, K + 1 in v(K) (one in a plain step) and one in each
  draft step of a model draft. A round then pays the processors 2K + 1 times for at most K + 1 tokens that plain
  decoding pays them once for, so costly processors (a grammar engine, a Python scorer) lower K, and where p is a
  plain step's own cost or more no draft can pay at all: the call decodes plainly, without probes.

A round with K draft tokens yields E(K) = 1 + alpha + ... + alpha^K tokens per row in d K + v(K) seconds; the
policy takes the K in 0..max_lookahead with the highest E(K) / (d K + v(K)). With `StaticCosts` (used by every
sampling call, whose text depends on K, and always under tensor parallelism) d and v come from the models' weight
sizes instead of the clock (`step_cost_ratio`: decoding a token reads every weight once; on a GPU running eager
forwards, launch-bound, each decoder layer costs about the same), so the sequence of K's, and with it every sample,
repeats. K = 0 is plain decoding: when drafting does not pay (a useless draft), the policy
stops drafting and probes with K = 1 now and then to notice if it starts paying, unless not even a draft accepted
every time could pay at the costs measured over a few rounds (`MeasuredCosts.settled`; a draft step costing about a
plain round or more: a draft as large as the target, or a small one on a launch-bound GPU), where it stops probing
too; and a draft reading at least the target's weight bytes per step does not draft in the first rounds either. A
round's measured cost counts as at most a few times the estimate before it (`MeasuredCosts.observe`): one stalled
round does not decide a call. Choosing K from past rounds never biases the output: each round is exact for any K.

Processors of unknown cost (`sampling.processing.cost_unknown`: a user's, a `prefix_allowed_tokens_fn`, anything not
one of transformers' own listed there) are timed before any draft token pays for them: the first round drafts
nothing (`processors_unknown`), and where their time per position is already at least that round's own (the
prompt's forward: a bound on a plain step, `ProcessingCost.step_bound`) drafting never starts. A sampling call
(`StaticCosts`) reads the clock for that verdict alone, and only with such processors and where K may read the clock
(not under `generator=` or tensor parallelism): its K's are otherwise the clock-free ones. On CUDA, whose rounds are
timed by events, processors are not timed apart (`round_timer`): their cost is in the rounds' durations, as before.

Trees: `FixedTree` drafts the call's tree every round; under `draft_shape="auto"` in a greedy call that can draft
trees, `AdaptiveLookahead` weighs the best tree of each width against the chains each round (`shapes`) and
says which it chose (`chosen_tree`), K being its depth.

`RoundLookahead` is the one owner of K in a call: built once (`RoundLookahead.for_call`, the only place a policy is
made for `generate()`, by `make_policy`), it asks the policy before every round and caps its choice (room left
before `max_length`, the first round of a prompt ending in padding, the lookahead of a lookup round), handing the
drafter `DraftBudget`; `largest_round` says how large its rounds get, for what is compiled ahead.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import LogitsProcessor

from ..options import DEFAULT_MAX_LOOKAHEAD, DynamicTree, SpeculativeConfig, TreeShape
from ..proposers.base import DraftBudget
from ..sampling.processing import cost_unknown
from .round_costs import (
    STATIC_VERIFY_SLOPE,
    DecayedMean,
    MeasuredCosts,
    ProcessingCost,
    RoundRecord,
    StaticCosts,
    expected_rate,
    expected_tokens,
)
from .round_timer import host_clock
from .shapes import TREE_NODES, RankAcceptance, ShapeDesigner

LOOKUP_FIRST_LOOKAHEAD = 4  # prompt lookup's K before its costs are measured (a model draft's: 2)
# the deepest suffix round (draft_model="prompt_lookup" or a suffix drafter; prompt_lookup_num_tokens= sets it):
# SuffixDecoding's default depth; a short match drafts fewer (`proposers.suffix.SPEC_FACTOR`)
DEFAULT_LOOKUP_TOKENS = 24
ALPHA_PRIOR = 0.6  # alpha before a few tokens are tested: a fair draft of the same family
# Probes are spaced by `probe_every` (doubling while they fail) times max(1, PROBE_GAIN / g), where g is what a draft
# accepted every time would gain over plain decoding at the measured costs (`AdaptiveLookahead.perfect_draft_gain`).
PROBE_GAIN = 0.25


class LookaheadPolicy(ABC):
    """Decides K before each round and learns from each round's record."""

    @abstractmethod
    def choose(self) -> int:
        """K for the next round; called exactly once before each round. Any K >= 0 is allowed: the caller caps it
        by the room left before `max_length`."""

    def observe(self, record: RoundRecord) -> None:  # noqa: B027 (optional hook)
        """Learn from a finished round."""

    def chosen_tree(self) -> TreeShape | DynamicTree | None:
        """The tree of the round `choose` just chose, K its depth (None: a chain of K)."""
        return None

    def acceptance_rate(self) -> float:
        """The policy's estimate of alpha, the chance a draft token is accepted (`ALPHA_PRIOR` where it keeps none)."""
        return ALPHA_PRIOR

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


class FixedTree(FixedLookahead):
    """Always the same tree (`draft_shape="tree"` or a `TreeShape`): K is its depth."""

    def __init__(self, tree: TreeShape | DynamicTree):
        super().__init__(tree.max_depth)
        self.tree = tree

    def chosen_tree(self) -> TreeShape | DynamicTree | None:
        return self.tree


class AdaptiveLookahead(LookaheadPolicy):
    """Theorem 3.8 with an online estimate of alpha and a cost model (see the module docstring)."""

    def __init__(
        self,
        max_lookahead: int = DEFAULT_MAX_LOOKAHEAD,  # caps K
        costs: MeasuredCosts | StaticCosts | None = None,  # default: measured on the wall clock
        first_lookahead: int = 2,  # K while no cost is known yet (the first two rounds)
        alpha_prior: float = ALPHA_PRIOR,  # until a few tokens are tested
        alpha_prior_weight: float = 2.0,  # the prior counts as this many tested tokens: a useless draft is found
        # out after about three rejections, a good one is not abandoned after one unlucky round
        probe_every: int = 16,  # when not drafting, a K=1 round this often re-measures alpha (~2% cost at c=0.3);
        # the interval doubles (up to 8x) while probes keep confirming that drafting does not pay
        decay: float = 0.85,  # per round: estimates follow the last ~7 rounds (prompts change character)
        draft_step_seconds: float | None = None,  # a draft step timed before the call: the measured costs' prior
        growth: float = 1.0,  # how fast K may exceed the K's observed (`MeasuredCosts`' growth)
        # draft/target cost of a step (`step_cost_ratio`): until costs are measured, a draft reading at
        # least the target's bytes per step (c >= 1) cannot pay even if every token were accepted, so the first
        # rounds decode plainly instead of drafting first_lookahead tokens; None: unknown
        draft_cost_ratio: float | None = None,
        # `draft_shape="auto"` in a greedy call that can draft trees: each round weighs the best tree of every width
        # against the chains (`shapes`); None: chains
        trees: ShapeDesigner | None = None,
        # the call's processors include one of unknown cost (`sampling.processing.cost_unknown`) whose time the costs
        # measure: the first round drafts nothing, so that they are timed before a draft token pays for them
        processors_unknown: bool = False,
        draft_processes: bool = True,  # the drafter processes each drafted position (False: a prompt lookup)
    ):
        self.max_lookahead = max_lookahead
        self.costs = costs if costs is not None else MeasuredCosts(decay, draft_step_seconds, growth, draft_processes)
        self.processors_unknown = processors_unknown
        self.first_lookahead = min(first_lookahead, max_lookahead)
        self.draft_cost_ratio = draft_cost_ratio
        self.probe_every = probe_every
        # the call's one acceptance estimate: rank 0's hazard is alpha (a chain's), the ranks above a tree's
        ranks = trees.ranks if trees is not None else 1
        self.acceptance = RankAcceptance(ranks, alpha_prior, alpha_prior_weight, decay)
        self._rounds_without_drafting = 0
        self._probe_interval = probe_every
        self._probed = False
        self.trees = trees
        self._tree: TreeShape | DynamicTree | None = None

    @property
    def needs_timing(self) -> bool:
        return isinstance(self.costs, MeasuredCosts) or self.costs.processing is not None

    @property
    def alpha(self) -> DecayedMean:
        """The estimate of alpha: the acceptance's rank 0."""
        return self.acceptance.hazards[0]

    def observe(self, record: RoundRecord) -> None:
        self.acceptance.observe(record)
        self.costs.observe(record)

    def acceptance_rate(self) -> float:
        return self.acceptance.alpha

    def expected_rate(self, lookahead: int) -> float:
        """Expected tokens per second per row with K = lookahead: E(K) / (d K + v(K))."""
        return expected_rate(self.acceptance.alpha, lookahead, self.costs)

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

    def chosen_tree(self) -> TreeShape | DynamicTree | None:
        return self._tree

    def best_lookahead(self) -> int:
        """The K (a tree's depth, `chosen_tree`) of the best rate at the costs measured."""
        if self.trees is not None:
            self._tree, depth = self.trees.best(self.costs, self.acceptance)
            return depth
        # K grows by at most one beyond the K's observed: a line extrapolated from few rounds is a guess, and a
        # guessed-cheap wide round (compute-bound verification) costs a lot and tells little about alpha.
        return max(range(self.costs.largest_lookahead(self.max_lookahead) + 1), key=self.expected_rate)

    def choose(self) -> int:
        self._tree = None
        processing = self.costs.processing
        if self.processors_unknown and processing is not None and not processing.measured:
            return 0  # the first round times the processors (see the module docstring)
        if self.costs.processing_outweighs_step:
            return 0  # no draft can pay, however good (`ProcessingCost`): no probes either
        if self.costs.ready:
            choice = self.best_lookahead()
        elif self.draft_cost_ratio is None or self.draft_cost_ratio < 1:
            return self.first_lookahead  # nothing measured yet: drafting measures the costs
        else:
            choice = 0  # a draft step reads the target's bytes or more: plain rounds until a probe measures it
        if choice > 0:
            self._rounds_without_drafting, self._probe_interval = 0, self.probe_every
            return choice
        gain = self.perfect_draft_gain()
        if gain <= 0 and self.costs.settled:
            return 0  # not even a perfect draft would pay at costs measured over rounds: no probes either
        if self._rounds_without_drafting == 0 and self._probed:  # the last probe did not make drafting pay
            self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)
        self._probed = False
        self._rounds_without_drafting += 1
        # A probe costs a draft forward or two (the draft catches up with the rounds it skipped) to find a gain of at
        # most `gain`: the smaller that gain, the rarer the probes (a draft costing 0.9 of a plain round can gain
        # 10% at best: a probe every ~40 rounds instead of 16).
        interval = self._probe_interval * (max(1.0, PROBE_GAIN / gain) if gain > 0 else 1.0)
        if self._rounds_without_drafting >= interval:  # is drafting paying again?
            self._rounds_without_drafting, self._probed = 0, True
            return 1
        return 0


def make_policy(
    config: SpeculativeConfig,
    clock_free: bool,
    cost_ratio: float,
    batch_size: int = 1,
    draft_step_seconds: float | None = None,
    lookup_only: bool = False,
    tree: TreeShape | DynamicTree | None = None,
    tree_ranks: int = 0,
    processors_unknown: bool = False,
) -> LookaheadPolicy:
    """A fresh policy for one generate() call (`RoundLookahead.for_call` calls it and caps its K).

    Args:
        config: the call's options (`num_lookahead`, `max_lookahead`, `lookahead_policy`).
        clock_free: K must not depend on the clock (a sampling call, or tensor-parallel ranks must agree): the
            adaptive policy then uses `StaticCosts`, with verification rising with the batch.
        cost_ratio: draft/target cost of a step, estimated from weight sizes, or from decoder layers on a
            launch-bound GPU (`step_cost_ratio`).
        batch_size: rows verified together (a verification pass scores batch_size * (K + 1) tokens).
        draft_step_seconds: the draft's step time measured before the call, if any: the starting estimate of the
            wall-clock costs (`MeasuredCosts`); unused by clock-free `StaticCosts`.
        lookup_only: drafting by prompt lookup alone (no draft step to pay per token): the wall-clock policy starts
            at `LOOKUP_FIRST_LOOKAHEAD` tokens and may double the largest K observed (`MeasuredCosts`' growth),
            instead of starting at 2 and adding one.
        tree: every round drafts this tree (`FixedTree`); None: see `tree_ranks`.
        tree_ranks: `draft_shape="auto"` may draft trees of up to this many of the draft's choices a node, chosen
            round by round (`shapes.ShapeDesigner`); 0: chains.
        processors_unknown: the call's processors include one of unknown cost (`sampling.processing.cost_unknown`)
            and the policy may time it (`times_unknown_processors`: not under `generator=`, tensor parallelism or
            CUDA): the first round drafts nothing and times them, and a clock-free policy times them too, for
            `StaticCosts.processing_outweighs_step` alone. Ignored with `lookup_only`: lookup drafts are not
            processed, so processors cost a lookup round only its verified positions (a lookup that is always right
            pays whatever they cost).
    """
    if tree is not None:
        return FixedTree(tree)
    if config.lookahead_policy is not None:
        return config.lookahead_policy()
    if config.num_lookahead is not None:
        return FixedLookahead(config.num_lookahead)
    trees = ShapeDesigner(tree_ranks, config.max_lookahead) if tree_ranks else None
    processors_unknown = processors_unknown and not lookup_only  # lookup drafts are not processed: see the docstring
    if clock_free:
        processing = ProcessingCost() if processors_unknown else None
        costs = StaticCosts(cost_ratio, verify_slope=STATIC_VERIFY_SLOPE * batch_size, processing=processing)
        return AdaptiveLookahead(config.max_lookahead, costs=costs, trees=trees, processors_unknown=processors_unknown)
    if lookup_only:  # processors cost a lookup only their verification (p in v(K)): no verdict, no plain first round
        return AdaptiveLookahead(
            config.max_lookahead, first_lookahead=LOOKUP_FIRST_LOOKAHEAD, growth=2.0, draft_processes=False
        )
    return AdaptiveLookahead(
        config.max_lookahead,
        draft_step_seconds=draft_step_seconds,
        draft_cost_ratio=cost_ratio,
        trees=trees,
        processors_unknown=processors_unknown,
    )


def times_unknown_processors(processors: Sequence[LogitsProcessor], clock_free: bool, device: torch.device) -> bool:
    """Whether a call's processors include one of unknown cost (`sampling.processing.cost_unknown`) that the policy
    may time (`make_policy`'s `processors_unknown`): not where K must never read the clock (`generator=`, tensor
    parallelism), nor where rounds are timed by CUDA events, which a processor's host seconds cannot be set against
    (`round_timer.host_clock`)."""
    return cost_unknown(processors) and not clock_free and host_clock(device)


def _most_draft_tokens(
    config: SpeculativeConfig, lookup_tokens: int | None, lookup_only: bool, suffix: bool = False
) -> int:
    """The most draft tokens a round of this call verifies under the built-in policies (a custom `lookahead_policy`
    may ask for more): with lookup alone, N (`prompt_lookup_num_tokens`, else `num_lookahead`, else
    `DEFAULT_LOOKUP_TOKENS`) or a larger `num_lookahead`; with a model draft, the largest of `max_lookahead`,
    `num_lookahead` and N, where a suffix drafter beside it (`suffix`) has N `DEFAULT_LOOKUP_TOKENS` unless given."""
    if lookup_only:
        return max(lookup_tokens or config.num_lookahead or DEFAULT_LOOKUP_TOKENS, config.num_lookahead or 0)
    depth = suffix_depth(lookup_tokens) if suffix else lookup_tokens or 0
    return max(config.max_lookahead, config.num_lookahead or 0, depth)


def suffix_depth(lookup_tokens: int | None) -> int:
    """The deepest round of a suffix drafter beside a draft model: N (`prompt_lookup_num_tokens`), else
    `DEFAULT_LOOKUP_TOKENS`."""
    return lookup_tokens or DEFAULT_LOOKUP_TOKENS


def largest_round(config: SpeculativeConfig, lookup_tokens: int | None, lookup_only: bool, suffix: bool = False) -> int:
    """The largest round size (positions a verification forward scores: K + 1) this call's rounds reach under the
    built-in policies: what compiled forwards and the kernel in a compiled graph must serve (`suffix`: a suffix
    drafter beside a draft model, whose chains are as deep as its rounds: `RoundLookahead.for_call`)."""
    return _most_draft_tokens(config, lookup_tokens, lookup_only, suffix) + 1


class RoundLookahead:
    """The one owner of K in a `generate()` call: the policy's choice in, the round's capped budget out.

    `budget` is called once before every round and asks the policy once (`LookaheadPolicy.choose`), except in a
    first round whose prompt ends in padding, which drafts nothing. Its choice is then capped:

    - room: a row never holds more than `max_length` tokens, so a round drafts at most ``max_length - longest row -
      1`` tokens (the recovered/bonus token takes the last place); the token buffer then needs `max_length + 1`
      columns whatever K a policy asks for;
    - first round: where the prompt ends in padding in some row (right padding), the logits of that padding
      position can come from an attention row with every key masked (a sliding window over padding), which
      eager/SDPA attention fills by averaging over every key of the forward, so the target's first forward must
      cover exactly the prompt, as plain decoding's does;
    - lookup lookahead: drafting by lookup alone, the policy's K (its `max_lookahead` widened to N at construction);
      with a model draft and N, a round one row drafts by lookup alone may be ``max(K, N)`` wide;
    - the draft's positions: a draft model with a learned position table (GPT-2's `n_positions`) drafts at most the
      tokens its table still has room for (`DraftModelProposer.room`); once the text fills it, rounds draft nothing
      by model and the target finishes alone (`draft_positions_ended`).

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
        suffix_costs: StaticCosts | None = None,
    ):
        """
        Args:
            policy: chooses K (a fresh one per call).
            max_length: `generate()`'s max_length.
            prompt_ends_in_padding: some row's prompt ends in padding: the first round drafts nothing.
            lookup_tokens: N (`prompt_lookup_num_tokens`) with a model draft: the lookahead of a lookup round; None: no
                lookup.
            lookup_only: drafting by lookup alone (`draft_model="prompt_lookup"`): lookup rounds are K wide.
            suffix_costs: a suffix drafter beside a draft model: the costs, in target steps, its choice between a
                suffix round and the model's weighs (`DraftBudget.suffix_threshold`); None: no suffix drafter. With
                it, `lookup_tokens` is the suffix rounds' depth (`suffix_depth`).
        """
        assert suffix_costs is None or lookup_tokens is not None, "a suffix drafter's depth is `suffix_depth`'s"
        self.policy, self.max_length = policy, max_length
        self.prompt_ends_in_padding = prompt_ends_in_padding
        self.lookup_tokens, self.lookup_only, self.suffix_costs = lookup_tokens, lookup_only, suffix_costs
        self._first_round = True
        # The longest row's length when the draft's position table first stopped its drafting; None: it never did.
        self.draft_positions_ended: int | None = None

    @classmethod
    def for_call(
        cls,
        config: SpeculativeConfig,
        *,
        clock_free: bool,
        batch_size: int,
        max_length: int,
        prompt_ends_in_padding: bool,
        lookup_tokens: int | None,
        lookup_only: bool,
        cost_ratio: float = 0.0,
        draft_step_seconds: float | None = None,
        tree: TreeShape | DynamicTree | None = None,
        tree_ranks: int = 0,
        processors_unknown: bool = False,
        suffix: bool = False,
    ) -> RoundLookahead:
        """The K owner of one `generate()` call, with a fresh policy (`make_policy`).

        Args:
            config: the call's options (`num_lookahead`, `max_lookahead`, `lookahead_policy`).
            clock_free: K must not depend on the clock (a sampling call, or tensor-parallel ranks must
                agree).
            batch_size: rows verified together.
            max_length: `generate()`'s max_length.
            prompt_ends_in_padding: some row's prompt ends in padding.
            lookup_tokens: `prompt_lookup_num_tokens` (N), or None.
            lookup_only: no draft model (`draft_model="prompt_lookup"`): K adapts as for a model draft (drafting
                costs only the lookup) up to N (default `DEFAULT_LOOKUP_TOKENS`); `num_lookahead=` fixes it.
            cost_ratio: draft/target cost of a step (`step_cost_ratio`); ignored by lookup alone (cost 0).
            draft_step_seconds: the draft's step time measured before the call (`PreparedDraft.
                measured_step_seconds`): the starting estimate of the adaptive policy's draft cost; None: none.
            tree, tree_ranks: the rounds' trees (`make_policy`; `shapes.ShapeChoice`).
            processors_unknown: a processor of unknown cost, which the clock may judge (`make_policy`).
            suffix: a suffix drafter beside the draft model (`suffix_draft=`, or prompt lookup's with
                `prompt_lookup_num_tokens=` N): its rounds are up to ``max(K, N)`` deep (N default
                `DEFAULT_LOOKUP_TOKENS`), chosen against the model's by static costs.
        """
        if lookup_only:
            config = replace(config, max_lookahead=_most_draft_tokens(config, lookup_tokens, lookup_only=True))
            policy = make_policy(config, clock_free, cost_ratio=0.0, batch_size=batch_size, lookup_only=True)
            return cls(policy, max_length, prompt_ends_in_padding, lookup_only=True)
        policy = make_policy(
            config,
            clock_free,
            cost_ratio,
            batch_size,
            draft_step_seconds=draft_step_seconds,
            tree=tree,
            tree_ranks=tree_ranks,
            processors_unknown=processors_unknown,
        )
        if not suffix:
            return cls(policy, max_length, prompt_ends_in_padding, lookup_tokens)
        costs = StaticCosts(cost_ratio, verify_slope=STATIC_VERIFY_SLOPE * batch_size)
        return cls(policy, max_length, prompt_ends_in_padding, suffix_depth(lookup_tokens), suffix_costs=costs)

    @property
    def needs_timing(self) -> bool:
        """Whether the policy learns from wall-clock durations (`LookaheadPolicy.needs_timing`)."""
        return self.policy.needs_timing

    def budget(self, lengths: Sequence[int], draft_room: int | None = None) -> DraftBudget:
        """This round's draft budget; call exactly once before each round.

        Args:
            lengths: per active row, its committed length.
            draft_room: the most tokens the draft model's position table lets it draft (`DraftModelProposer.room`);
                None: no limit (or no draft model).
        """
        if draft_room == 0 and self.draft_positions_ended is None:
            self.draft_positions_ended = max(lengths)
        first_round, self._first_round = self._first_round, False
        if first_round and self.prompt_ends_in_padding:
            return DraftBudget(lookahead=0, lookup_lookahead=0)
        room = self.max_length - max(lengths) - 1
        lookahead = max(0, min(self.policy.choose(), room))
        if draft_room is not None:
            lookahead = min(lookahead, draft_room)
        tree = self.policy.chosen_tree() if lookahead > 0 else None
        if tree is not None and self.suffix_costs is not None:  # a model tree's round, or a suffix drafter's tree
            assert self.lookup_tokens is not None  # the suffix depth (`__init__`)
            depth = max(0, min(max(lookahead, self.lookup_tokens), room))
            budget = self._suffix_budget(lookahead, depth, len(lengths), self.suffix_costs)
            return budget._replace(tree=tree.truncated(lookahead))
        if tree is not None:  # trees draft with a model alone, or beside a suffix drafter (`validation.tree_problems`)
            return DraftBudget(lookahead=lookahead, lookup_lookahead=0, tree=tree.truncated(lookahead))
        if self.lookup_only:  # a suffix drafter's tree: K deep, as wide as one verification pass serves well
            nodes = max(lookahead, TREE_NODES // max(1, len(lengths)))
            return DraftBudget(lookahead=lookahead, lookup_lookahead=lookahead, nodes=nodes)
        if self.lookup_tokens is None:
            return DraftBudget(lookahead=lookahead, lookup_lookahead=0)
        lookup_lookahead = max(0, min(max(lookahead, self.lookup_tokens), room))
        if self.suffix_costs is None:
            return DraftBudget(lookahead=lookahead, lookup_lookahead=lookup_lookahead)
        return self._suffix_budget(lookahead, lookup_lookahead, len(lengths), self.suffix_costs)

    def _suffix_budget(self, lookahead: int, depth: int, rows: int, costs: StaticCosts) -> DraftBudget:
        """A round's budget beside a suffix drafter: its tree `depth` deep and up to `TREE_NODES` wide over the
        rows, and what the model's round of K = `lookahead` is worth, in tokens, at the call's acceptance estimate
        and static costs: a suffix round of N nodes must promise E with (E + 1) / v(N) >= E(K) / (c K + v(K))."""
        nodes = max(depth, TREE_NODES // max(1, rows))
        model_tokens = expected_tokens(self.policy.acceptance_rate(), lookahead)  # per row, the bonus token included
        model_round = costs.draft_seconds() * lookahead + costs.verify_seconds(lookahead)
        threshold = model_tokens * costs.verify_seconds(nodes) / model_round - 1.0
        return DraftBudget(
            lookahead=lookahead,
            lookup_lookahead=depth,
            nodes=nodes,
            suffix_threshold=threshold,
            model_tokens=model_tokens - 1.0,
        )

    def observe(self, record: RoundRecord, model_steps: int) -> None:
        """Let the policy learn from a finished round.

        Args:
            record: the round's lookahead (the proposal's), acceptance and durations.
            model_steps: draft-model forwards of the round's proposal (0 and a nonzero lookahead: a lookup round).
        """
        if record.lookahead > 0 and model_steps == 0 and not self.lookup_only:
            return  # a lookup round of a model draft says nothing about the model's acceptance or cost
        self.policy.observe(record)
