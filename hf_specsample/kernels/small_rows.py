"""A linear layer for a few rows on the CPU: verification of K+1 positions at about the cost of one step.

A decoding step streams every weight once and is memory-bound. Verifying K+1 positions streams the weights once
too, but PyTorch's eager bf16 GEMM costs about K+1 steps for K+1 rows on CPUs without native bf16 (measured on an
AVX2-only EPYC: `F.linear` 8960x1536, 1.4 ms for 1 row, 6.7 ms for 5), and on CPUs with it (oneDNN's AVX-512 and
AMX paths) still grows with the rows. `small_rows.cpp` loads each weight element once and multiplies it into every
row. No compilation of the model, no copy of the weights: the kernel reads the model's own weight tensors.

- `load()`: builds the C++ operator once per build key (about 15 s with a C++ compiler; `kernels.build` keeps the
  binary in a folder of the library's cache named by what it depends on, for later processes and other
  environments of the same torch and Python) and registers `torch.ops.hf_specsample.small_rows_linear` (bf16
  weights), `small_rows_linear_int8` (int8 weights, one scale per row: a draft's quantized form) and
  `small_rows_linear_int4`. Returns why it cannot. Called only where a call's plan runs the kernel (a CPU bf16
  model's routing, a quantized form on it), never to find out whether it would.
- `KernelPath`, `paths()`, `best_path()`: the vector paths (AMX, AVX-512 BF16, AVX-512 VNNI, AVX-512F, AVX2+FMA,
  scalar), each built for its own instruction set in one binary; for each weight form the fastest path the CPU
  supports runs (`fastest_path`, a pure function of the offered paths; `offered_paths` from a CPU's flags), and a
  test can run each. `$HF_SPECSAMPLE_KERNEL_PATHS` (names, comma-separated) holds the kernel to those paths, as on
  a lesser CPU.
- `SmallRowsLinear`: a `TorchFunctionMode` that sends every eligible `F.linear` call (CPU, bf16 input and weight,
  at most `max_rows` rows, no autograd) to the kernel while it is active; anything else runs as it would.
- `kernels.routing.KernelRouting` decides, per model, which forwards run in `SmallRowsLinear`.

Exactness: outputs differ from eager ones by rounding only (fp32 accumulation in another order, rounded to bf16),
as compiled or batched logits do. The kernel is batch-invariant: a row's output never depends on the other rows.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..core.cache_folder import CACHE_ENV_VAR, default_cache_dir
from . import build

MAX_ROWS = 16  # rows (batch * positions) of the forwards a round runs, at most; the kernel's design point
# The widest forward (a prompt) the kernel may take, where it also beats eager GEMM at PROMPT_PROBE_ROWS rows: beyond
# a few rows its time grows linearly with the rows (each row block is the same work), so the probe's ratio holds.
PROMPT_ROWS = 1024
PROMPT_PROBE_ROWS = 256
SOURCE = Path(__file__).with_name("small_rows.cpp")
NAME = "hf_specsample_small_rows"  # the library's name (its build folder and file add the build key's digest)
# No -march=native: each vector path is compiled for its own instruction set (target attributes) and the best one the
# CPU supports is chosen at run time, so one binary serves every x86 CPU; other architectures build the scalar path.
# -ffp-contract=off: no fused multiply-adds the compiler chooses per tile shape, so the scalar code's rounding cannot
# depend on how many rows a tile holds (batch invariance).
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
PATHS_ENV_VAR = "HF_SPECSAMPLE_KERNEL_PATHS"  # path names, comma-separated: the kernel runs no other (scalar always)


@dataclass(frozen=True)
class Build:
    """The outcome of making the operator ready in this process.

    Attributes:
        problem: why the operator is unavailable (no compiler, a failed build, not a CPU build), or None.
        seconds: wall time of building it (or waiting for another process's build) and loading it, or of failing.
        compiled: this process compiled it (else it loaded a build an earlier process made).
    """

    problem: str | None
    seconds: float
    compiled: bool = False


_LOADED: list[Build] = []  # the process's one build: the operators are registered process-wide by the dispatcher
_LOADING = threading.Lock()


def load() -> Build:
    """Build (or load the build of an earlier process, `kernels.build`) and register the operators, once a process."""
    with _LOADING:
        if not _LOADED:
            _LOADED.append(_build())
        return _LOADED[0]


def loaded() -> Build | None:
    """The process's build where `load()` ran, else None (builds nothing)."""
    return _LOADED[0] if _LOADED else None


def ready() -> bool:
    """Whether `load()` would cost no build: the operators are loaded in this process, or a whole build of this
    checkout's source for this torch, Python and compiler waits on disk (builds nothing)."""
    if _LOADED:
        return _LOADED[0].problem is None
    return build.is_built(NAME, SOURCE, CFLAGS, LDFLAGS)


def _build() -> Build:
    start = time.perf_counter()
    try:
        built = build.compiled_library(NAME, SOURCE, CFLAGS, LDFLAGS)
    except Exception as error:  # noqa: BLE001 (any build failure means: run eagerly, and say why)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        problem = (
            f"the small-rows kernel could not be built ({type(error).__name__}: {first_line}; it builds under "
            f"{default_cache_dir() / 'kernels'}, which ${CACHE_ENV_VAR} moves)"
        )
        return Build(problem, time.perf_counter() - start)
    _register_fakes()
    return Build(None, built.seconds, built.compiled)


