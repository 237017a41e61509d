"""Model surgery for drafts: a model in, a model out, nothing timed or decided here (`prepare.form_choice` decides).

- quantized forms of a float CPU draft (`quantized_forms`): torch's dynamic int8 (`int8_dynamic_copy`), int8 or int4
  weights on the small-rows kernel (`int8_weights_copy`, `int4_weights_copy`; the q/k/v and gate/up projections of
  one input fused into one kernel call each, `kernels.quantized_linear.SiblingProjection`);
- `without_siblings`: a view of a quantized form whose fused projections are layers of their own (compiled steps);
- `restrict_vocabulary`: a view whose LM head scores an FR-Spec subset of the ids;
- `prepare.self_draft.layer_skip_draft`: a view of the target skipping its middle layers (`draft_model="auto"`).

Views share every module they do not replace with the model they were made from; copies share its input embedding.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Collection
from typing import Any, cast

import torch
from transformers import PreTrainedModel
from transformers.utils.quantization_config import QuantizationMethod

from ..kernels import small_rows
from ..kernels.quantized_linear import (
    SIBLING_GROUPS,
    Int4Linear,
    Int8Linear,
    SiblingProjection,
    fuse_siblings,
    linear_holding,
)
from ..options import DraftForm
from .self_draft import ModuleT, shallow_clone

CANNOT_MAKE = {
    DraftForm.DYNAMIC_INT8: (
        "draft_form='dynamic_int8' needs a float draft on the CPU without bitsandbytes or device_map dispatch, and a "
        "torch with a quantized CPU engine; use draft_form='as_given' (or 'auto') for this draft."
    ),
    DraftForm.INT8_WEIGHTS: (
        "draft_form='int8_weights' needs a float draft on the CPU without bitsandbytes or device_map dispatch, "
        "and hf_specsample's small-rows kernel (built at first use with a C++ compiler); use draft_form="
        "'as_given' (or 'auto') for this draft."
    ),
    DraftForm.INT4_WEIGHTS: (
        "draft_form='int4_weights' needs a float draft on the CPU without bitsandbytes or device_map "
        "dispatch, hf_specsample's small-rows kernel, and a CPU with AVX-512 VNNI or BF16 (the vector paths that "
        "read int4 weights about as fast as memory delivers them); use 'int8_weights' or 'auto' here."
    ),
}


KERNEL_FORMS = (DraftForm.INT8_WEIGHTS, DraftForm.INT4_WEIGHTS)  # the forms the small-rows kernel runs
QUANTIZED_FORMS = (DraftForm.DYNAMIC_INT8, *KERNEL_FORMS)


def quantized_forms(model: PreTrainedModel, forms: Collection[DraftForm] = QUANTIZED_FORMS) -> dict[DraftForm, Any]:
    """Those of `forms` that `model` can take here, each with the function that makes it. The small-rows kernel is
    built (`small_rows.load`) only where one of `forms` runs on it."""
    if not _is_plain_cpu_float(model):
        return {}
    makers = {}
    if DraftForm.DYNAMIC_INT8 in forms and int8_engine() is not None:
        makers[DraftForm.DYNAMIC_INT8] = int8_dynamic_copy
    if any(form in forms for form in KERNEL_FORMS) and small_rows.load().problem is None:
        if DraftForm.INT8_WEIGHTS in forms:
            makers[DraftForm.INT8_WEIGHTS] = int8_weights_copy
        # int4: where a vector path reads it
        if DraftForm.INT4_WEIGHTS in forms and small_rows.best_path(torch.uint8) is not small_rows.KernelPath.SCALAR:
            makers[DraftForm.INT4_WEIGHTS] = int4_weights_copy
    return makers


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
    def weight(self) -> torch.Tensor:
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
    # not .float(): refused for GGUF-loaded models. transformers wraps `to` in `functools.wraps(Module.to)`, whose
    # type takes the module as the first argument
    quantized = copy.deepcopy(model, memo).to(torch.float32).eval()  # type: ignore[arg-type]
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
    in Mamba-2's head, `self.down_proj.weight.dtype` in an Inkling MLP): those stay float in a quantized form, whose
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

    def replaced(module: ModuleT) -> ModuleT:
        clone = shallow_clone(module)
        for names in SIBLING_GROUPS:  # projections of one input: one kernel call (`SiblingProjection`)
            group = [getattr(module, name, None) for name in names]
            if all(_fusable(linear, group[0]) and id(linear) not in kept for linear in group):
                fusable = cast("list[torch.nn.Linear]", group)  # `_fusable` checked each is one
                for name, sibling in zip(names, fuse_siblings(fusable, make)):
                    clone._modules[name] = sibling
        for name, child in module.named_children():
            if clone._modules[name] is not child:
                continue  # fused above
            if _plain_linear(child) and id(child) not in kept:
                clone._modules[name] = make(child)
            elif any(_plain_linear(inner) for inner in child.modules()):
                clone._modules[name] = replaced(child)
        return clone

    return replaced(model).eval()


def _plain_linear(module: torch.nn.Module) -> bool:
    """An `nn.Linear` whose forward is `nn.Linear`'s: a subclass with its own (Llama-4's router returns a tuple)
    computes something else, which a replacement linear would not."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


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

    def replaced(module: ModuleT) -> ModuleT:
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
    quantized = linear_holding(weight.clone())
    view = shallow_clone(model)
    name = next(name for name, module in model.named_children() if module is head)
    view._modules[name] = quantized
    return view
