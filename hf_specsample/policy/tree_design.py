"""The best draft tree for an acceptance vector: Sequoia's tree design (arXiv 2402.12374), as a pure function.

Model (Sequoia's position-independent acceptance): at any node, the target's token is the draft's choice of rank r
with probability `p[r]` (r = 0 .. R - 1), whatever the depth and the path. A node whose path takes ranks
r_1 .. r_d is then reached by the tree rule's walk with probability p[r_1] * ... * p[r_d] (its *value*), and a tree's
expected count of committed tokens per row is 1 + the sum of its nodes' values (the tree rule's: 1 + the sum over
the nodes of the target probability of the path). A chain of K under p[0] = alpha is Leviathan's E(K) =
1 + alpha + ... + alpha^K (`round_costs.expected_tokens`, its closed form for a mean K over rounds).

`best_trees` maximises that count for every node budget n at once, under a maximum depth: a node's value never exceeds
its parent's (every p[r] <= 1), so the n most valuable nodes of the infinite tree of rank paths (ties broken by depth,
shallower first) hold every ancestor of each of them: they form a tree, and no n nodes sum to more. Best-first search
(a heap of candidate children) finds them in order, and its first n nodes are the best tree of n nodes: the trees of
all budgets come from one search. A chain of K (`TreeShape.chain`) is the answer where R = 1, or wherever the spine's
values stay above every other rank's.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from ..options import TreeShape


class DesignedTree(NamedTuple):
    """The best tree of one node budget.

    Attributes:
        paths: each node's path of ranks from the root, in the order taken (`TreeShape.from_paths`).
        expected: its expected count of committed tokens per row: 1 + the sum of its nodes' values.
        depth: its deepest node's depth (the draft's forwards).
        is_chain: every node is a first choice (`TreeShape.chain`).
    """

    paths: tuple[tuple[int, ...], ...]
    expected: float
    depth: int
    is_chain: bool

    @property
    def parents(self) -> int:
        """Its nodes with children and the root: the positions the draft processes (a chain's K)."""
        return len({path[:-1] for path in self.paths})

    @property
    def shape(self) -> TreeShape:
        """The tree (made when asked: a round weighs every budget and drafts one)."""
        return TreeShape.from_paths(self.paths)


def best_trees(accept: Sequence[float], max_nodes: int, max_depth: int) -> list[DesignedTree]:
    """The best tree of each budget 1 .. `max_nodes` (fewer where a depth cap leaves fewer nodes to take).

    Args:
        accept: `p[r]`, the probability that the target's token is the draft's choice of rank r (each in [0, 1],
            summing to at most 1).
        max_nodes: the largest budget (nodes, the root not counted).
        max_depth: no node deeper than this (the draft's levels are its forwards).

    Returns:
        Entry n - 1: the best tree of n nodes and its expected count. Each tree is the previous one plus one node.
    """
    if max_nodes < 1 or max_depth < 1 or not accept:
        return []
    # heap entries: (-value, depth, rank path); the path orders ties deterministically
    frontier: list[tuple[float, int, tuple[int, ...]]] = [(-p, 1, (rank,)) for rank, p in enumerate(accept)]
    heapq.heapify(frontier)
    taken: list[tuple[int, ...]] = []
    designed: list[DesignedTree] = []
    expected, deepest, chain = 1.0, 0, True
    while frontier and len(taken) < max_nodes:
        negative, depth, path = heapq.heappop(frontier)
        taken.append(path)
        expected, deepest, chain = expected - negative, max(deepest, depth), chain and not any(path)
        designed.append(DesignedTree(tuple(taken), expected, deepest, chain))
        if depth < max_depth:
            for rank, p in enumerate(accept):
                heapq.heappush(frontier, (negative * p, depth + 1, path + (rank,)))
    return designed
