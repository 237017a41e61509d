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

Hybrid models' layers may hold convolution and recurrent states beside (or instead of) keys and values
(`LinearAttentionLayer`, `LinearAttentionAndFullAttentionLayer`, ...; `DummyLayer` holds nothing). Everything here
that moves slots moves a layer's *attention part* only (`attention_part` names its class); `cache.linear_states`
moves the other part, and `copy_rows` / `stack_rows_into` / `select_rows` move both.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Cache
from transformers.cache_utils import (
    DummyLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionLayer,
    StaticCache,
    StaticLayer,
)
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from ..core.devices import to_device
from ..core.model_facts import ATTENTION_PART, linear_layers
from ..core.transformers_api import cache_layer_classes
from . import linear_states


def attention_part(layer) -> type[Any] | None:
    """The class of the layer's attention part (`DynamicLayer`, `DynamicSlidingWindowLayer`, `StaticLayer`), or None."""
    return ATTENTION_PART.get(type(layer))


def has_sliding_window(cache: Cache) -> bool:
    """Whether some layer of the cache keeps only a sliding window of positions (a rollback may need what it
    dropped)."""
    return any(attention_part(layer) is DynamicSlidingWindowLayer for layer in getattr(cache, "layers", ()))


def attention_layers(cache: Cache) -> list:
    """The layers of `cache` that hold keys and values (fused with a linear-attention part or not)."""
    return [layer for layer in getattr(cache, "layers", ()) if attention_part(layer) is not None]


def _holds_keys(layer) -> bool:
    return layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0


def is_static(cache: Cache | None) -> bool:
    """Whether `cache`'s attention is held in fixed-size `StaticLayer`s (or will be, once `full_static_cache`
    converted it); linear-attention and dummy layers have no slots and do not count."""
    layers = [layer for layer in getattr(cache, "layers", None) or () if not _slotless(layer)]
    return bool(layers) and all(isinstance(layer, StaticLayer) for layer in layers)


def runs_static(cache: Cache | None, cache_implementation: str | None, compile: bool) -> bool:
    """Whether a call's target runs on a static cache (`full_static_cache`): one asked for
    (`cache_implementation="static"` and the other static implementations, or a static `cache` passed in), or
    compiled verification (`SpeculativeConfig(compile=True)`)."""
    return compile or cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS or is_static(cache)


def _slotless(layer) -> bool:
    """A layer without keys and values: a linear-attention layer alone, or a dummy (shared-KV / MLP-only) layer."""
    return type(layer) in (LinearAttentionLayer, DummyLayer)


def keeps_state_layers(cache: Cache, initialized: bool = False) -> bool:
    """Whether `cache` has linear-attention layers (convolution / recurrent states), initialised ones if asked."""
    return any(not initialized or linear_states.is_initialized(layer) for _, layer in linear_layers(cache))


def total_slots(cache: Cache) -> int:
    """Slots in the cache (the same in every attention layer): `get_seq_length()` of any initialised one; 0 for a
    cache without attention (a state-space model's), which has no slots."""
    return max((_slots(layer) for layer in attention_layers(cache) if layer.is_initialized), default=0)


def _slots(layer) -> int:
    part = attention_part(layer)
    if part is StaticLayer:
        return int(layer.cumulative_length)
    if part is None:  # a layer `full_static_cache` is converting (transformers' static sliding-window layers)
        return int(layer.get_seq_length())
    return int(part.get_seq_length(layer))


def capacity(cache: Cache) -> int | None:
    """Most slots a static cache can hold (None: a dynamic cache grows)."""
    return min(layer.max_cache_len for layer in attention_layers(cache)) if is_static(cache) else None


