"""Per-row operations on a KV cache that transformers' `Cache` API does not offer.

`Cache.crop` removes the same number of slots from every row. Rows of a speculative batch accept different numbers
of draft tokens, so rolling them back means moving each row by its own amount: `realign` does that with one gather
per layer. Only the two layer types of `DynamicCache` whose slots are plain key/value vectors are handled
(`DynamicLayer`, `DynamicSlidingWindowLayer`); `unsupported_layers` names the others so that callers can refuse them
before any work. Everything else goes through the Cache API (`crop`, `batch_select_indices`,
`activate_past_recording`).

Slots are numbered over the whole cache: a cache of `total` slots holds slots ``0 .. total - 1`` of every row. A
full layer stores all of them; a sliding-window layer stores only the last `stored` (``min(total, window - 1)``
after a crop, more while it records its past between a forward and the next crop).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

SUPPORTED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def unsupported_layers(cache: Cache) -> list[str]:
    """Names of the cache's layer types that `realign` cannot move row by row (empty if all are supported)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return [type(cache).__name__]
    return sorted({type(layer).__name__ for layer in layers if type(layer) not in SUPPORTED_LAYERS})


def model_cache_problem(model: PreTrainedModel) -> str | None:
    """Why this model's KV cache cannot be rolled back per row, or None if it can.

    A model qualifies when its forward takes `past_key_values` and the `DynamicCache` built from its config holds
    only attention layers (full or sliding window). State-space and hybrid models (Mamba, Jamba, ...) keep a
    recurrent state that cannot be rolled back to an earlier token.
    """
    import inspect

    parameters = inspect.signature(model.forward).parameters
    if "past_key_values" not in parameters or "cache_params" in parameters:
        return f"{type(model).__name__} keeps a recurrent state (`cache_params`), not a KV cache"
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
    return max((layer.get_seq_length() for layer in cache.layers if layer.is_initialized), default=0)


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

    The cache ends with `total` slots; slots in front of each row's moved range hold zeros (callers mask them out). With `trim`, sliding-window layers are trimmed as `crop` trims them; without, they keep every slot
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
