"""The accept/reject math as pure tensors: hand-built cases with known outcomes, then statistics."""

import pytest
import torch
from scipy import stats

from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.sampling.draws import first_argmax, sample_from_weights
from hf_specsample.verify.rules import Verdict, block_accept, flag_nonfinite, greedy_accept, speculative_accept

V = 6


def one_hot(*tokens: int) -> torch.Tensor:
    """`(len(tokens), V)` one-hot rows."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_accept_all_then_bonus_from_last_target_position():
    draft_tokens = torch.tensor([[2, 4, 1]])
    draft_probs = one_hot(2, 4, 1)[None]  # the draft was certain
    target_probs = torch.cat([one_hot(2, 4, 1), one_hot(5)])[None]  # target agrees, then is sure of 5
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs)
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.next_tokens.tolist() == [5]


def test_reject_first_recovers_from_residual():
    draft_tokens = torch.tensor([[2, 4]])
    draft_probs = one_hot(2, 4)[None]
    target_probs = one_hot(3, 4, 5)[None]  # target gives token 2 no mass
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs)
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.next_tokens.tolist() == [3]  # residual max(0, q - p) is all on 3


def test_reject_middle():
    draft_tokens = torch.tensor([[2, 4, 1]])
    draft_probs = one_hot(2, 4, 1)[None]
    target_probs = one_hot(2, 0, 1, 5)[None]  # accepts 2, rejects 4
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs)
    assert verdict.num_accepted.tolist() == [1]
    assert verdict.next_tokens.tolist() == [0]


def test_zero_draft_probability_rejects_without_dividing():
    draft_tokens = torch.tensor([[3]])
    draft_probs = torch.zeros(1, 1, V)
    draft_probs[0, 0, 1] = 1.0  # the draft claims it could not have sampled 3
    target_probs = torch.full((1, 2, V), 1.0 / V)
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs, uniform=torch.zeros(1, 1))
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.next_tokens.item() != 1  # residual (q - p)+ has no mass on the draft's token 1


def test_all_zero_residual_falls_back_to_target():
    draft_tokens = torch.tensor([[4]])
    draft_probs = one_hot(2)[None]  # p(4) = 0 forces the rejection; p >= q everywhere, so (q - p)+ == 0
    target_probs = torch.cat([one_hot(2), one_hot(0)])[None]
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs)
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.next_tokens.tolist() == [2]  # sampled from q itself, no NaN


@pytest.mark.parametrize("uniform, accepted", [(0.49, 1), (0.51, 0)])
def test_acceptance_threshold_is_target_over_draft(uniform, accepted):
    draft_tokens = torch.tensor([[1]])
    draft_probs = torch.zeros(1, 1, V)
    draft_probs[0, 0, 1], draft_probs[0, 0, 2] = 0.6, 0.4
    target_probs = torch.zeros(1, 2, V)
    target_probs[0, 0, 1], target_probs[0, 0, 3] = 0.3, 0.7  # q/p = 0.5
    target_probs[0, 1, 0] = 1.0
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs, uniform=torch.tensor([[uniform]]))
    assert verdict.num_accepted.tolist() == [accepted]
    assert verdict.next_tokens.tolist() == ([0] if accepted else [3])


def test_rows_are_independent():
    draft_tokens = torch.tensor([[2, 4], [2, 4]])
    draft_probs = one_hot(2, 4)[None].repeat(2, 1, 1)
    target_probs = torch.stack([one_hot(2, 4, 5), one_hot(1, 4, 5)])
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs)
    assert verdict.num_accepted.tolist() == [2, 0]
    assert verdict.next_tokens.tolist() == [5, 1]


def test_no_draft_tokens_samples_from_target():
    target_probs = one_hot(4)[None]
    verdict = speculative_accept(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, V), target_probs)
    assert verdict.num_accepted.tolist() == [0] and verdict.next_tokens.tolist() == [4]


def test_greedy_accept():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [5, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [1, 2, 3, 4]])
    verdict = greedy_accept(DraftTree.chain(draft), target)
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.next_tokens.tolist() == [4, 0, 1]


def test_sample_from_weights_follows_unnormalised_weights():
    weights = torch.tensor([0.0, 1.0, 2.0, 0.0, 5.0, 2.0])
    generator = torch.Generator().manual_seed(1)
    draws = sample_from_weights(weights.expand(50_000, V), generator)
    counts = torch.bincount(draws, minlength=V)
    assert counts[0] == 0 and counts[3] == 0  # zero weight is never drawn
    assert _chisquare_pvalue(counts[weights > 0], weights[weights > 0]) > 1e-3


def test_sample_from_weights_edges(monkeypatch):
    """A row of zeros draws index 0; NaN / inf rows draw an index in range (flagged elsewhere); the extreme uniforms
    draw the first and the last positive weight, never a zero one (nor a weight below the float64 sum's resolution)."""
    weights = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, float("nan"), 1.0, 0.0], [1.0, float("inf"), 0.0, 0.0]])
    draws = sample_from_weights(weights, torch.Generator().manual_seed(0))
    assert draws[0] == 0 and ((draws >= 0) & (draws < 4)).all()
    tiny_last = torch.tensor([[3.0, 0.0, 1e-300, 0.0, 0.0], [0.0, 0.5, 0.25, 0.25, 0.0]])
    for uniform, expected in ((0.0, [0, 3]), (1.0 - 2.0**-53, [0, 1])):  # [0, 1)'s ends
        monkeypatch.setattr(
            torch, "rand", lambda shape, u=uniform, **kwargs: torch.full(shape, u, dtype=kwargs["dtype"])
        )
        assert sample_from_weights(tiny_last).tolist() == expected


