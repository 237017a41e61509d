"""Static caches that keep their addresses: marked where CUDA graphs need it, reused across calls of one process.

A CUDA graph replays kernels on fixed addresses, and inductor lets a graph mutate only *static* inputs (parameters,
buffers, tensors marked by `torch._dynamo.mark_static_address`); a mutated input it was not told about makes it skip
the graph ("skipping cudagraphs due to mutated inputs"). A static cache's forward mutates three tensors per attention
layer: its keys, its values and its write pointer (`cumulative_length`). transformers' `StaticLayer` marks them in
`lazy_initialization`, but not while dynamo traces, and the mark is a Python attribute that a clone, a `.to()` or a
replacement loses. `keep_marks` is the one owner of the decision, `mark` applies it to a cache before every compiled
forward (`cache.compiled.CompiledForward`):

- on CUDA, every mutated tensor is marked (graphs are what compiled decoding is for there);
- where inductor freezes the weights (the CPU's settings: `CompileSettings.freezes`), marks are removed: frozen code
  treats a marked tensor as a constant and would read the *first* call's cache in every later call (torch 2.13;
  `tests/test_compiled.py`). A CUDA compile that asks for freezing (a `CompileConfig` with `freezing`) loses its
  graphs rather than its exactness.

A new cache per call is a new address, which a CUDA graph re-records silently. `CachePool` keeps a call's static
cache after the call when the caller was not handed it, and gives it to the next call of the same model that needs
the same cache, `reset()` in place. A cache is defined by its model (a weak key: freed with it), its rows, its slots,
and the dtype and device its tensors were allocated with: the pool's key is exactly that.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from transformers import Cache

from . import row_ops

MUTATED = ("keys", "values", "cumulative_length")  # what a static layer's forward writes in place


def keep_marks(device: torch.device, freezes: bool) -> bool:
    """Whether a compiled forward on `device` gets the cache's mutated tensors marked static (else unmarked).

    Args:
        freezes: the compiled code freezes its weights (inductor `freezing`), which would freeze marked tensors too.
    """
    return device.type == "cuda" and not freezes


def mutated_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """Every tensor a forward over `cache` writes in place: each static attention layer's keys, values and pointer
    (nothing for a dynamic cache, whose layers are replaced, not written)."""
    for layer in row_ops.attention_layers(cache) if row_ops.is_static(cache) else ():
        for name in MUTATED:
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                yield tensor


def mark(cache: Any, freezes: bool) -> None:
    """Mark every tensor of `cache` that a compiled forward mutates where `keep_marks` says so, and unmark it where
    the code freezes its weights; elsewhere (unfrozen code on the CPU) the marks stay as transformers left them,
    read as inputs either way. Anything that is not a static cache is left alone."""
    for tensor in mutated_tensors(cache):
        if keep_marks(tensor.device, freezes):
            torch._dynamo.mark_static_address(tensor)
        elif freezes and hasattr(tensor, "_dynamo_static_input_type"):
            del tensor._dynamo_static_input_type


class CacheKey(NamedTuple):
    """What defines a reusable static cache of a model (the pool's weak key): its rows, its slots, and where and in
    which dtypes the model's weights live (which decide each layer's device and dtype)."""

    rows: int
    slots: int
    placement: frozenset[tuple[torch.device, torch.dtype]]

    @classmethod
    def of(cls, model: torch.nn.Module, rows: int, slots: int) -> "CacheKey":
        return cls(rows, slots, frozenset((weight.device, weight.dtype) for weight in model.parameters()))


class CachePool:
    """Static caches kept between calls, per model (weakly), by `CacheKey`. A cache is out of the pool while a call
    uses it (two caches of one model in one call, as a self-draft's, are two caches), and goes back only if the
    caller was not handed it (`give_back`)."""

    def __init__(self) -> None:
        self._caches: weakref.WeakKeyDictionary[torch.nn.Module, dict[CacheKey, list[Cache]]] = (
            weakref.WeakKeyDictionary()
        )

    def take(self, model: torch.nn.Module, rows: int, slots: int) -> Cache | None:
        """A kept cache of `model` of `rows` rows and `slots` slots, emptied in place (`Cache.reset`: the same
        tensors, the pointer at 0), or None."""
        kept = self._caches.get(model, {}).get(CacheKey.of(model, rows, slots))
        if not kept:
            return None
        cache = kept.pop()
        cache.reset()
        return cache

    def give_back(self, model: torch.nn.Module, cache: Any) -> None:
        """Keep `cache` for a later call of `model`: only a static cache of attention layers, all allocated."""
        layers: list = list(getattr(cache, "layers", ()))
        slots = row_ops.capacity(cache) if row_ops.is_static(cache) else None
        if slots is None or len(row_ops.attention_layers(cache)) != len(layers):
            return
        if not all(layer.is_initialized for layer in layers):
            return
        row_ops.restore_rows(cache)  # rows dropped as they finished come back: the next call resets every row
        key = CacheKey.of(model, layers[0].keys.shape[0], slots)
        self._caches.setdefault(model, {}).setdefault(key, []).append(cache)


POOL = CachePool()  # the process's kept static caches
