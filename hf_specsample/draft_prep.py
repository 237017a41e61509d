"""Making the draft cheap without touching the target: only the target defines the output distribution.

Three levers, each an option of `SpeculativeConfig`:

- `draft_quantization`: a dynamic-int8 copy of a float CPU draft (torch's fbgemm kernels). On the CPU this was
  measured to run a single-token step of Qwen2.5-Coder-0.5B in 41 ms where bf16 takes 132 ms and float32 113 ms.
  Quantization changes the draft's distribution a little (acceptance moves by a few points either way) and the
  output distribution not at all. Default AUTO: on for float drafts on the CPU, off elsewhere.
- `draft_vocabulary` (the FR-Spec idea): the draft scores only a subset of frequent tokens, so its LM head and
  its logits processing shrink. Exact because the draft's probabilities are those of the distribution it really
  sampled from (zero outside the subset); the cost is that a token outside the subset can never be drafted.
- `draft_model="auto"`: a self-draft for targets with no small sibling: an int8 copy of the target on the CPU,
  a layer-skipping view of it elsewhere.

Prepared drafts are cached per draft model (weakly), so the one-time cost is paid on the first call only.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
import weakref
from dataclasses import dataclass
from enum import Enum

import torch
from transformers import PreTrainedModel

from .self_draft import default_layers_to_keep, layer_skip_draft
from .validation import vocab_size

logger = logging.getLogger(__name__)

AUTO_DRAFT = "auto"  # draft_model="auto": build a draft from the target


class DraftQuantization(str, Enum):
    AUTO = "auto"  # int8 for float drafts on the CPU, unchanged otherwise
    NONE = "none"
    INT8 = "int8"  # dynamic int8 (CPU only)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PreparedDraft:
    """The draft model the loop runs, and the token ids its logits stand for (None: the whole vocabulary)."""

    model: PreTrainedModel
    vocabulary: torch.Tensor | None = None  # (subset,) long, sorted


def _is_plain_cpu_float(model: PreTrainedModel) -> bool:
    """Float weights, all on the CPU, no bitsandbytes / accelerate dispatch: safe to copy and quantize."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "hf_device_map", None) is not None:
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


def int8_dynamic_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` (float32) whose `nn.Linear` layers are dynamically quantized to int8 (CPU)."""
    engine = int8_engine()
    if engine is None:
        raise RuntimeError("this torch build has no quantized CPU engine for dynamic int8 (fbgemm/x86/qnnpack).")
    quantized = copy.deepcopy(model).float().eval()
    with _quantized_engine(engine), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(deprecated|quantize_per_tensor).*")
        torch.ao.quantization.quantize_dynamic(quantized, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return quantized


def restrict_vocabulary(model: PreTrainedModel, token_ids: torch.Tensor) -> PreTrainedModel:
    """A view of `model` whose LM head scores only `token_ids` (logits of width `len(token_ids)`).

    The head is a new `nn.Linear` holding the selected rows; every other weight is shared with `model`.
    """
    from .self_draft import _shallow_clone  # the module-cloning helper shared with layer_skip_draft

    head = model.get_output_embeddings()
    weight = head.weight.detach()[token_ids.to(head.weight.device)]
    compact = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    compact.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    view = _shallow_clone(model)
    name = next(name for name, module in model.named_children() if module is head)
    view._modules[name] = compact
    return view


class _Cache:
    """Prepared drafts per (draft model, options), dropped with the draft model."""

    def __init__(self):
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, owner: PreTrainedModel, key: tuple, build) -> PreparedDraft:
        entries = self._entries.setdefault(owner, {})
        if key not in entries:
            entries[key] = build()
        return entries[key]


_CACHE = _Cache()


def _vocabulary_key(vocabulary: torch.Tensor | None) -> tuple:
    return () if vocabulary is None else (vocabulary.numel(), int(vocabulary.sum()), int(vocabulary[-1]))


def prepare_draft(
    draft: PreTrainedModel | str,
    target: PreTrainedModel,
    quantization: DraftQuantization,
    vocabulary: torch.Tensor | None,
    target_width: int | None = None,
) -> PreparedDraft:
    """The draft the loop will run: the user's draft (or an "auto" self-draft), restricted and quantized.

    Args:
        vocabulary: FR-Spec token ids (sorted, within both models' logit widths), or None.
        target_width: the target's logit width. A draft of another width (a padded vocabulary: Qwen2.5-7B and up
            have 152064 logit rows, their small siblings 151936) drafts over the ids both have: the returned
            vocabulary is then ``0 .. min(widths) - 1`` unless an FR-Spec subset was asked for.
    """
    quantization = DraftQuantization(quantization)
    owner = target if draft == AUTO_DRAFT else draft
    key = (draft == AUTO_DRAFT, quantization, _vocabulary_key(vocabulary))
    prepared = _CACHE.get(owner, key, lambda: _build(draft, target, quantization, vocabulary))
    draft_width = _logit_width(owner)
    if prepared.vocabulary is None and target_width is not None and draft_width != target_width:
        return PreparedDraft(prepared.model, torch.arange(min(draft_width, target_width)))
    return prepared


def _logit_width(model: PreTrainedModel) -> int:
    return vocab_size(model)


def _build(draft, target, quantization: DraftQuantization, vocabulary: torch.Tensor | None) -> PreparedDraft:
    model = target if draft == AUTO_DRAFT else draft
    if draft == AUTO_DRAFT and not (_is_plain_cpu_float(target) and int8_engine()):
        layers = target.config.get_text_config().num_hidden_layers
        model = layer_skip_draft(target, default_layers_to_keep(layers))
        quantization = DraftQuantization.NONE
    if vocabulary is not None:
        vocabulary = vocabulary.sort().values
        model = restrict_vocabulary(model, vocabulary)
    wants_int8 = quantization is DraftQuantization.INT8 or (
        quantization is DraftQuantization.AUTO and _is_plain_cpu_float(model) and int8_engine() is not None
    )
    if wants_int8:
        if not _is_plain_cpu_float(model):
            raise ValueError(
                "draft_quantization='int8' needs a float draft on the CPU without bitsandbytes or device_map "
                "dispatch; use draft_quantization='none' (or 'auto') for this draft."
            )
        logger.info("hf_specsample: making a dynamic-int8 copy of the draft (once per draft model)")
        model = int8_dynamic_copy(model)
    elif draft == AUTO_DRAFT and vocabulary is None and model is target:
        raise ValueError("draft_model='auto' with draft_quantization='none' would draft with the target itself.")
    return PreparedDraft(model, vocabulary)