def full_static_cache(cache: Cache | None, config, capacity: int) -> Cache:
    """A cache of full `StaticLayer`s of at least `capacity` slots holding what `cache` holds, in place if given.

    `cache` may be None (a new `StaticCache` is made), transformers' `StaticCache` (its sliding-window layers keep
    only the last `window` slots, in order: those are copied to their slots of a full layer, zeros before them, which
    the window's mask never lets a query see), or a cache of full layers already (kept where large enough). The
    caller's object keeps its identity: only its layers are replaced. Linear-attention and dummy layers stay as they
    are; a linear-attention layer fused with full static attention keeps its states in a larger layer.

    Args:
        config: the model's config (for a new cache).
        capacity: slots needed (e.g. `max_length`). New layers are allocated by their first (eager) forward.

    Raises:
        ValueError: a linear-attention layer fused with sliding-window static attention (Inkling's), for which
            transformers' own static decoding fails.
    """
    if cache is None:
        cache = StaticCache(config=config.get_text_config(decoder=True), max_cache_len=capacity)
    problem = static_cache_problem(cache, config)
    if problem is not None:
        raise ValueError(problem)
    layer: Any  # transformers types `Cache.layers` as a union of mixins lacking the keys/slots read here
    for index, layer in enumerate(cache.layers):
        if _slotless(layer) or (attention_part(layer) is StaticLayer and layer.max_cache_len >= capacity):
            continue
        size = max(capacity, getattr(layer, "max_cache_len", 0))
        fused = isinstance(layer, linear_states.LinearLayer)
        new: StaticLayer  # or its fusion with a linear-attention part
        if fused:
            new = LinearAttentionAndStaticFullAttentionLayer(
                max_cache_len=size, number_of_states=layer.number_of_states
            )
            linear_states.move_states(layer, new)
        else:
            new = StaticLayer(max_cache_len=size)
        if _holds_keys(layer):
            held = _slots(layer)  # positions fed so far
            stored = min(held, layer.keys.shape[-2])  # the last `stored` of them are kept, in order
            StaticLayer.lazy_initialization(new, layer.keys[:, :, :0], layer.values[:, :, :0])
            assert new.keys is not None and new.values is not None  # allocated by lazy_initialization
            new.keys[:, :, held - stored : held] = layer.keys[:, :, :stored]
            new.values[:, :, held - stored : held] = layer.values[:, :, :stored]
            new.cumulative_length.fill_(held)
        cache.layers[index] = new
    return cache


def static_cache_problem(cache: Cache | None, config) -> str | None:
    """Why a static cache of this model (`cache`, or the one `config` makes: read, not built) cannot be used, or None.

    Convolutions fused with sliding-window static attention (Inkling's layers) are refused: transformers' own static
    decoding fails on them, so there is no plain result to be exact against.
    """
    layers = [type(layer) for layer in cache.layers] if cache is not None else cache_layer_classes(config, static=True)
    fused_sliding = sorted({layer.__name__ for layer in layers if issubclass(layer, _FUSED_SLIDING)})
    if not fused_sliding:
        return None
    return (
        f"A static cache of this model holds {', '.join(fused_sliding)} layers (convolutions fused with "
        "sliding-window attention), which transformers' own static decoding cannot run either. Use the default "
        "dynamic cache (no `cache_implementation`), with which `draft_model=` is exact for this model."
    )


_FUSED_SLIDING = (LinearAttentionAndStaticSlidingWindowAttentionLayer, LinearAttentionAndSlidingWindowAttentionLayer)


def _stored_after(layer, total: int) -> int:
    """How many slots `layer` stores once trimmed, in a cache of `total` slots."""
    if attention_part(layer) is DynamicSlidingWindowLayer:
        return min(total, layer.sliding_window - 1)
    return total


def crop(cache: Cache, num_slots: int, total: int | None = None) -> None:
    """`Cache.crop(-num_slots)` of every attention part (0: only trim sliding-window layers), refusing to drop what a
    layer no longer stores. Linear-attention parts are `cache.linear_states`' (a `Cache.crop` would crop them too).

    `total`: the slots the cache holds, where the caller knows them: a static cache's write pointers are then set
    without reading one (on CUDA a read waits for the device).

    A sliding-window layer that has trimmed itself to ``window - 1`` slots cannot give back older ones; `Cache.crop`
    would silently keep too few slots there.
    """
    if total is None:
        total = total_slots(cache)
    if total == 0:  # nothing fed yet (transformers' sliding layers cannot even crop(0) before their first update)
        return
    layers = attention_layers(cache)
    if is_static(cache):  # the pointer moves back; the next forward overwrites the dropped slots
        for layer in layers:
            layer.cumulative_length.fill_(total - num_slots)
        return
    for layer in layers:
        if attention_part(layer) is DynamicSlidingWindowLayer and _holds_keys(layer):
            if layer.keys.shape[-2] < _stored_after(layer, total - num_slots) + num_slots:
                raise RuntimeError(
                    "hf_specsample internal error: a rollback would drop KV slots a sliding-window layer no longer "
                    "stores. Please report this with the model's config."
                )
    for layer in layers:
        part = attention_part(layer)
        assert part is not None  # `attention_layers` holds only layers with an attention part
        part.crop(layer, -num_slots)


