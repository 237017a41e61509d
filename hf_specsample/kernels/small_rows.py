"""A linear layer for a few rows on the CPU: verification of K+1 positions at about the cost of one step.

A decoding step streams every weight once and is memory-bound. Verifying K+1 positions streams the weights once
too, but PyTorch's eager bf16 GEMM costs about K+1 steps for K+1 rows on CPUs without native bf16 (measured on an
AVX2-only EPYC: `F.linear` 8960x1536, 1.4 ms for 1 row, 6.7 ms for 5), and on CPUs with it (oneDNN's AVX-512 and
AMX paths) still grows with the rows. `small_rows.cpp` loads each weight element once and multiplies it into every
row. No compilation of the model, no copy of the weights: the kernel reads the model's own weight tensors.

- `load()`: builds the C++ operator once per machine (about 15 s with a C++ compiler; torch's extension cache keeps
  the binary for later processes) and registers `torch.ops.hf_specsample.small_rows_linear` (bf16 weights) and
  `small_rows_linear_int8` (int8 weights, one scale per row: a draft's compact form). Returns why it cannot.
- `KernelPath`, `paths()`, `best_path()`: the vector paths (AMX, AVX-512 BF16, AVX-512F, AVX2+FMA, scalar), each built
  for its own instruction set in one binary; the best one the CPU supports runs (a test can run each).
- `SmallRowsLinear`: a `TorchFunctionMode` that sends every eligible `F.linear` call (CPU, bf16 input and weight,
  at most `max_rows` rows, no autograd) to the kernel while it is active; anything else runs as it would.
- `KernelPlan.for_model(model, choice)`: which forward widths of `model` the kernel serves, after checking it
  against eager `F.linear` on the model's own largest weight (a disagreement turns it off, with a message): under
  `LinearKernel.AUTO`, each round width 1..16 (and a prompt's) where a timing on that weight finds it faster,
  kept per model (weakly) for later calls.

Exactness: outputs differ from eager ones by rounding only (fp32 accumulation in another order, rounded to bf16),
as compiled or batched logits do. The kernel is batch-invariant: a row's output never depends on the other rows.
"""

from __future__ import annotations

