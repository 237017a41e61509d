"""Prompt-lookup drafting: the n-gram search, and exactness through generate() (a point-mass draft)."""

import torch

from hf_specsample.prompt_lookup import ngram_continuation


def continuation(tokens, max_ngram=3, num_tokens=4, usable=None):
    tokens = torch.tensor(tokens)
    usable = torch.ones_like(tokens, dtype=torch.bool) if usable is None else torch.tensor(usable)
    return ngram_continuation(tokens, usable, max_ngram, num_tokens).tolist()


def test_continues_after_the_latest_earlier_occurrence():
    assert continuation([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], max_ngram=2) == [8, 2, 5, 6]  # (5, 6) at 0 and 4: the latest
    assert continuation([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], max_ngram=2, num_tokens=2) == [8, 2]


def test_longest_ngram_first():
    # (9, 5, 6) occurs at 0 (followed by 7); (5, 6) alone occurs later at 5 (followed by 8): the 3-gram wins.
    assert continuation([9, 5, 6, 7, 1, 5, 6, 8, 9, 5, 6], max_ngram=3) == [7, 1, 5, 6]
    assert continuation([9, 5, 6, 7, 1, 5, 6, 8, 9, 5, 6], max_ngram=2) == [8, 9, 5, 6]


def test_continuation_stops_at_the_end_of_the_text():
    assert continuation([3, 4, 3, 4], max_ngram=2, num_tokens=10) == [3, 4]  # (3, 4) at 0: followed by 3, 4


def test_no_occurrence_and_padding():
    assert continuation([1, 2, 3, 4]) == []
    # (7, 8) occurs at 0, but inside prompt padding: no n-gram may touch padding.
    assert continuation([7, 8, 9, 1, 7, 8], max_ngram=2, usable=[0, 0, 1, 1, 1, 1]) == []
    assert continuation([7, 8, 9, 1, 7, 8], max_ngram=2) == [9, 1, 7, 8]
