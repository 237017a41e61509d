"""What the library needs to know about a model, found once per call: `ModelFacts.of(model)`.

A call asks many questions of each model it runs: how wide its logits are, what its cache is made of (attention,
convolution and recurrent state layers), whether it can be compiled, where its inputs go, what its forward takes,
whether it is sharded. Each is answered here, once, into a frozen `ModelFacts` that the call's plan
(`plan/call_plan.py`) hands to whoever needs it; nothing else inspects a model. The cache layer types the library can
roll back row by row are named here too (`SUPPORTED_LAYERS`), below every module that moves them (`cache/`).

Glossary (`docs/ARCHITECTURE.md` has the whole list): a model's **logit width** is the size of its logits' last
dimension, `vocab_size` of its config or more (a padded head), the ids it scores.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticLayer,
)

from . import transformers_api

# Every cache layer type `cache.row_ops` and `cache.linear_states` move row by row -> the class of its attention part
# (None: no keys and values).
ATTENTION_PART: dict[type, type[Any] | None] = {  # type[Any]: the layer classes' attributes are read by name
    DynamicLayer: DynamicLayer,
    DynamicSlidingWindowLayer: DynamicSlidingWindowLayer,
    StaticLayer: StaticLayer,
    LinearAttentionLayer: None,
    LinearAttentionAndFullAttentionLayer: DynamicLayer,
    LinearAttentionAndSlidingWindowAttentionLayer: DynamicSlidingWindowLayer,
    LinearAttentionAndStaticFullAttentionLayer: StaticLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer: StaticLayer,
    DummyLayer: None,  # a layer without attention (MLP / MoE only); KV-sharing models are refused by their config
}
SUPPORTED_LAYERS = tuple(ATTENTION_PART)
LinearLayer = LinearAttentionCacheLayerMixin  # a layer with a linear-attention part (convolution / recurrent states)


def unsupported_layers(cache: Cache) -> list[str]:
    """Names of the cache's layer types that cannot be moved row by row (empty if all are supported)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return [type(cache).__name__]
    return sorted({type(layer).__name__ for layer in layers if type(layer) not in SUPPORTED_LAYERS})


def linear_layers(cache: Cache) -> Iterator[tuple[int, LinearLayer]]:
    """(index, layer) of every layer of `cache` with a linear-attention part."""
    for index, layer in enumerate(getattr(cache, "layers", ())):
        if isinstance(layer, LinearLayer):
            yield index, layer


