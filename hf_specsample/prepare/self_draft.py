"""Drafts made from the target itself, for targets with no small sibling sharing their tokenizer.

`layer_skip_draft` returns a view of the target that runs only some of its decoder layers. It shares every weight
with the target (no copy, no extra memory): only the module objects that carry a layer index are cloned, so that
the draft's own KV cache numbers its layers 0..n-1. `default_layers_to_keep` is the one choice of layers used by
`draft_model="auto"` (off the CPU), the benchmark's SmolLM2 pair and the real-model tests.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel

# Hook registries of an nn.Module: a clone starts with empty ones, so hooks on the target never fire for the draft.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def shallow_clone(module: ModuleT) -> ModuleT:
    """A new module object sharing parameters and buffers, with its own children and no torch hooks.

    An accelerate hook (device_map dispatch, offload) is re-attached to the clone: the `forward` accelerate
    installed is bound to the original module and would run the original's children.
    """
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    for name in _HOOK_DICTS:
        if name in module.__dict__:
            setattr(clone, name, type(module.__dict__[name])())
    if "_hf_hook" in module.__dict__:
        from accelerate.hooks import add_hook_to_module

        hook = clone.__dict__.pop("_hf_hook")
        for name in ("forward", "_old_forward"):
            clone.__dict__.pop(name, None)
        add_hook_to_module(clone, hook)
    return clone


def _decoder_layers(model: PreTrainedModel) -> tuple[torch.nn.Module, str]:
    """The module holding the decoder-layer `ModuleList`, and that list's attribute name."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return base, name
    raise ValueError(
        f"{type(model).__name__}: no decoder-layer list (`layers`, `h` or `blocks`) found under "
        f"{type(base).__name__}; layer skipping supports the common decoder layouts only."
    )


def _renumbered(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """A clone of a decoder layer whose layer-index attributes (its own and its children's) read `index`."""
    clone = shallow_clone(layer)
    if hasattr(clone, "layer_idx"):
        # torch types Module.__setattr__'s value as Tensor | Module; a module keeps any attribute
        clone.layer_idx = index  # type: ignore[assignment]
    for name, child in layer.named_children():
        if hasattr(child, "layer_idx"):
            child_clone = shallow_clone(child)
            # torch types Module.__setattr__'s value as Tensor | Module; a module keeps any attribute
            child_clone.layer_idx = index  # type: ignore[assignment]
            clone._modules[name] = child_clone
    return clone


def default_layers_to_keep(num_layers: int) -> list[int]:
    """The decoder layers a default self-draft runs: all but the middle fifth (at least one layer skipped).

    The first and last layers map tokens into and out of the model's representation; the middle ones refine it
    and are the cheapest to skip. How many: measured on SmolLM2-135M (30 layers; 3 prompts, greedy and sampling,
    K=3), alpha was 0.55 skipping the middle fifth (layers 12-17), 0.55 a sixth, 0.30 a quarter, 0.19 a third.
    """
    skipped = max(1, num_layers // 5) if num_layers > 1 else 0
    start = (num_layers - skipped) // 2
    return [index for index in range(num_layers) if not start <= index < start + skipped]


def layer_skip_draft(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """A draft that runs the target's embeddings, decoder layers `keep` (in order), final norm and LM head.

    Args:
        model: the target causal LM (any decoder with a `layers` / `h` / `blocks` list).
        keep: indices of the decoder layers to run, e.g. ``default_layers_to_keep(30)`` (all but 12-17).

    Returns:
        A model sharing all weights with `model`; it uses no extra parameter memory.
    """
    base, attribute = _decoder_layers(model)
    layers = getattr(base, attribute)
    keep = list(keep)
    if not keep or any(not 0 <= index < len(layers) for index in keep):
        raise ValueError(f"keep must be non-empty layer indices in [0, {len(layers)}), got {keep}.")

    config = copy.deepcopy(model.config)
    text_config = config.get_text_config(decoder=True)
    text_config.num_hidden_layers = len(keep)
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = [text_config.layer_types[index] for index in keep]

    new_base = shallow_clone(base)
    new_base._modules[attribute] = torch.nn.ModuleList(_renumbered(layers[index], i) for i, index in enumerate(keep))
    # torch types Module.__setattr__'s value as Tensor | Module; a module keeps any attribute
    new_base.config = text_config if getattr(base, "config", None) is not model.config else config  # type: ignore[assignment]

    draft = shallow_clone(model)
    draft.config = config
    _replace_submodule(draft, base, new_base)
    return draft


def _replace_submodule(root: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Replace `old` by `new` below `root`, cloning the modules on the path so that the target is untouched."""
    for name, child in root.named_children():
        if child is old:
            root._modules[name] = new
            return
        if any(module is old for module in child.modules()):
            child_clone = shallow_clone(child)
            if getattr(child_clone, "config", None) is not None and hasattr(new, "config"):
                child_clone.config = new.config
            root._modules[name] = child_clone
            _replace_submodule(child_clone, old, new)
            return
    raise ValueError("the decoder was not found below the model")
