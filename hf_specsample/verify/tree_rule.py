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
from typing import NamedTuple

import torch

from ..core.draft_tree import DraftTree
from ..sampling.draws import sample_from_weights
from .rejection import NonFinite


class TreeVerdict(NamedTuple):
    """Outcome of one tree's verification for every row.

    Attributes:
        path: `(rows, max_depth)` long, the accepted nodes' indices from depth 1 down, -1 after the last.
        num_accepted: `(rows,)` long, the accepted nodes (the path's length), in ``[0, max_depth]``; carries
            `NonFinite` codes where `flag_tree_nonfinite` found the target's distribution NaN/inf on the way.
        next_tokens: `(rows,)` long, the target's draw where the walk ended: the token that ended the round, or the
            bonus token at a leaf.
        accepted_tokens: `(rows, max_depth)` long, the path's tokens, padded with the row's next token after the
            last accepted one: ``cat([accepted_tokens, next_tokens[:, None]], 1)[:, : num_accepted + 1]`` are the
            round's committed tokens, as a chain's accepted drafts and its next token.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    accepted_tokens: torch.Tensor


Draw = Callable[[int, torch.Tensor], torch.Tensor]  # (level, position index (rows,)) -> drawn token (rows,)


def walk(tree: DraftTree, draw: Draw, max_depth: int) -> TreeVerdict:
    """The rule's walk down each row's tree, from a draw at each level (module docstring).

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`, siblings distinct.
        draw: called once per level ``0 .. max_depth`` with the level and the `(rows,)` long position index where
            each row stands (0: the root, i + 1: node i; a row that has ended stands where it ended), returns the
            `(rows,)` long token drawn there (only the rows still walking use it).
        max_depth: the deepest node's depth (a node deeper is never reached).

    Returns:
        The `TreeVerdict` (`num_accepted` without `NonFinite` codes).
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
    return TreeVerdict(path, num_accepted, next_tokens, accepted_tokens)


def tree_accept(tree: DraftTree, target_probs: torch.Tensor, draws: torch.Tensor) -> TreeVerdict:
    """Verify each row's tree so that the committed tokens follow `target_probs` exactly (module docstring).

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`.
        target_probs: `(rows, N + 1, vocab)` the target's processed probabilities (index 0: the root, i + 1: node i).
        draws: `(rows, max_depth + 1, 1)` float64 uniforms in [0, 1) (`draws.sample_uniform`), one per level;
            their count sets the walk's depth, `max_depth`, which must reach the tree's deepest node.

    Returns:
        The `TreeVerdict`; the caller flags NaN/inf distributions with `flag_tree_nonfinite`.
    """
    rows, nodes = tree.tokens.shape
    assert target_probs.shape[:2] == (rows, nodes + 1), f"target_probs {tuple(target_probs.shape)}, {nodes} nodes"
    assert draws.dim() == 3 and draws.shape[0] == rows and draws.shape[2] == 1, f"draws {tuple(draws.shape)}"
    index = torch.arange(rows, device=target_probs.device)

    def draw(level: int, position: torch.Tensor) -> torch.Tensor:
        return sample_from_weights(target_probs[index, position], uniform=draws[:, level])

    return walk(tree, draw, draws.shape[1] - 1)


def tree_greedy_accept(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> TreeVerdict:
    """Greedy verification: descend while the target's argmax is a child, then take the target's argmax.

    Args:
        tree: the round's tree, tokens and parents `(rows, N)`.
        target_tokens: `(rows, N + 1)` long, the target's argmax at each position (`draws.first_argmax`: ties go
            to the first id).
        max_depth: the deepest node's depth.

    Returns:
        The `TreeVerdict`: the committed tokens are the target's greedy continuation.
    """
    rows, nodes = tree.tokens.shape
    assert target_tokens.shape == (rows, nodes + 1), f"target_tokens {tuple(target_tokens.shape)}, {nodes} nodes"
    return walk(tree, lambda level, position: target_tokens.gather(1, position[:, None])[:, 0], max_depth)


def flag_tree_nonfinite(verdict: TreeVerdict, target_probs: torch.Tensor) -> TreeVerdict:
    """Mark rows that drew from a NaN/inf distribution, where plain sampling would have raised, without a sync.

    Only the positions a row drew at count: the root and its accepted nodes (`rejection.flag_nonfinite`'s rule for
    a chain). The code (`NonFinite.TARGET`) replaces `num_accepted`, read at the round's one host read.

    Args:
        verdict: the round's verdict; target_probs: `(rows, N + 1, vocab)`.
    """
    rows, positions = target_probs.shape[:2]
    nonfinite = ~torch.isfinite(target_probs.sum(dim=-1))  # (rows, N + 1): a row's sum is finite iff its entries are
    drawn_at = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], dim=1)  # (rows, max_depth + 1)
    visited = torch.cat([torch.ones_like(verdict.path[:, :1], dtype=torch.bool), verdict.path >= 0], dim=1)
    bad = (nonfinite.gather(1, drawn_at.clamp(max=positions - 1)) & visited).any(dim=-1)  # (rows,)
    codes = torch.where(bad, int(NonFinite.TARGET), verdict.num_accepted)
    return verdict._replace(num_accepted=codes)


def path_tokens(tree: DraftTree, max_depth: int) -> torch.Tensor:
    """`(rows, N, max_depth)` long: the tokens on the path to each node, depth 1 first, node i's own token at column
    ``depth_i - 1``, 0 after it.

    Args:
        tree: the round's tree; max_depth: at least its deepest node's depth.
    """
    rows, nodes = tree.tokens.shape
    ancestors = tree.ancestors()  # (rows, N, N): [r, i, j] node j on node i's path
    # each ancestor's token goes to its depth's column; the rest to a spare column, dropped
    column = torch.where(ancestors, (tree.depths - 1)[:, None, :], max_depth)  # (rows, N, N)
    out = tree.tokens.new_zeros((rows, nodes, max_depth + 1))
    out.scatter_(2, column, torch.where(ancestors, tree.tokens[:, None, :], 0))
    return out[..., :max_depth]


def path_probabilities(tree: DraftTree, target_probs: torch.Tensor) -> torch.Tensor:
    """`(rows, N)` the target's probability of the path to each node: the chance the rule accepts that node.

    Node i is accepted when every node on its path is, each with the target's probability of its token at its
    parent's position.

    Args:
        tree: the round's tree; target_probs: `(rows, N + 1, vocab)` (index 0: the root, i + 1: node i).
    """
    at_parent = target_probs.gather(1, (tree.parents + 1)[..., None].expand(-1, -1, target_probs.shape[-1]))
    token_probs = at_parent.gather(2, tree.tokens[..., None])[..., 0].double()  # (rows, N)
    on_path = tree.ancestors()  # (rows, N, N)
    return torch.where(on_path, token_probs[:, None, :], 1.0).prod(dim=-1)


def expected_tokens(tree: DraftTree, target_probs: torch.Tensor) -> torch.Tensor:
    """`(rows,)` float64, the tokens a round commits in expectation: 1 + the sum over nodes of the target's
    probability of the path to the node (`path_probabilities`); no verifier of this tree commits more.

    Args:
        tree: the round's tree; target_probs: `(rows, N + 1, vocab)`, one-hot rows of the argmax for greedy.
    """
    return 1.0 + path_probabilities(tree, target_probs).sum(dim=-1)
