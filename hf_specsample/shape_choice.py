"""What a call's rounds draft: one chain, or a tree (`SpeculativeConfig.draft_shape`), and why in words.

`choose_shape` is pure: the plan hands it the option and the facts that decide; it refuses an asked-for tree that
cannot run, before any forward, with what to do instead, and says why "auto" keeps the chain.
"""

from __future__ import annotations

from typing import NamedTuple

from .options import DraftShape, DynamicTree, TreeShape


class ShapeChoice(NamedTuple):
    """The call's shape: `tree` (a static shape, a dynamic tree; None: chains) and the words `SpeculativeStats.shape`
    reports."""

    tree: TreeShape | DynamicTree | None
    reason: str


def choose_shape(
    asked: DraftShape | TreeShape | DynamicTree,
    problems: list[str],
    depth: int,
    choices: int | None = None,
) -> ShapeChoice:
    """The call's shape.

    Args:
        asked: `SpeculativeConfig.draft_shape` (parsed).
        problems: why a tree cannot run in this call (each a phrase: "prompt lookup proposes chains", ...); empty
            where it can.
        depth: the deepest level drafted (`num_lookahead`, else `max_lookahead`): the tree is cut there.
        choices: the most distinct tokens the draft can propose at a node (its vocabulary; None: not known).

    Raises:
        ValueError: a tree asked for (`"tree"`, `"dynamic"`, a `TreeShape` or a `DynamicTree`) where `problems`
            is not empty, or whose nodes take more of the draft's choices than it has.
    """
    if asked is DraftShape.CHAIN:
        return ShapeChoice(None, "chain (draft_shape='chain')")
    if asked is DraftShape.AUTO:  # trees are chosen once their acceptance and costs are measured per call (issue 45)
        return ShapeChoice(None, "chain (draft_shape='auto' drafts chains)")
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
