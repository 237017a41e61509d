"""Which forwards of a model the small-rows kernel serves (`KernelRouting`), decided once per model and machine.

`KernelRouting.for_model(facts, choice)`: the kernel is first checked against eager `F.linear` on the model's own
largest weight (a disagreement turns it off, with a message); under `LinearKernel.AUTO` each forward of 1 to
`MAX_ROWS` kernel rows (and a prompt's) runs on it where a timing on that weight finds it faster. Both are kept per
model (weakly) and per weight version and thread count, for later calls.

Glossary: **kernel rows** are the rows a linear layer sees in a forward, batch rows times positions.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.model_facts import ModelFacts, Role
from ..options import LinearKernel
from . import small_rows  # through the module: its build and paths are what tests stand in for
from .small_rows import MAX_ROWS, PROMPT_PROBE_ROWS, PROMPT_ROWS, KernelPath, SmallRowsLinear


@dataclass(frozen=True)
class KernelRouting:
    """Which forwards of a model the kernel serves, by their rows (batch * positions).

    Attributes:
        rows: the kernel rows (batch * positions) of at most `MAX_ROWS` at which forwards run with `SmallRowsLinear`,
            each decided on its own (AUTO times every count on the model's own weights: a wide round may lose where a
            narrow one wins).
        reason: what decided it, for `SpeculativeStats.linear_kernel` (the path, the timings, or why the kernel is
            off; the build time where this call built the operator).
        prompt_rows: forwards wider than `MAX_ROWS` (prompts) run on the kernel up to this many rows, where it also
            won at `PROMPT_PROBE_ROWS` rows; 0: they run eagerly.
    """

    rows: frozenset[int]
    reason: str
    prompt_rows: int = 0

    def serves(self, rows: int) -> bool:
        """Whether a forward (or a linear) over `rows` rows (batch * positions) runs on the kernel."""
        return rows in self.rows or MAX_ROWS < rows <= self.prompt_rows

    def applied(self, rows: int):
        """The context a forward over `rows` rows (batch * positions) runs in."""
        return SmallRowsLinear(max(rows, MAX_ROWS)) if self.serves(rows) else contextlib.nullcontext()

    def everywhere(self):
        """A context in which every linear runs as this routing says by its own row count: plain `generate()` with
        the kernel where it pays (its prompt and its steps), to tell the kernel's share from speculation's."""
        return SmallRowsLinear(routing=self) if self.is_on else contextlib.nullcontext()

    @property
    def is_on(self) -> bool:
        return bool(self.rows) or self.prompt_rows > 0

    @classmethod
    def off(cls, reason: str) -> "KernelRouting":
        return cls(frozenset(), reason)

    @classmethod
    def every_round(cls, reason: str) -> "KernelRouting":
        return cls(ALL_ROWS, reason)

    @classmethod
    def for_model(
        cls, facts: ModelFacts, choice: LinearKernel, clock_free: bool = False, role: Role = Role.TARGET
    ) -> "KernelRouting":
        """The routing for the model of `facts` under `choice` (AUTO's timing and the check are done once per model and
        weight set).

        Before the kernel serves a model, its output is checked against eager `F.linear` on the model's own largest
        weight (`_check_against_eager`): a path that disagrees beyond bf16 rounding (a CPU no session tested, a
        compiler's miscompilation) turns the kernel off for the model, with a message, so it can never become a
        wrong sample.

        Args:
            clock_free: the output must not depend on the clock (a seeded call): AUTO then decides without timing,
                using the kernel for every row count wherever a vector path runs, since a timing that flips
                between processes would change the logits' rounding and so a seeded sample.
            role: what the model is to the call, for messages. `LinearKernel.ON` is refused only for the target: a
                draft whose form has no bf16 `nn.Linear` (an int8 copy) runs without it.

        Raises:
            ValueError: `LinearKernel.ON` where the kernel cannot serve the target (not a CPU bf16 model, the
                operator cannot be built here, or it disagrees with eager `F.linear`).
        """
        if choice is LinearKernel.OFF:
            return cls.off("off (linear_kernel='off')")
        model, weight = facts.model, facts.largest_linear
        problem = _model_problem(weight, role)
        built_now = small_rows.loaded() is None
        build = small_rows.load() if problem is None else small_rows.Build(None, 0.0)
        problem = problem or build.problem
        made = "compiled" if build.compiled else "loaded"
        built = f"; operator {made} in {build.seconds:.1f} s" if built_now and problem is None else ""
        if problem is None:
            assert weight is not None  # `_model_problem` refuses a model without one
            key = (weight.data_ptr(), weight._version if not weight.is_inference() else -1, torch.get_num_threads())
            checks = _CHECKS.setdefault(model, {})
            if key not in checks:
                checks[key] = _check_against_eager(weight)
            problem = checks[key]
        if problem is not None:
            if choice is LinearKernel.ON and role is not Role.DRAFT:
                raise ValueError(
                    f"linear_kernel='on' cannot be honoured: {problem}. Use linear_kernel='auto' (the kernel where it "
                    "runs and pays, eager elsewhere) or 'off'."
                )
            return cls.off(f"off: {problem}")
        assert weight is not None  # `_model_problem` refuses a model without one
        path = small_rows.best_path()
        if choice is LinearKernel.ON:
            return cls.every_round(f"on for 1-{MAX_ROWS} rows, {path} path (linear_kernel='on'){built}")
        if clock_free:
            if path is KernelPath.SCALAR:
                return cls.off(f"off: a seeded call decides without the clock (no vector path here){built}")
            return cls.every_round(
                f"on for 1-{MAX_ROWS} rows, {path} path: a seeded call decides without the clock{built}"
            )
        routings = _ROUTINGS.setdefault(model, {})
        if key not in routings:
            routings[key] = _timed_routing(weight)
        routing = routings[key]
        return cls(routing.rows, routing.reason + built, routing.prompt_rows)


ALL_ROWS = frozenset(range(1, MAX_ROWS + 1))


def _model_problem(weight: torch.Tensor | None, role: Role) -> str | None:
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
        got, expected = small_rows.small_rows_linear(x, part).float(), F.linear(x, part).float()
        scale = x.float().abs() @ part.float().abs().T
        error = float(((got - expected).abs() / (scale + 1e-30)).max())
        if not error <= 2**-6:
            return (
                f"the kernel's {small_rows.best_path()} path disagrees with eager F.linear on the model's own weights "
                f"(relative error {error:.2g} at {rows} rows; bf16 rounding allows 2^-6): please report this CPU"
            )
    return None


# Timed calls per row count and method (after one warm-up call each), medians compared. With 3 a count whose costs are
# within a few percent (the AMX path at 11 rows of Qwen2.5's head: 0.69 against 0.71 ms) fell to either side by noise,
# leaving holes in the routing between counts the kernel won; 7 cost 0.1 s more per model.
TIMED_REPEATS = 7
PROBE_WEIGHT_ROWS = 4096  # weight rows per timed call (12.6 MB of Qwen2.5's head); calls step through the weight


@torch.no_grad()
def _timed_routing(weight: torch.Tensor) -> KernelRouting:
    """Time the kernel against eager `F.linear` on `weight` at every row count 1..`MAX_ROWS` and at a prompt's
    `PROMPT_PROBE_ROWS` rows; the kernel serves the counts where it is faster (about 0.3-0.6 s in all).

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
    # counts look several times slower for both methods and decided them by noise.
    warm = torch.randn(1, weight.shape[1], generator=generator).to(torch.bfloat16)
    part: torch.Tensor | None  # a slice; below, the prompt's part or None (the next slice)
    for part in slices:
        F.linear(warm, part)
        small_rows.small_rows_linear(warm, part)
    timings = {}
    eager: list[float]  # seconds per call, each method's
    kernel: list[float]
    for rows in (*range(1, MAX_ROWS + 1), PROMPT_PROBE_ROWS):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        part = slices[0][:1024] if rows == PROMPT_PROBE_ROWS else None  # a prompt's rows are compute-bound
        eager, kernel = [], []
        for repeat in range(TIMED_REPEATS + 1):
            for method, times in ((F.linear, eager), (small_rows.small_rows_linear, kernel)):
                chosen = part if part is not None else next_part()
                start = time.perf_counter()
                method(x, chosen)
                if repeat:  # the first call of each warms up
                    times.append(time.perf_counter() - start)
        timings[rows] = (1e3 * statistics.median(eager), 1e3 * statistics.median(kernel))
    served = frozenset(rows for rows, (eager, kernel) in timings.items() if rows <= MAX_ROWS and kernel < eager)
    prompt_rows = PROMPT_ROWS if timings[PROMPT_PROBE_ROWS][1] < timings[PROMPT_PROBE_ROWS][0] else 0
    shown = ", ".join(f"{rows}: {eager:.2f}/{kernel:.2f}" for rows, (eager, kernel) in timings.items())
    on_weight = f"timed on the model's largest weight {tuple(weight.shape)}"
    shown = f"{small_rows.best_path()} path, {on_weight}, ms eager/kernel by rows: {shown}"
    if not served and not prompt_rows:
        return KernelRouting.off(f"off: eager is faster at every row count here ({shown})")
    return KernelRouting(
        served, f"on for {_ranges(served)} rows{' and prompts' if prompt_rows else ''} ({shown})", prompt_rows
    )


def _ranges(counts: frozenset[int]) -> str:
    """`{1, 2, 3, 5, 7, 8}` -> "1-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for count in sorted(counts):
        if runs and runs[-1][-1] == count - 1:
            runs[-1].append(count)
        else:
            runs.append([count])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs) or "no"


# model -> {(largest weight's storage, version, threads): timed routing / check}. Weak: dropped with the model.
_ROUTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, KernelRouting]]" = weakref.WeakKeyDictionary()
_CHECKS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, str | None]]" = weakref.WeakKeyDictionary()
