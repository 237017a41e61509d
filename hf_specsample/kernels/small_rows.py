"""A linear layer for a few rows on the CPU: verification of K+1 positions at about the cost of one step.

A decoding step streams every weight once and is memory-bound. Verifying K+1 positions streams the weights once
too, but PyTorch's eager bf16 GEMM on CPUs without native bf16 (AVX2 only) costs about K+1 steps for K+1 rows
(measured: `F.linear` 8960x1536, 1.4 ms for 1 row, 6.7 ms for 5). `small_rows.cpp` loads each bf16 weight element
once and multiplies it into every row (1.8 ms for 5 rows; a whole Qwen2.5-Coder-1.5B forward over 5 positions 1.30x
an eager one-position step, against 4.1x eager and 1.6x compiled). No compilation of the model, no copy of the
weights: the kernel reads the model's own weight tensors.

- `load()`: builds the C++ operator once per machine (about 12 s with a C++ compiler; torch's extension cache keeps
  the binary for later processes) and registers `torch.ops.hf_specsample.small_rows_linear`. Returns why it cannot,
  or None.
- `SmallRowsLinear`: a `TorchFunctionMode` that sends every eligible `F.linear` call (CPU, bf16 input and weight,
  at most `max_rows` rows, no autograd) to the kernel while it is active; anything else runs as it would.
- `KernelPlan.for_model(model, choice)`: which forwards of `model` the kernel serves (from 1 or 2 rows, up to a
  round's 16 or a prompt's 1024), decided by timing the kernel against eager `F.linear` on one of the model's own
  weights (`LinearKernel.AUTO`), kept per model (weakly) for later calls. On CPUs where eager bf16 GEMM is emulated
  the kernel also encodes prompts faster (127 tokens of Qwen2.5-Coder-1.5B: see the README).

Exactness: outputs differ from eager ones by rounding only (fp32 accumulation in another order, rounded to bf16),
as compiled or batched logits do. The kernel is batch-invariant: a row's output never depends on the other rows.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..options import LinearKernel

MAX_ROWS = 16  # rows (batch * positions) of the forwards a round runs, at most; the kernel's design point
# The widest forward (a prompt) the kernel may take, where it also beats eager GEMM at PROMPT_PROBE_ROWS rows: beyond
# a few rows its time grows linearly with the rows (each row block is the same work), so the probe's ratio holds.
PROMPT_ROWS = 1024
PROMPT_PROBE_ROWS = 256
PROBE_ROWS = 5  # the round width the AUTO probe compares at, besides 1 (a K=4 round)
SOURCE = Path(__file__).with_name("small_rows.cpp")


@dataclass(frozen=True)
class Build:
    """The outcome of building the operator in this process.

    Attributes:
        problem: why the operator is unavailable (no compiler, a failed build, not a CPU build), or None.
        seconds: wall time of the build or of loading the cached binary.
    """

    problem: str | None
    seconds: float


@functools.cache  # one build per process: the operator is registered process-wide by torch's dispatcher
def load() -> Build:
    """Build (or load from torch's extension cache) and register `torch.ops.hf_specsample.small_rows_linear`."""
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load as load_extension

        # -march=native: the binary is for this CPU; the name carries the CPU capability so that a cache directory
        # shared by machines of different capability never hands one machine another's binary.
        capability = torch.backends.cpu.get_cpu_capability().lower()
        load_extension(
            f"hf_specsample_small_rows_{capability}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 (any build failure means: run eagerly, and say why)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Build(f"the small-rows kernel could not be built ({type(error).__name__}: {first_line})", 0.0)
    return Build(None, time.perf_counter() - start)


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel (call `load()` first).

    Args:
        x: `(..., K)` bf16 on the CPU; any number of rows once flattened (it is built for a few).
        weight: `(N, K)` contiguous bf16.
        bias: `(N,)` or None.

    Returns:
        `(..., N)` in x's dtype.
    """
    out = torch.ops.hf_specsample.small_rows_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None = MAX_ROWS) -> bool:
    """Whether `F.linear(x, weight, bias)` may go to the kernel: plain CPU bf16 tensors, at most `max_rows` rows
    (None: any), no autograd of any kind (the operator has no derivative: reverse mode with a tensor that requires
    grad, forward-mode dual levels and torch.func transforms all stay with eager `F.linear`)."""
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)  # not a quantized or distributed tensor subclass
        and type(x) is torch.Tensor
        and weight.dtype == torch.bfloat16
        and x.dtype == torch.bfloat16
        and weight.dim() == 2
        and x.dim() >= 1
        and weight.device.type == "cpu"
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and (max_rows is None or x.numel() <= max_rows * weight.shape[1])
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (type(bias) in (torch.Tensor, torch.nn.Parameter) and bias.dtype == torch.bfloat16))
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
        and forward_ad._current_level < 0  # no forward-mode dual level is open
        and torch._C._functorch.maybe_current_level() is None  # no vmap / jvp / grad transform is active
    )


class SmallRowsLinear(TorchFunctionMode):
    """While active (`with SmallRowsLinear(): model(...)`), eligible `F.linear` calls run on the kernel.

    A torch-function mode is per thread and changes nothing in the model: other threads, and every call outside
    the `with`, run as before. Builds (or loads) the operator on first use.

    Args:
        max_rows: route linears of at most this many rows (None: any number, e.g. to compute a reference
            distribution the way the kernel computes it).

    Raises:
        RuntimeError: the operator cannot be built here (the message says why).
    """

    def __init__(self, max_rows: int | None = MAX_ROWS):
        super().__init__()
        problem = load().problem
        if problem is not None:
            raise RuntimeError(f"{problem}; run without SmallRowsLinear (eager F.linear)")
        self.max_rows = max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if eligible(x, weight, bias, self.max_rows):
                return small_rows_linear(x, weight, bias)
        return func(*args, **kwargs)


def _largest_weight(model: torch.nn.Module) -> torch.Tensor | None:
    weights = [
        module.weight
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and type(module.weight) is torch.nn.Parameter
    ]
    return max(weights, key=lambda weight: weight.numel(), default=None)


def _median_ms(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@dataclass(frozen=True)
class KernelPlan:
    """Which forwards of a model the kernel serves: those of `from_rows` to `max_rows` rows (batch * positions).

    Attributes:
        from_rows: the narrowest forward that runs with `SmallRowsLinear`; None: none does.
        max_rows: the widest (`MAX_ROWS`, a round; `PROMPT_ROWS` where the kernel also wins at a prompt's width).
            Wider forwards (long prompts) run eagerly.
        reason: what decided it, for `SpeculativeStats.linear_kernel` (the timings, or why the kernel is off; the
            build time where this call built the operator).
    """

    from_rows: int | None
    reason: str
    max_rows: int = MAX_ROWS

    def applied(self, rows: int):
        """The context a forward over `rows` rows (batch * positions) runs in."""
        if self.from_rows is not None and self.from_rows <= rows <= self.max_rows:
            return SmallRowsLinear(self.max_rows)
        return contextlib.nullcontext()

    @classmethod
    def off(cls, reason: str) -> "KernelPlan":
        return cls(None, reason)

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, choice: LinearKernel, clock_free: bool = False, role: str = "model"
    ) -> "KernelPlan":
        """The plan for `model` under `choice` (AUTO's timing is done once per model and weight set).

        Args:
            clock_free: the output must not depend on the clock (a seeded call): AUTO then decides without timing,
                using the kernel wherever its vector path was built (AVX2 and FMA), since a timing that flips
                between processes would change the logits' rounding and so a seeded sample.
            role: what the model is to the call ("target", "draft"), for messages.

        Raises:
            ValueError: `LinearKernel.ON` where the kernel cannot serve the model (not a CPU bf16 model, or the
                operator cannot be built here).
        """
        if choice is LinearKernel.OFF:
            return cls.off("off (linear_kernel='off')")
        weight = _largest_weight(model)
        problem = _model_problem(weight, role)
        built_now = load.cache_info().currsize == 0
        build = load() if problem is None else Build(None, 0.0)
        problem = problem or build.problem
        if problem is not None:
            if choice is LinearKernel.ON:
                raise ValueError(
                    f"linear_kernel='on' cannot be honoured: {problem}. Use linear_kernel='auto' (the kernel where it "
                    "runs and pays, eager elsewhere) or 'off'."
                )
            return cls.off(f"off: {problem}")
        built = f"; operator built or loaded in {build.seconds:.1f} s" if built_now else ""
        if choice is LinearKernel.ON:
            return cls(1, f"on for 1-{MAX_ROWS} rows (linear_kernel='on'){built}")
        if clock_free:
            if torch.ops.hf_specsample.vectorized():
                return cls(1, f"on for 1-{MAX_ROWS} rows: a seeded call decides without the clock (AVX2 kernel){built}")
            return cls.off(f"off: a seeded call decides without the clock (no AVX2 kernel here){built}")
        key = (weight.data_ptr(), weight._version if not weight.is_inference() else -1, torch.get_num_threads())
        plans = _PLANS.setdefault(model, {})
        if key not in plans:
            plans[key] = _timed_plan(weight)
        plan = plans[key]
        return cls(plan.from_rows, plan.reason + built, plan.max_rows)


def _model_problem(weight: torch.Tensor | None, role: str) -> str | None:
    if weight is None:
        return f"the {role} has no plain nn.Linear weights"
    if weight.device.type != "cpu":
        return f"the {role}'s weights are on {weight.device.type}, the kernel runs on the CPU"
    if weight.dtype != torch.bfloat16:
        return f"the {role}'s weights are {weight.dtype}, the kernel reads bf16"
    return None


@torch.no_grad()
def _timed_plan(weight: torch.Tensor) -> KernelPlan:
    """Time the kernel against eager `F.linear` on the first rows of `weight`: 1 and `PROBE_ROWS` rows (a step and
    a round) on 4096 weight rows, `PROMPT_PROBE_ROWS` rows (a prompt) on 1024 (about 0.1-0.5 s in all)."""
    generator = torch.Generator().manual_seed(0)
    timings = {}
    for rows, part, repeats in ((1, 4096, 5), (PROBE_ROWS, 4096, 5), (PROMPT_PROBE_ROWS, 1024, 3)):
        part = weight[:part]
        x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        eager, kernel = functools.partial(F.linear, x, part), functools.partial(small_rows_linear, x, part)
        timings[rows] = (_median_ms(eager, repeats), _median_ms(kernel, repeats))
    shown = ", ".join(f"{rows} rows eager {e:.2f} ms, kernel {k:.2f} ms" for rows, (e, k) in timings.items())
    shown = f"timed on the model's largest weight ({tuple(weight.shape)}): {shown}"
    wins = {rows: kernel < eager for rows, (eager, kernel) in timings.items()}
    if not wins[PROBE_ROWS]:
        return KernelPlan.off(f"off: eager is faster here ({shown})")
    from_rows = 1 if wins[1] else 2
    max_rows = PROMPT_ROWS if wins[PROMPT_PROBE_ROWS] else MAX_ROWS
    return KernelPlan(from_rows, f"on for {from_rows}-{max_rows} rows ({shown})", max_rows)


# model -> {(largest weight's storage, version, threads): timed plan}. Weak: dropped with the model.
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, KernelPlan]]" = weakref.WeakKeyDictionary()
