"""Forwards of one fixed shape on a static cache, fed through buffers the runner owns: copy in, run, clone out.

A CUDA graph replays kernels on the addresses it recorded, so whatever a captured forward reads or writes must
live at one address for the graph's life: the cache (`cache.static_addresses`), and the forward's inputs and
outputs. A `ForwardRunner` owns its inputs (ids, position ids, the attention mask over every slot) as static
buffers, copies each forward's values into them, runs the model on them, and clones the logits out: torch's
CUDA-graph trees free a graph's outputs at the next replay ("accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run"), and the caller keeps the logits across the next forward.

One runner serves one shape: `rows` rows of `width` positions. A forward of fewer positions is padded to `width`
(gpt-fast verifies exactly K+1 positions every round; vLLM and SGLang pad to a captured size): the padded positions
repeat the last token at the next positions, write their keys past the committed length, are masked from every
real position (they come after it: the causal mask) and are rolled back by position afterwards (the write pointer
moves back; nothing is allocated). Their logits are dropped. Fewer rows (a batch whose rows finished: the cache
keeps their storage, `row_ops.select_rows`) are padded likewise: the spare rows repeat the first row's inputs into
the finished rows' slots, and their logits are dropped.

Backends (`RunnerBackend`), one discipline:

- `EAGER`: the model's eager forward on the buffers (the default on the CPU, so every CPU test runs the buffers);
- `COMPILED`: `torch.compile(fullgraph=True, dynamic=False)`, `mode="reduce-overhead"` (CUDA graphs) on CUDA and
  inductor's CPU settings (`cache.compiled.CPU_INDUCTOR_OPTIONS`, frozen weights: a weight change compiles afresh)
  on the CPU; each runner compiles its own code object, so a new shape is a first compilation, never a recompile.
"""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..core.devices import to_device
from . import compiled as compiled_module
from . import row_ops, static_addresses


class RunnerBackend(Enum):
    """What runs a `ForwardRunner`'s forward."""

    EAGER = "eager"
    COMPILED = "compiled"


@dataclass(frozen=True)
class RunnerPlan:
    """Which forwards of a model run through runners, decided once per call (`plan/call_plan.py`).

    Attributes:
        backend: what runs them.
        sizes: the runners' widths, ascending: a forward of `width` positions runs on the smallest size at least
            `width` (padded to it); wider ones (a prompt) run as before.
    """

    backend: RunnerBackend
    sizes: tuple[int, ...]

    def size_for(self, width: int) -> int | None:
        """The runner width a forward of `width` positions is padded to, or None: it runs without a runner."""
        return next((size for size in self.sizes if size >= width), None)


def _fresh_code(name: str) -> Callable:
    """A trampoline `model(**kwargs)` on a code object of its own: torch's compile cache hangs off code objects,
    so each runner's compilation is its first (a new shape never counts as a recompile of another runner's)."""

    def trampoline(model, kwargs):
        return model(**kwargs)

    code = trampoline.__code__.replace(co_name=name)
    return types.FunctionType(code, trampoline.__globals__, name)


