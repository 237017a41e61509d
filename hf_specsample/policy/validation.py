"""Checks run before any forward pass, each failing with what to do instead."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Cache, GenerationConfig, StaticCache, StoppingCriteriaList
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria, MaxTimeCriteria

from ..cache import row_ops
from ..core import transformers_api
from ..core.model_facts import ModelFacts, Role, unsupported_layers
from ..options import NamedDraft, SpeculativeConfig
from ..proposers.cross_tokenizer import shared_vocabulary
from ..proposers.suffix_store import SuffixDraft

# Keyword arguments `generate()` hands to a decoding method that this loop understands.
KNOWN_MODEL_KWARGS = frozenset(
    {"attention_mask", "position_ids", "use_cache", "logits_to_keep", *transformers_api.GENERATE_CACHE_NAMES}
)
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def check_models(target: ModelFacts, draft: ModelFacts | None) -> None:
    """Target and draft (None: a draft made from the target, or none at all) must be decoder-only LMs with a cache
    that can be rolled back per row (attention, convolution and recurrent state layers: `ModelFacts.problem_as`).

    What `draft_model=` is was resolved before (`prepare.prepared_draft.resolve_draft`); which token ids the draft
    reads is `check_tokenizers`' question.
    """
    for role, facts in ((Role.TARGET, target), (Role.DRAFT, draft)):
        if facts is None:
            continue
        if facts.model.config.is_encoder_decoder:
            raise ValueError(
                f"The {role} model is encoder-decoder ({type(facts.model).__name__}); hf_specsample drafts for "
                "decoder-only causal LMs. For encoder-decoder models use transformers' `assistant_model=`."
            )
        if not facts.model.can_generate():
            raise ValueError(
                f"The {role} model ({type(facts.model).__name__}) cannot generate: it has no language-modelling "
                "head, so it makes no next-token logits to draft or verify with (transformers' own generate() is not "
                "available on it either). Pass a causal LM (the `...ForCausalLM` class `AutoModelForCausalLM` "
                "loads), not a base model taken out of one (`model.model`, `model.transformer`) nor a model with "
                "another head."
            )
        if facts.unloaded:
            raise ValueError(
                f"The {role} model's weights are on the meta device, and no accelerate hook loads them (a model built "
                "under `init_empty_weights` or moved with `.to('meta')`): load its weights first (`from_pretrained`, "
                "or `to_empty()` then `load_state_dict`)."
            )
        problem = facts.problem_as(role)
        if problem is not None:
            raise ValueError(
                f"The {role} model cannot be used with `draft_model=`: {problem}. Speculative decoding rolls each "
                "row's cache back to its last accepted token every round, which needs a DynamicCache of attention "
                "layers (full or sliding window) and transformers' convolution / recurrent state layers. Use such a "
                + str(role)
                + (" (a small model sharing the target's tokenizer)" if role is Role.DRAFT else "")
                + ", or generate without `draft_model=`."
            )


def check_hybrid_draft(draft: ModelFacts | None, other_tokenizer: bool) -> None:
    """A draft with another tokenizer must keep no convolution or recurrent state.

    Such a draft re-reads the committed text in its own ids every round, which may roll its cache back past
    positions of earlier rounds (`proposers.cross_tokenizer`); a convolution or recurrent state only goes back to the
    start of the current round.
    """
    if other_tokenizer and draft is not None and draft.keeps_state:
        raise ValueError(
            f"The draft ({type(draft.model).__name__}) keeps convolution or recurrent states, which hf_specsample "
            "rolls back only within a round, and a draft with another tokenizer may have to roll back further (its "
            "ids for the committed text change). Use a draft sharing the target's tokenizer, or an attention-only "
            "draft."
        )


# Padding a vocabulary to a multiple of 64..256 rows (Qwen2.5-7B: 152064 logit rows, its 0.5B sibling 151936; Phi-3:
# 32064 over Llama's 32000) changes the logit width by less than this many ids; other tokenizers differ by far more
# (SmolLM2 49152 against Qwen2.5 151936, Llama 3 128256). Widths further apart than this, and than 1%, are taken for
# different tokenizers unless the caller passes both.
PADDING_SLACK = 256


def check_routed(routed: bool) -> None:
    """`speculative_generate` runs only when hf_specsample's `generate()` wrapper routed the call to it.

    transformers' own `generate()` hands a `custom_generate` callable neither `streamer=` nor `tokenizer=` (it keeps
    only the callable's new parameters): a streamer would hear the prompt and never its end, and stop strings would
    fail. The wrapper passes both on (`registration`).
    """
    if not routed:
        raise ValueError(
            "speculative_generate was called by transformers' own generate() (`custom_generate=`, with hf_specsample "
            "unregistered), which hands it neither `streamer=` nor `tokenizer=` (a streamer would hear the prompt and "
            "never its end; stop strings would fail). Call `hf_specsample.generate(model, ...)` with the same "
            "arguments, or `hf_specsample.register()` and then `model.generate(..., draft_model=...)`."
        )


def check_tokenizers(
    target_width: int,
    draft_width: int | None,
    tokenizers: tuple[Any, Any] | None,
    named: NamedDraft | None = None,
    target_tokenizer: Any = None,
) -> bool:
    """Whether the draft reads another tokenizer's ids (then it drafts over the tokens both share).

    With both tokenizers known (`tokenizer=` and `draft_tokenizer=` / `assistant_tokenizer=`), their vocabularies
    decide. Without them, a draft of the target's tokenizer is assumed; logit widths may differ by padding (fewer than
    `PADDING_SLACK` ids, or under 1%), but a draft whose width is further from the target's is refused: its ids would
    mean other strings. With the target's tokenizer alone (`tokenizer=`), a draft that scores fewer ids than that
    tokenizer has tokens is refused too: it cannot be a model of that tokenizer. (A draft of another tokenizer whose
    width is within padding of the target's cannot be told apart by widths: pass its tokenizer.)

    Args:
        target_width, draft_width: the models' logit widths (a prepared draft's as given, before a restricted head);
            None for a draft without a model of its own.
        tokenizers: (target tokenizer, draft tokenizer) when the caller gave both, else None.
        named: the draft's name where it is "auto" or "prompt_lookup" (which draft in the target's own ids).
        target_tokenizer: the target's tokenizer where the caller gave it without the draft's, else None.

    Raises:
        ValueError: a named draft with another tokenizer, widths of different tokenizers without tokenizers, a draft
            narrower than the target's tokenizer, or tokenizers that share no token
            (`proposers.cross_tokenizer.shared_vocabulary`).
    """
    differ = tokenizers is not None and (
        len(tokenizers[0]) != len(tokenizers[1]) or _vocabulary(tokenizers[0]) != _vocabulary(tokenizers[1])
    )  # sizes first: comparing two 150k-token vocabularies costs 0.1 s
    if named is not None:
        if differ:
            raise ValueError(
                f"draft_model='{named}' drafts in the target's own token ids, so a `draft_tokenizer=` / "
                "`assistant_tokenizer=` other than the target's `tokenizer=` contradicts it. Drop "
                "`draft_tokenizer=`, or pass the draft model that tokenizer belongs to as `draft_model=`."
            )
        return False
    assert draft_width is not None  # only a named draft (returned above) has no model of its own
    if tokenizers is not None:
        # before any forward: an implicit draft's preparation (AUTO's timed forwards) comes after these checks
        if differ and shared_vocabulary(*tokenizers, target_width, draft_width).size == 0:
            raise ValueError(
                "The draft's tokenizer shares no token with the target's, so it can propose nothing. Use a draft "
                "whose vocabulary overlaps the target's."
            )
        return differ
    # The tokenizer's base vocabulary, as far as the target scores it: added tokens (a fine-tune's new special
    # token, with the target's embeddings resized) may lie beyond a draft of the same tokenizer.
    base = (getattr(target_tokenizer, "vocab_size", None) or len(target_tokenizer)) if target_tokenizer else 0
    tokens = min(base, target_width)
    if draft_width < tokens:
        raise ValueError(
            f"The draft scores {draft_width} token ids, fewer than the {tokens} tokens of the target's tokenizer's "
            "vocabulary (`tokenizer=`), so it is not a model of that tokenizer: its ids mean other strings. Pass the "
            "draft's own tokenizer as `draft_tokenizer=` (or `assistant_tokenizer=`): the draft then drafts over the "
            "tokens both vocabularies share, exactly."
        )
    if abs(target_width - draft_width) >= max(PADDING_SLACK, max(target_width, draft_width) // 100):
        raise ValueError(
            f"The draft scores {draft_width} token ids and the target {target_width}: they look like models with "
            "different tokenizers, whose ids mean other strings. Pass the target's tokenizer as `tokenizer=` and the "
            "draft's as `draft_tokenizer=` (or `assistant_tokenizer=`): the draft then drafts over the tokens both "
            "vocabularies share, exactly. If they share one tokenizer, pass it as both."
        )
    return False


def _vocabulary(tokenizer: Any) -> dict:
    return tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else dict(tokenizer)


def check_generation_config(config: GenerationConfig) -> None:
    """Only greedy decoding and multinomial sampling can be sped up exactly.

    `prompt_lookup_num_tokens` (transformers' prompt-lookup decoding) is ours to run here: with `draft_model=` it
    sets the lookup drafter's depth, so it does not count towards the mode.
    """
    without_lookup = copy.copy(config)
    without_lookup.prompt_lookup_num_tokens = None
    mode = without_lookup.get_generation_mode()
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={config.num_beams}) cannot be combined with `draft_model=`: speculative sampling "
            "verifies one sequence per row. Use num_beams=1 (greedy or do_sample=True), or drop `draft_model=`."
        )
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"`draft_model=` speeds up greedy decoding and sampling, not {mode.value}. Use num_beams=1 and "
            "no penalty_alpha / assistant settings, or drop `draft_model=`."
        )
    if config.output_attentions or config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not returned by speculative decoding (the target scores "
            "several positions per pass). Drop those flags, or generate without `draft_model=`."
        )


_ADAPTIVE_K = (
    "K adapts by default: it is chosen before every round from measured acceptance and costs, up to "
    "`SpeculativeConfig(max_lookahead=...)` (`num_lookahead=N` fixes it). Drop it."
)
_OTHER_TOKENIZER = (
    "a draft with another tokenizer (`draft_tokenizer=` with `tokenizer=`) re-reads the committed text in its own ids "
    "every round and drafts over the tokens both vocabularies share, with no window to set. Drop it."
)
# transformers' assisted-generation settings (`assistant_model=`), which `draft_model=` would otherwise ignore
# silently, each with what does its job here ({value}: the caller's). Plain generate() ignores them too without an
# assistant, but a caller moving from `assistant_model=` to `draft_model=` expects them to act.
ASSISTANT_SETTINGS = {
    "num_assistant_tokens": "pass `num_lookahead={value}` for {value} draft tokens every round (without it, K is "
    "chosen before every round from measured acceptance and costs).",
    "num_assistant_tokens_schedule": _ADAPTIVE_K,
    "assistant_confidence_threshold": _ADAPTIVE_K,
    "assistant_early_exit": "for a draft made from the target itself, pass `draft_model='auto'` (an int8 copy of the "
    "target on the CPU, a view skipping the middle fifth of its layers elsewhere; "
    "`hf_specsample.prepare.self_draft.layer_skip_draft(target, keep=range({value}))` builds a chosen layer subset).",
    "assistant_lookbehind": _OTHER_TOKENIZER,
    "target_lookbehind": _OTHER_TOKENIZER,
    "assistant_ensemble_weight": "hf_specsample samples exactly from the target's distribution and offers no mixture "
    "with the draft's. Drop it, or use `assistant_model=` for that biased verification.",
    "speculation_type": "`draft_model=` names the draft (a model, 'auto' or 'prompt_lookup'). Drop it, or use "
    "`assistant_model=` for transformers' speculation types.",
}


def check_assistant_settings(
    kwargs: dict[str, Any], generation_config: GenerationConfig | None, model_config: GenerationConfig | None
) -> None:
    """Refuse transformers' assisted-generation settings (`ASSISTANT_SETTINGS`) on a `draft_model=` call.

    A setting counts when the call passes it as a keyword argument (not None), or when the `generation_config=` it
    passes holds a value that is neither transformers' default for it (`num_assistant_tokens=20`, ...) nor the
    model's own `generation_config`'s: a config copied from the model's, or a model whose checkpoint sets one, passes.

    Args:
        kwargs: the call's keyword arguments to `generate()`.
        generation_config: the call's `generation_config=` (None: none passed).
        model_config: the model's own `generation_config` (None: it has none).
    """
    defaults = transformers_api.generation_defaults()
    for name, instead in ASSISTANT_SETTINGS.items():
        value = kwargs.get(name)
        if value is None and generation_config is not None:
            value = getattr(generation_config, name, None)
            if value == defaults.get(name) or value == getattr(model_config, name, None):
                value = None
        if value is not None:
            raise ValueError(
                f"`{name}={value!r}` is a setting of transformers' assisted generation (`assistant_model=`), which "
                f"`draft_model=` does not read: {instead.format(value=value)}"
            )


def check_prompt_lookup(num_tokens: Any, max_ngram: Any) -> None:
    """`prompt_lookup_num_tokens` / `max_matching_ngram_size` (None: unset) must be positive ints."""
    for name, value in (("prompt_lookup_num_tokens", num_tokens), ("max_matching_ngram_size", max_ngram)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}.")


def check_inputs(
    input_ids: torch.Tensor, model_kwargs: dict[str, Any], streamer: Any = None, generator: Any = None
) -> None:
    """Reject inputs the loop does not handle, instead of ignoring them."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator= takes a torch.Generator (e.g. `torch.Generator().manual_seed(0)`), got "
            f"{type(generator).__name__}."
        )
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"streamer= takes one row, but this call generates {input_ids.shape[0]} (batch x num_return_sequences): "
            "rows of a speculative batch commit different numbers of tokens per round. Stream one row per call."
        )
    unknown = sorted(key for key, value in model_kwargs.items() if key not in KNOWN_MODEL_KWARGS and value is not None)
    if unknown:
        raise ValueError(
            f"Model inputs {unknown} are not supported with `draft_model=` (text-only decoder LMs: input_ids and "
            "attention_mask). Generate without `draft_model=` for these inputs."
        )
    cache = transformers_api.generate_cache(model_kwargs)
    if cache is not None:
        unsupported = unsupported_layers(cache) if isinstance(cache, Cache) else [type(cache).__name__]
        if isinstance(cache, StaticCache) and row_ops.is_static(cache):
            # sliding-window static layers are converted to full ones (`cache.row_ops.full_static_cache`)
            unsupported = []
            if getattr(cache, "offloading", False):
                unsupported = ["offloaded static layers"]
        elif not unsupported and not cache.is_croppable and not row_ops.keeps_state_layers(cache):
            unsupported = ["layers that cannot be cropped"]
        if unsupported:
            raise ValueError(
                f"`draft_model=` needs a DynamicCache (the default) or a StaticCache to roll back rejected tokens; got "
                f"a cache with {', '.join(unsupported)}. Pass no `{transformers_api.CACHE}` and no quantized/offloaded "
                "`cache_implementation`, or a DynamicCache / StaticCache from an earlier generate() call."
            )
        if not row_ops.attention_layers(cache) and row_ops.keeps_state_layers(cache, initialized=True):
            raise ValueError(
                f"This `{transformers_api.CACHE}` holds only recurrent / convolution states, which do not say how many "
                "tokens they cover, so `draft_model=` cannot tell where to continue. Pass the whole conversation as "
                "input_ids without the cache (it is encoded again), or generate without `draft_model=`."
            )
        if row_ops.total_slots(cache) >= input_ids.shape[1]:
            raise ValueError(
                f"`{transformers_api.CACHE}` already covers {row_ops.total_slots(cache)} tokens but input_ids has "
                f"{input_ids.shape[1]}: pass the whole conversation as input_ids (the cached turns plus the new one), "
                "as for plain generate()."
            )


