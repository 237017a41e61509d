"""Per-row operations on a KV cache that transformers' `Cache` API does not offer.

`Cache.crop` removes the same number of slots from every row. Rows of a speculative batch accept different numbers
of draft tokens, so rolling them back means moving each row by its own amount: `realign` does that with one gather
per layer. The layer types whose slots are plain key/value vectors are handled: `DynamicCache`'s (`DynamicLayer`,
`DynamicSlidingWindowLayer`) and `StaticCache`'s full `StaticLayer`; `unsupported_layers` names the others so that
callers can refuse them before any work. Everything else goes through the Cache API (`crop`,
`batch_select_indices`, `activate_past_recording`).

A `StaticLayer` holds `max_cache_len` slots in fixed tensors (what `torch.compile` and CUDA graphs need) and writes
each forward's keys at its `cumulative_length`: slots ``0 .. cumulative_length - 1`` are the cache, and a rollback
moves that pointer back (gpt-fast's "overwrite rejected slots"); slots past it are never attended to (causal mask).
Static caches that transformers builds for sliding-window models hold ring-like `StaticSlidingWindowLayer`s, which
cannot be moved row by row: `full_static_cache` turns any cache into one of full `StaticLayer`s holding the same
visible keys (the model's mask still applies the window, by slot distance, as for our draft caches).

Slots are numbered over the whole cache: a cache of `total` slots holds slots ``0 .. total - 1`` of every row. A
full layer stores all of them; a sliding-window layer stores only the last `stored` (``min(total, window - 1)``
after a crop, more while it records its past between a forward and the next crop).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticCache, StaticLayer

from .. import transformers_api

SUPPORTED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer)


def is_static(cache: Cache | None) -> bool:
    """Whether `cache` is made of fixed-size `StaticLayer`s (or will be, once `full_static_cache` converted it)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, StaticLayer) for layer in layers)


def unsupported_layers(cache: Cache) -> list[str]:
    """Names of the cache's layer types that `realign` cannot move row by row (empty if all are supported)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return [type(cache).__name__]
    return sorted({type(layer).__name__ for layer in layers if type(layer) not in SUPPORTED_LAYERS})


def model_cache_problem(model: PreTrainedModel) -> str | None:
    """Why this model's KV cache cannot be rolled back per row, or None if it can.

    A model qualifies when its forward takes a cache and the `DynamicCache` built from its config holds only
    attention layers (full or sliding window). State-space and hybrid models (Mamba, Jamba, ...) keep a recurrent
    state that cannot be rolled back to an earlier token (before transformers 5.24 their forward took it as
    `cache_params`; from 5.24 on their `DynamicCache` holds linear-attention layers).
    """
    name = transformers_api.forward_cache_name(model)
    if name is None:
        return f"{type(model).__name__}'s forward takes no cache"
    if name == transformers_api.RECURRENT_STATE:
        return f"{type(model).__name__} keeps a recurrent state (`{name}`), not a KV cache"
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        return f"{type(model).__name__} keeps a cache of its own, not a DynamicCache (transformers says so itself)"
    try:
        cache = DynamicCache(config=model.config)
    except Exception as error:  # noqa: BLE001 (any config this cannot build a cache for is refused)
        return f"no DynamicCache can be built for {type(model).__name__} ({error})"
    unsupported = unsupported_layers(cache)
    if unsupported:
        return (
            f"{type(model).__name__}'s cache has layers of type {', '.join(unsupported)} (a recurrent state, or keys "
            "and values shared with other layers), which hf_specsample cannot roll back row by row"
        )
    return None


def total_slots(cache: Cache) -> int:
    """Slots in the cache (the same in every layer): `get_seq_length()` of any initialised layer."""
    return max((_slots(layer) for layer in cache.layers if layer.is_initialized), default=0)


def _slots(layer) -> int:
    if type(layer) is StaticLayer:
        return int(layer.cumulative_length)
    return int(layer.get_seq_length())


def capacity(cache: Cache) -> int | None:
    """Most slots a static cache can hold (None: a dynamic cache grows)."""
    return min(layer.max_cache_len for layer in cache.layers) if is_static(cache) else None


def full_static_cache(cache: Cache | None, config, capacity: int) -> Cache:
    """A cache of full `StaticLayer`s of at least `capacity` slots holding what `cache` holds, in place if given.

    `cache` may be None (a new `StaticCache` is made), transformers' `StaticCache` (its sliding-window layers keep
    only the last `window` slots, in order: those are copied to their slots of a full layer, zeros before them, which
    the window's mask never lets a query see), or a cache of full layers already (kept where large enough). The
    caller's object keeps its identity: only its layers are replaced.

    Args:
        config: the model's config (for a new cache).
        capacity: slots needed (e.g. `max_length`). New layers are allocated by their first (eager) forward.
    """
    if cache is None:
        cache = StaticCache(config=config.get_text_config(decoder=True), max_cache_len=capacity)
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticLayer and layer.max_cache_len >= capacity:
            continue
        size = max(capacity, getattr(layer, "max_cache_len", 0))
        new = StaticLayer(max_cache_len=size)
        if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            held = _slots(layer)  # positions fed so far
            stored = min(held, layer.keys.shape[-2])  # the last `stored` of them are kept, in order
            new.lazy_initialization(layer.keys[:, :, :0], layer.values[:, :, :0])
            new.keys[:, :, held - stored : held] = layer.keys[:, :, :stored]
            new.values[:, :, held - stored : held] = layer.values[:, :, :stored]
            new.cumulative_length.fill_(held)
        cache.layers[index] = new
    return cache


def _stored_after(layer, total: int) -> int:
    """How many slots `layer` stores once trimmed, in a cache of `total` slots."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return min(total, layer.sliding_window - 1)
    return total