class ForwardRunner:
    """Forwards of `rows` rows over `width` positions on `cache`, through static buffers (see the module doc).

    Attributes:
        input_ids: `(rows, width)` long, the ids buffer.
        position_ids: `(rows, width)` long, the position ids buffer (fed where the model takes them).
        attention_mask: `(rows, capacity)` long, the mask over every slot of the cache.
        runs: forwards run.
        compile_seconds: wall time of the runs that compiled or captured.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        capacity: int,
        rows: int,
        width: int,
        backend: RunnerBackend,
        cache_name: str,
        takes_position_ids: bool,
        device: torch.device,
    ):
        # Weak: a runner is kept with its cache (`runners_for`), which may outlive the call in the pool, kept per
        # model weakly; a strong reference here would keep the model alive for ever.
        self.model_ref = weakref.ref(model)
        self.rows, self.width, self.backend, self.capacity, self.device = rows, width, backend, capacity, device
        self.cache_name = cache_name
        self.input_ids = torch.zeros((rows, width), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((rows, width), dtype=torch.long, device=device)
        self.attention_mask = torch.zeros((rows, capacity), dtype=torch.long, device=device)
        self.kwargs: dict[str, Any] = {
            "input_ids": self.input_ids,
            "use_cache": True,
            "attention_mask": self.attention_mask,
        }
        if takes_position_ids:
            self.kwargs["position_ids"] = self.position_ids
        self.freezes = backend is RunnerBackend.COMPILED and device.type == "cpu"
        if static_addresses.keep_marks(device, self.freezes):  # graphs read the inputs where they were recorded
            for buffer in (self.input_ids, self.position_ids, self.attention_mask):
                torch._dynamo.mark_static_address(buffer)
        self.runs, self.compile_seconds = 0, 0.0
        self._function: Callable | None = None
        self._fingerprint: tuple | None = None

    def run(
        self, cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, slot_is_real: torch.Tensor
    ) -> torch.Tensor:
        """One forward over `w <= width` positions of every row, padded to `width`; the cache's write pointer ends
        after the `w` real positions.

        Args:
            cache: the static cache this runner serves (`runners_for(cache)`); it may hold fewer rows than the runner
                (`row_ops.select_rows` dropped finished rows, keeping the storage): the spare rows repeat the first
                row's inputs into the dropped rows' slots, and their logits are dropped.
            input_ids: `(rows, w)` long, on the model's device, `rows` at most the runner's.
            position_ids: `(rows, w)` long.
            slot_is_real: `(rows, slots)` bool on the CPU: the mask over the cache's slots, these `w` included;
                `slots - w` is the write pointer before the forward.

        Returns:
            `(rows, w, logit width)` float32 logits of the given rows, a tensor of the caller's (the next run leaves it
            as it is).
        """
        rows, valid = input_ids.shape
        slots = slot_is_real.shape[1]
        pad = self.width - valid
        shape = f"a runner of {self.rows}x{self.width} got {rows}x{valid}"
        assert 0 < rows <= self.rows and 0 < valid <= self.width, shape
        assert slots + pad <= self.capacity, f"a static cache of {self.capacity} slots cannot hold {slots + pad}"
        mask = torch.zeros((self.rows, self.capacity), dtype=torch.long)
        mask[:rows, :slots] = slot_is_real
        mask[rows:, :slots] = slot_is_real[:1]  # spare rows (rows that finished) repeat the first: dropped after
        mask[:, slots : slots + pad] = 1  # the padded positions see the real ones and themselves, as a longer round
        self.attention_mask.copy_(to_device(mask, self.device))
        self.input_ids[:rows, :valid].copy_(input_ids)
        self.position_ids[:rows, :valid].copy_(to_device(position_ids, self.device))
        if rows < self.rows:
            self.input_ids[rows:, :valid] = self.input_ids[:1, :valid]
            self.position_ids[rows:, :valid] = self.position_ids[:1, :valid]
        if pad:
            self.input_ids[:, valid:] = self.input_ids[:, valid - 1 : valid]
            steps = torch.arange(1, pad + 1, device=self.device)
            self.position_ids[:, valid:] = self.position_ids[:, valid - 1 : valid] + steps
        model = self.model_ref()
        assert model is not None, "hf_specsample internal error: a runner outlived its model"
        kwargs = {**self.kwargs, self.cache_name: cache}
        if rows < self.rows:  # the forward writes every allocated row: the finished rows' storage takes the spares
            row_ops.restore_rows(cache)
        try:
            logits = self._forward(model, cache, kwargs)
        finally:
            if rows < self.rows:
                row_ops.narrow_rows(cache, rows)
        if pad:  # rolled back by position: the pointer moves back over the padded slots
            row_ops.crop(cache, pad, total=slots + pad)
        self.runs += 1
        return logits[:rows, :valid].to(torch.float32, copy=True)  # cloned out: the next run overwrites graph outputs

    def _forward(self, model: torch.nn.Module, cache: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        if self.backend is RunnerBackend.EAGER:
            return model(**kwargs).logits
        return self._compiled(model, cache, kwargs)

    def _compiled(self, model: torch.nn.Module, cache: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        stale = self._function is None or (self.freezes and compiled_module.fingerprint(model) != self._fingerprint)
        options: dict[str, Any] = {}
        if self.device.type == "cuda":
            options["mode"] = "reduce-overhead"
        if stale:  # the first run, or weights frozen into the code changed since
            name = f"hf_specsample_runner_{id(self)}_{self.rows}x{self.width}_{self.runs}"
            self._function = torch.compile(_fresh_code(name), fullgraph=True, dynamic=False, **options)
            self._fingerprint = compiled_module.fingerprint(model) if self.freezes else None
        static_addresses.mark(cache, self.freezes)
        inductor = dict(compiled_module.CPU_INDUCTOR_OPTIONS) if self.device.type == "cpu" else {}
        start = time.perf_counter()
        with torch._inductor.config.patch(inductor):
            assert self._function is not None
            logits = self._function(model, kwargs).logits
        if stale:
            self.compile_seconds += time.perf_counter() - start
        return logits


# cache -> {(rows, width): its runner}. Weak: a runner lives as long as the cache it serves, so a cache kept between
# calls (`cache.static_addresses.POOL`) keeps its compiled or captured runners too. Rows dropped as they finish keep
# the cache's storage (`row_ops.select_rows`): its runners, of the allocated rows, serve the rows left (spare rows).
_RUNNERS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], ForwardRunner]]" = weakref.WeakKeyDictionary()


def runner_for(
    cache: Any,
    model: torch.nn.Module,
    rows: int,
    width: int,
    backend: RunnerBackend,
    cache_name: str,
    takes_position_ids: bool,
    device: torch.device,
) -> ForwardRunner:
    """The runner of `model` on `cache` for `rows` x `width` with `backend`: the one kept with the cache, else a
    new one (kept with it). Runners of other rows are dropped (the cache's tensors were replaced)."""
    runners = _RUNNERS.setdefault(cache, {})
    if any(held != rows for held, _ in runners):
        runners.clear()
    runner = runners.get((rows, width))
    if runner is None or runner.backend is not backend or runner.model_ref() is not model:
        capacity = row_ops.capacity(cache)
        assert capacity is not None, "a runner needs a static cache"
        runner = ForwardRunner(model, capacity, rows, width, backend, cache_name, takes_position_ids, device)
        runners[(rows, width)] = runner
    return runner