def realign(
    cache: Cache,
    old_starts: Sequence[int],
    new_starts: Sequence[int],
    lengths: Sequence[int],
    total: int,
    trim: bool = True,
    old_total: int | None = None,
) -> None:
    """Move each row's slots so that row ``b``'s slots ``old_starts[b] .. + lengths[b]`` land at ``new_starts[b]``.

    The cache ends with `total` slots; slots in front of each row's moved range hold zeros (callers mask them out).
    With `trim`, sliding-window layers are trimmed as `crop` trims them; without, they keep every slot
    they store (so that a later rollback can still drop slots fed since the last trim). The moved range must still
    be stored in every layer (a sliding-window layer keeps the slots fed since its last trim, plus ``window - 1``).
    Only attention parts move (linear-attention states have no slots: `cache.linear_states`).

    Args:
        cache: a cache of `SUPPORTED_LAYERS`.
        old_starts, new_starts, lengths: per row, where its slots begin now, where they begin after, how many.
        total: the number of slots after the move (``new_starts[b] + lengths[b] <= total``).
        old_total: the number of slots before, where the caller knows it (else read from the cache: on CUDA a
            static cache's pointer read waits for the device).
    """
    old_total = total_slots(cache) if old_total is None else old_total
    assert all(start + length <= total for start, length in zip(new_starts, lengths)), "rows must fit in the cache"
    for layer in attention_layers(cache):
        if not _holds_keys(layer):
            continue
        if attention_part(layer) is StaticLayer:  # in place: the tensors keep their (compiled, CUDA-graph) addresses
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
        if attention_part(layer) is DynamicSlidingWindowLayer:
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
    """`(batch, heads, total - new_first, dim)` states: each row's range moved, zeros elsewhere (holes: masked, but
    never uninitialised memory, NaN * 0).

    On the CPU one contiguous slice copy per row (a gather along the slot axis was 50x slower there); elsewhere one
    gather for every row (a copy per row is two kernel launches per layer tensor and row: 900 per round for 8 rows
    of a 28-layer model on a launch-bound GPU).

    Args:
        states: `(batch, heads, stored, dim)` keys or values holding slots ``old_first ..`` of the cache.
        old_first / new_first: the first slot stored before / after.
    """
    width = total - new_first
    slots = torch.arange(new_first, total)[None, :]  # (1, width) the slots after the move
    new_start, old_start = torch.tensor(list(new_starts))[:, None], torch.tensor(list(old_starts))[:, None]
    kept = (slots >= new_start) & (slots < new_start + torch.tensor(list(lengths))[:, None])  # (batch, width)
    source = slots - new_start + old_start - old_first  # (batch, width) the stored slot each one comes from
    if bool(((source < 0) | (source >= states.shape[-2]))[kept].any()):  # host tensors: no device sync
        raise RuntimeError(
            "hf_specsample internal error: a KV slot to keep was already dropped from a sliding-window layer. "
            "Please report this with the model's config."
        )
    if states.device.type == "cpu":
        return _moved_by_rows(states, old_starts, new_starts, lengths, old_first, new_first, width)
    return _moved_by_gather(states, kept, source)


