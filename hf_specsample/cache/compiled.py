"""Compiled forward passes for the target's verification (and any fixed-shape step), exact and safe to reuse.

A decoding step streams every weight once; verifying K+1 positions streams them once too but does K+1 times the
arithmetic. PyTorch's eager small-M GEMM makes that cost about K+1 steps on CPUs without fast bf16 (AVX2: eager
bf16 `F.linear` 8960x1536 costs 1.8 ms for 1 row and 8.0 ms for 5). Inductor's C++ GEMM template, with the weights
frozen and prepacked once, reuses each loaded weight block for every row (3.3 ms for 5 rows). This module compiles a
model's forward that way:

- `CompileSettings`: what to hand `torch.compile`, and the inductor options that must be set *while it compiles*.
  On this torch, `torch.compile(options={"freezing": True, ...})` does not freeze the weights (the GEMM stays ATen's);
  patching `torch._inductor.config` around the compiling call does. `for_device` gives the settings that make small
  M fast: on CPU frozen weights + max-autotune with the C++ GEMM and a dynamic query length (one graph serves
  every width >= 2; callers feed one position as two); on CUDA CUDA graphs (`mode="reduce-overhead"`).
  `from_compile_config` honours transformers' `CompileConfig`.
- `compiled_forward(model, settings)`: the compiled callable, kept per model (weakly) and settings.

Exactness: a compiled forward computes the model's function; its logits differ from eager ones by rounding, as
logits of a batched forward differ from one-row ones. Frozen weights are a *copy*: if the model's parameters
change after compiling (`load_state_dict`, `copy_`, an optimizer step), compiled code would silently compute the
old model. Every call therefore checks the parameters' storage and version counters (`_fingerprint`, ~0.1 ms on a
1.5B model) and compiles afresh when they changed. torch's compile cache is attached to a code object and reused
by any new `torch.compile` of the same function (guards check shapes, not values), so each compilation traces a
fresh copy of a tiny trampoline code object: entries never serve another model or stale weights.
"""

from __future__ import annotations

import contextlib
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config
from transformers import Cache, PreTrainedModel

from ..kernels.small_rows import MAX_ROWS, SmallRowsLinear
from . import row_ops, static_addresses

# Inductor options that make small-M GEMM fast on CPU: weights frozen and prepacked once, and the C++ GEMM template
# autotuned against ATen's. Needs `torch.no_grad`/`inference_mode` (generate() runs under no_grad).
CPU_INDUCTOR_OPTIONS = (
    ("freezing", True),
    ("max_autotune", True),
    ("max_autotune_gemm_backends", "CPP,ATEN"),
)