def check_stopping(stopping_criteria: StoppingCriteriaList, batch_size: int) -> None:
    """Refuse the one stopping setup whose plain behaviour the loop does not reproduce.

    Plain `generate()` pads a finished row only when an EOS criterion exists. Without one, a row whose stop string
    or custom criterion fires keeps receiving real tokens until every row's has fired. The speculative loop drops
    rows when they stop, so a batch with such criteria and no EOS id would come out different.
    """
    if batch_size == 1 or any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria):
        return
    per_row = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, MaxTimeCriteria))]
    if per_row:
        raise ValueError(
            f"With a batch ({batch_size} rows), stopping criteria {per_row} and no `eos_token_id`, plain generate() "
            "keeps generating rows whose criterion fired (it pads finished rows only when an EOS id is set) until "
            "every row's has fired; `draft_model=` drops rows as they stop. Set `eos_token_id=` (e.g. "
            "tokenizer.eos_token_id; rows are then padded after they stop, as plain generate() does), or generate "
            "one row per call."
        )


def check_cache_plan(
    target: ModelFacts, cache: Any, generation_config: GenerationConfig, config: SpeculativeConfig
) -> None:
    """Refuse a static or compiled target cache the loop cannot run, before any work (`plan/call_plan.py` then
    builds it): an offloaded one, `compile=True` for a model that cannot be compiled here, and a static cache of
    convolutions fused with sliding-window attention (Inkling's, which transformers' own static decoding fails on).
    """
    implementation = generation_config.cache_implementation
    if not row_ops.runs_static(cache, implementation, config.compile):
        return
    if implementation == "offloaded_static" or getattr(cache, "offloading", False):
        raise ValueError(
            "`draft_model=` does not run offloaded caches (each round rolls rejected slots back on the device). Use "
            "cache_implementation='static' (or the default dynamic cache)."
        )
    if config.compile and target.compile_problem is not None:
        raise ValueError(
            f"SpeculativeConfig(compile=True) cannot compile this target: {target.compile_problem}. Drop compile=True "
            "(the target then runs eagerly), or load the target without that setting."
        )
    problem = row_ops.static_cache_problem(cache if row_ops.is_static(cache) else None, target.model.config)
    if problem is not None:
        raise ValueError(problem)


