"""`DraftForm.AUTO`'s choice among the forms a draft can take here: the only place that times or weighs them.

Which forms it weighs (`weighed_forms`) is decided from the draft's dtype before anything is built: the small-rows
kernel's forms only for a bf16 draft.

Which form of a draft steps faster depends on the CPU (a dynamic-int8 copy ran a Qwen2.5-Coder-0.5B step in 46 ms
where bf16 took 93 ms on an AVX2-only EPYC; with AMX bf16 tiles or the small-rows kernel's int8 / int4 weights the
order turns around), so the forms are timed at first use (`prepare.draft_timing`) instead of following a rule:

- without calibration text, the fastest single-token step wins (the forms draft alike);
- with it (the call's prompt), the target is timed too and each form's acceptance is measured on the text, and the
  form with the highest expected speedup (`round_costs.expected_speedup`) wins (int4 weights draft worse);
- clock-free (a seeded call, whose sample must repeat in another process; a tensor-parallel target, whose ranks
  must choose alike): nothing is timed; without calibration the first form made among `CLOCK_FREE_ORDER`, with it
  the expected speedup with each form's cost taken as its weight bytes per step over the target's;
- a quantized form's kernel is made for a few rows: where the float model it was made from runs a prompt faster
  (`PROMPT_LENGTHS`), its forwards of many positions run on that model (`cache.forwards.WideForwards`).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from ..cache.forwards import WideForwards
from ..core.model_facts import ModelFacts, Role
from ..kernels.routing import KernelRouting
from ..options import DraftForm, LinearKernel
from ..policy.round_costs import expected_speedup, weight_bytes
from .draft_timing import acceptance, decode_step_seconds, forward_seconds
from .surgery import QUANTIZED_FORMS, int8_engine

logger = logging.getLogger(__name__)

# AUTO's choice without calibration text or clock: int8 weights on the small-rows kernel (weighed for bf16 drafts,
# where the kernel builds), torch's dynamic int8, the draft as given. The int8 forms read about a quarter of float32's
# bytes, half of bf16's.
CLOCK_FREE_ORDER = (DraftForm.INT8_WEIGHTS, DraftForm.DYNAMIC_INT8, DraftForm.AS_GIVEN)
# Prompt lengths at which AUTO times a quantized form against the draft as given, shortest first: the quantized form's
# kernel pays per few rows, a float GEMM per many, so the float's lead grows with the length.
PROMPT_LENGTHS = (32, 128)


def weighed_forms(model: PreTrainedModel, kernel: bool = True) -> tuple[DraftForm, ...]:
    """The quantized forms `DraftForm.AUTO` weighs for `model`, from its dtype, before anything is built.

    The kernel's forms (`surgery.KERNEL_FORMS`) for a bf16 model, whose linears the kernel serves anyway (one build
    for both), or where torch has no dynamic int8. Not for a float32 or float16 model: it would build the kernel (15-20
    s on 2 cores) for a form that torch's dynamic int8 comes within about 5% of (a Qwen2.5-Coder-0.5B step: 36.2
    against 34.5 ms on the Sapphire Rapids Xeon of docs/kernel_and_compile.md). Nor where `kernel` is False
    (`linear_kernel="off"`: no kernel at all).
    """
    uses_kernel = kernel and (model.dtype == torch.bfloat16 or int8_engine() is None)
    return QUANTIZED_FORMS if uses_kernel else (DraftForm.DYNAMIC_INT8,)


class FormChoice(NamedTuple):
    """What AUTO chose, and what it measured to choose it (`PreparedDraft`'s fields of the same names).

    Attributes:
        form: the form that drafts.
        step_seconds: per form timed, seconds of a single-token step (empty where nothing was timed).
        acceptance: per form, its expected acceptance on the calibration text (empty without one).
        step_bytes: per form, the weight bytes a step reads, where the choice was clock-free (else empty).
        wide: where the chosen quantized form's prompts run on the float model it was made from (None: on itself).
        wide_seconds: per prompt length timed, seconds of one forward of the chosen form and of the float model.
    """

    form: DraftForm
    step_seconds: dict[DraftForm, float] = {}
    acceptance: dict[DraftForm, float] = {}
    step_bytes: dict[DraftForm, int] = {}
    wide: WideForwards | None = None
    wide_seconds: dict[int, dict[DraftForm, float]] = {}


def choose_form(
    forms: dict[DraftForm, PreTrainedModel],
    source: ModelFacts,
    target: ModelFacts,
    target_routing: KernelRouting,
    ids: torch.Tensor | None,
    calibration: torch.Tensor | None,
    clock_free: bool,
    kernel: bool = True,
) -> FormChoice:
    """AUTO's choice among `forms` (two or more), made from `source` (the draft as given or its FR-Spec view; the
    target for "auto"), for `target` whose forwards run under `target_routing` (see the module docstring).

    Args:
        ids: `(n,)` the target ids the forms' logits stand for (an FR-Spec subset), or None.
        calibration: `(length,)` target token ids of representative text, or None.
        kernel: the forms' bf16 linears may run on the small-rows kernel (the call's `linear_kernel` is not "off").
    """
    if clock_free:
        return _chosen_without_clock(forms, target, target_routing, ids, calibration)
    timings = time_forms(forms, source, target if calibration is not None else None, target_routing, kernel)
    seconds, target_seconds = timings.drafts, timings.target
    logger.info("hf_specsample: draft step by form: %s", {str(f): f"{t * 1e3:.1f} ms" for f, t in seconds.items()})
    if calibration is None or not math.isfinite(target_seconds or math.inf):
        fastest = min(seconds, key=seconds.__getitem__)
        return _with_wide_forwards(FormChoice(fastest, step_seconds=seconds), forms[fastest], source.model)
    assert target_seconds is not None  # finite: the target was timed
    context = target_routing.applied(calibration.numel())
    rates = dict(zip(forms, acceptance(target.model, list(forms.values()), calibration, context, ids)))
    value = {form: expected_speedup(rates[form], seconds[form] / target_seconds) for form in forms}
    best = max(value, key=value.__getitem__)
    return _with_wide_forwards(FormChoice(best, step_seconds=seconds, acceptance=rates), forms[best], source.model)


class FormTimings(NamedTuple):
    """Seconds of a single-token step: of each form of a draft, and of the target (None: not timed)."""

    drafts: dict[DraftForm, float]
    target: float | None


def time_forms(
    forms: dict[DraftForm, PreTrainedModel],
    source: ModelFacts,
    target: ModelFacts | None,
    target_routing: KernelRouting,
    kernel: bool = True,
) -> FormTimings:
    """Single-token steps of each form of a draft (and of the target, if given), as the loop runs them (bf16 models
    on the small-rows kernel where their default routing puts one row, unless `kernel` is False), interleaved
    (`decode_step_seconds`)."""
    facts = [source if model is source.model else ModelFacts.of(model, same_config=source) for model in forms.values()]
    choice = LinearKernel.AUTO if kernel else LinearKernel.OFF
    routings = [KernelRouting.for_model(form_facts, choice, role=Role.DRAFT) for form_facts in facts]
    models, contexts = list(forms.values()), [plan.applied for plan in routings]
    if target is not None:
        models, contexts = [*models, target.model], [*contexts, target_routing.applied]
    seconds = decode_step_seconds(models, contexts=contexts)
    return FormTimings(dict(zip(forms, seconds)), seconds[len(forms)] if target is not None else None)


def _chosen_without_clock(
    forms: dict[DraftForm, PreTrainedModel],
    target: ModelFacts,
    target_routing: KernelRouting,
    ids: torch.Tensor | None,
    calibration: torch.Tensor | None,
) -> FormChoice:
    """AUTO's choice among `forms` that depends only on the weights and the calibration text."""
    sizes = {form: weight_bytes(made) for form, made in forms.items()}
    if calibration is None:
        return FormChoice(next(form for form in CLOCK_FREE_ORDER if form in forms), step_bytes=sizes)
    context = target_routing.applied(calibration.numel())
    rates = dict(zip(forms, acceptance(target.model, list(forms.values()), calibration, context, ids)))
    target_bytes = max(1, weight_bytes(target.model))
    value = {form: expected_speedup(rates[form], sizes[form] / target_bytes) for form in forms}
    best = max(value, key=value.__getitem__)  # ties: the first form, in `forms`' order
    return FormChoice(best, acceptance=rates, step_bytes=sizes)


