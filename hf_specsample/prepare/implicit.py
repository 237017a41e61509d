"""The drafts `generate(draft_model=model)` prepares itself, kept so that a quantized copy is made once per model.

`draft_for_call` gives a call its `PreparedDraft`: the caller's own as it is, or the implicit one from `_IMPLICIT`,
the only cache of prepared drafts: weakly keyed by the draft model (the target for "auto"), so it is freed with
that model, keyed by exactly the options asked for, and rebuilt when the model's weights changed since
(`_ImplicitDrafts`).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any, NamedTuple, cast

import torch
from transformers import PreTrainedModel

from ..core.model_facts import ModelFacts
from ..kernels.routing import KernelRouting
from ..options import DraftForm, NamedDraft
from .prepared_draft import (
    OTHER_TOKENIZER_VOCABULARY,
    DraftRecipe,
    DraftSpec,
    PreparedDraft,
    build_draft,
    shared_width,
)
from .vocabulary import vocabulary_ids


def draft_for_call(
    spec: DraftSpec,
    target: ModelFacts,
    draft: ModelFacts | None,
    form: DraftForm,
    vocabulary: torch.Tensor | int | None,
    special_ids: list[int],
    target_routing: KernelRouting,
    other_tokenizer: bool = False,
    calibration: torch.Tensor | None = None,
    clock_free: bool = False,
    kernel: bool = True,
) -> PreparedDraft:
    """The prepared draft one `generate()` call runs: the caller's `PreparedDraft` as it is, or the implicit one.

    Args:
        spec: `draft_model=` resolved (a model, a `PreparedDraft` or "auto"); `draft`: its model's facts (None
            for "auto").
        form, vocabulary: the call's `speculative_config` options.
        target_routing: the target's kernel routing under `LinearKernel.AUTO` (AUTO's timings run the target under it).
        special_ids: the call's EOS / padding / BOS ids (an int `vocabulary` keeps them).
        calibration: `(length,)` target token ids of representative text (the call's prompt): where the implicit
            draft is made under AUTO, its forms are weighed by acceptance on it too (`form_choice`).
        other_tokenizer: the draft reads another tokenizer's ids (`validation.check_tokenizers`): it may be
            quantized, but neither restricted to an FR-Spec vocabulary nor made from the target.
        clock_free: the call's output must not depend on the clock (a seeded call, a tensor-parallel target): AUTO
            then chooses the implicit draft's form without timing and without `calibration`, so that
            the choice depends on the draft's weights only, not on which call prepared it first.
        kernel: AUTO may weigh the small-rows kernel's forms (`form_choice.weighed_forms`): the call's `linear_kernel`
            is not "off".
    """
    prepared = spec.prepared
    if other_tokenizer:
        if vocabulary is not None or (prepared is not None and prepared.vocabulary is not None):
            raise ValueError(OTHER_TOKENIZER_VOCABULARY)
        if prepared is not None and prepared.self_draft_of is not None:
            raise ValueError(
                "This PreparedDraft was made by prepare_draft('auto', ...) from the target, so it drafts in the "
                "target's own ids: drop `draft_tokenizer=` / `assistant_tokenizer=` for it."
            )
    if prepared is not None:
        if form is not DraftForm.AUTO or vocabulary is not None:
            raise ValueError(
                "draft_model= is a PreparedDraft, whose form and vocabulary were fixed by prepare_draft(): set them "
                "there (prepare_draft(draft, target, form=..., vocabulary=...)), not in speculative_config."
            )
        return prepared
    ids = vocabulary_ids(vocabulary, shared_width(target, draft), special_ids)
    # Clock-free, the implicit draft is chosen from the weights alone: weighed on this call's prompt, the choice (so
    # a seeded sample) would depend on which call first prepared the draft in this process.
    calibration = None if other_tokenizer or clock_free else calibration
    return _IMPLICIT.get(DraftRecipe(spec, target, draft, form, ids, target_routing, calibration, clock_free, kernel))


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
            self.name,
            self.version,
            self.data_ptr,
            self.dtype,
        ) and self.tensor() is tensor


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
    - Per model, keyed by exactly the options: the quantization asked for and the full vocabulary ids (under AUTO:
      whether the choice is clock-free, and whether it may weigh the kernel's forms).
    - Valid while the model's weights are unchanged: every parameter and buffer is the same object, with the same
      storage and the same in-place version counter as when the entry was made; otherwise every entry of that
      model is rebuilt. Writes through `.data` (`p.data.copy_(...)`) bypass torch's version counter, and weights
      made under `torch.inference_mode` have none: such in-place writes are not seen; after them, pass
      `prepare_draft(draft, target)` yourself. Output stays exact either way; a stale copy only drafts worse.
    """

    def __init__(self):
        self._entries: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, _Entry]] = weakref.WeakKeyDictionary()

    def get(self, recipe: DraftRecipe) -> PreparedDraft:
        """The entry for `recipe`, made (`prepared_draft.build_draft`) where there is none. A clock-free choice is
        kept apart from a timed one, and one that may weigh the kernel's forms from one that may not: the same
        options may choose differently."""
        is_self = recipe.spec.kind is NamedDraft.AUTO
        owner_facts = recipe.target if is_self else recipe.draft
        assert owner_facts is not None  # a model draft comes with its facts
        owner = owner_facts.model
        how = (recipe.clock_free, recipe.kernel) if recipe.form is DraftForm.AUTO else None
        key = (is_self, recipe.form, None if recipe.ids is None else recipe.ids.numpy().tobytes(), how)
        weights = _named_weights(owner)
        # Entries made from other weights than the owner's current ones are stale: drop them (and their memory).
        entries = {k: entry for k, entry in self._entries.get(owner, {}).items() if entry.is_current(weights)}
        if key not in entries:
            prepared = build_draft(recipe)
            decided = prepared.step_seconds or prepared.step_bytes
            if prepared.model is owner and not decided:  # nothing made or decided: runs as given
                return prepared
            # None stands for the owner (see `_Entry`): typed Any, as `PreparedDraft.model` holds a model elsewhere
            stored = replace(prepared, model=cast(Any, None)) if prepared.model is owner else prepared
            if prepared.wide is not None and prepared.wide.model is owner:
                stored = replace(stored, wide=prepared.wide._replace(model=cast(Any, None)))
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
