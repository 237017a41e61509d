"""Batched sampling on a sliding-window model, texts longer than the window: exact (chi-square), and hole-free.

Rows of one batch accept different numbers of draft tokens every round. Before caches were kept hole-free, a
window (which counts cache slots) then covered the wrong tokens of a row: batched greedy differed from plain
greedy and samples left the target's top-k. Here each prompt's samples are tested against that prompt's exact
distribution, enumerated with cache-free forwards.
"""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, SLIDING_WINDOW, arch_draft, prepared_processors, tiny_arch

import hf_specsample.decoding as decoding

PROMPTS = [[1, 5, 9, 13, 17, 21], [1, 7, 3, 20, 11]]  # both longer than the window (4) before any new token
NUM_TOKENS = 3
SAMPLES = 6_000  # per prompt
SETTINGS = dict(top_k=4, temperature=1.2)
ALPHA = 1e-3


@pytest.fixture(scope="module")
def pair():
    target = tiny_arch("mistral_sliding", seed=0, vocab_size=24)
    return target, arch_draft(target, seed=1, scale=0.5)


def left_padded(rows):
    return padded(rows, "left")


def padded(rows, side: str):
    longest = max(len(row) for row in rows)
    pads = [[PAD] * (longest - len(row)) for row in rows]
    ids = torch.tensor([pad + row if side == "left" else row + pad for pad, row in zip(pads, rows)])
    return ids, (ids != PAD).long()


def sample(target, draft, seed: int, lookahead: int, side: str = "left"):
    ids, mask = padded(PROMPTS, side)
    return target.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=SAMPLES,
        pad_token_id=PAD, draft_model=draft, num_lookahead=lookahead, generator=torch.Generator().manual_seed(seed),
        **SETTINGS,
    )  # fmt: skip


def pvalues(target, out, side: str = "left"):
    """Per prompt, the p-value of its rows against plain sampling from that (padded) prompt."""
    ids, mask = padded(PROMPTS, side)
    result = []
    for index in range(len(PROMPTS)):
        prompt, prompt_mask = ids[index : index + 1], mask[index : index + 1]
        processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=NUM_TOKENS, **SETTINGS)
        exact = exact_distribution(target, prompt, processors, NUM_TOKENS, attention_mask=prompt_mask)
        rows = out[index * SAMPLES : (index + 1) * SAMPLES]
        result.append(chisquare_pvalue(exact, continuations(rows, ids.shape[1])))
    return result


@pytest.mark.parametrize("lookahead, side", [(1, "left"), (3, "left"), (3, "right")])
@torch.no_grad()
def test_batched_sampling_past_the_window_is_exact(pair, lookahead, side):
    """Left padding, and right padding (padding inside each row's window; generate()'s own position ids)."""
    assert len(PROMPTS[1]) + NUM_TOKENS > SLIDING_WINDOW
    target, draft = pair
    out = sample(target, draft, seed=lookahead, lookahead=lookahead, side=side)
    assert min(pvalues(target, out, side)) > ALPHA


@torch.no_grad()
def test_the_reference_is_plain_generate_right_padded(pair):
    """The enumerated reference for a right-padded prompt is plain sampling's (mask and generate()'s position ids),
    and differs from the unpadded prompt's: so the right-padded case above compares with what plain would do."""
    target, _ = pair
    ids, mask = padded(PROMPTS, "right")
    torch.manual_seed(0)
    out = target.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=SAMPLES,
        pad_token_id=PAD, **SETTINGS,
    )  # fmt: skip
    assert min(pvalues(target, out, "right")) > ALPHA
    assert min(pvalues(target, out, "left")) < 1e-6  # the row padded on the right samples another distribution


@torch.no_grad()
def test_the_test_rejects_a_wrong_context(pair):
    """Power: samples from the same weights attending to a wider window (the wrong tokens) fail the test."""
    import copy

    target, _ = pair
    wrong = copy.deepcopy(target)
    wrong.config.sliding_window = 2 * SLIDING_WINDOW
    for module in wrong.modules():
        if getattr(module, "sliding_window", None) == SLIDING_WINDOW:
            module.sliding_window = 2 * SLIDING_WINDOW
    ids, mask = left_padded(PROMPTS)
    out = wrong.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=NUM_TOKENS, num_return_sequences=SAMPLES,
        pad_token_id=PAD, **SETTINGS,
    )  # fmt: skip
    assert min(pvalues(target, out)) < 1e-6


@torch.no_grad()
def test_cache_holds_no_more_slots_than_the_longest_row(pair):
    """B=8 ragged rows: the target's cache never grows past the longest row (was 587 slots for 303 tokens)."""
    target, draft = pair
    slots = []
    original = decoding.SpeculativeDecoder.commit

    def spy(self, *args, **kwargs):
        accepted = original(self, *args, **kwargs)
        if self.sequences.num_active:
            slots.append((self.target.slots, max(self.sequences.lengths)))
        return accepted

    decoding.SpeculativeDecoder.commit = spy
    try:
        ids, mask = left_padded(PROMPTS * 4)
        target.generate(
            ids, attention_mask=mask, do_sample=True, max_new_tokens=40, pad_token_id=PAD, draft_model=draft,
            num_lookahead=4, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    finally:
        decoding.SpeculativeDecoder.commit = original
    assert slots and all(cache_slots <= longest - 1 for cache_slots, longest in slots)
