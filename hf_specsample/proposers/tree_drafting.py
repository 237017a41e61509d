"""What tree drafting does with a level's logits: processed at each parent with that parent's own prefix, then the
top choices at each parent as its children (`proposers.draft_model.DraftModelProposer.draft_tree` runs the forwards).

A parent's prefix is its row's committed tokens followed by the tokens of its path (the root's is the committed
tokens alone), so a processor that reads the prefix (repetition penalty, n-gram bans, bad words) sees at each parent
exactly what plain decoding would show it there (`sampling.processing.processed_at_paths`, as the verifier does at
every node).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..options import TreeShape
from ..sampling.draws import first_argmax
from ..sampling.processing import PositionwiseProcessor, processed_at_paths


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
