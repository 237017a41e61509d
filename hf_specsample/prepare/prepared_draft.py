"""A draft made ready before a call (`PreparedDraft`, `prepare_draft`), and what `draft_model=` is (`resolve_draft`).

Only the target defines the output distribution, so the draft may be made cheap in any way:

- its form (`DraftForm`): a quantized copy of a float CPU draft, dynamic int8 or int8 / int4 weights on the small-rows
  kernel (`prepare.surgery`); AUTO times them here and keeps the fastest, or the one with the best expected speedup
  when calibration text measures their acceptance (`form_choice`). Quantization changes the draft's distribution a
  little (acceptance moves by a few points either way) and the output distribution not at all;
- its vocabulary (the FR-Spec idea): the draft scores only a subset of frequent tokens, so its LM head and its
  logits processing shrink; exact because the draft's probabilities are those of the distribution it really
  sampled from (zero outside the subset);
- `draft="auto"`: a self-draft for targets with no small sibling: a quantized copy of the target on the CPU, a view
  skipping the middle fifth of its layers elsewhere (or with `form="as_given"`).

`prepare_draft` returns a `PreparedDraft` the caller holds and passes as `generate(draft_model=...)`; the one-line
`generate(draft_model=small)` prepares one itself and keeps it (`prepare.implicit`).
"""

from __future__ import annotations

