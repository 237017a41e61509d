"""Registers `draft_model=` / `num_lookahead=` on every model's `generate()`.

`register()` wraps `GenerationMixin.generate` once. A call without `draft_model=` goes straight to the original
`generate()`, untouched but for one thing: a cache passed under a name the installed transformers deprecated
(`past_key_values=` from 5.24 on) is renamed as `generate()` would rename it, with the same deprecation message, at
the caller's line (`transformers_api.take_caller_cache`). A call with `draft_model=` is routed through
transformers' own `custom_generate` callable hook to `speculative_generate`, so `generate()` still prepares inputs,
processors and stopping criteria itself. A call that names another `custom_generate` method (a callable or a
repository) is that method's: it goes to the original `generate()` (renamed cache aside) untouched.

transformers' assisted-generation settings (`num_assistant_tokens=`, `assistant_early_exit=`, ...) are refused on a
`draft_model=` call, before any work, with what does their job here (`validation.check_assistant_settings`):
`draft_model=` does not read them, and ignoring them would give a caller moving from `assistant_model=` something
other than what was asked for.

Two arguments never reach a `custom_generate` callable in transformers (it keeps only the callable's *new*
parameters): `streamer` and `tokenizer`. So `speculative_generate` runs only when this wrapper routed the call
(`speculative_routed`), and refuses, before any work, to be called as `custom_generate=` on transformers' own
`generate()`, where a streamer would hear the prompt and never its end. The wrapper passes the streamer on as
`speculative_streamer`, turns
`stop_strings` + `tokenizer` into transformers' own `StopStringCriteria`, appended to the stopping criteria, and
passes `tokenizer` with `draft_tokenizer=` (or transformers' name `assistant_tokenizer=`) as
`speculative_tokenizers`: a draft whose tokenizer has another vocabulary then drafts over the tokens both share.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin

from .core import transformers_api
from .decoding import speculative_generate
from .plan.call_plan import makes_target_cache
from .policy import validation

_ORIGINAL_GENERATE = GenerationMixin.generate
SPECULATIVE_ARGUMENTS = ("num_lookahead", "speculative_config", "generator", "suffix_draft")


def _stop_strings(model: GenerationMixin, generation_config: GenerationConfig | None, kwargs: dict) -> Any:
    """The stop strings `generate()` would use: call argument > passed config > model's config."""
    if "stop_strings" in kwargs:
        return kwargs["stop_strings"]
    for config in (generation_config, getattr(model, "generation_config", None)):
        if config is not None and getattr(config, "stop_strings", None):
            return config.stop_strings
    return None


