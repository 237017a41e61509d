"""What a call's rounds draft: one chain, or a tree (`SpeculativeConfig.draft_shape`), and why in words.

`choose_shape` is pure: the plan hands it the option and the facts that decide; it refuses an asked-for tree that
cannot run, before any forward, with what to do instead, and says why "auto" keeps the chain.
"""

from __future__ import annotations

from typing import NamedTuple

from ..options import DraftShape, DynamicTree, TreeShape
from .shape_policy import AUTO_RANKS

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
    of the draft's choices a node, chosen by the adaptive lookahead (`shape_policy`); `reason` is then replaced by
    what ran once the call ends (`SpeculativeStats.describe_auto_shapes`).
    """

    tree: TreeShape | DynamicTree | None
    reason: str
    ranks: int = 0


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
    if asked is DraftShape.AUTO:  # trees are chosen round by round from measured acceptance and costs (`shape_policy`)
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
