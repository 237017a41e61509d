"""A draft model's trees, grown level by level (`proposers.draft_model.DraftModelProposer.get_candidates` runs the
forwards): a static tree (`options.TreeShape`, `ShapeGrowth`) or each row's own dynamic tree (`options.DynamicTree`,
`DynamicGrowth`). Either way a parent's children are the draft's top choices there (`choices`): deterministic.

**Static.** A level's logits are processed at each parent with that parent's own prefix, then the top choices at each
parent become its children.

A parent's prefix is its row's committed tokens followed by the tokens of its path (the root's is the committed
tokens alone), so a processor that reads the prefix (repetition penalty, n-gram bans, bad words) sees at each parent
exactly what plain decoding would show it there (`sampling.processing.processed_at_paths`, as the verifier does at
every node).

**Dynamic** (EAGLE-2): each row grows its own tree per round from the draft's probabilities.

Every node drafted goes into the round's pool, a `DraftTree` of `DynamicTree.drafted` nodes per row in blocks, one
block per level: the root's top-`expand` children, then per later level the top-`expand` children of each of the
level before's `expand` best nodes (its frontier). A node's value is its cumulative draft log-probability (the sum
along its path of the log-softmax of the draft's processed scores at each parent). Each block is sorted by value,
best first, so a level's frontier is the first `expand` nodes of its block in every row: the draft feeds the same pool
indices in every row (each row's own nodes there, its own parents: `CachedTree.set_parents`).

After the last level the best `DynamicTree.nodes` of the pool are kept (`KeptNodes`), re-indexed in level order per
row: the tree the target verifies. A node's value is at most its parent's (log-probabilities are at most 0) and ties
go to the lower pool index (a parent's block comes first), so the kept nodes are ancestor-closed. Nothing here reads
the target: the tree is the draft's deterministic choice, and the tree rule stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.cached_model import CachedModel
from ..cache.tree_forward import CachedTree
from ..core.draft_tree import DraftTree
from ..core.sequences import Sequences
from ..options import DynamicTree, TreeShape
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


class DynamicPool:
    """Every node a round's dynamic tree drafted, per row (module docstring).

    Attributes:
        spec: the round's `DynamicTree` (cut to the room left).
        tree: the pool, `(rows, drafted)` tokens, parents (per row) and depths, level order.
        values: `(rows, drafted)` float32, each node's cumulative draft log-probability.
        starts: per level (depth 1 first), its block's first pool index.
        levels: the levels drafted so far.
    """

    def __init__(self, spec: DynamicTree, rows: int, device: torch.device):
        self.spec = spec
        expand, size = spec.expand, spec.drafted
        self.starts = [0] + [expand + level * expand**2 for level in range(spec.depth - 1)]
        sizes = [expand] + [expand**2] * (spec.depth - 1)
        depths = torch.cat([torch.full((n,), level + 1, dtype=torch.long) for level, n in enumerate(sizes)])
        self.parents = torch.full((rows, size), -1, dtype=torch.long, device=device)  # (rows, pool size)
        self.depths = depths.to(device).expand(rows, -1)  # (rows, pool size)
        tokens = torch.zeros((rows, size), dtype=torch.long, device=device)
        self.tree = DraftTree(tokens, self.parents, self.depths)  # the pool as a tree, its tensors shared
        self.values = torch.full((rows, size), float("-inf"), dtype=torch.float32, device=device)
        self.levels = 0

    def frontier(self) -> list[int]:
        """The pool indices the next level expands: the first `expand` of the last block (its best, in every row)."""
        start = self.starts[self.levels - 1]
        return list(range(start, start + self.spec.expand))

    def add_level(self, scores: torch.Tensor, tokens_of: torch.Tensor | None = None) -> None:
        """Draft the next level from the draft's processed `scores` `(rows, F, vocab)` at the root (F = 1, level 1)
        or at the frontier (F = `expand`, in `frontier()` order): each one's top-`expand` tokens as its children.

        Args:
            tokens_of: `(vocab,)` the token id each score column stands for (a compact vocabulary); None: itself.
        """
        rows, parents, vocab = scores.shape
        expand = self.spec.expand
        index = choices(scores.reshape(rows * parents, vocab), expand).reshape(rows, parents, expand)
        # <= 0 (rounding aside): a child's value never exceeds its parent's; NaN (a broken draft) ranks last
        log_probs = torch.log_softmax(scores.float(), dim=-1).gather(2, index).clamp(max=0.0)
        if self.levels == 0:
            parent_nodes = torch.full((rows, 1), -1, dtype=torch.long, device=scores.device)
            parent_values = torch.zeros((rows, 1), dtype=torch.float32, device=scores.device)
        else:
            frontier = self.frontier()
            parent_nodes = torch.arange(frontier[0], frontier[-1] + 1, device=scores.device).expand(rows, -1)
            parent_values = self.values[:, frontier[0] : frontier[-1] + 1]
        values = (parent_values[:, :, None] + log_probs).reshape(rows, -1)
        values = values.masked_fill(values.isnan(), float("-inf"))
        order = torch.sort(values, dim=1, descending=True, stable=True).indices  # (rows, F * expand) best first
        tokens = index.reshape(rows, -1) if tokens_of is None else tokens_of[index.reshape(rows, -1)]
        start = self.starts[self.levels]
        block = slice(start, start + order.shape[1])
        self.tree.tokens[:, block] = tokens.gather(1, order)
        self.parents[:, block] = parent_nodes.repeat_interleave(expand, dim=1).gather(1, order)
        self.values[:, block] = values.gather(1, order)
        self.levels += 1

    def kept(self) -> tuple[DraftTree, torch.Tensor]:
        """The best `spec.num_nodes` nodes of each row's pool, re-indexed in level order.

        Returns:
            The kept `DraftTree` `(rows, N)` (parents per row, in its own indices), and `(rows, N)` long: each kept
            node's pool index (ascending).
        """
        rows, size = self.values.shape
        count = self.spec.num_nodes
        # ties to the lower pool index: a parent (its value >= its child's, its block earlier) always comes first
        best = torch.sort(self.values, dim=1, descending=True, stable=True).indices[:, :count]
        kept = best.sort(dim=1).values  # (rows, N) pool order is level order
        new_index = torch.full((rows, size + 1), -1, dtype=torch.long, device=kept.device)  # column size: the root
        new_index.scatter_(1, kept, torch.arange(count, device=kept.device).expand(rows, -1))
        pool_parents = self.parents.gather(1, kept)
        parents = new_index.gather(1, torch.where(pool_parents < 0, size, pool_parents))
        tree = DraftTree(self.tree.tokens.gather(1, kept), parents, self.depths.gather(1, kept))
        return tree, kept


class DynamicGrowth(Growth):
    """Each row's dynamic tree, grown one level per draft forward (`DraftModelProposer.get_candidates`):
    `spec.depth` forwards, the first at the root, each later one over the frontier's `spec.expand` nodes with the
    tree mask; the best `spec.num_nodes` nodes of the pool are kept.

    After it the draft's cache holds each row's committed tokens, the root included, then every frontier node fed, in
    the order fed (`in_cache`, over the pool's indices), until compacted. Each level after the first reads its
    frontier's parents on the host, for the tree mask: on an accelerator, one `(rows, expand)` device read (a sync)
    per level.
    """

    def __init__(
        self,
        runner: CachedModel,
        processor: PositionwiseProcessor,
        sequences: Sequences,
        spec: DynamicTree,
        tokens_of: torch.Tensor | None = None,
    ):
        """`spec`: the round's dynamic tree (cut to the room left); the rest as `Growth`'s."""
        super().__init__(runner, processor, sequences, tokens_of)
        self.pool = DynamicPool(spec, sequences.num_active, sequences.tokens.device)
        self.depth = spec.depth
        self.cached: CachedTree | None = None  # the pool in the draft's cache, from the first level's forward
        self.in_cache: KeptNodes | None = None  # the kept nodes, once proposed

    def feed(self, level: int) -> torch.Tensor:  # noqa: ARG002 (the pool knows its frontier)
        """`(rows, expand, width)` the draft's logits at the frontier (fed with the tree mask)."""
        assert self.cached is not None  # made by the first level
        frontier = self.pool.frontier()
        self.cached.set_parents(frontier, self.pool.parents[:, frontier].cpu())  # the sync named above
        return self.cached.feed(frontier)

    def grow(self, level: int, logits: torch.Tensor) -> None:
        """The level's block of the pool from the draft's `(rows, F, vocab or subset)` logits at the root (level 0)
        or the frontier, processed with each node's own prefix."""
        sequences, pool = self.sequences, self.pool
        tokens, lengths, callers = sequences.tokens, sequences.lengths, sequences.rows.active
        if level == 0:
            self.cached = CachedTree.after_root(self.runner, sequences, pool.tree, grows=True)
            scores = self.processor(tokens, lengths, logits, callers)
        else:
            scores = processed_at_frontier(self.processor, tokens, lengths, pool, logits, callers)
        pool.add_level(scores, self.tokens_of)

    def proposal(self) -> Proposal:
        """The kept tree: `(rows, N)` nodes, one draft forward per level, no distributions."""
        assert self.cached is not None  # a dynamic tree has one level at least
        tree, kept = self.pool.kept()
        self.in_cache = KeptNodes(self.cached, kept)
        return Proposal.of_tree(tree, self.depth, None)


class KeptNodes:
    """A dynamic tree's pool in the draft's cache (`CachedTree` over the pool's indices), compacted along a path of
    the kept tree's indices."""

    def __init__(self, cached: CachedTree, kept: torch.Tensor):
        """
        Args:
            cached: the pool's nodes in the draft's cache (the frontier nodes it fed).
            kept: `(rows, N)` long, each kept node's pool index (`DynamicPool.kept`).
        """
        self.cached, self.kept = cached, kept

    def compact(self, path: torch.Tensor, counts: Sequence[int]) -> None:
        """`CachedTree.compact` along `path` `(rows, D)` of kept-tree indices (-1 after `counts[b]`): each path node
        as its pool index, whose slot is wherever the draft fed it (or none: a node never fed, a leaf)."""
        kept = self.kept.cpu()  # a device read on an accelerator, beside the path's (`SpeculativeDecoder.keep_path`)
        path = path.cpu()
        pool_path = torch.where(path >= 0, kept.gather(1, path.clamp(min=0)), -1)
        self.cached.compact(pool_path, counts)


def processed_at_frontier(
    processor: PositionwiseProcessor,
    tokens: torch.Tensor,
    lengths: Sequence[int],
    pool: DynamicPool,
    scores: torch.Tensor,
    callers: Sequence[int],
) -> torch.Tensor:
    """`scores` `(rows, F, vocab)` at the pool's frontier (`pool.frontier()`, each row's own nodes) processed with
    each node's own prefix: the row's committed tokens, then the node's path (`sampling.processing.processed_at_paths`).

    Args:
        tokens: `(rows, capacity)` the token buffer (committed tokens up to ``lengths[b]``; not written to).
        lengths: per row, its committed length.
        callers: each row's caller row (`RowBook.active`).

    Returns:
        `(rows, F, vocab)` processed scores.
    """
    rows, count, _ = scores.shape
    depth = pool.levels  # the frontier's depth: every frontier node sits on the last level drafted
    depths = [[depth] * count] * rows

    def paths() -> torch.Tensor:  # (rows, F, depth): made only where a processor reads tokens
        return frontier_paths(pool.tree, pool.frontier(), depth)

    return processed_at_paths(processor, tokens, lengths, scores, callers, depths, paths)


def frontier_paths(tree: DraftTree, nodes: Sequence[int], depth: int) -> torch.Tensor:
    """`(rows, len(nodes), depth)` long: the tokens on each row's path to `nodes` (all at `depth`), depth 1 first."""
    rows = tree.tokens.shape[0]
    at = torch.tensor(list(nodes), dtype=torch.long, device=tree.tokens.device).expand(rows, -1)
    steps = []
    assert tree.parents is not None  # a tree's
    for _ in range(depth):  # up from the nodes, one parent a step
        steps.append(tree.tokens.gather(1, at))
        at = tree.parents.gather(1, at).clamp(min=0)
    return torch.stack(steps[::-1], dim=2)
