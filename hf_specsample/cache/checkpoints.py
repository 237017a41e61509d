"""Rolling recurrent states back per row: a snapshot before every forward, and a re-feed from it where needed.

A recurrent layer (`cache.linear_states`) reports only its state after the last position of a forward. So
`StateCheckpoints` copies the recurrent layers' states before each forward (`before_forward`), and a rollback gives
each row the state after its kept positions from the newest copy taken at or before them:

- a row that keeps everything a forward fed (all drafts accepted) keeps the live state;
- a row that keeps exactly the positions of a snapshot (the draft model rolled back to a step boundary, which is all
  a same-tokenizer draft ever does) gets that snapshot's rows;
- any other row (the target rejected a draft: it keeps the last committed token and its ``a`` accepted drafts of the
  ``K + 1`` positions it verified) is restored from the snapshot before the forward and re-fed its ``a + 1`` kept
  positions. Where every row can go back to that snapshot at the same distance behind its committed length (always
  for one row), the re-feed is deferred to the next round's verification, which then feeds the ``a + 1`` positions
  before its own ``K + 1`` (`deferred_keep`): a wider forward instead of one more. Otherwise rows re-fed different
  counts share forwards now: one forward per distinct count, each feeding every row up to the next count and
  keeping the state of the rows that stop there ("prefix order").

The re-feed runs on a *shadow* of the cache (`shadow_cache`): attention parts cropped back to the snapshot, states
copied from it. So the real cache's attention keys and values, which hold every verified position, are rolled back
by `cache.row_ops` as for any model; only recurrent states are taken from the shadow. The cost of a rollback is
therefore, in rounds where a row rejected a draft, up to K more positions in the next verification (one row, or
rows that committed alike) or one forward over at most K positions per distinct accepted count (measured in
`python -m hf_specsample_bench.hybrid_rollback`), and the copies (one per forward; a few MB for a 1B hybrid).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache
from transformers.cache_utils import DummyLayer

from . import linear_states, row_ops
from .linear_states import StateKey

# `run(cache, starts, width)`: feed every row's buffer positions ``starts[b] .. starts[b] + width - 1`` to the model
# with `cache` (the forward's logits are not needed).
Runner = Callable[[Cache, Sequence[int], int], None]


@dataclass
class Snapshot:
    """The recurrent layers' states before a forward.

    Attributes:
        fed: per row, the positions the cache held then.
        states: copies of `linear_states.restored_states`; a key that is missing was not initialised yet (the
            empty state, which a scan starts from as from zeros).
    """

    fed: list[int]
    states: dict[StateKey, torch.Tensor] = field(default_factory=dict)


class StateCheckpoints:
    """The snapshots of one `CachedModel`'s cache since its last rollback, and the per-row restore from them.

    A cache whose linear-attention layers all turned out to be positional (convolutions only) takes no snapshots:
    its rollback is `linear_states.trim_positional`, done here too so that every linear-attention part has one
    owner.
    """

    def __init__(self, cache: Cache):
        self.cache = cache
        self.snapshots: list[Snapshot] = []
        linear_states.settle_recording(cache)  # a caller's cache: its recurrent layers are known already

    @property
    def may_recur(self) -> bool:
        """Whether a linear-attention layer holds a recurrent state, or has not said yet (before its first forward)."""
        return any(
            linear_states.is_recurrent(layer) or not linear_states.is_initialized(layer)
            for _, layer in linear_states.linear_layers(self.cache)
        )

    def before_forward(self, fed: Sequence[int]) -> None:
        """Copy the recurrent states before a forward (nothing for a cache known to hold convolutions only)."""
        if self.may_recur:
            self.snapshots.append(Snapshot(list(fed), linear_states.snapshot(self.cache)))

    def after_forward(self) -> None:
        """Stop recording the history of layers a forward showed to be recurrent (`linear_states.settle_recording`)."""
        linear_states.settle_recording(self.cache)

    def deferred_keep(
        self, fed: Sequence[int], keep: Sequence[int], lengths: Sequence[int], limit: int
    ) -> list[int] | None:
        """Positions to keep instead of `keep` so that no row needs a re-feed now, or None.

        Where some row's kept positions lie after its newest snapshot (it would be re-fed), every row may instead go
        back to one snapshot, if that leaves all rows the same distance behind their committed lengths (the next
        forward feeds every row alike): the next forward then feeds the positions after it together with the next
        round's, at the price of a wider forward rather than one more. Always so for a single row. The newest such
        snapshot, and only if it leaves at most `limit` committed positions to catch up (beyond the last one, which
        the next forward feeds anyway), so that a run of rejections cannot widen the forwards without bound: then the
        re-feed runs at once (`restore`).

        Args:
            fed, keep: per row, the positions held and the positions a rollback would keep.
            lengths: per row, the committed length.
            limit: the most positions the next forward may catch up (the verified drafts of the forward rolled back).
        """
        points = [snapshot.fed for snapshot in self.snapshots] + [list(fed)]
        if not self.snapshots or all(any(point[row] == kept for point in points) for row, kept in enumerate(keep)):
            return None  # no snapshot, or every row keeps a snapshot's positions: nothing to re-feed
        for snapshot in reversed(self.snapshots):
            distances = {length - point for length, point in zip(lengths, snapshot.fed)}
            if all(point <= kept for point, kept in zip(snapshot.fed, keep)) and len(distances) == 1:
                return list(snapshot.fed) if distances.pop() - 1 <= limit else None
        return None

    def restore(self, fed: Sequence[int], keep: Sequence[int], run: Runner | None) -> None:
        """Give each row the linear-attention states after its first `keep[b]` positions; forget the snapshots.

        Args:
            fed: per row, the positions the cache holds now.
            keep: per row, the positions to keep (``<= fed[b]``).
            run: feeds the model on a given cache (for a re-feed; None where no row can need one).
        """
        live = dict(linear_states.restored_states(self.cache))
        if live and any(kept < held for kept, held in zip(keep, fed)):
            points = [snapshot.fed for snapshot in self.snapshots] + [list(fed)]
            if any(point > kept for point, kept in zip(points[0], keep)):
                raise RuntimeError(
                    "hf_specsample internal error: a rollback to positions no snapshot precedes. Please report this "
                    "with the model's config."
                )
            choice = [max(i for i, point in enumerate(points) if point[row] <= keep[row]) for row in range(len(keep))]
            gaps = [kept - points[index][row] for row, (kept, index) in enumerate(zip(keep, choice))]
            harvested: dict[StateKey, torch.Tensor] = {}
            if any(gaps):
                assert run is not None, "hf_specsample internal error: a re-feed without a token buffer"
                base = min(index for index, gap in zip(choice, gaps) if gap)
                needs = [kept - points[base][row] if gap else 0 for row, (kept, gap) in enumerate(zip(keep, gaps))]
                drop = fed[0] - points[base][0]
                assert all(held - point == drop for held, point in zip(fed, points[base])), "rows fed alike"
                harvested = self._refeed(base, drop, needs, run)
                choice = [len(points) if need else index for index, need in zip(choice, needs)]
            for key, tensor in live.items():
                sources = [snapshot.states.get(key) for snapshot in self.snapshots] + [tensor, harvested.get(key)]
                linear_states.set_state(self.cache, key, linear_states.mix_rows(sources, choice))
        linear_states.trim_positional(self.cache, [held - kept for held, kept in zip(fed, keep)])
        self.snapshots = []

    def _refeed(self, base: int, drop: int, needs: Sequence[int], run: Runner) -> dict[StateKey, torch.Tensor]:
        """Re-feed rows from snapshot `base`, in prefix order; return the states (rows re-fed: theirs; others: 0).

        Args:
            base: the snapshot every re-fed row starts from.
            drop: positions fed since that snapshot (the same in every row: every forward feeds every row alike).
            needs: per row, the positions to re-feed after the snapshot (0: the row is not re-fed).
        """
        snapshot = self.snapshots[base]
        shadow = shadow_cache(self.cache, drop, snapshot)
        harvested: dict[StateKey, torch.Tensor] = {}
        done = 0
        for target in sorted({need for need in needs if need}):
            run(shadow, [start + done for start in snapshot.fed], target - done)
            done = target
            rows = [row for row, need in enumerate(needs) if need == target]
            for key, tensor in linear_states.restored_states(shadow):
                if key not in harvested:
                    harvested[key] = torch.zeros_like(tensor)
                index = torch.tensor(rows, device=tensor.device)
                harvested[key][index] = tensor[index]
        return harvested

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (a CPU long tensor) of every snapshot (rows leave between forwards and a rollback)."""
        rows = index.tolist()
        for snapshot in self.snapshots:
            snapshot.fed = [snapshot.fed[row] for row in rows]
            snapshot.states = {key: tensor[index.to(tensor.device)] for key, tensor in snapshot.states.items()}


