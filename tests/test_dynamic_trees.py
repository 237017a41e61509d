"""Dynamic draft trees (`SpeculativeConfig(draft_shape="dynamic")`, `DynamicTree`, EAGLE-2): each row's own tree per
round, exactly the target's output.

- the pool: every node's value is its cumulative draft log-probability, a level's frontier is its best nodes, and the
  kept nodes are the best `nodes`, ancestor-closed, re-indexed in level order;
- drafting against a slow reference round after round (a plain forward per path, processors with the path's
  prefix): every drafted node's token and value, so the draft's cache after each compaction equals a recompute;
- greedy: token for token plain `generate()`'s on every architecture trees serve, one row and a ragged left-padded
  batch whose rows grow different trees;
- sampling: the exact distribution of 3-token continuations (every processor), chi-square, and a wrong variant
  (every row verified with row 0's tree structure) fails the same test (power).
"""

import pytest
import torch
from exact import chisquare_pvalue
from test_architectures import batch
from test_tree_drafting import SUBSET, drafting_setup, reference_scores
from test_trees import ALPHA, SETTINGS, assert_greedy_identity_or_refused, exact_for, greedy, sample
from tiny import ARCHITECTURES, PAD, tiny_lm

from hf_specsample import DraftShape, DynamicTree, SpeculativeConfig
from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.policy.shapes import choose_shape
from hf_specsample.proposers.base import DraftBudget
from hf_specsample.proposers.tree_growth import DynamicPool

DYNAMIC = SpeculativeConfig(draft_shape="dynamic", draft_form="as_given")
SMALL = SpeculativeConfig(draft_shape=DynamicTree(nodes=6, depth=3, expand=2), draft_form="as_given")
# fewer nodes than drafted at the sampling tests' depth (2, their room): which nodes are kept matters
NARROW = SpeculativeConfig(draft_shape=DynamicTree(nodes=4, expand=3), draft_form="as_given")
VOCAB = 32


