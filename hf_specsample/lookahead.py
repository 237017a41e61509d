"""Choosing K, the draft tokens per round.

`AdaptiveLookahead` (the default) picks K before every round by Leviathan et al.'s Theorem 3.8, from estimates it
keeps up to date while generating:

- alpha, the probability that a tested draft token is accepted (decayed counts of accepted / tested tokens);
- d, the cost of one draft step (seconds per drafted token);
- v(K), the cost of everything else in a round that verifies K draft tokens: the target forward over K+1
  positions, logits processing, acceptance and bookkeeping. It grows with K where verification is compute-bound
  (large batches, bitsandbytes 4-bit, float32 on CPU), so it is a line v0 + v1 K fitted to the rounds observed.

A round with K draft tokens yields E(K) = 1 + alpha + ... + alpha^K tokens per row in d K + v(K) seconds; the
policy takes the K in 0..max_lookahead with the highest E(K) / (d K + v(K)). With `StaticCosts` (used when a
`generator=` is given, and always under tensor parallelism) d and v come from the models' weight sizes instead of
the clock (`weight_bytes_ratio`: decoding a token reads every weight once), so the sequence of K's, and with it
every sample, is reproducible. K = 0 is plain decoding: when
drafting does not pay (a useless draft), the policy stops drafting and probes with K = 1 now and then to notice if
it starts paying. Choosing K from past rounds never biases the output: each round is exact for any K.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

DEFAULT_MAX_LOOKAHEAD = 8  # adaptive K never exceeds this; larger K rarely pays on CPU
# Clock-free verification cost per extra draft token and row, relative to a one-token target step: verifying
# K+1 positions of one row is nearly free while decoding is memory-bound (bf16 1.5B on CPU: 5 tokens ~ 1 token),
# but a batch verifies batch * (K+1) tokens and turns compute-bound.
STATIC_VERIFY_SLOPE = 0.02


@dataclass(frozen=True)
class RoundRecord:
    """What one round cost and yielded, summed over the batch's rows."""

    lookahead: int
    accepted: int  # draft tokens accepted, all rows
    tested: int  # draft tokens tested: accepted + one per row that saw a rejection
    draft_seconds: float
    verify_seconds: float  # everything in the round but drafting
    prefill: bool = False  # the first round also encodes the prompt: its costs say nothing about later rounds


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
    """Round costs from the wall clock: d per draft step, and v(K) as a line through the K's observed."""

    def __init__(self, decay: float):
        self.decay = decay
        self.draft_step = _DecayedMean(0.0, weight=0.0, decay=decay)
        self.verify: dict[int, _DecayedMean] = {}  # K -> decayed mean of v(K)

    @property
    def ready(self) -> bool:
        return bool(self.verify) and self.draft_step.count > 0

    def observe(self, record: RoundRecord) -> None:
        if record.prefill:
            return
        if record.lookahead > 0:
            self.draft_step.add(record.draft_seconds, record.lookahead)
        self.verify.setdefault(record.lookahead, _DecayedMean(0.0, 0.0, self.decay)).add(record.verify_seconds)

    def draft_seconds(self) -> float:
        return self.draft_step.value

    def verify_seconds(self, lookahead: int) -> float:
        """v(K) from the least-squares line through the observed K's (flat through a single one)."""
        points = [(k, mean.value) for k, mean in self.verify.items()]
        mean_k = sum(k for k, _ in points) / len(points)
        mean_v = sum(v for _, v in points) / len(points)
        spread = sum((k - mean_k) ** 2 for k, _ in points)
        slope = max(0.0, sum((k - mean_k) * (v - mean_v) for k, v in points) / spread) if spread else 0.0
        return max(1e-9, mean_v + slope * (lookahead - mean_k))


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
        total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if id(p) not in skipped)
    return total


def weight_bytes_ratio(draft: PreTrainedModel, target: PreTrainedModel) -> float:
    """Draft over target weight bytes per step: a clock-free estimate of c for memory-bound decoding."""
    return weight_bytes(draft) / max(1, weight_bytes(target))


class StaticCosts:
    """Costs fixed in advance, in units of one target step: d = c, v(K) = 1 + slope K. No clock, so the choice of
    K depends only on the tokens drawn: runs with the same generator repeat exactly, and tensor-parallel ranks agree.

    Args:
        cost_ratio: c, the draft step's cost in target steps (`weight_bytes_ratio`).
        verify_slope: v(K)'s growth per draft token (`STATIC_VERIFY_SLOPE` per row verified together).
    """

    ready = True

    def __init__(self, cost_ratio: float, verify_slope: float = STATIC_VERIFY_SLOPE):
        self.cost_ratio, self.verify_slope = cost_ratio, verify_slope

    def observe(self, record: RoundRecord) -> None:
        pass

    def draft_seconds(self) -> float:
        return self.cost_ratio

    def verify_seconds(self, lookahead: int) -> float:
        return 1.0 + self.verify_slope * lookahead


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
    ):
        self.max_lookahead = max_lookahead
        self.costs = costs if costs is not None else MeasuredCosts(decay)
        self.first_lookahead = min(first_lookahead, max_lookahead)
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

    def choose(self) -> int:
        if not self.costs.ready:
            return self.first_lookahead
        choice = max(range(self.max_lookahead + 1), key=self.expected_rate)
        if choice > 0:
            self._rounds_without_drafting, self._probe_interval = 0, self.probe_every
            return choice
        if self._rounds_without_drafting == 0 and self._probed:  # the last probe did not make drafting pay
            self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)
        self._probed = False
        self._rounds_without_drafting += 1
        if self._rounds_without_drafting >= self._probe_interval:  # is drafting paying again?
            self._rounds_without_drafting, self._probed = 0, True
            return 1
        return 0
