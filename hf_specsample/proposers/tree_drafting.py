"""A static draft tree (`options.TreeShape`) grown level by level (`ShapeGrowth`): a level's logits processed at each
parent with that parent's own prefix, then the top choices at each parent as its children
(`proposers.draft_model.DraftModelProposer.get_candidates` runs the forwards).

A parent's prefix is its row's committed tokens followed by the tokens of its path (the root's is the committed
tokens alone), so a processor that reads the prefix (repetition penalty, n-gram bans, bad words) sees at each parent
exactly what plain decoding would show it there (`sampling.processing.processed_at_paths`, as the verifier does at
every node).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.cached_model import CachedModel
from ..cache.tree_forward import CachedTree
from ..core.draft_tree import DraftTree
from ..core.sequences import Sequences
from ..options import TreeShape
from ..sampling.draws import first_argmax
from ..sampling.processing import PositionwiseProcessor, processed_at_paths
from .base import Growth, Proposal


class ShapeGrowth(Growth):
    """A static tree of `shape`, grown one level per draft forward (`DraftModelProposer.get_candidates`).

    The first forward gives the root's children; each later one feeds the parents of the next level's nodes with
    the tree mask (`cache.tree_forward.CachedTree`). A parent's children are the top-(rank + 1) distinct tokens of
    the draft's processed scores there (processed with the parent's own prefix: `processed_at_parents`), the scores
    a greedy chain draft takes its argmax of, also when sampling: the children are deterministic. The buffer is not
    written to. After it the draft's cache holds each row's committed tokens, the root included, then every node
    that has children, in level order (`in_cache`), until compacted.
    """

    def __init__(
        self,
        runner: CachedModel,
        processor: PositionwiseProcessor,
        sequences: Sequences,
        shape: TreeShape,
        tokens_of: torch.Tensor | None = None,
    ):
        """`shape`: the round's tree shape (cut to the room left); the rest as `Growth`'s."""
        super().__init__(runner, processor, sequences, tokens_of)
        self.shape = shape
        self.tree = DraftTree.of_shape(shape, sequences.tokens.new_zeros((sequences.num_active, shape.num_nodes)))
        self.children = children_by_parent(shape)
        self.levels = parents_of_levels(shape)
        self.depth = len(self.levels)
        self.in_cache: CachedTree | None = None  # made after the first level's forward (the root's)

    def feed(self, level: int) -> torch.Tensor:
        """`(rows, P, width)` the draft's logits at the level's parents (their nodes fed with the tree mask)."""
        assert self.in_cache is not None  # made by the first level
        return self.in_cache.feed(self.levels[level])

    def grow(self, level: int, logits: torch.Tensor) -> None:
        """The level's nodes: each parent's top choices of the draft's `(rows, P, vocab or subset)` logits there."""
        sequences, parents = self.sequences, self.levels[level]
        if level == 0:
            self.in_cache = CachedTree.after_root(self.runner, sequences, self.tree, self.shape)
        scores = processed_at_parents(
            self.processor,
            sequences.tokens,
            sequences.lengths,
            self.shape,
            self.tree.tokens,
            parents,
            logits,
            sequences.rows.active,
        )
        for lane, parent in enumerate(parents):
            kids = self.children[parent]
            index = choices(scores[:, lane], max(rank for _, rank in kids) + 1)  # (rows, ranks)
            chosen = index if self.tokens_of is None else self.tokens_of[index]
            for node, rank in kids:
                self.tree.tokens[:, node] = chosen[:, rank]

    def proposal(self) -> Proposal:
        """The tree: `(rows, N)` nodes, one draft forward per level, no distributions (deterministic children)."""
        return Proposal.of_tree(self.tree, self.depth, self.shape)