import contextlib
import enum
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

        # No -march=native: each vector path is compiled for its own instruction set (target attributes) and the
        # best one the CPU supports is chosen at run time, so one binary serves every x86 CPU (and a cache directory
        # shared by machines of different capability is safe); other architectures build the scalar path.
        load_extension(
            "hf_specsample_small_rows",
            sources=[str(SOURCE)],
            # -ffp-contract=off: no fused multiply-adds the compiler chooses per tile shape, so the scalar code's
            # rounding cannot depend on how many rows a tile holds (batch invariance)
            extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 (any build failure means: run eagerly, and say why)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Build(f"the small-rows kernel could not be built ({type(error).__name__}: {first_line})", 0.0)
    _register_fakes()
    return Build(None, time.perf_counter() - start)


def _register_fakes() -> None:
    """Output shapes of the linear operators for `torch.compile` (`SpeculativeConfig(compile_draft=True)` traces a
    compact draft's forward through them): `(M, K)` x and `(N, ...)` weights give `(M, N)` in x's dtype."""

    def fake(x: torch.Tensor, weight: torch.Tensor, *rest) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    for name in ("small_rows_linear", "small_rows_linear_int8", "small_rows_linear_int4"):
        torch.library.register_fake(f"hf_specsample::{name}")(fake)


class KernelPath(str, enum.Enum):
    """The kernel's vector paths (`small_rows.cpp`), fastest first; the best one the CPU supports runs."""

    AMX_BF16 = "amx_bf16"  # AMX tiles: 16 weight rows x 32 k's per tile, flat in the rows up to 16 (bf16 weights only)
    AVX512_BF16 = "avx512_bf16"  # vdpbf16ps: two bf16 products per fp32 lane per instruction (bf16 and int4 weights)
    AVX512_VNNI = "avx512_vnni"  # int8 weights: x rounded to int8 per row, exact integer dot products (vpdpbusd)
    AVX512F = "avx512f"  # 16 fp32 lanes, weights widened to fp32
    AVX2_FMA = "avx2_fma"  # 8 fp32 lanes, weights widened to fp32
    SCALAR = "scalar"  # every CPU (other architectures: only this one)

    def __str__(self) -> str:
        return self.value


def paths() -> list[KernelPath]:
    """The paths this CPU runs, fastest first (call `load()` first)."""
    return [KernelPath(torch.ops.hf_specsample.path_name(index)) for index in torch.ops.hf_specsample.paths()]


# The paths that read each weight form (as `reads` in small_rows.cpp).
READS = {
    torch.bfloat16: (KernelPath.AMX_BF16, KernelPath.AVX512_BF16, KernelPath.AVX512F, KernelPath.AVX2_FMA,
                     KernelPath.SCALAR),
    torch.int8: (KernelPath.AVX512_VNNI, KernelPath.AVX512F, KernelPath.AVX2_FMA, KernelPath.SCALAR),
    torch.uint8: (KernelPath.AVX512_VNNI, KernelPath.AVX512_BF16, KernelPath.SCALAR),  # int4, two to a byte
}  # fmt: skip


def best_path(weights: torch.dtype = torch.bfloat16) -> KernelPath:
    """The path the kernel runs here by default for bf16 weights (`small_rows_linear`), int8 ones
    (`small_rows_linear_int8`) or packed int4 ones (torch.uint8, `small_rows_linear_int4`): the first path of
    `READS[weights]` (each form's order, fastest first) that this CPU runs."""
    here = paths()
    return next(path for path in READS[weights] if path in here)


def _path_index(path: KernelPath | None) -> int:
    """The operator's number for `path` (-1: the best one), as the operator names its paths."""
    if path is None:
        return -1
    names = [torch.ops.hf_specsample.path_name(index) for index in range(len(KernelPath))]
    return names.index(str(KernelPath(path)))


def small_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, path: KernelPath | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel (call `load()` first).

    Args:
        x: `(..., K)` on the CPU (bf16 in the loop); any number of rows once flattened (it is built for a few).
        weight: `(N, K)` contiguous bf16.
        bias: `(N,)` or None.
        path: a vector path this CPU runs (tests); None: the best one.

    Returns:
        `(..., N)` in x's dtype.
    """
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.hf_specsample.small_rows_linear(flat, weight, bias, _path_index(path))
    return out.view(*x.shape[:-1], weight.shape[0])


def small_rows_linear_int8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    path: KernelPath | None = None,
    row_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight * scale[:, None], bias)` for int8 weights with one fp32 scale per row, by the kernel.

    On the AVX512_VNNI path each row of x is rounded to int8 first (its own scale): the result is then that of the
    rounded x (within 1/254 of each row's largest value), as torch's dynamic int8 computes.

    Args:
        x: `(..., K)` on the CPU.
        weight: `(N, K)` contiguous int8.
        scale: `(N,)` contiguous fp32.
        bias: `(N,)` or None.
        path: a path of `READS[torch.int8]` this CPU runs (tests); None: the best one.
        row_sums: `(N,)` int32, `weight.sum(1)` (the VNNI path needs it: pass it to avoid reading the weight twice).

    Returns:
        `(..., N)` in x's dtype.
    """
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.hf_specsample.small_rows_linear_int8(flat, weight, scale, bias, _path_index(path), row_sums)
    return out.view(*x.shape[:-1], weight.shape[0])


def small_rows_linear_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    path: KernelPath | None = None,
    corrections: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear` for int4 weights packed by `pack_int4`, with one fp32 scale per row and group of `group` k's.

    On the AVX512_VNNI path (groups of 128) each row of x is rounded to int8 first, as in `small_rows_linear_int8`.

    Args:
        x: `(..., K)` on the CPU.
        packed: `(N, K // 2)` uint8 (`pack_int4`).
        scale: `(N, K // group)` fp32.
        group: k's per scale, a multiple of 64 dividing K.
        bias: `(N,)` or None.
        path: a path of `READS[torch.uint8]` (tests), None: the best this CPU runs.
        corrections: `(N,)` fp32, `int4_corrections(packed, scale)` (the VNNI path needs it: pass it to avoid
            reading the weight twice).

    Returns:
        `(..., N)` in x's dtype.
    """
    flat = x.reshape(-1, x.shape[-1])
    index = _path_index(path)
    out = torch.ops.hf_specsample.small_rows_linear_int4(flat, packed, scale, group, bias, index, corrections)
    return out.view(*x.shape[:-1], packed.shape[0])


def int4_corrections(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`(N,)` fp32: what the AVX512_VNNI path subtracts for x's unsigned offset (groups of 128; see small_rows.cpp)."""
    return torch.ops.hf_specsample.int4_corrections(packed, scale.float().contiguous())


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """`(N, K)` int values in -8..7 (K a multiple of 64) -> `(N, K // 2)` uint8 in the kernel's layout: in each
    chunk of 64 k's, byte j holds k = j in its low nibble and k = 32 + j in its high one, each as value + 8."""
    rows, columns = values.shape
    assert columns % 64 == 0, "int4 rows are packed in chunks of 64"
    chunks = (values.to(torch.int16) + 8).to(torch.uint8).view(rows, columns // 64, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(rows, columns // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: `(N, K // 2)` uint8 -> `(N, K)` int8 values in -8..7."""
    rows, half = packed.shape
    chunks = packed.view(rows, half // 32, 1, 32)
    values = torch.cat([chunks & 15, chunks >> 4], dim=2).to(torch.int8) - 8
    return values.reshape(rows, half * 2)


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
        plan: route only linears whose row count the plan's kernel serves (`KernelPlan.serves`), e.g. plain
            `generate()` with the kernel where it pays, prompt and steps alike (`KernelPlan.everywhere`).

    Raises:
        RuntimeError: the operator cannot be built here (the message says why).
    """

    def __init__(self, max_rows: int | None = MAX_ROWS, plan: "KernelPlan | None" = None):
        super().__init__()
        problem = load().problem
        if problem is not None:
            raise RuntimeError(f"{problem}; run without SmallRowsLinear (eager F.linear)")
        self.max_rows = None if plan is not None else max_rows
        self.plan = plan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            planned = self.plan is None or self.plan.serves(x.numel() // max(1, x.shape[-1]))
            if planned and eligible(x, weight, bias, self.max_rows):
                return small_rows_linear(x, weight, bias)
        return func(*args, **kwargs)


def _largest_weight(model: torch.nn.Module) -> torch.Tensor | None:
    weights = [
        module.weight
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and type(module.weight) is torch.nn.Parameter
    ]
    return max(weights, key=lambda weight: weight.numel(), default=None)


@dataclass(frozen=True)
class KernelPlan:
    """Which forwards of a model the kernel serves, by their rows (batch * positions).

    Attributes:
        widths: the forward widths (rows) of at most `MAX_ROWS` that run with `SmallRowsLinear`, each decided on its
            own (AUTO times every width on the model's own weights: a wide round may lose where a narrow one wins).
        reason: what decided it, for `SpeculativeStats.linear_kernel` (the path, the timings, or why the kernel is
            off; the build time where this call built the operator).
        prompt_rows: forwards wider than `MAX_ROWS` (prompts) run on the kernel up to this many rows, where it also
            won at `PROMPT_PROBE_ROWS` rows; 0: they run eagerly.
    """

    widths: frozenset[int]
    reason: str
    prompt_rows: int = 0

    def serves(self, rows: int) -> bool:
        """Whether a forward (or a linear) over `rows` rows (batch * positions) runs on the kernel."""
        return rows in self.widths or MAX_ROWS < rows <= self.prompt_rows

    def applied(self, rows: int):
        """The context a forward over `rows` rows (batch * positions) runs in."""
        return SmallRowsLinear(max(rows, MAX_ROWS)) if self.serves(rows) else contextlib.nullcontext()

    def everywhere(self):
        """A context in which every linear runs as this plan says by its own row count: plain `generate()` with
        the kernel where it pays (its prompt and its steps), to tell the kernel's share from speculation's."""
        return SmallRowsLinear(plan=self) if self.is_on else contextlib.nullcontext()

    @property
    def is_on(self) -> bool:
        return bool(self.widths) or self.prompt_rows > 0

    @classmethod
    def off(cls, reason: str) -> "KernelPlan":
        return cls(frozenset(), reason)

    @classmethod
    def every_round(cls, reason: str) -> "KernelPlan":
        return cls(ALL_WIDTHS, reason)

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, choice: LinearKernel, clock_free: bool = False, role: str = "model"
    ) -> "KernelPlan":
        """The plan for `model` under `choice` (AUTO's timing and the check are done once per model and weight set).

        Before the kernel serves a model, its output is checked against eager `F.linear` on the model's own largest
        weight (`_check_against_eager`): a path that disagrees beyond bf16 rounding (a CPU no session tested, a
        compiler's miscompilation) turns the kernel off for the model, with a message, so it can never become a
        wrong sample.

        Args:
            clock_free: the output must not depend on the clock (a seeded call): AUTO then decides without timing,
                using the kernel for every round width wherever a vector path runs, since a timing that flips
                between processes would change the logits' rounding and so a seeded sample.
            role: what the model is to the call ("target", "draft"), for messages. `LinearKernel.ON` is refused
                only for the target: a draft whose form has no bf16 `nn.Linear` (an int8 copy) runs without it.

        Raises:
            ValueError: `LinearKernel.ON` where the kernel cannot serve the target (not a CPU bf16 model, the
                operator cannot be built here, or it disagrees with eager `F.linear`).
        """
        if choice is LinearKernel.OFF:
            return cls.off("off (linear_kernel='off')")
        weight = _largest_weight(model)
        problem = _model_problem(weight, role)
        built_now = load.cache_info().currsize == 0
        build = load() if problem is None else Build(None, 0.0)
        problem = problem or build.problem
        built = f"; operator built or loaded in {build.seconds:.1f} s" if built_now and problem is None else ""
        if problem is None:
            key = (weight.data_ptr(), weight._version if not weight.is_inference() else -1, torch.get_num_threads())
            checks = _CHECKS.setdefault(model, {})
            if key not in checks:
                checks[key] = _check_against_eager(weight)
            problem = checks[key]
        if problem is not None:
            if choice is LinearKernel.ON and role != "draft":
                raise ValueError(
                    f"linear_kernel='on' cannot be honoured: {problem}. Use linear_kernel='auto' (the kernel where it "
                    "runs and pays, eager elsewhere) or 'off'."
                )
            return cls.off(f"off: {problem}")
        path = best_path()
        if choice is LinearKernel.ON:
            return cls.every_round(f"on for 1-{MAX_ROWS} rows, {path} path (linear_kernel='on'){built}")
        if clock_free:
            if path is KernelPath.SCALAR:
                return cls.off(f"off: a seeded call decides without the clock (no vector path here){built}")
            return cls.every_round(f"on for 1-{MAX_ROWS} rows, {path} path: a seeded call decides without the clock"
                                   f"{built}")  # fmt: skip
        plans = _PLANS.setdefault(model, {})
        if key not in plans:
            plans[key] = _timed_plan(weight)
        plan = plans[key]
        return cls(plan.widths, plan.reason + built, plan.prompt_rows)


ALL_WIDTHS = frozenset(range(1, MAX_ROWS + 1))


def _model_problem(weight: torch.Tensor | None, role: str) -> str | None:
    if weight is None:
        return f"the {role} has no plain bf16 nn.Linear weights"
    if weight.device.type != "cpu":
        return f"the {role}'s weights are on {weight.device.type}, the kernel runs on the CPU"
    if weight.dtype != torch.bfloat16:
        return f"the {role}'s weights are {weight.dtype}, the kernel reads bf16"
    return None


CHECK_ROWS = (1, 5, MAX_ROWS)  # rows the check compares at (every tile shape of the kernel is among them)
CHECK_WEIGHT_ROWS = 256  # weight rows it compares on (the first ones of the model's largest weight)


@torch.no_grad()
def _check_against_eager(weight: torch.Tensor) -> str | None:
    """None where the kernel agrees with eager `F.linear` on `weight`'s first rows within bf16 rounding; else why not.

    Both round the output to bf16 (2^-8 relative) after fp32 sums in different orders, so they may differ by about
    2^-7 of the sum of absolute products; a wrong kernel (a scale off, a lane dropped) differs by far more.
    """
    generator = torch.Generator().manual_seed(0)
    part = weight[:CHECK_WEIGHT_ROWS]
    for rows in CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        got, expected = small_rows_linear(x, part).float(), F.linear(x, part).float()
        scale = x.float().abs() @ part.float().abs().T
        error = float(((got - expected).abs() / (scale + 1e-30)).max())
        if not error <= 2**-6:
            return (
                f"the kernel's {best_path()} path disagrees with eager F.linear on the model's own weights "
                f"(relative error {error:.2g} at {rows} rows; bf16 rounding allows 2^-6): please report this CPU"
            )
    return None


# Timed calls per width and method (after one warm-up call each), medians compared. With 3 a width whose costs are
# within a few percent (the AMX path at 11 rows of Qwen2.5's head: 0.69 against 0.71 ms) fell to either side by noise,
# leaving holes in the plan between widths the kernel won; 7 cost 0.1 s more per model.
TIMED_REPEATS = 7
PROBE_WEIGHT_ROWS = 4096  # weight rows per timed call (12.6 MB of Qwen2.5's head); calls step through the weight


@torch.no_grad()
def _timed_plan(weight: torch.Tensor) -> KernelPlan:
    """Time the kernel against eager `F.linear` on `weight` at every round width 1..`MAX_ROWS` and at a prompt's
    `PROMPT_PROBE_ROWS` rows; the kernel serves the widths where it is faster (about 0.3-0.6 s in all).

    Each timed call reads the next `PROBE_WEIGHT_ROWS` rows of the weight (wrapping around), so that a large weight
    is read from memory as a forward reads it, not from cache; eager and kernel calls alternate.
    """
    generator = torch.Generator().manual_seed(0)
    slices = [weight[start : start + PROBE_WEIGHT_ROWS] for start in range(0, weight.shape[0], PROBE_WEIGHT_ROWS)]
    slices = [part for part in slices if part.shape[0] == slices[0].shape[0]]
    turn = iter(range(10**9))

    def next_part():
        return slices[next(turn) % len(slices)]

    # Warm-up: every slice once by each method. The first touch of a weight loaded from a memory-mapped file pages it
    # in, and a path's first call pays one-time costs (threads waking, AMX's tile state): timed, they made the first
    # widths look several times slower for both methods and decided them by noise.
    warm = torch.randn(1, weight.shape[1], generator=generator).to(torch.bfloat16)
    for part in slices:
        F.linear(warm, part)
        small_rows_linear(warm, part)
    timings = {}
    for rows in (*range(1, MAX_ROWS + 1), PROMPT_PROBE_ROWS):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        part = slices[0][:1024] if rows == PROMPT_PROBE_ROWS else None  # a prompt's width is compute-bound
        eager, kernel = [], []
        for repeat in range(TIMED_REPEATS + 1):
            for method, times in ((F.linear, eager), (small_rows_linear, kernel)):
                chosen = part if part is not None else next_part()
                start = time.perf_counter()
                method(x, chosen)
                if repeat:  # the first call of each warms up
                    times.append(time.perf_counter() - start)
        timings[rows] = (1e3 * statistics.median(eager), 1e3 * statistics.median(kernel))
    widths = frozenset(rows for rows, (eager, kernel) in timings.items() if rows <= MAX_ROWS and kernel < eager)
    prompt_rows = PROMPT_ROWS if timings[PROMPT_PROBE_ROWS][1] < timings[PROMPT_PROBE_ROWS][0] else 0
    shown = ", ".join(f"{rows}: {eager:.2f}/{kernel:.2f}" for rows, (eager, kernel) in timings.items())
    shown = (
        f"{best_path()} path, timed on the model's largest weight {tuple(weight.shape)}, ms eager/kernel by rows: "
        f"{shown}"
    )
    if not widths and not prompt_rows:
        return KernelPlan.off(f"off: eager is faster at every width here ({shown})")
    return KernelPlan(widths, f"on for {_ranges(widths)} rows{' and prompts' if prompt_rows else ''} ({shown})",
                      prompt_rows)  # fmt: skip


def _ranges(widths: frozenset[int]) -> str:
    """`{1, 2, 3, 5, 7, 8}` -> "1-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for width in sorted(widths):
        if runs and runs[-1][-1] == width - 1:
            runs[-1].append(width)
        else:
            runs.append([width])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs) or "no"


# model -> {(largest weight's storage, version, threads): timed plan / check}. Weak: dropped with the model.
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, KernelPlan]]" = weakref.WeakKeyDictionary()
_CHECKS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, str | None]]" = weakref.WeakKeyDictionary()
