"""The architecture matrix: on tiny models of 20 architectures, speculative output equals plain `generate()`'s.

For each architecture (sliding-window variants with a window of 4 slots, so every text here runs past it):
- greedy: one prompt, a ragged left-padded batch, and right-padded prompts give plain greedy's tokens;
- EOS inside an accepted block, rows stopping at different steps: sequences, `scores`, `logits` and the returned
  cache equal plain's, and a second chat turn on that cache equals plain's second turn;
- sampling never leaves the target's top-k, checked against a cache-free forward over every sampled text.
"""

import pytest
import torch
from tiny import ARCHITECTURES, PAD, arch_draft, cache_of, second_turns, tiny_arch

VOCAB = 48
NEW_TOKENS = 14


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request):
    target = tiny_arch(request.param, seed=0, vocab_size=VOCAB)
    return request.param, target, arch_draft(target, seed=1)


def batch(rows: list[list[int]], side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows, longest)` input ids and attention mask, padded on `side` with PAD."""
    longest = max(len(row) for row in rows)
    ids = torch.full((len(rows), longest), PAD)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(longest - len(row), longest) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 7, 3], [1, 30, 31, 32, 33]]


def greedy_cases():
    """(case, ids, mask) of the greedy tests: `PROMPTS[0]` alone (no mask), then `PROMPTS` padded left and right."""
    yield "one prompt", torch.tensor([PROMPTS[0]]), None
    for side in ("left", "right"):
        yield (side, *batch(PROMPTS, side))


def assert_greedy_cases_match_plain(both, target, draft) -> dict[str, torch.Tensor]:
    """`both(target, draft, ids, mask)` gives (plain, speculative) outputs: equal on every `greedy_cases()` case.
    Returns the speculative outputs by case."""
    outputs = {}
    for case, ids, mask in greedy_cases():
        plain, outputs[case] = both(target, draft, ids, mask)
        assert outputs[case].tolist() == plain.tolist(), case
    return outputs


def eos_mid_way(target, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """An EOS that row 0 of plain greedy's run emits mid-way and the other rows at other steps, or never: row 0's
    first new token from its fourth on that is not among its first three."""
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    new = free[:, ids.shape[1] :]
    return next(int(token) for token in new[0, 3:].tolist() if token not in new[0, :3].tolist())


def assert_prompt_lookup_matches_plain(target, draft, side: str) -> None:
    """Both prompt-lookup drafters (n-grams alone; n-grams first, then `draft`) give plain greedy's tokens on `PROMPTS`
    padded on `side`, row 0 stopping mid-way at an EOS, the other rows at other steps or never."""
    ids, mask = batch(PROMPTS, side)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    eos = int(free[0, ids.shape[1] + 4])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, eos_token_id=eos)
    plain = target.generate(ids, **kwargs)
    for drafter in (dict(draft_model="prompt_lookup", prompt_lookup_num_tokens=4), dict(draft_model=draft)):
        got = target.generate(ids, **{"prompt_lookup_num_tokens": 3, **kwargs, **drafter})
        assert got.tolist() == plain.tolist()


def both(target, draft, ids, mask=None, **kwargs):
    """(plain, speculative) outputs of generate() with the same arguments."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, **kwargs)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    speculative = target.generate(ids, attention_mask=mask, draft_model=draft, num_lookahead=3, **kwargs)
    return plain, speculative


@torch.no_grad()
def test_greedy_single_prompt(pair):
    _, target, draft = pair
    plain, speculative = both(target, draft, torch.tensor([PROMPTS[0]]))
    assert speculative.tolist() == plain.tolist()


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_greedy_ragged_batch(pair, side):
    _, target, draft = pair
    ids, mask = batch(PROMPTS, side)
    plain, speculative = both(target, draft, ids, mask)
    assert speculative.tolist() == plain.tolist()


def assert_same_cache(plain_cache, speculative_cache, attention_mask):
    """Same shapes, same keys and values in every slot the attention mask lets a query see.

    Slots of prompt padding are never attended to. Their deeper-layer values depend on how many positions their
    forward held (eager attention averages a fully masked row over all its keys), in plain decoding as here.
    """
    assert speculative_cache.get_seq_length() == plain_cache.get_seq_length()
    for plain_layer, layer in zip(plain_cache.layers, speculative_cache.layers):
        assert layer.keys.shape == plain_layer.keys.shape
        seen = attention_mask[:, -layer.keys.shape[-2] :].bool()[:, None, :, None].expand_as(layer.keys)
        torch.testing.assert_close(layer.keys[seen], plain_layer.keys[seen], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.values[seen], plain_layer.values[seen], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_eos_in_block_outputs_cache_and_next_turn(pair):
    _, target, draft = pair
    ids, mask = batch(PROMPTS, "left")
    eos = eos_mid_way(target, ids, mask)
    flags = dict(eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain, speculative = both(target, draft, ids, mask, **flags)
    assert speculative.sequences.tolist() == plain.sequences.tolist()
    assert len(speculative.scores) == len(plain.scores) and len(speculative.logits) == len(plain.logits)
    for step, (mine, theirs) in enumerate(zip(speculative.scores, plain.scores)):
        assert mine.shape == theirs.shape
        unfinished = ~(plain.sequences[:, ids.shape[1] : ids.shape[1] + step] == eos).any(dim=1)
        torch.testing.assert_close(mine[unfinished], theirs[unfinished], rtol=1e-4, atol=1e-4)
    cached_mask = torch.cat([mask, torch.ones_like(plain.sequences[:, ids.shape[1] :])], dim=1)[:, :-1]
    assert_same_cache(cache_of(plain), cache_of(speculative), cached_mask)

    # A second chat turn reusing each call's cache (the whole conversation as input ids, as plain generate() wants).
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, eos_token_id=eos)
    plain_2, speculative_2 = second_turns(target, draft, plain, speculative, mask, ids.shape[1], **kwargs)
    assert speculative_2.tolist() == plain_2.tolist()


@torch.no_grad()
def test_sampling_stays_in_target_top_k(pair):
    """Every sampled token is among the target's top 3 after its own prefix (computed without any cache)."""
    _, target, draft = pair
    assert_samples_in_top_k(target, draft)


def assert_samples_in_top_k(target, draft, **generate_kwargs) -> None:
    """12 rows sampled with top-k 3 after `PROMPTS[0]` (seed 0; `generate_kwargs`: more options): every token is
    among the target's top 3 after its own prefix (computed without any cache)."""
    prompt = torch.tensor([PROMPTS[0]])
    out = target.generate(
        prompt, do_sample=True, top_k=3, max_new_tokens=NEW_TOKENS, num_return_sequences=12, pad_token_id=PAD,
        draft_model=draft, generator=torch.Generator().manual_seed(0), **generate_kwargs,
    )  # fmt: skip
    logits = target(input_ids=out).logits[:, prompt.shape[1] - 1 : -1]  # (rows, new, vocab)
    top = logits.topk(3, dim=-1).indices
    sampled = out[:, prompt.shape[1] :, None]
    assert bool((top == sampled).any(dim=-1).all()), "a sampled token lies outside the target's top-k"


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_greedy_prompt_lookup_ragged_batch_with_eos(pair, side):
    """Both prompt-lookup drafters (n-grams alone; n-grams first, then the model) on every architecture."""
    _, target, draft = pair
    assert_prompt_lookup_matches_plain(target, draft, side)
