"""The decoding loop: draft -> verify -> accept -> commit, until every row stops.

`speculative_generate` is a transformers `custom_generate` callable: `generate()` prepares inputs, logits
processors and stopping criteria exactly as for plain decoding, then hands them to it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.generation.streamers import BaseStreamer

from . import distributed, transformers_api, validation
from .cache import row_ops
from .cache.cached_model import CachedModel, input_device
from .cache.compiled import CompiledForward, CompileSettings, compile_problem, compiled_forward
from .call_inputs import CallInputs
from .kernels.small_rows import MAX_ROWS, KernelPlan, best_path
from .lookahead import RoundLookahead, RoundRecord, RoundWidths, most_draft_tokens, weight_bytes_ratio
from .options import DraftQuantization, LinearKernel, NamedDraft, SpeculativeConfig, Verification
from .outputs import OutputRecorder, SpeculativeDecoderOnlyOutput
from .prepare.prepared_draft import PreparedDraft, draft_for_call
from .prepare.vocabulary import special_token_ids
from .proposers.base import Proposal, Proposer
from .proposers.cross_vocab import DraftIdBuffer, TextBridge, shared_vocabulary
from .proposers.draft_model import DraftModelProposer
from .proposers.prompt_lookup import DEFAULT_MAX_NGRAM, LookupThenModelProposer, PromptLookupProposer
from .round_timer import PhaseTimer
from .sequences import Sequences
from .stats import SpeculativeStats
from .verify.processing import PositionwiseProcessor, probabilities
from .verify.rejection import (
    NonFinite,
    Verdict,
    block_accept,
    first_argmax,
    flag_nonfinite,
    greedy_accept,
    speculative_accept,
)
from .verify.stopping import StopCheck


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft_model: PreTrainedModel | PreparedDraft | str | None = None,
    num_lookahead: int | None = None,
    generator: torch.Generator | None = None,
    speculative_config: SpeculativeConfig | None = None,
    speculative_streamer: BaseStreamer | None = None,
    speculative_tokenizers: tuple[Any, Any] | None = None,
    speculative_caller_cache: bool = False,
    speculative_prompt_lookup_num_tokens: int | None = None,
    speculative_max_matching_ngram_size: int | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
    """Speculative sampling with a draft model, as a `custom_generate` callable of `model.generate()`.

    Call it through `model.generate(..., draft_model=small)` once `hf_specsample` is imported, or explicitly as
    `model.generate(..., custom_generate=hf_specsample.speculative_generate, draft_model=small)`.

    Args:
        model: the target causal LM (`generate()` passes itself).
        input_ids: `(batch, prompt_length)` long, the prepared (left-padded, expanded) prompt.
        logits_processor: processors `generate()` built from the generation config and the caller; applied to
            draft and target alike, at every position with that position's own prefix.
        stopping_criteria: criteria `generate()` built; checked after every committed token.
        generation_config: the resolved generation config (`do_sample`, `max_length`, `return_dict_in_generate`, ...).
        draft_model: the draft causal LM: the target's tokenizer, or another one given as `draft_tokenizer=`
            (with the target's as `tokenizer=`). "auto": a draft made from the target
            (an int8 copy on the CPU, a layer-skipping view elsewhere), for targets with no small sibling. Or a
            `PreparedDraft` from `hf_specsample.prepare_draft`, run as it is.
        num_lookahead: draft tokens per round (K >= 1); overrides `speculative_config.num_lookahead`. Default:
            chosen before every round from measured acceptance and costs (see `AdaptiveLookahead`).
        generator: optional `torch.Generator` for all random draws (reproducible sampling).
        speculative_config: further options, see `SpeculativeConfig`.
        speculative_streamer: where committed tokens are streamed (the registered `generate()` passes the caller's
            `streamer=` here, because transformers does not forward `streamer` to custom decoding callables).
        speculative_tokenizers: (target tokenizer, draft tokenizer), set by the registered `generate()` from
            `tokenizer=` and `draft_tokenizer=` / `assistant_tokenizer=`. When their vocabularies differ, the draft
            reads its own ids and drafts over the tokens both share (`proposers/cross_vocab.py`).
        speculative_caller_cache: set by the registered `generate()` when the caller passed a cache (`cache=`, or
            `past_key_values=` where transformers still takes it):
            that object is then left holding what plain `generate()` leaves in it, even without
            `return_dict_in_generate` (a non-empty cache is taken to be the caller's in any case).
        speculative_prompt_lookup_num_tokens / speculative_max_matching_ngram_size: transformers'
            `prompt_lookup_num_tokens=` / `max_matching_ngram_size=`, passed on by the registered `generate()`: the
            n-gram drafter's tokens per lookup round and longest n-gram (see `proposers/prompt_lookup.py`). With a model
            draft, n-gram continuations are drafted first where a row has one.
        **model_kwargs: `attention_mask` `(batch, prompt_length)`, `position_ids` `(batch, prompt_length)`, the
            prepared cache under `transformers_api.CACHE` (empty, or holding the first tokens of `input_ids` from an
            earlier turn), and
            the flags `generate()` sets (`use_cache`, `logits_to_keep`).

    Returns:
        `(batch, sequence_length)` long sequences, or a `SpeculativeDecoderOnlyOutput` (with `speculative_stats`)
        when `return_dict_in_generate=True`; its cache (`out.cache`, or `out.past_key_values` before transformers
        5.24) holds what plain `generate()`'s would hold.
    """
    if draft_model is None:
        raise ValueError(
            "speculative_generate needs `draft_model=` (a small causal LM sharing the target's tokenizer)."
        )
    config = SpeculativeConfig.resolve(speculative_config, num_lookahead)
    prepared = isinstance(draft_model, PreparedDraft)
    running = draft_model.model if prepared else draft_model
    validation.check_models(model, running)
    tokenizers = speculative_tokenizers
    held = draft_model.tokenizers if prepared else None  # prepared with another tokenizer: held with the draft
    if held is not None and (tokenizers is None or _same_objects(tokenizers, held)):
        tokenizers, other_tokenizer = held, True  # prepare_draft compared their vocabularies
    else:
        draft_width = draft_model.width if prepared else None
        other_tokenizer = validation.check_tokenizers(model, running, tokenizers, draft_width)
    validation.check_hybrid_draft(running, other_tokenizer)
    lookup_tokens, max_ngram = speculative_prompt_lookup_num_tokens, speculative_max_matching_ngram_size
    if lookup_tokens is None:  # called as custom_generate= directly: transformers' own fields
        lookup_tokens = generation_config.prompt_lookup_num_tokens
    if max_ngram is None:
        max_ngram = generation_config.max_matching_ngram_size
    validation.check_generation_config(generation_config)
    validation.check_prompt_lookup(lookup_tokens, max_ngram)
    validation.check_inputs(input_ids, model_kwargs, speculative_streamer)
    validation.check_cache_plan(model, transformers_api.generate_cache(model_kwargs), generation_config, config)
    validation.check_stopping(stopping_criteria, input_ids.shape[0])
    decoder = SpeculativeDecoder(
        CallInputs(
            model=model, draft_model=draft_model, input_ids=input_ids, model_kwargs=model_kwargs,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, config=config, generator=generator, streamer=speculative_streamer,
            caller_cache=speculative_caller_cache, lookup_tokens=lookup_tokens, max_ngram=max_ngram,
            other_tokenizers=tokenizers if other_tokenizer else None,
        )
    )  # fmt: skip
    return decoder.run()


class SpeculativeDecoder:
    """State of one speculative `generate()` call; `run()` is the loop."""

    def __init__(self, call: CallInputs):
        model, draft_model, input_ids, model_kwargs = call.model, call.draft_model, call.input_ids, call.model_kwargs
        generation_config, config, generator = call.generation_config, call.config, call.generator
        lookup_tokens, other_tokenizers = call.lookup_tokens, call.other_tokenizers
        self.max_length = int(generation_config.max_length)
        self.do_sample = bool(generation_config.do_sample)
        self.pad_token_id = _as_int(transformers_api.pad_token_id(generation_config))
        self.stops = StopCheck(call.stopping_criteria, input_ids.device)
        self.streamer = call.streamer
        self.processor = PositionwiseProcessor(
            call.logits_processor, batch_size=input_ids.shape[0], fast=config.fast_processors
        )
        self.tensor_parallel = distributed.is_tensor_parallel(model)
        if self.tensor_parallel:  # every rank must draw the same randomness (see distributed.py)
            generator = distributed.shared_generator(generator, input_ids.device)
        self.generator = generator
        # A seeded call repeats its sample in any process, and tensor-parallel ranks must run identical rounds: no
        # choice below may then depend on the clock (the draft's form, the kernel plans, K).
        reproducible = generator is not None

        # The target's kernel plan (AUTO's timing; "on" refused where the kernel cannot serve the target), made
        # before the draft's form timings and calibration forwards, so that a refusal comes before any forward.
        plan = KernelPlan.for_model(model, config.linear_kernel, reproducible, "target")
        vocab_size = validation.vocab_size(model)
        self.verification = config.verification
        batch = input_ids.shape[0]
        draft = None
        if draft_model == NamedDraft.PROMPT_LOOKUP:  # no model: every round proposes up to K tokens by lookup
            if config.draft_quantization is not DraftQuantization.AUTO or config.draft_vocabulary is not None:
                raise ValueError(
                    "draft_model='prompt_lookup' runs no draft model: draft_quantization / draft_vocabulary have "
                    "nothing to act on. Drop them, or pass a model as draft_model= with prompt_lookup_num_tokens=."
                )
        else:
            if config.compile_draft:  # before any forward (AUTO's timings included)
                _check_draft_compiles(draft_model, model)
            draft = draft_for_call(
                draft_model, model, config.draft_quantization, config.draft_vocabulary,
                special_token_ids(generation_config), other_tokenizer=other_tokenizers is not None,
                calibration=_calibration(input_ids, model_kwargs.get("attention_mask")), clock_free=reproducible,
            )  # fmt: skip
            if self.tensor_parallel:
                distributed.check_same_draft(draft.quantization, draft.vocabulary, input_ids.device)

        # A row never holds more than max_length tokens: `RoundLookahead` caps K so that the drafts and the
        # recovered/bonus token fit (one spare column).
        capacity = self.max_length + 1
        position_ids = model_kwargs.get("position_ids")
        position_ids = position_ids if position_ids is not None and position_ids.dim() == 2 else None
        self.sequences = Sequences(input_ids, model_kwargs.get("attention_mask"), capacity, position_ids)
        cache = transformers_api.generate_cache(model_kwargs)
        widest_round = most_draft_tokens(config, lookup_tokens, lookup_only=draft is None) + 1
        # Eager rounds of a CPU bf16 target run on the small-rows kernel where it pays. Compiled ones
        # (`compile=True`) run it inside the graph (`CompileSettings.kernel_rows`) under linear_kernel="on", and
        # under "auto" where its plan serves every round width of this batch (`_kernel_in_graph`); else inductor's
        # GEMM. The plan also checks the kernel against eager F.linear on the target's weights (refusing "on" where
        # it cannot serve the target) and serves the forwards that run eagerly (wider than the kernel's rows, or a
        # batch that shrinks to one row).
        kernel_in_graph = config.compile and _kernel_in_graph(plan, config.linear_kernel, batch, widest_round)
        cache, compiled = _target_cache(model, cache, call.caller_cache, generation_config, config, kernel_in_graph)
        cached = row_ops.total_slots(cache) if cache is not None else 0
        in_graph = compiled is not None and compiled.settings.kernel_rows > 0
        kernel = plan if compiled is None or in_graph else None
        self.target = CachedModel(
            model, batch, cache, cached_is_real=self.sequences.is_real(cached), compiled=compiled,
            compiled_widths=widest_round, kernel=kernel, source=self.sequences,
        )  # fmt: skip
        self._compile_seconds_before = compiled.compile_seconds if compiled is not None else None
        prompt_length = input_ids.shape[1]
        prompt_ends_in_padding = not bool(self.sequences.is_real(prompt_length)[:, -1].all())
        self.lookahead = RoundLookahead.for_call(
            config, reproducible=reproducible, batch_size=batch, max_length=self.max_length,
            prompt_ends_in_padding=prompt_ends_in_padding, lookup_tokens=lookup_tokens, lookup_only=draft is None,
            cost_ratio=weight_bytes_ratio(draft.model, model) if draft is not None else 0.0,
            draft_step_seconds=draft.measured_step_seconds if draft is not None else None,
        )  # fmt: skip
        self.sequences.rows.attach(self.target)
        if draft is None or lookup_tokens is not None:
            lookup = PromptLookupProposer(call.max_ngram or DEFAULT_MAX_NGRAM)
        self.stats = SpeculativeStats.for_batch(input_ids.shape[0])
        if kernel is None:
            self.stats.linear_kernel = "target compiled"
        elif in_graph:
            rows = compiled.settings.kernel_rows
            self.stats.linear_kernel = f"target compiled, its linears of 1-{rows} rows on the kernel: {kernel.reason}"
        else:
            self.stats.linear_kernel = f"target {kernel.reason}"
        self.drafter: Proposer
        self.model_drafter: DraftModelProposer | None = None
        self.draft_step: CompiledForward | None = None
        if draft is None:
            self.drafter = lookup
        else:
            if draft.quantization is DraftQuantization.INT8_WEIGHTS:  # its own layers run the kernel's int8 path
                draft_kernel = KernelPlan.off(f"int8 weights on the kernel's {best_path(torch.int8)} path")
            elif draft.quantization is DraftQuantization.INT4_WEIGHTS:
                path = best_path(torch.uint8)
                draft_kernel = KernelPlan.off(f"int4 weights on the kernel's {path} path (LM head int8)")
            else:
                draft_kernel = KernelPlan.for_model(draft.model, config.linear_kernel, reproducible, "draft")
            self.stats.linear_kernel += f"; draft {draft_kernel.reason}"
            self.draft_step, eager_steps = _draft_step(draft) if config.compile_draft else (None, None)
            self.model_drafter = self.draft_proposer(draft, model, vocab_size, other_tokenizers, draft_kernel)
            self.drafter = self.model_drafter
            if lookup_tokens is not None:  # transformers' argument: n-gram continuations first, the model elsewhere
                self.drafter = LookupThenModelProposer(self.drafter, lookup)
        # Plain generate() returns its cache with the output object (unless use_cache=False), and leaves a cache the
        # caller passed in as it returns it: so do we. Otherwise finished rows' caches are not worth keeping.
        wanted = bool(generation_config.return_dict_in_generate) or call.caller_cache or cached > 0
        self.keep_cache = wanted and model_kwargs.get("use_cache") is not False
        self.finished_caches: dict[int, CachedModel] = {}  # caller's row -> that row's target cache, once finished
        self.recorder = OutputRecorder(generation_config, batch)
        self.stats.draft_form = draft.form if draft is not None else str(NamedDraft.PROMPT_LOOKUP)
        if draft is not None and config.compile_draft and self.draft_step is None:
            self.stats.draft_form += f"; its steps run eagerly under compile_draft: {eager_steps}"
        self.timer = PhaseTimer(self.lookahead.needs_timing, input_ids.device)

    def draft_proposer(
        self,
        draft: PreparedDraft,
        model: PreTrainedModel,
        vocab_size: int,
        other_tokenizers: tuple[Any, Any] | None,
        kernel: KernelPlan | None = None,
    ) -> DraftModelProposer:
        """The draft-model proposer: over the target's ids, or with another tokenizer over the tokens both share."""
        if other_tokenizers is None:
            draft_ids = draft.ids_for(model)  # (subset,) the ids its logits stand for, or None: all of the target's
            return DraftModelProposer(
                draft.model, self.sequences, self.processor, self.do_sample, self.generator, draft_ids, vocab_size,
                kernel=kernel, wide=draft.wide, step=self.draft_step,
            )  # fmt: skip
        target_tokenizer, draft_tokenizer = other_tokenizers
        if draft.shared_vocabulary is not None and _same_objects(other_tokenizers, draft.tokenizers):
            shared = draft.shared_vocabulary  # built by prepare_draft
        else:
            shared = shared_vocabulary(target_tokenizer, draft_tokenizer, vocab_size, draft.width)
        if shared.size == 0:
            raise ValueError(
                "The draft's tokenizer shares no token with the target's, so it can propose nothing. Use a draft whose "
                "vocabulary overlaps the target's."
            )
        self.stats.shared_vocabulary = shared.size
        shared = shared.to(self.sequences.tokens.device)
        inputs = DraftIdBuffer(self.sequences, shared, TextBridge(target_tokenizer, draft_tokenizer))
        return DraftModelProposer(
            draft.model, self.sequences, self.processor, self.do_sample, self.generator, shared.target_ids,
            vocab_size, columns=shared.draft_columns, inputs=inputs, kernel=kernel, wide=draft.wide,
            step=self.draft_step,
        )  # fmt: skip

    def run(self) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
        if self.streamer is not None:
            self.streamer.put(self.sequences.tokens[:, : self.sequences.prompt_length].cpu())
        self.target.warm_up()  # compile now, outside every round (the prompt then runs compiled too)
        draft_compile_before = self.draft_step.compile_seconds if self.draft_step is not None else 0.0
        if self.model_drafter is not None and self.draft_step is not None:
            self.model_drafter.warm_up()  # the draft's compiled step too
        while self.sequences.num_active > 0:
            self.round(self.lookahead.widths(self.sequences.lengths))
        if self.streamer is not None:
            self.streamer.end()
        self.stats.target_forward_passes = self.target.forward_passes
        self.stats.target_refeed_passes = self.target.refeed_passes
        self.stats.draft_forward_passes = self.drafter.forward_passes
        if self.target.compiled is not None:
            self.stats.compile_seconds = self.target.compiled.compile_seconds - self._compile_seconds_before
        if self.draft_step is not None:
            self.stats.draft_compile_seconds = self.draft_step.compile_seconds - draft_compile_before
        sequences = self.sequences.output(self.pad_token_id)
        cache = self.plain_cache(sequences) if self.keep_cache else None
        return self.recorder.build(sequences, self.stats, cache if self.recorder.return_dict else None)

    def round(self, widths: RoundWidths) -> None:
        """One draft -> verify -> accept -> commit round over all active rows; the policy learns its costs."""
        compilations = self._compilations()
        refeeds = self.target.refeed_passes
        self.timer.start()
        proposal = self.drafter.get_candidates(self.sequences, widths)
        self.timer.mark()
        scores, raw_logits = self.verify(proposal)
        verdict = self.accept(proposal, scores)
        num_accepted = self.commit(proposal, verdict, scores, raw_logits)
        self.timer.mark()
        if self.stats.rounds == 1 and self.sequences.num_active:
            self.target.warm_up()  # a cache allocated by the first round, or weights changed since the first warm-up
        # The first round also encodes the prompt, and a round that compiled says nothing of later rounds' costs.
        prefill = self.stats.rounds == 1 or self._compilations() != compilations
        width = proposal.tokens.shape[1]  # the drafter's, which a lookup round may widen
        tested = sum(accepted + int(accepted < width) for accepted in num_accepted)
        record = RoundRecord(
            width, sum(num_accepted), tested, 0.0, 0.0, prefill=prefill,
            refeed_forwards=self.target.refeed_passes - refeeds,
        )  # fmt: skip
        for timed, model_steps in self.timer.finish(record, proposal.model_steps):
            self.lookahead.observe(timed, model_steps)

    def _compilations(self) -> int:
        """Compilations so far by the target's compiled forward and the draft's compiled step."""
        return sum(compiled.compilations for compiled in (self.target.compiled, self.draft_step) if compiled)

    def verify(self, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """Target scores at the K+1 positions after each row's committed tokens, in one forward pass.

        Returns:
            `(batch, K + 1, vocab)` processed scores and the raw logits they came from.
        """
        lookahead = proposal.tokens.shape[1]
        lengths = self.sequences.lengths
        upto = [length + lookahead for length in lengths]
        raw_logits = self.target.feed_upto(self.sequences, upto, num_logits=lookahead + 1)
        scores = self.processor(self.sequences.tokens, lengths, raw_logits, self.sequences.rows.active)
        return scores, raw_logits

    def accept(self, proposal: Proposal, scores: torch.Tensor) -> Verdict:
        """The round's verdict: greedy by argmax, else the configured rule on the proposal's distributions (its
        point masses as token ids, `verify/rejection.py`), with NaN/inf rows flagged.

        Args:
            scores: `(batch, K + 1, vocab)` the target's processed scores.
        """
        if not self.do_sample:
            verdict = greedy_accept(proposal.tokens, first_argmax(scores))
        else:
            target_probs = probabilities(scores)  # (batch, K + 1, vocab)
            rule = block_accept if self.verification is Verification.BLOCK else speculative_accept
            draft_probs, point_mass = proposal.probs, proposal.point_mass  # None / None: all point masses
            # A mask only where a proposal mixes point masses with distributions: a rule's four-argument call stays
            # the contract (`Verification`), and `point_mass` an optional keyword.
            mixed = {} if point_mass is None else {"point_mass": point_mass}
            verdict = rule(proposal.tokens, draft_probs, target_probs, self.generator, **mixed)
            verdict = flag_nonfinite(verdict, draft_probs, target_probs, point_mass)
        return distributed.broadcast_verdict(verdict) if self.tensor_parallel else verdict

    def commit(self, proposal: Proposal, verdict: Verdict, scores: torch.Tensor, raw_logits: torch.Tensor) -> list[int]:
        """Write the recovered/bonus token, stop rows where `generate()` would, roll caches back, drop done rows.

        Returns:
            Per row active in this round, the number of draft tokens it accepted.
        """
        seqs = self.sequences
        eos_flags = self.stops.eos_flags(proposal.tokens, verdict.next_tokens)  # (batch, K + 1) or None
        read = verdict.num_accepted[:, None]
        if eos_flags is not None:
            read = torch.cat([read, eos_flags.to(read.device)], dim=1)
        if self.streamer is not None:  # the row's new tokens travel with it: no read of their own
            read = torch.cat([read, proposal.tokens.to(read.device), verdict.next_tokens[:, None].to(read.device)], 1)
        values = read.tolist()  # the round's one host sync
        num_accepted = [row[0] for row in values]
        _raise_if_nonfinite(num_accepted)
        seqs.write(verdict.num_accepted, verdict.next_tokens)
        width = proposal.tokens.shape[1]
        flags = None if eos_flags is None else [row[1 : width + 2] for row in values]
        stops = self.stops.first_stops(seqs.tokens, seqs.lengths, num_accepted, flags)
        counts = [stop if stop is not None else accepted + 1 for stop, accepted in zip(stops, num_accepted)]

        if self.streamer is not None:
            tokens = values[0][-(width + 1) :]  # row 0's drafts, then its next token
            committed = tokens[: num_accepted[0]] + [tokens[-1]]
            self.streamer.put(torch.tensor([committed[: counts[0]]]))
        callers = seqs.rows.callers()
        self.recorder.record(callers, counts, scores, raw_logits if self.recorder.wants_raw_logits else None)
        self.stats.record_round(callers, proposal.tokens.shape[1], num_accepted, counts)

        seqs.advance(counts)
        self.target.keep_confirmed(seqs.lengths)  # rejected drafts out; a stopped row keeps its length - 1
        done = [stop is not None for stop in stops]
        if self.keep_cache:
            self.keep_finished_caches(done)
        seqs.retire(done)  # drops finished rows from the buffer and from both caches
        if seqs.num_active:
            self.drafter.keep_confirmed(seqs.lengths)
        return num_accepted

    def keep_finished_caches(self, done: list[bool]) -> None:
        """Set aside the target cache of each row that stops this round, for the cache `generate()` returns."""
        rows = [row for row, is_done in enumerate(done) if is_done]
        if rows == [0] and self.sequences.num_active == 1:  # the last row: its cache is the whole cache, no copy
            self.finished_caches[self.sequences.rows.caller(0)] = self.target
            return
        for row in rows:
            self.finished_caches[self.sequences.rows.caller(row)] = self.target.take_rows([row])

    def plain_cache(self, sequences: torch.Tensor):
        """The cache plain `generate()` would return with these sequences, in the cache object it was given.

        Plain decoding keeps finished rows in the batch, feeding them padding, and never feeds the last token. So
        each row holds ``sequences[b, :-1]``, from slot 0: finished rows are fed their EOS and padding here, then
        every row's leading holes are dropped and the rows are stacked.

        Args:
            sequences: `(batch, length)` the output sequences.
        """
        parts = [self.finished_caches[row] for row in range(sequences.shape[0])]
        length = sequences.shape[1] - 1
        for row, part in enumerate(parts):
            start = part.fed[0]
            part.drop_shared_holes()  # before feeding: a static cache of max_length slots has no room for holes
            if start < length:
                part.feed(self.sequences.columns_of(sequences[row : row + 1], [row], [start], length - start), 1)
            part.left_align()
        if parts != [self.target]:  # a single row that never left the batch is already in place
            row_ops.stack_rows_into(self.target.cache, [part.cache for part in parts])
        self.target.stop_recording()
        return self.target.cache


def _target_cache(
    model: PreTrainedModel,
    cache: Any,
    caller_cache: bool,
    generation_config: GenerationConfig,
    config: SpeculativeConfig,
    kernel_in_graph: bool = False,
) -> tuple[Any, CompiledForward | None]:
    """The target's cache, and its compiled forward if this call compiles (else None).

    `kernel_in_graph`: under `compile=True`, the forward's round-width linears are the small-rows kernel's
    (`CompileSettings.for_device(kernel=True)`; see `_kernel_in_graph`).

    A static cache is used when the caller asks for one (`cache_implementation="static"`, a `StaticCache` passed in)
    or for compiled verification (`SpeculativeConfig(compile=True)`); it is made of full
    `StaticLayer`s of at least `max_length` slots (`cache.row_ops.full_static_cache`, converting the caller's cache in
    place). The forward is compiled as plain `generate()` would compile it for this static cache (`compile_config`,
    on CPU only with its `_compile_all_devices`), or with `CompileSettings.for_device` under `compile=True`.
    """
    implementation = generation_config.cache_implementation
    if not (config.compile or implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS or row_ops.is_static(cache)):
        return cache, None
    # `validation.check_cache_plan` refused offloaded caches and compile=True for a target that cannot compile.
    problem = compile_problem(model)
    fresh = cache is None or (not caller_cache and row_ops.total_slots(cache) == 0 and not row_ops.is_static(cache))
    # At least max_length slots; as many as generate() allocated (it keeps the largest size seen, so that compiled
    # code is not recompiled for a new size) or `max_cache_len` asks for.
    sizes = [generation_config.max_length, generation_config.max_cache_len or 0]
    sizes += [layer.max_cache_len for layer in getattr(cache, "layers", ()) if hasattr(layer, "max_cache_len")]
    cache = row_ops.full_static_cache(None if fresh else cache, model.config, int(max(sizes)))
    if config.compile:
        settings = CompileSettings.for_device(input_device(model), kernel=kernel_in_graph)
    elif problem is None and transformers_api.valid_auto_compile(model, cache, generation_config):
        compile_config = generation_config.compile_config or transformers_api.default_compile_config(model)
        settings = CompileSettings.from_compile_config(compile_config)
    else:
        return cache, None
    return cache, compiled_forward(model, settings)


def _kernel_in_graph(plan: KernelPlan, choice: LinearKernel, batch: int, widest_round: int) -> bool:
    """Whether `compile=True` compiles the target with its round-width linears on the small-rows kernel.

    Under "on", always (`KernelPlan.for_model` refused it first where the kernel cannot serve the target). Under
    "auto", where the model's plan serves every forward a round of this batch runs (`batch` rows times 2 ..
    `widest_round` positions: a one-position round runs as two in compiled code), all within the kernel's
    `MAX_ROWS`: the plan's timing on the model's own weights (eager `F.linear` against the kernel) decides, on
    the machine at hand. Elsewhere inductor's GEMM serves every forward (a batch whose rounds the kernel
    cannot all serve would otherwise run its wider rounds eagerly).
    """
    if choice is LinearKernel.ON:
        return True
    if choice is LinearKernel.OFF or batch * widest_round > MAX_ROWS:
        return False
    return all(plan.serves(batch * width) for width in range(2, widest_round + 1))


CALIBRATION_TOKENS = 128  # the most prompt tokens an implicit draft's forms are weighed on
CALIBRATION_MIN_TOKENS = 16  # shorter prompts say too little of acceptance: the forms are compared by step time alone


def _check_draft_compiles(draft_model: Any, target: PreTrainedModel) -> None:
    """Refuse `compile_draft=True`, before any forward, for a draft whose forward cannot compile (a hybrid model,
    an offloaded one, a quantization transformers marks not compileable, a tensor-parallel one)."""
    if draft_model == NamedDraft.AUTO:
        draft = target
    else:
        draft = draft_model.model if isinstance(draft_model, PreparedDraft) else draft_model
    problem = compile_problem(draft)
    if problem is not None:
        raise ValueError(
            f"compile_draft=True cannot compile this draft: {problem}. Leave compile_draft=False for this draft (its "
            "steps then run eagerly), or pass a draft whose forward compiles."
        )


def _draft_step(draft: PreparedDraft) -> tuple[CompiledForward | None, str | None]:
    """The compiled single-token step of `draft` (`SpeculativeConfig(compile_draft=True)`), or None and why its steps
    run eagerly: torch's dynamic int8 form (which AUTO may choose) breaks a compiled graph at every linear (its
    packed weights are script objects dynamo cannot trace), so compiling it would only add the breaks' cost."""
    if draft.quantization is DraftQuantization.INT8:
        return None, "torch's dynamic int8 linears break compiled graphs (draft_quantization='int8_weights' compiles)"
    return compiled_forward(draft.step_model(), CompileSettings.for_draft_steps()), None


def _calibration(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The first row's real prompt tokens (its last `CALIBRATION_TOKENS`), or None where it has too few."""
    row = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
    return row[-CALIBRATION_TOKENS:] if row.numel() >= CALIBRATION_MIN_TOKENS else None


def _raise_if_nonfinite(num_accepted: list[int]) -> None:
    """Raise where plain sampling raises: a distribution sampled from holds NaN or inf (see `flag_nonfinite`)."""
    codes = {code for code in num_accepted if code < 0}
    if not codes:
        return
    if NonFinite.TARGET in codes:
        raise RuntimeError(
            "The target's processed next-token scores contain NaN or inf, so they are no distribution to sample "
            "from (plain generate() fails here too: 'probability tensor contains either inf, nan or element < 0'). "
            "Usual causes: float16 overflow (load the model in bfloat16 or float32), a broken checkpoint, or a logits "
            "processor that writes inf. `remove_invalid_values=True` replaces them, as in plain generate()."
        )
    raise RuntimeError(
        "The draft's processed next-token scores contain NaN or inf, so its proposals have no distribution to "
        "verify against. Usual causes: float16 overflow (load the draft in bfloat16 or float32) or a broken "
        "checkpoint; use another draft, or pass `remove_invalid_values=True`."
    )


def _same_objects(pair: tuple[Any, Any], other: tuple[Any, Any] | None) -> bool:
    """Whether two (target tokenizer, draft tokenizer) pairs are the very same objects."""
    return other is not None and pair[0] is other[0] and pair[1] is other[1]


def _as_int(value: torch.Tensor | int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0])
    return int(value)