def check_replayed(processors: Any, declared: tuple[type, ...], batch_size: int) -> None:
    """Refuse, before any work, a processor declared stateful that cannot be copied (replaying copies it), and a batch
    with one: plain decoding calls it with every row at one step, which rows that accept different numbers of tokens
    never are (`sampling.stateful.ReplayedProcessor` replays one row)."""
    replayed = [type(processor).__name__ for processor in processors if isinstance(processor, declared)]
    for processor in processors:
        if isinstance(processor, declared):
            try:
                copy.deepcopy(processor)  # what replaying does at every processed position
            except Exception as error:  # noqa: BLE001 (whatever copying raises, the advice is the same)
                raise ValueError(
                    f"{type(processor).__name__} is declared stateful (SpeculativeConfig(stateful_processors=...)), "
                    "which replays it from copies of its state, but copy.deepcopy cannot copy it "
                    f"({type(error).__name__}: {error}). Make it copyable (a __deepcopy__), keep its state as a "
                    "function of each row's prefix and leave it undeclared, or generate without draft_model= for it."
                ) from error
    if replayed and batch_size > 1:
        raise ValueError(
            f"{', '.join(replayed)} is declared stateful (SpeculativeConfig(stateful_processors=...)), which is "
            f"replayed for one row per call; this call has {batch_size} rows (num_return_sequences included). Call "
            "generate() once per row, or make the processor a function of each row's prefix and leave it undeclared."
        )