def shadow_cache(cache: Cache, drop: int, snapshot: Snapshot) -> Cache:
    """A cache that holds what `cache` held `drop` positions ago (at `snapshot`), for a re-feed.

    Attention parts are cropped by `drop` on copies of the layers (a dynamic layer's crop makes new tensors; a
    static layer gets its own write pointer, and its re-fed slots are rewritten with the keys of the same tokens at
    the same positions, or lie beyond the slots any row keeps). Recurrent layers' states are copies of the
    snapshot's (or empty), positional windows are sliced back by `drop`, and no layer records its past: the shadow
    is thrown away after the re-feed.
    """
    shadow = copy.copy(cache)
    shadow.layers = []
    layer: Any  # transformers types `Cache.layers` as a union of mixins lacking the slots read here
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            shadow.layers.append(layer)
            continue
        linear = isinstance(layer, linear_states.LinearLayer)
        clone: Any = linear_states.copy_states(layer) if linear else copy.copy(layer)
        part = row_ops.attention_part(layer)
        if part is row_ops.StaticLayer:
            clone.cumulative_length = layer.cumulative_length.clone()
            clone.cumulative_length.sub_(drop)
        elif part is not None and layer.is_initialized:
            part.crop(clone, -drop)
        if linear:
            _rewind_linear(clone, index, drop, snapshot)
        shadow.layers.append(clone)
    return shadow


def _rewind_linear(layer: linear_states.LinearLayer, index: int, drop: int, snapshot: Snapshot) -> None:
    """Set a shadow layer's linear-attention states to what they were `drop` positions ago."""
    if linear_states.is_recurrent(layer):
        for field_ in linear_states.StateField:
            states = getattr(layer, field_.value)
            initialized = getattr(layer, f"is_{field_.value}_initialized")
            for state in list(states):
                saved = snapshot.states.get((index, field_, state))
                if saved is not None:
                    states[state] = saved.clone()  # the shadow's forwards update it in place
                elif initialized[state]:  # the empty state: the layer starts over, as in a prefill
                    states[state], initialized[state] = None, False
                    layer.has_previous_state[state] = False
    elif linear_states.is_initialized(layer):
        for state, history in layer.conv_states.items():
            if layer.is_conv_states_initialized[state] and history is not None:
                drops = [drop] * history.shape[0]
                window = layer.conv_kernel_size[state]
                assert window is not None  # set with the state (transformers' `lazy_initialization`)
                layer.conv_states[state] = linear_states.conv_windows(history, drops, window)
    layer.record_past = False
