"""The draft tree's verification rule in isolation (`verify.rules`), on a toy language of 6 tokens.

The toy target's next-token law depends on the last two tokens (`Toy`); the draft's top choices at each node build
the tree (deterministic children, as a draft model's top-k). Rounds follow one another until 3 tokens are out, so the
law of the first 3 tokens spans round boundaries. Three checks:

- the analytic proof: the law of the first 3 emitted tokens, computed by recursion over the rule's walk with every
  draw enumerated, equals the target's own law to 1e-9 (chains, stars, mixed trees, EOS inside the tree);
- chi-square of 200,000 seeded rounds of `tree_accept` (pooled small cells) at temperatures 0.3-1.5, top-k, top-p;
- power: the same statistic rejects three wrong rules (the q-divided rule, a rule that needs distinct siblings fed
  duplicate ones, Medusa's typical acceptance).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from exact import chisquare_pvalue
from transformers.generation import logits_process as lp
from tree_math import expected_tokens, path_probabilities

from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.options import TreeShape
from hf_specsample.sampling.draws import sample_from_weights, sample_uniform
from hf_specsample.verify.rules import NonFinite, Verdict, flag_nonfinite, greedy_accept, tree_accept, walk

V = 6
EOS = 0
BOS = V  # the context before the first token (never emitted)
NUM_TOKENS = 3
ROWS = 200_000
ALPHA = 1e-3  # seeded: each p-value is deterministic; an exact rule fails with probability ALPHA
POWER = 1e-6  # a wrong rule's p-value must fall below this

SHAPES = {
    "chain": TreeShape.chain(3),
    "star": TreeShape.from_paths([(0,), (1,), (2,)]),
    "mixed": TreeShape.from_paths([(0, 0, 0), (0, 1), (1, 0), (2,)]),
}
WARPERS: dict[str, list] = {
    "t0.3": [lp.TemperatureLogitsWarper(0.3)],
    "t0.7": [lp.TemperatureLogitsWarper(0.7)],
    "t1.0": [],
    "t1.5": [lp.TemperatureLogitsWarper(1.5)],
    "top_k": [lp.TemperatureLogitsWarper(0.9), lp.TopKLogitsWarper(3)],
    "top_p": [lp.TemperatureLogitsWarper(1.2), lp.TopPLogitsWarper(0.8)],
}


class Toy:
    """A target and a draft whose next-token laws depend on the last two tokens (`BOS` before the first).

    Attributes:
        target: `(V + 1, V + 1, V)` float64, the target's processed probabilities after each context.
        draft: `(V + 1, V + 1, V)` float64, the draft's (a perturbed target, EOS favoured: it enters trees).
    """

    def __init__(self, warpers: list, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        logits = 1.5 * torch.randn(V + 1, V + 1, V, generator=generator)
        draft_logits = logits + torch.randn(V + 1, V + 1, V, generator=generator)
        draft_logits[..., EOS] += 1.0
        flat = logits.reshape(-1, V)
        for warper in warpers:
            flat = warper(torch.zeros((flat.shape[0], 0), dtype=torch.long), flat)
        self.target = torch.softmax(flat.double(), dim=-1).reshape(V + 1, V + 1, V)
        self.draft = torch.softmax(draft_logits.double(), dim=-1)

    def tree(self, shape: TreeShape, context: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
        """Each row's tree of `shape` after its `context` `(rows, 2)`: a node takes the draft's choice of its rank at
        its parent. Returns the tree and `(rows, N + 1, 2)` the context before each position (root, then nodes)."""
        contexts = [context]
        tokens = []
        order = self.draft.argsort(dim=-1, descending=True, stable=True)  # (V + 1, V + 1, V) the draft's choices
        for parent, rank in zip(shape.parents, shape.ranks):
            before = contexts[parent + 1]  # (rows, 2)
            token = order[before[:, 0], before[:, 1], rank]  # (rows,)
            tokens.append(token)
            contexts.append(torch.stack([before[:, 1], token], dim=1))
        tree = DraftTree.of_shape(shape, torch.stack(tokens, dim=1) if tokens else context[:, :0])
        return tree, torch.stack(contexts, dim=1)

    def at(self, table: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        """`(rows, positions, V)` the table's law after each context `(rows, positions, 2)`."""
        return table[contexts[..., 0], contexts[..., 1]]

    def exact_law(self, count: int = NUM_TOKENS) -> dict[tuple[int, ...], float]:
        """The target's law of its first `count` tokens (cut after EOS)."""
        law: dict[tuple[int, ...], float] = {}
        for sequence in itertools.product(range(V), repeat=count):
            end = sequence.index(EOS) + 1 if EOS in sequence else count
            if any(token != 0 for token in sequence[end:]):
                continue  # a sequence cut at EOS is counted once
            mass, context = 1.0, (BOS, BOS)
            for token in sequence[:end]:
                mass *= self.target[context[0], context[1], token].item()
                context = (context[1], token)
            law[sequence[:end]] = law.get(sequence[:end], 0.0) + mass
        return law