def _with_wide_forwards(choice: FormChoice, chosen: PreTrainedModel, plain: PreTrainedModel) -> FormChoice:
    """`choice` with `wide` set where `plain`, the float model the chosen quantized form was made from, runs a prompt
    faster than that form: from the shortest length of `PROMPT_LENGTHS` at which it was timed faster
    (`time_wide_forwards`). Not where the two compute in different dtypes (the dynamic-int8 copy runs in float32, a
    bf16 draft's keys are bf16): they could not share a cache."""
    if choice.form is DraftForm.AS_GIVEN or chosen.dtype != plain.dtype:
        return choice
    timed: dict[int, dict[DraftForm, float]] = {}
    for length in PROMPT_LENGTHS:
        quantized_seconds, plain_seconds = time_wide_forwards([chosen, plain], length)
        timed[length] = {choice.form: quantized_seconds, DraftForm.AS_GIVEN: plain_seconds}
        if plain_seconds < quantized_seconds:
            return choice._replace(wide=WideForwards(plain, length), wide_seconds=timed)
    return choice._replace(wide_seconds=timed)


def time_wide_forwards(models: list[PreTrainedModel], length: int) -> list[float]:
    """Seconds of one prompt forward of `length` positions of each model (`draft_timing.forward_seconds`)."""
    return forward_seconds(models, length)
