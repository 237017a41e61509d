"""What hf_specsample borrows from transformers: names and private hooks, decided by what the installed version offers.

transformers 5.24 renamed the cache argument, the `model_kwargs` key and the output field from `past_key_values`
(and `cache_params`, for state-space models) to `cache`, and deprecated the old names. Every module that spelled the
old name broke at once. So the library spells none of them: it asks this module.

- `CACHE`: the name `generate()` uses for the cache in the keyword arguments it hands a decoding method and in the
  output objects it returns, read off `GenerateDecoderOnlyOutput`'s fields (not off a version string).
- `forward_cache_name(model)`: the name a model's own `forward` takes it under, read off its signature (a model
  with remote code may still take `past_key_values` on a transformers that renamed it).
- `CALLER_CACHE_NAMES` / `take_caller_cache`: the names `generate()` accepts from a caller, and the renaming it
  does itself (with its deprecation message) for the old ones.
- `leave_cache_to_call` / `NoCacheYet`: keeping `generate()` from building a cache that a call would throw away
  (its cache preparation skips a call given a cache).
- the private hooks the loop relies on: `valid_auto_compile`, `default_compile_config`, `pad_token_id`,
  `generation_defaults`.
- `cache_layer_classes(config)`: the layer classes of the cache transformers builds for a config, read as its
  constructor reads them, without building one.
- `additive_attention_mask`, `FOUR_D_MASK_ATTENTION`, `attention_implementation`: a draft tree's 4D mask, as the
  attention implementations that take one as given want it (`cache.tree_forward`).
- `scan_restarts_from_zero(model)`: whether a model's recurrent layers can continue a multi-token forward from a
  cached state, read off the installed modeling module's scan function.

`check_installed()` runs at `import hf_specsample`: an older transformers than `OLDEST_SUPPORTED` is refused with a
message naming the floor; a newer one than CI has tested gets a warning naming the tested range; a missing hook is
refused at import, never as a crash deep in a forward. `docs/internals.md` lists every transformers internal the
library relies on.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig, PreTrainedModel, cache_utils
from transformers.generation import utils as generation_utils

# The range CI runs the suite on (`.ci/run`): the floor is also `pyproject.toml`'s, the ceiling its upper bound's
# last release (a test keeps the three in step).
OLDEST_SUPPORTED = "5.23.0"
NEWEST_TESTED = "5.24.0"

# Cache names across the versions we know, newest first: 5.24's `cache`, then the names it deprecated.
_KNOWN_CACHE_NAMES = ("cache", "past_key_values", "cache_params")
# (the state-space models of transformers < 5.24 take their `DynamicCache` as `cache_params`)


def _output_cache_field() -> str:
    fields = getattr(generation_utils.GenerateDecoderOnlyOutput, "__dataclass_fields__", {})
    for name in _KNOWN_CACHE_NAMES:
        if name in fields:
            return name
    raise ImportError(
        f"hf_specsample cannot find the cache field of transformers {transformers.__version__}'s "
        f"GenerateDecoderOnlyOutput (looked for {', '.join(_KNOWN_CACHE_NAMES)}). {_WHAT_TO_DO}"
    )


_WHAT_TO_DO = (
    f"hf_specsample is tested with transformers {OLDEST_SUPPORTED} to {NEWEST_TESTED}: "
    f"`pip install 'transformers>={OLDEST_SUPPORTED},<={NEWEST_TESTED}'`, or upgrade hf_specsample."
)

CACHE: str = _output_cache_field()
"""The cache's name in `generate()`'s model kwargs and output objects: "cache" (5.24 on) or "past_key_values"."""

CALLER_CACHE_NAMES: tuple[str, ...] = (CACHE,) + (
    tuple(name for name in _KNOWN_CACHE_NAMES if name != CACHE) if CACHE == "cache" else ()
)
"""Every name under which `generate()` takes a caller's cache: the current one, then the deprecated ones it renames
(5.24: `cache`, `past_key_values`, `cache_params`; before: `past_key_values` only)."""


GENERATE_CACHE_NAMES: tuple[str, ...] = _KNOWN_CACHE_NAMES
"""Every key under which `generate()` may hand a decoding method the cache: `CACHE`, and on transformers < 5.24
`cache_params` for models whose class name contains "mamba" (Mamba, Mamba2, FalconMamba)."""


class NoCacheYet:
    """Stands where a caller's cache goes for a call whose decoding method makes the target's cache itself
    (`leave_cache_to_call`): `generate()` takes it for the caller's and so builds none of its own (its "user-defined
    cache" branch), and `generate_cache` reads it as no cache. It answers the one question `generate()` asks a
    caller's cache before decoding (its length, for position ids when there is no attention mask); a forward handed
    it would fail loudly, never run on it."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def leave_cache_to_call(model: Any, kwargs: dict[str, Any]) -> None:
    """Have `generate()` build no cache for a call given none, whose decoding method makes the target's own: a
    `NoCacheYet` where the caller's cache goes. Left out where `generate()` would not take it for one: beside a
    `cache_implementation` named anywhere (`generate()` refuses both at once), or for a model whose forward takes its
    cache under another name (a state-space model on transformers < 5.24)."""
    if kwargs.get(CACHE) is not None or forward_cache_name(model) != CACHE:
        return
    configs = (kwargs, kwargs.get("generation_config"), getattr(model, "generation_config", None))
    if any(_read(config, "cache_implementation") is not None for config in configs):
        return
    kwargs[CACHE] = NoCacheYet()


