"""The exact verification rule of a draft tree with deterministic children, as pure tensor functions.

No model code lives here: every function takes the target's probabilities (or argmax tokens) at the tree's
positions, the `DraftTree` and the round's draws, and returns tokens. Words as in `draft_tree` (root, node, depth,
path) and `verify.rejection` (accepted, bonus, point mass).

The rule (SGLang's ``tree_speculative_sampling_target_only`` with its thresholds at 1, EAGLE-2's
``evaluate_posterior``): start at the root; draw a token from the target's processed distribution there; if it is
one of the current node's children, accept that child and descend into it; otherwise emit the drawn token and end
the round. At a leaf every draw ends the round: the drawn token is the bonus token. Every emitted token is then the
target's own draw given its prefix, whatever the tree (its children chosen without looking at the draws, siblings
distinct). Greedy is the same walk with the target's argmax as the draw.

Positions: the target scores N + 1 positions of a tree of N nodes, index 0 the root (the distribution of the first
new token) and index i + 1 node i (the distribution after node i's token, given its path).

The draws: one uniform per depth level per row, `(rows, max_depth + 1, 1)` float64 (`draws.sample_uniform`),
level d's draw made at the node where the walk stands after d accepted nodes, by `draws.sample_from_weights`
(inverse CDF). The walk runs over the levels on the device, vectorised over rows, with no host read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.draft_tree import DraftTree
from ..sampling.draws import sample_from_weights
from .rejection import Verdict

Draw = Callable[[int, torch.Tensor], torch.Tensor]  # (level, position index (rows,)) -> drawn token (rows,)


def walk(tree: DraftTree, draw: Draw, max_depth: int) -> Verdict:
    """The rule's walk down each row's tree, from a draw at each level (module docstring).

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`, siblings distinct.
        draw: called once per level ``0 .. max_depth`` with the level and the `(rows,)` long position index where
            each row stands (0: the root, i + 1: node i; a row that has ended stands where it ended), returns the
            `(rows,)` long token drawn there (only the rows still walking use it).
        max_depth: the deepest node's depth (a node deeper is never reached).

    Returns:
        The `Verdict` with the accepted path and its tokens (`num_accepted` without `NonFinite` codes).
    """
    rows, nodes = tree.tokens.shape
    device = tree.tokens.device
    current = torch.full((rows,), -1, dtype=torch.long, device=device)  # node where each row stands, -1: the root
    walking = torch.ones((rows,), dtype=torch.bool, device=device)
    path = torch.full((rows, max_depth), -1, dtype=torch.long, device=device)
    next_tokens = torch.zeros((rows,), dtype=torch.long, device=device)
    for level in range(max_depth + 1):
        drawn = draw(level, current + 1)  # (rows,)
        if level < max_depth and nodes > 0:
            # the current node's child carrying the drawn token; siblings are distinct, so at most one
            match = (tree.parents == current[:, None]) & (tree.tokens == drawn[:, None])  # (rows, N)
            descend = match.any(dim=-1) & walking  # (rows,)
            child = match.long().argmax(dim=-1)  # (rows,) the first match (any index where none)
            path[:, level] = torch.where(descend, child, -1)
        else:  # a leaf's draw always ends the walk (the bonus token)
            descend = torch.zeros_like(walking)
            child = current
        next_tokens = torch.where(walking & ~descend, drawn, next_tokens)
        current = torch.where(descend, child, current)
        walking = descend
    num_accepted = (path >= 0).sum(dim=-1)  # (rows,)
    on_path = tree.tokens.gather(1, path.clamp(min=0)) if nodes > 0 else path * 0  # (rows, max_depth)
    accepted_tokens = torch.where(path >= 0, on_path, next_tokens[:, None])
    return Verdict(num_accepted, next_tokens, path, accepted_tokens)


def tree_accept(tree: DraftTree, target_probs: torch.Tensor, draws: torch.Tensor) -> Verdict:
    """Verify each row's tree so that the committed tokens follow `target_probs` exactly (module docstring).

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`.
        target_probs: `(rows, N + 1, vocab)` the target's processed probabilities (index 0: the root, i + 1: node i).
        draws: `(rows, max_depth + 1, 1)` float64 uniforms in [0, 1) (`draws.sample_uniform`), one per level;
            their count sets the walk's depth, `max_depth`, which must reach the tree's deepest node.

    Returns:
        The `Verdict`; the caller flags NaN/inf distributions with `rejection.flag_nonfinite`.
    """
    rows, nodes = tree.tokens.shape
    assert target_probs.shape[:2] == (rows, nodes + 1), f"target_probs {tuple(target_probs.shape)}, {nodes} nodes"
    assert draws.dim() == 3 and draws.shape[0] == rows and draws.shape[2] == 1, f"draws {tuple(draws.shape)}"
    index = torch.arange(rows, device=target_probs.device)

    def draw(level: int, position: torch.Tensor) -> torch.Tensor:
        return sample_from_weights(target_probs[index, position], uniform=draws[:, level])

    return walk(tree, draw, draws.shape[1] - 1)


def greedy_accept(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int | None = None) -> Verdict:
    """Greedy verification: descend while the target's argmax is a child, then take the target's argmax, so the
    committed tokens are exactly the target's greedy continuation.

    Args:
        tree: the round's tree, tokens `(rows, N)`; a chain (`DraftTree.chain`) keeps its leading run of tokens equal
            to the target's argmax, the walk's result without the walk's loop over levels.
        target_tokens: `(rows, N + 1)` long, the target's argmax at each position (`draws.first_argmax`: ties go to
            the first id).
        max_depth: a tree's deepest node's depth (None: a chain's N).

    Returns:
        The `Verdict` (a tree's with its path and path tokens).
    """
    rows, nodes = tree.tokens.shape
    assert target_tokens.shape == (rows, nodes + 1), f"target_tokens {tuple(target_tokens.shape)}, {nodes} nodes"
    if tree.parents is None:
        matches = tree.tokens == target_tokens[:, :nodes]  # (rows, N)
        num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # (rows,)
        return Verdict(num_accepted, target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1))
    depth = nodes if max_depth is None else max_depth
    return walk(tree, lambda level, position: target_tokens.gather(1, position[:, None])[:, 0], depth)