import enum
import logging
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from ..cache.forwards import WideForwards
from ..core.model_facts import ModelFacts
from ..kernels.routing import KernelRouting
from ..options import DraftForm, LinearKernel, NamedDraft, parse_choice
from ..policy.validation import check_models, check_tokenizers
from ..proposers.cross_tokenizer import SharedVocabulary, shared_vocabulary
from ..proposers.suffix_store import SuffixDraft
from .form_choice import choose_form, weighed_forms
from .self_draft import default_layers_to_keep, layer_skip_draft
from .surgery import CANNOT_MAKE, quantized_forms, restrict_vocabulary, without_siblings
from .vocabulary import special_token_ids, vocabulary_ids

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class PreparedDraft:
    """The draft the loop runs, made by `prepare_draft`; pass it as `generate(draft_model=prepared)`.

    It is a snapshot: an int8 copy does not follow later changes to the draft's weights (prepare it again then).

    Attributes:
        model: the model the loop runs: the draft itself, its int8 copy, a view with a restricted LM head, or a
            self-draft of the target.
        vocabulary: `(n,)` long, sorted: the token ids the model's logits stand for (its first n logit columns), an
            FR-Spec subset; None: the draft's own ids ``0 .. logit_width - 1``.
        logit_width: the logit width of the draft as given (before a restricted head).
        form: the form that drafts: AS_GIVEN, DYNAMIC_INT8, INT8_WEIGHTS or INT4_WEIGHTS.
        self_draft_of: for `draft="auto"`, a weak reference to the target it was made from; else None.
        acceptance: where AUTO weighed the forms against calibration text: each form's expected acceptance rate
            (`draft_timing.acceptance`); empty otherwise.
        step_seconds: where AUTO timed the forms: seconds per single-token step of each, the faster of which is
            `model`; empty where nothing was timed.
        step_bytes: where AUTO chose without the clock (a seeded call, a tensor-parallel target): the weight bytes a
            single-token step of each form reads (`round_costs.weight_bytes`), its stand-in for time; else empty.
        tokenizers: for a draft with another tokenizer, (the target's, the draft's) as given to `prepare_draft`:
            `generate()` uses them when it is given no tokenizers, or these very objects.
        shared_vocabulary: the tokens those tokenizers share (`proposers.cross_tokenizer.shared_vocabulary`, built once
            here instead of in every call).
        wide: where AUTO timed `model` (a quantized form) against the draft as given over prompt lengths and the latter
            was faster: the draft as given (same logit layout) and the rows from which it runs the draft's forwards
            (`cache.forwards.WideForwards`: the prompt, a chat turn); None: every forward runs on `model`. The
            prepared draft then keeps the draft as given alive too.
        wide_seconds: those timings: per prompt length timed, seconds of one forward of `model`'s form and of the
            draft as given.
    """

    model: PreTrainedModel
    vocabulary: torch.Tensor | None
    logit_width: int
    form: DraftForm = DraftForm.AS_GIVEN
    self_draft_of: weakref.ref | None = None
    step_seconds: dict[DraftForm, float] = field(default_factory=dict)
    acceptance: dict[DraftForm, float] = field(default_factory=dict)
    step_bytes: dict[DraftForm, int] = field(default_factory=dict)
    tokenizers: tuple[Any, Any] | None = None
    shared_vocabulary: SharedVocabulary | None = None
    wide: WideForwards | None = None
    wide_seconds: dict[int, dict[DraftForm, float]] = field(default_factory=dict)
    # (a weak reference to `model`, its `step_model` view), once made; shared with the copies `replace` makes (the
    # implicit cache hands out one per call), so that every call compiles the same view once. Weak: the implicit
    # cache's stored entry must not hold the draft it is keyed by
    _step_model: list[tuple[weakref.ref, PreTrainedModel]] = field(default_factory=list, repr=False)

    def step_model(self) -> PreTrainedModel:
        """`model` as compiled single-token steps run it (`SpeculativeConfig(compile_draft=True)`): the same weights,
        with a quantized form's fused sibling projections as layers of their own (`without_siblings`; made once), or
        `model` itself where it has none."""
        if self._step_model and self._step_model[0][0]() is self.model:
            return self._step_model[0][1]
        view = without_siblings(self.model)
        if view is not self.model:  # a view holds the quantized copy's modules, never the draft as given
            self._step_model[:] = [(weakref.ref(self.model), view)]
        return view

    @property
    def description(self) -> str:
        """What drafts, for the statistics: e.g. "dynamic_int8 (timed per step: dynamic_int8 46.1 ms, as_given 93.0
        ms)"."""
        timed = ", ".join(
            f"{form} {seconds * 1e3:.1f} ms" if math.isfinite(seconds) else f"{form} failed"
            for form, seconds in self.step_seconds.items()
        )
        accepted = ", ".join(f"{form} {rate:.2f}" for form, rate in self.acceptance.items())
        weighed = ", ".join(f"{form} {_megabytes(size)}" for form, size in self.step_bytes.items())
        prompts = "; ".join(
            f"{length} positions: " + ", ".join(f"{form} {seconds * 1e3:.1f} ms" for form, seconds in by_form.items())
            for length, by_form in self.wide_seconds.items()
        )
        source = "the target" if self.self_draft_of is not None else "the draft as given"
        wide = (f"forwards of {self.wide.from_rows}+ positions on {source}" if self.wide is not None else "") + (
            f" (timed over {prompts})" if prompts else ""
        )
        wide = wide.strip()  # no leading space where wide forwards were timed but none chosen
        parts = [
            f"timed per step: {timed}" if timed else "",
            wide,
            f"chosen without the clock, weights read per step: {weighed}" if weighed else "",
            f"acceptance: {accepted}" if accepted else "",
        ]
        details = "; ".join(part for part in parts if part)
        return f"{self.form}" + (f" ({details})" if details else "")

    @property
    def measured_step_seconds(self) -> float | None:
        """Seconds of one single-token step of `model` where AUTO timed it (`step_seconds` of its form), else None."""
        seconds = self.step_seconds.get(self.form)
        return seconds if seconds is not None and math.isfinite(seconds) else None

    def ids_for(self, target: ModelFacts) -> torch.Tensor | None:
        """The token ids this draft proposes over when drafting for `target`, or None for ``0 .. logit_width - 1``.

        A draft of another logit width than the target's (a padded vocabulary: Qwen2.5-7B and up have 152064
        logit rows, their small siblings 151936) drafts over the ids both have, ``0 .. min(widths) - 1``, unless an
        FR-Spec subset was asked for. Computed for each call, so one prepared draft serves targets of any width.

        Raises:
            ValueError: the draft was made by "auto" from another target, or its vocabulary holds ids the target
                lacks.
        """
        if self.self_draft_of is not None and self.self_draft_of() is not target.model:
            raise ValueError(
                "This PreparedDraft was made by prepare_draft('auto', ...) from another target: a self-draft drafts "
                "for the model it was made from. Call hf_specsample.prepare_draft('auto', target) for this target."
            )
        target_width = target.logit_width
        if self.vocabulary is not None:
            if int(self.vocabulary[-1]) >= target_width:
                raise ValueError(
                    f"This PreparedDraft's vocabulary holds ids up to {int(self.vocabulary[-1])}, but the target "
                    f"scores only {target_width} ids: prepare the draft for this target (prepare_draft(draft, "
                    "target, vocabulary=...)) with ids it has."
                )
            return self.vocabulary
        return torch.arange(min(self.logit_width, target_width)) if self.logit_width != target_width else None


class DraftKind(str, enum.Enum):
    """What a model object passed as `draft_model=` is (`resolve_draft`); a draft named by a string is a
    `NamedDraft`."""

    MODEL = "model"  # a causal LM, prepared by the call (`prepare.implicit`)
    PREPARED = "prepared"  # a `PreparedDraft`, run as it is

    def __str__(self) -> str:
        return self.value


