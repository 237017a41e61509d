"""Apply a `LogitsProcessorList` at several positions of several rows, each with that position's own prefix.

Plain `generate()` calls the processor list once per step with `input_ids` of shape `(batch, current_length)`.
Speculative sampling scores up to K+1 positions per row at once, and rows of a batch may stand at different
lengths. To give every processor exactly the arguments plain `generate()` would have given it:

- processors that depend on the prefix (repetition penalty, n-gram bans, bad words, ...) are called once per
  distinct prefix length, with the rows that share it;
- processors known to ignore `input_ids` and to treat rows independently (temperature, top-k, top-p, min-p, ...)
  are called once on all positions flattened together;
- the two that read only the prefix's *length* (min-length and min-new-tokens: they forbid EOS while the sequence is
  too short) are applied to all positions at once from a `(batch, positions)` tensor of lengths. Calling them per
  distinct length cost up to B (K+1) calls per round, each scanning the vocabulary (`torch.isin`).

The processor list keeps its order: it is cut into consecutive runs of these three kinds. Processors that read the
row's index in the batch (`prefix_allowed_tokens_fn`'s `batch_id`, the per-row prompt padding of the repetition
penalty) are given the caller's row indices, not the indices inside a group. A user processor that indexes rows
itself would see group indices: processors are assumed to treat rows independently otherwise.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Sequence

import torch
from transformers.generation import logits_process as lp

# Processors whose output row depends only on the same row of `scores` (never on `input_ids`, nor on the batch),
# and not on which token id a column stands for: they give the same result on any subset of the vocabulary.
VOCABULARY_FREE_PROCESSORS: tuple[type, ...] = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.TopHLogitsWarper,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
)

# Processors whose output row depends only on the same row of `scores` (never on `input_ids`, nor on the batch).
PREFIX_FREE_PROCESSORS: tuple[type, ...] = VOCABULARY_FREE_PROCESSORS + (lp.SuppressTokensLogitsProcessor,)

# Processors that read only the prefix length: EOS is forbidden while the sequence is shorter than a threshold.
LENGTH_ONLY_PROCESSORS: tuple[type, ...] = (lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor)


class RunKind(enum.Enum):
    """How a run of consecutive processors is applied to `(batch, positions, vocab)` scores."""

    PREFIX_FREE = "prefix_free"  # once, on all positions flattened
    LENGTH_ONLY = "length_only"  # once, from each position's prefix length
    PREFIX = "prefix"  # once per distinct prefix length, with that prefix


# Processors that keep state across calls or need a second batch: calling them for draft positions (or for
# positions that are later rejected) would change what they do, so they are refused up front.
UNSUPPORTED_PROCESSORS: tuple[type, ...] = (
    lp.SynthIDTextWatermarkLogitsProcessor,
    lp.UnbatchedClassifierFreeGuidanceLogitsProcessor,
    lp.ClassifierFreeGuidanceLogitsProcessor,
)


def check_supported(processors: Sequence[lp.LogitsProcessor]) -> None:
    """Raise a `ValueError` naming any processor speculative sampling cannot apply exactly."""
    for processor in processors:
        if isinstance(processor, UNSUPPORTED_PROCESSORS):
            raise ValueError(
                f"{type(processor).__name__} keeps state across calls (or needs a second batch), so it cannot be "
                "applied to draft positions exactly; generate without `draft_model=` for this configuration."
            )


def _kind(processor: lp.LogitsProcessor) -> RunKind:
    # Exact type, not isinstance: a subclass may well read `input_ids`.
    if type(processor) in PREFIX_FREE_PROCESSORS:
        return RunKind.PREFIX_FREE
    if type(processor) in LENGTH_ONLY_PROCESSORS:
        return RunKind.LENGTH_ONLY
    return RunKind.PREFIX


def _runs(processors: Sequence[lp.LogitsProcessor]) -> list[tuple[RunKind, list[lp.LogitsProcessor]]]:
    """Split the list into consecutive runs of (kind, processors)."""
    runs: list[tuple[RunKind, list[lp.LogitsProcessor]]] = []
    for processor in processors:
        kind = _kind(processor)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(processor)
        else:
            runs.append((kind, [processor]))
    return runs


class PositionwiseProcessor:
    """Applies a processor list to `scores` of shape `(batch, positions, vocab)`.

    Position ``j`` of row ``b`` is processed with prefix ``tokens[b, : prefix_lengths[b] + j]``, which is what
    plain `generate()` passes when it samples that position.
    """

    def __init__(self, processors: Sequence[lp.LogitsProcessor]):
        check_supported(processors)
        self.runs = _runs(processors)
        # Exact type, as for prefix-freedom: a subclass may read token ids.
        self.vocabulary_free = all(type(p) in VOCABULARY_FREE_PROCESSORS for p in processors)

    def __call__(
        self,
        tokens: torch.Tensor,
        prefix_lengths: Sequence[int],
        scores: torch.Tensor,
        row_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Return the processed scores (the input is not modified).

        Args:
            tokens: `(batch, capacity)` long, each row's tokens (prompt with its padding, generated, then drafts).
            prefix_lengths: `batch` ints, the prefix length of position 0 of each row.
            scores: `(batch, positions, vocab)` float32 logits.
            row_ids: each row's index in the caller's batch (default: ``0 .. batch - 1``).

        Returns:
            `(batch, positions, vocab)` processed scores.
        """
        if not self.runs:
            return scores
        batch, positions, vocab = scores.shape
        for kind, processors in self.runs:
            if kind is RunKind.PREFIX_FREE:
                flat = scores.reshape(batch * positions, vocab)
                no_prefix = tokens.new_empty((batch * positions, 0))
                for processor in processors:
                    flat = processor(no_prefix, flat)
                scores = flat.reshape(batch, positions, vocab)
            elif kind is RunKind.LENGTH_ONLY:
                lengths = torch.tensor(list(prefix_lengths))[:, None] + torch.arange(positions)  # (batch, positions)
                for processor in processors:
                    scores = _forbid_eos_while_short(processor, lengths, scores)
            else:
                row_ids = list(range(batch)) if row_ids is None else row_ids
                scores = self._by_prefix_length(processors, tokens, prefix_lengths, scores, row_ids)
        return scores

    @staticmethod
    def _by_prefix_length(
        processors: list[lp.LogitsProcessor],
        tokens: torch.Tensor,
        prefix_lengths: Sequence[int],
        scores: torch.Tensor,
        row_ids: Sequence[int],
    ) -> torch.Tensor:
        batch, positions, _ = scores.shape
        groups: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for row in range(batch):
            for position in range(positions):
                groups[prefix_lengths[row] + position].append((row, position))
        out = scores.clone()
        for length, pairs in groups.items():
            rows = torch.tensor([row for row, _ in pairs], device=scores.device)
            cols = torch.tensor([col for _, col in pairs], device=scores.device)
            group_ids = tokens[rows, :length]  # (group, length)
            group_scores = scores[rows, cols]  # (group, vocab)
            group_row_ids = [row_ids[row] for row, _ in pairs]
            for processor in processors:
                group_scores = _call(processor, group_ids, group_scores, group_row_ids)
            out[rows, cols] = group_scores
        return out