# --- the analytic proof --------------------------------------------------------------------------------------------


def rule_law(toy: Toy, shape: TreeShape, context: tuple[int, int], count: int, memo: dict) -> dict:
    """The law of the next `count` tokens (cut after EOS) when rounds of the rule's walk produce them: every draw
    sequence of a round enumerated, each weighted by the target's probability of its draws where the walk made them."""
    if count == 0:
        return {(): 1.0}
    if (context, count) in memo:
        return memo[(context, count)]
    levels = shape.max_depth + 1
    draws = torch.tensor(list(itertools.product(range(V), repeat=levels)))  # (R, levels), every draw sequence
    tree, contexts = toy.tree(shape, torch.tensor([context]).expand(draws.shape[0], 2))
    verdict = walk(tree, lambda level, position: draws[:, level], shape.max_depth)
    probs = toy.at(toy.target, contexts)  # (R, N + 1, V)
    law: dict[tuple[int, ...], float] = {}
    for row in range(draws.shape[0]):
        accepted = int(verdict.num_accepted[row])
        if any(draws[row, accepted + 1 :].tolist()):
            continue  # draws after the walk ended are never used: count each walk once
        positions = [0] + (verdict.path[row, :accepted] + 1).tolist()
        weight = math.prod(probs[row, at, draws[row, level]].item() for level, at in enumerate(positions))
        if weight == 0.0:
            continue
        emitted = verdict.accepted_tokens[row, :accepted].tolist() + [int(verdict.next_tokens[row])]
        assert emitted == draws[row, : accepted + 1].tolist()  # the walk emits its draws
        emitted = emitted[: emitted.index(EOS) + 1] if EOS in emitted else emitted
        emitted = emitted[:count]
        if emitted[-1] == EOS or len(emitted) == count:
            rest = {(): 1.0}
        else:
            after = (list(context) + emitted)[-2:]
            rest = rule_law(toy, shape, (after[0], after[1]), count - len(emitted), memo)
        for tail, mass in rest.items():
            key = tuple(emitted) + tail
            law[key] = law.get(key, 0.0) + weight * mass
    memo[(context, count)] = law
    return law


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", [1, 2])
def test_the_rules_law_is_the_targets_exactly(shape, seed):
    toy = Toy(WARPERS["t1.0"], seed=seed)
    law, exact = rule_law(toy, SHAPES[shape], (BOS, BOS), NUM_TOKENS, {}), toy.exact_law()
    assert set(law) <= set(exact)
    assert max(abs(law.get(key, 0.0) - mass) for key, mass in exact.items()) < 1e-9
    assert abs(sum(law.values()) - 1.0) < 1e-9


def test_eos_enters_the_trees_of_the_analytic_proof():
    """The proofs and the chi-square tests cover EOS inside a tree, with children after it: the toys of seeds 1
    and 2 put it at the root's first child (seed 1) and at a leaf (seed 2)."""
    mixed = SHAPES["mixed"]
    tree, _ = Toy(WARPERS["t1.0"], seed=1).tree(mixed, torch.tensor([[BOS, BOS]]))
    assert tree.tokens[0, 0] == EOS and 0 in mixed.parents
    tree, _ = Toy(WARPERS["t1.0"], seed=2).tree(mixed, torch.tensor([[BOS, BOS]]))
    assert tree.tokens[0, -1] == EOS


