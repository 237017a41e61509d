"""The accept/reject math as pure tensors: hand-built cases with known outcomes, then statistics."""

import pytest
import torch
from scipy import stats

from hf_specsample.rejection import greedy_accept, sample_from_weights, speculative_accept

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
    verdict = greedy_accept(draft, target)
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.next_tokens.tolist() == [4, 0, 1]


def test_sample_from_weights_follows_unnormalised_weights():
    weights = torch.tensor([0.0, 1.0, 2.0, 0.0, 5.0, 2.0])
    generator = torch.Generator().manual_seed(1)
    draws = sample_from_weights(weights.expand(50_000, V), generator)
    counts = torch.bincount(draws, minlength=V)
    assert counts[0] == 0 and counts[3] == 0  # zero weight is never drawn
    assert _chisquare_pvalue(counts[weights > 0], weights[weights > 0]) > 1e-3


def test_sample_from_weights_is_reproducible_with_a_generator():
    weights = torch.rand(100, V)
    first = sample_from_weights(weights, torch.Generator().manual_seed(7))
    again = sample_from_weights(weights, torch.Generator().manual_seed(7))
    assert torch.equal(first, again)


def _chisquare_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    probs = probs.double() / probs.double().sum()
    return stats.chisquare(counts.double().numpy(), (probs * counts.sum()).numpy()).pvalue


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
