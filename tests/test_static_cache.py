"""Static caches (`cache_implementation="static"`, a `StaticCache` passed in): exact, on the architecture matrix.

transformers refuses a static cache with `assistant_model=`. Ours rolls rejected drafts back by moving the cache's
write pointer and moves ragged rows in place (`cache.row_ops`); transformers' sliding-window static layers are turned
into full ones, whose window the model's mask applies. For every architecture:
- greedy: one prompt and ragged batches padded on either side give plain greedy's tokens;
- EOS inside accepted blocks: sequences, scores and the returned cache's visible slots equal plain static's, and a
  second chat turn on that cache equals plain's second turn;
and sampling through a static cache follows the target's exact distribution (chi-square, with a power check).
"""

import itertools

import pytest
import torch
from exact import sampled_pvalue
from test_architectures import NEW_TOKENS, PROMPTS, assert_greedy_cases_match_plain, batch, eos_mid_way, greedy_cases
from tiny import ARCHITECTURES, PAD, arch_draft, cache_of, perturbed_copy, tiny_arch, tiny_lm, with_cache
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from hf_specsample import SpeculativeConfig
from hf_specsample.cache import row_ops
from hf_specsample.policy.lookahead import LookaheadPolicy

VOCAB = 48
STATIC = dict(cache_implementation="static", max_cache_len=64)  # room for a second chat turn


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request):
    target = tiny_arch(request.param, seed=0, vocab_size=VOCAB)
    return request.param, target, arch_draft(target, seed=1)


def both(target, draft, ids, mask=None, **kwargs):
    """(plain static, speculative static) outputs of generate() with the same arguments."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, **kwargs)
    plain = target.generate(ids, attention_mask=mask, **STATIC, **kwargs)
    speculative = target.generate(ids, attention_mask=mask, draft_model=draft, num_lookahead=3, **STATIC, **kwargs)
    return plain, speculative


@torch.no_grad()
def test_greedy_single_prompt_and_ragged_batches(pair):
    _, target, draft = pair
    speculative = assert_greedy_cases_match_plain(both, target, draft)
    for case, ids, mask in greedy_cases():
        if mask is not None:  # the padded batches: equal to plain dynamic-cache decoding too
            dynamic = target.generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False
            )
            assert speculative[case].tolist() == dynamic.tolist(), case


def visible_slots(cache, layer_index: int, length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys, values, first position) of the slots plain's layer still holds of the first `length` positions.

    A full layer holds them all from slot 0; transformers' static sliding-window layer keeps the last `window`, in
    order, at its slot 0.
    """
    layer = cache.layers[layer_index]
    if type(layer) is StaticLayer:
        return layer.keys[:, :, :length], layer.values[:, :, :length], 0
    stored = min(length, layer.keys.shape[-2])
    return layer.keys[:, :, :stored], layer.values[:, :, :stored], length - stored


@torch.no_grad()
def test_eos_in_block_outputs_static_cache_and_next_turn(pair):
    _, target, draft = pair
    ids, mask = batch(PROMPTS, "left")
    eos = eos_mid_way(target, ids, mask)
    flags = dict(eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
    plain, speculative = both(target, draft, ids, mask, **flags)
    assert speculative.sequences.tolist() == plain.sequences.tolist()
    assert len(speculative.scores) == len(plain.scores)
    for step, (mine, theirs) in enumerate(zip(speculative.scores, plain.scores)):
        unfinished = ~(plain.sequences[:, ids.shape[1] : ids.shape[1] + step] == eos).any(dim=1)
        torch.testing.assert_close(mine[unfinished], theirs[unfinished], rtol=1e-4, atol=1e-4)

    cache = cache_of(speculative)
    assert isinstance(cache, StaticCache) and row_ops.is_static(cache)
    length = plain.sequences.shape[1] - 1  # plain's cache holds every row's sequence minus its last token
    assert row_ops.total_slots(cache) == int(cache_of(plain).get_seq_length()) == length
    seen = torch.cat([mask, torch.ones_like(plain.sequences[:, ids.shape[1] :])], dim=1)[:, :-1].bool()
    for index in range(len(cache.layers)):
        plain_keys, plain_values, first = visible_slots(cache_of(plain), index, length)
        keys, values = cache.layers[index].keys[:, :, first:length], cache.layers[index].values[:, :, first:length]
        attended = seen[:, first:length][:, None, :, None].expand_as(keys)
        torch.testing.assert_close(keys[attended], plain_keys[attended], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values[attended], plain_values[attended], rtol=1e-4, atol=1e-4)

    turn = torch.tensor([[11, 12, 13]] * ids.shape[0])
    second_ids = torch.cat([plain.sequences, turn], dim=1)
    second_mask = torch.cat([mask, torch.ones_like(plain.sequences[:, ids.shape[1] :]), torch.ones_like(turn)], 1)
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, eos_token_id=eos)
    plain_2 = target.generate(second_ids, attention_mask=second_mask, **with_cache(cache_of(plain)), **kwargs)
    speculative_2 = target.generate(
        second_ids, attention_mask=second_mask, **with_cache(cache_of(speculative)), draft_model=draft,
        num_lookahead=3, **kwargs,
    )  # fmt: skip
    assert speculative_2.tolist() == plain_2.tolist()


