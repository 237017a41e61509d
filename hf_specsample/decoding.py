"""The decoding loop: draft -> verify -> accept -> commit, until every row stops; the loop builds what it runs (its
statistics, verifier and drafters: `new_stats`, `call_verifier`, `call_drafters`) from the plan's decisions.

`speculative_generate` is a transformers `custom_generate` callable: `generate()` prepares inputs, logits
processors and stopping criteria exactly as for plain decoding, then hands them to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .cache import row_ops, static_addresses, tree_forward
from .cache.cached_model import CachedModel
from .core import transformers_api
from .core.draft_tree import RankCounts, rank_observations
from .core.sequences import Sequences
from .options import NamedDraft, SpeculativeConfig, Verification
from .outputs import OutputRecorder, SpeculativeDecoderOnlyOutput
from .plan.call_plan import CallPlan, DraftPlan, plan_call, resolve_inputs
from .policy.round_timer import PhaseTimer
from .prepare.prepared_draft import PreparedDraft
from .proposers.base import DraftBudget, Proposal, Proposer
from .proposers.cross_tokenizer import DraftIdBuffer, TextBridge
from .proposers.draft_model import DraftModelProposer
from .proposers.suffix import CallText, SuffixProposer
from .proposers.suffix_store import SuffixDraft
from .proposers.suffix_then_model import SuffixThenModelProposer
from .sampling.processing import PositionwiseProcessor
from .stats import SpeculativeStats
from .stopping import RoundRead, StopCheck
from .verify.rules import Verdict
from .verify.verifier import Verifier, along_path


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
    speculative_routed: bool = False,
    suffix_draft: SuffixDraft | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
    """Speculative sampling with a draft model, as a `custom_generate` callable of `model.generate()`: resolve the
    call's inputs (`call_plan.resolve_inputs`), plan it (`call_plan.plan_call`: every refusal before any forward, every
    decision once), run its rounds (`SpeculativeDecoder`).

    Call it through `model.generate(..., draft_model=small)` once `hf_specsample` is imported, or, with
    transformers' own `generate()` put back (`hf_specsample.unregister()`), as `hf_specsample.generate(model, ...,
    draft_model=small)`. The registered wrapper routes the call here (`speculative_routed`); transformers' own
    `generate()` would hand a `custom_generate` callable neither `streamer=` nor `tokenizer=`, so such a call is
    refused before any work. `generate()` passes
    what it prepared (the `(batch, prompt_length)` prompt, its processors and stopping criteria, the resolved config,
    and in `model_kwargs` the attention mask, position ids and cache); the registered `generate()` adds the caller's
    streamer, tokenizers and prompt-lookup options, and whether the cache is the caller's. `call_inputs.CallInputs`
    describes each; README's "Arguments added to `generate()`" the user's (`draft_model`, `num_lookahead`, ...).

    Returns:
        `(batch, sequence_length)` long sequences, or a `SpeculativeDecoderOnlyOutput` (with `speculative_stats`)
        when `return_dict_in_generate=True`; its cache (`out.cache`, or `out.past_key_values` before transformers
        5.24) holds what plain `generate()`'s would hold.
    """
    if input_ids.shape[-1] == 0 and speculative_routed:  # nothing to draft from: plain's own loop, tokens or error
        return transformers_api.plain_decoding(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            speculative_streamer,
            model_kwargs,
        )
    inputs = resolve_inputs(
        model,
        input_ids,
        generation_config,
        speculative_config,
        num_lookahead,
        speculative_prompt_lookup_num_tokens,
        speculative_max_matching_ngram_size,
        speculative_routed,
        draft_model=draft_model,
        model_kwargs=model_kwargs,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generator=generator,
        streamer=speculative_streamer,
        caller_cache=speculative_caller_cache,
        tokenizers=speculative_tokenizers,
        suffix_draft=suffix_draft,
    )
    return SpeculativeDecoder(plan_call(inputs)).run()


class SpeculativeDecoder:
    """State of one speculative `generate()` call; `run()` is the loop."""

    def __init__(self, plan: CallPlan):
        inputs, generation_config = plan.inputs, plan.inputs.generation_config
        input_ids, batch_size = inputs.input_ids, inputs.batch_size
        self.plan, self.max_length = plan, int(generation_config.max_length)
        self.pad_token_id = _as_int(transformers_api.pad_token_id(generation_config))
        self.stops, self.streamer = StopCheck(inputs.stopping_criteria, input_ids.device, batch_size), inputs.streamer
        # A row never holds more than max_length tokens: `RoundLookahead` caps K so that the drafts and the
        # recovered/bonus token fit (one spare column).
        position_ids = inputs.model_kwargs.get("position_ids")
        position_ids = position_ids if position_ids is not None and position_ids.dim() == 2 else None
        mask = inputs.model_kwargs.get("attention_mask")
        self.sequences = Sequences(input_ids, mask, self.max_length + 1, position_ids)
        real = self.sequences.is_real(plan.cached_slots)
        target_cache, draft_cache = static_caches(plan)
        self.target = CachedModel(plan.target, batch_size, target_cache, real, plan.forwards, self.sequences)
        self.lookahead, self.keep_cache = plan.lookahead, plan.keep_cache
        self.stats = new_stats(plan)
        self.recorder = OutputRecorder(generation_config, batch_size)
        self.verifier = call_verifier(plan, self.recorder.keep_scores, self.sequences)
        self.model_drafter, self.drafter = call_drafters(plan, self.sequences, self.verifier.processor, draft_cache)
        self.draft = self.model_drafter.model if self.model_drafter is not None else None  # its model and cache
        self.finished_caches: dict[int, CachedModel] = {}  # caller's row -> that row's target cache, once finished
        self.timer = PhaseTimer(self.lookahead.needs_timing, input_ids.device, self.verifier.processor)

    def run(self) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
        if self.streamer is not None:
            self.streamer.put(self.sequences.tokens[:, : self.sequences.prompt_length].cpu())
        draft = self.draft
        compile_before = self.target.compile_seconds or 0.0
        draft_compile_before = (draft.compile_seconds if draft is not None else None) or 0.0
        self.target.warm_up()  # compile now, outside every round (the prompt then runs compiled too)
        if self.model_drafter is not None:
            self.model_drafter.warm_up()  # the draft's compiled step too, where it has one
        while self.sequences.num_active > 0:
            draft_room = self.model_drafter.room(self.sequences) if self.model_drafter is not None else None
            self.round(self.lookahead.budget(self.sequences.lengths, draft_room))
        if self.streamer is not None:
            self.streamer.end()
        if self.plan.shape.ranks:  # draft_shape="auto" chose round by round: say what ran
            self.stats.shape = self.stats.describe_auto_shapes()
        self.stats.target_forward_passes = self.target.forward_passes
        self.stats.target_refeed_passes = self.target.refeed_passes
        self.stats.draft_forward_passes = self.drafter.forward_passes
        self.stats.draft_positions_ended = self.lookahead.draft_positions_ended
        processor = self.verifier.processor  # the drafter's and the trees' too
        self.stats.processing_seconds, self.stats.processed_positions = processor.seconds, processor.positions
        self.stats.grammar_seconds = sum(grammar.seconds for grammar in processor.grammars)
        if self.target.compile_seconds is not None:
            self.stats.compile_seconds = self.target.compile_seconds - compile_before
        if draft is not None and draft.compile_seconds is not None:
            self.stats.draft_compile_seconds = draft.compile_seconds - draft_compile_before
        sequences = self.sequences.output(self.pad_token_id)
        prompt_length = self.sequences.prompt_length
        self.drafter.finished(
            [sequences[row, prompt_length : prompt_length + new] for row, new in enumerate(self.stats.row_new_tokens)]
        )
        self.stats.suffix_accepted_tokens = self.drafter.accepted_by_source()
        cache = self.plain_cache(sequences) if self.keep_cache else None
        if self.plan.pooled:  # the call's own static caches, kept for the next call where the caller gets none
            for model, static_cache in self.own_static_caches(handed_out=cache):
                static_addresses.POOL.give_back(model, static_cache)
        return self.recorder.build(sequences, self.stats, cache if self.recorder.return_dict else None)

    def own_static_caches(self, handed_out: object) -> list[tuple[Any, Any]]:
        """This call's static caches as (model, cache), except one handed to the caller."""
        caches = [(self.target.model, self.target.cache)] if self.target.cache is not handed_out else []
        draft = self.draft
        if draft is not None and draft.capacity is not None:  # the draft's static cache, made for this call
            caches.append((draft.model, draft.cache))
        return caches

    def round(self, budget: DraftBudget) -> None:
        """One draft -> verify -> accept -> commit round over all active rows; the policy learns its costs."""
        compilations = self._compilations()
        refeeds = self.target.refeed_passes
        # a draft model's first forward feeds the prompt: its drafting then says nothing of a draft step
        draft_fed_prompt = self.model_drafter is not None and self.model_drafter.forward_passes == 0
        self.timer.start()
        proposal = self.drafter.get_candidates(self.sequences, budget)  # a chain, or a tree cut to the room
        self.timer.mark()
        verdict, scores, raw_logits, tested = self.verify(proposal)
        num_accepted = self.commit(proposal, verdict, scores, raw_logits)
        self.timer.mark()
        if self.stats.rounds == 1 and self.sequences.num_active:
            self.target.warm_up()  # a cache allocated by the first round, or weights changed since the first warm-up
        # The first round also encodes the prompt, and a round that compiled says nothing of later rounds' costs.
        prefill = self.stats.rounds == 1 or self._compilations() != compilations
        record = self.timer.record(proposal.lookahead, num_accepted, prefill, self.target.refeed_passes - refeeds)
        record = dataclasses.replace(record, **tested, draft_prefill=draft_fed_prompt and proposal.model_steps > 0)
        for timed, model_steps in self.timer.finish(record, proposal.model_steps):
            self.lookahead.observe(timed, model_steps)

    def _compilations(self) -> int:
        """Compilations so far by the target's compiled forward and the draft's compiled step."""
        return self.target.compilations + (self.draft.compilations if self.draft is not None else 0)

    def verify(self, proposal: Proposal) -> tuple[Verdict, torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """The target scores the root and every drafted node of each row in one forward pass (a chain's K + 1
        positions after its committed tokens); the round's verdict follows (`verify.verifier.Verifier`: greedy by
        argmax, else the rule on the proposal's distributions, its point masses as token ids, NaN/inf rows flagged;
        row chunk by row chunk); a tree's accepted path is then kept (`keep_path`).

        Returns:
            The verdict; the processed scores and raw logits where the recorder keeps them (else None: the logits
            are freed once verified), `(batch, K + 1, vocab)` at a chain's positions, at the root and along a tree's
            accepted path; and what a tree's walk tested of the draft's ranks, as `RoundRecord` fields.
        """
        tree, lengths = proposal.tree, self.sequences.lengths
        # Logits verified in several row chunks are made chunk by chunk (`cache.output_head`), unless recorded.
        chunks = self.verifier.chunks(len(lengths), tree.num_nodes + 1, self.plan.target.logit_width)
        with self.target.head.deferred(len(chunks) > 1 and not self.recorder.wants_raw_logits):
            if tree.parents is None:
                upto = [length + tree.num_nodes for length in lengths]
                raw_logits = self.target.feed_upto(self.sequences, upto, tree.num_nodes + 1)
            else:  # the root and the nodes with the tree's mask, held in the cache until `keep_path`
                raw_logits, _ = tree_forward.feed_tree(self.target, self.sequences, tree, proposal.shape)
        verdict, scores = self.verifier(
            self.sequences.tokens,
            lengths,
            self.target.head.take(raw_logits),
            self.sequences.rows.active,
            tree,
            proposal.probs,
            proposal.point_mass,
            proposal.shape,
        )
        raw = None
        if self.recorder.wants_raw_logits:
            raw = raw_logits if verdict.path is None else along_path(raw_logits, verdict.path)
        del raw_logits
        return verdict, scores, raw, self.keep_path(proposal, verdict)

    def keep_path(self, proposal: Proposal, verdict: Verdict) -> dict[str, Any]:
        """Write a tree's accepted path into the buffer after each row's committed tokens (where a chain's drafts
        already are) and compact both caches to it (a chain's accepted path is a prefix: the caches' rollback keeps
        it); the round's second host read, which raises a NaN/inf verdict.

        Returns:
            A tree round's `RoundRecord` fields: its nodes and what its walks tested of the draft's ranks
            (`draft_tree.rank_observations`; none for a dynamic tree, whose ranks are its own); a chain's: none.
        """
        if verdict.path is None:
            return {}
        assert verdict.accepted_tokens is not None
        for depth in range(verdict.accepted_tokens.shape[1]):
            self.sequences.write(depth, verdict.accepted_tokens[:, depth])
        path = verdict.path.cpu()  # the compactions need each row's path before rows stop and caches roll back
        counts = (path >= 0).sum(dim=1).tolist()
        for model in (self.target, self.draft):  # a suffix drafter's trees are in the target's cache alone
            if model is not None:
                model.keep_path(path, counts)
        shape = proposal.shape
        ranks = rank_observations(shape, path) if shape is not None else RankCounts((), ())
        return dict(nodes=proposal.tokens.shape[1], **ranks._asdict())

    def commit(
        self, proposal: Proposal, verdict: Verdict, scores: torch.Tensor | None, raw_logits: torch.Tensor | None
    ) -> list[int]:
        """Write the recovered/bonus token, then the round's four steps: read it (its one host sync), stop rows where
        `generate()` would, emit what they commit, shrink (roll caches back, drop finished rows).

        Returns:
            Per row active in this round, the number of draft tokens it accepted.
        """
        read = self.stops.read_round(verdict, stream=self.streamer is not None)
        self.sequences.write(verdict.num_accepted, verdict.next_tokens)
        callers = self.sequences.rows.callers()
        stops, counts = self.stop(read, callers, scores, raw_logits)
        self.emit(read, counts)
        nodes, tree = proposal.tokens.shape[1], proposal.parents is not None
        self.stats.record_round(
            callers, proposal.lookahead, read.num_accepted, counts, nodes, tree, proposal.forced_levels
        )
        self.drafter.observe(read.num_accepted)
        self.shrink(counts, [stop is not None for stop in stops])
        return read.num_accepted

    def stop(
        self, read: RoundRead, callers: list[int], scores: torch.Tensor | None, raw_logits: torch.Tensor | None
    ) -> tuple[list[int | None], list[int]]:
        """Where each row stops within the round (`StopCheck.first_stops`), and the new tokens each commits; the
        recorder keeps those rows' scores and logits.

        Returns:
            Per active row, the new token after which it stops (or None), and the number of new tokens it commits.
        """
        seqs, candidates = self.sequences, self.stops.candidates(read.num_accepted)
        # recorded before the criteria run, which read the scores so far as plain's do; `keep` drops those past a stop
        self.recorder.record(callers, candidates, scores, raw_logits)
        stops = self.stops.first_stops(
            seqs.tokens, seqs.lengths, read.num_accepted, candidates, read.eos_flags, callers, self.caller_view
        )
        counts = [stop if stop is not None else count for stop, count in zip(stops, candidates)]
        self.recorder.keep(callers, candidates, counts)
        return stops, counts

    def emit(self, read: RoundRead, counts: list[int]) -> None:
        """Stream row 0's committed tokens, token by token, `(1,)` each, as plain `generate()` streams them."""
        if self.streamer is None or read.streamed is None:
            return
        tokens = read.streamed  # row 0's drafts, then its next token
        for token in (tokens[: read.num_accepted[0]] + [tokens[-1]])[: counts[0]]:
            self.streamer.put(torch.tensor([token]))

    def shrink(self, counts: list[int], done: list[bool]) -> None:
        """Commit `counts` new tokens per row, roll the caches back to the committed tokens, and drop the `done`
        rows (their target caches set aside first where the call returns a cache)."""
        seqs = self.sequences
        seqs.advance(counts)
        self.target.rollback_to_committed(seqs.lengths)  # rejected drafts out; a stopped row keeps its length - 1
        if self.keep_cache:
            self.keep_finished_caches(done)
        kept = seqs.drop_finished(done)  # the token buffers (and the row book) keep the other rows
        if seqs.num_active and len(kept) < len(done):  # each cache told which rows stay
            self.target.select_rows(kept)
            self.drafter.select_rows(kept)
        if seqs.num_active:
            self.drafter.rollback_to_committed(seqs.lengths)

    def caller_view(self, length: int, ends: dict[int, int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """What plain `generate()` passes its stopping criteria once rows hold `length` columns: `(batch, length)`
        ids in the caller's row order (`Sequences.caller_prefixes`; `ends`: active rows stopped within the round,
        padded past their end, their scores shown blanked) and the scores so far (`stopping`). Reads only:
        the recorder drops the stopped rows' steps in `stop`, once the round's stops are known."""
        seqs = self.sequences
        ended = {seqs.rows.caller(row): end - seqs.prompt_length for row, end in ends.items()}
        scores = self.recorder.scores_so_far(length - seqs.prompt_length, ended)
        return seqs.caller_prefixes(length, self.pad_token_id, ends), scores

    def keep_finished_caches(self, done: list[bool]) -> None:
        """Set aside the target cache of each row that stops this round, for the cache `generate()` returns."""
        rows = [row for row, is_done in enumerate(done) if is_done]
        if rows == [0] and self.sequences.num_active == 1:  # the last row: its cache is the whole cache, no copy
            self.finished_caches[self.sequences.rows.caller(0)] = self.target
            return
        for row in rows:
            self.finished_caches[self.sequences.rows.caller(row)] = self.target.copy_rows([row])

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
            self.target.stack_rows(parts)
        self.target.stop_recording()
        return self.target.cache


def static_caches(plan: CallPlan) -> tuple[Any, Any]:
    """The target's cache and the draft's (None: a new `DynamicCache`): the one `generate()` handed over
    (`CallPlan.cache`), or under `compile=True` static caches of `CallPlan.static_slots` slots made for the call
    (`CallPlan.pooled`, `DraftPlan.static`). The draft's is taken first: where both are one model's, each gets back
    the cache it ran on in the last call (`POOL.take` hands out the last given back, and the draft's went back last),
    so that no CUDA graph re-records for a new address."""
    draft = plan.draft
    draft_cache = _static_cache(draft.facts.model, plan) if draft is not None and draft.static else None
    target_cache = _static_cache(plan.target.model, plan) if plan.pooled else plan.cache
    return target_cache, draft_cache


def _static_cache(model: Any, plan: CallPlan) -> Any:
    """A static cache of full layers for `model` at the call's final size: a kept one of the same shape
    (`cache.static_addresses.POOL`, reset in place), else a new one (allocated by its first forward)."""
    kept = static_addresses.POOL.take(model, plan.inputs.batch_size, plan.static_slots)
    return kept if kept is not None else row_ops.full_static_cache(None, model.config, plan.static_slots)


def new_stats(plan: CallPlan) -> SpeculativeStats:
    """The call's statistics, with what the plan decided already filled in."""
    stats = SpeculativeStats.for_batch(plan.inputs.batch_size)
    stats.linear_kernel, stats.graphs, stats.shape = plan.kernel_description, plan.graphs, plan.shape.reason
    stats.kernel_build_seconds = plan.kernel_build_seconds
    named = NamedDraft.SUFFIX if plan.suffix is not None else NamedDraft.PROMPT_LOOKUP  # without a draft model
    stats.draft_form = plan.draft.description if plan.draft is not None else str(named)
    if plan.draft is not None and plan.draft.shared is not None:
        stats.shared_vocabulary = plan.draft.shared.size
    return stats


def call_verifier(plan: CallPlan, keep_scores: bool, sequences: Sequences | None = None) -> Verifier:
    """The call's verifier: its processors per position, the configured rule, and where the call may draft trees
    and samples, its key (`Verifier.for_call`)."""
    inputs = plan.inputs
    return Verifier.for_call(
        inputs.logits_processor,
        inputs.batch_size,
        plan.config.fast_processors,
        bool(inputs.generation_config.do_sample),
        cast(Verification, plan.config.verification),  # a string given is parsed into the enum
        plan.generator,
        keep_scores,
        plan.target.tensor_parallel,
        trees=plan.shape.tree is not None or bool(plan.shape.ranks) or plan.shape.suffix_trees,
        prompt_length=inputs.input_ids.shape[1],
        stateful=plan.config.stateful_processors,
        sequences=sequences,
    )


def call_drafters(
    plan: CallPlan, sequences: Sequences, processor: PositionwiseProcessor, draft_cache: Any = None
) -> tuple[DraftModelProposer | None, Proposer]:
    """The call's draft-model proposer (None without a draft model), and the rounds' drafter: the draft model, the
    suffix drafter (over the call's rows and `CallPlan.suffix`; prompt lookup: over each row's own text, up to
    `CallPlan.max_ngram` tokens matched), or the suffix drafter beside the model."""
    suffix = None
    if plan.max_ngram is not None:
        call_text = CallText.ALL_ROWS if plan.suffix is not None else CallText.OWN_ROW
        suffix = SuffixProposer(sequences, plan.suffix, plan.shape.suffix_trees, call_text, plan.max_ngram)
    if plan.draft is None:
        assert suffix is not None  # a call without a draft model drafts by suffix or lookup (`plan_call`)
        return None, suffix
    model = draft_proposer(plan, plan.draft, sequences, processor, draft_cache)
    return model, (model if suffix is None else SuffixThenModelProposer(model, suffix))


def draft_proposer(
    plan: CallPlan, draft: DraftPlan, sequences: Sequences, processor: PositionwiseProcessor, cache: Any = None
) -> DraftModelProposer:
    """The draft-model proposer: over the target's ids, or with another tokenizer over the tokens both share."""
    inputs = None
    if draft.shared is not None:  # reads the rows' text in its own ids
        assert draft.tokenizers is not None  # the tokens both tokenizers share come with the tokenizers
        shared = draft.shared.to(sequences.tokens.device)
        inputs = DraftIdBuffer(sequences, shared, TextBridge(*draft.tokenizers))
    do_sample = bool(plan.inputs.generation_config.do_sample)
    return DraftModelProposer(
        draft.facts,
        draft.forwards,
        draft.vocabulary,
        sequences,
        processor,
        do_sample,
        plan.generator,
        inputs,
        cache,
    )


def _as_int(value: torch.Tensor | int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0])
    return int(value)