@dataclass(frozen=True)
class CompileSettings:
    """How to compile a forward.

    Attributes:
        compile_kwargs: keyword arguments of `torch.compile` (as sorted pairs: hashable).
        inductor_options: inductor config values patched in while compiled code runs (and so while it compiles).
        freezes: whether compiled code holds a copy of the weights (inductor `freezing`): then weight changes are
            detected before every call and trigger a new compilation.
        kernel_rows: linears of at most this many rows run on the small-rows kernel inside compiled code (its
            operator traced through its fake implementation, `kernels.small_rows.SmallRowsLinear` active while the
            code compiles and runs); 0: none (inductor's or ATen's GEMM).
    """

    compile_kwargs: tuple[tuple[str, Any], ...] = ()
    inductor_options: tuple[tuple[str, Any], ...] = ()
    freezes: bool = False
    kernel_rows: int = 0

    @classmethod
    def for_device(cls, device: torch.device, kernel: bool = False) -> "CompileSettings":
        """What `SpeculativeConfig(compile=True)` uses: fast small-M GEMM on CPU, CUDA graphs on CUDA.

        Args:
            kernel: on CPU, the linears of round sizes (at most `MAX_ROWS` kernel rows) are the small-rows kernel's
                (`linear_kernel="on"`, or "auto" where the plan serves the rounds: `call_plan._kernel_in_graph`),
                and inductor fuses the rest of the forward (norms, rotary, attention's reshapes, residuals: the
                eager glue around the kernel's linears), rounding its intermediates to bf16 where eager code does
                (`emulate_precision_casts`: fused, they would stay float32, and greedy output could part from plain
                `generate()`'s). No freezing: the weights stay inputs, which the kernel reads as they are (no copy;
                a weight changed in place is read). Ignored on CUDA (the kernel is CPU-only; `KernelRouting.for_model`
                refuses "on" there first).
        """
        if device.type == "cpu" and kernel:
            return cls(
                compile_kwargs=(("dynamic", True),),
                inductor_options=(("emulate_precision_casts", True),),
                kernel_rows=MAX_ROWS,
            )
        if device.type == "cpu":
            # dynamic=True: the query length M is symbolic (M=1 is specialised by dynamo), so K may change every
            # round without recompiling, and the C++ GEMM template still applies (it needs static N and K only).
            return cls(compile_kwargs=(("dynamic", True),), inductor_options=CPU_INDUCTOR_OPTIONS, freezes=True)
        # CUDA graphs replay a recorded kernel sequence per shape: K takes a handful of values (one graph each).
        return cls(compile_kwargs=(("dynamic", None), ("mode", "reduce-overhead")))

    @classmethod
    def for_draft_steps(cls) -> "CompileSettings":
        """What `SpeculativeConfig(compile_draft=True)` uses for a draft's single-token steps on its dynamic cache:
        inductor fuses the step's many small operators (norms, rotary, attention's reshapes, residuals), about a
        third of a quantized draft's step on a CPU. Symbolic sizes (the cache grows every step; dynamo specialises
        one row apart from several). No freezing: the weights stay inputs, so a change to them is read, and a
        quantized draft's linears are the small-rows kernel's operators either way."""
        return cls(compile_kwargs=(("dynamic", True),))

    @classmethod
    def from_compile_config(cls, compile_config: Any) -> "CompileSettings":
        """transformers' `CompileConfig`, as plain `generate()` applies it (`torch.compile(**config.to_dict())`).

        Inductor options in its `options` are also patched in while compiling (torch.compile's own `options=` does
        not turn on freezing here), so `CompileConfig(mode=None, options={"freezing": True, ...})` works as meant.
        """
        kwargs = dict(compile_config.to_dict())
        options = kwargs.get("options") or {}
        return cls(
            compile_kwargs=tuple(sorted((key, _hashable(value)) for key, value in kwargs.items())),
            inductor_options=tuple(sorted(options.items())),
            freezes=bool(options.get("freezing")),
        )


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def _fingerprint(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Storage address and version counter of every parameter and buffer: changes when any weight is replaced or
    written in place through autograd-visible ops (writes through `.data` bypass version counters)."""
    return tuple(
        (tensor.data_ptr(), tensor._version if not tensor.is_inference() else -1)
        for tensor in (*model.parameters(), *model.buffers())
    )


def fingerprint(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """What frozen compiled code must check before running: see `_fingerprint`."""
    return _fingerprint(model)


def _trampoline(model, kwargs):
    return model(**kwargs)


@dataclass
class CompiledForward:
    """`model(**kwargs)` compiled with `settings`; recompiles (on a fresh code object) when the weights changed.

    Attributes:
        compile_seconds: wall time of the calls that compiled (first calls of a new shape class, recompilations).
        compilations: how many calls compiled something.
    """

    model_ref: weakref.ReferenceType
    settings: CompileSettings
    compile_seconds: float = 0.0
    compilations: int = 0
    warmed: set = field(default_factory=set)  # batch shapes warmed up: {True: one row, False: several}
    _function: Callable | None = field(default=None, repr=False)
    _fingerprint: tuple | None = field(default=None, repr=False)

    def _fresh(self, model: torch.nn.Module) -> None:
        code = _trampoline.__code__.replace(co_name=f"hf_specsample_forward_{id(self)}_{self.compilations}")
        function = types.FunctionType(code, _trampoline.__globals__, code.co_name)
        kwargs: dict[str, Any] = {
            key: dict(value) if key == "options" and value else value for key, value in self.settings.compile_kwargs
        }
        self._function = torch.compile(function, **kwargs)
        self._fingerprint = _fingerprint(model) if self.settings.freezes else None
        self.warmed.clear()  # a fresh code object has compiled nothing yet

    def _stale(self, model: torch.nn.Module) -> bool:
        """Whether the next call must compile afresh (nothing compiled yet, or the frozen weights are outdated)."""
        return self._function is None or (self.settings.freezes and _fingerprint(model) != self._fingerprint)

    def __call__(self, **kwargs: Any) -> Any:
        model = self.model_ref()
        assert model is not None, "the compiled model was freed"
        if self._stale(model):
            self._fresh(model)
        assert self._function is not None  # made by `_fresh`
        for value in kwargs.values():  # the cache, under whichever name the model's forward takes it
            static_addresses.mark(value, self.settings.freezes)
        graphs = _captured_graphs()
        start = time.perf_counter()
        with (
            torch._inductor.config.patch(dict(self.settings.inductor_options)),
            _no_duck_shapes(self.symbolic_widths),
            _kernel_mode(self.settings.kernel_rows),
        ):
            out = self._function(model, kwargs)
        if _captured_graphs() != graphs:
            self.compile_seconds += time.perf_counter() - start
            self.compilations += 1
        return out

    @property
    def symbolic_widths(self) -> bool:
        """Whether one compilation serves every query length >= 2 (`dynamic=True`; dynamo specialises length 1,
        so callers pad one-position forwards to two rather than compile, and hold, a second frozen copy)."""
        return dict(self.settings.compile_kwargs).get("dynamic") is True

    def serves(self, rows: int, width: int) -> bool:
        """Whether a forward of `rows` rows over `width` positions runs compiled code at all. With the kernel's
        linears in the graph (`CompileSettings.kernel_rows`), only forwards the kernel serves do (one position is
        fed as two): a wider one (a long prompt, a wide batch) would compile a second graph, with eager GEMMs,
        in the middle of a call, so it runs eagerly instead."""
        kernel_rows = self.settings.kernel_rows
        return not kernel_rows or rows * max(width, 2) <= kernel_rows

    def ready_for(self, rows: int) -> bool:
        """Whether a forward over `rows` rows may run compiled code now without compiling in the middle of a call.

        With symbolic widths, compiled code is used only for the batch shapes warmed up (`warm`) at the start of
        a call: dynamo specialises one row apart from several, and each compiled graph holds its own copy of the
        frozen weights, so a batch that shrinks to one row finishes eagerly. Otherwise compiled code compiles on
        demand, as plain `generate()`'s does (rounds that compiled are left out of the cost estimates).
        """
        return not self.symbolic_widths or (rows == 1) in self.warmed

    def needs_warm_up(self, rows: int) -> bool:
        """Whether `rows` rows need a warm-up forward: not compiled yet, or the weights changed since."""
        model = self.model_ref()
        stale = model is not None and self._stale(model)
        return self.symbolic_widths and (stale or (rows == 1) not in self.warmed)

    def warm(self, rows: int) -> None:
        self.warmed.add(rows == 1)


def _kernel_mode(rows: int):
    """The small-rows kernel's mode for linears of at most `rows` rows (dynamo traces it: the same mode at every
    call, so its guards hold), or nothing where `rows` is 0."""
    return SmallRowsLinear(rows) if rows else contextlib.nullcontext()


def _no_duck_shapes(symbolic: bool):
    """Give every dynamic size its own symbol while compiling (torch's "duck shapes" give equal sizes one symbol).

    With duck shapes, a query length that happens to equal another size of the first compiled call (Qwen2.5-1.5B
    has 2 key/value heads, and the warm-up feeds 2 positions) shares its symbol, and a guard on that other size
    (the static cache's `index_copy_` pins the head count) pins the query length too: the next width recompiles,
    and a second graph freezes a second copy of the weights (6 GB for a 1.5B model).
    """
    if not symbolic:
        return contextlib.nullcontext()
    # torch declares `patch` (added at runtime by `install_config_module`) for inductor's config module, not fx's
    return fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]


def _captured_graphs() -> int:
    """Graphs dynamo has compiled in this process (a private counter; 0 where it is unavailable)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 (only used to attribute time to compilation)
        return 0


def positions_to_keep(width: int, num_logits: int, device: torch.device, compiled: bool) -> int | torch.Tensor:
    """`logits_to_keep` for a forward over `width` positions that returns the last `num_logits` logits.

    Compiled code gets the positions as a tensor of at least two: an int argument is specialised by dynamo (a guard
    on its value, which also pins the query length it equals), and so is a length of 1, so each new value would
    compile, and freeze the weights, again; a longer tensor's length stays symbolic, and one graph serves the prompt
    and every round. The caller keeps the last `num_logits` of the logits returned.
    """
    if not compiled:
        return num_logits
    return torch.arange(width - max(num_logits, 2), width, device=device)  # a length of 1 would be specialised too


def contiguous_attention(cache: Cache) -> None:
    """Every attention layer's keys and values as contiguous tensors (what a forward's concatenation leaves): a
    rollback leaves views of longer tensors and a per-row move other layouts, and dynamo guards on strides, so a
    compiled step would compile again for each. A copy of the cache at most once per round (after a rollback)."""
    for layer in row_ops.attention_layers(cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                setattr(layer, name, tensor.contiguous())


def fresh_input(value):
    """A tensor as a fresh, row-major tensor of its own (anything else as it is).

    Dynamo guards on strides and on a view's base, so an input that is a view, or has the strides of one (a
    `(1, w)` slice of a wider row keeps the row's stride: `.contiguous()` keeps it, since a size-1 dimension is
    contiguous whatever its stride), fed where a fresh tensor was fed before, compiles and freezes the weights
    again. Only such tensors are copied (a few hundred integers).
    """
    if isinstance(value, torch.Tensor) and (value._base is not None or value.stride() != _row_major(value.shape)):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a fresh row-major tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# model -> {settings: CompiledForward}. Weak: freed with the model. Each entry references the model weakly too.
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[CompileSettings, CompiledForward]]" = (
    weakref.WeakKeyDictionary()
)


def compiled_forward(model: PreTrainedModel, settings: CompileSettings) -> CompiledForward:
    """The compiled forward of `model` under `settings`, compiled on first call and kept while the model lives."""
    entries = _COMPILED.setdefault(model, {})
    if settings not in entries:
        entries[settings] = CompiledForward(weakref.ref(model), settings)
    return entries[settings]


def release_compiled(model: PreTrainedModel) -> None:
    """Drop the compiled forwards kept for `model` (and the frozen weight copies they hold)."""
    _COMPILED.pop(model, None)
