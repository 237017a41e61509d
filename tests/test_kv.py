"""CachedModel: logits with holes, padding and rollbacks equal a plain forward over each row's real tokens."""

import torch
from tiny import tiny_lm

from hf_specsample.kv import CachedModel

VOCAB = 32


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """`(vocab,)` next-token logits after `tokens`, computed without any cache or padding."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


@torch.no_grad()
def test_ragged_feeds_and_rollbacks_match_plain_forward():
    model = tiny_lm(seed=0, vocab_size=VOCAB, layers=2, hidden=32)
    generator = torch.Generator().manual_seed(0)
    capacity = 40
    tokens = torch.randint(3, VOCAB, (2, capacity), generator=generator)
    is_real = torch.ones(2, capacity, dtype=torch.bool)
    is_real[1, :3] = False  # row 1's prompt is left-padded by 3
    cached = CachedModel(model, is_real)

    def check(lengths):
        logits = cached.feed(tokens, upto=lengths, num_logits=1)[:, 0]
        for row, length in enumerate(lengths):
            real = [t for t, ok in zip(tokens[row, :length].tolist(), is_real[row, :length].tolist()) if ok]
            torch.testing.assert_close(logits[row], reference_logits(model, real), rtol=1e-4, atol=1e-4)

    check([8, 8])  # prompts (row 1 padded)
    check([10, 9])  # ragged feed: row 1 gets a hole in front of its token
    cached.rollback([9, 9])  # row 0 drops one position
    check([12, 13])
    cached.rollback([10, 13])  # row 0 drops two, row 1 nothing
    check([11, 15])
    assert cached.fed == [11, 15]


@torch.no_grad()
def test_rollback_crops_slots_no_row_needs():
    model = tiny_lm(seed=0, vocab_size=VOCAB)
    tokens = torch.randint(3, VOCAB, (2, 20))
    cached = CachedModel(model, torch.ones(2, 20, dtype=torch.bool))
    cached.feed(tokens, upto=[10, 10], num_logits=1)
    cached.rollback([6, 8])
    assert cached.cache.get_seq_length() == 8  # two trailing slots were nobody's
    assert cached.slot_is_real[0].tolist() == [True] * 6 + [False] * 2  # row 0 keeps holes


@torch.no_grad()
def test_select_rows_keeps_the_chosen_rows_exact():
    model = tiny_lm(seed=0, vocab_size=VOCAB, layers=2, hidden=32)
    tokens = torch.randint(3, VOCAB, (3, 20))
    cached = CachedModel(model, torch.ones(3, 20, dtype=torch.bool))
    cached.feed(tokens, upto=[6, 6, 6], num_logits=1)
    cached.rollback([6, 4, 5])
    cached.select_rows([1, 2])
    logits = cached.feed(tokens[1:], upto=[8, 9], num_logits=1)[:, 0]
    torch.testing.assert_close(logits[0], reference_logits(model, tokens[1, :8].tolist()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], reference_logits(model, tokens[2, :9].tolist()), rtol=1e-4, atol=1e-4)