def test_sample_from_weights_is_reproducible_with_a_generator():
    weights = torch.rand(100, V)
    first = sample_from_weights(weights, torch.Generator().manual_seed(7))
    again = sample_from_weights(weights, torch.Generator().manual_seed(7))
    assert torch.equal(first, again)


def _chisquare_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square of `counts` against `probs`, cells expected to hold fewer than `min_expected` samples
    pooled into one (as `exact.py` does): without pooling, one draw in a cell expected 1e-4 times decides the
    statistic, and the p-value of an exact sampler swings between 1 and 1e-27 with the seed."""
    expected = probs.double() / probs.double().sum() * counts.sum()
    small = expected < min_expected
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if expected[-1] == 0:  # nothing pooled
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed.numpy(), expected.numpy()).pvalue


def _random_probs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(2.0 * torch.randn(*shape, V, generator=generator), dim=-1)


def test_first_committed_token_follows_target_and_acceptance_is_overlap():
    """With K=2, the first committed token must be distributed as q_0, whatever p is; P(accept d_1) = sum min(p, q)."""
    generator = torch.Generator().manual_seed(3)
    rows = 40_000
    draft_probs = _random_probs(generator, 1, 2).expand(rows, 2, V)
    target_probs = _random_probs(generator, 1, 3).expand(rows, 3, V)
    draft_tokens = sample_from_weights(draft_probs, generator)  # (rows, 2), really sampled from draft_probs
    verdict = speculative_accept(draft_tokens, draft_probs, target_probs, generator)
    first = torch.where(verdict.num_accepted > 0, draft_tokens[:, 0], verdict.next_tokens)
    counts = torch.bincount(first, minlength=V)
    assert _chisquare_pvalue(counts, target_probs[0, 0]) > 1e-3
    overlap = torch.minimum(draft_probs[0, 0], target_probs[0, 0]).sum().item()
    assert abs((verdict.num_accepted > 0).float().mean().item() - overlap) < 4 * (overlap / rows) ** 0.5 + 1e-3


def test_always_accepting_would_fail_the_same_statistic():
    """The statistic above has power: the draft's own first token does not pass as the target's."""
    generator = torch.Generator().manual_seed(3)
    rows = 40_000
    draft_probs = _random_probs(generator, 1, 2).expand(rows, 2, V)
    target_probs = _random_probs(generator, 1, 3).expand(rows, 3, V)
    draft_tokens = sample_from_weights(draft_probs, generator)
    counts = torch.bincount(draft_tokens[:, 0], minlength=V)
    assert _chisquare_pvalue(counts, target_probs[0, 0]) < 1e-6


# --- block verification -------------------------------------------------------------------------------------------

RULES = {"token": speculative_accept, "block": block_accept}


def simulate(rule, target_table, draft_table, lookahead: int, length: int, rows: int, seed: int) -> torch.Tensor:
    """`(rows, length)` tokens generated by rounds of `rule` for a model whose next-token distribution depends only
    on the position: ``target_table[j]`` / ``draft_table[j]`` at position j. Exact iff tokens are independent with
    laws ``target_table[0 .. length-1]``, whatever the rounds' boundaries."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.zeros((rows, length + 2 * (lookahead + 1)), dtype=torch.long)  # room for a finished row's spans
    position = torch.zeros(rows, dtype=torch.long)
    while bool((position < length).any()):
        spans = position[:, None] + torch.arange(lookahead + 1)  # (rows, K + 1)
        draft_probs = draft_table[spans[:, :lookahead]]  # (rows, K, V)
        target_probs = target_table[spans]  # (rows, K + 1, V)
        draft_tokens = sample_from_weights(draft_probs, generator)
        verdict = rule(draft_tokens, draft_probs, target_probs, generator)
        block = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
        block.scatter_(1, verdict.num_accepted[:, None], verdict.next_tokens[:, None])
        active = (position < length)[:, None]  # finished rows draw along but neither write nor advance
        keep = (torch.arange(lookahead + 1)[None, :] <= verdict.num_accepted[:, None]) & active
        out.scatter_(1, spans, torch.where(keep, block, out.gather(1, spans)))
        position += torch.where(active[:, 0], verdict.num_accepted + 1, 0)
    return out[:, :length]