def _register_fakes() -> None:
    """Output shapes of the linear operators for `torch.compile` (`SpeculativeConfig(compile_draft=True)` traces a
    quantized draft's forward through them): `(M, K)` x and `(N, ...)` weights give `(M, N)` in x's dtype."""

    def fake(x: torch.Tensor, weight: torch.Tensor, *rest) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    for name in ("small_rows_linear", "small_rows_linear_int8", "small_rows_linear_int4"):
        torch.library.register_fake(f"hf_specsample::{name}")(fake)


class KernelPath(str, enum.Enum):
    """The kernel's vector paths (`small_rows.cpp`), fastest first for bf16 weights (each form's order: `READS`)."""

    AMX_BF16 = "amx_bf16"  # AMX tiles: 16 weight rows x 32 k's per tile, flat in the rows up to 16 (bf16 weights only)
    AVX512_BF16 = "avx512_bf16"  # vdpbf16ps: two bf16 products per fp32 lane per instruction (bf16 and int4 weights)
    AVX512_VNNI = "avx512_vnni"  # int8 weights: x rounded to int8 per row, exact integer dot products (vpdpbusd)
    AVX512F = "avx512f"  # 16 fp32 lanes, weights widened to fp32
    AVX2_FMA = "avx2_fma"  # 8 fp32 lanes, weights widened to fp32
    SCALAR = "scalar"  # every CPU (other architectures: only this one)

    def __str__(self) -> str:
        return self.value


def paths() -> list[KernelPath]:
    """The paths this CPU runs (and `$HF_SPECSAMPLE_KERNEL_PATHS` allows), fastest first (call `load()` first)."""
    return [KernelPath(torch.ops.hf_specsample.path_name(index)) for index in torch.ops.hf_specsample.paths()]


# The paths that read each weight form, fastest first (as `reads` and the orders in small_rows.cpp): int8 and int4
# weights read fastest on avx512_vnni (two vpdpbusd per 128 products of an int4 group beat avx512_bf16's four table
# lookups and four vdpbf16ps: 224 against 457 us on a Sapphire Rapids Xeon), bf16 ones on the widest bf16 path.
READS = {
    torch.bfloat16: (
        KernelPath.AMX_BF16,
        KernelPath.AVX512_BF16,
        KernelPath.AVX512F,
        KernelPath.AVX2_FMA,
        KernelPath.SCALAR,
    ),
    torch.int8: (KernelPath.AVX512_VNNI, KernelPath.AVX512F, KernelPath.AVX2_FMA, KernelPath.SCALAR),
    torch.uint8: (KernelPath.AVX512_VNNI, KernelPath.AVX512_BF16, KernelPath.SCALAR),  # int4, two to a byte
}
FORMS = (torch.bfloat16, torch.int8, torch.uint8)  # the operator's numbers for the weight forms (`Form`), in order

# The CPU flags (as Linux's /proc/cpuinfo names them) each path needs, as `cpu_supports` in small_rows.cpp asks them.
NEEDS = {
    KernelPath.AVX2_FMA: {"avx2", "fma"},
    KernelPath.AVX512F: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"},
    KernelPath.AVX512_VNNI: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    KernelPath.AVX512_BF16: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    KernelPath.AMX_BF16: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"},
}


def offered_paths(flags: Collection[str], amx_granted: bool = True) -> list[KernelPath]:
    """The paths an x86 CPU with these flags offers, in `KernelPath`'s order (as the operator's `paths()` lists
    them); `amx_granted`: Linux granted the process AMX's tile state (the kernel asks for it)."""
    offered = [path for path in KernelPath if path is KernelPath.SCALAR or NEEDS[path] <= set(flags)]
    return [path for path in offered if amx_granted or path is not KernelPath.AMX_BF16]


def fastest_path(offered: Collection[KernelPath], weights: torch.dtype = torch.bfloat16) -> KernelPath:
    """The path the kernel runs by default for `weights` (torch.bfloat16, torch.int8, or torch.uint8 for packed int4)
    among the `offered` ones: the first of `READS[weights]` offered (scalar reads every form)."""
    return next((path for path in READS[weights] if path in offered), KernelPath.SCALAR)


def best_path(weights: torch.dtype = torch.bfloat16) -> KernelPath:
    """The path the kernel runs here by default for bf16 weights (`small_rows_linear`), int8 ones
    (`small_rows_linear_int8`) or packed int4 ones (torch.uint8, `small_rows_linear_int4`): `fastest_path` among
    `paths()` (call `load()` first)."""
    return fastest_path(paths(), weights)


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
        routing: route only linears whose row count the routing's kernel serves (`KernelRouting.serves`), e.g. plain
            `generate()` with the kernel where it pays, prompt and steps alike (`KernelRouting.everywhere`).

    Raises:
        RuntimeError: the operator cannot be built here (the message says why).
    """

    def __init__(self, max_rows: int | None = MAX_ROWS, routing: Any = None):
        super().__init__()
        problem = load().problem
        if problem is not None:
            raise RuntimeError(f"{problem}; run without SmallRowsLinear (eager F.linear)")
        self.max_rows = None if routing is not None else max_rows
        self.routing = routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            planned = self.routing is None or self.routing.serves(x.numel() // max(1, x.shape[-1]))
            if planned and eligible(x, weight, bias, self.max_rows):
                return small_rows_linear(x, weight, bias)
        return func(*args, **kwargs)
