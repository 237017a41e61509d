"""Draft trees: a round's candidate tokens as a tree rooted at the round's first position, not one chain.

Glossary (one word each):
- root: the position after each row's committed tokens; its distribution is the first new token's. It is not a
  node: a tree of N nodes feeds the target N + 1 positions (the root's token, the last committed one, then the nodes).
- node: a drafted token; its parent is the root (-1) or an earlier node, so nodes come in level order (a parent's
  index below its children's). Siblings carry distinct tokens: a deterministic choice of the draft (its top ranks).
- rank: which of the draft's choices at the parent a node is (0: the most likely token).
- depth: 1 for the root's children; a node sits at position root + depth.
- path: the nodes from the root's child down to a node; the accepted path is where verification ended.

`TreeShape` is a static shape (the same for every row and round); `DraftTree` is a round's tree with its tokens.
A chain of K tokens is the tree whose node k has parent k - 1 and rank 0 (`TreeShape.chain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TreeShape:
    """A static tree: node i's parent (-1: the root) and its rank among the parent's children.

    Attributes:
        parents: per node, the parent node's index (-1: the root), in level order (a parent before its children).
        ranks: per node, which of the draft's choices at the parent it takes (0: the most likely); distinct among
            siblings.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.ranks) or not self.parents:
            raise ValueError("a tree shape needs one parent and one rank per node, and at least one node")
        seen: set[tuple[int, int]] = set()
        for node, (parent, rank) in enumerate(zip(self.parents, self.ranks)):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} must be -1 (the root) or an earlier node")
            if rank < 0 or (parent, rank) in seen:
                raise ValueError(f"node {node}: rank {rank} under parent {parent} is negative or taken twice")
            seen.add((parent, rank))

    @classmethod
    def from_paths(cls, paths: list[tuple[int, ...]]) -> TreeShape:
        """The shape holding each path of ranks from the root (`(0, 1)`: the first choice's second choice), and
        every prefix of one; nodes sorted by depth, then by path."""
        nodes = sorted({path[:depth] for path in paths for depth in range(1, len(path) + 1)}, key=lambda p: (len(p), p))
        index = {path: node for node, path in enumerate(nodes)}
        return cls(tuple(index[path[:-1]] if len(path) > 1 else -1 for path in nodes), tuple(p[-1] for p in nodes))

    @classmethod
    def chain(cls, lookahead: int) -> TreeShape:
        """`lookahead` tokens in one chain: the draft's first choice at each depth."""
        return cls(tuple(range(-1, lookahead - 1)), (0,) * lookahead)

    @classmethod
    def default(cls) -> TreeShape:
        """16 nodes: a first-choice spine of depth 8, second and third choices at the first levels."""
        spine = (0,) * 8
        return cls.from_paths([spine, (1, 0), (2,), (0, 1, 0), (0, 2), (0, 0, 1), (0, 0, 0, 1)])

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        """The most choices any node takes at its parent, less one (top-(max_rank + 1) is drafted)."""
        return max(self.ranks)

    @property
    def is_chain(self) -> bool:
        return self == TreeShape.chain(self.num_nodes)

    def truncated(self, depth: int) -> TreeShape:
        """The nodes at depth <= `depth` (>= 1), renumbered in the same order."""
        kept = [node for node, node_depth in enumerate(self.depths) if node_depth <= depth]
        if len(kept) == self.num_nodes:
            return self
        index = {node: new for new, node in enumerate(kept)}
        return TreeShape(tuple(index.get(self.parents[node], -1) for node in kept), tuple(self.ranks[n] for n in kept))

    def describe(self) -> str:
        """In words, for `SpeculativeStats.shape`."""
        if self.is_chain:
            return f"a chain of {self.num_nodes}"
        return f"a tree of {self.num_nodes} nodes, depth {self.max_depth}, up to {self.max_rank + 1} choices a node"

    def levels(self) -> list[list[int]]:
        """The nodes at each depth, depth 1 first."""
        depths = self.depths
        return [[node for node, depth in enumerate(depths) if depth == level] for level in range(1, self.max_depth + 1)]


@dataclass
class DraftTree:
    """A round's drafted tree, one per row, all of N nodes.

    Attributes:
        tokens: `(rows, N)` long, each node's token (siblings distinct).
        parents: `(rows, N)` long, each node's parent (-1: the root), in level order per row.
        depths: `(rows, N)` long, each node's depth (1: a child of the root).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

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

    def ancestors(self) -> torch.Tensor:
        """`(rows, N, N)` bool: [r, i, j] where node j is node i or one of its ancestors in row r's tree (what node
        i attends to among the nodes)."""
        rows, nodes = self.parents.shape
        seen = torch.eye(nodes, dtype=torch.bool, device=self.parents.device).expand(rows, -1, -1).clone()
        for node in range(nodes):  # level order: a parent's row is complete before its children's
            parent = self.parents[:, node]
            has_parent = parent >= 0
            inherited = seen[torch.arange(rows, device=parent.device), parent.clamp(min=0)] & has_parent[:, None]
            seen[:, node] |= inherited
        return seen
