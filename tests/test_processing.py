"""PositionwiseProcessor gives every position exactly what plain generate() would give it, one call at a time."""

import pytest
import torch
from transformers.generation import logits_process as lp

from hf_specsample.processing import PositionwiseProcessor, RunKind

VOCAB, BATCH, POSITIONS = 50, 3, 4
PREFIX_LENGTHS = [6, 9, 7]  # ragged rows, as in a batch after different acceptance


def reference(processors, tokens, prefix_lengths, scores):
    """One processor-list call per (row, position), with that position's own prefix: plain generate()."""
    out = torch.empty_like(scores)
    for row in range(scores.shape[0]):
        for position in range(scores.shape[1]):
            prefix = tokens[row : row + 1, : prefix_lengths[row] + position]
            out[row, position] = lp.LogitsProcessorList(processors)(prefix, scores[row, position][None].clone())[0]
    return out


@pytest.mark.parametrize(
    "processors",
    [
        [lp.MinLengthLogitsProcessor(9, eos_token_id=3)],
        [lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=4, eos_token_id=[3, 7])],
        [  # the three kinds in one list, in generate()'s order
            lp.RepetitionPenaltyLogitsProcessor(1.3),
            lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=6, min_new_tokens=3, eos_token_id=[7, 99]),
            lp.TemperatureLogitsWarper(0.7),
            lp.TopKLogitsWarper(10),
        ],
    ],
    ids=["min_length", "min_new_tokens", "mixed"],
)
def test_matches_one_call_per_position(processors):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, 20), generator=generator)
    scores = torch.randn((BATCH, POSITIONS, VOCAB), generator=generator)
    expected = reference(processors, tokens, PREFIX_LENGTHS, scores)
    got = PositionwiseProcessor(processors)(tokens, PREFIX_LENGTHS, scores.clone())
    assert torch.equal(got, expected)
    eos = 3 if processors[0].__class__ is not lp.RepetitionPenaltyLogitsProcessor else 7
    forbidden = torch.isinf(expected[..., eos])  # the thresholds straddle the positions: both cases are tested
    assert forbidden.any() and not forbidden.all()


def test_length_only_processors_are_applied_once_per_call(monkeypatch):
    processor = lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=4, eos_token_id=3)
    positionwise = PositionwiseProcessor([processor])
    assert [kind for kind, _ in positionwise.runs] == [RunKind.LENGTH_ONLY]
    monkeypatch.setattr(type(processor), "__call__", lambda *a: pytest.fail("called per prefix length"))
    positionwise(torch.zeros((BATCH, 20), dtype=torch.long), PREFIX_LENGTHS, torch.zeros((BATCH, POSITIONS, VOCAB)))