class DraftSpec(NamedTuple):
    """`draft_model=` resolved once (`resolve_draft`); every later step reads it instead of asking again.

    Attributes:
        kind: what it is: a model object's `DraftKind`, or the `NamedDraft` a string names.
        given: the model or the `PreparedDraft` passed; None for "auto" and "prompt_lookup".
        store: the suffix drafter's store (kind `NamedDraft.SUFFIX`): the `SuffixDraft` passed, or a new one for
            "suffix"; else None.
    """

    kind: DraftKind | NamedDraft
    given: PreTrainedModel | PreparedDraft | None = None
    store: SuffixDraft | None = None

    @property
    def model_free(self) -> bool:
        """No draft model runs: n-gram lookups or a suffix drafter."""
        return self.kind in (NamedDraft.PROMPT_LOOKUP, NamedDraft.SUFFIX)

    @property
    def model(self) -> PreTrainedModel | None:
        """The draft model as given (a `PreparedDraft`'s model), None for "auto" and "prompt_lookup"."""
        return self.given.model if isinstance(self.given, PreparedDraft) else self.given  # DraftKind.PREPARED

    @property
    def prepared(self) -> PreparedDraft | None:
        return self.given if isinstance(self.given, PreparedDraft) else None  # DraftKind.PREPARED


def resolve_draft(draft_model: Any) -> DraftSpec:
    """What `draft_model=` is: a model, a `PreparedDraft`, a `SuffixDraft`, "auto", "prompt_lookup" or "suffix".

    Raises:
        TypeError: anything else.
    """
    if isinstance(draft_model, SuffixDraft):
        return DraftSpec(NamedDraft.SUFFIX, store=draft_model)
    if isinstance(draft_model, str) and draft_model == NamedDraft.SUFFIX:
        return DraftSpec(NamedDraft.SUFFIX, store=SuffixDraft())
    if isinstance(draft_model, PreparedDraft):
        return DraftSpec(DraftKind.PREPARED, draft_model)
    if isinstance(draft_model, PreTrainedModel):
        return DraftSpec(DraftKind.MODEL, draft_model)
    if isinstance(draft_model, str) and draft_model in (NamedDraft.AUTO, NamedDraft.PROMPT_LOOKUP):
        return DraftSpec(NamedDraft(draft_model))
    raise TypeError(
        f"draft_model must be a transformers causal LM (e.g. AutoModelForCausalLM.from_pretrained(...)), "
        f"a PreparedDraft, '{NamedDraft.AUTO}' (a draft made from the target), '{NamedDraft.PROMPT_LOOKUP}' "
        f"(n-gram continuations from the prompt and text so far), '{NamedDraft.SUFFIX}' or a SuffixDraft (trees "
        f"of what followed the text's end in the call and in earlier calls), got {draft_model!r}."
    )


