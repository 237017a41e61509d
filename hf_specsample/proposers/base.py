"""The contract every drafter implements (`Proposer`) and what it hands the verifier each round (`Proposal`).

Three members: `get_candidates` as in transformers' `CandidateGenerator`, batched over rows of different lengths
and returning what exactness needs (the distributions the draft tokens were drawn from); `rollback_to_committed` where
transformers has `update_candidate_strategy` (roll back to the committed lengths); `forward_passes`. A token
drawn with certainty (a suffix or lookup continuation, a suffix token forced into a model's proposal, a greedy draft)
is a point mass and travels as its id alone, never as a one-hot row over the vocabulary (`verify/rules.py`
handles it as such). Choosing K is not a drafter's business: `lookahead.RoundLookahead` decides it, and the drafter
drafts what it is told (`DraftBudget`, made by `lookahead.RoundLookahead`).

Drafters: `proposers.draft_model.DraftModelProposer` (a draft model), `proposers.suffix.SuffixProposer` (trees of what
followed the rows' last tokens in the call and in earlier calls' outputs; prompt lookup is it over each row's own
text), `proposers.suffix_then_model.SuffixThenModelProposer` (both).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..cache.cached_model import CachedModel
from ..core.draft_tree import DraftTree
from ..core.sequences import Sequences
from ..options import DynamicTree, TreeShape
from ..sampling.processing import PositionwiseProcessor


class DraftBudget(NamedTuple):
    """How many tokens a round may draft, decided by `RoundLookahead` alone; each drafter reads its own field.

    Attributes:
        lookahead: K, the tokens a draft model drafts (the policy's choice, capped by the room left).
        lookup_lookahead: the deepest a suffix drafter's (or lookup's) round may be: K when drafting by lookup alone,
            ``max(K, N)`` (capped by the room left) with a model draft and `prompt_lookup_num_tokens=N`, else 0.
        tree: the tree a draft model drafts this round instead of a chain, K its depth; None: a chain.
        nodes: the most nodes a suffix drafter's tree offers a row (`proposers.suffix`; depth: `lookup_lookahead`).
        suffix_threshold: beside a draft model, the expected accepted tokens a row's suffix tree must offer for a
            suffix round to be worth the model's round (`proposers.suffix_then_model`).
        model_tokens: beside a draft model, the draft tokens its round of K is expected to have accepted per row (a
            suffix path forced into it must promise at least as many).
    """

    lookahead: int
    lookup_lookahead: int
    tree: TreeShape | DynamicTree | None = None
    nodes: int = 0
    suffix_threshold: float = 0.0
    model_tokens: float = 0.0


class Proposal(NamedTuple):
    """A round's draft, a tree of N nodes per row (a chain of K tokens: node k's parent is node k - 1), and the
    distributions its tokens were drawn from.

    Attributes:
        tokens: `(batch, N)` long, each node's token; a chain's are also written into the buffer after each row's
            committed tokens.
        probs: a chain's `(batch, K, vocab)` float32, the distributions `tokens` were drawn from, over the target's
            ids; None when every token is a point mass (a lookup proposal, a greedy draft, no token at all) or for a
            tree (its children are the draft's top choices: deterministic).
        point_mass: `(batch, K)` bool, True where a token is a point mass although `probs` is given (a forced
            suffix token in a model's proposal): the verifier ignores `probs` there. None: no such position.
        model_steps: draft-model forwards run for it (0: no model ran, e.g. a lookup proposal).
        parents, depths: a tree's `(batch, N)` long parents (-1: the root) and depths (`core.draft_tree.DraftTree`);
            None: a chain.
        shape: the tree's static shape (`DraftBudget.tree`: its depths known on the host), or None (a chain, or a
            dynamic tree: each row's own).
        depth: a tree's depth (None: a chain, whose depth is its K).
        forced_levels: a chain's levels that a grammar forced in every row, proposed without a draft forward
            (`ChainGrowth.take_forced`; point masses).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    point_mass: torch.Tensor | None = None
    model_steps: int = 0
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    shape: TreeShape | None = None
    depth: int | None = None
    forced_levels: tuple[int, ...] = ()

    @classmethod
    def of_tree(cls, tree: DraftTree, depth: int, shape: TreeShape | None) -> Proposal:
        """A drafted tree as the round's proposal: one draft forward per level, no distributions (its children are
        the draft's top choices)."""
        return cls(
            tree.tokens, None, model_steps=depth, parents=tree.parents, depths=tree.depths, shape=shape, depth=depth
        )

    @property
    def tree(self) -> DraftTree:
        """The draft as a `DraftTree` (a chain's parents and depths implied)."""
        return DraftTree(self.tokens, self.parents, self.depths)

    @property
    def lookahead(self) -> int:
        """The most draft tokens a row can accept: a chain's K, a tree's depth."""
        return self.tokens.shape[1] if self.depth is None else self.depth


class Proposer(ABC):
    """A drafter: proposes draft tokens after every active row's committed tokens, once per round.

    The loop (`decoding.SpeculativeDecoder`) calls, per round: `get_candidates` (before the target's forward), then,
    after the round's tokens are committed, `select_rows` where rows finished and `rollback_to_committed` with the
    rows' new lengths (only while rows remain). It reads `forward_passes` once, for the statistics, at the end.
    """

    @property
    @abstractmethod
    def forward_passes(self) -> int:
        """Draft-model forwards run so far in this call (0 for a drafter that runs no model)."""

    @abstractmethod
    def get_candidates(self, sequences: Sequences, budget: DraftBudget) -> Proposal:
        """Write this round's draft tokens after every active row's committed tokens and return them.

        Args:
            sequences: the call's token buffer: `tokens` `(batch, capacity)`, the committed `lengths` per active
                row. The proposal's ``K`` tokens of each row are written at columns ``lengths[b] .. lengths[b]+K-1``
                (`Sequences.write`); the committed lengths do not move.
            budget: how many tokens this round may draft, already capped by the room left before `max_length`
                (`lookahead.RoundLookahead.budget`): a model drafts `budget.lookahead`, a lookup at most
                `budget.lookup_lookahead`; 0 drafts nothing.

        Returns:
            A `Proposal` with `(batch, K)` tokens, ``K`` at most the budget's (all rows the same ``K``).
        """

    @abstractmethod
    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only the active `rows` (ascending indices into the active rows) of any per-row state (a draft's
        cache), as the loop drops finished rows."""

    @abstractmethod
    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        """Forget what the round drafted beyond the committed tokens (roll a draft's cache back).

        Args:
            lengths: per active row (after the round's finished rows were dropped), its committed length.
        """

    def observe(self, num_accepted: Sequence[int]) -> None:  # noqa: B027 (optional hook)
        """The round's accepted draft tokens, per row active in it (before finished rows are dropped)."""

    def accepted_by_source(self) -> dict[str, int]:
        """Draft tokens accepted so far, by where the drafter found them (`SpeculativeStats.suffix_accepted_tokens`);
        empty for a drafter with one source."""
        return {}

    def finished(self, outputs: Sequence[torch.Tensor]) -> None:  # noqa: B027 (optional hook)
        """The call ended without error: per caller row, its new tokens `(new,)` long (a drafter that learns from
        earlier calls keeps them)."""


class Growth(ABC):
    """How a draft model's round grows, level by level (`DraftModelProposer.get_candidates` runs the one loop: the
    first level's forward catches the cache up with the committed tokens, each later one is `feed`).

    Attributes:
        depth: the levels (draft forwards): a chain's K, a tree's depth.
        in_cache: what of the round the draft's cache holds beyond the committed tokens until compacted (a tree's
            fed nodes), or None (a chain's drafts become committed positions or are rolled back).
    """

    depth: int
    in_cache: Any = None

    def __init__(
        self,
        runner: CachedModel,
        processor: PositionwiseProcessor,
        sequences: Sequences,
        tokens_of: torch.Tensor | None = None,
    ):
        """
        Args:
            runner: the draft and its cache.
            processor: the call's processors (applied with each position's target-id prefix).
            sequences: the target's rows (the committed tokens).
            tokens_of: `(subset,)` the target id each score column stands for (a compact vocabulary); None: itself.
        """
        self.runner, self.processor, self.sequences, self.tokens_of = runner, processor, sequences, tokens_of

    def take_forced(self, level: int) -> bool:  # noqa: ARG002 (a chain's)
        """Grow `level` without a forward where the processors allow one token only (a grammar's forced run);
        whether it did."""
        return False

    @abstractmethod
    def feed(self, level: int) -> torch.Tensor:
        """`(rows, F, width)` the draft's logits at the parents of `level` (>= 1): fed with the shape's mask."""

    @abstractmethod
    def grow(self, level: int, logits: torch.Tensor) -> None:
        """Choose the nodes of `level` from the draft's `(rows, F, vocab or subset)` logits at its parents."""

    @abstractmethod
    def proposal(self) -> Proposal:
        """The round's draft, once every level has grown."""
