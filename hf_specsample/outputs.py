"""What `generate()` returns: the usual tensor or output object, plus speculative statistics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .core import transformers_api
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
    """Collects the per-token scores/logits `generate()` was asked for, step by step in the caller's row order.

    Each kept step is one `(batch, vocab)` tensor, `-inf` in rows that hold no token at that step (finished, or not
    there yet), so the steps so far are at hand as plain `generate()` holds them (its stopping criteria read them).
    A round records its candidate tokens before the stopping criteria run (`scores_so_far` shows them the scores,
    a row's candidates past a stop within the round blanked in copies), and `keep` drops the candidates past each
    row's stop once the round's stops are known, and the steps no row reaches.
    """

    def __init__(self, generation_config: GenerationConfig, batch_size: int):
        self.return_dict = bool(generation_config.return_dict_in_generate)
        self.keep_scores = self.return_dict and bool(generation_config.output_scores)
        self.keep_logits = self.return_dict and bool(generation_config.output_logits)
        self.batch_size = batch_size
        self.recorded = [0] * batch_size  # per caller row, the steps recorded
        self.scores: list[torch.Tensor] = []  # per step, (batch, vocab)
        self.logits: list[torch.Tensor] = []

    @property
    def wants_raw_logits(self) -> bool:
        return self.keep_logits

    def record(
        self,
        callers: Sequence[int],
        counts: Sequence[int],
        scores: torch.Tensor | None,
        raw_logits: torch.Tensor | None,
    ) -> None:
        """Keep positions ``0 .. counts[b] - 1`` of `scores` / `raw_logits` (`(active rows, positions, vocab)`) as the
        next steps of each active row's caller row (`callers`, from the row book)."""
        pairs = [(self.scores, scores)] if self.keep_scores and scores is not None else []
        pairs += [(self.logits, raw_logits)] if self.keep_logits and raw_logits is not None else []
        for kept, source in pairs:
            # one copy per (step, position) shared by rows: one per position when the rows are aligned
            groups: dict[tuple[int, int], list[int]] = {}
            for row, (caller, count) in enumerate(zip(callers, counts)):
                for position in range(count):
                    groups.setdefault((self.recorded[caller] + position, position), []).append(row)
            for (step, position), rows in groups.items():
                while len(kept) <= step:
                    kept.append(source.new_full((self.batch_size, source.shape[-1]), float("-inf")))
                index = torch.tensor([callers[row] for row in rows], device=kept[step].device)
                kept[step][index] = source[rows, position].to(kept[step].device)
        for caller, count in zip(callers, counts):
            self.recorded[caller] += count

    def keep(self, callers: Sequence[int], recorded: Sequence[int], counts: Sequence[int]) -> None:
        """Drop the last ``recorded[b] - counts[b]`` steps `record` kept for each active row (candidates past a
        stop): `-inf` again, and steps no row reaches any more are gone."""
        for caller, extra in zip(callers, (had - kept for had, kept in zip(recorded, counts))):
            self.recorded[caller] -= extra
            for kept in (self.scores, self.logits):
                for step in range(self.recorded[caller], min(self.recorded[caller] + extra, len(kept))):
                    kept[step][caller] = float("-inf")
        longest = max(self.recorded, default=0)
        del self.scores[longest:], self.logits[longest:]

    def scores_so_far(self, steps: int, ended: Mapping[int, int]) -> tuple[torch.Tensor, ...] | None:
        """What plain `generate()` passes its stopping criteria as `scores` after `steps` new tokens: its processed
        scores per step, `(batch, vocab)` each, where they are returned, else None.

        Args:
            ended: caller row -> its first step past a stop within this round (a row that stopped earlier in the
                round): shown `-inf` from that step on, as `keep` will leave them, in copies of the steps concerned.
                The recorder itself is left as it is (`keep` drops those steps once the round's stops are known), and
                no step a criterion was handed changes after the call.
        """
        if not self.keep_scores:
            return None
        shown = list(self.scores[:steps])
        for step in range(min(ended.values(), default=steps), steps):
            blanked = [caller for caller, first_step in ended.items() if first_step <= step]
            shown[step] = shown[step].clone()
            shown[step][blanked] = float("-inf")
        return tuple(shown)

    def build(
        self, sequences: torch.Tensor, stats: SpeculativeStats, cache
    ) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
        """The tensor, or the output object when `return_dict_in_generate=True`."""
        ids = cast(torch.LongTensor, sequences)  # long ids: the type transformers gives `generate()`'s output
        if not self.return_dict:
            return ids
        # transformers annotates `scores` / `logits` as `tuple[torch.Tensor]`, a one-element tuple: one per step
        return SpeculativeDecoderOnlyOutput(
            sequences=ids,
            scores=tuple(self.scores) if self.keep_scores else None,  # type: ignore[arg-type]
            logits=tuple(self.logits) if self.keep_logits else None,  # type: ignore[arg-type]
            speculative_stats=stats,
            **{transformers_api.CACHE: cache},
        )
