"""Host synchronisations per round, counted without CUDA.

Every `.item()`, `.tolist()`, `.cpu()` and `bool()` of a tensor inside `SpeculativeDecoder.round` is recorded with
its call site. On CUDA each of these waits for the device when the tensor lives there; the test pins which sites
there are and how often they run, and docs/ARCHITECTURE.md ("Host syncs per round") says what each one is. A change
that adds a sync to the loop fails here and must update both.
"""

import collections
import sys

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig, decoding, sequences

FIXED = SpeculativeConfig(num_lookahead=3, draft_quantization="none")
# Sites that only ever read CPU tensors (no device sync): the slot mask (`CachedModel.slot_is_real`, CPU by design) and
# the n-gram search, which runs on the host copy of the token buffer.
HOST_ONLY = {("cached_model.py", "_forward"), ("cached_model.py", "_parts"), ("prompt_lookup.py", "ngram_continuation")}


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def record_rounds(monkeypatch, call) -> list[tuple[collections.Counter, int]]:
    """Per round after the first (which also encodes the prompt): (transfers per call site, tokens committed)."""
    rounds = []
    for name in ("item", "tolist", "cpu", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            if rounds and rounds[-1][0] is not None:
                caller = sys._getframe(1)
                site = (caller.f_code.co_filename.rsplit("/", 1)[-1], caller.f_code.co_name)
                if site not in HOST_ONLY:
                    rounds[-1][0][site] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    original_round, original_advance = decoding.SpeculativeDecoder.round, sequences.Sequences.advance

    def counted_round(self, *args, **kwargs):
        rounds.append([collections.Counter(), 0])
        try:
            return original_round(self, *args, **kwargs)
        finally:
            rounds[-1] = (rounds[-1][0], rounds[-1][1])

    def counted_advance(self, counts):
        if rounds:
            rounds[-1][1] += sum(counts)
        return original_advance(self, counts)

    monkeypatch.setattr(decoding.SpeculativeDecoder, "round", counted_round)
    monkeypatch.setattr(sequences.Sequences, "advance", counted_advance)
    call()
    return rounds[1:]


@pytest.mark.parametrize("do_sample", [False, True])
def test_model_draft_round_syncs_once_plus_once_per_committed_token(pair, monkeypatch, do_sample):
    """`num_accepted.tolist()` once, and the stopping criteria's verdict once per committed token (plain decoding
    checks them after every token too)."""
    target, draft = pair
    rounds = record_rounds(
        monkeypatch,
        lambda: target.generate(
            torch.tensor([[1, 17, 42, 5, 9]]), max_new_tokens=24, min_new_tokens=24, do_sample=do_sample,
            pad_token_id=PAD, draft_model=draft, speculative_config=FIXED,
        ),
    )  # fmt: skip
    assert len(rounds) > 3
    for sites, committed in rounds:
        assert sites == {("decoding.py", "commit"): 1, ("stopping.py", "first_stops"): committed}, sites


@pytest.mark.parametrize("do_sample", [False, True])
def test_prompt_lookup_round_adds_the_token_buffer_copy(pair, monkeypatch, do_sample):
    """Prompt lookup copies the token buffer to the host once per round for its n-gram search, and a row with no
    continuation in a round that drafts reads its last token (one row here: at most one)."""
    target, _ = pair
    rounds = record_rounds(
        monkeypatch,
        lambda: target.generate(
            torch.tensor([[1, 17, 42, 5, 9, 1, 17, 42, 5, 9, 1, 17]]), max_new_tokens=24, min_new_tokens=24,
            do_sample=do_sample, pad_token_id=PAD, draft_model="prompt_lookup", num_lookahead=3,
        ),
    )  # fmt: skip
    assert len(rounds) > 3
    for sites, committed in rounds:
        own_last = sites.pop(("prompt_lookup.py", "propose"), 0)
        assert own_last <= 1, sites
        expected = {("decoding.py", "commit"): 1, ("stopping.py", "first_stops"): committed}
        assert sites == {**expected, ("prompt_lookup.py", "continuations"): 1}, sites
