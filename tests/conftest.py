import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # lets tests import the shared `tiny` / `exact` helpers

import hf_specsample  # noqa: E402,F401  (registers draft_model= on generate())


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same global seed; one thread (tiny models only lose by threading)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="module")
def target():
    """A tiny 64-token target (2 layers): big enough for varied greedy runs, small enough to be instant."""
    from tiny import tiny_lm

    return tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)


@pytest.fixture(scope="module")
def draft(target):
    """A draft close to `target` (its weights plus 10% noise): accepts often, not always."""
    from tiny import perturbed_copy

    return perturbed_copy(target, seed=1, scale=0.1)