def joint_pvalue(tokens: torch.Tensor, target_table: torch.Tensor) -> float:
    """Chi-square of the joint law of the first 3 tokens against the product of the target's marginals."""
    codes = tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]
    expected = torch.einsum("a,b,c->abc", target_table[0], target_table[1], target_table[2]).reshape(-1)
    return _chisquare_pvalue(torch.bincount(codes, minlength=V**3), expected)


def tables(seed: int, length: int = 12):
    generator = torch.Generator().manual_seed(seed)
    return _random_probs(generator, length), _random_probs(generator, length)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("lookahead", [1, 3])
def test_generated_tokens_follow_the_target_jointly(rule, lookahead):
    target_table, draft_table = tables(seed=5)
    tokens = simulate(RULES[rule], target_table, draft_table, lookahead, length=3, rows=60_000, seed=lookahead)
    assert joint_pvalue(tokens, target_table) > 1e-3


def _accept_first_failure(draft_tokens, draft_probs, target_probs, generator=None):
    """A wrong block rule: stops at the first failed test (as token verification) but keeps block's residuals."""
    verdict = block_accept(draft_tokens, draft_probs, target_probs, generator)
    return Verdict(verdict.num_accepted.clamp(max=1), verdict.next_tokens)


def _always_accept(draft_tokens, draft_probs, target_probs, generator=None):
    rows = torch.arange(draft_tokens.shape[0])
    return Verdict(rows * 0 + draft_tokens.shape[1], sample_from_weights(target_probs[:, -1], generator))


@pytest.mark.parametrize("wrong", [_accept_first_failure, _always_accept])
def test_the_joint_statistic_rejects_wrong_rules(wrong):
    target_table, draft_table = tables(seed=5)
    tokens = simulate(wrong, target_table, draft_table, lookahead=3, length=3, rows=60_000, seed=3)
    assert joint_pvalue(tokens, target_table) < 1e-6


def test_block_reproduces_the_papers_two_token_example():
    """Sun et al.'s example: vocabulary {a, b}, target (1/3, 2/3), draft (2/3, 1/3), K = 2: token verification
    accepts 10/9 tokens per round in expectation, block verification 11/9."""
    rows, generator = 200_000, torch.Generator().manual_seed(0)
    target, draft = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    draft_tokens = sample_from_weights(draft.expand(rows, 2, 2), generator)
    args = (draft_tokens, draft.expand(rows, 2, 2), target.expand(rows, 3, 2), generator)
    token, block = (rule(*args).num_accepted.double().mean().item() for rule in (speculative_accept, block_accept))
    tolerance = 4 * (1.0 / rows) ** 0.5
    assert abs(token - 10 / 9) < tolerance and abs(block - 11 / 9) < tolerance


@pytest.mark.parametrize("seed", range(4))
def test_block_accepts_at_least_as_many_tokens_on_average(seed):
    target_table, draft_table = tables(seed=seed, length=5)
    rows, generator = 100_000, torch.Generator().manual_seed(seed)
    draft_probs = draft_table[:4].expand(rows, 4, V)
    target_probs = target_table.expand(rows, 5, V)
    draft_tokens = sample_from_weights(draft_probs, generator)
    token = speculative_accept(draft_tokens, draft_probs, target_probs, generator).num_accepted.double().mean()
    block = block_accept(draft_tokens, draft_probs, target_probs, generator).num_accepted.double().mean()
    assert block >= token - 4 * (4.0 / rows) ** 0.5  # equal in expectation at worst, up to sampling noise