class Role(str, enum.Enum):
    """What a model is to a call: the target verifies several positions per forward from its cached state."""

    TARGET = "target"
    DRAFT = "draft"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """One model, inspected once (`of`).

    Attributes:
        model: the model.
        logit_width: the width of its logits (its LM head's output size, else the config's vocabulary size).
        embeddable: rows of its input embedding (ids at or above it cannot be fed).
        cache_problem: why its cache cannot be rolled back row by row (as a draft), or None.
        scan_restarts_from_zero: its recurrent layers restart every multi-token forward from a zero state
            (transformers' Mamba-1): it drafts one token per forward and cannot verify (`problem_as`).
        keeps_state: its cache holds convolution or recurrent states (a hybrid or state-space model).
        compile_problem: why its forward cannot be compiled here, or None.
        tensor_parallel: sharded over an initialised process group of more than one rank.
        largest_linear: its largest plain `nn.Linear` weight (what the small-rows kernel is checked and timed on),
            or None.
        input_device: where its input ids go (accelerate's execution device for a dispatched model).
        cache_name: the keyword its forward takes its cache under (None: it takes none).
        takes_position_ids, takes_logits_to_keep: what its forward takes.
        dynamic_int8: it has torch's dynamic int8 linears (`draft_form="dynamic_int8"`).
        unloaded: some of its weights are on the `meta` device and no accelerate hook loads them (a model built
            under `init_empty_weights` or moved with `.to("meta")`): nothing to run.
        position_limit: the positions its learned position table embeds (GPT-2's `n_positions`, OPT's
            `max_position_embeddings`): a forward at position `position_limit` or beyond fails. None where positions
            have no hard end (rotary, ALiBi, none).
    """

    model: PreTrainedModel
    logit_width: int
    embeddable: int
    cache_problem: str | None
    scan_restarts_from_zero: bool
    keeps_state: bool
    compile_problem: str | None
    tensor_parallel: bool
    largest_linear: torch.Tensor | None
    input_device: torch.device
    cache_name: str | None
    takes_position_ids: bool
    takes_logits_to_keep: bool
    dynamic_int8: bool
    unloaded: bool
    position_limit: int | None

    @classmethod
    def of(cls, model: PreTrainedModel, same_config: ModelFacts | None = None) -> ModelFacts:
        """Inspect `model`. `same_config`: the facts of a model of the same class and config (a prepared draft's
        source), whose cache questions (what its config's cache holds) are not asked again."""
        if same_config is not None:
            cache_problem, keeps_state = same_config.cache_problem, same_config.keeps_state
            restarts, cache_name = same_config.scan_restarts_from_zero, same_config.cache_name
        else:
            cache_problem, keeps_state = _cache_kind(model)
            restarts, cache_name = transformers_api.scan_restarts_from_zero(model), _forward_cache_name(model)
        parameters = inspect.signature(model.forward).parameters
        tensor_parallel = _tensor_parallel(model)
        embeddings = model.get_input_embeddings()
        return cls(
            model=model,
            logit_width=logit_width(model),
            embeddable=int(
                getattr(embeddings, "num_embeddings", None) or cast(torch.Tensor, embeddings.weight).shape[0]
            ),
            cache_problem=cache_problem,
            scan_restarts_from_zero=restarts,
            keeps_state=keeps_state,
            compile_problem=_compile_problem(model, keeps_state, tensor_parallel),
            tensor_parallel=tensor_parallel,
            largest_linear=_largest_linear(model),
            input_device=input_device(model),
            cache_name=cache_name,
            takes_position_ids="position_ids" in parameters,
            takes_logits_to_keep="logits_to_keep" in parameters,
            dynamic_int8=any(isinstance(module, _DYNAMIC_INT8_LINEAR) for module in model.modules()),
            unloaded=any(p.device.type == "meta" for p in model.parameters())
            and not any(hasattr(module, "_hf_hook") for module in model.modules()),
            position_limit=position_limit(model),
        )

    def problem_as(self, role: Role) -> str | None:
        """Why this model cannot be the call's `role`, or None (a Mamba-1 model drafts but cannot verify)."""
        if self.cache_problem is not None or role is Role.DRAFT or not self.scan_restarts_from_zero:
            return self.cache_problem
        return (
            f"{type(self.model).__name__}'s Mamba-1 layers cannot continue a forward of several tokens from a cached "
            "state (transformers' selective scan starts each such forward from a zero state), so the target cannot "
            "verify drafts in one forward. It can still serve as the draft of another target"
        )


_DYNAMIC_INT8_LINEAR = torch.ao.nn.quantized.dynamic.Linear


def logit_width(model: PreTrainedModel) -> int:
    """The width of the model's logits: its LM head's output size, else the config's vocabulary size."""
    head = model.get_output_embeddings()
    out_features = getattr(head, "out_features", None)
    if out_features is None and getattr(head, "weight", None) is not None:
        out_features = head.weight.shape[0]
    return int(out_features) if out_features is not None else int(model.config.get_text_config().vocab_size)


def position_limit(model: PreTrainedModel) -> int | None:
    """The positions `model`'s learned position table embeds, or None where positions have no hard end.

    A table has as many rows as the config's `max_position_embeddings` (GPT-2's `n_positions`), or up to two more (OPT
    and BioGPT offset positions by 2): an embedding other than the input embedding (GPT-2, OPT, GPT-Neo, BioGPT), or a
    fixed buffer of positions (GPT-J's and CodeGen's sines and cosines, CTRL's encoding). Rotary models name a
    `max_position_embeddings` too, but hold no such table: they run past it, as plain `generate()` lets them.
    """
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    inputs = model.get_input_embeddings()
    rows = [
        module.num_embeddings
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module is not inputs
    ]
    rows += [buffer.shape[0] for name, buffer in model.named_buffers() if "pos" in name and buffer.dim() == 2]
    return limit if any(limit <= count <= limit + 2 for count in rows) else None


