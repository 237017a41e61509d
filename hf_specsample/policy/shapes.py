"""The draft's shape: chosen once per call (`choose_shape`), designed per round under "auto" (`ShapeDesigner`, from
the acceptance by rank, `RankAcceptance`, and the best tree of each size, `best_trees`).

What a call's rounds draft: one chain, or a tree (`SpeculativeConfig.draft_shape`), and why in words. `choose_shape` is
pure: the plan hands it the option and the facts that decide; it refuses an asked-for tree that cannot run, before any
forward, with what to do instead, and says why "auto" keeps the chain.

**Round by round.** `draft_shape="auto"`'s choice between a chain and a tree, from measured acceptance and costs.

Greedy calls only (`choose_shape`): greedy text is the target's argmax whatever was drafted, so the
clock may decide. Each round, for every node budget n up to one beyond the widest round measured (as K grows
today, `MeasuredCosts.largest_lookahead`), the best tree of n nodes (`best_trees`, its depth capped by
`max_lookahead`) is weighed by its rate E(n) / (d * depth + v(n)): E its expected tokens, d a draft forward (a tree
drafts one forward per level, over its frontier: about a chain's step on the CPU) with its processing (one
position per parent, `DesignedTree.parents`), v(n) the rest of a round verifying n + 1 positions, one table for
chains and trees (`RoundRecord.width`). The best n wins; where its tree is
a chain, a chain round of K = n runs (the chain's own path: causal verification, no tree mask).

Acceptance by rank: `RankAcceptance`, the call's one acceptance estimate (`lookahead.AdaptiveLookahead.acceptance`;
its rank 0 is a chain's alpha), keeps, per rank r of the draft's choices, the decayed hazard h[r] = P(the
target's token is the draft's choice of rank r | it is none of ranks 0 .. r - 1), counted where those ranks were
offered: a chain round tests rank 0 at each position it reaches (Leviathan's alpha); a tree round tests, at each node
its walk passes, the ranks offered there up to the one taken (`draft_tree.rank_observations`). Then
p[r] = h[r] * prod over j < r of (1 - h[j]), the acceptance vector the designer designs for. Hazards above rank 0
start from a prior that lets the first wide rounds try a tree; they only move in tree rounds.

**The best draft tree** for an acceptance vector: Sequoia's tree design (arXiv 2402.12374), as a pure function.

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

from ..options import DraftShape, DynamicTree, TreeShape
from .round_costs import DecayedMean, MeasuredCosts, RoundRecord, StaticCosts

# Why a sampling call keeps chains under "auto": its chain rounds verify with the draft's probabilities (block
# verification), a tree's rule with deterministic children does not, and measured on Qwen2.5-Coder 1.5B/0.5B at
# T = 0.7 the chain kept more tokens per pass (6.17 against the default tree's 4.57); a choice between them by the
# clock would also make a seeded sample depend on timing.
SAMPLING_KEEPS_CHAINS = (
    "chain (draft_shape='auto' samples with chains: their block verification uses the draft's probabilities and "
    "keeps more tokens per pass than a tree's rule; draft_shape='tree' drafts trees)"
)


class ShapeChoice(NamedTuple):
    """The call's shape: `tree` (a static shape, a dynamic tree; None: chains) and the words
    `SpeculativeStats.shape` reports.

    `ranks` > 0 (`draft_shape="auto"`, greedy, trees possible): each round drafts a chain or a tree of up to `ranks`
    of the draft's choices a node, chosen by the adaptive lookahead (`shapes`); `reason` is then replaced by
    what ran once the call ends (`SpeculativeStats.describe_auto_shapes`).
    """

    tree: TreeShape | DynamicTree | None
    reason: str
    ranks: int = 0
    suffix_trees: bool = False  # a suffix drafter proposes trees of its own (`proposers.suffix`); `tree` is None


def suffix_shape(asked: DraftShape | TreeShape | DynamicTree, problems: list[str]) -> ShapeChoice:
    """A suffix drafter's shape: its own trees (their size follows the matches), or chains where `problems` (why
    this call cannot verify trees) or `draft_shape="chain"` say so.

    Raises:
        ValueError: a model draft's tree shape (`"tree"`, `"dynamic"`, a `TreeShape` or a `DynamicTree`) asked of it.
    """
    if asked is DraftShape.CHAIN:
        return ShapeChoice(None, "suffix chains (draft_shape='chain')")
    if asked is not DraftShape.AUTO:
        raise ValueError(
            "A suffix drafter drafts trees of its own, shaped by what it matched: draft_shape= other than 'auto' "
            "(its trees where the call can verify them) or 'chain' has nothing to shape."
        )
    if problems:
        return ShapeChoice(None, f"suffix chains (the call cannot verify trees: {'; '.join(problems)})")
    return ShapeChoice(None, "suffix trees", suffix_trees=True)


def choose_shape(
    asked: DraftShape | TreeShape | DynamicTree,
    problems: list[str],
    depth: int,
    choices: int | None = None,
    sampling: bool = False,
    fixed_lookahead: bool = False,
) -> ShapeChoice:
    """The call's shape.

    Args:
        asked: `SpeculativeConfig.draft_shape` (parsed).
        problems: why a tree cannot run in this call (each a phrase: "prompt lookup proposes chains", ...); empty
            where it can.
        depth: the deepest level drafted (`num_lookahead`, else `max_lookahead`): the tree is cut there.
        choices: the most distinct tokens the draft can propose at a node (its vocabulary; None: not known).
        sampling: the call samples ("auto" keeps chains: `SAMPLING_KEEPS_CHAINS`).
        fixed_lookahead: `num_lookahead=` fixes a chain's K ("auto" keeps chains).

    Raises:
        ValueError: a tree asked for (`"tree"`, `"dynamic"`, a `TreeShape` or a `DynamicTree`) where `problems`
            is not empty, or whose nodes take more of the draft's choices than it has.
    """
    if asked is DraftShape.CHAIN:
        return ShapeChoice(None, "chain (draft_shape='chain')")
    if asked is DraftShape.AUTO:  # trees are chosen round by round from measured acceptance and costs (`shapes`)
        if problems:
            return ShapeChoice(None, f"chain (draft_shape='auto' falls back to chains: {'; '.join(problems)})")
        if sampling:
            return ShapeChoice(None, SAMPLING_KEEPS_CHAINS)
        if fixed_lookahead:
            return ShapeChoice(None, "chain (draft_shape='auto' with num_lookahead= drafts chains of that K)")
        ranks = min(AUTO_RANKS, choices) if choices is not None else AUTO_RANKS
        return ShapeChoice(None, "auto: chains or trees by measured acceptance and costs", ranks)
    if problems:
        named = repr(str(asked)) if isinstance(asked, DraftShape) else f"a {type(asked).__name__}"
        raise ValueError(
            f"draft_shape={named} drafts a tree of candidates, which this call cannot run: {'; '.join(problems)}. "
            "Use draft_shape='chain' (or 'auto', which falls back to chains)."
        )
    tree = TreeShape.default() if asked is DraftShape.TREE else DynamicTree() if asked is DraftShape.DYNAMIC else asked
    assert isinstance(tree, (TreeShape, DynamicTree))  # `SpeculativeConfig` parses everything else into `DraftShape`
    if choices is not None and tree.max_rank >= choices:
        raise ValueError(
            f"draft_shape's tree takes the draft's choice of rank {tree.max_rank} at a node (the {tree.max_rank + 1}"
            f"th most likely token), but the draft proposes from {choices} tokens. "
            + (f"Use ranks below {choices}." if isinstance(tree, TreeShape) else f"Use expand <= {choices}.")
        )
    tree = tree.truncated(depth)
    return ShapeChoice(tree, tree.describe())


TREE_NODES = 15  # the widest tree weighed: 16 positions with the root, what the CPU kernel serves in one pass
AUTO_RANKS = 4  # the most of the draft's choices a node of an automatic tree takes
RANK_PRIOR = 0.3  # h[r] for r >= 1 before a tree round measures it: the draft's second choice is often right on code


class RankAcceptance:
    """Decayed hazards of the target's token by the draft's rank (module docstring); h[0] is Leviathan's alpha.

    Args:
        ranks: R, the ranks kept (0 .. R - 1; 1 for a call drafting chains only).
        first_prior, prior_weight: h[0]'s prior and its weight in tested tokens.
        decay: per round, how much earlier observations still count.
    """

    def __init__(self, ranks: int, first_prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.85):
        priors = [first_prior] + [RANK_PRIOR] * (ranks - 1)
        self.hazards = [DecayedMean(prior, weight=prior_weight, decay=decay) for prior in priors]

    def observe(self, record: RoundRecord) -> None:
        """A chain round's rank-0 tests (`accepted` of `tested`), or a tree round's counts per rank."""
        if record.nodes is None:
            if record.tested:
                self.hazards[0].add(record.accepted, record.tested)
            return
        for hazard, tested, hits in zip(self.hazards, record.rank_tested, record.rank_accepted):
            if tested:
                hazard.add(hits, tested)

    @property
    def alpha(self) -> float:
        """The probability that a tested first choice (a chain's draft token) is accepted: h[0]."""
        return self.hazards[0].value

    def accept(self) -> list[float]:
        """p[r] for r = 0 .. R - 1, non-increasing (a rank offered without the one before would waste a node)."""
        out: list[float] = []
        left = 1.0
        for hazard in self.hazards:
            p = left * min(1.0, max(0.0, hazard.value))
            out.append(min(p, out[-1]) if out else p)
            left -= p
        return out


class ShapeDesigner:
    """The best chain or tree for the next round at the costs and acceptance known now (module docstring).

    Args:
        ranks: the most of the draft's choices a node takes (`AUTO_RANKS`, fewer for a draft proposing fewer tokens):
            the ranks the call's acceptance keeps (`lookahead.AdaptiveLookahead.acceptance`).
        max_depth: the deepest level (`max_lookahead`).
    """

    def __init__(self, ranks: int, max_depth: int):
        self.ranks, self.max_depth = ranks, max_depth
        self.max_nodes = max(TREE_NODES, max_depth)

    def best(self, costs: MeasuredCosts | StaticCosts, acceptance: RankAcceptance) -> tuple[TreeShape | None, int]:
        """The next round's tree (None: a chain) and its depth (a chain's K; 0: plain decoding), at the best rate."""
        widest = costs.largest_lookahead(self.max_nodes)
        designed = best_trees(acceptance.accept(), widest, self.max_depth)
        draft, processing = costs.draft_seconds(), costs.draft_processing_seconds()
        best = 1.0 / costs.verify_seconds(0)  # plain decoding's rate
        chosen = None
        for nodes, tree in enumerate(designed, start=1):
            # d counts one processed position a level, where a tree's levels process each of their parents
            drafting = draft * tree.depth + processing * (tree.parents - tree.depth)
            rate = tree.expected / (drafting + costs.verify_seconds(nodes))
            if rate > best:  # ties: the narrower round
                best, chosen = rate, tree
        if chosen is None:
            return None, 0
        return (None if chosen.is_chain else chosen.shape), chosen.depth


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
