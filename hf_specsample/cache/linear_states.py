"""Per-row moves of the convolution and recurrent states that hybrid and state-space models keep beside attention.

transformers (5.23 on) caches a hybrid model's non-attention layers as `LinearAttentionLayer`s, alone or fused with
an attention layer (`LinearAttentionAndFullAttentionLayer`, ...). Per state index ``i`` such a layer holds a
convolution window `conv_states[i]` `(batch, channels, window)` and/or a recurrent state `recurrent_states[i]`
`(batch, ...)`. Neither has a slot per position, so the KV layout of `cache.row_ops` (holes in front) does not apply:
a row's state simply is the state after the positions the row holds. Two kinds of layer, told apart as transformers
itself tells them apart (`LinearAttentionCacheLayerMixin.is_croppable`: no recurrent state):

- **positional** (convolutions only: LFM2, Inkling): while `record_past` is on, a forward appends each position's
  convolution input to `conv_states[i]`, so the tensor holds every position fed since the last rollback, and the
  window after any of them is a slice (`conv_windows`). Exact, and free.
- **recurrent** (Mamba's selective scan, Mamba-2's SSD, gated delta nets, ...): the state after a position inside a
  forward is never materialised. Its states are copied before each forward (`snapshot`) and a row is restored from
  the copy taken at or before its last kept position (`mix_rows`); `cache.checkpoints` re-feeds what lies between.
  Such a layer's convolution windows travel with its recurrent states: they are restored the same way (a model may
  store windows that are no history, as Zaya does).

Every function here acts on the linear-attention part of a layer only; `cache.row_ops` moves the attention part.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import Cache

from ..core.model_facts import LinearLayer, linear_layers  # noqa: F401  (`linear_layers` also read as ours)


class StateField(str, enum.Enum):
    """The two per-state-index tensors of a linear-attention layer (the attribute names transformers uses)."""

    CONV = "conv_states"
    RECURRENT = "recurrent_states"


StateKey = tuple[int, StateField, int]  # (layer index in the cache, field, state index)


def is_recurrent(layer: LinearLayer) -> bool:
    """Whether the layer holds a recurrent state (known once a forward initialised it)."""
    return any(layer.is_recurrent_states_initialized.values())


def is_initialized(layer: LinearLayer) -> bool:
    """Whether a forward has written any of the layer's states."""
    return any(layer.is_conv_states_initialized.values()) or is_recurrent(layer)


def is_positional(layer: LinearLayer) -> bool:
    """Whether the layer's convolution windows are a recorded history that a slice rolls back (see module doc)."""
    return is_initialized(layer) and not is_recurrent(layer) and bool(layer.record_past)


def restored_states(cache: Cache) -> Iterator[tuple[StateKey, torch.Tensor]]:
    """(key, live tensor) of every state a rollback restores from snapshots: all states of recurrent layers."""
    for index, layer in linear_layers(cache):
        if not is_recurrent(layer):
            continue
        for field in StateField:
            initialized = getattr(layer, f"is_{field.value}_initialized")
            for state, tensor in getattr(layer, field.value).items():
                if initialized[state] and tensor is not None:
                    yield (index, field, state), tensor


def snapshot(cache: Cache) -> dict[StateKey, torch.Tensor]:
    """Copies of the states `restored_states` names (forwards update them in place)."""
    return {key: tensor.clone() for key, tensor in restored_states(cache)}


def set_state(cache: Cache, key: StateKey, tensor: torch.Tensor) -> None:
    """Put `tensor` in the cache at `key` (a new tensor object: transformers' in-place updates then write to it)."""
    index, field, state = key
    getattr(cache.layers[index], field.value)[state] = tensor


def mix_rows(sources: Sequence[torch.Tensor | None], choice: Sequence[int]) -> torch.Tensor:
    """`(batch, ...)`: row ``b`` of ``sources[choice[b]]``; a None source stands for the empty state (zeros).

    Args:
        sources: tensors of one shape `(batch, ...)` (at least one not None).
        choice: per row, the index of its source.
    """
    reference = next(source for source in sources if source is not None)
    used = sorted(set(choice))
    if len(used) == 1:
        source = sources[used[0]]
        return source.clone() if source is not None else torch.zeros_like(reference)
    out = torch.empty_like(reference)
    for index in used:
        rows = torch.tensor([row for row, picked in enumerate(choice) if picked == index], device=reference.device)
        source = sources[index]
        out[rows] = source[rows] if source is not None else 0
    return out


def conv_windows(history: torch.Tensor, drops: Sequence[int], window: int) -> torch.Tensor:
    """Each row's convolution window after dropping its last `drops[b]` positions.

    Positions before a row's first one are zeros (what a causal convolution pads with, and what transformers stores
    after a short prompt), so a history shorter than the window is padded on the left.

    Args:
        history: `(batch, channels, length)` the recorded convolution inputs, the newest last.
        drops: per row, how many of the newest positions to drop (``<= length``).
        window: the window's length (the layer's `conv_kernel_size`).

    Returns:
        `(batch, channels, window)` a new tensor.
    """
    batch, channels, length = history.shape
    padded = F.pad(history, (window, 0))  # (batch, channels, window + length)
    ends = torch.tensor([window + length - drop for drop in drops], device=history.device)  # exclusive, padded coords
    index = ends[:, None] - window + torch.arange(window, device=history.device)  # (batch, window)
    return padded.gather(-1, index[:, None, :].expand(batch, channels, window))