def _route_to_speculative(model: GenerationMixin, kwargs: dict) -> dict:
    """Rewrite `generate()` keyword arguments for the `custom_generate` hook (see the module docstring)."""
    if kwargs.get("assistant_model") is not None:
        raise ValueError("Pass either `draft_model=` (hf_specsample) or `assistant_model=` (transformers), not both.")
    validation.check_assistant_settings(
        kwargs, kwargs.get("generation_config"), getattr(model, "generation_config", None)
    )
    kwargs["custom_generate"] = speculative_generate
    kwargs["speculative_routed"] = True  # the streamer and tokenizer below reach the loop (`speculative_generate`)
    draft_tokenizer, assistant_tokenizer = kwargs.pop("draft_tokenizer", None), kwargs.pop("assistant_tokenizer", None)
    if draft_tokenizer is not None and assistant_tokenizer is not None and draft_tokenizer is not assistant_tokenizer:
        raise ValueError("Pass the draft's tokenizer once: `draft_tokenizer=` or `assistant_tokenizer=` (the same).")
    draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else assistant_tokenizer
    if draft_tokenizer is not None:
        if kwargs.get("tokenizer") is None:
            raise ValueError(
                "`draft_tokenizer=` / `assistant_tokenizer=` is compared with the target's tokenizer: pass the "
                "target's "
                "as `tokenizer=` too."
            )
        kwargs["speculative_tokenizers"] = (kwargs["tokenizer"], draft_tokenizer)
    elif kwargs.get("tokenizer") is not None:  # the draft's width is checked against the target's vocabulary
        kwargs["speculative_tokenizers"] = (kwargs["tokenizer"], None)
    if kwargs.get(transformers_api.CACHE) is not None:  # the caller holds this object: leave it as plain would
        kwargs["speculative_caller_cache"] = True
    elif makes_target_cache(kwargs.get("speculative_config")):  # generate()'s own would be thrown away
        transformers_api.leave_cache_to_call(model, kwargs)
    # transformers' prompt-lookup arguments would switch generate() to its own assisted mode (which refuses
    # num_return_sequences > 1 and batches): with draft_model= they configure our lookup (the suffix drafter over
    # each row's own text).
    config = kwargs.get("generation_config")
    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
        value = kwargs.pop(name, None)
        if value is None and config is not None and getattr(config, name, None) is not None:
            value = getattr(config, name)
            config = kwargs["generation_config"] = copy.deepcopy(config)
            setattr(config, name, None)
        if value is not None:
            kwargs[f"speculative_{name}"] = value
    streamer = kwargs.pop("streamer", None)
    if streamer is not None:
        kwargs["speculative_streamer"] = streamer
    stop_strings = _stop_strings(model, kwargs.get("generation_config"), kwargs)
    tokenizer = kwargs.get("tokenizer")
    if stop_strings and tokenizer is not None:
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
        # Built above; generate() must not build them again (it would ask for the tokenizer, which it drops). A
        # passed config is copied without them: `stop_strings=None` beside `generation_config=` is deprecated.
        config = kwargs.get("generation_config")
        if config is None or "stop_strings" in kwargs:
            kwargs["stop_strings"] = None
        else:
            config = kwargs["generation_config"] = copy.deepcopy(config)
            config.stop_strings = None
    return kwargs


@functools.wraps(_ORIGINAL_GENERATE)
def generate(self, *args, **kwargs):
    """`GenerationMixin.generate` with hf_specsample's `draft_model=` / `num_lookahead=` arguments.

    Installed as every model's `generate()` by `register()`; also callable as a function whether registered or not,
    `hf_specsample.generate(model, **inputs, draft_model=draft)`, with the arguments `model.generate()` takes.
    """
    # A cache under a name transformers deprecated is renamed here, as `generate()` renames it, so that its
    # deprecation message points at the caller's line rather than at this wrapper.
    transformers_api.take_caller_cache(kwargs, stacklevel=2)
    custom_generate = kwargs.get("custom_generate")
    if custom_generate is not None and custom_generate is not speculative_generate:
        # Another decoding method (a callable, or a Hub / local `custom_generate` folder such as this repository's):
        # the call is its own, `draft_model=` included.
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    is_ours = custom_generate is speculative_generate
    if kwargs.get("draft_model") is None and not is_ours:
        given = [name for name in SPECULATIVE_ARGUMENTS if kwargs.get(name) is not None]
        if given:
            raise ValueError(f"{given} only apply to speculative sampling: pass `draft_model=` as well.")
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    return _ORIGINAL_GENERATE(self, *args, **_route_to_speculative(self, kwargs))


def register() -> None:
    """Add `draft_model=` and friends to `generate()` (done on `import hf_specsample`); idempotent."""
    GenerationMixin.generate = generate  # type: ignore[method-assign]  # registering is replacing transformers' method


def unregister() -> None:
    """Restore transformers' own `generate()`; `hf_specsample.generate(model, ...)` still runs `draft_model=` calls."""
    GenerationMixin.generate = _ORIGINAL_GENERATE  # type: ignore[method-assign]  # transformers' own, put back


def is_registered() -> bool:
    return GenerationMixin.generate is generate
