"""What a tree's verification commits in expectation, for the tests (`test_tree_rule.py`, `test_tree_verifier.py`):
the library designs trees from acceptance by rank (`policy.shapes`) and never needs it per node."""

from __future__ import annotations

import torch

from hf_specsample.core.draft_tree import DraftTree


def path_probabilities(tree: DraftTree, target_probs: torch.Tensor) -> torch.Tensor:
    """`(rows, N)` the target's probability of the path to each node: the chance the rule accepts that node.

    Node i is accepted when every node on its path is, each with the target's probability of its token at its
    parent's position.

    Args:
        tree: the round's tree; target_probs: `(rows, N + 1, vocab)` (index 0: the root, i + 1: node i).
    """
    assert tree.parents is not None
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