def path_of(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`, given one row's parents."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


# --- the pool -------------------------------------------------------------------------------------------------------


def grown_pool(spec: DynamicTree, rows: int, vocab: int, seed: int, ties: bool = False) -> tuple[DynamicPool, list]:
    """A pool grown from random scores (`ties`: scores of few distinct values, so values tie); with every level's
    scores, to recompute values by hand."""
    generator = torch.Generator().manual_seed(seed)
    pool = DynamicPool(spec, rows, torch.device("cpu"))
    levels = []
    for level in range(spec.depth):
        lanes = 1 if level == 0 else spec.expand
        scores = torch.randn((rows, lanes, vocab), generator=generator)
        if ties:
            scores = scores.round()
        scores[:, :, 0] = float("-inf")  # a token the processors ruled out
        levels.append((pool.frontier() if level else [-1], scores))
        pool.add_level(scores)
    return pool, levels


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize(
    "spec", [DynamicTree(), DynamicTree(nodes=9, depth=4, expand=3), DynamicTree(nodes=40, depth=2)]
)
def test_kept_nodes_are_ancestor_closed_and_the_best_by_cumulative_log_probability(spec, ties):
    rows, vocab = 3, 12
    pool, levels = grown_pool(spec, rows, vocab, seed=5, ties=ties)
    assert pool.levels == spec.depth
    tree, kept = pool.kept()
    assert tree.tokens.shape == kept.shape == (rows, spec.num_nodes)
    for row in range(rows):
        parents = pool.tree.parents[row].tolist()
        tokens = pool.tree.tokens[row].tolist()
        values = pool.values[row]
        # every pool node: its parent is the root or a frontier node of the level before, its value the sum of the
        # log-softmax of the scores along its path, its siblings distinct and the parent's top choices
        for node in range(spec.drafted):
            path = path_of(parents, node)
            expected = 0.0
            for depth, step in enumerate(path):
                frontier, scores = levels[depth]
                lane = frontier.index(parents[step])
                expected += torch.log_softmax(scores[row, lane], dim=-1)[tokens[step]].item()
            if expected == float("-inf"):
                assert values[node] == float("-inf")
            else:
                assert values[node].item() == pytest.approx(expected, abs=1e-5)
        for depth, (frontier, scores) in enumerate(levels):
            for lane, parent in enumerate(frontier):
                children = [
                    node
                    for node in range(spec.drafted)
                    if parents[node] == parent and tree_depth(pool, node) == depth + 1
                ]
                assert len(children) == spec.expand
                got = sorted(tokens[node] for node in children)
                best = torch.sort(scores[row, lane], descending=True, stable=True).indices[: spec.expand].tolist()
                assert got == sorted(best)
        # each level's frontier: the best `expand` of its block
        for level in range(spec.depth - 1):
            start = pool.starts[level]
            end = pool.starts[level + 1]
            block = values[start:end]
            if block.numel() > spec.expand:
                assert block[: spec.expand].min() >= block[spec.expand :].max()
        # kept: the best `nodes` values, ancestor-closed, level order, parents re-indexed
        kept_row = kept[row].tolist()
        others = [node for node in range(spec.drafted) if node not in kept_row]
        if others:
            assert values[kept_row].min() >= values[others].max()
        assert kept_row == sorted(kept_row)
        for index, node in enumerate(kept_row):
            parent = parents[node]
            assert parent < 0 or parent in kept_row
            new_parent = int(tree.parents[row, index])
            assert new_parent == (kept_row.index(parent) if parent >= 0 else -1)
            assert new_parent < index
            assert int(tree.tokens[row, index]) == tokens[node]
            assert int(tree.depths[row, index]) == len(path_of(parents, node))


def tree_depth(pool: DynamicPool, node: int) -> int:
    return int(pool.tree.depths[0, node])


# --- drafting against a slow reference, round after round -----------------------------------------------------------

PROCESSORS = {
    "none": {},
    "prefix": dict(do_sample=True, repetition_penalty=1.5, no_repeat_ngram_size=2, temperature=1.3),
    "sampling": dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.95),
}


@pytest.mark.parametrize("processing", list(PROCESSORS))
@pytest.mark.parametrize("padding", [[0], [3, 0]], ids=["one_row", "two_rows"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("subset", [None, SUBSET], ids=["full_vocabulary", "subset"])
@torch.no_grad()
def test_dynamic_drafts_equal_the_slow_reference_round_after_round(
    processing, padding, cache, attention, subset, monkeypatch
):
    """Four rounds, each followed by a ragged accepted path (`ENDINGS`), compaction and the loop's rollback: the
    compaction keeps exactly the path's fed nodes, and every drafted node of every round has the reference's value
    along its path and is among its parent's reference top choices, so each round's cache (the root's logits, the
    frontier's) equals a recompute over the committed prefix."""
    model, generator, sequences, processors, proposer = drafting_setup(
        attention, PROCESSORS, processing, padding, subset, cache
    )
    pools = []
    kept_of = DynamicPool.kept
    monkeypatch.setattr(DynamicPool, "kept", lambda self: pools.append(self) or kept_of(self))
    spec = DynamicTree(nodes=7, depth=4, expand=2)
    for round_ in range(len(ENDINGS)):
        before = proposer.forward_passes
        proposal = proposer.get_candidates(sequences, DraftBudget(0, 0, spec))
        assert proposal.model_steps == spec.depth == proposer.forward_passes - before
        pool = pools[-1]
        for row in range(sequences.num_active):
            parents, tokens = pool.tree.parents[row].tolist(), pool.tree.tokens[row].tolist()
            for parent in [-1, *sorted(set(parents) - {-1})]:
                path = [tokens[node] for node in path_of(parents, parent)] if parent >= 0 else []
                reference = torch.log_softmax(reference_scores(model, processors, sequences, row, path, subset), -1)
                base = pool.values[row, parent].item() if parent >= 0 else 0.0
                children = [node for node in range(spec.drafted) if parents[node] == parent]
                best = torch.sort(reference, descending=True, stable=True)
                for node in children:
                    value = pool.values[row, node].item()
                    if reference[tokens[node]] > float("-inf"):
                        assert value == pytest.approx(base + reference[tokens[node]].item(), abs=1e-4), (round_, row)
                        assert reference[tokens[node]] >= best.values[spec.expand - 1] - 1e-4
                    else:
                        assert value == float("-inf")
        tree, kept = proposal.tree, proposer.model.held_tree.kept
        fed_nodes = {node for start in pool.starts[:-1] for node in range(start, start + spec.expand)}
        fed = [[int(node) in fed_nodes for node in kept[row]] for row in range(sequences.num_active)]
        ends = [choose_end(tree, fed[row], row, ENDINGS[round_][row], generator) for row in range(len(padding))]
        committed = list(sequences.lengths)
        path, counts = accept(sequences, tree, ends, generator)
        proposer.model.keep_path(path, counts)
        # the path's fed nodes stay (each moved from wherever it was fed), nothing else: no pruned or unfed node
        on_path = [sum(fed[row][node] for node in path[row, : counts[row]].tolist()) for row in range(len(padding))]
        assert proposer.runner.fed == [length + kept for length, kept in zip(committed, on_path)]
        proposer.rollback_to_committed(sequences.lengths)


# per round, per row: which node the accepted path ends at (`choose_end`)
ENDINGS = [("deepest_fed", "deepest_fed"), ("random", "random"), ("deepest", "deepest_fed"), ("nothing", "random")]


def choose_end(tree: DraftTree, fed: list[bool], row: int, how: str, generator: torch.Generator) -> int:
    """A kept node of row `row`: the deepest one fed (its whole path fed), a random one, the deepest one (often a
    leaf never fed), or -1 (nothing accepted)."""
    depths = tree.depths[row].tolist()
    if how == "nothing":
        return -1
    if how == "random":
        return int(torch.randint(0, tree.num_nodes, (1,), generator=generator))
    candidates = [node for node in range(tree.num_nodes) if how == "deepest" or fed[node]]
    return max(candidates, key=lambda node: (depths[node], node), default=-1)


def accept(sequences, tree: DraftTree, ends: list[int], generator: torch.Generator):
    """Commit each row's path to node `ends[b]` (-1: none) and a bonus token; return the (rows, D) path, counts."""
    depth = int(tree.depths.max())
    path = torch.full((len(ends), depth), -1, dtype=torch.long)
    committed = []
    for row, end in enumerate(ends):
        nodes = path_of(tree.parents[row].tolist(), end) if end >= 0 else []
        path[row, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        bonus = torch.randint(3, VOCAB, (1,), generator=generator)
        committed.append(torch.cat([tree.tokens[row, nodes], bonus]))
    sequences.extend([0] * len(ends), committed)
    return path, [int((path[row] >= 0).sum()) for row in range(len(ends))]


# --- greedy: plain generate()'s tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_identity_on_every_architecture(name):
    """Plain greedy's tokens on every architecture trees serve; refused before any forward on the others."""
    assert_greedy_identity_or_refused(name, "dynamic", DYNAMIC, SMALL)


def test_a_ragged_batch_grows_different_trees_and_matches_plain(greedy_models, monkeypatch):
    """Rows of different lengths grow different trees (their parents differ), verified per row: plain's tokens; one
    draft forward per level drafted."""
    target, drafts = greedy_models
    ids, mask = batch([[1, 17, 42, 5, 9, 3, 8], [1, 7, 3], [1, 30, 31, 33]])
    grown = []  # (pool, kept tree) per round
    kept_of = DynamicPool.kept
    monkeypatch.setattr(DynamicPool, "kept", lambda self: grown.append((self, kept_of(self))) or grown[-1][1])
    expected = greedy(target, ids, mask)
    for draft in drafts.values():
        grown.clear()
        got = greedy(target, ids, mask, draft_model=draft, speculative_config=DYNAMIC, return_dict_in_generate=True)
        assert torch.equal(got.sequences, expected)
        stats = got.speculative_stats
        assert stats.shape == "dynamic tree: 15 nodes, depth 8, expand 4"
        assert stats.draft_forward_passes == sum(pool.levels for pool, _ in grown)
        trees = [tree for _, (tree, _) in grown if tree.tokens.shape[0] > 1]
        assert any(not torch.equal(tree.parents[0], tree.parents[1]) for tree in trees)


def test_tokens_per_target_pass_against_the_static_default(greedy_models, capsys):
    """A sanity print, no assertion on the count: tokens per target pass of the dynamic tree and of the static
    default (15 nodes each, depth 8), greedy, on the tiny models."""
    target, drafts = greedy_models
    prompt = torch.tensor([[1, 17, 42, 5, 9]])
    kwargs = dict(return_dict_in_generate=True, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    counts = {}
    for kind, draft in drafts.items():
        for shape in ("tree", "dynamic"):
            config = SpeculativeConfig(draft_shape=shape, draft_form="as_given")
            out = target.generate(prompt, draft_model=draft, speculative_config=config, **kwargs)
            counts[kind, shape] = out.speculative_stats.tokens_per_target_pass
    with capsys.disabled():
        print(
            "\ntokens per target pass (tiny models, greedy):", {f"{k}/{s}": round(v, 2) for (k, s), v in counts.items()}
        )


# --- sampling: the exact distribution -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    """The sampling tests' 8-token target (its `drafts` and the `greedy_models` are `conftest.py`'s)."""
    return tiny_lm(seed=0)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("draft_kind, config", [("close", DYNAMIC), ("far", DYNAMIC), ("far", NARROW)])
def test_dynamic_tree_samples_follow_target(target, drafts, setting, draft_kind, config):
    settings = SETTINGS[setting]
    samples, eos = sample(target, drafts[draft_kind], 21, config, **settings)
    assert chisquare_pvalue(exact_for(target, eos, **settings), samples) > ALPHA


def test_nodes_kept_by_their_own_probability_fail_the_same_test(target, drafts, monkeypatch):
    """Power: keeping the nodes of the best last-step log-probability instead of the best cumulative one (a plausible
    bug) keeps nodes whose parent was pruned: they hang off the root at their own depth, so the target's logits after
    them are those of another position, and the same test must fail. (A tree that is merely worse, such as one chosen
    by the target's probabilities or drafted without the processors' path, stays exact: every emitted token is the
    target's draw at its node, whichever tree holds it.)"""
    add_level = DynamicPool.add_level

    def own_log_probability(self, scores, tokens_of=None):
        add_level(self, scores, tokens_of)
        start = self.starts[self.levels - 1]
        block = slice(start, start + (scores.shape[1] * self.spec.expand))
        parents = self.tree.parents[:, block]
        parent_values = torch.where(parents >= 0, self.values.gather(1, parents.clamp(min=0)), 0.0)
        self.own = getattr(self, "own", torch.zeros_like(self.values))
        self.own[:, block] = self.values[:, block] - parent_values

    kept_of = DynamicPool.kept

    def kept_by_own(self):
        self.values = self.own
        return kept_of(self)

    monkeypatch.setattr(DynamicPool, "add_level", own_log_probability)
    monkeypatch.setattr(DynamicPool, "kept", kept_by_own)
    samples, _ = sample(target, drafts["far"], 21, NARROW, temperature=0.7)
    assert chisquare_pvalue(exact_for(target, temperature=0.7), samples) < ALPHA


# --- the choice -----------------------------------------------------------------------------------------------------


def test_a_dynamic_tree_wider_than_the_draft_or_empty_is_refused(target, drafts):
    """Where trees cannot run at all: `test_trees.py::test_trees_are_refused_where_they_cannot_run[dynamic]`."""
    prompt = torch.tensor([[1, 5, 2, 5]])
    wide = SpeculativeConfig(draft_shape=DynamicTree(expand=1000), draft_form="as_given")
    with pytest.raises(ValueError, match="expand <="):
        target.generate(
            prompt, max_new_tokens=4, pad_token_id=PAD, draft_model=drafts["close"], speculative_config=wide
        )
    with pytest.raises(ValueError, match="positive int"):
        DynamicTree(nodes=0)


def test_the_choice_and_the_option():
    assert SpeculativeConfig(draft_shape="dynamic").draft_shape is DraftShape.DYNAMIC
    explicit = DynamicTree(nodes=7, depth=3, expand=2)
    assert SpeculativeConfig(draft_shape=explicit).draft_shape is explicit
    assert choose_shape(DraftShape.DYNAMIC, [], 8).tree == DynamicTree()
    assert choose_shape(DraftShape.DYNAMIC, [], 3).tree == DynamicTree(depth=3)
    assert choose_shape(explicit, [], 8).tree is explicit
    assert choose_shape(explicit, [], 8).reason == "dynamic tree: 7 nodes, depth 3, expand 2"
    assert DynamicTree(nodes=40, depth=2).num_nodes == 4 + 16  # no more than drafted
    with pytest.raises(ValueError, match="a hybrid target.*draft_shape='chain'"):
        choose_shape(DraftShape.DYNAMIC, ["a hybrid target"], 8)
    with pytest.raises(TypeError, match="DynamicTree"):
        SpeculativeConfig(draft_shape=[(0, 0), (1,)])


def test_max_lookahead_cuts_a_dynamic_tree(target, drafts):
    config = SpeculativeConfig(draft_shape="dynamic", max_lookahead=2, draft_form="as_given")
    out = target.generate(PROMPT_SHORT, max_new_tokens=6, pad_token_id=PAD, draft_model=drafts["close"],
                          speculative_config=config, return_dict_in_generate=True)  # fmt: skip
    assert out.speculative_stats.shape == "dynamic tree: 15 nodes, depth 2, expand 4"
    assert max(out.speculative_stats.nodes_per_round) == 15


PROMPT_SHORT = torch.tensor([[1, 5, 2, 5]])
