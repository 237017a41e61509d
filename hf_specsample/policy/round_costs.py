"""What a round costs and yields, and the cost models the adaptive lookahead learns (`lookahead.AdaptiveLookahead`).

- `RoundRecord`: one round's lookahead, acceptance and durations, handed to the policy after the round.
- `ProcessingCost`: p, the logits processors' seconds per verified position, and whether they cost so much that no
  draft can pay (`outweighs_step`).
- `MeasuredCosts`: d (a draft step) and v(K) (the rest of a round verifying K draft tokens, a chain's or a tree's
  nodes: `RoundRecord.width`) on the wall clock, each the processors' share (p per processed position) plus the rest,
  fitted without them.
- `StaticCosts`: the same without a clock, from weight sizes (`weight_bytes_ratio`: decoding a token reads every
  weight once), for calls whose K must repeat (a seeded call, tensor-parallel ranks); with a `ProcessingCost`
  (processors of unknown cost in a sampling call), its one clock read: whether they outweigh a plain step.
- `expected_tokens`, `expected_rate`: Leviathan et al.'s Theorem 3.8, a round's expected tokens and their rate, the
  one home of the formula (the adaptive lookahead and the benchmark's report use it too).
- `expected_speedup`: Theorem 3.8 at the best K, for AUTO's choice of a draft's form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..kernels.quantized_linear import Int4Linear, Int8Linear
from ..options import DEFAULT_MAX_LOOKAHEAD

# Clock-free verification cost per extra draft token and row, relative to a one-token target step: verifying
# K+1 positions of one row is nearly free while decoding is memory-bound (bf16 1.5B on CPU: 5 tokens ~ 1 token),
# but a batch verifies batch * (K+1) tokens and turns compute-bound.
STATIC_VERIFY_SLOPE = 0.02
OUTLIER = 3.0  # a round's measured cost counts as at most this many times the estimate before it (`MeasuredCosts`)
VERIFY_FIT_DECAY = 0.95  # per round, the weight of earlier rounds in v(K)'s fit (about 20 rounds: widths vary)
PARABOLA_WIDTHS = 4  # distinct widths observed before v(K) may curve (a parabola), else a line
CURVE_EVIDENCE = 3.0  # a parabola replaces the line where its residual is this many times smaller
SETTLED_ROUNDS = 3  # rounds of measured draft steps before a call may stop drafting without probing again


@dataclass(frozen=True)
class RoundRecord:
    """What one round cost and yielded, summed over the batch's rows."""

    lookahead: int
    accepted: int  # draft tokens accepted, all rows
    tested: int  # draft tokens tested: accepted + one per row that saw a rejection
    draft_seconds: float
    verify_seconds: float  # everything in the round but drafting (a hybrid target's re-feeds after a rejection too)
    prefill: bool = False  # the first round also encodes the prompt: its costs say nothing about later rounds
    # the draft model fed the prompt in this round (a call whose first round drafted nothing): its drafting time says
    # nothing about a draft step (its verification's still counts)
    draft_prefill: bool = False
    refeed_forwards: int = 0  # target forwards that re-fed kept positions to restore recurrent states (hybrids)
    # A tree round (`shapes`): its nodes (the target verified nodes + 1 positions; `lookahead` is its depth,
    # the draft's forwards), and per rank of the draft's choices, the nodes' ranks tested and accepted
    # (`draft_tree.rank_observations`). None: a chain round, `lookahead` wide.
    nodes: int | None = None
    rank_tested: tuple[int, ...] = ()
    rank_accepted: tuple[int, ...] = ()
    # Of `draft_seconds` and `verify_seconds`, the logits processors' host seconds (`PositionwiseProcessor.seconds`):
    # at the drafted positions (a model draft processes each), and at the width + 1 verified ones
    draft_processing_seconds: float = 0.0
    verify_processing_seconds: float = 0.0

    @property
    def width(self) -> int:
        """Draft tokens the target verified (a chain's K, a tree's nodes): the key of v's table."""
        return self.lookahead if self.nodes is None else self.nodes

    @classmethod
    def untimed(cls, lookahead: int, num_accepted: list[int], prefill: bool, refeed_forwards: int) -> RoundRecord:
        """A round of `lookahead` draft tokens per row, `num_accepted` per row, before its durations are known."""
        tested = sum(accepted + int(accepted < lookahead) for accepted in num_accepted)
        return cls(lookahead, sum(num_accepted), tested, 0.0, 0.0, prefill=prefill, refeed_forwards=refeed_forwards)