def prepare_draft(
    draft: PreTrainedModel | str,
    target: PreTrainedModel,
    *,
    form: DraftForm | str = DraftForm.AUTO,
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
            the target (a quantized copy on the CPU, a view skipping the middle fifth of its layers elsewhere or with
            `form="as_given"`).
        target: the model whose `generate()` will use the draft.
        form: AUTO (default: for a float draft on the CPU, the fastest of its forms on this machine, timed here: as
            given, DYNAMIC_INT8 (torch's dynamic int8) and, for a bf16 draft, INT8_WEIGHTS (int8 weights on the
            small-rows kernel) and with `calibration` INT4_WEIGHTS (int4 weights, CPUs with AVX-512 VNNI or BF16),
            each weighed by its measured acceptance (`form_choice.weighed_forms`); the draft as given elsewhere), or
            one of those forms (forced; CPU float drafts only), or AS_GIVEN. Where AUTO chose a quantized form, it
            also times it against the draft as given over prompt lengths (`form_choice.PROMPT_LENGTHS`); the
            draft's forwards of many positions run on the faster (`PreparedDraft.wide`).
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

    For a tensor-parallel target, AUTO chooses without the clock (as a seeded `generate()` call does), so that
    every rank prepares the same form.

    Returns:
        A `PreparedDraft`. A quantized copy is a snapshot of the draft's weights: prepare again after changing them.

    Raises:
        ValueError / TypeError: a draft `generate(draft_model=...)` would refuse, options out of range, or a quantized
            form for a draft that is not a float model on the CPU.
    """
    spec = resolve_draft(draft)
    if spec.kind not in (DraftKind.MODEL, NamedDraft.AUTO):
        raise TypeError(f"prepare_draft takes a causal LM or '{NamedDraft.AUTO}', got {draft!r}.")
    target_facts = ModelFacts.of(target)
    draft_facts = ModelFacts.of(spec.model) if spec.kind is DraftKind.MODEL and spec.model is not None else None
    tokenizers = check_draft(spec, target_facts, draft_facts, (tokenizer, draft_tokenizer))
    other_tokenizer = tokenizers is not None
    if other_tokenizer and vocabulary is not None:
        raise ValueError(OTHER_TOKENIZER_VOCABULARY)
    form = parse_choice(DraftForm, form, "form")
    ids = vocabulary_ids(
        vocabulary, shared_width(target_facts, draft_facts), special_token_ids(target.generation_config)
    )
    clock_free = target_facts.tensor_parallel  # every rank must choose the same form
    # AUTO's timings run the target under its routing; any other form times nothing (and builds no kernel for it)
    if form is DraftForm.AUTO:
        target_routing = KernelRouting.for_model(target_facts, LinearKernel.AUTO, clock_free=clock_free)
    else:
        target_routing = KernelRouting.off("off: nothing timed")
    calibration = None if other_tokenizer else calibration
    prepared = build_draft(
        DraftRecipe(spec, target_facts, draft_facts, form, ids, target_routing, calibration, clock_free)
    )
    if not other_tokenizer:
        return prepared
    shared = shared_vocabulary(tokenizer, draft_tokenizer, target_facts.logit_width, prepared.logit_width)
    return replace(prepared, tokenizers=tokenizers, shared_vocabulary=shared)


def check_draft(
    spec: DraftSpec, target: ModelFacts, draft: ModelFacts | None, tokenizers: tuple[Any, Any] | None
) -> tuple[Any, Any] | None:
    """The refusals of a draft for a target that need no forward, asked by `prepare_draft` and by `call_plan.plan_call`
    alike (nothing else makes them): both models (`validation.check_models`), then which token ids the draft reads
    (`validation.check_tokenizers`; a `PreparedDraft` holding its tokenizers was compared by `prepare_draft`).

    Args:
        spec: `draft_model=` resolved; `draft`: its model's facts (None for "auto" and "prompt_lookup").
        tokenizers: (the target's tokenizer, the draft's) as given: (target's, None) where only the target's is
            known (`tokenizer=` alone: the draft's width is checked against its vocabulary); None or (None, None)
            for neither.

    Returns:
        (target tokenizer, draft tokenizer) where the draft reads another tokenizer's ids, else None.

    Raises:
        ValueError: a model that cannot be used, the draft's tokenizer without the target's, or a draft that reads
            other ids than the target's without both tokenizers to say which.
    """
    check_models(target, draft)
    if tokenizers is not None and tokenizers[0] is None and tokenizers[1] is not None:
        raise ValueError("Pass the target's `tokenizer=` with the draft's `draft_tokenizer=`: they are compared.")
    target_tokenizer = tokenizers[0] if tokenizers is not None else None
    both = tokenizers if tokenizers is not None and tokenizers[1] is not None else None
    prepared = spec.prepared
    held = prepared.tokenizers if prepared is not None else None
    if held is not None and (both is None or same_tokenizers(both, held)):
        return held
    width = prepared.logit_width if prepared is not None else draft.logit_width if draft is not None else None
    named = spec.kind if isinstance(spec.kind, NamedDraft) else None
    other_tokenizer = check_tokenizers(target.logit_width, width, both, named, target_tokenizer)
    return both if other_tokenizer else None


def same_tokenizers(pair: tuple[Any, Any], other: tuple[Any, Any] | None) -> bool:
    """Whether two (target tokenizer, draft tokenizer) pairs are the very same objects."""
    return other is not None and pair[0] is other[0] and pair[1] is other[1]


OTHER_TOKENIZER_VOCABULARY = (
    "A draft with another tokenizer drafts over the tokens both vocabularies share, so an FR-Spec draft_vocabulary "
    "(target ids) cannot restrict its LM head, whose rows are the draft's own ids. Drop draft_vocabulary / "
    "prepare_draft(vocabulary=...) for this draft."
)


def shared_width(target: ModelFacts, draft: ModelFacts | None) -> int:
    """The ids both models score (a draft made from the target: all of the target's): an FR-Spec vocabulary must
    lie below this."""
    return min(target.logit_width, draft.logit_width if draft is not None else target.logit_width)


class DraftRecipe(NamedTuple):
    """What a prepared draft is made from (`build_draft`), and what the implicit drafts are kept by
    (`implicit._IMPLICIT`).

    Attributes:
        spec: a model (`DraftKind.MODEL`, whose facts are `draft`) or "auto" (`NamedDraft.AUTO`: draft is None).
        target, draft: the models' facts.
        form: the form asked for (`DraftForm.AUTO`: chosen here).
        ids: `(n,)` the FR-Spec ids its head keeps, or None.
        target_routing: the target's kernel routing under `LinearKernel.AUTO` (clock-free where `clock_free`): the
            target's forwards in AUTO's timings and acceptance measurements run under it.
        calibration: `(length,)` target token ids AUTO measures the forms' acceptance on, or None.
        clock_free: AUTO chooses without timing (the choice depends on the weights alone).
        kernel: AUTO may weigh the small-rows kernel's forms (the call's `linear_kernel` is not "off").
    """

    spec: DraftSpec
    target: ModelFacts
    draft: ModelFacts | None
    form: DraftForm
    ids: torch.Tensor | None
    target_routing: KernelRouting
    calibration: torch.Tensor | None = None
    clock_free: bool = False
    kernel: bool = True


def build_draft(recipe: DraftRecipe) -> PreparedDraft:
    """Make the prepared draft: the model (the target for "auto"), its restricted head, then the form asked for.

    AUTO: the forms the draft can take here among `form_choice.weighed_forms` (as given, dynamic int8, for a bf16
    draft int8 weights and with calibration text int4 weights; for "auto", the target's quantized forms, else a view
    skipping its middle layers), chosen by `form_choice.choose_form` (timed, or clock-free).
    """
    spec, target, draft, form, ids, target_routing, calibration, clock_free, kernel = recipe
    is_self = spec.kind is NamedDraft.AUTO
    if is_self and target.tensor_parallel:  # every rank raises alike, before any collective
        raise ValueError(
            "draft_model='auto' builds the draft from the target's weights, which a tensor-parallel target holds in "
            "shards (one per rank). Load a small model of the same tokenizer on every rank and pass it as "
            "draft_model= (a replica per rank), or use draft_model='prompt_lookup'."
        )
    source = target if is_self else draft
    assert source is not None  # a model draft comes with its facts
    model, width = source.model, source.logit_width
    if form is DraftForm.AUTO:  # int4 drafts worse: weighed only where acceptance is measured
        weighed = weighed_forms(model, kernel)
        wanted = [made for made in weighed if made is not DraftForm.INT4_WEIGHTS or calibration is not None]
    else:
        wanted = [] if form is DraftForm.AS_GIVEN else [form]
    makers = quantized_forms(model, wanted)  # builds the kernel only where a wanted form runs on it
    if form not in (DraftForm.AUTO, DraftForm.AS_GIVEN) and form not in makers:
        raise ValueError(CANNOT_MAKE[form])
    quantized = list(makers)
    if is_self and not quantized:  # the target as given is no draft: a view skipping its middle layers
        if target.keeps_state:
            raise ValueError(
                f"draft_model='auto' here skips layers of the target, and {type(model).__name__} keeps convolution "
                "or recurrent states, whose per-layer config (which layers are convolutions, recurrences or "
                "attention) a layer-skipping view does not renumber. Pass a small model of the same tokenizer as "
                "draft_model=, or use draft_model='auto' on the CPU with draft_form='dynamic_int8' (a quantized copy "
                "of the whole target)."
            )
        model = layer_skip_draft(model, default_layers_to_keep(model.config.get_text_config().num_hidden_layers))
    if ids is not None:
        model = restrict_vocabulary(model, ids)
    self_draft_of = weakref.ref(target.model) if is_self else None
    if not quantized:
        return PreparedDraft(model, ids, width, DraftForm.AS_GIVEN, self_draft_of)
    logger.info("hf_specsample: making the draft's %s form(s)", ", ".join(map(str, quantized)))
    forms = {made: makers[made](model) for made in quantized}
    if form is DraftForm.AUTO and not is_self:
        forms = {DraftForm.AS_GIVEN: model, **forms}
    if len(forms) == 1:
        ((made, drafter),) = forms.items()
        return PreparedDraft(drafter, ids, width, made, self_draft_of)
    plain = source if model is source.model else ModelFacts.of(model, same_config=source)
    choice = choose_form(forms, plain, target, target_routing, ids, calibration, clock_free, kernel)
    return PreparedDraft(
        forms[choice.form],
        ids,
        width,
        choice.form,
        self_draft_of,
        step_seconds=choice.step_seconds,
        acceptance=choice.acceptance,
        step_bytes=choice.step_bytes,
        wide=choice.wide,
        wide_seconds=choice.wide_seconds,
    )


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"