def test_block_hand_built_cases():
    """Draft = target: everything is kept, then the bonus comes from the last target position. A draft token the
    target gives probability 0 has weight 0: the block ends before it, and the next token avoids it."""
    draft = one_hot(2, 3)[None]  # (1, 2, V): the draft is sure of 2 then 3
    target = torch.cat([one_hot(2, 3), one_hot(5)])[None]  # (1, 3, V)
    verdict = block_accept(torch.tensor([[2, 3]]), draft, target, uniform=torch.tensor([[0.99, 0.99]]))
    assert verdict.num_accepted.tolist() == [2] and verdict.next_tokens.tolist() == [5]
    target = torch.cat([one_hot(2), one_hot(4), one_hot(5)])[None]  # the target never says 3 after 2
    verdict = block_accept(torch.tensor([[2, 3]]), draft, target, uniform=torch.tensor([[0.0, 0.0]]))
    assert verdict.num_accepted.tolist() == [1] and verdict.next_tokens.tolist() == [4]
    zero_draft = torch.cat([one_hot(1), one_hot(3)])[None]  # the draft "sampled" 2 with probability 0
    verdict = block_accept(torch.tensor([[2, 3]]), zero_draft, target, uniform=torch.tensor([[0.0, 0.0]]))
    assert verdict.num_accepted.tolist() == [0] and verdict.next_tokens.tolist() == [2]


# --- point masses: token ids, no dense one-hot ----------------------------------------------------------------------


def test_a_rejected_point_mass_recovers_from_the_target_without_its_token():
    draft_tokens = torch.tensor([[2]])
    target_probs = torch.zeros(1, 2, V)
    target_probs[0, 0, 2], target_probs[0, 0, 3] = 0.5, 0.5
    target_probs[0, 1, 0] = 1.0
    for rule in RULES.values():
        verdict = rule(draft_tokens, None, target_probs, uniform=torch.tensor([[0.9]]))  # 0.9 >= target(2) / 1
        assert verdict.num_accepted.tolist() == [0] and verdict.next_tokens.tolist() == [3]
        verdict = rule(draft_tokens, None, target_probs, uniform=torch.tensor([[0.4]]))
        assert verdict.num_accepted.tolist() == [1] and verdict.next_tokens.tolist() == [0]


def point_mass_round(seed: int, rows: int = 400, lookahead: int = 3):
    """Random target distributions, dense draft distributions, and draft tokens drawn from the target (half of the
    rows) or the draft, so that every number of accepted tokens occurs; a random `(rows, K)` point-mass mask."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = _random_probs(generator, rows, lookahead + 1)  # (rows, K + 1, V)
    draft_probs = _random_probs(generator, rows, lookahead)  # (rows, K, V)
    from_target = sample_from_weights(target_probs[:, :lookahead], generator)
    from_draft = sample_from_weights(draft_probs, generator)
    draft_tokens = torch.where(torch.arange(rows)[:, None] % 2 == 0, from_target, from_draft)  # (rows, K)
    point_mass = torch.rand(rows, lookahead, generator=generator) < 0.5  # (rows, K)
    uniform = torch.rand(rows, lookahead, generator=generator)  # (rows, K)
    return draft_tokens, draft_probs, target_probs, point_mass, uniform


def verdict_of(rule, draft_tokens, draft_probs, target_probs, uniform, **kwargs) -> Verdict:
    """`rule`'s verdict with the given acceptance draws and a fixed generator for the recovered/bonus draws."""
    verdict = rule(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(11), uniform, **kwargs)
    return flag_nonfinite(verdict, draft_probs, target_probs, kwargs.get("point_mass"))


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed", range(3))
def test_point_masses_give_the_verdicts_of_dense_one_hot_rows(rule, seed):
    """`draft_probs=None` (every token a point mass) and a `point_mass` mask (some) give exactly the verdicts of the
    same proposals written as dense one-hot rows, for fixed uniforms and generator."""
    draft_tokens, draft_probs, target_probs, point_mass, uniform = point_mass_round(seed)
    one_hot = torch.nn.functional.one_hot(draft_tokens, V).float()  # (rows, K, V)

    every = verdict_of(RULES[rule], draft_tokens, None, target_probs, uniform)
    expected = verdict_of(RULES[rule], draft_tokens, one_hot, target_probs, uniform)
    assert torch.equal(every.num_accepted, expected.num_accepted)
    assert torch.equal(every.next_tokens, expected.next_tokens)
    assert set(expected.num_accepted.tolist()) == {0, 1, 2, 3}  # every outcome is compared

    # Mixed: the point-mass positions' rows of draft_probs are ignored, even NaN (forced tokens in a model proposal).
    masked = torch.where(point_mass[..., None], float("nan"), draft_probs)
    mixed = verdict_of(RULES[rule], draft_tokens, masked, target_probs, uniform, point_mass=point_mass)
    expected = verdict_of(
        RULES[rule], draft_tokens, torch.where(point_mass[..., None], one_hot, draft_probs), target_probs, uniform
    )
    assert torch.equal(mixed.num_accepted, expected.num_accepted)
    assert torch.equal(mixed.next_tokens, expected.next_tokens)
    assert set(expected.num_accepted.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("rule", list(RULES))
def test_point_masses_follow_the_target_jointly(rule):
    """Rounds of prompt-lookup-like drafts (point masses on a fixed token per position) stay exact."""
    target_table, _ = tables(seed=5)
    tokens_table = torch.tensor([1, 4, 1, 0, 2, 5, 3, 3, 1, 0, 2, 4])  # the token proposed at each position

    def point_mass_rule(draft_tokens, draft_probs, target_probs, generator=None):
        return RULES[rule](draft_tokens, None, target_probs, generator)

    draft_table = torch.nn.functional.one_hot(tokens_table, V).float()  # only to draw the tokens in `simulate`
    tokens = simulate(point_mass_rule, target_table, draft_table, lookahead=3, length=3, rows=60_000, seed=2)
    assert joint_pvalue(tokens, target_table) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [151_936, 152_064, 151_937, 8_193, 8_191, 100])