def processed_at_parents(
    processor: PositionwiseProcessor,
    tokens: torch.Tensor,
    lengths: Sequence[int],
    shape: TreeShape,
    tree_tokens: torch.Tensor,
    parents: Sequence[int],
    scores: torch.Tensor,
    callers: Sequence[int],
) -> torch.Tensor:
    """`scores` `(rows, P, vocab)` at `parents` (node indices, -1: the root) processed with each parent's prefix
    (`sampling.processing.processed_at_paths`).

    Args:
        tokens: `(rows, capacity)` the token buffer (committed tokens up to ``lengths[b]``; not written to).
        lengths: per row, its committed length.
        shape: the tree's shape (read on the host: no device read).
        tree_tokens: `(rows, N)` the tree's tokens so far: those of every parent's path are set.
        callers: each row's caller row (`RowBook.active`).

    Returns:
        `(rows, P, vocab)` processed scores.
    """
    nodes_on_paths = [_path(shape, parent) for parent in parents]  # per parent, its path's nodes, depth 1 first
    depth = max(1, max(len(path) for path in nodes_on_paths))

    def paths() -> torch.Tensor:  # (rows, P, depth), gathered by node indices known on the host
        index = [path + [path[-1] if path else 0] * (depth - len(path)) for path in nodes_on_paths]
        at = torch.tensor(index, dtype=torch.long, device=tree_tokens.device)  # (P, depth)
        return tree_tokens[:, at]

    depths = [[len(path) for path in nodes_on_paths]] * len(lengths)
    return processed_at_paths(processor, tokens, lengths, scores, callers, depths, paths)


def _path(shape: TreeShape, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = shape.parents[node]
    return path[::-1]


def choices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """`(rows, count)` long: the indices of the `count` highest `scores` `(rows, vocab)` per row, distinct, highest
    first, ties to the lower index (so the first is `first_argmax`'s, the chain draft's greedy token).

    A full sort of the vocabulary costs about 10 ms per row on the CPU over 151,936 logits. `topk` of `count + 1`
    (0.3 ms) finds the set wherever the count-th highest score is above the next one; only a tie there (scores
    masked to -inf by top-k/top-p beyond the kept ones, exact ties) takes `_tied_choices` (a few passes over the
    vocabulary). The test of that costs one host read (a sync on CUDA).
    """
    if count == 1:
        return first_argmax(scores)[:, None]
    if count >= scores.shape[-1]:
        return _tied_choices(scores, count)
    values, index = torch.topk(scores, count + 1, dim=-1)  # (rows, count + 1), highest first
    if bool((values[:, count - 1] == values[:, count]).any()) or bool(values.isnan().any()):
        return _tied_choices(scores, count)
    index = torch.sort(index[:, :count], dim=-1).values  # ascending index, then stably by score: ties to the lower
    order = torch.sort(scores.gather(1, index), dim=-1, descending=True, stable=True).indices
    return index.gather(1, order)


def _tied_choices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """`choices` where the count-th highest score ties with the next: every score above it is taken and the lowest
    indices among those equal to it fill the rest (`topk` over a key that is larger the lower the index of a taken
    score), then ordered by score. Where a row holds NaN the tokens taken are still distinct (the tree rule needs
    distinct siblings), though not the top ones."""
    rows, vocab = scores.shape
    count = min(count, vocab)
    kth = torch.topk(scores, count, dim=-1).values[:, -1:]  # (rows, 1)
    above = scores > kth
    tied = scores == kth
    wanted_ties = count - above.sum(dim=-1, keepdim=True)
    taken = above | (tied & (tied.cumsum(dim=-1) <= wanted_ties))  # exactly `count` per row without NaN
    key = torch.where(taken, torch.arange(vocab, 0, -1, device=scores.device), 0)
    index = torch.topk(key, count, dim=-1).indices  # (rows, count), ascending index among the taken
    order = torch.sort(scores.gather(1, index), dim=-1, descending=True, stable=True).indices
    return index.gather(1, order)


def children_by_parent(shape: TreeShape) -> dict[int, list[tuple[int, int]]]:
    """Per parent node (-1: the root), its children as (node, rank)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for node, (parent, rank) in enumerate(zip(shape.parents, shape.ranks)):
        children.setdefault(parent, []).append((node, rank))
    return children


def parents_of_levels(shape: TreeShape) -> list[list[int]]:
    """Per level (depth 1 first), the parents of its nodes, in node order (the root, -1, for depth 1): one draft
    forward per level feeds that level's parents."""
    return [sorted({shape.parents[node] for node in level}) for level in shape.levels()]