def test_expected_tokens_is_the_walks_expectation():
    """1 + the path probabilities' sum is the walk's expected committed count, to 1e-12 (draws enumerated)."""
    toy, shape = Toy(WARPERS["t0.7"], seed=2), SHAPES["mixed"]
    draws = torch.tensor(list(itertools.product(range(V), repeat=shape.max_depth + 1)))
    tree, contexts = toy.tree(shape, torch.tensor([[BOS, 3]]).expand(draws.shape[0], 2))
    probs = toy.at(toy.target, contexts)
    verdict = walk(tree, lambda level, position: draws[:, level], shape.max_depth)
    chance = torch.ones(draws.shape[0], dtype=torch.float64)  # each draw sequence's probability, all levels
    for level in range(shape.max_depth + 1):
        at = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], 1)[:, level].clamp(min=0)
        chance *= probs[torch.arange(draws.shape[0]), at, draws[:, level]]
    mean = (chance * (verdict.num_accepted + 1)).sum() / chance.sum()  # draws past the end integrate to 1
    assert abs(mean.item() - expected_tokens(_first(tree), probs[:1]).item()) < 1e-12
    assert path_probabilities(_first(tree), probs[:1]).shape == (1, shape.num_nodes)


def _first(tree: DraftTree) -> DraftTree:
    return DraftTree(tree.tokens[:1], tree.parents[:1], tree.depths[:1])


# --- chi-square, with power ----------------------------------------------------------------------------------------

Rule = Callable[[DraftTree, torch.Tensor, torch.Tensor, int, torch.Generator], Verdict]


def exact_rule(tree, target_probs, draft_probs, max_depth, generator):
    draws = sample_uniform((tree.tokens.shape[0], max_depth + 1), target_probs.device, generator)
    return tree_accept(tree, target_probs.float(), draws)


def simulate(toy: Toy, shape: TreeShape, rule: Rule, seed: int, rows: int = ROWS, tamper=None) -> list[tuple]:
    """The first `NUM_TOKENS` tokens (cut after EOS) of `rows` sequences, made by rounds of `rule` over trees of
    `shape` drafted after each row's context; `tamper` may edit each round's tree (duplicate siblings)."""
    generator = torch.Generator().manual_seed(seed)
    span = shape.max_depth + 1
    out = torch.full((rows, 2 + NUM_TOKENS + span), BOS, dtype=torch.long)  # two BOS, then the tokens
    count = torch.zeros(rows, dtype=torch.long)
    index = torch.arange(rows)
    while True:
        done = (count >= NUM_TOKENS) | (out[:, 2:] == EOS).any(dim=1)
        if bool(done.all()):
            break
        context = torch.stack([out[index, count], out[index, count + 1]], dim=1)  # the last two tokens
        tree, contexts = toy.tree(shape, context)
        if tamper is not None:
            tree = tamper(tree)
        verdict = rule(tree, toy.at(toy.target, contexts), toy.at(toy.draft, contexts), shape.max_depth, generator)
        committed = torch.cat([verdict.accepted_tokens, verdict.next_tokens[:, None]], dim=1)  # (rows, span)
        keep = (torch.arange(span) <= verdict.num_accepted[:, None]) & ~done[:, None]
        columns = 2 + count.clamp(max=NUM_TOKENS)[:, None] + torch.arange(span)  # a finished row writes nothing
        out.scatter_(1, columns, torch.where(keep, committed, out.gather(1, columns)))
        count += torch.where(done, 0, verdict.num_accepted + 1)
    samples = []
    for row in out[:, 2 : 2 + NUM_TOKENS].tolist():
        samples.append(tuple(row[: row.index(EOS) + 1] if EOS in row else row))
    return samples


