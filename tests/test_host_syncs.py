"""Host synchronisations per round, counted without CUDA.

Every `.item()`, `.tolist()`, `.cpu()` and `bool()` of a tensor inside `SpeculativeDecoder.round` is recorded with
its call site. On CUDA each of these waits for the device when the tensor lives there; the test pins which sites
there are and how often they run, and docs/internals.md ("Host syncs per round", under the invariants) says what
each one is. A change that adds a sync to the loop fails here and must update both.
"""

import collections
import sys

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_specsample import SpeculativeConfig, decoding
from hf_specsample.cache.forwards import Forwards
from hf_specsample.cache.runner import RunnerBackend, RunnerPlan
from hf_specsample.core import sequences
from hf_specsample.plan import call_plan as plan

FIXED = SpeculativeConfig(num_lookahead=3, draft_form="as_given")
# Sites that only ever read CPU tensors (no device sync): the slot mask (`CachedModel.slot_is_real`, CPU by design).
HOST_ONLY = {("cached_model.py", "_forward"), ("cached_model.py", "_parts")}


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def record_rounds(monkeypatch, call, extra: tuple[str, ...] = ()) -> list[tuple[collections.Counter, int]]:
    """Per round after the first (which also encodes the prompt): (transfers per call site, tokens committed).

    `extra`: more conversions to count (`__int__`: a static cache's write pointer read as a Python int)."""
    rounds = []
    for name in ("item", "tolist", "cpu", "__bool__", *extra):
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
@pytest.mark.parametrize("streamer", [False, True])
def test_model_draft_round_syncs_once(pair, monkeypatch, do_sample, streamer):
    """One read per round: the accepted counts, with the EOS flags of the round's tokens (the max-length criterion
    is decided on the host) and, when streaming, the tokens streamed. Plain decoding reads its stop flag once per
    token."""
    target, draft = pair
    rounds = record_rounds(
        monkeypatch,
        lambda: target.generate(
            torch.tensor([[1, 17, 42, 5, 9]]), max_new_tokens=24, min_new_tokens=24, do_sample=do_sample,
            pad_token_id=PAD, eos_token_id=2, draft_model=draft, speculative_config=FIXED,
            streamer=Collect() if streamer else None,
        ),
    )  # fmt: skip
    assert len(rounds) > 3
    for sites, _ in rounds:
        assert sites == {("stopping.py", "read_round"): 1}, sites


class Collect:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        pass


def test_other_stopping_criteria_read_their_verdict_per_committed_token(pair, monkeypatch):
    """A criterion that is neither max length, max time nor EOS (a stop string, a user's) is called on every
    committed prefix, as plain decoding calls it, each call reading its verdict."""
    target, draft = pair

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    rounds = record_rounds(
        monkeypatch,
        lambda: target.generate(
            torch.tensor([[1, 17, 42, 5, 9]]), max_new_tokens=24, min_new_tokens=24, pad_token_id=PAD,
            draft_model=draft, speculative_config=FIXED, stopping_criteria=StoppingCriteriaList([Never()]),
        ),
    )  # fmt: skip
    assert len(rounds) > 3
    for sites, committed in rounds:
        assert sites == {("stopping.py", "read_round"): 1, ("stopping.py", "_prefix_stops"): committed}, sites


@pytest.mark.parametrize("do_sample", [False, True])
def test_prompt_lookup_round_adds_the_token_buffer_copy(pair, monkeypatch, do_sample):
    """Prompt lookup (the suffix drafter over the row's own text) copies the token buffer to the host once per round
    for its search; a round that drafts a tree reads it back as a dynamic tree's round does."""
    target, _ = pair
    rounds = record_rounds(
        monkeypatch,
        lambda: target.generate(
            torch.tensor([[1, 17, 42, 5, 9, 1, 17, 42, 5, 9, 1, 17]]), max_new_tokens=24, min_new_tokens=24,
            do_sample=do_sample, pad_token_id=PAD, draft_model="prompt_lookup", num_lookahead=3,
        ),
    )  # fmt: skip
    assert len(rounds) > 3
    trees = 0
    for sites, _ in rounds:
        tree_reads = {site: sites.pop(site) for site in list(sites) if site in TREE_READS}
        if tree_reads:  # a round that drafted a tree reads it back, as a dynamic tree's round does
            assert tree_reads == TREE_READS, tree_reads
            trees += 1
        assert sites == {("stopping.py", "read_round"): 1, ("suffix.py", "row_trees"): 1}, sites
    assert trees > 0


# A round's tree built per row, as a dynamic tree's or the suffix drafter's: its parents, depths and tokens copied for
# the tree mask (`CachedTree`), its depths for the verifier's processing, its accepted path for the compactions.
TREE_READS = {
    ("tree_forward.py", "__init__"): 3,
    ("verifier.py", "_host_depths"): 1,
    ("decoding.py", "keep_path"): 2,
    ("tree_forward.py", "compact"): 1,
    ("tree_forward.py", "<listcomp>"): 1,
}


@pytest.mark.parametrize("do_sample", [False, True])
def test_static_caches_on_runners_sync_once_per_round(pair, monkeypatch, do_sample):
    """Under compile=True both caches are static and both models' rounds run on runners (the target's forced onto
    eager ones here, as on CUDA): rollbacks set the write pointers from the known slot count and never read one
    (`int(cumulative_length)` would wait for the device), and padding adds no read."""
    target, draft = pair
    original = plan._target_forwards

    def forwards(inputs, facts, kernel, largest, graphs=None):
        cache, chosen, description, pooled = original(inputs, facts, kernel, largest, graphs)
        runner = RunnerPlan(RunnerBackend.EAGER, (largest,))
        return cache, Forwards(kernel=chosen.kernel, runner=runner, largest_round=largest), description, pooled

    monkeypatch.setattr(plan, "_target_forwards", forwards)
    config = SpeculativeConfig(num_lookahead=3, draft_form="as_given", compile=True)
    rounds = record_rounds(
        monkeypatch,
        lambda: target.generate(
            torch.tensor([[1, 17, 42, 5, 9]]), max_new_tokens=24, min_new_tokens=24, do_sample=do_sample,
            pad_token_id=PAD, eos_token_id=2, draft_model=draft, speculative_config=config,
        ),
        extra=("__int__",),
    )  # fmt: skip
    assert len(rounds) > 3
    for sites, _ in rounds:
        # transformers' own: eager SDPA on a static cache asks whether the cache is empty (`q_offset == 0`, the
        # write pointer) once per forward of several positions (the verification, and the draft's step that
        # catches up on two committed tokens); traced code skips the question
        asked = sites.pop(("masking_utils.py", "_ignore_causal_mask_sdpa"))
        assert 1 <= asked <= 2 and sites == {("stopping.py", "read_round"): 1}, sites