def _moved_by_gather(states: torch.Tensor, kept: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`_moved` by one gather for every row (off the CPU): `kept` `(batch, width)` bool on the host, the new slots
    each row keeps, and `source` the stored slot each comes from."""
    batch, heads, _, dim = states.shape
    width = kept.shape[1]
    index = to_device(torch.where(kept, source, 0), states.device)[:, None, :, None].expand(batch, heads, width, dim)
    return torch.where(to_device(kept, states.device)[:, None, :, None], states.gather(2, index), 0)


def _moved_by_rows(
    states: torch.Tensor,
    old_starts: Sequence[int],
    new_starts: Sequence[int],
    lengths: Sequence[int],
    old_first: int,
    new_first: int,
    width: int,
) -> torch.Tensor:
    """`_moved` by one slice copy per row (the CPU's way)."""
    batch, heads, _, dim = states.shape
    out = states.new_empty((batch, heads, width, dim))
    for row, (old_start, new_start, length) in enumerate(zip(old_starts, new_starts, lengths)):
        low = max(new_start, new_first)  # the part of the row's new range that is stored
        high = new_start + length
        source = low - new_start + old_start - old_first
        out[row, :, : max(0, low - new_first)] = 0
        if high > low:
            out[row, :, low - new_first : high - new_first] = states[row, :, source : source + high - low]
        if high - new_first < width:
            out[row, :, max(0, high - new_first) :] = 0
    return out


def copy_rows(cache: Cache, rows: Sequence[int]) -> Cache:
    """A new cache object holding copies of `rows` (indices into the batch), every part of every layer; `cache` is
    unchanged."""
    index = torch.tensor(list(rows), dtype=torch.long)
    taken = copy.copy(cache)
    taken.layers = []
    layer: Any  # transformers types `Cache.layers` as a union of mixins lacking the keys/slots read here
    for layer in cache.layers:
        if isinstance(layer, DummyLayer):
            taken.layers.append(layer)
            continue
        clone: Any = (
            linear_states.copy_rows(layer, index) if isinstance(layer, linear_states.LinearLayer) else copy.copy(layer)
        )
        if attention_part(layer) is not None and _holds_keys(layer):
            clone.keys = layer.keys[index.to(layer.keys.device)]
            clone.values = layer.values[index.to(layer.values.device)]
        if attention_part(layer) is StaticLayer:
            clone.cumulative_length = layer.cumulative_length.clone()
            clone.batch_size = len(rows)
        taken.layers.append(clone)
    return taken


def stack_rows_into(target: Cache, parts: Sequence[Cache]) -> None:
    """Make `target` hold the rows of `parts` (each of the same number of slots), in order, in place.

    `target` keeps its identity: a caller who passed it to `generate()` sees the result in the object they hold.
    """
    layer: Any  # transformers types `Cache.layers` as a union of mixins lacking the keys/slots read here
    for index, layer in enumerate(target.layers):
        sources: list[Any] = [part.layers[index] for part in parts]
        if isinstance(layer, linear_states.LinearLayer):
            linear_states.stack_rows(layer, sources)
        part = attention_part(layer)
        if part is None or not all(source.is_initialized and source.keys is not None for source in sources):
            continue
        layer.keys = torch.cat([source.keys for source in sources], dim=0)
        layer.values = torch.cat([source.values for source in sources], dim=0)
        if not layer.is_initialized:
            layer.dtype, layer.device, layer.is_initialized = layer.keys.dtype, layer.keys.device, True
        if part is DynamicSlidingWindowLayer:
            layer.cumulative_length = sources[0].cumulative_length
        if part is StaticLayer:
            layer.cumulative_length.copy_(sources[0].cumulative_length)
            layer.batch_size = layer.keys.shape[0]


def select_rows(cache: Cache, index: torch.Tensor) -> None:
    """Keep the rows `index` (a CPU long tensor) of every part of every layer (`Cache.batch_select_indices` does not
    reach static or linear-attention layers).

    A static layer keeps its storage: the kept rows move to its leading rows and the layer holds a view of them
    (`restore_rows` makes it hold every row again), so its tensors keep the addresses that compiled forwards and
    CUDA graphs recorded, and the cache can serve a later call of the full batch (`static_addresses.POOL`).
    """
    layer: Any  # transformers types `Cache.layers` as a union of mixins lacking the keys/slots read here
    for layer in cache.layers:
        if isinstance(layer, linear_states.LinearLayer):
            linear_states.select_rows(layer, index)
        part = attention_part(layer)
        if part is None or not _holds_keys(layer):
            continue
        if part is StaticLayer:
            for states in (layer.keys, layer.values):
                _allocated(states)[: len(index)].copy_(states[index.to(states.device)])  # gathered first: no overlap
            continue
        layer.keys = layer.keys[index.to(layer.keys.device)]
        layer.values = layer.values[index.to(layer.values.device)]
    narrow_rows(cache, len(index))  # the static layers hold the rows just moved to the front


def _allocated(states: torch.Tensor) -> torch.Tensor:
    """The tensor whose leading rows `states` is (`select_rows`), or `states` itself."""
    base = states._base
    if base is not None and base.shape[1:] == states.shape[1:] and base.data_ptr() == states.data_ptr():
        return base
    return states


def restore_rows(cache: Cache) -> None:
    """Make every static layer hold all the rows it allocated again, after `select_rows` dropped some: for a cache
    about to be emptied (`Cache.reset`) and reused, or a forward of the allocated batch (`runner.ForwardRunner`,
    `narrow_rows` after it); the dropped rows hold stale slots."""
    for layer in attention_layers(cache):
        if attention_part(layer) is StaticLayer and _holds_keys(layer):
            layer.keys, layer.values = _allocated(layer.keys), _allocated(layer.values)
            layer.batch_size = layer.keys.shape[0]


def narrow_rows(cache: Cache, rows: int) -> None:
    """Make every static layer hold its first `rows` allocated rows (views: nothing moves), as `select_rows` left
    them before a `restore_rows`."""
    for layer in attention_layers(cache):
        if attention_part(layer) is StaticLayer and _holds_keys(layer):
            layer.keys, layer.values = _allocated(layer.keys)[:rows], _allocated(layer.values)[:rows]
            layer.batch_size = rows


def allocated_rows(cache: Cache) -> int:
    """The rows a static cache's layers were allocated with (`select_rows` keeps their storage)."""
    layer = next(layer for layer in attention_layers(cache) if _holds_keys(layer))
    return _allocated(layer.keys).shape[0]