def check_draft_compiles(draft: ModelFacts) -> None:
    """Refuse `compile_draft=True`, before any forward, for a draft whose forward cannot compile (a hybrid model, an
    offloaded one, a quantization transformers marks not compileable, a tensor-parallel one)."""
    if draft.compile_problem is not None:
        raise ValueError(
            f"compile_draft=True cannot compile this draft: {draft.compile_problem}. Leave compile_draft=False for "
            "this draft (its steps then run eagerly), or pass a draft whose forward compiles."
        )


def check_suffix_draft(suffix_draft: Any, model_free: bool) -> SuffixDraft | None:
    """`suffix_draft=` checked: a `SuffixDraft` beside a draft model, or None.

    Raises:
        TypeError: anything else; ValueError: beside `draft_model="suffix"`, a `SuffixDraft` or "prompt_lookup".
    """
    if suffix_draft is None:
        return None
    if not isinstance(suffix_draft, SuffixDraft):
        raise TypeError(
            f"suffix_draft= takes a hf_specsample.SuffixDraft (a store of earlier outputs), got {suffix_draft!r}."
        )
    if model_free:
        raise ValueError(
            "suffix_draft= drafts beside a draft model. Without one, pass the store itself as draft_model=store."
        )
    return suffix_draft


def check_suffix(
    store: SuffixDraft, logit_width: int, tokenizers: tuple[Any, Any] | None, lookup_tokens: int | None
) -> None:
    """Refuse a suffix drafter's call that cannot run: a store of another vocabulary (`SuffixDraft.check_vocabulary`),
    or prompt lookup beside it (it drafts from the rows' own text already).

    Raises:
        ValueError: saying what to do instead.
    """
    store.check_vocabulary(logit_width, tokenizers[0] if tokenizers is not None else None)
    if lookup_tokens is not None:
        raise ValueError(
            "prompt_lookup_num_tokens= adds prompt lookup to a draft model; a suffix drafter already drafts from "
            "each row's prompt and text. Drop prompt_lookup_num_tokens=."
        )


