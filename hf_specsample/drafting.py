"""Draft proposers: they write K draft tokens per row and report the distributions they sampled them from.

The interface mirrors transformers' `CandidateGenerator` (`get_candidates` / `update_candidate_strategy`), batched
over rows of different lengths and returning the draft's *processed* probabilities, which exactness needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from .kv import CachedModel
from .processing import PositionwiseProcessor, probabilities
from .rejection import sample_from_weights
from .sequences import Sequences


class Proposal(NamedTuple):
    """Draft tokens of one round.

    Attributes:
        tokens: `(batch, k)` long, also written into the buffer after each row's committed tokens.
        probs: `(batch, k, vocab)` float32, the distributions `tokens` were sampled from; None for greedy drafts.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None


class DraftModelProposer:
    """Proposes tokens by running a small causal LM autoregressively on its own KV cache."""

    def __init__(
        self,
        draft_model: PreTrainedModel,
        sequences: Sequences,
        processor: PositionwiseProcessor,
        do_sample: bool,
        generator: torch.Generator | None = None,
    ):
        self.runner = CachedModel(draft_model, sequences.token_is_real)
        self.processor = processor
        self.do_sample = do_sample
        self.generator = generator

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    def get_candidates(self, sequences: Sequences, num_tokens: int) -> Proposal:
        """Draft `num_tokens` tokens after every active row's committed tokens.

        The first forward catches the draft's cache up with the committed tokens it has not seen (the prompt, or
        the last one or two committed tokens); each later forward feeds the previous draft token.
        """
        tokens, lengths = sequences.tokens, sequences.lengths
        drafted, drafted_probs = [], []
        for step in range(num_tokens):
            logits = self.runner.feed(tokens, upto=[length + step for length in lengths], num_logits=1)
            prefix_lengths = [length + step for length in lengths]
            scores = self.processor(tokens, prefix_lengths, logits, sequences.row_ids)[:, 0]  # (batch, vocab)
            if self.do_sample:
                probs = probabilities(scores)
                token = sample_from_weights(probs, self.generator)  # (batch,)
                drafted_probs.append(probs)
            else:
                token = scores.argmax(dim=-1)
            sequences.write([step] * sequences.num_active, token)
            drafted.append(token)
        return Proposal(
            tokens=torch.stack(drafted, dim=1) if drafted else tokens.new_empty((sequences.num_active, 0)),
            probs=torch.stack(drafted_probs, dim=1) if drafted_probs else None,
        )

    def update_candidate_strategy(self, keep: Sequence[int]) -> None:
        """Roll the draft's cache back to the first `keep[b]` buffer positions of each row."""
        self.runner.rollback(keep)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these active rows (others finished)."""
        self.runner.select_rows(rows)
