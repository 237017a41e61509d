"""Apply a `LogitsProcessorList` at several positions of several rows, each with that position's own prefix.

Plain `generate()` calls the processor list once per step with `input_ids` of shape `(batch, current_length)`.
Speculative sampling scores up to K+1 positions per row at once, and rows of a batch may stand at different
lengths. To give every processor exactly the arguments plain `generate()` would have given it:

- processors that depend on the prefix (repetition penalty, n-gram bans, bad words, min-new-tokens, ...) are called
  once per distinct prefix length, with the rows that share it;
- processors known to ignore `input_ids` and to treat rows independently (temperature, top-k, top-p, min-p, ...)
  are called once on all positions flattened together.

The processor list keeps its order: it is cut into consecutive runs of the two kinds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from transformers.generation import logits_process as lp

# Processors whose output row depends only on the same row of `scores` (never on `input_ids`, nor on the batch).
PREFIX_FREE_PROCESSORS: tuple[type, ...] = (
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
    lp.SuppressTokensLogitsProcessor,
)

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


def _is_prefix_free(processor: lp.LogitsProcessor) -> bool:
    # Exact type, not isinstance: a subclass may well read `input_ids`.
    return type(processor) in PREFIX_FREE_PROCESSORS


def _runs(processors: Sequence[lp.LogitsProcessor]) -> list[tuple[bool, list[lp.LogitsProcessor]]]:
    """Split the list into consecutive runs of (prefix_free, processors)."""
    runs: list[tuple[bool, list[lp.LogitsProcessor]]] = []
    for processor in processors:
        kind = _is_prefix_free(processor)
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

    def __call__(self, tokens: torch.Tensor, prefix_lengths: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        """Process `scores` in place of a copy and return them.

        Args:
            tokens: `(batch, capacity)` long, each row's tokens (prompt with its padding, generated, then drafts).
            prefix_lengths: `batch` ints, the prefix length of position 0 of each row.
            scores: `(batch, positions, vocab)` float32 logits.

        Returns:
            `(batch, positions, vocab)` processed scores.
        """
        if not self.runs:
            return scores
        batch, positions, vocab = scores.shape
        for prefix_free, processors in self.runs:
            if prefix_free:
                flat = scores.reshape(batch * positions, vocab)
                no_prefix = tokens.new_empty((batch * positions, 0))
                for processor in processors:
                    flat = processor(no_prefix, flat)
                scores = flat.reshape(batch, positions, vocab)
            else:
                scores = self._by_prefix_length(processors, tokens, prefix_lengths, scores)
        return scores

    @staticmethod
    def _by_prefix_length(
        processors: list[lp.LogitsProcessor],
        tokens: torch.Tensor,
        prefix_lengths: Sequence[int],
        scores: torch.Tensor,
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
            for processor in processors:
                group_scores = processor(group_ids, group_scores)
            out[rows, cols] = group_scores
        return out


def probabilities(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores in float32; `-inf` scores get probability exactly 0."""
    return torch.softmax(scores.float(), dim=-1)
