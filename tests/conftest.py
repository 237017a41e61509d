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
