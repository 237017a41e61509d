"""A call's plan: its inputs inspected once, every refusal before any forward, every decision frozen (`plan_call`).

`decoding.speculative_generate` is resolve -> plan -> run: `CallInputs` holds what `generate()` handed over,
`plan_call` turns it into a `CallPlan`, and `decoding.SpeculativeDecoder` runs the rounds from that plan alone. In
the order `plan_call` runs them:

1. what `draft_model=` is (`prepare.prepared_draft.resolve_draft`: a model, a `PreparedDraft`, "auto", "prompt_lookup");
2. each model inspected once (`model_facts.ModelFacts.of`): the target, the draft as given;
3. the refusals, in this order, before any forward: the models, the tokenizers (does the draft read another
   vocabulary?), a hybrid draft with another tokenizer, the generation mode and flags, the prompt-lookup options,
   the inputs, the target's static cache or compilation, the stopping criteria, the logits processors, options a
   draft-free call cannot use, a draft that `compile_draft` cannot compile, and `linear_kernel="on"` where the kernel
   cannot serve the target (its routing is made here: `kernels.routing.KernelRouting`);
4. the decisions: the prepared draft (AUTO's timings and calibration forwards, the first forwards of the call) and,
   for a tensor-parallel target, that every rank runs the same one; the draft's facts, kernel routing, compiled step,
   vocabulary and the tokenizers it reads; the target's cache (the caller's made static, or one the loop makes:
   `pooled`, `static_slots`) and compiled forward; the rounds' K owner
   (`lookahead.RoundLookahead`); whether the call returns a cache.

Glossary: `docs/ARCHITECTURE.md` ("Words").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.generation.stopping_criteria import MaxTimeCriteria

from ..cache import row_ops
from ..cache.compiled import CompiledForward, CompileSettings, compiled_forward
from ..cache.forwards import Forwards
from ..cache.runner import RunnerBackend, RunnerPlan
from ..core import transformers_api
from ..core.model_facts import ModelFacts, Role
from ..kernels.routing import KernelRouting
from ..kernels.small_rows import MAX_ROWS, best_path, loaded, ready
from ..options import DraftForm, DraftShape, LinearKernel, NamedDraft, SpeculativeConfig
from ..policy import validation
from ..policy.graph_choice import choose_graphs
from ..policy.lookahead import RoundLookahead, largest_round, times_unknown_processors
from ..policy.round_costs import step_cost_ratio
from ..policy.shapes import ShapeChoice, choose_shape, suffix_shape
from ..prepare.implicit import draft_for_call
from ..prepare.prepared_draft import DraftSpec, PreparedDraft, check_draft, resolve_draft, same_tokenizers
from ..prepare.vocabulary import special_token_ids
from ..proposers.cross_tokenizer import SharedVocabulary, shared_vocabulary
from ..proposers.draft_model import DraftVocabulary
from ..proposers.suffix_store import MAX_MATCH, SuffixDraft
from ..sampling.processing import check_supported
from ..verify import distributed
from .call_inputs import CallInputs
from .call_inputs import resolve_inputs as resolve_inputs  # the loop imports it with the plan

DRAFT_STEP_SIZES = (1, 2)  # a draft's step, and a round's first step catching up on the last committed tokens


@dataclass(frozen=True)
class DraftPlan:
    """The draft model of a call, decided.

    Attributes:
        prepared: the `PreparedDraft` it runs (the caller's, or the implicit one).
        facts: the facts of the model that drafts (`prepared.model`).
        forwards: how its forwards run (kernel routing, prompts on its float original, compiled steps, embeddable ids).
        vocabulary: which target ids its logits stand for.
        shared: with another tokenizer, the tokens both vocabularies share (`proposers.cross_tokenizer`); else None.
        tokenizers: with another tokenizer, (the target's, the draft's); else None.
        description: what drafts, for `SpeculativeStats.draft_form`.
        static: its steps run on a static cache of the call's `CallPlan.static_slots` (`compile=True`), which the
            loop takes from `cache.static_addresses.POOL` or makes (`decoding.static_caches`); else a new one.
    """

    prepared: PreparedDraft
    facts: ModelFacts
    forwards: Forwards
    vocabulary: DraftVocabulary
    shared: SharedVocabulary | None
    tokenizers: tuple[Any, Any] | None
    description: str
    static: bool = False


@dataclass(frozen=True)
class CallPlan:
    """Everything a call decided before its first round; `decoding.SpeculativeDecoder` reads nothing else.

    Attributes:
        inputs: what `generate()` handed over (`CallInputs`).
        target: the target's facts.
        cache: the caller's cache (made static where the call runs static), or None: the loop makes one (a new
            dynamic cache, or under `pooled` a static one of `static_slots`, `decoding.static_caches`).
        forwards: how the target's forwards run (kernel routing, compiled forward and the rounds it serves).
        draft: the draft model, or None (`draft_model="prompt_lookup"` or a suffix drafter alone).
        max_ngram: with a suffix drafter (`suffix`, prompt lookup: `draft_model="prompt_lookup"` or
            `prompt_lookup_num_tokens=` with a model draft), the most of a row's last tokens matched
            (`max_matching_ngram_size`, else `MAX_MATCH`); None: no suffix drafter.
        generator: the generator every draw uses (rank 0's for a tensor-parallel target).
        clock_free: no decision depends on the clock (a generator was given, or ranks must agree).
        lookahead: the call's one owner of K (`lookahead.RoundLookahead`).
        keep_cache: the call returns the target's cache (or leaves the caller's as plain `generate()` does).
        kernel_description: what ran the eager forwards' linears, for `SpeculativeStats.linear_kernel`.
        graphs: whether the call's runners run as graphs, and why (`graph_choice.choose_graphs`), for
            `SpeculativeStats.graphs`.
        pooled: the call's static caches are made for it (not the caller's): the loop takes them from
            `cache.static_addresses.POOL` (or makes them) and gives back those the caller is not handed.
        static_slots: slots of the static caches made for the call under `compile=True` (`static_cache_size`),
            else 0.
        shape: what the rounds draft: a tree (`shape.tree`) or chains, and why (`shapes.choose_shape`).
        suffix: the suffix drafter's store (`draft_model="suffix"` or a `SuffixDraft`), or None.
        kernel_build_seconds: seconds this call's planning spent making the small-rows kernel ready (compiling it,
            or loading an earlier process's build; `kernels.small_rows.load`), 0.0 where it did not.
    """

    inputs: CallInputs
    target: ModelFacts
    cache: Any
    forwards: Forwards
    draft: DraftPlan | None
    max_ngram: int | None
    generator: torch.Generator | None
    clock_free: bool
    lookahead: RoundLookahead
    keep_cache: bool
    kernel_description: str
    graphs: str = ""
    pooled: bool = False
    shape: ShapeChoice = ShapeChoice(None, "chain")
    kernel_build_seconds: float = 0.0
    static_slots: int = 0
    suffix: SuffixDraft | None = None

    @property
    def config(self) -> SpeculativeConfig:
        return self.inputs.config

    @property
    def cached_slots(self) -> int:
        """Slots the target's cache holds before the first round (the caller's cache: its past; else 0)."""
        return row_ops.total_slots(self.cache) if self.cache is not None else 0


def plan_call(inputs: CallInputs) -> CallPlan:
    """Resolve, inspect, refuse and decide, in the order of the module docstring."""
    config, model_kwargs = inputs.config, inputs.model_kwargs
    spec = resolve_draft(inputs.draft_model)
    target = ModelFacts.of(inputs.model)
    draft = ModelFacts.of(spec.model) if spec.model is not None else None
    tokenizers, shape = _refuse(inputs, spec, target, draft)
    generator = inputs.generator
    if target.tensor_parallel and inputs.generation_config.do_sample:  # every rank draws alike (`distributed`);
        # a greedy call draws nothing, not even the shared generator's seed
        generator = distributed.shared_generator(generator, inputs.input_ids.device)
    # No choice below may depend on the clock where a seeded call must repeat in any process, or ranks agree.
    clock_free = inputs.generator is not None or target.tensor_parallel
    # `max_time=` counts from the call's start, setup included, as plain's clock does: such a call times nothing
    # before its first round (the kernel's routing and AUTO's draft form are chosen as a clock-free call chooses).
    hurried = any(isinstance(criterion, MaxTimeCriteria) for criterion in inputs.stopping_criteria)
    untimed = clock_free or hurried
    # Nor does it build the kernel (15-20 s on 2 cores): under linear_kernel="auto" it runs one already built, or none.
    bf16 = any(facts is not None and facts.model.dtype == torch.bfloat16 for facts in (target, draft))
    unbuilt = hurried and bf16 and config.linear_kernel is LinearKernel.AUTO and not ready()
    if unbuilt:
        inputs = dataclasses.replace(inputs, config=dataclasses.replace(config, linear_kernel=LinearKernel.OFF))
        config = inputs.config
    kernel_ready = loaded() is not None  # else a build below is this call's, in its statistics
    # The target's kernel routing: AUTO's timing, "on" refused where the kernel cannot serve the target, before the
    # draft's form timings and calibration forwards.
    # SpeculativeConfig's fields take strings and hold the enum (`__post_init__` parses them)
    kernel = KernelRouting.for_model(target, cast(LinearKernel, config.linear_kernel), untimed, Role.TARGET)
    lookup_only = spec.model_free  # prompt lookup or a suffix drafter: no draft model
    suffix = inputs.suffix_draft is not None or inputs.lookup_tokens is not None  # a suffix drafter beside a model
    largest = largest_round(config, inputs.lookup_tokens, lookup_only, suffix)
    graphs = choose_graphs(target.input_device, config.compile)
    draft_plan = (
        None
        if lookup_only
        else _draft_plan(inputs, spec, target, draft, kernel, untimed, tokenizers, largest, graphs.backend)
    )
    cache, forwards, kernel_description, pooled = _target_forwards(inputs, target, kernel, largest, graphs.backend)
    prepared, max_length = draft_plan.prepared if draft_plan is not None else None, inputs.generation_config.max_length
    # A sampled text depends on K (a drafted and a bonus position use the randomness differently), so a sampling
    # call's K never reads the clock: a call seeded by `torch.manual_seed` repeats, its kernel routings and AUTO's
    # draft form being timed once per model and kept (the first call decides as every later one).
    sampling = bool(inputs.generation_config.do_sample)
    launch_bound = target.input_device.type == "cuda" and graphs.backend is None  # eager steps on a GPU
    lookahead = RoundLookahead.for_call(
        config,
        clock_free=clock_free or sampling,
        batch_size=inputs.batch_size,
        max_length=int(max_length),
        prompt_ends_in_padding=inputs.prompt_ends_in_padding,
        lookup_tokens=inputs.lookup_tokens,
        lookup_only=lookup_only,
        cost_ratio=step_cost_ratio(prepared.model, target.model, launch_bound) if prepared is not None else 0.0,
        draft_step_seconds=prepared.measured_step_seconds if prepared is not None else None,
        tree=shape.tree,
        tree_ranks=shape.ranks,  # every round's tree (cut to the room), or auto's trees
        processors_unknown=times_unknown_processors(inputs.logits_processor, clock_free, target.input_device),
        suffix=suffix,
    )
    cached = row_ops.total_slots(cache) if cache is not None else 0
    # Plain generate() returns its cache with the output object (unless use_cache=False), and leaves a cache the
    # caller passed in as it returns it: so do we. Otherwise finished rows' caches are not worth keeping.
    wanted = bool(inputs.generation_config.return_dict_in_generate) or inputs.caller_cache or cached > 0
    keep_cache = wanted and model_kwargs.get("use_cache") is not False
    if draft_plan is not None:
        assert draft_plan.forwards.kernel is not None  # a draft's forwards always have a kernel routing
        kernel_description += f"; draft {draft_plan.forwards.kernel.reason}"
    if unbuilt:
        kernel_description += " (a call with max_time= builds no kernel: none was built yet)"
    store = spec.store if spec.store is not None else inputs.suffix_draft
    lookups = spec.kind is NamedDraft.PROMPT_LOOKUP or inputs.lookup_tokens is not None
    max_ngram = inputs.max_ngram or MAX_MATCH if lookups or store is not None else None
    build = None if kernel_ready else loaded()
    return CallPlan(
        inputs,
        target,
        cache,
        forwards,
        draft_plan,
        max_ngram,
        generator,
        clock_free,
        lookahead,
        keep_cache,
        kernel_description,
        graphs.reason,
        pooled,
        shape,
        build.seconds if build is not None else 0.0,
        static_cache_size(inputs, largest) if config.compile else 0,
        store,
    )


def _refuse(
    inputs: CallInputs, spec: DraftSpec, target: ModelFacts, draft: ModelFacts | None
) -> tuple[tuple[Any, Any] | None, ShapeChoice]:
    """Every refusal that needs no forward, in order; returns the (target, draft) tokenizers where the draft reads
    another tokenizer's ids (a `PreparedDraft` may hold them, else None), and the rounds' shape."""
    config, generation_config = inputs.config, inputs.generation_config
    tokenizers = check_draft(spec, target, draft, inputs.tokenizers)  # the models and the ids the draft reads
    validation.check_hybrid_draft(draft, tokenizers is not None)
    validation.check_generation_config(generation_config)
    validation.check_prompt_lookup(inputs.lookup_tokens, inputs.max_ngram)
    validation.check_inputs(inputs.input_ids, inputs.model_kwargs, inputs.streamer, inputs.generator)
    validation.check_cache_plan(target, transformers_api.generate_cache(inputs.model_kwargs), generation_config, config)
    validation.check_stopping(inputs.stopping_criteria, inputs.batch_size)
    check_supported(inputs.logits_processor, config.stateful_processors, inputs.batch_size)
    validation.check_replayed(inputs.logits_processor, config.stateful_processors, inputs.batch_size)
    if spec.model_free and (config.draft_form is not DraftForm.AUTO or config.draft_vocabulary is not None):
        raise ValueError(
            f"draft_model='{spec.kind}' runs no draft model: draft_form / draft_vocabulary have nothing to act on. "
            "Drop them, or pass a model as draft_model=."
        )
    store = validation.check_suffix_draft(inputs.suffix_draft, spec.model_free)
    store = spec.store if spec.store is not None else store
    if store is not None:
        validation.check_suffix(store, target.logit_width, inputs.tokenizers, inputs.lookup_tokens)
    if config.compile_draft and not spec.model_free:  # before any forward (AUTO's timings too)
        validation.check_draft_compiles(draft if draft is not None else target)
    static_cache = row_ops.is_static(transformers_api.generate_cache(inputs.model_kwargs))
    problems = validation.tree_problems(
        target,
        draft if draft is not None or spec.model_free else target,
        other_tokenizer=tokenizers is not None,
        config=config,
        static_cache=static_cache,
    )
    depth = config.num_lookahead if config.num_lookahead is not None else config.max_lookahead
    drafting = draft if draft is not None else target
    vocabulary = config.draft_vocabulary
    choices = vocabulary.numel() if isinstance(vocabulary, torch.Tensor) else vocabulary  # N: N ids at least
    choices = min(drafting.logit_width, choices or drafting.logit_width, target.logit_width)
    sampling, fixed = bool(generation_config.do_sample), config.num_lookahead is not None
    if spec.model_free:  # the suffix drafter, or prompt lookup (the same over each row's own text)
        return tokenizers, suffix_shape(cast(DraftShape, config.draft_shape), problems)
    shape = choose_shape(cast(DraftShape, config.draft_shape), problems, depth, choices, sampling, fixed)
    if store is None and inputs.lookup_tokens is None:
        return tokenizers, shape
    # beside the model, the suffix drafter's trees need the target alone to verify trees
    target_problems = validation.tree_problems(
        target, None, other_tokenizer=False, config=config, static_cache=static_cache
    )
    chains = bool(target_problems) or config.draft_shape is DraftShape.CHAIN
    return tokenizers, shape._replace(suffix_trees=not chains)


def _draft_plan(
    inputs: CallInputs,
    spec: DraftSpec,
    target: ModelFacts,
    draft: ModelFacts | None,
    target_kernel: KernelRouting,
    clock_free: bool,
    tokenizers: tuple[Any, Any] | None,
    largest: int,
    graphs: RunnerBackend | None,
) -> DraftPlan:
    """The draft model's part of the plan: prepared (the call's first forwards where AUTO times it), then inspected."""
    config = inputs.config
    auto_routing = target_kernel if config.linear_kernel is not LinearKernel.ON else None  # "off": timed eagerly
    auto_routing = auto_routing or KernelRouting.for_model(target, LinearKernel.AUTO, clock_free, Role.TARGET)
    prepared = draft_for_call(
        spec,
        target,
        draft,
        cast(DraftForm, config.draft_form),
        config.draft_vocabulary,
        special_token_ids(inputs.generation_config),
        auto_routing,
        other_tokenizer=tokenizers is not None,
        clock_free=clock_free,
        calibration=inputs.calibration,
        kernel=config.linear_kernel is not LinearKernel.OFF,
    )
    if target.tensor_parallel:
        distributed.check_same_draft(prepared.form, prepared.vocabulary, inputs.input_ids.device)
    same_config = draft if draft is not None else target
    facts = same_config if prepared.model is same_config.model else ModelFacts.of(prepared.model, same_config)
    if prepared.form is DraftForm.INT8_WEIGHTS:  # its own layers run the kernel's int8 path
        kernel = KernelRouting.off(f"int8 weights on the kernel's {best_path(torch.int8)} path")
    elif prepared.form is DraftForm.INT4_WEIGHTS:
        kernel = KernelRouting.off(f"int4 weights on the kernel's {best_path(torch.uint8)} path (LM head int8)")
    else:
        kernel = KernelRouting.for_model(facts, cast(LinearKernel, config.linear_kernel), clock_free, Role.DRAFT)
    description = prepared.description
    step = None
    if config.compile_draft and prepared.form is DraftForm.DYNAMIC_INT8:
        # torch's dynamic int8 linears are script objects dynamo cannot trace: compiling would only add graph breaks
        description += "; its steps run eagerly under compile_draft: torch's dynamic int8 linears break compiled "
        description += "graphs (draft_form='int8_weights' compiles)"
    elif config.compile_draft:
        step = compiled_forward(prepared.step_model(), CompileSettings.for_draft_steps())
    shared = None
    if tokenizers is None:
        ids = prepared.ids_for(target)  # (subset,) the ids its logits stand for, or None: all of the target's
        vocabulary = DraftVocabulary(ids, None, target.logit_width)
    else:
        shared = _shared(prepared, tokenizers, target)
        vocabulary = DraftVocabulary(shared.target_ids, shared.draft_columns, target.logit_width)
    embeddable = facts.embeddable if tokenizers is None and facts.embeddable < target.logit_width else None
    # Under compile=True the draft's cache keeps its address too, and its steps (one position; two where a round
    # catches up on the last committed tokens) run through runners (what a captured step needs); not where its
    # steps are compiled for a dynamic cache (`compile_draft`), it reads another tokenizer's ids (rows even up by
    # dropping slots), or it keeps recurrent states (rolled back by re-feeding).
    static = config.compile and step is None and tokenizers is None and not facts.keeps_state
    static = static and row_ops.static_cache_problem(None, facts.model.config) is None
    runner = RunnerPlan(graphs or RunnerBackend.EAGER, DRAFT_STEP_SIZES) if static else None
    forwards = Forwards(kernel=kernel, wide=prepared.wide, step=step, embeddable=embeddable, runner=runner)
    return DraftPlan(prepared, facts, forwards, vocabulary, shared, tokenizers, description, static)


def static_cache_size(inputs: CallInputs, largest: int) -> int:
    """Slots of a call's static caches under `compile=True`: the prompt, the new tokens, and one verification of
    `largest` positions (K + 1) past them (a round padded to its full size writes past the committed length;
    `RoundLookahead` keeps the committed tokens within `max_length`)."""
    generation_config = inputs.generation_config
    return max(int(generation_config.max_length) + largest, generation_config.max_cache_len or 0)


def makes_target_cache(config: object) -> bool:
    """Whether a call given no cache makes its target's itself (`CallPlan.pooled`), so that `generate()` need build
    none: under `SpeculativeConfig(compile=True)`, a static cache at the call's final size (or a kept one)."""
    return isinstance(config, SpeculativeConfig) and config.compile


