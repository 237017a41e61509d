"""A round that drafts a tree (`SpeculativeConfig.draft_shape`): the draft's tree, the target's one forward over its
root and every node, the tree rule's verdict, and both caches cut down to the accepted path.

It hands the loop what a chain's round hands it: a `Proposal` whose tokens are the accepted path (written into the
buffer after each row's committed tokens, as a chain's drafts are) and a `Verdict` (the accepted count and the
target's draw where the walk ended). Committing, stopping, streaming, recording and rolling back are then the
chain's (`decoding.SpeculativeDecoder.commit`).

A sampling call's draws are keyed by (the call's key, the caller row, the buffer position), `sampling.keyed_draws`:
the tree rounds' (`TreeVerifier`) and those of the rounds of a tree call that draft nothing (the room is 0, or a
first round whose prompt ends in padding: a chain round of K = 0, its one token drawn with `root_draws`). So every
token of the call is the target's draw at its position with that position's uniform, whatever the draft drafted.
"""

from __future__ import annotations

import torch

from ..cache import tree_forward
from ..cache.cached_model import CachedModel
from ..core.draft_tree import DraftTree, RankCounts, rank_observations
from ..core.sequences import Sequences
from ..options import DynamicTree, TreeShape
from ..proposers.base import Proposal
from ..proposers.draft_model import DraftModelProposer
from ..sampling.keyed_draws import keyed_uniforms, positions_from
from ..sampling.processing import PositionwiseProcessor
from .rejection import Verdict
from .tree_verifier import TreeVerifier, along_path


class TreeRound:
    """Draft, verify and compact one tree per active row (module docstring)."""

    def __init__(
        self,
        drafter: DraftModelProposer,
        target: CachedModel,
        verifier: TreeVerifier,
        keep_raw_logits: bool,
    ):
        """
        Args:
            drafter: the draft model's proposer (trees are drafted by a draft model only).
            target: the target and its cache.
            verifier: the call's tree verifier (processors at every node with its own path).
            keep_raw_logits: the recorder keeps raw logits (`output_logits=True`): hand back those along the path.
        """
        self.drafter, self.target, self.verifier = drafter, target, verifier
        self.keep_raw_logits = keep_raw_logits

    @classmethod
    def for_call(
        cls,
        drafter: DraftModelProposer,
        target: CachedModel,
        processor: PositionwiseProcessor,
        do_sample: bool,
        generator: torch.Generator | None,
        keep: set[str],
    ) -> TreeRound:
        """A call's tree rounds, verified with the chain's processors (`processor`); a sampling call's key is drawn
        once, from `generator` (else the global generator), by `TreeVerifier.for_call`.

        Args:
            keep: what the recorder keeps: "scores" (`output_scores`), "logits" (`output_logits`).
        """
        verifier = TreeVerifier.for_call(processor, do_sample, generator, "scores" in keep)
        return cls(drafter, target, verifier, "logits" in keep)

    def root_draws(self, sequences: Sequences) -> torch.Tensor | None:
        """`(batch, 1)` float64, the keyed uniforms of a round of this call that drafts nothing (K = 0): each row's
        at its committed length, where its one token goes; None for greedy (nothing is drawn)."""
        if self.verifier.key is None:
            return None
        device = sequences.tokens.device
        rows = torch.tensor(sequences.rows.callers(), dtype=torch.long, device=device)
        return keyed_uniforms(self.verifier.key, rows, positions_from(sequences.lengths, 1, device))[:, 0]

    def draft(self, sequences: Sequences, shape: TreeShape | DynamicTree) -> DraftTree:
        """Each row's tree of the round's `shape` (`DraftBudget.tree`: the call's tree or auto's, cut to the room
        the round has)."""
        return self.drafter.draft_tree(sequences, shape).tree

    def verify(
        self, sequences: Sequences, shape: TreeShape | DynamicTree, tree: DraftTree
    ) -> tuple[Proposal, Verdict, torch.Tensor | None, torch.Tensor | None, RankCounts]:
        """The target's forward over the root and the nodes, the verdict, the path written into the buffer, and both
        caches compacted to it.

        Returns:
            A `Proposal` of `(batch, D)` accepted tokens (D: the tree's depth; past a row's accepted count, its next
            token), the `Verdict`, the `(batch, D + 1, vocab)` processed scores and raw logits at the root and
            along the accepted path where the recorder keeps them (else None), and what the rows' walks say of the
            draft's ranks (`draft_tree.rank_observations`, for `draft_shape="auto"`'s choice; empty for a dynamic tree).
        """
        lengths = sequences.lengths
        # None (a dynamic tree): each row's parents and depths are read off `tree` for the mask and the processors'
        # prefixes, on an accelerator two small device reads (syncs) a round besides the path's
        static = shape if isinstance(shape, TreeShape) else None
        # Logits verified in several row chunks are made chunk by chunk (`cache.output_head`), unless recorded.
        chunks = self.verifier.chunks(len(lengths), tree.num_nodes + 1, self.target.facts.logit_width)
        with self.target.head.deferred(len(chunks) > 1 and not self.keep_raw_logits):
            logits, in_target = tree_forward.feed_tree(self.target, sequences, tree, static)  # (batch, N + 1, vocab)
        made = self.target.head.take(logits)
        verdict, scores = self.verifier(sequences.tokens, lengths, made, sequences.rows.active, tree, static)
        raw = along_path(logits, verdict.path) if self.keep_raw_logits else None
        del logits, made
        for depth in range(verdict.accepted_tokens.shape[1]):  # the path into the buffer, as a chain's drafts
            sequences.write(depth, verdict.accepted_tokens[:, depth])
        # The round's second host read (the loop's `read_round` is the first): the compactions need each row's path
        # on the host before rows stop and caches roll back. A NaN/inf verdict is raised by that read.
        path = verdict.path.cpu()
        counts = (path >= 0).sum(dim=1).tolist()
        in_target.compact(path, counts)
        self.drafter.compact_tree(path, counts)
        proposal = Proposal(tokens=verdict.accepted_tokens, probs=None, model_steps=shape.max_depth)
        # auto designs static trees; a dynamic tree's ranks are its own: none recorded
        ranks = rank_observations(static, path) if static is not None else RankCounts((), ())
        return proposal, Verdict(verdict.num_accepted, verdict.next_tokens), scores, raw, ranks
