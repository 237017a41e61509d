"""Multi-turn chat: the returned cache is plain's (a stop inside a block included), and a turn on a cache is exact.

Chat clients pass the previous turn's cache with the whole conversation as `input_ids`. The draft has
no cache for that prefix and builds one; the target continues from the given cache, as plain `generate()` does.
"""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, arch_draft, cache_of, prepared_processors, tiny_arch, with_cache
from transformers import DynamicCache

PROMPT = torch.tensor([[1, 5, 9, 13, 17]])
TURN = torch.tensor([[11, 12, 3]])


@pytest.fixture(scope="module", params=["llama", "mistral_sliding"])
def pair(request):
    target = tiny_arch(request.param, seed=0, vocab_size=24)
    return target, arch_draft(target, seed=1)


def eos_mid_block(target) -> int:
    """A token plain greedy emits as its 5th new token and not before: an EOS that lands inside a block."""
    new = target.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=PAD)[0, PROMPT.shape[1] :]
    return next(int(t) for i, t in enumerate(new.tolist()) if i >= 4 and t not in new[:i].tolist())


@torch.no_grad()
def test_cache_after_a_stop_inside_a_block_is_plains(pair):
    """Was: 14 positions for an 11-token sequence where plain holds 10."""
    target, draft = pair
    eos = eos_mid_block(target)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=eos, return_dict_in_generate=True)
    plain = target.generate(PROMPT, **kwargs)
    mine = target.generate(PROMPT, draft_model=draft, num_lookahead=6, **kwargs)
    assert mine.sequences.tolist() == plain.sequences.tolist()
    assert cache_of(mine).get_seq_length() == plain.sequences.shape[1] - 1
    for theirs, ours in zip(cache_of(plain).layers, cache_of(mine).layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_the_cache_object_passed_in_holds_the_result(pair):
    """Clients that keep one DynamicCache and pass it every turn see plain's state in that very object."""
    target, draft = pair
    kwargs = dict(max_new_tokens=9, do_sample=False, pad_token_id=PAD)
    theirs, ours = DynamicCache(config=target.config), DynamicCache(config=target.config)
    plain = target.generate(PROMPT, **with_cache(theirs), **kwargs)
    target.generate(PROMPT, **with_cache(ours), draft_model=draft, num_lookahead=3, **kwargs)
    assert ours.get_seq_length() == theirs.get_seq_length() == plain.shape[1] - 1
    for plain_layer, layer in zip(theirs.layers, ours.layers):
        torch.testing.assert_close(layer.keys, plain_layer.keys, rtol=1e-4, atol=1e-4)
        assert getattr(layer, "record_past", False) == getattr(plain_layer, "record_past", False)

    conversation = torch.cat([plain, TURN], dim=1)
    plain_2 = target.generate(conversation, **with_cache(theirs), **kwargs)
    mine_2 = target.generate(conversation, **with_cache(ours), draft_model=draft, num_lookahead=3, **kwargs)
    assert mine_2.tolist() == plain_2.tolist()


@torch.no_grad()
def test_speculative_cache_serves_plain_generate_and_back(pair):
    target, draft = pair
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    first = target.generate(PROMPT, draft_model=draft, num_lookahead=2, **kwargs)
    conversation = torch.cat([first.sequences, TURN], dim=1)
    reference = target.generate(conversation, max_new_tokens=8, do_sample=False, pad_token_id=PAD)  # no cache
    second = target.generate(conversation, **with_cache(cache_of(first)), **kwargs)  # plain, our cache
    assert second.sequences.tolist() == reference.tolist()
    third = target.generate(
        torch.cat([second.sequences, TURN], dim=1), **with_cache(cache_of(second)), draft_model=draft, **kwargs
    )  # speculative on plain's cache
    fresh = target.generate(
        torch.cat([second.sequences, TURN], dim=1), max_new_tokens=8, do_sample=False, pad_token_id=PAD
    )
    assert third.sequences.tolist() == fresh.tolist()


@torch.no_grad()
def test_sampling_a_turn_on_a_cache_is_exact(pair):
    """Chi-square: the second turn, sampled on the first turn's cache, follows the target given the conversation."""
    target, draft = pair
    rows, num_tokens, settings = 6_000, 3, dict(top_k=4)
    first = target.generate(
        PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True, draft_model=draft
    )
    conversation = torch.cat([first.sequences, TURN], dim=1)
    cache = cache_of(first)
    cache.batch_repeat_interleave(rows)  # plain generate() cannot expand a cache for num_return_sequences either
    out = target.generate(
        conversation.expand(rows, -1), **with_cache(cache), do_sample=True, max_new_tokens=num_tokens,
        pad_token_id=PAD, draft_model=draft, num_lookahead=2, generator=torch.Generator().manual_seed(0), **settings,
    )  # fmt: skip
    processors, _ = prepared_processors(target, conversation, do_sample=True, max_new_tokens=num_tokens, **settings)
    exact = exact_distribution(target, conversation, processors, num_tokens)
    assert chisquare_pvalue(exact, continuations(out, conversation.shape[1])) > 1e-3


def test_a_cache_covering_the_whole_input_is_refused(pair):
    target, draft = pair
    first = target.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="pass the whole conversation as input_ids"):
        target.generate(PROMPT, **with_cache(cache_of(first)), draft_model=draft, pad_token_id=PAD)


@torch.no_grad()
def test_use_cache_false_returns_no_cache_like_plain(pair):
    target, draft = pair
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True, use_cache=False)
    assert cache_of(target.generate(PROMPT, draft_model=draft, **kwargs)) is None
    assert cache_of(target.generate(PROMPT, **kwargs)) is None