def tree_problems(
    target: ModelFacts,
    draft: ModelFacts | None,
    *,
    other_tokenizer: bool,
    static_cache: bool,
    config: SpeculativeConfig,
) -> list[str]:
    """Why this call cannot draft trees (`shapes.choose_shape`), each in a phrase; empty where it can.

    Args:
        target, draft: the models' facts (draft None: no draft model).
        other_tokenizer: the draft reads another tokenizer's ids.
        static_cache: the target's cache is static (the caller's, `cache_implementation="static"`, `compile=True`).
    """
    problems = []
    if other_tokenizer:
        problems.append("a draft with another tokenizer drafts chains (its tokens do not map one to one)")
    if static_cache or config.compile:
        problems.append("static caches and compile=True run chains")
    if config.compile_draft:
        problems.append("compile_draft=True compiles the draft's single-token steps, which a tree does not take")
    if target.tensor_parallel:
        problems.append("a tensor-parallel target verifies chains")
    if config.lookahead_policy is not None:
        problems.append("a lookahead_policy chooses a chain's K each round (a tree drafts its shape)")
    for role, facts in (("target", target), ("draft", draft)):
        problem = tree_problem(facts) if facts is not None else None
        if problem is not None:
            problems.append(f"the {role} {problem}")
    return problems