@torch.no_grad()
def test_plain_static_cache_passed_in_for_a_second_turn():
    """The cache plain static decoding returns (sliding-window layers included) continues a chat exactly."""
    target = tiny_arch("gemma2", seed=0, vocab_size=VOCAB)
    draft = arch_draft(target, seed=1)
    prompt = torch.tensor([PROMPTS[0]])
    first = target.generate(prompt, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False,
                            return_dict_in_generate=True, **STATIC)  # fmt: skip
    second_ids = torch.cat([first.sequences, torch.tensor([[11, 12, 13]])], dim=1)
    reference = target.generate(second_ids, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    mine = target.generate(
        second_ids, **with_cache(cache_of(first)), max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
        do_sample=False, draft_model=draft, num_lookahead=3,
    )  # fmt: skip
    assert mine.tolist() == reference.tolist()
    assert row_ops.is_static(cache_of(first))  # the caller's object, now of full layers


@torch.no_grad()
def test_static_cache_smaller_than_needed_is_grown():
    target = tiny_lm(seed=0)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    prompt = torch.tensor([[1, 5, 2, 5]])
    small = StaticCache(config=target.config, max_cache_len=6)
    plain = target.generate(prompt, max_new_tokens=12, pad_token_id=PAD, do_sample=False)
    mine = target.generate(prompt, **with_cache(small), max_new_tokens=12, pad_token_id=PAD, do_sample=False,
                           draft_model=draft, num_lookahead=3)  # fmt: skip
    assert mine.tolist() == plain.tolist()
    assert row_ops.capacity(small) >= 16


def test_offloaded_static_cache_is_refused():
    target = tiny_lm(seed=0)
    with pytest.raises(ValueError, match="offloaded"):
        target.generate(torch.tensor([[1, 5]]), draft_model=target, max_new_tokens=3, pad_token_id=PAD,
                        cache_implementation="offloaded_static")  # fmt: skip


def test_full_static_cache_keeps_a_sliding_layers_slots_in_place():
    """Unit: transformers' static sliding layer (last `window` slots, in order) -> full layer at their positions."""
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                           sliding_window=3, vocab_size=10)  # fmt: skip
    cache = StaticCache(config=config, max_cache_len=8)
    states = torch.arange(5, dtype=torch.float32).reshape(1, 1, 5, 1).expand(1, 1, 5, 4).contiguous()
    cache.update(states, states, 0)  # five positions through a window of 3
    row_ops.full_static_cache(cache, config, 8)
    layer = cache.layers[0]
    assert type(layer) is StaticLayer and int(layer.cumulative_length) == 5
    assert layer.keys[0, 0, 2:5, 0].tolist() == [2.0, 3.0, 4.0]  # the window's slots, at positions 2..4
    assert layer.keys[0, 0, :2].abs().sum() == 0  # older positions are outside every later window
    dynamic = DynamicCache()
    dynamic.update(states, states, 0)
    row_ops.full_static_cache(dynamic, config, 8)
    assert dynamic.layers[0].keys[0, 0, :5, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


SAMPLING = dict(temperature=0.8, top_k=4)
PROMPT = torch.tensor([[1, 5, 2, 5]])


@pytest.mark.parametrize("name", ["llama", "qwen2_sliding", "gemma3_text"])
@torch.no_grad()
def test_sampling_through_a_static_cache_is_exact(name):
    """8,000 rows in one call (rows leave from the static cache as they stop at EOS) against the exact law."""
    target = tiny_arch(name, seed=0, vocab_size=VOCAB)
    draft = arch_draft(target, seed=1, scale=0.6)
    eos = 7
    p_value = sampled_pvalue(
        target, PROMPT, 3, 8000, seed=3, settings=dict(SAMPLING, eos_token_id=eos), eos_token_ids=(eos,),
        draft_model=draft, num_lookahead=2, **STATIC,
    )  # fmt: skip
    assert p_value > 1e-3


@torch.no_grad()
def test_sampling_static_power_check(monkeypatch):
    """A rollback that forgets to move the pointer back (rejected drafts stay in the cache) is caught."""
    target = tiny_arch("llama", seed=0, vocab_size=VOCAB)
    draft = arch_draft(target, seed=1, scale=0.6)
    original = row_ops.crop

    def leaky_crop(cache, num_slots, total=None):
        if row_ops.is_static(cache):
            return  # rejected slots stay in front of the next forward's
        return original(cache, num_slots, total)

    monkeypatch.setattr(row_ops, "crop", leaky_crop)
    p_value = sampled_pvalue(
        target, PROMPT, 3, 8000, seed=3, settings=SAMPLING, draft_model=draft, num_lookahead=2, **STATIC
    )
    assert p_value < 1e-3


class ReplayedLookahead(LookaheadPolicy):
    """K = 2, 2, then 0 for 15 rounds, 1, then 0: leaves a row that finishes early with leading holes in its slots."""

    def __init__(self):
        self.choices = itertools.chain([2, 2], [0] * 15, [1], itertools.repeat(0))

    def choose(self) -> int:
        return next(self.choices)


@pytest.mark.parametrize("cache", [dict(cache_implementation="static"), dict()], ids=["static", "dynamic"])
@torch.no_grad()
def test_returned_cache_of_max_length_slots_holds_a_row_that_finished_with_holes(cache):
    """A static cache of exactly `max_length` slots (no `max_cache_len`) returned with a row that finished early
    after rounds that left leading holes in its slots: the row's holes are dropped before it is fed its padding, so
    it fits (it used to fail with "a static cache of 36 slots cannot hold 37"), and the cache is plain's."""
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32).to(torch.bfloat16)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    ids = torch.tensor([[PAD, PAD, 1, 5, 2, 5], [1, 3, 3, 4, 6, 2], [4, 4, 1, 7, 9, 3]])
    mask = (ids != PAD).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=30, eos_token_id=1, pad_token_id=PAD, do_sample=False)
    kwargs.update(return_dict_in_generate=True, **cache)
    close = dict(rtol=0.07, atol=0.07)  # bf16 keys fed in other widths differ by a few ulps; a wrong slot by O(1)
    plain = target.generate(ids, **kwargs)
    config = SpeculativeConfig(lookahead_policy=ReplayedLookahead, linear_kernel="off")
    speculative = target.generate(ids, draft_model=draft, speculative_config=config, **kwargs)
    assert speculative.sequences.tolist() == plain.sequences.tolist()
    assert (speculative.sequences[:, ids.shape[1] :] == 1).any(dim=1).sum() >= 1, "no row finished early"
    length = plain.sequences.shape[1] - 1
    assert row_ops.total_slots(cache_of(speculative)) == length
    seen = torch.cat([mask, torch.ones_like(plain.sequences[:, ids.shape[1] :])], dim=1)[:, :-1].bool()
    for mine, theirs in zip(cache_of(speculative).layers, cache_of(plain).layers):
        attended = seen[:, None, :, None].expand_as(theirs.keys[:, :, :length])
        for name in ("keys", "values"):
            got, expected = getattr(mine, name)[:, :, :length], getattr(theirs, name)[:, :, :length]
            torch.testing.assert_close(got[attended], expected[attended], **close)
