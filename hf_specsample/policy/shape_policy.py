"""`draft_shape="auto"`'s round-by-round choice between a chain and a tree, from measured acceptance and costs.

Greedy calls only (`shape_choice.choose_shape`): greedy text is the target's argmax whatever was drafted, so the
clock may decide. Each round, for every node budget n up to one beyond the widest round measured (as K grows
today, `MeasuredCosts.largest_lookahead`), the best tree of n nodes (`tree_design.best_trees`, its depth capped by
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
p[r] = h[r] * prod over j < r of (1 - h[j]), the acceptance vector `tree_design` designs for. Hazards above rank 0
start from a prior that lets the first wide rounds try a tree; they only move in tree rounds.
"""

from __future__ import annotations

from ..options import TreeShape
from .round_costs import DecayedMean, MeasuredCosts, RoundRecord, StaticCosts
from .tree_design import best_trees

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