@pytest.mark.parametrize("warpers", list(WARPERS))
def test_tree_accept_follows_the_target(warpers):
    toy = Toy(WARPERS[warpers], seed=1)
    samples = simulate(toy, SHAPES["mixed"], exact_rule, seed=1)
    assert chisquare_pvalue(toy.exact_law(), samples) > ALPHA


@pytest.mark.parametrize("shape", ["chain", "star"])
def test_tree_accept_follows_the_target_on_chains_and_stars(shape):
    toy = Toy(WARPERS["t0.7"], seed=3)
    assert chisquare_pvalue(toy.exact_law(), simulate(toy, SHAPES[shape], exact_rule, seed=2)) > ALPHA


def _wrong_walk(tree, target_probs, draft_probs, max_depth, generator, choose) -> Verdict:
    """A walk whose choice at a node is `choose(p, q, children, tokens, generator)` -> (child index or -1, token
    drawn where no child was chosen), for the wrong rules below."""
    rows, nodes = tree.tokens.shape
    index = torch.arange(rows)
    current = torch.full((rows,), -1, dtype=torch.long)
    walking = torch.ones(rows, dtype=torch.bool)
    path = torch.full((rows, max_depth), -1, dtype=torch.long)
    next_tokens = torch.zeros(rows, dtype=torch.long)
    for level in range(max_depth + 1):
        p, q = target_probs[index, current + 1].clone(), draft_probs[index, current + 1].clone()
        children = tree.parents == current[:, None]
        if level == max_depth:
            children &= False
        child, drawn = choose(p, q, children, tree.tokens, generator)
        descend = (child >= 0) & walking
        next_tokens = torch.where(walking & ~descend, drawn, next_tokens)
        if level < max_depth:
            path[:, level] = torch.where(descend, child, -1)
        current = torch.where(descend, child, current)
        walking = descend
    accepted = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), next_tokens[:, None])
    return Verdict((path >= 0).sum(-1), next_tokens, path, accepted)


def _q_divided(p, q, children, tokens, generator):
    """Each child accepted with probability min(1, p / q) in rank order, the residual max(0, p - q) after a
    rejection (right for children sampled from q; deterministic children were not)."""
    rows, nodes = tokens.shape
    chosen = torch.full((rows,), -1, dtype=torch.long)
    for node in range(nodes):
        token = tokens[:, node]
        u = torch.rand(rows, generator=generator, dtype=torch.float64)
        p_token, q_token = p.gather(1, token[:, None])[:, 0], q.gather(1, token[:, None])[:, 0]
        trial = children[:, node] & (chosen < 0)
        accept = trial & (u * q_token < p_token)
        chosen = torch.where(accept, node, chosen)
        rejected = trial & ~accept
        residual = (p - q).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        p = torch.where(rejected[:, None], residual / residual.sum(-1, keepdim=True), p)
        q = torch.where(rejected[:, None], q.scatter(1, token[:, None], 0.0), q)
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-300)
    return chosen, sample_from_weights(p, generator)


def _sequential_siblings(p, q, children, tokens, generator):
    """Each child accepted with its target probability over the mass its rejected elder siblings left, the rest
    drawn with the children's tokens zeroed: exact for distinct siblings only."""
    rows, nodes = tokens.shape
    chosen = torch.full((rows,), -1, dtype=torch.long)
    left = torch.ones(rows, dtype=torch.float64)
    residual = p.clone()
    for node in range(nodes):
        token = tokens[:, node]
        u = torch.rand(rows, generator=generator, dtype=torch.float64)
        p_token = p.gather(1, token[:, None])[:, 0]
        trial = children[:, node] & (chosen < 0)
        accept = trial & (u * left < p_token)
        chosen = torch.where(accept, node, chosen)
        left = torch.where(trial & ~accept, left - p_token, left)
        residual = torch.where(children[:, node : node + 1], residual.scatter(1, token[:, None], 0.0), residual)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return chosen, sample_from_weights(residual, generator)


