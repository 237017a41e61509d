"""`draft_shape="auto"`: the best tree for an acceptance vector (`shapes`), the ranks a tree round measures
(`draft_tree.rank_observations`), the round-by-round choice between chains and trees at measured costs
(`shapes`, fed synthetic rounds: no clock), and the calls: greedy identity with both shapes in one call,
chains where trees cannot run or the call samples, and why in `speculative_stats.shape`."""

import random
from dataclasses import replace

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm

import hf_specsample.plan.call_plan as plan_module
import hf_specsample.policy.lookahead as lookahead_module
from hf_specsample import SpeculativeConfig, TreeShape
from hf_specsample.core.draft_tree import rank_observations
from hf_specsample.policy.lookahead import AdaptiveLookahead, LookaheadPolicy
from hf_specsample.policy.round_costs import RoundRecord, StaticCosts, expected_tokens
from hf_specsample.policy.shapes import SAMPLING_KEEPS_CHAINS, RankAcceptance, ShapeDesigner, best_trees

# --- the design -----------------------------------------------------------------------------------------------------


def expected_count(shape: TreeShape, accept: list[float]) -> float:
    """1 + the sum over `shape`'s nodes of the product of `accept[rank]` along the node's path (0 for a rank beyond
    `accept`): a reference for the expected tokens `best_trees` sums as it grows its trees."""
    values: list[float] = []
    for parent, rank in zip(shape.parents, shape.ranks):
        p = accept[rank] if rank < len(accept) else 0.0
        values.append(p * (values[parent] if parent >= 0 else 1.0))
    return 1.0 + sum(values)


@pytest.mark.parametrize("alpha", [0.0, 0.35, 0.8, 1.0])
def test_a_chains_expected_tokens_are_the_trees(alpha):
    """One formula: the best trees of one rank are chains, and their expected tokens are E(K) of Theorem 3.8."""
    for lookahead, tree in enumerate(best_trees([alpha], 6, 6), start=1):
        assert tree.is_chain and tree.depth == lookahead
        assert tree.expected == pytest.approx(expected_tokens(alpha, lookahead), rel=1e-12)
        assert expected_count(TreeShape.chain(lookahead), [alpha]) == pytest.approx(tree.expected, rel=1e-12)


def brute_force_best(accept, nodes, max_depth):
    """The most expected tokens of any tree of `nodes` nodes: every parent-closed set of rank paths, grown a node at
    a time from the empty tree."""
    trees = {frozenset()}
    for _ in range(nodes):
        grown = set()
        for tree in trees:
            for parent in [()] + [path for path in tree if len(path) < max_depth]:
                for rank in range(len(accept)):
                    child = parent + (rank,)
                    if child not in tree:
                        grown.add(tree | {child})
        trees = grown
    return max(expected_count(TreeShape.from_paths(list(tree)), accept) for tree in trees)


@pytest.mark.parametrize(
    "accept", [[0.6, 0.25, 0.1], [0.9, 0.05], [0.3, 0.3, 0.2], [0.5, 0.45], [0.2, 0.1, 0.05]], ids=str
)
@pytest.mark.parametrize("max_depth", [2, 3])
def test_best_first_is_the_best_tree_of_every_size(accept, max_depth):
    designed = best_trees(accept, 6, max_depth)
    assert len(designed) == 6
    for nodes, tree in enumerate(designed, start=1):
        shape, expected = tree.shape, tree.expected
        assert shape.num_nodes == nodes and shape.max_depth == tree.depth <= max_depth
        assert tree.is_chain == shape.is_chain
        assert expected == pytest.approx(expected_count(shape, accept))
        assert expected == pytest.approx(brute_force_best(accept, nodes, max_depth))


def test_one_rank_designs_chains_and_a_depth_cap_limits_them():
    for nodes, tree in enumerate(best_trees([0.8], 5, 8), start=1):
        assert tree.shape == TreeShape.chain(nodes) and tree.is_chain
        assert tree.expected == pytest.approx(sum(0.8**i for i in range(nodes + 1)))  # Leviathan's E(K)
    assert len(best_trees([0.8], 5, 3)) == 3  # a chain deeper than 3 is not allowed, and there is nothing else
    spine = best_trees([0.9, 0.05], 4, 8)[-1].shape
    assert spine.is_chain  # the spine's values stay above any second choice's