def test_first_argmax_is_torch_argmax(dtype, width):
    """Bit for bit `torch.argmax`: random rows, ties within a block, across blocks and with the tail (the first
    wins), NaN (the first NaN wins), +inf, rows of -inf, and leading shapes of one to three dimensions."""
    generator = torch.Generator().manual_seed(width)
    scores = torch.randn(12, width, generator=generator).to(dtype)
    last = width - 1
    scores[1, [3, 5]] = 9.0  # a tie in one block
    scores[2, [7, last]] = 9.0  # a tie between the first block and the tail (or the last block)
    scores[3, [width // 2, 1]] = 9.0
    scores[4, [last, width // 3]] = 9.0
    scores[5, [width // 2, 11]] = float("nan")
    scores[6, last] = float("nan")
    scores[7, [2, width // 2]] = float("inf")
    scores[8] = float("-inf")
    scores[9, last] = 50.0  # the maximum in the tail alone
    scores[10] = 0.0  # all equal
    scores[11, :] = scores[11, :].abs().neg()
    scores[11, width // 4] = 0.0  # -0.0 and 0.0 compare equal: the first of them
    for shaped in (scores, scores[0], scores.reshape(3, 4, width)):
        assert torch.equal(first_argmax(shaped), shaped.argmax(dim=-1)), shaped.shape


def _block_weights_reference(ratio: torch.Tensor) -> torch.Tensor:
    """weight_0 = 1, weight_i = min(1, weight_{i-1} ratio_i), by a loop over positions (Sun et al.'s definition)."""
    weights = [torch.ones_like(ratio[:, 0])]
    for i in range(ratio.shape[1]):
        weights.append(torch.minimum(weights[-1] * ratio[:, i], torch.ones_like(ratio[:, i])))
    return torch.stack(weights, dim=1)


def test_block_weights_without_a_loop_match_the_definition():
    """block_accept computes the weights in logs (a running sum less its running maximum): the same values as the
    loop over positions, up to rounding, ratios of 0 (weight 0 from there on) and of 1 (weight 1 exactly) included;
    with drawn uniforms the verdicts agree row for row."""
    generator = torch.Generator().manual_seed(11)
    rows, lookahead = 4000, 5
    draft_probs = _random_probs(generator, rows, lookahead)
    target_probs = _random_probs(generator, rows, lookahead + 1)
    draft_tokens = sample_from_weights(draft_probs, generator)
    target_probs[:50, 2].scatter_(-1, draft_tokens[:50, 2:3], 0.0)  # ratio 0 at the third position
    target_probs[50:100, :lookahead] = draft_probs[50:100]  # ratio 1 everywhere: every weight 1
    draft_p = draft_probs.gather(-1, draft_tokens[..., None])[..., 0].double()
    target_p = target_probs[:, :lookahead].gather(-1, draft_tokens[..., None])[..., 0].double()
    ratio = target_p / draft_p
    running = torch.cat([ratio.new_zeros((rows, 1)), ratio.log().cumsum(dim=-1)], dim=1)
    logs = (running - running.cummax(dim=-1).values).exp()
    reference = _block_weights_reference(ratio)
    assert torch.allclose(logs, reference, rtol=1e-12, atol=0)
    assert (logs[:50, 3:] == 0).all() and (logs[50:100] == 1).all()
    uniform = torch.rand(rows, lookahead, generator=generator)
    verdict = block_accept(draft_tokens, draft_probs, target_probs, uniform=uniform)
    assert verdict.num_accepted[50:100].tolist() == [lookahead] * 50
    assert verdict.num_accepted[:50].max() <= 2  # the block ends before the token the target never says
