"""A suffix drafter beside a draft model (`draft_model=small, suffix_draft=store`): each row, each round, drafts from
whichever is expected to give more tokens for the round's cost.

The suffix drafter's tree (`proposers.suffix`) comes first, for every row (no model runs for it). Its expected
accepted tokens are the sum of its nodes' probabilities (`CountedTree.expected_tokens`), scaled by how that estimate
has held up in this row so far (`trust`: the row's accepted suffix tokens over the tokens its estimates promised,
both decayed, from a prior of `PRIOR_TRUST`). The round's budget says what the model's round is worth
(`DraftBudget.suffix_threshold`, `DraftBudget.model_tokens`: from the call's acceptance estimate and the cost model,
`lookahead.RoundLookahead.budget`; no clock).

- A suffix round (the rows' trees; the model does not run, its cache catches up in a later round) where every row's
  trusted estimate reaches `suffix_threshold`, or where the policy drafts nothing by model this round (K = 0), and
  the draft's cache can still catch up in one forward afterwards (`DraftModelProposer.can_skip`; where it cannot,
  the round is the model's, of at least one token, which catches it up).
- Else the model's round: the model runs for every row (a forward feeds every row the same positions); a row whose
  suffix path (its tree's most probable chain) is trusted to give at least `model_tokens` takes its tokens first,
  as point masses (`DraftModelProposer.get_candidates(forced=...)`), and the model continues after them. A model
  round drafting a tree (`draft_shape="tree"`) forces nothing.

Exact as each drafter is: a round is either the suffix drafter's tree (the walk, with keyed draws) or the model's
proposal (its rule), chosen from committed tokens, earlier calls' outputs and counts of earlier rounds alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sequences import Sequences
from .base import DraftBudget, Proposal, Proposer
from .draft_model import DraftModelProposer
from .suffix import NO_TREE, CountedTree, SuffixProposer

PRIOR_TRUST = 0.5  # a row's first suffix estimates count at half: the store's text is not the target's own
PRIOR_WEIGHT = 2.0  # the prior counts as this many promised tokens
TRUST_DECAY = 0.85  # per suffix round of the row: the trust follows its last ~7 rounds


class SuffixThenModelProposer(Proposer):
    """Suffix trees where they promise more than the model's round, the model elsewhere (module docstring).

    Attributes:
        model: the draft model's proposer; suffix: the suffix drafter.
        promised, kept: per caller row, decayed sums of the suffix tokens its rounds' estimates promised and the
            suffix tokens the target accepted.
    """

    def __init__(self, model: DraftModelProposer, suffix: SuffixProposer):
        self.model, self.suffix = model, suffix
        self.promised: dict[int, float] = {}
        self.kept: dict[int, float] = {}
        self.offered: list[tuple[int, float, int] | None] = []  # per active row: (caller, promised, tokens offered)
        self.model_accepted = 0

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def trust(self, caller: int) -> float:
        """How much of its suffix estimates a row's rounds have kept (module docstring)."""
        promised = self.promised.get(caller, 0.0) + PRIOR_WEIGHT
        return (self.kept.get(caller, 0.0) + PRIOR_TRUST * PRIOR_WEIGHT) / promised

    def get_candidates(self, sequences: Sequences, budget: DraftBudget) -> Proposal:
        """The round's suffix trees, then a suffix round (one row, its tree worth more than the model's round) or
        the model's round with the rows' trusted suffix paths forced in (module docstring).

        Returns:
            The suffix drafter's proposal (a tree, or a chain of point masses), or the model's.
        """
        trees = self.suffix.row_trees(sequences, budget.lookup_lookahead, budget.nodes)
        callers = sequences.rows.callers()
        worth = [
            bool(tree.tokens) and self.trust(caller) * tree.expected_tokens >= budget.suffix_threshold
            for tree, caller in zip(trees, callers)
        ]
        no_model = all(worth) or (budget.lookahead == 0 and any(worth))  # no row wants the model's round
        if no_model and self.model.can_skip(sequences, budget.lookup_lookahead + 1):
            self.offered = [
                (caller, tree.expected_tokens, budget.lookup_lookahead) if tree.tokens else None
                for tree, caller in zip(trees, callers)
            ]
            return self.suffix.propose(sequences, trees)
        if no_model and budget.lookahead == 0:  # the draft is too far behind to skip again: it catches up now
            budget = budget._replace(lookahead=1)
        if budget.tree is None and budget.lookahead > 0:  # a model's chain: trusted suffix paths go in first
            paths = [self._forced_path(tree, caller, budget) for tree, caller in zip(trees, callers)]
        else:  # a model tree, or no model round: nothing is forced
            paths = [NO_TREE] * len(trees)
        self.offered = [
            (caller, path.expected_tokens, len(path.tokens)) if path.tokens else None
            for caller, path in zip(callers, paths)
        ]
        self.suffix.sources = [source if path.tokens else None for source, path in zip(self.suffix.sources, paths)]
        if not any(path.tokens for path in paths):
            return self.model.get_candidates(sequences, budget)
        forced = [torch.tensor(path.tokens, dtype=torch.long) for path in paths]
        return self.model.get_candidates(sequences, budget, forced=forced)

    def _forced_path(self, tree: CountedTree, caller: int, budget: DraftBudget) -> CountedTree:
        """A row's suffix path, cut to the model's K, where it is trusted to beat the model's tokens; else none."""
        path = tree.path(budget.lookahead)
        return path if path.tokens and self.trust(caller) * path.expected_tokens >= budget.model_tokens else NO_TREE

    def observe(self, num_accepted: Sequence[int]) -> None:
        """Each row's trust learns from its suffix tokens; the accepted tokens are counted by source."""
        from_suffix = []
        for offered, accepted in zip(self.offered, num_accepted):
            if offered is None:
                self.model_accepted += int(accepted)
                from_suffix.append(0)
                continue
            caller, promised, offered_tokens = offered
            kept = min(int(accepted), offered_tokens)
            self.promised[caller] = TRUST_DECAY * self.promised.get(caller, 0.0) + promised
            self.kept[caller] = TRUST_DECAY * self.kept.get(caller, 0.0) + kept
            self.model_accepted += int(accepted) - kept
            from_suffix.append(kept)
        self.suffix.observe(from_suffix)

    def accepted_by_source(self) -> dict[str, int]:
        return {**self.suffix.accepted_by_source(), "model": self.model_accepted}

    def finished(self, outputs: Sequence[torch.Tensor]) -> None:
        self.suffix.finished(outputs)

    def select_rows(self, rows: Sequence[int]) -> None:
        self.model.select_rows(rows)

    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        self.model.rollback_to_committed(lengths)