def _forbid_eos_while_short(processor: lp.LogitsProcessor, lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """What a min-length / min-new-tokens processor does at every position at once.

    Args:
        processor: a `MinLengthLogitsProcessor` or `MinNewTokensLengthLogitsProcessor`.
        lengths: `(batch, positions)` long, each position's prefix length (`input_ids.shape[-1]` in `generate()`).
        scores: `(batch, positions, vocab)`.

    Returns:
        `(batch, positions, vocab)` scores with the EOS ids at -inf where the prefix is still too short.
    """
    if isinstance(processor, lp.MinNewTokensLengthLogitsProcessor):
        too_short = lengths - processor.prompt_length_to_skip < processor.min_new_tokens
    else:
        too_short = lengths < processor.min_length
    vocab = scores.shape[-1]
    eos = processor.eos_token_id.to(scores.device).reshape(-1)
    eos = eos[(eos >= 0) & (eos < vocab)]  # what torch.isin(arange(vocab), eos) selects
    if not bool(too_short.any()) or eos.numel() == 0:
        return scores
    out = scores.clone()
    masked = too_short.to(scores.device)[..., None].expand(-1, -1, eos.numel())  # (batch, positions, eos)
    out[..., eos] = torch.where(masked, -math.inf, out[..., eos])
    return out


def _call(processor: lp.LogitsProcessor, ids: torch.Tensor, scores: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """Call `processor` on a group of rows, giving row-indexed processors the rows' indices in the caller's batch.

    Two processors `generate()` builds index rows: `prefix_allowed_tokens_fn` receives a `batch_id`, and the
    repetition penalty of a padded batch holds one prompt-padding length per row.
    """
    if isinstance(processor, lp.PrefixConstrainedLogitsProcessor):
        allowed_fn = processor._prefix_allowed_tokens_fn
        rows = []
        for i, row_id in enumerate(row_ids):
            one_row = lp.PrefixConstrainedLogitsProcessor(lambda _, sent, row_id=row_id: allowed_fn(row_id, sent), 1)
            rows.append(one_row(ids[i : i + 1], scores[i : i + 1]))
        return torch.cat(rows)
    if isinstance(processor, lp.RepetitionPenaltyLogitsProcessor) and isinstance(
        processor.prompt_ignore_length, torch.Tensor
    ):
        ignore = processor.prompt_ignore_length[torch.tensor(row_ids, device=processor.prompt_ignore_length.device)]
        return lp.RepetitionPenaltyLogitsProcessor(processor.penalty, prompt_ignore_length=ignore)(ids, scores)
    return processor(ids, scores)


def probabilities(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores in float32; `-inf` scores get probability exactly 0."""
    return torch.softmax(scores.float(), dim=-1)