def _forward_cache_name(model: PreTrainedModel) -> str | None:
    return transformers_api.forward_cache_name(model)


def _cache_kind(model: PreTrainedModel) -> tuple[str | None, bool]:
    """(why its cache cannot be rolled back per row, or None; whether it keeps convolution / recurrent states).

    A model qualifies when its forward takes a cache and the `DynamicCache` built from its config would hold
    attention layers (full or sliding window) and transformers' convolution / recurrent state layers, in any mix:
    hybrids (Jamba, Qwen3.5, LFM2, ...) and state-space models (Mamba-2, ...). The layers are read off the config
    (`transformers_api.cache_layer_classes`), not built: the call's caches are the only ones it makes.
    """
    if transformers_api.forward_cache_name(model) is None:
        return f"{type(model).__name__}'s forward takes no cache", False
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        own = "keeps a cache of its own, not a DynamicCache (transformers says so itself)"
        return f"{type(model).__name__} {own}", False
    try:
        layers = transformers_api.cache_layer_classes(model.config)
    except Exception as error:  # noqa: BLE001 (any config this cannot build a cache for is refused)
        return f"no DynamicCache can be built for {type(model).__name__} ({error})", False
    keeps_state = any(issubclass(layer, LinearLayer) for layer in layers)
    if "reuse" in (getattr(model.config.get_text_config(decoder=True), "kv_sharing_modes", None) or ()):
        return (
            f"{type(model).__name__}'s layers reuse keys and values shared with other layers (KV sharing), which "
            "hf_specsample cannot roll back row by row"
        ), keeps_state
    unsupported = sorted({layer.__name__ for layer in layers if layer not in SUPPORTED_LAYERS})
    if unsupported:
        return (
            f"{type(model).__name__}'s cache has layers of type {', '.join(unsupported)} (for instance a sparse-"
            "attention indexer), which hf_specsample cannot roll back row by row"
        ), keeps_state
    return None, keeps_state


def _tensor_parallel(model: PreTrainedModel) -> bool:
    """True when `model` is sharded over an initialised process group of more than one rank."""
    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and (getattr(model, "tp_size", None) or 1) > 1
    )


def _compile_problem(model: PreTrainedModel, keeps_state: bool, tensor_parallel: bool) -> str | None:
    """Why `model`'s forward cannot be compiled here, or None.

    As plain `generate()` decides (`_valid_auto_compile_criteria`): a quantizer that is not compileable, CPU or disk
    offload (accelerate hooks move weights during the forward). Tensor-parallel models are left eager too, and so
    are hybrid and state-space models (their convolution histories grow between rollbacks, and their recurrent
    states are swapped for snapshots: `cache.checkpoints`).
    """
    if keeps_state:
        return "it keeps convolution / recurrent states, which hf_specsample rolls back in eager forwards only"
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return f"its quantization ({type(quantizer).__name__}) cannot be compiled"
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        devices = set(device_map.values())
        if "disk" in devices or ("cpu" in devices and len(devices) > 1):
            return "it is offloaded by accelerate (device_map with CPU or disk parts)"
    if tensor_parallel:
        return "it is tensor-parallel"
    return None


def _largest_linear(model: torch.nn.Module) -> torch.Tensor | None:
    weights = [
        module.weight
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and type(module.weight) is torch.nn.Parameter
    ]
    return max(weights, key=lambda weight: weight.numel(), default=None)


def input_device(model: PreTrainedModel) -> torch.device:
    """The device a model's input ids must be on.

    For an accelerate-dispatched model (`device_map=...`, CPU/disk offload) that is the execution device of the
    hook on the embedding (or on a module holding it): offloaded weights sit on the `meta` device. Otherwise it
    is the embedding weight's device.
    """
    embeddings = model.get_input_embeddings()
    for module in (embeddings, getattr(model, "base_model", None), model):
        hook = getattr(module, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    weight_device = cast(torch.Tensor, embeddings.weight).device  # torch types a submodule's attribute loosely
    return weight_device if weight_device.type != "meta" else torch.device("cpu")
