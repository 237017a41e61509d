"""What a call's rounds draft: one chain, or a tree (`SpeculativeConfig.draft_shape`), and why in words.

`choose_shape` is pure: the plan hands it the option and the facts that decide; it refuses an asked-for tree that
cannot run, before any forward, with what to do instead, and says why "auto" keeps the chain.
"""

from __future__ import annotations

from typing import NamedTuple

from .options import DraftShape, TreeShape


class ShapeChoice(NamedTuple):
    """The call's shape: `tree` (None: chains) and the words `SpeculativeStats.shape` reports."""

    tree: TreeShape | None
    reason: str


def choose_shape(
    asked: DraftShape | TreeShape,
    problems: list[str],
    num_lookahead: int | None,
) -> ShapeChoice:
    """The call's shape.

    Args:
        asked: `SpeculativeConfig.draft_shape` (parsed).
        problems: why a tree cannot run in this call (each a phrase: "prompt lookup proposes chains", ...); empty
            where it can.
        num_lookahead: the caller's K: with a tree, the deepest level drafted (the tree is cut there).

    Raises:
        ValueError: a tree asked for (`"tree"` or a `TreeShape`) where `problems` is not empty.
    """
    if asked is DraftShape.CHAIN:
        return ShapeChoice(None, "chain (draft_shape='chain')")
    if asked is DraftShape.AUTO:  # trees are chosen once their acceptance and costs are measured per call (issue 45)
        return ShapeChoice(None, "chain (draft_shape='auto' drafts chains)")
    if problems:
        named = repr(str(asked)) if isinstance(asked, DraftShape) else "a TreeShape"
        raise ValueError(
            f"draft_shape={named} drafts a tree of candidates, which this call cannot run: {'; '.join(problems)}. "
            "Use draft_shape='chain' (or 'auto', which falls back to chains)."
        )
    tree = TreeShape.default() if asked is DraftShape.TREE else asked
    assert isinstance(tree, TreeShape)  # `SpeculativeConfig` parses everything else into `DraftShape`
    if num_lookahead is not None:
        tree = tree.truncated(num_lookahead)
    return ShapeChoice(tree, tree.describe())
