"""Tree shapes (`draft_tree`) and the call's choice between a chain and a tree (`shapes`)."""

import pytest
import torch

from hf_specsample import DraftShape, SpeculativeConfig, TreeShape
from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.policy.shapes import choose_shape


def test_the_default_tree():
    shape = TreeShape.default()
    assert (shape.num_nodes, shape.max_depth, shape.max_rank) == (15, 8, 1)  # 16 positions with the root
    assert shape.levels()[:2] == [[0, 1], [2, 3]] and shape.levels()[-1] == [14]
    assert [shape.parents[node] for node in (2, 3, 14)] == [0, 0, 12]  # second choices hang off the spine
    assert not shape.is_chain and TreeShape.chain(4).is_chain
    assert [shape.depths[node] for node in range(shape.num_nodes)] == sorted(shape.depths)  # level order


def test_a_shape_is_checked():
    with pytest.raises(ValueError, match="parent"):
        TreeShape((0, -1), (0, 0))  # a node its own parent
    with pytest.raises(ValueError, match="taken twice"):
        TreeShape((-1, -1), (0, 0))  # two first choices of one parent: siblings must be distinct
    with pytest.raises(ValueError, match="at least one node"):
        TreeShape((), ())


def test_truncation_keeps_the_shallow_nodes_and_their_links():
    shape = TreeShape.from_paths([(0, 0, 0), (1, 0), (0, 1)])
    cut = shape.truncated(2)
    assert cut.max_depth == 2 and cut.num_nodes == 5  # (0,) (1,) (0, 0) (0, 1) (1, 0)

    # every kept node keeps its path of ranks
    def paths(tree):
        out = []
        for node in range(tree.num_nodes):
            path, at = [], node
            while at >= 0:
                path.append(tree.ranks[at])
                at = tree.parents[at]
            out.append(tuple(reversed(path)))
        return out

    assert set(paths(cut)) == {path for path in paths(shape) if len(path) <= 2}
    assert shape.truncated(3) is shape


def test_ancestors_are_each_node_and_its_path():
    shape = TreeShape.from_paths([(0, 0), (1,)])  # nodes: (0,), (1,), (0, 0)
    tree = DraftTree.of_shape(shape, torch.tensor([[5, 6, 7]]))
    expected = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestors()[0], expected)


def test_the_choice():
    assert choose_shape(DraftShape.CHAIN, [], 8).tree is None
    auto = choose_shape(DraftShape.AUTO, [], 8, choices=3)
    assert auto.tree is None and auto.ranks == 3  # round by round (`shapes`), up to the draft's 3 choices
    fallback = choose_shape(DraftShape.AUTO, ["a hybrid target"], 8)  # auto falls back, never refuses
    assert fallback.tree is None and not fallback.ranks and fallback.reason.endswith("chains: a hybrid target)")
    sampling = choose_shape(DraftShape.AUTO, [], 8, sampling=True)
    assert sampling.tree is None and not sampling.ranks and "samples with chains" in sampling.reason
    assert not choose_shape(DraftShape.AUTO, [], 8, fixed_lookahead=True).ranks
    assert choose_shape(DraftShape.TREE, [], 8).tree == TreeShape.default()
    assert choose_shape(DraftShape.TREE, [], 3).tree == TreeShape.default().truncated(3)
    explicit = TreeShape.from_paths([(0, 0), (1,)])
    assert choose_shape(explicit, [], 8).tree is explicit
    with pytest.raises(ValueError, match="a hybrid target.*draft_shape='chain'"):
        choose_shape(DraftShape.TREE, ["a hybrid target"], 8)


def test_the_option():
    assert SpeculativeConfig().draft_shape is DraftShape.AUTO
    assert SpeculativeConfig(draft_shape="tree").draft_shape is DraftShape.TREE
    shape = TreeShape.chain(2)
    assert SpeculativeConfig(draft_shape=shape).draft_shape is shape
    with pytest.raises(ValueError, match="draft_shape must be one of"):
        SpeculativeConfig(draft_shape="bush")


def test_a_rank_beyond_the_drafts_choices_is_refused():
    star = TreeShape.from_paths([[0], [1], [2]])  # lists of ranks are paths too
    assert choose_shape(star, [], 8, choices=3).tree is star
    with pytest.raises(ValueError, match="rank 2 .* proposes from 2 tokens"):
        choose_shape(star, [], 8, choices=2)


def test_a_shape_that_is_no_shape_is_refused():
    with pytest.raises(TypeError, match="TreeShape.from_paths"):
        SpeculativeConfig(draft_shape=[(0, 0), (1,)])
