"""CachedModel: every row's cache is hole-free and computes what a plain forward over its own tokens computes."""

import pytest
import torch
from tiny import tiny_arch

from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.core.sequences import Sequences

VOCAB = 32


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """`(vocab,)` next-token logits after `tokens`, computed without any cache or padding."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def real_tokens(sequences: Sequences, row: int, length: int) -> list[int]:
    is_real = sequences.is_real(length)[row].tolist()
    return [t for t, ok in zip(sequences.tokens[row, :length].tolist(), is_real) if ok]


def assert_hole_free(cached: CachedModel) -> None:
    """Each row's positions sit in its last `fed` slots: no masked slot after the first real one but padding."""
    assert cached.slots == max(cached.fed)
    for row, fed in enumerate(cached.fed):
        assert not cached.slot_is_real[row, : cached.slots - fed].any()


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding", "gemma2"])
@torch.no_grad()
def test_ragged_rollbacks_keep_rows_exact(arch):
    """Rows dropping different numbers of positions, sliding windows included, still compute their own logits."""
    model = tiny_arch(arch, seed=0, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (2, 8), generator=generator)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # row 1 is left-padded by 3
    sequences = Sequences(prompt, mask, capacity=40)
    sequences.tokens[:, 8:] = torch.randint(3, VOCAB, (2, 32), generator=generator)
    cached = CachedModel(ModelFacts.of(model), batch=2)
    sequences.rows.attach(cached)

    def check(upto):
        logits = cached.feed_upto(sequences, upto, num_logits=1)[:, 0]
        for row, length in enumerate(upto):
            expected = reference_logits(model, real_tokens(sequences, row, length))
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
        assert_hole_free(cached)

    check([8, 8])  # prompts
    for step in range(6):  # rows drop 0..3 positions, differently, far past the window
        check([f + 4 for f in cached.fed])
        cached.rollback([cached.fed[0] - step % 4, cached.fed[1] - (step + 2) % 4])
        assert_hole_free(cached)
    check([f + 3 for f in cached.fed])
    # Committed lengths: row 0 one past its cache, row 1 two past. Row 0 drops one more so both stand 2 behind.
    lengths = [cached.fed[0] + 1, cached.fed[1] + 2]
    cached.rollback_to_committed(lengths)
    assert [length - fed for length, fed in zip(lengths, cached.fed)] == [2, 2]
    assert_hole_free(cached)
    check([f + 2 for f in cached.fed])
    cached.rollback_to_committed([f - 1 for f in cached.fed])  # both drop two: a uniform crop
    assert_hole_free(cached)
    check([f + 3 for f in cached.fed])


@torch.no_grad()
def test_dropping_what_a_sliding_layer_no_longer_stores_raises():
    """Never compute with missing slots: rolling back past the last trim of a sliding window is an error."""
    model = tiny_arch("mistral_sliding", seed=0, vocab_size=VOCAB)
    sequences = Sequences(torch.randint(3, VOCAB, (1, 10)), None, capacity=20)
    cached = CachedModel(ModelFacts.of(model), batch=1)
    cached.feed_upto(sequences, [10], num_logits=1)
    cached.rollback([9])  # trims the window layers to 3 slots
    with pytest.raises(RuntimeError, match="no longer stores"):
        cached.rollback([7])


@pytest.mark.parametrize("arch", ["llama", "starcoder2"])
@torch.no_grad()
def test_select_rows_keeps_the_chosen_rows_exact(arch):
    model = tiny_arch(arch, seed=0, vocab_size=VOCAB)
    prompt = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    sequences = Sequences(prompt, None, capacity=30)
    sequences.tokens[:, 6:] = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(2))
    cached = CachedModel(ModelFacts.of(model), batch=3)
    sequences.rows.attach(cached)
    cached.feed_upto(sequences, [12, 12, 12], num_logits=1)
    cached.rollback([12, 7, 9])  # row 0 is the longest: dropping it leaves shared leading holes
    sequences.drop_finished([True, False, False])
    assert cached.slots == 9, "leading holes every remaining row shares are dropped"
    assert_hole_free(cached)
    logits = cached.feed_upto(sequences, [9, 11], num_logits=1)[:, 0]
    torch.testing.assert_close(
        logits[0], reference_logits(model, sequences.tokens[0, :9].tolist()), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        logits[1], reference_logits(model, sequences.tokens[1, :11].tolist()), rtol=1e-4, atol=1e-4
    )


@torch.no_grad()
def test_feeds_of_different_widths_are_refused():
    """A ragged feed would put holes inside rows; CachedModel refuses it rather than computing something else."""
    model = tiny_arch("llama", seed=0, vocab_size=VOCAB)
    sequences = Sequences(torch.randint(3, VOCAB, (2, 5)), None, capacity=12)
    cached = CachedModel(ModelFacts.of(model), batch=2)
    with pytest.raises(AssertionError, match="same number of positions"):
        cached.feed_upto(sequences, [5, 4], num_logits=1)


def test_rows_move_alike_by_gather_and_by_slices():
    """`row_ops._moved` copies row by row on the CPU and gathers every row at once elsewhere (`_moved_by_gather`,
    run here on the CPU): the same tensor, holes zero, for full and sliding-window offsets and a row keeping
    nothing."""
    from hf_specsample.cache import row_ops

    generator = torch.Generator().manual_seed(0)
    states = torch.randn(3, 2, 10, 4, generator=generator)
    cases = [  # old starts, new starts, lengths, old first, new first, total
        ([0, 2, 5], [3, 4, 6], [7, 6, 4], 0, 0, 10),
        ([4, 6, 8], [5, 6, 8], [6, 5, 3], 2, 4, 11),  # sliding: the first stored slots are not slot 0
        ([1, 1, 1], [0, 0, 0], [9, 9, 9], 0, 0, 9),
        ([9, 3, 3], [9, 2, 2], [0, 7, 7], 0, 0, 9),  # a row keeping nothing: zeros only
    ]
    for old_starts, new_starts, lengths, old_first, new_first, total in cases:
        by_rows = row_ops._moved(states, old_starts, new_starts, lengths, old_first, new_first, total)
        slots = torch.arange(new_first, total)[None, :]
        new_start, old_start = torch.tensor(new_starts)[:, None], torch.tensor(old_starts)[:, None]
        kept = (slots >= new_start) & (slots < new_start + torch.tensor(lengths)[:, None])
        by_gather = row_ops._moved_by_gather(states, kept, slots - new_start + old_start - old_first)
        assert by_rows.shape == (3, 2, total - new_first, 4)
        assert torch.equal(by_rows, by_gather)
        assert (by_rows[~kept[:, None, :, None].expand_as(by_rows)] == 0).all()