def trim_positional(cache: Cache, drops: Sequence[int]) -> None:
    """Roll every positional layer's windows back by `drops[b]` positions per row, to exactly its window length."""
    for _, layer in linear_layers(cache):
        if not is_positional(layer):
            continue
        for state, history in layer.conv_states.items():
            if layer.is_conv_states_initialized[state] and history is not None:
                window = layer.conv_kernel_size[state]
                assert window is not None  # set with the state (transformers' `lazy_initialization`)
                layer.conv_states[state] = conv_windows(history, drops, window)


def stop_recording(cache: Cache, was_recording: Sequence[bool | None]) -> None:
    """Trim positional windows and give every linear layer back the `record_past` it had (`was_recording`)."""
    for index, layer in linear_layers(cache):
        if is_positional(layer):
            for state, history in layer.conv_states.items():
                if layer.is_conv_states_initialized[state] and history is not None:
                    window = layer.conv_kernel_size[state]
                    assert window is not None  # set with the state (transformers' `lazy_initialization`)
                    layer.conv_states[state] = conv_windows(history, [0] * history.shape[0], window)
        # Layers a model appended to the cache itself (Inkling2-Loop's loop passes copy theirs) had recorded nothing.
        previous = was_recording[index] if index < len(was_recording) else False
        if previous is not None:
            layer.record_past = previous


def settle_recording(cache: Cache) -> list[int]:
    """Stop recording the convolution history of layers that turned out to be recurrent; returns their indices.

    Recording is switched on for every linear layer before a call's first forward, when no layer says yet whether
    it recurs. A recurrent layer's windows are restored from snapshots, so its history is trimmed to the window
    (transformers' in-place updates need exactly that size) and no longer recorded.

    Raises:
        NotImplementedError: a recurrent state fused with sliding-window attention, whose rollback needs the
            recording (no transformers family has one: refusing beats computing with windows of mixed lengths).
    """
    settled = []
    for index, layer in linear_layers(cache):
        if not (is_recurrent(layer) and layer.record_past):
            continue
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError(
                f"hf_specsample cannot roll back {type(layer).__name__} layers that hold a recurrent state beside "
                "sliding-window attention. Generate without `draft_model=` for this model, and please report it."
            )
        for state, history in layer.conv_states.items():
            if layer.is_conv_states_initialized[state] and history is not None:
                window = layer.conv_kernel_size[state]
                assert window is not None  # set with the state (transformers' `lazy_initialization`)
                layer.conv_states[state] = conv_windows(history, [0] * history.shape[0], window)
        layer.record_past = False
        settled.append(index)
    return settled


def _tensors(layer: LinearLayer) -> Iterator[tuple[dict, int, torch.Tensor]]:
    """(dict, state index, tensor) of every initialised state tensor of a layer."""
    for field in StateField:
        states = getattr(layer, field.value)
        initialized = getattr(layer, f"is_{field.value}_initialized")
        for state, tensor in states.items():
            if initialized[state] and tensor is not None:
                yield states, state, tensor


def select_rows(layer: LinearLayer, index: torch.Tensor) -> None:
    """Keep the rows `index` (a CPU long tensor) of every state of the layer."""
    for states, state, tensor in list(_tensors(layer)):
        states[state] = tensor[index.to(tensor.device)]


# A linear-attention layer's per-state-index dicts.
_STATE_DICTS = (
    "conv_states",
    "recurrent_states",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)


def copy_states(layer: LinearLayer) -> LinearLayer:
    """A shallow copy of the layer whose state dicts are its own (assigning a state does not touch `layer`)."""
    clone = copy.copy(layer)
    for name in _STATE_DICTS:
        setattr(clone, name, dict(getattr(layer, name)))
    return clone


def move_states(source: LinearLayer, target: LinearLayer) -> None:
    """Give `target` (a new layer of another class, e.g. a larger static one) `source`'s linear-attention states."""
    for name in _STATE_DICTS:
        setattr(target, name, dict(getattr(source, name)))
    target.record_past, target.dtype, target.device = source.record_past, source.dtype, source.device


def copy_rows(layer: LinearLayer, index: torch.Tensor) -> LinearLayer:
    """A copy of the layer holding copies of the rows `index` of its states (`layer` is unchanged)."""
    clone = copy_states(layer)
    select_rows(clone, index)
    return clone


def stack_rows(target: LinearLayer, parts: Sequence[LinearLayer]) -> None:
    """Make `target` hold the states of `parts`, rows in order (each part's states of one shape but the batch)."""
    first = parts[0]
    for field in StateField:
        states = getattr(first, field.value)
        initialized = getattr(first, f"is_{field.value}_initialized")
        for state in states:
            if initialized[state] and states[state] is not None:
                getattr(target, field.value)[state] = torch.cat([getattr(part, field.value)[state] for part in parts])
                getattr(target, f"is_{field.value}_initialized")[state] = True
    target.has_previous_state = dict(first.has_previous_state)
    target.conv_kernel_size = dict(first.conv_kernel_size)
    target.dtype, target.device = first.dtype, first.device
