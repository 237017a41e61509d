"""Draft trees: a round's candidate tokens as a tree rooted at the round's first position, not one chain.

Glossary (one word each):
- root: the position after each row's committed tokens; its distribution is the first new token's. It is not a
  node: a tree of N nodes feeds the target N + 1 positions (the root's token, the last committed one, then the nodes).
- node: a drafted token; its parent is the root (-1) or an earlier node, so nodes come in level order (a parent's
  index below its children's). Siblings carry distinct tokens: a deterministic choice of the draft (its top ranks).
- rank: which of the draft's choices at the parent a node is (0: the most likely token).
- depth: 1 for the root's children; a node sits at position root + depth.
- path: the nodes from the root's child down to a node; the accepted path is where verification ended.

`rank_observations` reads an accepted path as tests of the draft's ranks (did the target's token take rank r at a
node offering it?), what `draft_shape="auto"` estimates its trees' acceptance from (`shapes`).

`options.TreeShape` is a static shape (the same for every row and round, a value a user may pass); `DraftTree` is a
round's tree with its tokens. A chain of K tokens is the tree whose node k has parent k - 1 and rank 0
(`TreeShape.chain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..options import TreeShape


@dataclass
class DraftTree:
    """A round's drafted tree, one per row, all of N nodes; a chain of N tokens is the tree whose node k has parent
    k - 1 (`chain`: its parents and depths are implied, never built).

    Attributes:
        tokens: `(rows, N)` long, each node's token (siblings distinct).
        parents: `(rows, N)` long, each node's parent (-1: the root), in level order per row; None: a chain.
        depths: `(rows, N)` long, each node's depth (1: a child of the root); None: a chain.
    """

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> DraftTree:
        """The chain of `tokens` `(rows, N)`: node k's parent is node k - 1."""
        return cls(tokens)

    def with_parents(self) -> DraftTree:
        """The tree with its parents and depths built (a chain's implied ones made explicit; a tree as it is)."""
        if self.parents is not None:
            return self
        rows, nodes = self.tokens.shape
        index = torch.arange(nodes, device=self.tokens.device).expand(rows, -1)
        return DraftTree(self.tokens, index - 1, index + 1)

    def rows(self, index: slice) -> DraftTree:
        """The tree of the rows `index`."""
        parents, depths = self.parents, self.depths
        return DraftTree(
            self.tokens[index], None if parents is None else parents[index], None if depths is None else depths[index]
        )

    @classmethod
    def of_shape(cls, shape: TreeShape, tokens: torch.Tensor) -> DraftTree:
        """The tree of `shape` with `tokens` `(rows, N)`."""
        rows, device = tokens.shape[0], tokens.device
        parents = torch.tensor(shape.parents, dtype=torch.long, device=device).expand(rows, -1)
        depths = torch.tensor(shape.depths, dtype=torch.long, device=device).expand(rows, -1)
        return cls(tokens, parents, depths)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def path_tokens(self, max_depth: int) -> torch.Tensor:
        """`(rows, N, max_depth)` long: the tokens on the path to each node, depth 1 first, node i's own token at
        column ``depth_i - 1``, 0 after it.

        Args:
            max_depth: at least the tree's deepest node's depth.
        """
        assert self.depths is not None  # a tree's (a chain's paths are the buffer's)
        rows, nodes = self.tokens.shape
        ancestors = self.ancestors()  # (rows, N, N): [r, i, j] node j on node i's path
        # each ancestor's token goes to its depth's column; the rest to a spare column, dropped
        column = torch.where(ancestors, (self.depths - 1)[:, None, :], max_depth)  # (rows, N, N)
        out = self.tokens.new_zeros((rows, nodes, max_depth + 1))
        out.scatter_(2, column, torch.where(ancestors, self.tokens[:, None, :], 0))
        return out[..., :max_depth]

    def ancestors(self) -> torch.Tensor:
        """`(rows, N, N)` bool: [r, i, j] where node j is node i or one of its ancestors in row r's tree (what node
        i attends to among the nodes)."""
        assert self.parents is not None, "a chain's ancestors are the nodes before it"
        rows, nodes = self.parents.shape
        seen = torch.eye(nodes, dtype=torch.bool, device=self.parents.device).expand(rows, -1, -1).clone()
        for node in range(nodes):  # level order: a parent's row is complete before its children's
            parent = self.parents[:, node]
            has_parent = parent >= 0
            inherited = seen[torch.arange(rows, device=parent.device), parent.clamp(min=0)] & has_parent[:, None]
            seen[:, node] |= inherited
        return seen


class RankCounts(NamedTuple):
    """What one tree round's walks tested of the draft's choices, summed over its rows (`rank_observations`)."""

    # named as `round_costs.RoundRecord`'s fields, which take them as they are (`RoundRecord(..., **counts._asdict())`)
    rank_tested: tuple[int, ...]  # per rank 0 .. max_rank
    rank_accepted: tuple[int, ...]


def rank_observations(shape: TreeShape, path: torch.Tensor) -> RankCounts:
    """What one tree round says of the ranks, summed over its rows.

    Args:
        shape: the round's tree.
        path: `(rows, max_depth)` long on the host, each row's accepted nodes from depth 1 down, -1 after the last
            (`verify.rules.Verdict.path`).

    Returns:
        Per rank 0 .. shape.max_rank, tested and accepted: at each node a row's walk stood on, the ranks offered
        there (contiguous from 0) up to the one the target's token took, or all of them where it took none (a leaf
        tests nothing).
    """
    width = shape.max_rank + 1
    children: dict[int, set[int]] = {}
    for parent, rank in zip(shape.parents, shape.ranks):
        children.setdefault(parent, set()).add(rank)
    tested, accepted = [0] * width, [0] * width
    for row in path.tolist():
        current = -1
        for node in [*row, -1]:
            offered = 0
            while offered in children.get(current, ()):
                offered += 1
            if offered == 0:
                break  # a leaf (or only ranks past a gap): nothing was tested here
            if node < 0:  # the walk ended here: none of the offered ranks was the target's token
                tested[:offered] = [count + 1 for count in tested[:offered]]
                break
            rank = shape.ranks[node]
            for below in range(min(rank + 1, offered)):
                tested[below] += 1
            if rank < offered:
                accepted[rank] += 1
            current = node
    return RankCounts(tuple(tested), tuple(accepted))
