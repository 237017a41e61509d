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


def _timed_forms(monkeypatch, int8_seconds: float, as_given_seconds: float) -> list:
    """Make `DraftQuantization.AUTO`'s timing report these figures (tiny models step faster as given); returns the
    list of timing calls, so a test can check when timing happened."""
    calls = []

    def fake(models, *args, **kwargs):
        calls.append(len(models))
        return [int8_seconds, as_given_seconds]

    monkeypatch.setattr("hf_specsample.prepare.prepared_draft.decode_step_seconds", fake)
    return calls


@pytest.fixture
def int8_steps_faster(monkeypatch):
    """AUTO's timing finds the int8 copy faster (as on the CPUs measured with real drafts)."""
    return _timed_forms(monkeypatch, 0.001, 0.002)


@pytest.fixture
def as_given_steps_faster(monkeypatch):
    """AUTO's timing finds the draft as given faster (as on a CPU with fast bf16, or with a tiny draft)."""
    return _timed_forms(monkeypatch, 0.002, 0.001)


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
