"""What tree drafting does with a level's logits: processed at each parent with that parent's own prefix, then the
top choices at each parent as its children (`proposers.draft_model.DraftModelProposer.draft_tree` runs the forwards).

A parent's prefix is its row's committed tokens followed by the tokens of its path (the root's is the committed
tokens alone), so a processor that reads the prefix (repetition penalty, n-gram bans, bad words) sees at each parent
exactly what plain decoding would show it there. Parents of one level share their depth, hence their prefix length:
processors that read no token (temperature, top-k/p, min-length) run once over all of them; the others run once per
parent, each with a copy of the token buffer holding that parent's path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..options import TreeShape
from ..verify.processing import PositionwiseProcessor, RunKind
from ..verify.rejection import first_argmax


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
    """`scores` `(rows, P, vocab)` at `parents` (node indices, -1: the root) processed with each parent's prefix.

    Args:
        tokens: `(rows, capacity)` the token buffer (committed tokens up to ``lengths[b]``; not written to).
        lengths: per row, its committed length.
        shape: the tree's shape (read on the host: no device read).
        tree_tokens: `(rows, N)` the tree's tokens so far: those of every parent's path are set.
        callers: each row's caller row (`RowBook.active`).

    Returns:
        `(rows, P, vocab)` processed scores.
    """
    rows, num_parents, vocab = scores.shape
    depths = [0 if parent < 0 else shape.depths[parent] for parent in parents]
    if not any(kind is RunKind.PREFIX for kind, _ in processor.runs):  # no processor reads a token: one call
        prefix_lengths = [length + depth for length in lengths for depth in depths]
        flat = scores.reshape(rows * num_parents, 1, vocab)
        return processor(tokens, prefix_lengths, flat).reshape(rows, num_parents, vocab)
    out = torch.empty_like(scores)
    for lane, (parent, depth) in enumerate(zip(parents, depths)):
        lane_tokens = tokens if parent < 0 else _with_path(tokens, lengths, shape, tree_tokens, parent)
        prefix_lengths = [length + depth for length in lengths]
        out[:, lane : lane + 1] = processor(lane_tokens, prefix_lengths, scores[:, lane : lane + 1], callers)
    return out


def _with_path(
    tokens: torch.Tensor, lengths: Sequence[int], shape: TreeShape, tree_tokens: torch.Tensor, node: int
) -> torch.Tensor:
    """A copy of `tokens` with `node`'s path written after each row's committed tokens."""
    path = [node]
    while shape.parents[path[-1]] >= 0:
        path.append(shape.parents[path[-1]])
    depth = len(path)
    path_tokens = tree_tokens[:, path[::-1]].to(tokens.device)  # (rows, depth)
    columns = torch.tensor(list(lengths), device=tokens.device)[:, None] + torch.arange(depth, device=tokens.device)
    return tokens.clone().scatter_(1, columns, path_tokens)


def choices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """`(rows, count)` long: the indices of the `count` highest `scores` `(rows, vocab)` per row, distinct, highest
    first, ties to the lower index (so the first is `first_argmax`'s, the chain draft's greedy token)."""
    if count == 1:
        return first_argmax(scores)[:, None]
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :count]


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
