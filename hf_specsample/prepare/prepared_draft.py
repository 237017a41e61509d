"""Making the draft cheap without touching the target: only the target defines the output distribution.

Three levers, each an argument of `prepare_draft` (and an option of `SpeculativeConfig`):

- `quantization`: a dynamic-int8 copy of a float CPU draft (torch's fbgemm kernels). Measured single-token steps
  of Qwen2.5-Coder-0.5B: 41 ms int8 against 132 ms bf16 on one CPU, 27 ms against 50 ms on another. Quantization
  changes the draft's distribution a little (acceptance moves by a few points either way) and the output
  distribution not at all. Default AUTO: for a float draft on the CPU, both forms are timed at first use
  (`prepare/draft_timing.py`) and the faster one drafts; elsewhere the draft runs as given. A compact form's
  kernel is made for a few rows: over a prompt the float draft is often faster (Qwen2.5-Coder-0.5B on a Xeon with
  AMX, 110 positions: 148 ms bf16 against 284 ms int8 weights), so AUTO also times both over prompt widths and the
  draft's forwards of many positions run on its float original where that was faster (`PreparedDraft.wide`).
- `vocabulary` (the FR-Spec idea): the draft scores only a subset of frequent tokens, so its LM head and its
  logits processing shrink. Exact because the draft's probabilities are those of the distribution it really
  sampled from (zero outside the subset); the cost is that a token outside the subset can never be drafted.
- `draft="auto"`: a self-draft for targets with no small sibling: an int8 copy of the target on the CPU, a view
  skipping the middle fifth of its layers elsewhere (or with `quantization=NONE`).

`prepare_draft` returns a `PreparedDraft`, an object the caller holds and passes as `generate(draft_model=...)`.
The one-line `generate(draft_model=small)` prepares one itself and keeps it in `_IMPLICIT`, the only cache here:
weakly keyed by the draft model (the target for "auto"), so it is freed with that model, keyed by exactly the
options asked for, and rebuilt when the model's weights changed since (see `_ImplicitDrafts`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel
from transformers.utils.quantization_config import QuantizationMethod

from .. import distributed
from ..cache import row_ops
from ..cache.cached_model import WideForwards
from ..kernels import small_rows
from ..kernels.quantized_linear import SIBLING_GROUPS, Int4Linear, Int8Linear, SiblingProjection, fuse_siblings
from ..kernels.small_rows import KernelPlan
from ..lookahead import expected_speedup, weight_bytes
from ..options import DraftQuantization, LinearKernel, NamedDraft
from ..proposers.cross_vocab import SharedVocabulary, shared_vocabulary
from ..validation import check_models, check_tokenizers, vocab_size
from .draft_timing import acceptance, decode_step_seconds, forward_seconds
from .self_draft import default_layers_to_keep, layer_skip_draft, shallow_clone
from .vocabulary import special_token_ids, vocabulary_ids

logger = logging.getLogger(__name__)

AUTO_DRAFT = NamedDraft.AUTO  # draft_model="auto": build a draft from the target


@dataclass(frozen=True, eq=False)
class PreparedDraft:
    """The draft the loop runs, made by `prepare_draft`; pass it as `generate(draft_model=prepared)`.

    It is a snapshot: an int8 copy does not follow later changes to the draft's weights (prepare it again then).

    Attributes:
        model: the model the loop runs: the draft itself, its int8 copy, a view with a compact LM head, or a
            self-draft of the target.
        vocabulary: `(n,)` long, sorted: the token ids the model's logits stand for (its first n logit columns), an
            FR-Spec subset; None: the draft's own ids ``0 .. width - 1``.
        width: the logit width of the draft as given (before a compact head).
        quantization: the form that drafts: NONE (as given), INT8, INT8_WEIGHTS or INT4_WEIGHTS.
        self_draft_of: for `draft="auto"`, a weak reference to the target it was made from; else None.
        acceptance: where AUTO weighed the forms against calibration text: each form's expected acceptance rate
            (`draft_timing.acceptance`); empty otherwise.
        step_seconds: where AUTO timed the forms: seconds per single-token step of each (INT8 and NONE), the
            faster of which is `model`; empty where nothing was timed.
        step_bytes: where AUTO chose without the clock (a seeded call, a tensor-parallel target): the weight bytes a
            single-token step of each form reads (`lookahead.weight_bytes`), its stand-in for time; else empty.
        tokenizers: for a draft with another tokenizer, (the target's, the draft's) as given to `prepare_draft`:
            `generate()` uses them when it is given no tokenizers, or these very objects.
        shared_vocabulary: the tokens those tokenizers share (`proposers.cross_vocab.shared_vocabulary`, built once here
            instead of in every call).
        wide: where AUTO timed `model` (a compact form) against the draft as given over prompt widths and the latter
            was faster: the draft as given (same logit layout) and the rows from which it runs the draft's forwards
            (`cache.cached_model.WideForwards`: the prompt, a chat turn); None: every forward runs on `model`. The
            prepared draft then keeps the draft as given alive too.
        wide_seconds: those timings: per timed width, seconds of one forward of `model`'s form and of NONE.
    """

    model: PreTrainedModel
    vocabulary: torch.Tensor | None
    width: int
    quantization: DraftQuantization = DraftQuantization.NONE
    self_draft_of: weakref.ref | None = None
    step_seconds: dict[DraftQuantization, float] = field(default_factory=dict)
    acceptance: dict[DraftQuantization, float] = field(default_factory=dict)
    step_bytes: dict[DraftQuantization, int] = field(default_factory=dict)
    tokenizers: tuple[Any, Any] | None = None
    shared_vocabulary: SharedVocabulary | None = None
    wide: WideForwards | None = None
    wide_seconds: dict[int, dict[DraftQuantization, float]] = field(default_factory=dict)
    # (a weak reference to `model`, its `step_model` view), once made; shared with the copies `replace` makes (the
    # implicit cache hands out one per call), so that every call compiles the same view once. Weak: the implicit
    # cache's stored entry must not hold the draft it is keyed by
    _step_model: list[tuple[weakref.ref, PreTrainedModel]] = field(default_factory=list, repr=False)

    def step_model(self) -> PreTrainedModel:
        """`model` as compiled single-token steps run it (`SpeculativeConfig(compile_draft=True)`): the same weights,
        with a compact form's fused sibling projections as layers of their own (`without_siblings`; made once), or
        `model` itself where it has none."""
        if self._step_model and self._step_model[0][0]() is self.model:
            return self._step_model[0][1]
        view = without_siblings(self.model)
        if view is not self.model:  # a view holds the compact copy's modules, never the draft as given
            self._step_model[:] = [(weakref.ref(self.model), view)]
        return view

    @property
    def form(self) -> str:
        """What drafts, for the statistics: e.g. "int8 (timed per step: int8 46.1 ms, none 93.0 ms)"."""
        timed = ", ".join(
            f"{form} {seconds * 1e3:.1f} ms" if math.isfinite(seconds) else f"{form} failed"
            for form, seconds in self.step_seconds.items()
        )
        accepted = ", ".join(f"{form} {rate:.2f}" for form, rate in self.acceptance.items())
        weighed = ", ".join(f"{form} {_megabytes(size)}" for form, size in self.step_bytes.items())
        prompts = "; ".join(
            f"{width} positions: " + ", ".join(f"{form} {seconds * 1e3:.1f} ms" for form, seconds in by_form.items())
            for width, by_form in self.wide_seconds.items()
        )
        source = "the target" if self.self_draft_of is not None else "the draft as given"
        wide = (f"forwards of {self.wide.from_rows}+ positions on {source}" if self.wide is not None else "") + (
            f" (timed over {prompts})" if prompts else ""
        )
        parts = [
            f"timed per step: {timed}" if timed else "",
            wide,
            f"chosen without the clock, weights read per step: {weighed}" if weighed else "",
            f"acceptance: {accepted}" if accepted else "",
        ]
        details = "; ".join(part for part in parts if part)
        return f"{self.quantization}" + (f" ({details})" if details else "")

    @property
    def measured_step_seconds(self) -> float | None:
        """Seconds of one single-token step of `model` where AUTO timed it (`step_seconds` of its form), else None."""
        seconds = self.step_seconds.get(self.quantization)
        return seconds if seconds is not None and math.isfinite(seconds) else None

    def ids_for(self, target: PreTrainedModel) -> torch.Tensor | None:
        """The token ids this draft proposes over when drafting for `target`, or None for ``0 .. width - 1``.

        A draft of another logit width than the target's (a padded vocabulary: Qwen2.5-7B and up have 152064
        logit rows, their small siblings 151936) drafts over the ids both have, ``0 .. min(widths) - 1``, unless an
        FR-Spec subset was asked for. Computed for each call, so one prepared draft serves targets of any width.

        Raises:
            ValueError: the draft was made by "auto" from another target, or its vocabulary holds ids the target
                lacks.
        """
        if self.self_draft_of is not None and self.self_draft_of() is not target:
            raise ValueError(
                "This PreparedDraft was made by prepare_draft('auto', ...) from another target: a self-draft drafts "
                "for the model it was made from. Call hf_specsample.prepare_draft('auto', target) for this target."
            )
        target_width = vocab_size(target)
        if self.vocabulary is not None:
            if int(self.vocabulary[-1]) >= target_width:
                raise ValueError(
                    f"This PreparedDraft's vocabulary holds ids up to {int(self.vocabulary[-1])}, but the target "
                    f"scores only {target_width} ids: prepare the draft for this target (prepare_draft(draft, "
                    "target, vocabulary=...)) with ids it has."
                )
            return self.vocabulary
        return torch.arange(min(self.width, target_width)) if self.width != target_width else None


def prepare_draft(
    draft: PreTrainedModel | str,
    target: PreTrainedModel,
    *,
    quantization: DraftQuantization | str = DraftQuantization.AUTO,
    vocabulary: torch.Tensor | int | None = None,
    tokenizer=None,
    draft_tokenizer=None,
    calibration: torch.Tensor | None = None,
) -> PreparedDraft:
    """Prepare a draft once, to pass as `target.generate(..., draft_model=prepared)` in every later call.

    `generate(draft_model=draft)` does the same preparation itself (kept while `draft` lives and its weights do not
    change); preparing it yourself gives you the object: you decide when it is made and freed, and a benchmark can
    time exactly what `generate()` runs. Options are set here, not in `speculative_config` (a call that sets them
    there too is refused).

    Args:
        draft: a causal LM sharing the target's tokenizer (its logit width may differ), or with another tokenizer
            (pass both as `tokenizer=` / `draft_tokenizer=`, here and to `generate()`), or "auto": a draft made from
            the target (an int8 copy on the CPU, a view skipping the middle fifth of its layers elsewhere or with
            `quantization="none"`).
        target: the model whose `generate()` will use the draft.
        quantization: AUTO (default: for a float draft on the CPU, the fastest of its forms on this machine, timed
            here: as given, INT8 (torch's dynamic int8), INT8_WEIGHTS (int8 weights on the small-rows kernel) and,
            with `calibration`, INT4_WEIGHTS (int4 weights, CPUs with AVX-512 VNNI or BF16), each weighed by its
            measured acceptance; the draft as given elsewhere), or one of those forms (forced; CPU float drafts
            only), or NONE. Where AUTO chose a compact form, it also times it against the draft as given over
            prompt widths (`WIDE_WIDTHS`); the draft's forwards of many positions run on the faster
            (`PreparedDraft.wide`).
        vocabulary: FR-Spec: the token ids the draft may propose, a tensor (e.g. `hf_specsample.frequent_tokens(
            tokenizer, 32000)`) or an int N (the N lowest ids, plus the EOS / padding / BOS ids of the target's
            `generation_config`); None (default): every id. Not with a draft of another tokenizer.
        tokenizer, draft_tokenizer: the target's and the draft's tokenizers, for a draft with another tokenizer (a
            draft whose logit width is far from the target's is refused without them). The prepared draft keeps
            them and the vocabulary they share (0.25 s of CPU to build for Qwen2.5 and SmolLM2), so `generate()`
            needs neither again; it is a snapshot: prepare again after adding tokens to either tokenizer.
        calibration: `(length,)` target token ids of representative text (e.g. a prompt, 32-256 tokens): under AUTO
            the target is timed too, each form's acceptance is measured on it (`draft_timing.acceptance`), and the
            form with the highest expected speedup wins, int4 weights included. `generate(draft_model=draft)` uses
            its first call's prompt. Not for a draft with another tokenizer.

    For a tensor-parallel target, AUTO chooses without the clock (as a seeded `generate()` call does, see
    `_build`), so that every rank prepares the same form.

    Returns:
        A `PreparedDraft`. An int8 copy is a snapshot of the draft's weights: prepare again after changing them.

    Raises:
        ValueError / TypeError: a draft `generate(draft_model=...)` would refuse, options out of range, or INT8 for
            a draft that is not a float model on the CPU.
    """
    check_models(target, draft)
    if (tokenizer is None) != (draft_tokenizer is None):
        raise ValueError("Pass both the target's `tokenizer=` and the draft's `draft_tokenizer=`, or neither.")
    tokenizers = (tokenizer, draft_tokenizer) if tokenizer is not None else None
    other_tokenizer = check_tokenizers(target, draft, tokenizers)
    if other_tokenizer and vocabulary is not None:
        raise ValueError(_OTHER_TOKENIZER_VOCABULARY)
    quantization = DraftQuantization(quantization)
    ids = vocabulary_ids(vocabulary, _shared_width(draft, target), special_token_ids(target.generation_config))
    clock_free = distributed.is_tensor_parallel(target)  # every rank must choose the same form
    prepared = _build(draft, target, quantization, ids, None if other_tokenizer else calibration, clock_free)
    if not other_tokenizer:
        return prepared
    shared = shared_vocabulary(tokenizer, draft_tokenizer, vocab_size(target), prepared.width)
    return replace(prepared, tokenizers=tokenizers, shared_vocabulary=shared)


_OTHER_TOKENIZER_VOCABULARY = (
    "A draft with another tokenizer drafts over the tokens both vocabularies share, so an FR-Spec draft_vocabulary "
    "(target ids) cannot restrict its LM head, whose rows are the draft's own ids. Drop draft_vocabulary / "
    "prepare_draft(vocabulary=...) for this draft."
)


def draft_for_call(
    draft: PreTrainedModel | str | PreparedDraft,
    target: PreTrainedModel,
    quantization: DraftQuantization,
    vocabulary: torch.Tensor | int | None,
    special_ids: list[int],
    other_tokenizer: bool = False,
    calibration: torch.Tensor | None = None,
    clock_free: bool = False,
) -> PreparedDraft:
    """The prepared draft one `generate()` call runs: the caller's `PreparedDraft` as it is, or the implicit one.

    Args:
        quantization, vocabulary: the call's `speculative_config` options.
        special_ids: the call's EOS / padding / BOS ids (an int `vocabulary` keeps them).
        calibration: `(length,)` target token ids of representative text (the call's prompt): where the implicit
            draft is made under AUTO, its forms are weighed by acceptance on it too (`_build`).
        other_tokenizer: the draft reads another tokenizer's ids (`validation.check_tokenizers`): it may be
            quantized, but neither restricted to an FR-Spec vocabulary nor made from the target.
        clock_free: the call's output must not depend on the clock (a seeded call, a tensor-parallel target): AUTO
            then chooses the implicit draft's form without timing and without `calibration` (`_build`), so that
            the choice depends on the draft's weights only, not on which call prepared it first.
    """
    if other_tokenizer:
        prepared_vocabulary = isinstance(draft, PreparedDraft) and draft.vocabulary is not None
        if vocabulary is not None or prepared_vocabulary:
            raise ValueError(_OTHER_TOKENIZER_VOCABULARY)
        if isinstance(draft, PreparedDraft) and draft.self_draft_of is not None:
            raise ValueError(
                "This PreparedDraft was made by prepare_draft('auto', ...) from the target, so it drafts in the "
                "target's own ids: drop `draft_tokenizer=` / `assistant_tokenizer=` for it."
            )
    if isinstance(draft, PreparedDraft):
        if quantization is not DraftQuantization.AUTO or vocabulary is not None:
            raise ValueError(
                "draft_model= is a PreparedDraft, whose quantization and vocabulary were fixed by prepare_draft(): "
                "set them there (prepare_draft(draft, target, quantization=..., vocabulary=...)), not in "
                "speculative_config."
            )
        return draft
    ids = vocabulary_ids(vocabulary, _shared_width(draft, target), special_ids)
    # Clock-free, the implicit draft is chosen from the weights alone: weighed on this call's prompt, the choice (so
    # a seeded sample) would depend on which call first prepared the draft in this process.
    calibration = None if other_tokenizer or clock_free else calibration
    return _IMPLICIT.get(draft, target, quantization, ids, calibration, clock_free)


def _shared_width(draft: PreTrainedModel | str, target: PreTrainedModel) -> int:
    """The ids both models score: an FR-Spec vocabulary must lie below this."""
    return min(vocab_size(target), vocab_size(target if draft == AUTO_DRAFT else draft))


def _build(
    draft: PreTrainedModel | str,
    target: PreTrainedModel,
    quantization: DraftQuantization,
    ids: torch.Tensor | None,
    calibration: torch.Tensor | None = None,
    clock_free: bool = False,
) -> PreparedDraft:
    """Make the prepared draft: the model ("auto": the target), its compact head, then the form asked for.

    AUTO: the forms the draft can take here (as given, `int8`, `int8_weights`; for "auto", the target's compact
    forms, else a view skipping its middle layers), each timed at a single-token step. Without `calibration`, the
    fastest step wins (those forms draft alike). With it (token ids of representative text), `int4_weights` joins
    where it runs, the target is timed too and each form's acceptance is measured on the text: the form with the
    highest expected speedup (`lookahead.expected_speedup`) wins.

    AUTO with `clock_free` (a seeded call, whose sample must repeat in another process; a tensor-parallel target,
    whose ranks must run the same draft): nothing is timed. Without `calibration`, the first form made among
    `CLOCK_FREE_ORDER`; with it, the expected speedup with each form's cost taken as its weight bytes per step over
    the target's (`lookahead.weight_bytes`: decoding reads every weight once per step).
    """
    is_auto = draft == AUTO_DRAFT
    if is_auto and distributed.is_tensor_parallel(target):  # every rank raises alike, before any collective
        raise ValueError(
            "draft_model='auto' builds the draft from the target's weights, which a tensor-parallel target holds in "
            "shards (one per rank). Load a small model of the same tokenizer on every rank and pass it as "
            "draft_model= (a replica per rank), or use draft_model='prompt_lookup'."
        )
    model = target if is_auto else draft
    width = vocab_size(model)
    makers = _compact_forms(model)
    if quantization not in (DraftQuantization.AUTO, DraftQuantization.NONE) and quantization not in makers:
        raise ValueError(_CANNOT_MAKE[quantization])
    if quantization is DraftQuantization.AUTO:
        compact = [form for form in makers if form is not DraftQuantization.INT4_WEIGHTS or calibration is not None]
    else:
        compact = [] if quantization is DraftQuantization.NONE else [quantization]
    if is_auto and not compact:  # the target as given is no draft: a view skipping its middle layers
        if row_ops.keeps_state(target):
            raise ValueError(
                f"draft_model='auto' here skips layers of the target, and {type(target).__name__} keeps convolution "
                "or recurrent states, whose per-layer config (which layers are convolutions, recurrences or "
                "attention) a layer-skipping view does not renumber. Pass a small model of the same tokenizer as "
                "draft_model=, or use draft_model='auto' on the CPU with draft_quantization='int8' (a compact copy "
                "of the whole target)."
            )
        model = layer_skip_draft(target, default_layers_to_keep(target.config.get_text_config().num_hidden_layers))
    if ids is not None:
        model = restrict_vocabulary(model, ids)
    self_draft_of = weakref.ref(target) if is_auto else None
    if not compact:
        return PreparedDraft(model, ids, width, DraftQuantization.NONE, self_draft_of)
    logger.info("hf_specsample: making the draft's %s form(s)", ", ".join(map(str, compact)))
    forms = {form: makers[form](model) for form in compact}
    if quantization is DraftQuantization.AUTO and not is_auto:
        forms = {DraftQuantization.NONE: model, **forms}
    if len(forms) == 1:
        ((form, made),) = forms.items()
        return PreparedDraft(made, ids, width, form, self_draft_of)
    if clock_free:
        return _chosen_without_clock(forms, target, ids, width, self_draft_of, calibration)
    timings = time_forms(forms, target if calibration is not None else None)
    seconds = timings.drafts
    logger.info("hf_specsample: draft step by form: %s", {str(f): f"{t * 1e3:.1f} ms" for f, t in seconds.items()})
    if calibration is None or not math.isfinite(timings.target or math.inf):
        fastest = min(seconds, key=seconds.get)
        prepared = PreparedDraft(forms[fastest], ids, width, fastest, self_draft_of, step_seconds=seconds)
        return _with_wide_forwards(prepared, model)
    target_context = KernelPlan.for_model(target, LinearKernel.AUTO, role="target").applied(calibration.numel())
    rates = dict(zip(forms, acceptance(target, list(forms.values()), calibration, target_context, ids)))
    value = {form: expected_speedup(rates[form], seconds[form] / timings.target) for form in forms}
    best = max(value, key=value.get)
    prepared = PreparedDraft(forms[best], ids, width, best, self_draft_of, step_seconds=seconds, acceptance=rates)
    return _with_wide_forwards(prepared, model)


# Prompt widths at which AUTO times a compact form against the draft as given, narrowest first: the compact form's
# kernel pays per few rows, a float GEMM per many, so the float's lead grows with the width.
WIDE_WIDTHS = (32, 128)


def _with_wide_forwards(prepared: PreparedDraft, plain: PreTrainedModel) -> PreparedDraft:
    """`prepared` with `wide` set where `plain`, the float model its compact form was made from (the draft as given,
    or its FR-Spec view; the target for "auto"), runs a prompt faster than that form: from the narrowest width of
    `WIDE_WIDTHS` at which it was timed faster (`time_wide_forwards`). Not where the two compute in different dtypes
    (the dynamic-int8 copy runs in float32, a bf16 draft's keys are bf16): they could not share a cache."""
    if prepared.quantization is DraftQuantization.NONE or prepared.model.dtype != plain.dtype:
        return prepared
    timed: dict[int, dict[DraftQuantization, float]] = {}
    for width in WIDE_WIDTHS:
        compact_seconds, plain_seconds = time_wide_forwards([prepared.model, plain], width)
        timed[width] = {prepared.quantization: compact_seconds, DraftQuantization.NONE: plain_seconds}
        if plain_seconds < compact_seconds:
            return replace(prepared, wide=WideForwards(plain, width), wide_seconds=timed)
    return replace(prepared, wide_seconds=timed)


def time_wide_forwards(models: list[PreTrainedModel], width: int) -> list[float]:
    """Seconds of one prompt forward of `width` positions of each model (`draft_timing.forward_seconds`)."""
    return forward_seconds(models, width)


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


# AUTO's choice without calibration text or clock: int8 weights on the small-rows kernel (made only where it is built),
# torch's dynamic int8, the draft as given. The int8 forms read about a quarter of float32's bytes, half of bf16's.
CLOCK_FREE_ORDER = (DraftQuantization.INT8_WEIGHTS, DraftQuantization.INT8, DraftQuantization.NONE)


def _chosen_without_clock(
    forms: dict[DraftQuantization, PreTrainedModel],
    target: PreTrainedModel,
    ids: torch.Tensor | None,
    width: int,
    self_draft_of: weakref.ref | None,
    calibration: torch.Tensor | None,
) -> PreparedDraft:
    """AUTO's choice among `forms` that depends only on the weights and the calibration text (see `_build`)."""
    sizes = {form: weight_bytes(made) for form, made in forms.items()}
    if calibration is None:
        chosen = next(form for form in CLOCK_FREE_ORDER if form in forms)
        return PreparedDraft(forms[chosen], ids, width, chosen, self_draft_of, step_bytes=sizes)
    plan = KernelPlan.for_model(target, LinearKernel.AUTO, clock_free=True, role="target")
    rates = dict(
        zip(forms, acceptance(target, list(forms.values()), calibration, plan.applied(calibration.numel()), ids))
    )
    target_bytes = max(1, weight_bytes(target))
    value = {form: expected_speedup(rates[form], sizes[form] / target_bytes) for form in forms}
    best = max(value, key=value.get)  # ties: the first form, in `forms`' order
    return PreparedDraft(forms[best], ids, width, best, self_draft_of, acceptance=rates, step_bytes=sizes)


_CANNOT_MAKE = {
    DraftQuantization.INT8: (
        "draft_quantization='int8' needs a float draft on the CPU without bitsandbytes or device_map dispatch, and a "
        "torch with a quantized CPU engine; use draft_quantization='none' (or 'auto') for this draft."
    ),
    DraftQuantization.INT8_WEIGHTS: (
        "draft_quantization='int8_weights' needs a float draft on the CPU without bitsandbytes or device_map dispatch, "
        "and hf_specsample's small-rows kernel (built at first use with a C++ compiler); use draft_quantization="
        "'none' (or 'auto') for this draft."
    ),
    DraftQuantization.INT4_WEIGHTS: (
        "draft_quantization='int4_weights' needs a float draft on the CPU without bitsandbytes or device_map "
        "dispatch, hf_specsample's small-rows kernel, and a CPU with AVX-512 VNNI or BF16 (the vector paths that "
        "read int4 weights about as fast as memory delivers them); use 'int8_weights' or 'auto' here."
    ),
}


def _compact_forms(model: PreTrainedModel) -> dict[DraftQuantization, Any]:
    """The compact forms `model` can take here, each with the function that makes it."""
    if not _is_plain_cpu_float(model):
        return {}
    makers = {}
    if int8_engine() is not None:
        makers[DraftQuantization.INT8] = int8_dynamic_copy
    if small_rows.load().problem is None:
        makers[DraftQuantization.INT8_WEIGHTS] = int8_weights_copy
        if small_rows.best_path(torch.uint8) is not small_rows.KernelPath.SCALAR:  # a vector path reads int4
            makers[DraftQuantization.INT4_WEIGHTS] = int4_weights_copy
    return makers


class FormTimings(NamedTuple):
    """Seconds of a single-token step: of each form of a draft, and of the target (None: not timed)."""

    drafts: dict[DraftQuantization, float]
    target: float | None


def time_forms(forms: dict[DraftQuantization, PreTrainedModel], target: PreTrainedModel | None = None) -> FormTimings:
    """Single-token steps of each form of a draft (and of the target, if given), as the loop runs them (bf16 models
    on the small-rows kernel where their default plan puts one row), interleaved (`decode_step_seconds`)."""
    models = [*forms.values(), *([target] if target is not None else [])]
    plans = [KernelPlan.for_model(model, LinearKernel.AUTO, role="draft") for model in models]
    seconds = decode_step_seconds(models, contexts=[plan.applied for plan in plans])
    return FormTimings(dict(zip(forms, seconds)), seconds[len(forms)] if target is not None else None)


def _is_plain_cpu_float(model: PreTrainedModel) -> bool:
    """Float weights, all on the CPU, no bitsandbytes / accelerate dispatch: safe to copy and quantize.

    A model loaded from a GGUF file carries a quantizer although its weights were dequantized to plain float
    tensors on load (transformers then refuses `.float()`, not `.to(torch.float32)`): it qualifies.
    """
    if getattr(model, "hf_device_map", None) is not None:
        return False
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is not None and method != QuantizationMethod.GGUF:
        return False
    return all(p.device.type == "cpu" and p.is_floating_point() for p in model.parameters())


def int8_engine() -> str | None:
    """The quantized engine used for dynamic int8 linears, or None where this torch has none.

    `torch.ao.quantization` is deprecated upstream (it still works in torch 2.13); where it is gone this returns
    None and AUTO leaves the draft as it is.
    """
    if not hasattr(getattr(torch, "ao", None), "quantization"):
        return None
    engines = torch.backends.quantized.supported_engines
    return next((engine for engine in ("fbgemm", "x86", "qnnpack") if engine in engines), None)


@contextlib.contextmanager
def _quantized_engine(engine: str):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


class SharedFloat32Embedding(torch.nn.Module):
    """An int8 copy's input embedding: rows looked up in the source model's own `nn.Embedding`, shared rather than
    copied, and cast to float32. A float cast to float32 is exact, so this returns bit for bit what a float32 copy
    of the embedding returns, without holding that copy (Qwen2.5-Coder-1.5B's: 934 MB)."""

    def __init__(self, source: torch.nn.Embedding):
        super().__init__()
        # Held in a tuple, not as a submodule: `.float()` / `.to()` on the copy must not convert the source in place.
        self._source = (source,)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self._source[0].weight

    @property
    def num_embeddings(self) -> int:
        return self._source[0].num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`(batch, length)` ids -> `(batch, length, hidden)` float32."""
        return self._source[0](input_ids).float()


def int8_dynamic_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` (float32) whose `nn.Linear` layers are dynamically quantized to int8 (CPU).

    A plain `nn.Embedding` input embedding is shared with `model` (`SharedFloat32Embedding`), not copied.
    """
    engine = int8_engine()
    if engine is None:
        raise RuntimeError("this torch build has no quantized CPU engine for dynamic int8 (fbgemm/x86/qnnpack).")
    embedding = model.get_input_embeddings()
    memo = {id(embedding): SharedFloat32Embedding(embedding)} if type(embedding) is torch.nn.Embedding else {}
    quantized = copy.deepcopy(model, memo).to(torch.float32).eval()  # not .float(): refused for GGUF-loaded models
    linears = {
        name for name, module in quantized.named_modules() if type(module) is torch.nn.Linear and name
    } - _weights_read(quantized)
    spec = dict.fromkeys(sorted(linears), torch.ao.quantization.default_dynamic_qconfig)
    with _quantized_engine(engine), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(deprecated|quantize_per_tensor).*")
        torch.ao.quantization.quantize_dynamic(quantized, spec, dtype=torch.qint8, inplace=True)
    return quantized


def _weights_read(model: torch.nn.Module) -> set[str]:
    """Names of the `nn.Linear` modules whose weight tensor their parent's forward reads (`self.lm_head.weight.dtype`
    in Mamba-2's head, `self.down_proj.weight.dtype` in an Inkling MLP): those stay float in a compact form, whose
    `weight` is a method (dynamic int8) or an int8 / packed int4 buffer (`Int8Linear`, `Int4Linear`)."""
    read = set()
    for parent_name, parent in model.named_modules():
        children = [name for name, child in parent.named_children() if type(child) is torch.nn.Linear]
        if not children:
            continue
        try:
            source = inspect.getsource(type(parent).forward)
        except (OSError, TypeError):  # a forward without source (a builtin, a compiled wrapper): none read
            continue
        prefix = f"{parent_name}." if parent_name else ""
        read |= {prefix + name for name in children if f"self.{name}.weight" in source}
    return read


def int8_weights_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A view of `model` whose `nn.Linear` layers are `kernels.quantized_linear.Int8Linear` (int8 weights, one scale
    per row, run by the small-rows kernel); every other module (embeddings, norms) is shared with `model`.

    The LM head gets its own int8 copy where it is tied to the input embedding (the embedding stays as it is).
    """
    return _with_linears(model, Int8Linear.from_linear)


def _with_linears(model: PreTrainedModel, make) -> PreTrainedModel:
    """A view of `model` in which `make(linear)` replaces every `nn.Linear` (but those whose weight tensor the model
    reads, `_weights_read`); the modules on the way are shallow clones, every other module is `model`'s own."""
    kept = {id(model.get_submodule(name)) for name in _weights_read(model)}

    def replaced(module: torch.nn.Module) -> torch.nn.Module:
        clone = shallow_clone(module)
        for names in SIBLING_GROUPS:  # projections of one input: one kernel call (`SiblingProjection`)
            group = [getattr(module, name, None) for name in names]
            if all(_fusable(linear, group[0]) and id(linear) not in kept for linear in group):
                for name, sibling in zip(names, fuse_siblings(group, make)):
                    clone._modules[name] = sibling
        for name, child in module.named_children():
            if clone._modules[name] is not child:
                continue  # fused above
            if isinstance(child, torch.nn.Linear) and id(child) not in kept:
                clone._modules[name] = make(child)
            elif any(isinstance(inner, torch.nn.Linear) for inner in child.modules()):
                clone._modules[name] = replaced(child)
        return clone

    return replaced(model).eval()


def _fusable(linear, first) -> bool:
    return (
        type(linear) is torch.nn.Linear
        and linear.in_features == first.in_features
        and linear.weight.dtype == first.weight.dtype
        and linear.weight.device == first.weight.device
    )


def without_siblings(model: PreTrainedModel) -> PreTrainedModel:
    """A view of `model` in which each `SiblingProjection` is a layer of its own over its rows of the fused weight
    (`SiblingProjection.standalone`: views, no weight copied); `model` itself where it has none.

    Compiled code traces every call: one kernel call for q/k/v saves a few microseconds of eager dispatch, which
    compiled code does not pay, while the siblings' hand-off (Python state keyed by the input tensor) would make
    dynamo guard and recompile per layer."""
    if not any(isinstance(module, SiblingProjection) for module in model.modules()):
        return model

    def replaced(module: torch.nn.Module) -> torch.nn.Module:
        clone = shallow_clone(module)
        for name, child in module.named_children():
            if isinstance(child, SiblingProjection):
                clone._modules[name] = child.standalone()
            elif any(isinstance(inner, SiblingProjection) for inner in child.modules()):
                clone._modules[name] = replaced(child)
        return clone

    return replaced(model).eval()


def int4_weights_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A view of `model` whose decoder `nn.Linear` layers are `Int4Linear` (int4 weights, a scale per 128 inputs)
    where their inputs split into whole groups, `Int8Linear` elsewhere and for the LM head (the largest single
    weight, and the most sensitive); every other module is shared with `model`."""
    head = model.get_output_embeddings()

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        if linear is head or not Int4Linear.fits(linear):
            return Int8Linear.from_linear(linear)
        return Int4Linear.from_linear(linear)

    return _with_linears(model, make)


def restrict_vocabulary(model: PreTrainedModel, token_ids: torch.Tensor) -> PreTrainedModel:
    """A view of `model` whose LM head scores only `token_ids` (logits of width `len(token_ids)`).

    The head is a new `nn.Linear` holding the selected rows; every other weight is shared with `model`.
    """
    head = model.get_output_embeddings()
    weight = head.weight.detach()[token_ids.to(head.weight.device)]
    compact = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    compact.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    view = shallow_clone(model)
    name = next(name for name, module in model.named_children() if module is head)
    view._modules[name] = compact
    return view


class _TensorState(NamedTuple):
    """One parameter or buffer of a model as it was when a draft was prepared from it."""

    name: str
    tensor: weakref.ref  # the tensor object: replacing a Parameter makes a new one
    version: int | None  # torch's in-place counter: copy_, load_state_dict, optimizer steps, init functions bump it
    data_ptr: int  # `.to()` / `.half()` / `p.data = ...` swap the storage without bumping `version`
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> _TensorState:
        return cls(name, weakref.ref(tensor), _version(tensor), tensor.data_ptr(), tensor.dtype)

    def matches(self, name: str, tensor: torch.Tensor) -> bool:
        return (name, _version(tensor), tensor.data_ptr(), tensor.dtype) == (
            self.name, self.version, self.data_ptr, self.dtype
        ) and self.tensor() is tensor  # fmt: skip


def _version(tensor: torch.Tensor) -> int | None:
    """The in-place version counter; None for tensors made under `torch.inference_mode`, which have none."""
    return None if tensor.is_inference() else tensor._version


def _named_weights(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model`, by name (shared tensors once)."""
    return [*model.named_parameters(), *model.named_buffers()]


class _Entry(NamedTuple):
    prepared: PreparedDraft  # `model` (`wide.model`) None where it is the owner: an entry never references its key
    weights: tuple[_TensorState, ...]  # the owner's parameters and buffers when `prepared` was made

    def is_current(self, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether the owner's `weights` (`_named_weights`) are still those `prepared` was made from."""
        return len(self.weights) == len(weights) and all(
            state.matches(name, tensor) for state, (name, tensor) in zip(self.weights, weights)
        )


class _ImplicitDrafts:
    """The drafts `generate(draft_model=model)` prepared itself, so that the int8 copy is made once, not per call.

    - Weakly keyed by the model they were made from (the target for "auto"): an entry is freed with that model.
      No entry references its key (an int8 copy or a view holds submodules and tensors, never the model object):
      where AUTO's timing chose the draft as given, the entry keeps that decision and its timings without the model.
    - Per model, keyed by exactly the options: the quantization asked for and the full vocabulary ids.
    - Valid while the model's weights are unchanged: every parameter and buffer is the same object, with the same
      storage and the same in-place version counter as when the entry was made; otherwise every entry of that
      model is rebuilt. Writes through `.data` (`p.data.copy_(...)`) bypass torch's version counter, and weights
      made under `torch.inference_mode` have none: such in-place writes are not seen; after them, pass
      `prepare_draft(draft, target)` yourself. Output stays exact either way; a stale copy only drafts worse.
    """

    def __init__(self):
        self._entries: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, _Entry]] = weakref.WeakKeyDictionary()

    def get(
        self,
        draft: PreTrainedModel | str,
        target: PreTrainedModel,
        quantization: DraftQuantization,
        ids: torch.Tensor | None,
        calibration: torch.Tensor | None = None,
        clock_free: bool = False,
    ) -> PreparedDraft:
        """The entry for these options, made (`_build`, with `calibration` and `clock_free` for AUTO) where there
        is none. A clock-free choice is kept apart from a timed one: the same options may choose differently."""
        owner = target if draft == AUTO_DRAFT else draft
        quantization = DraftQuantization(quantization)
        how = clock_free and quantization is DraftQuantization.AUTO
        key = (draft == AUTO_DRAFT, quantization, None if ids is None else ids.numpy().tobytes(), how)
        weights = _named_weights(owner)
        # Entries made from other weights than the owner's current ones are stale: drop them (and their memory).
        entries = {k: entry for k, entry in self._entries.get(owner, {}).items() if entry.is_current(weights)}
        if key not in entries:
            prepared = _build(draft, target, quantization, ids, calibration, clock_free)
            decided = prepared.step_seconds or prepared.step_bytes
            if prepared.model is owner and not decided:  # nothing made or decided: runs as given
                return prepared
            stored = replace(prepared, model=None) if prepared.model is owner else prepared
            if prepared.wide is not None and prepared.wide.model is owner:
                stored = replace(stored, wide=prepared.wide._replace(model=None))
            entries[key] = _Entry(stored, tuple(_TensorState.of(name, tensor) for name, tensor in weights))
        self._entries[owner] = entries
        prepared = entries[key].prepared
        if prepared.model is None:
            prepared = replace(prepared, model=owner)
        if prepared.wide is not None and prepared.wide.model is None:
            prepared = replace(prepared, wide=prepared.wide._replace(model=owner))
        return prepared

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())


_IMPLICIT = _ImplicitDrafts()