# Layer kinds (`config.layer_types`, GPT-Neo's `attention_layers`) whose mask is the causal one a tree's mask extends.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "global", "attention"})


def tree_problem(facts: ModelFacts) -> str | None:
    """Why a model's forwards cannot feed draft trees (`cache.tree_forward`; chains run there instead), or None.
    Compiled forwards and static caches are the call's (`tree_problems`)."""
    name = type(facts.model).__name__
    implementation = transformers_api.attention_implementation(facts.model)
    if facts.cache_problem is not None:
        return facts.cache_problem
    if facts.keeps_state:
        return f"{name} keeps convolution / recurrent states, which cannot branch into a tree: chains there"
    if implementation not in transformers_api.FOUR_D_MASK_ATTENTION:
        return (
            f"{name} runs {implementation} attention, which takes no tree mask: chains there (trees need "
            f"attn_implementation={' or '.join(map(repr, transformers_api.FOUR_D_MASK_ATTENTION))})"
        )
    if not facts.takes_position_ids:
        return f"{name}'s forward takes no position ids, which a tree's nodes need: chains there"
    if getattr(facts.model.config, "alibi", False):
        return f"{name} builds its ALiBi biases from a 2D padding mask, which a tree mask is not: chains there"
    config = facts.model.config
    layers = transformers_api.cache_layer_classes(config)
    # Windows a model builds into its own mask (local, sliding, chunked layers), whether or not its cache trims them
    # (GPT-Neo's local layers keep a full cache): the tree's mask would replace them.
    kinds = set(getattr(config, "layer_types", None) or ()) | set(getattr(config, "attention_layers", None) or ())
    windowed = sorted(kinds - FULL_ATTENTION_KINDS)
    if windowed or any(issubclass(layer, DynamicSlidingWindowLayer) for layer in layers):
        kind = ", ".join(windowed) or "sliding-window"
        return (
            f"{name} has {kind} layers, windows its own mask builds, which tree forwards do not serve yet: chains there"
        )
    return None
