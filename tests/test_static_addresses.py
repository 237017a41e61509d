"""Static caches that keep their addresses (`cache/static_addresses.py`): marked for CUDA graphs where the device is
CUDA, allocated once per `compile=True` call at their final size, reused by the next call, and exact whatever stale
slots hold.

The calls here run the compiled path with the compiled forward replaced by the eager model (`eager_compiled`): the
caches, the pool, the padding and the rollbacks are the compiled call's, without minutes of compiling on 2 cores.
"""

import weakref

import pytest
import torch
from tiny import PAD, cache_of, perturbed_copy, tiny_lm, with_cache
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

import hf_specsample.cache.compiled as compiled
from hf_specsample import SpeculativeConfig, decoding
from hf_specsample.cache import row_ops, static_addresses
from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.policy.lookahead import largest_round

COMPILE = SpeculativeConfig(compile=True, num_lookahead=3)
PROMPT = torch.tensor([[1, 5, 2, 5]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def test_marks_kept_only_on_cuda_and_never_under_freezing():
    assert static_addresses.keep_marks(torch.device("cuda"), freezes=False)
    assert static_addresses.keep_marks(torch.device("cuda", 1), freezes=False)
    assert not static_addresses.keep_marks(torch.device("cuda"), freezes=True)  # frozen code would read one cache
    assert not static_addresses.keep_marks(torch.device("cpu"), freezes=False)
    assert not static_addresses.keep_marks(torch.device("cpu"), freezes=True)


def meta_cache(layers: int = 2) -> StaticCache:
    cache = StaticCache(config=tiny_lm(seed=0, vocab_size=16, layers=layers, hidden=32).config, max_cache_len=8)
    states = torch.empty((1, 2, 0, 8), device="meta")
    for layer in cache.layers:
        StaticLayer.lazy_initialization(layer, states, states)
    return cache


def is_marked(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "_dynamo_static_input_type")


def test_every_mutated_tensor_is_marked_where_the_decision_says(monkeypatch):
    """On meta tensors standing for CUDA ones: every layer's keys, values and write pointer are marked (what inductor
    needs to keep a graph that writes them), and unmarked where the code freezes."""
    cache = meta_cache()
    tensors = list(static_addresses.mutated_tensors(cache))
    assert len(tensors) == 3 * len(cache.layers)
    for tensor in tensors:  # as a clone or a replacement leaves them
        if is_marked(tensor):
            del tensor._dynamo_static_input_type
    monkeypatch.setattr(static_addresses, "keep_marks", lambda device, freezes: device.type == "meta" and not freezes)
    static_addresses.mark(cache, freezes=False)
    assert all(is_marked(tensor) for tensor in tensors)
    static_addresses.mark(cache, freezes=True)
    assert not any(is_marked(tensor) for tensor in tensors)


def test_compiled_forward_marks_the_cache_it_is_handed(monkeypatch, eager_compiled):
    """`CompiledForward` applies the decision before every call (transformers' own mark is lost on a replacement)."""
    seen = []
    monkeypatch.setattr(static_addresses, "mark", lambda cache, freezes: seen.append((cache, freezes)))
    model = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=32)
    forward = compiled.CompiledForward(weakref.ref(model), compiled.CompileSettings())
    cache = StaticCache(config=model.config, max_cache_len=8)
    forward(input_ids=PROMPT, **with_cache(cache))
    assert any(value is cache and freezes is False for value, freezes in seen)


def cache_tensors(cache) -> list[int]:
    return [tensor.data_ptr() for tensor in static_addresses.mutated_tensors(cache)]


@torch.no_grad()
def test_caches_keep_their_addresses_across_rounds_rollbacks_and_calls(monkeypatch, eager_compiled, pair):
    target, draft = pair
    addresses = []
    original = decoding.SpeculativeDecoder.round

    def round(self, budget):
        original(self, budget)
        both = (self.target.cache, self.model_drafter.runner.cache)
        assert all(row_ops.is_static(cache) for cache in both)
        assert row_ops.capacity(self.target.cache) == PROMPT.shape[1] + 16 + largest_round(COMPILE, None, False)
        addresses.append(tuple(tuple(cache_tensors(cache)) for cache in both))

    monkeypatch.setattr(decoding.SpeculativeDecoder, "round", round)
    plain = target.generate(PROMPT, max_new_tokens=16, pad_token_id=PAD, do_sample=False)
    for _ in range(2):
        out = target.generate(PROMPT, max_new_tokens=16, pad_token_id=PAD, do_sample=False, draft_model=draft,
                              speculative_config=COMPILE, return_dict_in_generate=False)  # fmt: skip
        assert out.tolist() == plain.tolist()
    assert len(addresses) > 4 and len(set(addresses)) == 1, "one allocation per cache, reused by the second call"


@torch.no_grad()
def test_a_returned_cache_is_not_reused(eager_compiled, pair):
    """The caller holds the cache it was handed: the next call gets another one."""
    target, draft = pair
    kwargs = dict(max_new_tokens=8, pad_token_id=PAD, do_sample=False, draft_model=draft, speculative_config=COMPILE)
    cache = cache_of(target.generate(PROMPT, return_dict_in_generate=True, **kwargs))
    snapshot = [tensor.clone() for tensor in static_addresses.mutated_tensors(cache)]
    target.generate(PROMPT + 1, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, static_addresses.mutated_tensors(cache)))


def test_pool_is_keyed_by_what_defines_a_cache():
    model = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=32)
    pool = static_addresses.CachePool()
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(input_ids=PROMPT, **with_cache(cache))
    pool.give_back(model, cache)
    assert pool.take(model, rows=2, slots=8) is None
    assert pool.take(model, rows=1, slots=9) is None
    other = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=32)
    assert pool.take(other, rows=1, slots=8) is None
    model.to(torch.float64)
    assert pool.take(model, rows=1, slots=8) is None, "weights in another dtype make caches of another dtype"
    model.to(torch.float32)
    taken = pool.take(model, rows=1, slots=8)
    assert taken is cache and int(taken.layers[0].cumulative_length) == 0
    assert pool.take(model, rows=1, slots=8) is None, "out of the pool while in use"


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@torch.no_grad()
def test_garbage_in_stale_slots_changes_nothing(monkeypatch, eager_compiled, pair, do_sample):
    """Slots past the committed length (rejected drafts, a padded position) hold whatever the last forward wrote;
    large finite garbage written there after every rollback changes no output."""
    target, draft = pair
    prompt = torch.tensor([[1, 5, 2, 5], [PAD, 3, 7, 2]])
    mask = (prompt != PAD).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=PAD, do_sample=do_sample, draft_model=draft,
                  speculative_config=COMPILE)  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    clean = target.generate(prompt, generator=generator, **kwargs) if do_sample else target.generate(prompt, **kwargs)
    original = CachedModel.rollback
    written = []

    def rollback(self, keep):
        original(self, keep)
        if row_ops.is_static(self.cache):
            for layer in row_ops.attention_layers(self.cache):
                for states in (layer.keys, layer.values):
                    states[:, :, self.slots :] = 1e4
            written.append(self.slots)

    monkeypatch.setattr(CachedModel, "rollback", rollback)
    generator = torch.Generator().manual_seed(3)
    dirty = target.generate(prompt, generator=generator, **kwargs) if do_sample else target.generate(prompt, **kwargs)
    assert written, "the stale slots were written"
    assert dirty.tolist() == clean.tolist()
    if not do_sample:
        assert (
            clean.tolist() == target.generate(prompt, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD).tolist()
        )