def crop(cache: Cache, num_slots: int) -> None:
    """`cache.crop(-num_slots)` (0: only trim sliding-window layers), refusing to drop what a layer no longer stores.

    A sliding-window layer that has trimmed itself to ``window - 1`` slots cannot give back older ones; `Cache.crop`
    would silently keep too few slots there.
    """
    total = total_slots(cache)
    if total == 0:  # nothing fed yet (transformers' sliding layers cannot even crop(0) before their first update)
        return
    if is_static(cache):  # the pointer moves back; the next forward overwrites the dropped slots
        for layer in cache.layers:
            layer.cumulative_length.fill_(total - num_slots)
        return
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized and layer.keys is not None:
            if layer.keys.shape[-2] < _stored_after(layer, total - num_slots) + num_slots:
                raise RuntimeError(
                    "hf_specsample internal error: a rollback would drop KV slots a sliding-window layer no longer "
                    "stores. Please report this with the model's config."
                )
    cache.crop(-num_slots)


def realign(
    cache: Cache,
    old_starts: Sequence[int],
    new_starts: Sequence[int],
    lengths: Sequence[int],
    total: int,
    trim: bool = True,
) -> None:
    """Move each row's slots so that row ``b``'s slots ``old_starts[b] .. + lengths[b]`` land at ``new_starts[b]``.

    The cache ends with `total` slots; slots in front of each row's moved range hold zeros (callers mask them out).
    With `trim`, sliding-window layers are trimmed as `crop` trims them; without, they keep every slot
    they store (so that a later rollback can still drop slots fed since the last trim). The moved range must still
    be stored in every layer (a sliding-window layer keeps the slots fed since its last trim, plus ``window - 1``).

    Args:
        cache: a cache of `DynamicLayer` / `DynamicSlidingWindowLayer` layers (see `unsupported_layers`).
        old_starts, new_starts, lengths: per row, where its slots begin now, where they begin after, how many.
        total: the number of slots after the move (``new_starts[b] + lengths[b] <= total``).
    """
    old_total = total_slots(cache)
    assert all(start + length <= total for start, length in zip(new_starts, lengths)), "rows must fit in the cache"
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            continue
        if type(layer) is StaticLayer:  # in place: the tensors keep their (compiled, CUDA-graph) addresses
            for states in (layer.keys, layer.values):
                states[:, :, :total] = _moved(states[:, :, :old_total], old_starts, new_starts, lengths, 0, 0, total)
            layer.cumulative_length.fill_(total)
            continue
        stored = layer.keys.shape[-2]
        new_stored = _stored_after(layer, total) if trim else min(total, stored)
        layer.keys = _moved(layer.keys, old_starts, new_starts, lengths, old_total - stored, total - new_stored, total)
        layer.values = _moved(
            layer.values, old_starts, new_starts, lengths, old_total - stored, total - new_stored, total
        )
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = total