# --- the ranks a round measures -------------------------------------------------------------------------------------


def test_rank_observations_read_each_rows_walk():
    shape = TreeShape.from_paths([(0, 0), (1,), (0, 1)])  # nodes: (0,) (1,) (0, 0) (0, 1)
    path = torch.tensor(
        [
            [0, 2],  # rank 0 then rank 0: at the root 0 tested and taken; at (0,) 0 tested and taken; (0, 0) a leaf
            [1, -1],  # rank 1 at the root (0 tested before it); (1,) is a leaf
            [0, 3],  # rank 0, then rank 1 at (0,)
            [-1, -1],  # neither of the root's two choices
            [0, -1],  # rank 0, then neither choice at (0,)
        ]
    )
    tested, accepted = rank_observations(shape, path)
    assert tested == (2 + 1 + 2 + 1 + 2, 0 + 1 + 1 + 1 + 1)
    assert accepted == (2 + 0 + 1 + 0 + 1, 0 + 1 + 1 + 0 + 0)


def test_rank_acceptance_from_hazards():
    ranks = RankAcceptance(3, prior_weight=1e-9, decay=1.0)
    ranks.observe(RoundRecord(4, accepted=6, tested=10, draft_seconds=0, verify_seconds=0))  # a chain: rank 0 only
    ranks.observe(RoundRecord(2, 0, 0, 0, 0, nodes=3, rank_tested=(0, 4, 2), rank_accepted=(0, 2, 0)))
    p = ranks.accept()
    assert p == pytest.approx([0.6, 0.4 * 0.5, 0.0], abs=1e-9)


# --- the choice at measured costs -----------------------------------------------------------------------------------

P = [0.7, 0.2]  # the target's token is the draft's first choice 70% of the time, its second 20%


def simulate(verify, rounds=60, draft_step=0.01, seed=0):
    """Feed the auto policy rounds whose acceptance follows `P` (each node's rank drawn per row) and whose durations
    follow `verify(width)` and `draft_step` per level; returns the rounds' (shape, width)."""
    rng = random.Random(seed)
    policy = AdaptiveLookahead(max_lookahead=8, trees=ShapeDesigner(2, 8))
    chosen = []
    for _ in range(rounds):
        depth = policy.choose()
        tree = policy.chosen_tree()
        shape = tree if tree is not None else TreeShape.chain(depth) if depth else None
        width = shape.num_nodes if shape is not None else 0
        chosen.append(("tree" if tree is not None else "chain", width))
        ranks = []
        for _row in range(2):  # the target's rank at each level of a row's walk (2: neither choice)
            ranks.append([rng.choices([0, 1, 2], weights=[P[0], P[1], 1 - sum(P)])[0] for _ in range(depth + 1)])
        if tree is None:
            accepted = [next((i for i, rank in enumerate(row[:depth]) if rank != 0), depth) for row in ranks]
            record = RoundRecord.untimed(depth, accepted, prefill=False, refeed_forwards=0)
        else:
            node = {(parent, rank): n for n, (parent, rank) in enumerate(zip(tree.parents, tree.ranks))}
            path = torch.full((2, depth), -1, dtype=torch.long)
            for row, walk in enumerate(ranks):
                current = -1
                for level, rank in enumerate(walk[:depth]):
                    if (current, rank) not in node:
                        break
                    current = path[row, level] = node[(current, rank)]
            record = RoundRecord(depth, 0, 0, 0, 0, nodes=width, **rank_observations(tree, path)._asdict())
        policy.observe(replace(record, draft_seconds=draft_step * depth, verify_seconds=verify(width)))
    return chosen


def test_flat_verification_costs_choose_wide_trees():
    chosen = simulate(verify=lambda width: 0.3)
    late = chosen[30:]
    assert all(shape == "tree" for shape, _ in late), late
    assert min(width for _, width in late) >= 10  # width is nearly free: the widest trees measured


