"""One model's KV cache over the shared token buffer: hole-free rows, per-row rollback, plain `generate()`'s layout.

Invariant (what makes every architecture compute exactly what plain decoding computes): row ``b`` of the cache
holds buffer positions ``0 .. fed[b] - 1`` of that row, in order, in its last ``fed[b]`` slots. The slots in front
are *holes*, masked out. So each row's slots are laid out exactly as plain `generate()` lays out that row (prompt
padding included, masked the same way), only shifted right, and a sliding window, which counts slots, covers the
same tokens. Rows of a batch are fed the same number of new positions in each forward; a rollback that drops
different numbers of positions from different rows moves each row back to the end (`cache.row_ops.realign`, one
gather per layer); a uniform one is a `Cache.crop`.

A static cache (`StaticLayer`s of fixed size, `cache.row_ops`) keeps the same layout: its write pointer is the slot
count, a rollback moves the pointer back, a per-row move happens in place. Every forward then gets the attention
mask over all the cache's slots (masked beyond the pointer), so shapes stay fixed for compiled code; forwards of at
most `compiled_widths` positions (verification rounds, not the prefill) go through the compiled forward, if any;
a compiled forward with a symbolic query length (one graph for every width) also encodes the prompt. Eager forwards
run in the context of the model's `kernels.routing.KernelRouting`, if any (the small-rows linear kernel for rounds).
A model may also have `WideForwards`: another model of the same layout (a quantized draft's float original) that runs
its eager forwards of many positions (the prompt), where that was timed faster; both write the same cache.

Sliding-window layers record their past (`activate_past_recording`) so that a forward's new slots can be rolled
back; every rollback trims them back to the window. So a rollback can drop only positions fed since the previous
one, which is all the loop ever drops (rejected drafts, and at most the last draft-fed position to even rows out);
`cache.row_ops` raises rather than compute with slots it no longer has.

Hybrid and state-space models' convolution and recurrent states have no slots: row ``b``'s states are those after
its ``fed[b]`` positions. Convolution windows are rolled back by slicing their recorded history
(`cache.linear_states`); recurrent states from a snapshot taken before each forward, re-feeding the kept positions
after it where a row keeps fewer than a forward fed (`cache.checkpoints`). Two forward shapes keep that cheap and
exact: a forward that would also feed many already committed positions (a prompt) feeds them in a forward of their
own first, so that a rollback never re-feeds them; and a model whose recurrent layers cannot continue a forward of
several tokens from a cached state (transformers' Mamba-1, `transformers_api.scan_restarts_from_zero`) is fed one
position per forward once it holds a state (allowed for drafts only: `ModelFacts.problem_as`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol, cast

import torch
from transformers import Cache, DynamicCache

from ..core import transformers_api
from ..core.devices import to_device
from ..core.model_facts import ModelFacts, unsupported_layers
from ..core.sequences import Columns, Sequences
from . import linear_states, row_ops
from .checkpoints import StateCheckpoints
from .compiled import contiguous_attention, fresh_input, positions_to_keep
from .forwards import Forwards
from .output_head import OutputHead
from .runner import RunnerBackend, runner_for
from .step_warm_up import warm_step


class HeldTree(Protocol):
    """A round's tree in a model's cache (`tree_forward.CachedTree`, `tree_growth.KeptNodes`)."""

    def compact(self, path: torch.Tensor, counts: Sequence[int]) -> None:
        """Keep the accepted `path` `(rows, D)` (-1 after `counts[b]`) and let go of the rest."""


class CachedModel:
    """A model plus its KV cache, fed column ranges of a `Sequences` buffer.

    Attributes:
        cache: the `Cache` (a `DynamicCache` of `model_facts.SUPPORTED_LAYERS`, or a static cache whose attention is
            held in full `StaticLayer`s).
        fed: per row, the number of leading buffer positions whose keys/values (and states) are in the cache.
        states: the owner of the cache's convolution and recurrent states' rollback (None: attention only).
        refeed_passes: forwards run to re-feed kept positions on recurrent states (also counted in forward_passes).
        slot_is_real: `(batch, slots)` bool on the CPU, the attention mask over the cache's slots.
        forward_passes: number of forward calls made so far.
        forwards: how its forwards run (`Forwards`); `compiled`, `kernel`, `wide` and `step` are its fields.
        held_tree: a round's draft tree whose nodes the cache holds after the committed positions
            (`tree_forward.CachedTree`, or a dynamic tree's kept nodes over it), until `keep_path`; None: no tree.
    """

    def __init__(
        self,
        facts: ModelFacts,
        batch: int,
        cache: Cache | None = None,
        cached_is_real: torch.Tensor | None = None,
        forwards: Forwards | None = None,
        source: Sequences | None = None,
    ):
        """
        Args:
            facts: the model's facts (`model_facts.ModelFacts`): a decoder-only model with an LM head.
            batch: rows.
            cache: a cache to extend: empty, or holding the first ``C`` buffer positions of every row as plain
                `generate()` left it (a previous chat turn). A `DynamicCache` if None.
            cached_is_real: `(batch, C)` bool, the attention mask over those ``C`` positions (None: all real).
            forwards: how its forwards run (`Forwards`; None: plain eager).
            source: the token buffer this model is fed from (its rows are this cache's rows): a rollback of
                recurrent states re-feeds kept positions from it. Needed for models with recurrent states only.

        A model whose recurrent layers cannot continue a multi-token forward from a cached state
        (`ModelFacts.scan_restarts_from_zero`: a Mamba-1 draft) is fed one position per forward once it holds one.
        """
        model, forwards = facts.model, forwards if forwards is not None else Forwards()
        self.model, self.facts, self.forwards = model, facts, forwards
        self.cache = cache if cache is not None else DynamicCache(config=model.config)
        unsupported = unsupported_layers(self.cache)
        if unsupported:
            raise ValueError(
                f"`draft_model=` needs a DynamicCache of attention, convolution and recurrent state layers; this cache "
                f"has {', '.join(unsupported)}. "
                f"Pass no `{transformers_api.CACHE}` / `cache_implementation`, or generate without `draft_model=`."
            )
        self.capacity = row_ops.capacity(self.cache)  # None: a dynamic cache
        compiled, step = forwards.compiled, forwards.step
        assert compiled is None or self.capacity is not None, "compiled forwards need a static cache"
        self.compiled, self.kernel, self.wide, self.step = compiled, forwards.kernel, forwards.wide, step
        self._step_model = step.model_ref() if step is not None else None  # held: `step` refers to it weakly
        self._was_recording = [getattr(layer, "record_past", None) for layer in self.cache.layers]
        self.cache.activate_past_recording()  # lets sliding-window layers (and convolution windows) be rolled back
        hybrid = any(True for _ in linear_states.linear_layers(self.cache))
        assert (compiled is None and step is None) or not hybrid, "hybrid models run eagerly (their states roll back)"
        self.states = StateCheckpoints(self.cache) if hybrid else None
        self.source, self.single_step = source, facts.scan_restarts_from_zero
        self.refeed_passes = 0
        self._last_num_logits = 1  # of the last `feed`: K + 1 for a verification
        cached = row_ops.total_slots(self.cache)
        if cached_is_real is None:
            cached_is_real = torch.ones((batch, cached), dtype=torch.bool)
        self.slot_is_real = cached_is_real.bool().cpu()  # (batch, slots)
        self.fed = [cached] * batch
        self.forward_passes = 0
        self._cache_name = facts.cache_name or transformers_api.CACHE
        self.runner_plan = forwards.runner if self.capacity is not None and self.states is None else None
        eager = compiled is None and step is None and self.runner_plan is None and self.states is None
        self.head = OutputHead(model, usable=eager and not facts.tensor_parallel)  # deferred verification logits
        self.held_tree: HeldTree | None = None

    @property
    def slots(self) -> int:
        return self.slot_is_real.shape[1]

    @property
    def input_device(self) -> torch.device:
        """Where input ids go (`ModelFacts.input_device`)."""
        return self.facts.input_device

    def keep_path(self, path: torch.Tensor, counts: Sequence[int]) -> None:
        """Keep a round's accepted path in the cache, the one call after verification on every model's cache: a held
        tree's nodes are compacted to the path (`CachedTree.compact`); without one the accepted drafts are already a
        prefix of the fed positions (a chain's), which `rollback_to_committed` then crops.

        Args:
            path: `(rows, D)` long, each row's accepted nodes from the root's child down, -1 after `counts[b]`.
            counts: per row, its accepted nodes.
        """
        if self.held_tree is not None:
            self.held_tree.compact(path, counts)  # which lets go of it (`CachedTree.compact`)

    def _no_tree_held(self) -> None:
        if self.held_tree is not None:
            raise RuntimeError("hf_specsample internal error: the drafted tree must be compacted first (`keep_path`)")

    def feed_upto(self, sequences: Sequences, upto: Sequence[int], num_logits: int) -> torch.Tensor:
        """`feed` the buffer positions ``fed[b] .. upto[b] - 1`` of every active row of `sequences` (one width)."""
        self._no_tree_held()
        widths = {end - fed for end, fed in zip(upto, self.fed)}
        assert len(widths) == 1, f"rows must feed the same number of positions, got {sorted(widths)}"
        return self.feed(sequences.columns(self.fed, widths.pop()), num_logits)

    def feed(self, columns: Columns, num_logits: int) -> torch.Tensor:
        """Run the model on the next `width` buffer positions of every row and return the last logits.

        Args:
            columns: buffer positions ``fed[b] .. fed[b] + width - 1`` of every row (`Sequences.columns`).
            num_logits: how many trailing positions to return logits for (<= width).

        Returns:
            `(batch, num_logits, vocab)` float32 logits on the device of `columns.input_ids` (an empty stand-in where
            `head.deferred` defers them: `head.take` gives them, `cache.output_head.HeadLogits`).
        """
        width = columns.input_ids.shape[1]
        assert width >= num_logits, "every row must feed at least num_logits positions"
        self._last_num_logits = num_logits
        if self.states is None:
            return self._feed_part(columns, num_logits)
        logits = []
        for start, end in self._parts(width, num_logits, columns.is_real):
            part = Columns(*(tensor[:, start:end] for tensor in columns))
            wanted = max(0, end - max(start, width - num_logits))  # of the last num_logits positions
            part_logits = self._feed_part(part, max(wanted, 1))
            if wanted:
                logits.append(part_logits[:, -wanted:])
        return torch.cat(logits, dim=1) if len(logits) > 1 else logits[0]

    def _parts(self, width: int, num_logits: int, is_real: torch.Tensor) -> list[tuple[int, int]]:
        """The forwards (column ranges) that feed `width` positions to a cache with linear-attention layers.

        Positions before the last `num_logits` are committed: no rollback drops them. Where they outnumber the last
        ones (a prompt, a chat turn) and a recurrent layer may be involved, they get a forward of their own, so that
        a snapshot sits right before the positions a rollback may drop. Not where the last ones hold padding (a
        prompt padded on the right, whose first round drafts nothing, so nothing is rolled back): the logits of a
        padding position come from attention rows with every key masked, which eager attention fills from all the
        keys of the forward, and transformers masks padding out of linear-attention layers only in forwards of
        several positions; plain `generate()` encodes such a prompt in one forward, and so does this. A
        `single_step` model (a draft) holding a state is fed one position per forward.

        Args:
            is_real: `(rows, width)` bool, False for prompt padding.
        """
        assert self.states is not None  # `feed` splits forwards for linear-attention states only
        cut = width - num_logits
        split = cut > num_logits and self.states.may_recur and bool(is_real[:, cut:].all())
        parts = [(0, cut), (cut, width)] if split else [(0, width)]
        if not self.single_step:
            return parts
        held = max(self.fed) > 0
        singles = []
        for start, end in parts:
            if held or start > 0:
                singles += [(position, position + 1) for position in range(start, end)]
            else:
                singles.append((start, end))  # from the empty state: a scan from zero is what the model computes
            held = True
        return singles

    def _feed_part(self, columns: Columns, num_logits: int) -> torch.Tensor:
        """One forward over `columns` (see `feed`)."""
        if self.states is not None:
            self.states.before_forward(self.fed)
        self.grow(columns.is_real)
        logits = self._forward(self.cache, self.slot_is_real, columns, num_logits)
        if self.states is not None:
            self.states.after_forward()
        return logits

    def grow(self, is_real: torch.Tensor) -> None:
        """Count the slots a forward is about to write, `(rows, width)` bool on the CPU (False: padding): by `feed`,
        and by `cache.tree_forward`, whose tree nodes are counted as fed positions until its compaction."""
        self.slot_is_real = torch.cat([self.slot_is_real, is_real], dim=1)
        self.fed = [fed + is_real.shape[1] for fed in self.fed]

    def _forward(self, cache: Cache, slot_is_real: torch.Tensor, columns: Columns, num_logits: int) -> torch.Tensor:
        """The model's forward over `columns` with `cache`, whose slots (these columns' included) `slot_is_real`
        masks; returns the last `num_logits` logits as `feed` does."""
        width = columns.input_ids.shape[1]
        slots = slot_is_real.shape[1]
        device = self.input_device
        rows = slot_is_real.shape[0]
        size = self.runner_plan.size_for(width) if self.runner_plan is not None and cache is self.cache else None
        room = self.capacity if self.capacity is not None else 0
        allocated = all(getattr(layer, "is_initialized", True) for layer in cache.layers)  # by a first, eager forward
        if size is not None and slots + size - width <= room and allocated:
            return self._run(size, columns, slot_is_real, num_logits)
        compiled = (
            self.compiled is not None
            and cache is self.cache
            and (
                width <= self.forwards.largest_round or self.compiled.symbolic_widths
            )  # one graph also serves the prompt
            and self.compiled.serves(rows, width)
            and self.compiled.ready_for(rows)
            # a first forward allocates the cache eagerly (its layers: attention or dummy, a compiled model's)
            and all(layer.is_initialized for layer in cast("list[Any]", cache.layers))
        )
        # One position is fed as two under symbolic widths (one compiled graph, one frozen weight copy): the extra
        # position repeats the last token one slot further, its logits are dropped and its slot is rolled back.
        padded = int(
            compiled
            and width == 1
            and self.compiled is not None
            and self.compiled.symbolic_widths
            and slots < cast(int, self.capacity)  # compiled forwards run on static caches (`__init__` asserts it)
        )
        input_ids, position_ids = columns.input_ids.to(device), columns.position_ids
        if padded:
            input_ids = torch.cat([input_ids, input_ids[:, -1:]], dim=1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=1)
        kwargs = {self._cache_name: cache, "use_cache": True}
        if self.capacity is not None and self.states is None:  # static: the mask covers every slot (one shape for
            # compiled code). Not for hybrids, which run eagerly: their linear-attention layers read the mask's last
            # `width` columns as the new positions' padding (`create_recurrent_attention_mask`).
            assert slots <= self.capacity, f"a static cache of {self.capacity} slots cannot hold {slots}"
            mask = torch.zeros((rows, self.capacity), dtype=torch.long)
            mask[:, : slots + padded] = torch.cat([slot_is_real, torch.ones((rows, padded), dtype=torch.bool)], 1)
            kwargs["attention_mask"] = to_device(mask, device)
        elif self.capacity is not None or not bool(slot_is_real.all()):
            assert self.capacity is None or slots <= self.capacity, (
                f"a static cache of {self.capacity} slots cannot hold {slots}"
            )
            kwargs["attention_mask"] = to_device(slot_is_real.long(), device)
        if self.facts.takes_position_ids:
            kwargs["position_ids"] = to_device(position_ids, device)
        if self.facts.takes_logits_to_keep:
            kwargs["logits_to_keep"] = positions_to_keep(width + padded, num_logits + padded, device, compiled)
        input_ids = self._embeddable(input_ids)
        stepped = (
            not compiled and self.step is not None and width == 1 and cache is self.cache and self.step.ready_for(rows)
        )
        if compiled or stepped:  # dynamo guards on strides: row-major inputs, as the warm-up's
            input_ids, kwargs = fresh_input(input_ids), {key: fresh_input(value) for key, value in kwargs.items()}
        if compiled:
            assert self.compiled is not None  # `compiled` says so
            logits = self.compiled(input_ids=input_ids, **kwargs).logits
        elif stepped:
            assert self.step is not None  # `stepped` says so
            contiguous_attention(cache)
            logits = self.step(input_ids=input_ids, **kwargs).logits
        elif self.wide is not None and rows * width >= self.wide.from_rows:
            logits = self.wide.model(input_ids=input_ids, **kwargs).logits
        else:
            logits = self._eager(input_ids, kwargs, num_logits, columns.input_ids.device, slots, cache is self.cache)
        if padded:
            row_ops.crop(cache, 1)
            logits = logits[:, :-1]
        self.forward_passes += 1
        return logits[:, -num_logits:].to(device=columns.input_ids.device, dtype=torch.float32)

    def feed_masked(
        self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, num_logits: int
    ) -> torch.Tensor:
        """One eager forward over `(rows, width)` ids at `positions` `(rows, width)`, each position attending to the
        cache's slots and the forward's own positions `allowed` `(rows, width, slots)` marks (a draft tree's mask:
        `cache.tree_forward`); the last `num_logits` logits, float32, on the ids' device. The positions fed count
        as the cache's (`grow`), until the tree's compaction."""
        rows, width = input_ids.shape
        device = self.input_device
        if self.capacity is not None:  # a static cache attends over all its slots: those past the pointer masked
            slots = allowed.shape[-1]
            assert slots <= self.capacity, f"a static cache of {self.capacity} slots cannot hold {slots}"
            allowed = torch.cat([allowed, allowed.new_zeros((rows, width, self.capacity - slots))], dim=-1)
        kwargs: dict[str, Any] = {
            self._cache_name: self.cache,
            "use_cache": True,
            "attention_mask": transformers_api.additive_attention_mask(allowed, self.facts.model.dtype, device),
            "position_ids": positions.to(device),
        }
        if self.facts.takes_logits_to_keep:
            kwargs["logits_to_keep"] = positions_to_keep(width, num_logits, device, compiled=False)
        ids = self._embeddable(input_ids.to(device))
        logits = self._eager(ids, kwargs, num_logits, input_ids.device, self.slots, True)
        self.forward_passes += 1
        return logits[:, -num_logits:].to(device=input_ids.device, dtype=torch.float32)

    def _embeddable(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` with the ids the model cannot embed fed as id 0 (`Forwards.embeddable`)."""
        if self.forwards.embeddable is None:
            return input_ids
        return input_ids.masked_fill(input_ids >= self.forwards.embeddable, 0)

    def _eager(
        self,
        input_ids: torch.Tensor,
        kwargs: dict[str, Any],
        num_logits: int,
        out_device: torch.device,
        slots: int,
        own_cache: bool,
    ) -> torch.Tensor:
        """An eager forward of `(rows, width)` ids on the device, through the kernel's routing and the output head
        (deferred where the loop asks: `OutputHead`); a deferral the head cannot prove reruns after cropping the
        `width` positions fed off this model's cache (`own_cache`; `slots` the count before them)."""
        rows, width = input_ids.shape
        routed = partial(self.kernel.applied, rows * width) if self.kernel is not None else contextlib.nullcontext
        undo = partial(row_ops.crop, kwargs[self._cache_name], width, total=slots) if own_cache else None
        run = partial(self.model, input_ids=input_ids, **kwargs)
        return self.head.forward(run, routed, rows, num_logits, out_device, undo)

    def _run(self, size: int, columns: Columns, slot_is_real: torch.Tensor, num_logits: int) -> torch.Tensor:
        """`_forward` through this cache's runner of `size` positions (`cache.runner.ForwardRunner`)."""
        assert self.runner_plan is not None and self.capacity is not None
        rows, device = row_ops.allocated_rows(self.cache), self.input_device  # finished rows' slots: spare rows
        runner = runner_for(
            self.cache,
            self.model,
            rows,
            size,
            self.runner_plan.backend,
            self._cache_name,
            self.facts.takes_position_ids,
            device,
        )
        input_ids = columns.input_ids.to(device)
        if self.forwards.embeddable is not None:
            input_ids = input_ids.masked_fill(input_ids >= self.forwards.embeddable, 0)
        logits = runner.run(self.cache, input_ids, columns.position_ids, slot_is_real)
        self.forward_passes += 1
        return logits[:, -num_logits:].to(device=columns.input_ids.device)

    def warm_up(self) -> None:
        """Compile now what this call's forwards will run, so no round pays for it (`CompiledForward.ready_for`).

        Called before the first round: with symbolic widths the one compiled graph then also encodes the prompt.
        The warm-up forward writes two positions past the cache's write pointer, which then moves back: those
        slots are masked (causally) and overwritten by the next forward. A cache whose layers are not allocated
        yet (`StaticLayer` allocates on its first update: every call's new cache) gets the same two positions
        eagerly first, also when the graph is already compiled, so that the prompt runs compiled in every call.
        Nothing else changes.
        """
        rows = self.slot_is_real.shape[0]
        # (a compiled forward runs on a static cache, of an int capacity: `__init__` asserts it)
        if self.compiled is None or not self.compiled.symbolic_widths or self.slots + 2 > cast(int, self.capacity):
            return
        if not self.compiled.serves(rows, 2):  # this call's forwards all run eagerly: compile nothing
            return
        layers: list[Any] = self.cache.layers  # attention or dummy layers (a compiled model's), all `is_initialized`
        if not all(layer.is_initialized for layer in layers):  # every call's new cache, not only the first
            self._dummy_forward(self.model, rows)
        if self.compiled.needs_warm_up(rows):
            self._dummy_forward(self.compiled, rows)
            self.compiled.warm(rows)

    @property
    def compilations(self) -> int:
        """Calls that compiled something, of this model's compiled forward and compiled step."""
        return sum(part.compilations for part in (self.compiled, self.step) if part is not None)

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling this model's compiled forward and step (None: neither is compiled)."""
        parts = [part.compile_seconds for part in (self.compiled, self.step) if part is not None]
        return sum(parts) if parts else None

    def warm_step(self) -> None:
        """Compile the single-position step now, on a throwaway cache like this one (`step_warm_up.warm_step`)."""
        if self.step is not None:
            rows, masked = self.slot_is_real.shape[0], not bool(self.slot_is_real.all())
            warm_step(self.step, self.model, self.cache, self.facts, self._cache_name, rows, masked, self.input_device)

    def _dummy_forward(self, forward, rows: int) -> None:
        """Two positions of id 0 after the write pointer, then the pointer moves back."""
        pointer, device = self.slots, self.input_device
        assert self.capacity is not None  # compiled forwards run on static caches
        mask = torch.zeros((rows, self.capacity), dtype=torch.long)
        mask[:, :pointer] = self.slot_is_real
        mask[:, pointer : pointer + 2] = 1
        kwargs = {self._cache_name: self.cache, "use_cache": True, "attention_mask": mask.to(device)}
        if self.facts.takes_position_ids:
            # contiguous, as the rounds' position ids are: dynamo guards on strides (an expanded tensor would
            # compile, and freeze the weights, a second time)
            kwargs["position_ids"] = torch.arange(pointer, pointer + 2, device=device).repeat(rows, 1)
        if self.facts.takes_logits_to_keep:
            kwargs["logits_to_keep"] = positions_to_keep(2, 2, device, compiled=forward is self.compiled)
        forward(input_ids=torch.zeros((rows, 2), dtype=torch.long, device=device), **kwargs)
        row_ops.crop(self.cache, 2)

    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        """Roll back to what the committed tokens confirm, leaving every row the same distance behind its length.

        A row keeps at most ``lengths[b] - 1`` positions (the last committed token is fed with the next round, as in
        plain decoding, where the cache always holds the sequence minus its last token). If some row is further
        behind, the others drop positions too, so the next forward feeds every row the same number of positions.

        A cache with recurrent states may keep fewer positions still (`StateCheckpoints.deferred_keep`): where a row
        would need a re-feed and every row can go back to one snapshot at the same distance behind its length, the
        kept positions after it are re-fed by the next forward together with the next round's, instead of by a
        forward of their own now.

        Args:
            lengths: per row, the committed length.
        """
        self._no_tree_held()  # its node slots would pass for committed positions
        keep = self.rollback_point(lengths)
        if self.states is not None:
            keep = self.states.deferred_keep(self.fed, keep, lengths, limit=self._last_num_logits - 1) or keep
        self.rollback(keep)

    def rollback_point(self, lengths: Sequence[int], unchanged: Sequence[int] | None = None) -> list[int]:
        """Per row, the buffer length `rollback_to_committed` keeps: every row the same distance behind its length.

        Args:
            lengths: per row, the committed length.
            unchanged: per row, how many leading buffer positions still hold the tokens they held when fed (None:
                every committed one). A draft with another tokenizer rewrites the positions after its accepted
                tokens with the committed tokens' draft ids, which may differ from the rejected ones it fed there.

        Returns:
            Per row, the positions to keep; negative where a row is shorter than another row is behind (only rows
            of different lengths can be: a draft with another tokenizer, whose rows gain different numbers of ids).
        """
        keep = [min(fed, length - 1) for fed, length in zip(self.fed, lengths)]
        if unchanged is not None:
            keep = [min(kept, valid) for kept, valid in zip(keep, unchanged)]
        behind = max(length - kept for length, kept in zip(lengths, keep))
        return [length - behind for length in lengths]

    def rollback(self, keep: Sequence[int]) -> None:
        """Forget buffer positions ``>= keep[b]`` of each row; rows end up right-aligned, holes in front.

        Args:
            keep: per row, the buffer length to keep (at most `fed[b]`).
        """
        drops = [fed - kept for fed, kept in zip(self.fed, keep)]
        assert min(drops) >= 0, "cannot keep positions that were never fed"
        if self.states is not None:  # before the attention part moves: a re-feed crops a copy of it
            before = self.forward_passes
            self.states.restore(self.fed, keep, self._refeed_runner())
            self.refeed_passes += self.forward_passes - before
        if len(set(drops)) == 1:  # uniform: a crop (which also trims sliding-window layers back to their window)
            row_ops.crop(self.cache, drops[0], total=self.slots)  # no read of a static cache's pointer
            self.slot_is_real = self.slot_is_real[:, : self.slots - drops[0]]
            self.fed = list(keep)
            return
        self._realign(keep, total=max(keep))

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (indices into the current batch), e.g. to drop finished rows."""
        self._no_tree_held()
        index = torch.tensor(list(rows), dtype=torch.long)
        row_ops.select_rows(self.cache, index)  # a CPU index works for cache layers on any device
        if len(rows) < len(self.fed) and self.runner_plan and self.runner_plan.backend is RunnerBackend.EAGER:
            self.runner_plan = None  # graphs serve fewer rows padded to the allocated batch; eager runs them as before
        if self.states is not None:
            self.states.select_rows(index)
        self.slot_is_real = self.slot_is_real[index]
        self.fed = [self.fed[row] for row in rows]
        self.drop_shared_holes()

    def drop_shared_holes(self) -> None:
        """Drop the leading slots that every row leaves empty, trimming nothing (see module doc): a row that
        finished with leading holes then takes as many slots as it holds positions, so feeding it up to
        `max_length` fits a static cache of `max_length` slots."""
        if max(self.fed) < self.slots:
            self._realign(self.fed, total=max(self.fed), trim=False)

    def copy_rows(self, rows: Sequence[int]) -> "CachedModel":
        """A `CachedModel` of the same model holding copies of these rows' caches (this one is unchanged)."""
        taken = CachedModel.__new__(CachedModel)
        taken.__dict__.update(self.__dict__)
        index = torch.tensor(list(rows), dtype=torch.long)
        taken.cache = row_ops.copy_rows(self.cache, rows)
        taken.slot_is_real = self.slot_is_real[index]
        taken.fed = [self.fed[row] for row in rows]
        taken.forward_passes = taken.refeed_passes = 0
        taken.compiled = None  # its few last forwards (a finished row's padding) would compile a new batch size
        taken.runner_plan = None
        taken.states = StateCheckpoints(taken.cache) if self.states is not None else None
        taken.source = None  # its rows are no longer the buffer's: it is only fed forward, never rolled back
        return taken

    def left_align(self) -> None:
        """Drop every row's leading holes (all rows must hold the same number of positions): plain's layout."""
        assert len(set(self.fed)) == 1, "rows of a left-aligned cache hold the same positions"
        if self.states is not None:  # nothing to move: trims convolution histories to their windows
            self.states.restore(self.fed, self.fed, None)
        if self.slots > self.fed[0]:
            self._realign(self.fed, total=self.fed[0])
        else:
            row_ops.crop(self.cache, 0)  # trims sliding-window layers as a realign would

    def stack_rows(self, parts: Sequence["CachedModel"]) -> None:
        """Make this cache hold the rows of `parts` (each of the same number of slots), in order, in place."""
        row_ops.stack_rows_into(self.cache, [part.cache for part in parts])

    def stop_recording(self) -> None:
        """Trim sliding-window layers to their window and stop recording their past, as before this call."""
        row_ops.crop(self.cache, 0)
        linear_states.stop_recording(self.cache, self._was_recording)
        layer: Any  # `Cache.layers`' declared union lacks `record_past`, which the layers that had one have
        for layer, was_recording in zip(self.cache.layers, self._was_recording):
            if was_recording is not None:
                layer.record_past = was_recording

    def _refeed_runner(self):
        """The `cache.checkpoints.Runner` of this model: feeds a shadow cache from the token buffer, its slot mask
        growing from this cache's slots as they were when the shadow's snapshot was taken."""
        masks: dict[int, torch.Tensor] = {}

        def run(cache: Cache, starts: Sequence[int], width: int) -> None:
            assert self.source is not None, "hf_specsample internal error: a re-feed without a token buffer"
            mask = masks.get(id(cache))
            if mask is None:  # the shadow's slots: those before the snapshot's positions
                mask = self.slot_is_real[:, : self.slots - (self.fed[0] - starts[0])]
            steps = [(offset, 1) for offset in range(width)] if self.single_step else [(0, width)]
            for offset, step in steps:
                columns = self.source.columns([start + offset for start in starts], step)
                mask = torch.cat([mask, columns.is_real], dim=1)
                self._forward(cache, mask, columns, num_logits=1)
            masks[id(cache)] = mask

        return run

    def _realign(self, keep: Sequence[int], total: int, trim: bool = True) -> None:
        """Keep buffer positions ``0 .. keep[b] - 1`` of each row in its last `keep[b]` of `total` slots."""
        old_starts = [self.slots - fed for fed in self.fed]
        new_starts = [total - kept for kept in keep]
        row_ops.realign(self.cache, old_starts, new_starts, keep, total, trim=trim, old_total=self.slots)
        slots = torch.arange(total)[None, :]  # (1, total)
        new_starts_t = torch.tensor(new_starts)[:, None]
        source = (slots - new_starts_t + torch.tensor(old_starts)[:, None]).clamp(0, max(self.slots - 1, 0))
        self.slot_is_real = (slots >= new_starts_t) & self.slot_is_real.gather(1, source)
        self.fed = list(keep)
