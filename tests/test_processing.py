"""PositionwiseProcessor gives every position exactly what plain generate() would give it, one call at a time."""

import pytest
import torch
from transformers.generation import logits_process as lp

from hf_specsample.sampling.processing import PositionwiseProcessor, RunKind

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
    got = PositionwiseProcessor(processors, BATCH)(tokens, PREFIX_LENGTHS, scores.clone())
    assert torch.equal(got, expected)
    eos = 3 if processors[0].__class__ is not lp.RepetitionPenaltyLogitsProcessor else 7
    forbidden = torch.isinf(expected[..., eos])  # the thresholds straddle the positions: both cases are tested
    assert forbidden.any() and not forbidden.all()


def test_length_only_processors_are_applied_once_per_call(monkeypatch):
    processor = lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=4, eos_token_id=3)
    positionwise = PositionwiseProcessor([processor], BATCH)
    assert [kind for kind, _ in positionwise.runs] == [RunKind.LENGTH_ONLY]
    monkeypatch.setattr(type(processor), "__call__", lambda *a: pytest.fail("called per prefix length"))
    positionwise(torch.zeros((BATCH, 20), dtype=torch.long), PREFIX_LENGTHS, torch.zeros((BATCH, POSITIONS, VOCAB)))


class PerRowVocabulary(lp.LogitsProcessor):
    """A user processor that treats rows by their index: row i may only emit ids congruent to i mod 3."""

    def __call__(self, input_ids, scores):
        allowed = (torch.arange(scores.shape[1])[None, :] % 3) == torch.arange(scores.shape[0])[:, None] % 3
        return scores.masked_fill(~allowed, -float("inf"))


def whole_batch_reference(processors, tokens, prefix_lengths, scores):
    """Plain generate(): every call holds the whole batch, row b at index b (the other rows' contents unused)."""
    out = torch.empty_like(scores)
    for row in range(scores.shape[0]):
        for position in range(scores.shape[1]):
            length = prefix_lengths[row] + position
            ids = torch.zeros((scores.shape[0], length), dtype=torch.long)
            ids[row] = tokens[row, :length]
            whole = torch.zeros((scores.shape[0], scores.shape[2]))
            whole[row] = scores[row, position]
            out[row, position] = lp.LogitsProcessorList(processors)(ids, whole)[row]
    return out


def row_indexed_processors():
    encoder_ids = torch.randint(0, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(1))
    return {
        "encoder_repetition_penalty": [lp.EncoderRepetitionPenaltyLogitsProcessor(0.5, encoder_ids)],
        "encoder_no_repeat_ngram": [lp.EncoderNoRepeatNGramLogitsProcessor(1, encoder_ids)],
        "user_per_row": [PerRowVocabulary()],
        "prefix_allowed_tokens_fn": [
            lp.PrefixConstrainedLogitsProcessor(lambda batch_id, ids: [batch_id, int(ids[-1]) % VOCAB], 1)
        ],
        "padded_repetition_penalty": [
            lp.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([0, 3, 5]))
        ],
        "fast_top_p_between": [lp.TemperatureLogitsWarper(0.5), PerRowVocabulary(), lp.TopPLogitsWarper(0.8)],
    }


@pytest.mark.parametrize("name", list(row_indexed_processors()))
@pytest.mark.parametrize("row_ids", [[0, 1, 2], [2, 0, 1]], ids=["in-order", "permuted"])
def test_row_indexed_processors_see_the_callers_row_index(name, row_ids):
    """Processors that index rows (the caller's, e.g. after finished rows left the batch) get each row at its index."""
    processors = row_indexed_processors()[name]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, 20), generator=generator)
    scores = torch.randn((BATCH, POSITIONS, VOCAB), generator=generator)
    order = torch.tensor(row_ids)
    expected = whole_batch_reference(processors, tokens, PREFIX_LENGTHS, scores)  # rows in caller order
    lengths = [PREFIX_LENGTHS[row] for row in row_ids]
    got = PositionwiseProcessor(processors, BATCH)(tokens[order], lengths, scores[order].clone(), row_ids)
    assert torch.equal(got, expected[order])
    try:  # one-row calls, as rows grouped by prefix length were called before: they crash or differ here
        group_calls = reference(processors, tokens, PREFIX_LENGTHS, scores)
    except (RuntimeError, ValueError, IndexError, ZeroDivisionError):
        return
    assert not torch.equal(group_calls, expected), "the case must tell group calls from whole-batch calls"