def _read(source: Any, name: str) -> Any:
    return source.get(name) if isinstance(source, dict) else getattr(source, name, None)


def generate_cache(model_kwargs: dict[str, Any]) -> Any:
    """The cache `generate()` handed a decoding method in its model kwargs (under `CACHE`, or `cache_params` where
    transformers < 5.24 passes a Mamba model's cache under that name), or None (a `NoCacheYet` too)."""
    found = (model_kwargs[name] for name in GENERATE_CACHE_NAMES if model_kwargs.get(name) is not None)
    return next((cache for cache in found if not isinstance(cache, NoCacheYet)), None)


def take_caller_cache(kwargs: dict[str, Any], stacklevel: int) -> bool:
    """Move a cache the caller passed under a deprecated name to `CACHE` in `kwargs`, as `generate()` would.

    `generate()` renames a deprecated name itself, with a `FutureWarning` at the caller's line; the registered
    wrapper does it before calling the original, so the message still points at the caller's line, not at ours.

    Args:
        kwargs: the `generate()` keyword arguments (changed in place).
        stacklevel: the caller's frame, counted from this function (as for `warnings.warn`).

    Returns:
        Whether the caller passed a cache (under any accepted name).
    """
    for name in CALLER_CACHE_NAMES[1:]:
        if name not in kwargs:
            continue
        if CACHE in kwargs:
            raise ValueError(f"Pass the cache once: `{CACHE}=` (not also `{name}=`).")
        warnings.warn(
            f"`{name}` is deprecated in transformers {transformers.__version__} for `generate`: use `{CACHE}` "
            "instead (transformers' own rename, done by hf_specsample's registered generate() so that this message "
            "points at your line).",
            FutureWarning,
            stacklevel=stacklevel + 1,
        )
        kwargs[CACHE] = kwargs.pop(name)
    return kwargs.get(CACHE) is not None


def forward_cache_name(model: PreTrainedModel) -> str | None:
    """The keyword under which `model.forward` takes its cache (None: it takes none).

    Read off the signature: a model with remote code may still take `past_key_values` where transformers renamed
    it, and a state-space model of transformers < 5.24 takes `cache_params`.
    """
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in _KNOWN_CACHE_NAMES if name in parameters), None)


def cache_kwargs(model: PreTrainedModel, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `model.forward(**...)`, under the name its forward takes (`forward_cache_name`)."""
    return {forward_cache_name(model) or CACHE: cache}


def output_cache(output: Any) -> Any:
    """The cache a model's forward (or `generate()`) returned, from its output object (a state-space model of
    transformers < 5.24 returns it as `cache_params`)."""
    for name in (CACHE,) + tuple(name for name in _KNOWN_CACHE_NAMES if name != CACHE):
        if name in output:
            return output[name]
    return getattr(output, CACHE, None)


# The scan function of transformers' Mamba-1 modeling modules (mamba, falcon_mamba, jamba, zamba), and the names an
# argument carrying the state to start from would have.
_SELECTIVE_SCAN = "mamba_selective_scan"
_INITIAL_STATE_ARGUMENTS = ("initial_state", "initial_states", "ssm_state", "prev_state", "recurrent_state")


def scan_restarts_from_zero(model: PreTrainedModel) -> bool:
    """Whether the model's recurrent layers start every forward of several tokens from a zero state.

    transformers' Mamba-1 mixers (Mamba, FalconMamba, Jamba, Zamba) run a prompt through `mamba_selective_scan`,
    whose reference implementation takes no initial state ("not supported by the kernel path"), and only a single
    token from the cached state. So a forward over K+1 positions on a cache computes them as if nothing came
    before. Read off the model's own modeling module: a scan function of that name without an initial-state
    argument.
    """
    module = sys.modules.get(type(model).__module__)
    scan = getattr(module, _SELECTIVE_SCAN, None)
    if scan is None:
        return False
    parameters = inspect.signature(scan).parameters
    return not any(name in parameters for name in _INITIAL_STATE_ARGUMENTS)


def cache_layer_classes(config: Any, static: bool = False) -> list[type]:
    """The classes of the layers a `DynamicCache(config=config)` (a `StaticCache`, where `static`) is made of, one per
    decoder layer, without making one: read as their constructors read them, the decoder's text config's layer
    types (`get_layer_types_and_kwargs`) looked up in the mapping a layer class registers its type in.

    Raises:
        Exception: whatever building that cache would raise on reading the config (an unknown layer type: KeyError).
    """
    layer_types, _ = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    mapping = cache_utils.STATIC_LAYER_TYPE_MAPPING if static else cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
    return [mapping[layer_type] for layer_type in layer_types]


def valid_auto_compile(model: PreTrainedModel, cache: Any, generation_config: GenerationConfig) -> bool:
    """Whether plain `generate()` would compile this model's decoding forward with this cache and config."""
    # A causal LM is a PreTrainedModel and a GenerationMixin; transformers' types have no class for both (the mixin
    # types its own `self` as a private protocol), so this method is unknown on a PreTrainedModel
    return bool(model._valid_auto_compile_criteria({CACHE: cache}, generation_config))  # type: ignore[operator]