def _moved(
    states: torch.Tensor,
    old_starts: Sequence[int],
    new_starts: Sequence[int],
    lengths: Sequence[int],
    old_first: int,
    new_first: int,
    total: int,
) -> torch.Tensor:
    """`(batch, heads, total - new_first, dim)` states: each row's range moved, zeros elsewhere.

    One contiguous slice copy per row (a gather along the slot axis was 50x slower on the CPU).

    Args:
        states: `(batch, heads, stored, dim)` keys or values holding slots ``old_first ..`` of the cache.
        old_first / new_first: the first slot stored before / after.
    """
    batch, heads, _, dim = states.shape
    out = states.new_empty((batch, heads, total - new_first, dim))
    for row, (old_start, new_start, length) in enumerate(zip(old_starts, new_starts, lengths)):
        low = max(new_start, new_first)  # the part of the row's new range that is stored
        high = new_start + length
        source = low - new_start + old_start - old_first
        if high > low and (source < 0 or source + high - low > states.shape[-2]):
            raise RuntimeError(
                "hf_specsample internal error: a KV slot to keep was already dropped from a sliding-window layer. "
                "Please report this with the model's config."
            )
        out[row, :, : max(0, low - new_first)] = 0  # holes: masked, but never uninitialised memory (NaN * 0)
        if high > low:
            out[row, :, low - new_first : high - new_first] = states[row, :, source : source + high - low]
    return out


def take_rows(cache: Cache, rows: Sequence[int]) -> Cache:
    """A new cache object holding copies of `rows` (indices into the batch); `cache` is unchanged."""
    index = torch.tensor(list(rows), dtype=torch.long)
    taken = copy.copy(cache)
    taken.layers = []
    for layer in cache.layers:
        clone = copy.copy(layer)
        if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            clone.keys = layer.keys[index.to(layer.keys.device)]
            clone.values = layer.values[index.to(layer.values.device)]
        if type(layer) is StaticLayer:
            clone.cumulative_length = layer.cumulative_length.clone()
            clone.batch_size = len(rows)
        taken.layers.append(clone)
    return taken


def stack_rows_into(target: Cache, parts: Sequence[Cache]) -> None:
    """Make `target` hold the rows of `parts` (each of the same number of slots), in order, in place.

    `target` keeps its identity: a caller who passed it to `generate()` sees the result in the object they hold.
    """
    for index, layer in enumerate(target.layers):
        sources = [part.layers[index] for part in parts]
        if not all(source.is_initialized and source.keys is not None for source in sources):
            continue
        layer.keys = torch.cat([source.keys for source in sources], dim=0)
        layer.values = torch.cat([source.values for source in sources], dim=0)
        if not layer.is_initialized:
            layer.dtype, layer.device, layer.is_initialized = layer.keys.dtype, layer.keys.device, True
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = sources[0].cumulative_length
        if type(layer) is StaticLayer:
            layer.cumulative_length.copy_(sources[0].cumulative_length)
            layer.batch_size = layer.keys.shape[0]


def select_rows(cache: Cache, index: torch.Tensor) -> None:
    """Keep the rows `index` (a CPU long tensor) of every layer: `Cache.batch_select_indices`, static layers too."""
    if not is_static(cache):
        cache.batch_select_indices(index)
        return
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys[index.to(layer.keys.device)]
            layer.values = layer.values[index.to(layer.values.device)]
            layer.batch_size = layer.keys.shape[0]
