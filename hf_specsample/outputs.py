"""What `generate()` returns: the usual tensor or output object, plus speculative statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import transformers_api
from .stats import SpeculativeStats


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` (sequences, scores, logits, the cache) plus `speculative_stats`.

    The cache is under the name plain `generate()` returns it under with the installed transformers
    (`transformers_api.CACHE`: `out.cache` from 5.24 on, `out.past_key_values` before).

    `scores[i]` / `logits[i]` are `(batch, vocab)`: the target's processed scores / raw logits for generated token
    `i`, as plain sampling returns them. Rows that had already finished at step `i` hold `-inf` there (plain
    `generate()` keeps computing finished rows; speculative decoding drops them).
    """

    speculative_stats: SpeculativeStats | None = None


class OutputRecorder:
    """Collects the per-token scores/logits `generate()` was asked for, row by row."""

    def __init__(self, generation_config: GenerationConfig, batch_size: int):
        self.return_dict = bool(generation_config.return_dict_in_generate)
        self.keep_scores = self.return_dict and bool(generation_config.output_scores)
        self.keep_logits = self.return_dict and bool(generation_config.output_logits)
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]

    @property
    def wants_raw_logits(self) -> bool:
        return self.keep_logits

    def record(
        self,
        callers: Sequence[int],
        counts: Sequence[int],
        scores: torch.Tensor,
        raw_logits: torch.Tensor | None,
    ) -> None:
        """Keep positions ``0 .. counts[b] - 1`` of `scores` / `raw_logits` (`(active rows, positions, vocab)`), under
        each active row's caller row (`callers`, from the row book)."""
        for row, (row_id, count) in enumerate(zip(callers, counts)):
            if self.keep_scores:
                self.scores[row_id].extend(scores[row, :count].unbind(0))
            if self.keep_logits and raw_logits is not None:
                self.logits[row_id].extend(raw_logits[row, :count].unbind(0))

    def build(
        self, sequences: torch.Tensor, stats: SpeculativeStats, cache
    ) -> torch.Tensor | SpeculativeDecoderOnlyOutput:
        """The tensor, or the output object when `return_dict_in_generate=True`."""
        if not self.return_dict:
            return sequences
        return SpeculativeDecoderOnlyOutput(
            sequences=sequences,
            scores=_per_step(self.scores) if self.keep_scores else None,
            logits=_per_step(self.logits) if self.keep_logits else None,
            speculative_stats=stats,
            **{transformers_api.CACHE: cache},
        )


def _per_step(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Rows of per-token vectors -> tuple over steps of `(batch, vocab)`, `-inf` where a row had finished."""
    steps = max(len(row) for row in per_row)
    template = next(row[0] for row in per_row if row)
    filler = torch.full_like(template, float("-inf"))
    return tuple(torch.stack([row[step] if step < len(row) else filler for row in per_row]) for step in range(steps))