class DecayedMean:
    """Exponentially decayed mean: recent rounds count most; `weight` is the prior's weight in observations."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.total, self.count, self.decay = prior * weight, weight, decay

    def add(self, value: float, count: float = 1.0) -> None:
        self.total = self.decay * self.total + value
        self.count = self.decay * self.count + count

    @property
    def value(self) -> float:
        return self.total / self.count


class ProcessingCost:
    """What the logits processors cost, from the rounds' timed processing: p, seconds per verified position (a
    decayed mean over the rounds, the first one's included), and `step_bound`, at least what a plain step costs
    without them.

    Every verified position is processed with its own prefix, and a model draft processes each drafted position
    too: a round of K draft tokens costs K (d + p) + w(K) + (K + 1) p (w: the rest of the round) for at most K + 1
    tokens, which plain decoding makes in (K + 1) (w(0) + p). With w(K) >= w(0), that round is faster only where
    w(0) > d + p: once p >= w(0), no draft pays, however cheap its forward and however often it is accepted
    (`outweighs_step`). No round verifies in less than a plain step, the prompt's included, so the least
    processor-free verification time of any round (`step_bound`) is at least w(0), and `outweighs_step` can prove it
    from the first round on (one that drafted nothing: `AdaptiveLookahead`'s `processors_unknown`). The processors'
    seconds are the host's (`round_timer`: read only where the phases are timed on the host clock too).

    Args:
        decay: per round, how much earlier observations still count.
    """

    def __init__(self, decay: float = 0.85):
        self.per_position = DecayedMean(0.0, weight=0.0, decay=decay)
        self.step_bound = math.inf  # the least processor-free verification seconds of any round observed
        self.rounds = 0

    @property
    def measured(self) -> bool:
        return self.rounds > 0

    def observe(self, record: RoundRecord) -> None:
        """Learn a round's processing (a valid duration: checked by the caller), at most `OUTLIER` times the
        estimate before it: one call that stalled, or set something up, must not stop drafting for a call."""
        positions = record.width + 1
        spent = record.verify_processing_seconds
        if self.seconds() > 0:
            spent = min(spent, OUTLIER * positions * self.seconds())
        self.per_position.add(spent, positions)
        self.step_bound = min(self.step_bound, max(0.0, record.verify_seconds - record.verify_processing_seconds))
        self.rounds += 1

    def seconds(self) -> float:
        """p: seconds per verified position (0 until measured)."""
        return self.per_position.value if self.measured else 0.0

    def outweighs_step(self, per_draft_token: float) -> bool:
        """Whether processing costing `per_draft_token` seconds per drafted token leaves no draft able to pay: it is
        at least `step_bound` (see the class doc; never where processing costs nothing)."""
        return self.measured and per_draft_token > 0 and per_draft_token >= self.step_bound


class MeasuredCosts:
    """Round costs from the wall clock: d per draft step, and v(K) fitted to the rounds' widths (`verify_seconds`).

    The logits processors' share is measured apart (`ProcessingCost`, from `RoundRecord`'s processing seconds): d and
    v are fitted to the rest, and p is added back per processed position (K + 1 verified, one per drafted token), so
    a plain step's estimate carries one position's processing where a round carries K + 1, and a draft step's
    estimate includes its processing before any round drafted.

    Args:
        decay: per round, how much earlier observations still count.
        growth: how far K may go beyond the largest K observed: to ``max(largest + 1, growth * largest)``. 1 (a
            model draft): one more, since each extra draft step costs d for sure and v's line is a guess. 2 (prompt
            lookup): doubling, since an unobserved width then risks only the verification's slope and a lookup
            continuation is either copied whole or rejected early (the +1 ramp took 8 of a code edit's 25 rounds to
            reach the 10 tokens transformers' lookup proposes from its first round).
        draft_step_prior: seconds of one draft step measured before the call (`PreparedDraft.step_seconds`, where
            `draft_form="auto"` timed the draft's forms), the starting estimate of d; it counts as one
            drafted token (a bare single-row forward, without the processing and sampling a round adds) and fades
            with `decay`. None: d is unknown until a round drafts.
        draft_processes: the drafter processes each drafted position (a draft model); False: it processes none (a
            prompt lookup, whose drafts are point masses).
    """

    def __init__(
        self, decay: float, draft_step_prior: float | None = None, growth: float = 1.0, draft_processes: bool = True
    ):
        if growth < 1:
            raise ValueError(f"growth must be at least 1, got {growth}.")
        self.decay, self.growth, self.draft_processes = decay, growth, draft_processes
        prior_weight = 0.0 if draft_step_prior is None else 1.0
        # a draft step without its processing (the prior, a bare forward, has none)
        self.draft_step = DecayedMean(draft_step_prior or 0.0, weight=prior_weight, decay=decay)
        self.draft_processing = DecayedMean(0.0, weight=0.0, decay=decay)  # processing seconds per drafted token
        self.processing = ProcessingCost(decay)
        self.verify: dict[int, DecayedMean] = {}  # K -> decayed mean of v(K) without processing: widths observed
        # decayed sums over rounds of width^i (i = 0..4) and v * width^i (i = 0..2): `unprocessed_seconds`' least
        # squares
        self._moments, self._targets, self._squares = [0.0] * 5, [0.0] * 3, 0.0
        self.drafting_rounds = 0  # rounds whose draft steps were timed

    @property
    def settled(self) -> bool:
        """Whether the draft step's cost was measured in `SETTLED_ROUNDS` rounds or more (enough to give drafting up
        for the rest of a call)."""
        return self.drafting_rounds >= SETTLED_ROUNDS

    @property
    def ready(self) -> bool:
        return bool(self.verify) and self.draft_step.count > 0

    @property
    def knows_plain_step(self) -> bool:
        """Whether a draft step and a round without drafts (v(0)) have both been measured."""
        return 0 in self.verify and self.draft_step.count > 0

    def observe(self, record: RoundRecord) -> None:
        """Learn a round's durations, each at most `OUTLIER` times the estimate before it: noise on a clock only adds
        time (another process, a first call's lazy set-up), and one stalled round must not decide a call (a draft
        step measured at 30 times its cost once would stop drafting for good). A cost that really rose is followed
        within a few rounds."""
        durations = (record.draft_seconds, record.verify_seconds)
        processing = (record.draft_processing_seconds, record.verify_processing_seconds)
        if not all(math.isfinite(seconds) and seconds >= 0 for seconds in durations + processing):
            return  # no clock in use gives a NaN or a negative duration; one would poison every estimate after it
        self.processing.observe(record)  # the prompt's round too: a position's processing does not depend on it
        if record.prefill:
            return
        if record.lookahead > 0 and record.nodes is None:  # a chain's: one processed position per draft step
            self.draft_processing.add(record.draft_processing_seconds, record.lookahead)
        if record.lookahead > 0 and not record.draft_prefill:
            step = max(0.0, record.draft_seconds - record.draft_processing_seconds) / record.lookahead
            if self.draft_step.count > 0:
                step = min(step, OUTLIER * self.draft_step.value)
            self.draft_step.add(step * record.lookahead, record.lookahead)
            self.drafting_rounds += 1
        verify = max(0.0, record.verify_seconds - record.verify_processing_seconds)
        if self.verify:
            # against the fit, or the cheapest width's own mean where the fit says less: an extrapolated line can fall
            # to nothing, and a round clipped to it would confirm it (plain decoding "free", drafting stopped for good)
            cheapest = min(mean.value for mean in self.verify.values())
            verify = min(verify, OUTLIER * max(self.unprocessed_seconds(record.width), cheapest))
        self.verify.setdefault(record.width, DecayedMean(0.0, 0.0, self.decay)).add(verify)
        width = record.width
        self._moments = [VERIFY_FIT_DECAY * moment + width**power for power, moment in enumerate(self._moments)]
        self._targets = [
            VERIFY_FIT_DECAY * target + verify * width**power for power, target in enumerate(self._targets)
        ]
        self._squares = VERIFY_FIT_DECAY * self._squares + verify**2

    def draft_seconds(self) -> float:
        """d: a draft step and its processing."""
        return self.draft_step.value + self.draft_processing_seconds()

    def draft_processing_seconds(self) -> float:
        """The processing of a drafted token: as measured where chain rounds drafted (a tree's level processes each
        of its parents: `shapes` counts them); before, p where the drafter processes its positions as the
        target's are processed (`draft_processes`), else 0."""
        if self.draft_processing.count > 0:
            return self.draft_processing.value
        return self.processing.seconds() if self.draft_processes else 0.0

    @property
    def processing_outweighs_step(self) -> bool:
        """No draft can pay: a drafted token's processing costs a plain step or more (`ProcessingCost`)."""
        return self.draft_processes and self.processing.outweighs_step(self.draft_processing_seconds())

    def verify_seconds(self, lookahead: int) -> float:
        """v(K): the rest of the round without processing (`unprocessed_seconds`) and p for each of its K + 1
        verified positions."""
        return self.unprocessed_seconds(lookahead) + (lookahead + 1) * self.processing.seconds()

    def unprocessed_seconds(self, lookahead: int) -> float:
        """v(K) without the processors: a curve fitted to every round's (width, v) by least squares, each round
        weighted by `VERIFY_FIT_DECAY` per round since: flat with one width observed, a line (never falling) with two
        or three, a parabola with four or more where it curves upward (convex: verification turning compute-bound,
        compiled on an AVX2 CPU 146, 162, 222, 304 ms for K = 1..4; flat left of its vertex), else a line.

        Not each width's own mean: a round's v varies by 10-20% (the cache grows, rows commit different counts), so
        two neighbouring widths measured a few times give a slope off by several times its size, and a width measured
        once too high was never tried again (K held at 3 for a whole call where 8 paid).
        """
        if len(self.verify) == 1:
            return max(1e-9, next(iter(self.verify.values())).value)
        m, t = self._moments, self._targets
        line = _solve([[m[0], m[1]], [m[1], m[2]]], t[:2])
        if len(self.verify) >= PARABOLA_WIDTHS and line is not None:
            curve = _solve([[m[0], m[1], m[2]], [m[1], m[2], m[3]], [m[2], m[3], m[4]]], t)
            # the residuals' sums of squares at the fits: sum w v^2 - coefficients . targets
            line_residual = self._squares - line[0] * t[0] - line[1] * t[1]
            if curve is not None and curve[2] > 0:
                curve_residual = self._squares - sum(coefficient * sum_ for coefficient, sum_ in zip(curve, t))
                if curve_residual * CURVE_EVIDENCE < line_residual:  # the curve explains what noise cannot
                    a, b, c = curve
                    # never cheaper for more positions: flat left of the vertex (one within the widths measured)
                    at = max(lookahead, min(-b / (2 * c), max(self.verify)))
                    return max(1e-9, a + b * at + c * at**2)
        if line is None or line[1] < 0:  # never cheaper for more positions: flat at the weighted mean
            return max(1e-9, t[0] / m[0])
        return max(1e-9, line[0] + line[1] * lookahead)

    def largest_lookahead(self, max_lookahead: int) -> int:
        """The largest K worth trying now: one beyond the largest K observed, or `growth` times it (its cost is a
        guess until then)."""
        largest = max(self.verify, default=0)
        return min(max_lookahead, max(largest + 1, math.ceil(self.growth * largest)))


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """x with matrix @ x = vector (Gaussian elimination with partial pivoting), None where the matrix is singular
    (relative to its scale): the normal equations of `MeasuredCosts.unprocessed_seconds`' fit."""
    n = len(vector)
    rows = [list(row) + [value] for row, value in zip(matrix, vector)]
    scale = max(abs(value) for row in matrix for value in row) or 1.0
    for column in range(n):
        pivot = max(range(column, n), key=lambda row: abs(rows[row][column]))
        if abs(rows[pivot][column]) <= 1e-12 * scale:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for row in range(column + 1, n):
            factor = rows[row][column] / rows[column][column]
            rows[row] = [value - factor * top for value, top in zip(rows[row], rows[column])]
    solution = [0.0] * n
    for row in reversed(range(n)):
        known = sum(rows[row][column] * solution[column] for column in range(row + 1, n))
        solution[row] = (rows[row][n] - known) / rows[row][row]
    return solution


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


def expected_tokens(alpha: float, lookahead: float) -> float:
    """Leviathan et al.'s E(K) (Theorem 3.8): the tokens a round of K = `lookahead` draft tokens commits per row,
    1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha), where `alpha` is the probability that a tested
    draft token is accepted. `lookahead` may be a mean over rounds (not a whole number); 0 is plain decoding."""
    whole = int(lookahead)
    if whole == lookahead:  # summed term by term: exact as alpha nears 1, where the closed form cancels digits away
        return sum(alpha**i for i in range(whole + 1))
    return (1 - alpha ** (lookahead + 1)) / (1 - alpha) if alpha < 1.0 else lookahead + 1


def expected_rate(alpha: float, lookahead: int, costs: MeasuredCosts | StaticCosts) -> float:
    """Expected tokens per unit of `costs`' time and row with K = `lookahead`: E(K) / (d K + v(K))."""
    return expected_tokens(alpha, lookahead) / (costs.draft_seconds() * lookahead + costs.verify_seconds(lookahead))


def expected_speedup(alpha: float, cost_ratio: float, max_lookahead: int = DEFAULT_MAX_LOOKAHEAD) -> float:
    """Leviathan et al.'s Theorem 3.8 at the best K: tokens per unit of time over plain decoding's, for a draft
    accepted at rate `alpha` whose step costs `cost_ratio` target steps (verification as `StaticCosts` models it).
    1.0 where drafting does not pay (K = 0)."""
    costs = StaticCosts(cost_ratio)
    return max(expected_rate(alpha, lookahead, costs) for lookahead in range(max_lookahead + 1))


def weight_bytes_ratio(draft: PreTrainedModel, target: PreTrainedModel) -> float:
    """Draft over target weight bytes per step: a clock-free estimate of c for memory-bound decoding."""
    return weight_bytes(draft) / max(1, weight_bytes(target))


def step_cost_ratio(draft: PreTrainedModel, target: PreTrainedModel, launch_bound: bool) -> float:
    """c, a draft step's cost in target steps, without a clock: the weight bytes' ratio (`weight_bytes_ratio`), or
    where steps are bound by kernel launches (`launch_bound`: eager forwards on a GPU) the decoder layers' ratio
    where that is larger: each layer launches about the same kernels whatever its width. On an H200 (bf16,
    Qwen2.5-7B / 0.5B shapes, eager) a 7B step took 24 ms against 3.5 ms of weight streaming, and eight draft steps
    cost about five target steps (c near 0.6, where the bytes say 0.07 and the layers 0.86): with the bytes' ratio
    a sampling call drafted four tokens a round and ran at 0.48x plain `generate()`."""
    ratio = weight_bytes_ratio(draft, target)
    if not launch_bound:
        return ratio
    draft_layers, target_layers = (getattr(m.config.get_text_config(), "num_hidden_layers", 0) for m in (draft, target))
    counted = isinstance(draft_layers, int) and isinstance(target_layers, int)
    if not (counted and draft_layers > 0 and target_layers > 0):
        return ratio
    return max(ratio, draft_layers / target_layers)


class StaticCosts:
    """Costs in units of one target step, without a clock: d = c, v(K) = 1 + slope K + r(K), where r(K) is the
    number of forwards a hybrid target re-feeds per round to restore its recurrent states after rejections
    (`cache.checkpoints`; each costs about one target step: it reads every weight once), counted from the rounds
    themselves: a decayed mean per K observed, the nearest K's for others, 0 before any round and for models
    without recurrent states. The choice of K then depends only on the tokens drawn: runs with the same generator
    repeat exactly, and tensor-parallel ranks agree.

    Logits processors are not in these units: transformers' own cost a small part of a step, and a processor of
    unknown cost is only known by its time. Given a `processing` (a sampling call with such a processor, where the
    clock may be read), the rounds' processing is timed for one verdict, `processing_outweighs_step`: no draft can
    pay (`ProcessingCost`), so the call decodes plainly; K is otherwise chosen as without it.

    Args:
        cost_ratio: c, the draft step's cost in target steps (`weight_bytes_ratio`).
        verify_slope: v(K)'s growth per draft token (`STATIC_VERIFY_SLOPE` per row verified together).
        decay: per round, how much earlier re-feed counts still count.
        processing: the processors' timed cost, for the verdict above; None: nothing is timed.
    """

    ready = True
    knows_plain_step = True
    settled = True  # costs from weight sizes do not improve with more rounds

    def __init__(
        self,
        cost_ratio: float,
        verify_slope: float = STATIC_VERIFY_SLOPE,
        decay: float = 0.85,
        processing: ProcessingCost | None = None,
    ):
        self.cost_ratio, self.verify_slope, self.decay = cost_ratio, verify_slope, decay
        self.refeeds: dict[int, DecayedMean] = {}  # K -> decayed mean of re-feed forwards per round
        self.processing = processing

    def observe(self, record: RoundRecord) -> None:
        if record.lookahead > 0 and not record.prefill:
            mean = self.refeeds.setdefault(record.width, DecayedMean(0.0, 0.0, self.decay))
            mean.add(record.refeed_forwards)
        durations = (record.verify_seconds, record.verify_processing_seconds)
        if self.processing is not None and all(math.isfinite(seconds) and seconds >= 0 for seconds in durations):
            self.processing.observe(record)

    @property
    def processing_outweighs_step(self) -> bool:
        """No draft can pay (`ProcessingCost`'s argument in these units): with p the processors' timed seconds per
        position, each of the K draft tokens costing c t + p, and w(K) = (1 + slope K) t, a round of K costs at
        least (K + 1) (t + p) + K ((c + slope) t + p - t) against plain's (K + 1) (t + p), so no K gains once
        p >= (1 - c - slope) t, which p >= (1 - c - slope) `step_bound` proves (`step_bound` >= t)."""
        if self.processing is None:
            return False
        share = 1.0 - self.cost_ratio - self.verify_slope  # of a plain step, what drafted tokens' processing may cost
        return self.processing.outweighs_step(self.processing.seconds() / max(share, 1e-9))

    def draft_seconds(self) -> float:
        return self.cost_ratio

    def draft_processing_seconds(self) -> float:
        """0: a draft step's cost c counts no processing."""
        return 0.0

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