def _shared(prepared: PreparedDraft, tokenizers: tuple[Any, Any], target: ModelFacts) -> SharedVocabulary:
    """The tokens both tokenizers share: the prepared draft's where it holds these very tokenizers' (built by
    `prepare_draft`), else looked up (`proposers.cross_tokenizer.shared_vocabulary`, cached per tokenizer pair)."""
    if prepared.shared_vocabulary is not None and same_tokenizers(tokenizers, prepared.tokenizers):
        return prepared.shared_vocabulary
    # not empty: `validation.check_tokenizers` refused a pair that shares no token, before any forward
    return shared_vocabulary(*tokenizers, target.logit_width, prepared.logit_width)


def _target_forwards(
    inputs: CallInputs, target: ModelFacts, kernel: KernelRouting, largest: int, graphs: RunnerBackend | None = None
) -> tuple[Any, Forwards, str, bool]:
    """The caller's cache (`CallPlan.cache`), how the target's forwards run, what ran its linears (for the
    statistics), and whether the loop makes its cache for this call under `compile=True` (`CallPlan.pooled`).

    Eager rounds of a CPU bf16 target run on the small-rows kernel where it pays (`kernel`). Compiled ones
    (`compile=True`) run it inside the graph (`CompileSettings.kernel_rows`) under linear_kernel="on", and under
    "auto" where its plan serves every round size of this batch (`_kernel_in_graph`); else inductor's GEMM. The plan
    also serves the forwards that run eagerly (wider than the kernel's rows, or a batch that shrinks to one row).
    Where the call's forwards run as graphs (`graphs`: CUDA under compile=True), every round runs on a runner of
    the largest round's size instead of the compiled forward (the prompt eagerly).
    """
    config = inputs.config
    choice = cast(LinearKernel, config.linear_kernel)  # parsed by SpeculativeConfig
    kernel_in_graph = config.compile and _kernel_in_graph(kernel, choice, inputs.batch_size, largest)
    cache, compiled, pooled = _target_cache(inputs, target, kernel_in_graph, largest)
    if graphs is not None and pooled:  # the runner's own compiled code replaces the compiled forward
        runner = RunnerPlan(graphs, (largest,))
        forwards = Forwards(kernel=kernel, runner=runner, largest_round=largest)
        return cache, forwards, f"target on {graphs.value} runners", pooled
    in_graph = compiled is not None and compiled.settings.kernel_rows > 0
    eager_kernel = kernel if compiled is None or in_graph else None
    if eager_kernel is None:
        description = "target compiled"
    elif in_graph:
        assert compiled is not None  # `in_graph` says so
        rows = compiled.settings.kernel_rows
        description = f"target compiled, its linears of 1-{rows} rows on the kernel: {kernel.reason}"
    else:
        description = f"target {kernel.reason}"
    return cache, Forwards(kernel=eager_kernel, compiled=compiled, largest_round=largest), description, pooled


