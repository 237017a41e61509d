"""How a model's forwards run, decided once per call by its plan (`plan/call_plan.py`) and read by
`cache.cached_model`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from transformers import PreTrainedModel

from ..kernels.routing import KernelRouting
from .compiled import CompiledForward
from .runner import RunnerPlan


class WideForwards(NamedTuple):
    """Eager forwards of at least `from_rows` rows (batch * positions: a prompt) run on `model` instead.

    `model` has the same architecture, config, dtype and logit layout as the model it stands in for (a quantized
    draft's float original: `prepare.prepared_draft.PreparedDraft.wide`), so the cache either writes serves the
    other. Only for a draft: what a draft computes changes how often its proposals are accepted, never what is
    sampled.
    """

    model: PreTrainedModel
    from_rows: int


@dataclass(frozen=True)
class Forwards:
    """How a model's forwards run, as the call's plan decided (`plan/call_plan.py`).

    Attributes:
        kernel: eager forwards over `rows * positions` rows run in `kernel.applied(rows * positions)` (None: plain
            eager).
        compiled: a compiled forward of the model (`cache.compiled.compiled_forward`), for a static cache only.
        largest_round: forwards of at most this many positions use `compiled`; wider ones (the prompt) run eagerly,
            as plain `generate()` runs its prefill (unless `compiled` has symbolic sizes: one graph serves all).
        wide: eager forwards of at least `wide.from_rows` rows run on `wide.model`, plain eager (no kernel routing: it
            was timed so). For a draft only (see `WideForwards`).
        step: forwards of one position per row run on `step`, a compiled forward of the model or of a view of the
            same weights (`PreparedDraft.step_model`), outside the kernel routing (its linears are the kernel's
            operators or inductor's). For a draft only: compiled logits differ by rounding, which changes how
            often its proposals are accepted, never what is sampled. Not for hybrid models.
        runner: forwards of at most `max(RunnerPlan.sizes)` positions on the model's static cache run through
            `cache.runner.ForwardRunner`s of those sizes (padded to them), with `RunnerPlan.backend` (None: as above).
        embeddable: ids at or above it are fed as id 0 (a draft narrower than the target cannot embed the target's
            padded ids; its proposals then condition on another token, which exactness allows: the verifier only
            needs the distribution the draft really sampled from). None: every id is embeddable.
    """

    kernel: KernelRouting | None = None
    compiled: CompiledForward | None = None
    largest_round: int = 0
    wide: WideForwards | None = None
    step: CompiledForward | None = None
    embeddable: int | None = None
    runner: RunnerPlan | None = None