def test_steep_verification_costs_choose_short_chains():
    chosen = simulate(verify=lambda width: 0.3 * (1 + 0.3 * width))
    late = chosen[20:]
    assert all(shape == "chain" for shape, _ in late), late
    assert {width for _, width in late} <= {1, 2, 3}


def test_static_costs_need_no_clock_for_trees():
    policy = AdaptiveLookahead(costs=StaticCosts(0.05), trees=ShapeDesigner(2, 8))
    assert not policy.needs_timing
    first = policy.choose()
    assert policy.chosen_tree() is not None and first == policy.chosen_tree().max_depth


# --- calls ----------------------------------------------------------------------------------------------------------

PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def generate(target, draft, **kwargs):
    settings = dict(max_new_tokens=40, pad_token_id=PAD, return_dict_in_generate=True)
    return target.generate(PROMPT, draft_model=draft, **{**settings, **kwargs})


class Alternating(LookaheadPolicy):
    """A tree, then a chain of 3, then plain decoding, in turn."""

    TREE = TreeShape.from_paths([(0, 0, 0), (1, 0), (0, 1)])

    def __init__(self):
        self.round = -1

    def choose(self) -> int:
        self.round += 1
        return (self.TREE.max_depth, 3, 0)[self.round % 3]

    def chosen_tree(self):
        return self.TREE if self.round % 3 == 0 else None

    @property
    def needs_timing(self) -> bool:
        return False


def test_greedy_auto_is_plain_greedy_with_trees_and_chains_in_one_call(pair, monkeypatch):
    target, draft = pair
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=40, pad_token_id=PAD)
    monkeypatch.setattr(lookahead_module, "make_policy", lambda *args, **kwargs: Alternating())
    out = generate(target, draft, do_sample=False, speculative_config=SpeculativeConfig(draft_form="as_given"))
    assert torch.equal(out.sequences, expected)
    stats = out.speculative_stats
    assert {"tree", "chain"} <= set(stats.shape_per_round)
    assert stats.shape.startswith("auto: a tree in") and "a chain in" in stats.shape
    trees = [n for shape, n in zip(stats.shape_per_round, stats.nodes_per_round) if shape == "tree"]
    assert set(trees) <= {n.num_nodes for n in (Alternating.TREE, *map(Alternating.TREE.truncated, (1, 2)))}


def test_greedy_auto_drafts_trees_from_a_fixed_cost_model(pair, monkeypatch):
    """A seeded greedy call's costs come from weight sizes (`StaticCosts`, no clock): with a draft made to look
    cheap, verification nearly free in width and a close draft, the policy drafts trees, and the tokens are plain's."""
    target, draft = pair
    monkeypatch.setattr(plan_module, "step_cost_ratio", lambda draft, target, launch_bound: 0.05)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=40, pad_token_id=PAD)
    config = SpeculativeConfig(draft_form="as_given")
    runs = [generate(target, draft, do_sample=False, generator=torch.Generator().manual_seed(0),
                     speculative_config=config) for _ in range(2)]  # fmt: skip
    for out in runs:
        assert torch.equal(out.sequences, expected)
        assert "tree" in out.speculative_stats.shape_per_round
    assert runs[0].speculative_stats.shape_per_round == runs[1].speculative_stats.shape_per_round


def test_auto_falls_back_to_chains_where_trees_cannot_run_and_says_why(pair):
    target, draft = pair
    out = generate(target, draft, do_sample=False, cache_implementation="static")
    stats = out.speculative_stats
    assert stats.shape.startswith("chain (draft_shape='auto' falls back to chains: static caches")
    assert set(stats.shape_per_round) == {"chain"}


def test_sampling_under_auto_drafts_chains_says_why_and_repeats_with_a_seed(pair):
    target, draft = pair
    runs = [generate(target, draft, do_sample=True, temperature=0.8,
                     generator=torch.Generator().manual_seed(5)) for _ in range(2)]  # fmt: skip
    for out in runs:
        assert out.speculative_stats.shape == SAMPLING_KEEPS_CHAINS
        assert set(out.speculative_stats.shape_per_round) == {"chain"}
    assert torch.equal(runs[0].sequences, runs[1].sequences)