def _target_cache(
    inputs: CallInputs, target: ModelFacts, kernel_in_graph: bool, largest: int
) -> tuple[Any, CompiledForward | None, bool]:
    """The caller's cache (None: the loop makes one), the target's compiled forward if this call compiles (else
    None), and whether the loop makes the target's cache for this call under `compile=True` (then at its final size,
    `static_cache_size`, possibly a kept one: `decoding.static_caches`).

    A static cache is used when the caller asks for one (`cache_implementation="static"`, a `StaticCache` passed in)
    or for compiled verification (`SpeculativeConfig(compile=True)`); it is made of full `StaticLayer`s of at least
    `max_length` slots (`cache.row_ops.full_static_cache`, converting the caller's cache in place). The forward is
    compiled as plain `generate()` would compile it for this static cache (`compile_config`, on CPU only with its
    `_compile_all_devices`), or with `CompileSettings.for_device` under `compile=True` (`kernel_in_graph`: its
    round-size linears are the small-rows kernel's).
    """
    config, generation_config = inputs.config, inputs.generation_config
    cache = transformers_api.generate_cache(inputs.model_kwargs)
    if not row_ops.runs_static(cache, generation_config.cache_implementation, config.compile):
        return cache, None, False
    # `validation.check_cache_plan` refused offloaded caches and compile=True for a target that cannot compile.
    given = not inputs.caller_cache and row_ops.total_slots(cache) == 0 and not row_ops.is_static(cache)
    fresh = cache is None or given
    # At least max_length slots; as many as generate() allocated (it keeps the largest size seen, so that compiled
    # code is not recompiled for a new size) or `max_cache_len` asks for.
    sizes = [generation_config.max_length, generation_config.max_cache_len or 0]
    sizes += [layer.max_cache_len for layer in getattr(cache, "layers", ()) if hasattr(layer, "max_cache_len")]
    pooled = fresh and makes_target_cache(config)
    if pooled:
        cache = None
    else:
        cache = row_ops.full_static_cache(None if fresh else cache, target.model.config, int(max(sizes)))
    if config.compile:
        settings = CompileSettings.for_device(target.input_device, kernel=kernel_in_graph)
    elif target.compile_problem is None and transformers_api.valid_auto_compile(target.model, cache, generation_config):
        compile_config = generation_config.compile_config or transformers_api.default_compile_config(target.model)
        settings = CompileSettings.from_compile_config(compile_config)
    else:
        return cache, None, pooled
    return cache, compiled_forward(target.model, settings), pooled


def _kernel_in_graph(routing: KernelRouting, choice: LinearKernel, batch: int, largest: int) -> bool:
    """Whether `compile=True` compiles the target with its round-size linears on the small-rows kernel.

    Under "on", always (`KernelRouting.for_model` refused it first where the kernel cannot serve the target). Under
    "auto", where the model's routing serves every forward a round of this batch runs (`batch` rows times 2 ..
    `largest` positions: a one-position round runs as two in compiled code), all within the kernel's `MAX_ROWS`:
    the routing's timing on the model's own weights (eager `F.linear` against the kernel) decides, on the machine at
    hand. Elsewhere inductor's GEMM serves every forward (a batch whose rounds the kernel cannot all serve would
    otherwise run its larger rounds eagerly).
    """
    if choice is LinearKernel.ON:
        return True
    if choice is LinearKernel.OFF or batch * largest > MAX_ROWS:
        return False
    return all(routing.serves(batch * size) for size in range(2, largest + 1))