def default_compile_config(model: PreTrainedModel):
    """The `CompileConfig` plain `generate()` compiles with when the generation config names none."""
    return model._default_compile_config()


def generation_defaults() -> dict[str, Any]:
    """The values `generate()` gives a generation config's unset (None) fields when neither the call nor the model's
    own config sets them (e.g. `num_assistant_tokens=20`)."""
    return dict(GenerationConfig._get_default_generation_params())


def pad_token_id(generation_config: GenerationConfig) -> Any:
    """The pad token `generate()` resolved for this call (a tensor, an int or None)."""
    return generation_config._pad_token_tensor


def plain_decoding(
    model: PreTrainedModel,
    input_ids: Any,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: GenerationConfig,
    streamer: Any,
    model_kwargs: dict[str, Any],
) -> Any:
    """Plain `generate()`'s own decoding loop for a call `generate()` prepared (`input_ids` `(batch, length)`, and
    what else a `custom_generate` callable receives): its tokens, or the error it raises."""
    if streamer is not None:
        streamer.put(input_ids.cpu())  # plain generate() hands the streamer the prompt before decoding
    model_kwargs = {name: value for name, value in model_kwargs.items() if not isinstance(value, NoCacheYet)}
    model_kwargs["streamer"] = streamer
    decode: Any = model._sample  # `Any`: a module's attributes read as tensors or modules to type checkers
    return decode(input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)


# Attention implementations that use a 4D mask handed to the forward as it is: transformers' mask builders
# (`masking_utils._preprocess_mask_arguments`, 5.23 and 5.24 alike) return a mask of 4 dimensions unchanged, and these
# two apply it (eager adds it to the scores, sdpa passes it on). Flash attention takes no mask of that shape; flex
# attention wants a `BlockMask`; a paged or kernel-hub implementation builds its own.
FOUR_D_MASK_ATTENTION = ("eager", "sdpa")


def attention_implementation(model: PreTrainedModel) -> str:
    """The attention implementation the model's forward runs (its config's, as transformers dispatches on it)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def additive_attention_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(rows, 1, queries, slots)` mask of `dtype` on `device` from `allowed` `(rows, queries, slots)` bool: 0 where a
    query attends to a slot, the dtype's lowest value elsewhere.

    Additive, not boolean: eager attention adds the mask to the scores (a boolean mask would add 1 and mask nothing),
    sdpa takes either. The lowest finite value rather than -inf keeps a query that sees no slot (prompt padding) from
    turning into NaN, as transformers' own eager masks do.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None].to(device)


# Private hooks the library calls (above), by the class that holds them.
_REQUIRED_HOOKS = (
    (generation_utils.GenerationMixin, "_sample"),
    (generation_utils.GenerationMixin, "_valid_auto_compile_criteria"),
    (PreTrainedModel, "_default_compile_config"),
    (GenerationConfig, "_get_default_generation_params"),
    (cache_utils, "get_layer_types_and_kwargs"),
    (cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING"),
    (cache_utils, "STATIC_LAYER_TYPE_MAPPING"),
)


def check_installed(version: str | None = None) -> None:
    """Refuse a transformers older than the floor; warn about one newer than CI has tested; refuse missing hooks.

    Args:
        version: the version to judge (default: the installed one); for tests.

    Raises:
        ImportError: below `OLDEST_SUPPORTED`, or a hook the library calls is missing.
    """
    installed = Version(version or transformers.__version__)
    if installed < Version(OLDEST_SUPPORTED):
        raise ImportError(
            f"hf_specsample needs transformers >= {OLDEST_SUPPORTED}; transformers {installed} is installed. "
            f"Run `pip install 'transformers>={OLDEST_SUPPORTED},<={NEWEST_TESTED}'`."
        )
    missing = [f"{owner.__name__}.{name}" for owner, name in _REQUIRED_HOOKS if not hasattr(owner, name)]
    if missing:
        names = ", ".join(missing)
        raise ImportError(f"transformers {installed} lacks {names}, which hf_specsample calls. {_WHAT_TO_DO}")
    if installed.release[:2] > Version(NEWEST_TESTED).release[:2]:
        warnings.warn(
            f"hf_specsample was tested with transformers {OLDEST_SUPPORTED} to {NEWEST_TESTED}; {installed} is "
            f"installed. The names and hooks it borrows were found, so it should work; if a call fails or looks "
            f"wrong, `pip install 'transformers<={NEWEST_TESTED}'` and report it.",
            UserWarning,
            stacklevel=3,
        )
