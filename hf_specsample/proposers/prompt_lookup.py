"""Prompt-lookup drafting: propose what followed an earlier occurrence of the text's last n-gram.

Outputs that copy their inputs (code edits, quoting, extraction) repeat long runs of the prompt. The drafter looks
for the row's last ``n`` tokens earlier in the row (prompt and text so far; longest ``n`` first, the latest
occurrence) and proposes the tokens that followed it. No model runs, so a round costs one target forward.

Exact when sampling: a deterministic proposal is a draft distribution like any other, a point mass on the proposed
token, so the verifier accepts it with probability ``target(token)`` and otherwise samples the residual, the target's
distribution without that token. The proposal carries the token ids alone (`Proposal.probs` is None): no one-hot
tensor over the vocabulary is built (`verify/rules.py` handles point masses as such). A row with no match (or a
match shorter than the round) is padded with its last token, another point mass: exactness never depends on the proposal
being good. A round is only as wide as the longest continuation found (no row has one: a plain decoding step), and
`draft_model="prompt_lookup"` chooses its lookahead like a model draft's K (`lookahead.AdaptiveLookahead`, with a
lookup's near-zero drafting cost), up to `prompt_lookup_num_tokens` (default `lookahead.DEFAULT_LOOKUP_TOKENS`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sequences import Sequences
from .base import DraftBudget, Proposal, Proposer
from .draft_model import DraftModelProposer

DEFAULT_MAX_NGRAM = 3  # longest n-gram looked up (transformers' `max_matching_ngram_size` overrides it)


def ngram_continuation(tokens: torch.Tensor, usable: torch.Tensor, max_ngram: int, lookahead: int) -> torch.Tensor:
    """What followed the latest earlier occurrence of the row's last n-gram, longest n first.

    Args:
        tokens: `(length,)` long, one row's tokens so far.
        usable: `(length,)` bool, False for prompt padding (no n-gram may touch it).
        max_ngram: the longest n tried (then n - 1, ..., 1).
        lookahead: how many tokens to return at most.

    Returns:
        `(m,)` long with ``0 <= m <= lookahead``: the continuation (empty: no occurrence).
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        if not bool(usable[length - n :].all()):
            continue
        windows = tokens[: length - 1].unfold(0, n, 1)  # (length - n, n): every earlier n-gram
        fits = (windows == tokens[length - n :]).all(dim=1) & usable[: length - 1].unfold(0, n, 1).all(dim=1)
        starts = fits.nonzero().squeeze(1)
        if starts.numel():
            begin = int(starts[-1]) + n
            return tokens[begin : min(begin + lookahead, length)]
    return tokens[:0]


class PromptLookupProposer(Proposer):
    """Drafts every row from its own text (`ngram_continuation`); every proposal is a point mass (token ids only).

    Attributes:
        max_ngram: the longest n-gram looked up.
        forward_passes: always 0 (no model runs).
    """

    forward_passes = 0

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM):
        """`max_ngram` is checked with the call's other options (`validation.check_prompt_lookup`)."""
        self.max_ngram = max_ngram

    def continuations(self, sequences: Sequences, lookahead: int) -> list[torch.Tensor]:
        """Per active row, its continuation of at most `lookahead` tokens (possibly empty)."""
        tokens = sequences.tokens.cpu()
        usable = sequences.is_real(sequences.capacity)
        return [
            ngram_continuation(tokens[row, :length], usable[row, :length], self.max_ngram, lookahead)
            for row, length in enumerate(sequences.lengths)
        ]

    def get_candidates(self, sequences: Sequences, budget: DraftBudget) -> Proposal:
        """Write up to `budget.lookup_lookahead` proposed tokens after every active row's committed tokens: as many as
        the longest continuation found (rows with shorter ones, or none, repeat their last token).

        Returns:
            `Proposal` with `(batch, K)` tokens, ``K <= budget.lookup_lookahead``, and no probabilities (all point
            masses).
        """
        return self.propose(sequences, self.continuations(sequences, budget.lookup_lookahead))

    def propose(self, sequences: Sequences, found: Sequence[torch.Tensor]) -> Proposal:
        """Write the rows' continuations `found` (per active row, `(m,)` long, possibly empty), padded to the longest
        with each row's last token, after every active row's committed tokens.

        Returns:
            `Proposal` with `(batch, K)` tokens, ``K`` the longest continuation, and `probs` None.
        """
        lookahead = max((continuation.numel() for continuation in found), default=0)  # nothing found: a plain step
        rows = []
        for row, continuation in enumerate(found):
            own_last = sequences.tokens[row, sequences.lengths[row] - 1 :][:1]
            last = continuation[-1:] if continuation.numel() else own_last
            rows.append(torch.cat([continuation, last.cpu().repeat(lookahead - continuation.numel())]))
        proposed = torch.stack(rows).to(sequences.tokens.device) if rows else sequences.tokens[:, :0]  # (batch, K)
        for step in range(lookahead):
            sequences.write(step, proposed[:, step])
        return Proposal(tokens=proposed, probs=None)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Nothing to drop: the drafter keeps no per-row state."""

    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        """Nothing to roll back: the drafter keeps no state between rounds."""


class LookupThenModelProposer(Proposer):
    """`draft_model=small, prompt_lookup_num_tokens=N`: n-gram continuations where rows have one, the model elsewhere.

    With one active row, a round in which it has a continuation drafts up to `budget.lookup_lookahead` (``max(K, N)``)
    tokens by lookup alone and the draft model does not run (its cache catches up in a later round). Otherwise the model
    drafts `budget.lookahead` (K) tokens, and rows with a continuation take its tokens first
    (`DraftModelProposer.get_candidates(forced=...)`, marked as point masses in the proposal). In a batch the model
    runs every round: skipping it would leave rows behind in its cache by different amounts, and a forward feeds every
    row the same number of positions.
    """

    def __init__(self, model: DraftModelProposer, lookup: PromptLookupProposer):
        """
        Args:
            model: the draft-model proposer.
            lookup: the n-gram proposer.
        """
        self.model, self.lookup = model, lookup

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def get_candidates(self, sequences: Sequences, budget: DraftBudget) -> Proposal:
        """A lookup round (one active row with a continuation), else the model's proposal with n-gram tokens forced.

        Returns:
            `Proposal` with `(batch, K)` tokens: ``K <= budget.lookup_lookahead`` and `probs` None for a lookup round;
            ``K = budget.lookahead``, the model's distributions and a `point_mass` mask where tokens were forced.
        """
        found = self.lookup.continuations(sequences, budget.lookup_lookahead)
        if budget.lookup_lookahead > 0 and sequences.num_active == 1 and found[0].numel():
            return self.lookup.propose(sequences, found)
        return self.model.get_candidates(sequences, budget, forced=found)

    def select_rows(self, rows: Sequence[int]) -> None:
        self.model.select_rows(rows)

    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        self.model.rollback_to_committed(lengths)