def _typical(p, q, children, tokens, generator, threshold=0.09, alpha=0.3):
    """Medusa's typical acceptance: the first child whose target probability exceeds
    min(threshold, alpha * exp(-entropy)), else a draw from the target."""
    entropy = -(p * p.clamp(min=1e-300).log()).sum(-1)  # (rows,)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    passes = children & (p.gather(1, tokens) > bar[:, None])  # (rows, N)
    chosen = torch.where(passes.any(-1), passes.long().argmax(-1), -1)
    return chosen, sample_from_weights(p, generator)


def _rule(choose) -> Rule:
    return lambda tree, target, draft, depth, generator: _wrong_walk(tree, target, draft, depth, generator, choose)


def _duplicate_first_siblings(tree: DraftTree) -> DraftTree:
    """Node 1 (the root's second child) given node 0's token: duplicate siblings."""
    tokens = tree.tokens.clone()
    tokens[:, 1] = tokens[:, 0]
    return DraftTree(tokens, tree.parents, tree.depths)


WRONG = {
    "q_divided": (_rule(_q_divided), None),
    "duplicate_siblings": (_rule(_sequential_siblings), _duplicate_first_siblings),
    "typical_acceptance": (_rule(_typical), None),
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_the_statistic_rejects_wrong_rules(wrong):
    rule, tamper = WRONG[wrong]
    toy = Toy(WARPERS["t1.0"], seed=1)
    samples = simulate(toy, SHAPES["mixed"], rule, seed=1, tamper=tamper)
    assert chisquare_pvalue(toy.exact_law(), samples) < POWER


def test_the_sequential_sibling_rule_is_exact_with_distinct_siblings():
    """The duplicate-sibling failure above is the duplicates': the same rule passes on distinct siblings."""
    toy = Toy(WARPERS["t1.0"], seed=1)
    samples = simulate(toy, SHAPES["mixed"], _rule(_sequential_siblings), seed=1)
    assert chisquare_pvalue(toy.exact_law(), samples) > ALPHA


def test_expected_tokens_matches_the_sampled_mean():
    toy, shape = Toy(WARPERS["t0.7"], seed=4), SHAPES["mixed"]
    rows, generator = 100_000, torch.Generator().manual_seed(0)
    tree, contexts = toy.tree(shape, torch.tensor([[BOS, BOS]]).expand(rows, 2))
    probs = toy.at(toy.target, contexts)
    verdict = exact_rule(tree, probs, probs, shape.max_depth, generator)
    committed = (verdict.num_accepted + 1).double()
    expected = expected_tokens(tree, probs)
    assert abs(committed.mean() - expected[0]) < 5 * committed.std() / rows**0.5


# --- greedy, hand-built cases, NaN --------------------------------------------------------------------------------


def _reference_greedy(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> list[list[int]]:
    """Per row, the committed tokens walking the argmaxes one node at a time."""
    out = []
    for row in range(tree.tokens.shape[0]):
        node, emitted = -1, []
        for _ in range(max_depth + 1):
            token = int(target_tokens[row, node + 1])
            emitted.append(token)
            child = [j for j in range(tree.num_nodes) if tree.parents[row, j] == node and tree.tokens[row, j] == token]
            if not child:
                break
            node = child[0]
        out.append(emitted)
    return out


@pytest.mark.parametrize("shape", [TreeShape.default(), *SHAPES.values()])
def test_greedy_path_walks_the_argmaxes(shape):
    generator = torch.Generator().manual_seed(0)
    rows = 300
    tree = DraftTree.of_shape(shape, _distinct_siblings(shape, rows, generator))
    target_tokens = torch.randint(0, 4, (rows, shape.num_nodes + 1), generator=generator)
    verdict = greedy_accept(tree, target_tokens, shape.max_depth)
    committed = torch.cat([verdict.accepted_tokens, verdict.next_tokens[:, None]], 1)
    expected = _reference_greedy(tree, target_tokens, shape.max_depth)
    assert [committed[row, : len(want)].tolist() for row, want in enumerate(expected)] == expected
    assert (verdict.num_accepted + 1).tolist() == [len(want) for want in expected]
    assert (verdict.num_accepted > 0).any() and (verdict.num_accepted < shape.max_depth).any()
    one_hot = torch.nn.functional.one_hot(target_tokens, 4).double()
    assert torch.equal(expected_tokens(tree, one_hot), (verdict.num_accepted + 1).double())


def _distinct_siblings(shape: TreeShape, rows: int, generator: torch.Generator) -> torch.Tensor:
    """`(rows, N)` tokens in 0..3 with distinct siblings: each parent's children take a random permutation's ranks."""
    permutation = torch.rand(rows, shape.num_nodes + 1, 4, generator=generator).argsort(-1)  # per parent position
    parents = torch.tensor(shape.parents) + 1
    return permutation[:, parents, torch.tensor(shape.ranks)]


def test_hand_built_tree():
    """Root children 4 (node 0) and 2 (node 1); node 0's child 5 (node 2): the target draws 2, then 3."""
    shape = TreeShape.from_paths([(0, 0), (1,)])
    tree = DraftTree.of_shape(shape, torch.tensor([[4, 2, 5], [4, 2, 5]]))
    probs = torch.zeros(2, 4, V)
    probs[0, 0, 2] = probs[0, 2, 3] = 1.0  # row 0: 2 at the root, then 3 after node 1 (a leaf: the bonus)
    probs[1, 0, 4] = probs[1, 1, 1] = 1.0  # row 1: 4 at the root, then 1 after node 0 (not its child 5)
    probs[:, 3, 0] = probs[0, 1, 0] = probs[1, 2, 0] = 1.0
    verdict = tree_accept(tree, probs, torch.rand(2, 3, 1, dtype=torch.float64))
    assert verdict.path.tolist() == [[1, -1], [0, -1]]
    assert verdict.num_accepted.tolist() == [1, 1]
    assert verdict.next_tokens.tolist() == [3, 1]
    assert verdict.accepted_tokens.tolist() == [[2, 3], [4, 1]]
    assert tree.path_tokens(2)[0].tolist() == [[4, 0], [2, 0], [4, 5]]


def test_nonfinite_flagged_only_where_drawn():
    shape = TreeShape.from_paths([(0, 0), (1,)])
    tree = DraftTree.of_shape(shape, torch.tensor([[4, 2, 5]] * 3))
    probs = torch.zeros(3, 4, V)
    probs[:, 0, 4] = probs[:, 1, 1] = 1.0  # every row: 4 at the root, then 1 (node 0 accepted, then the end)
    probs[:, 2:, 0] = 1.0
    probs[0, 1, 3] = float("nan")  # row 0: at node 0, where it draws
    probs[1, 2, 3] = float("inf")  # row 1: at node 1, never visited
    verdict = flag_nonfinite(tree_accept(tree, probs, torch.rand(3, 3, 1, dtype=torch.float64)), None, probs)
    assert verdict.num_accepted.tolist() == [int(NonFinite.TARGET), 1, 1]


@pytest.mark.parametrize("lookahead", [1, 2, 5])
def test_a_chains_greedy_rule_is_the_walk_on_a_chain(lookahead):
    """`greedy_accept` of a chain (`DraftTree.chain`: no parents built) is the walk on the chain's tree, row for
    row; and it is no identity: a draft off the target's argmax accepts less."""
    generator = torch.Generator().manual_seed(0)
    rows = 500
    draft = torch.randint(0, 3, (rows, lookahead), generator=generator)
    target_tokens = torch.randint(0, 3, (rows, lookahead + 1), generator=generator)
    chain = greedy_accept(DraftTree.chain(draft), target_tokens)
    walked = greedy_accept(DraftTree.of_shape(TreeShape.chain(lookahead), draft), target_tokens, lookahead)
    assert torch.equal(chain.num_accepted, walked.num_accepted) and torch.equal(chain.next_tokens, walked.next_tokens)
    if lookahead:
        assert (chain.num_accepted > 0).any() and (chain.num_accepted < lookahead).any()
        off = greedy_accept(DraftTree.chain((target_tokens[:, :lookahead] + 1) % 3), target_tokens)
        assert not off.num_accepted.any()
