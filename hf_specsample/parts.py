"""The loop's parts, built from a call's plan (`plan.call_plan.CallPlan`: decisions only): its statistics, its
verifier and its drafters. `decoding.SpeculativeDecoder` builds them once, before the first round."""

from __future__ import annotations

from typing import cast

from .core.sequences import Sequences
from .options import NamedDraft, Verification
from .plan.call_plan import CallPlan, DraftPlan
from .proposers.base import Proposer
from .proposers.cross_tokenizer import DraftIdBuffer, TextBridge
from .proposers.draft_model import DraftModelProposer
from .proposers.prompt_lookup import LookupThenModelProposer, PromptLookupProposer
from .sampling.processing import PositionwiseProcessor
from .stats import SpeculativeStats
from .verify.verifier import Verifier


def new_stats(plan: CallPlan) -> SpeculativeStats:
    """The call's statistics, with what the plan decided already filled in."""
    stats = SpeculativeStats.for_batch(plan.inputs.batch_size)
    stats.linear_kernel, stats.graphs, stats.shape = plan.kernel_description, plan.graphs, plan.shape.reason
    stats.kernel_build_seconds = plan.kernel_build_seconds
    stats.draft_form = plan.draft.description if plan.draft is not None else str(NamedDraft.PROMPT_LOOKUP)
    if plan.draft is not None and plan.draft.shared is not None:
        stats.shared_vocabulary = plan.draft.shared.size
    return stats


def verifier(plan: CallPlan, keep_scores: bool) -> Verifier:
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
        trees=plan.shape.tree is not None or bool(plan.shape.ranks),
    )


def drafters(
    plan: CallPlan, sequences: Sequences, processor: PositionwiseProcessor
) -> tuple[DraftModelProposer | None, Proposer]:
    """The call's draft-model proposer (None without a draft model), and the rounds' drafter: the draft model,
    n-gram lookup of up to `max_ngram` tokens (without a draft model the plan always sets it), or both (n-gram
    continuations first, the model else)."""
    if plan.draft is None:
        return None, PromptLookupProposer(cast(int, plan.max_ngram))
    model = _draft_proposer(plan, plan.draft, sequences, processor)
    if plan.max_ngram is None:
        return model, model
    return model, LookupThenModelProposer(model, PromptLookupProposer(plan.max_ngram))


def _draft_proposer(
    plan: CallPlan, draft: DraftPlan, sequences: Sequences, processor: PositionwiseProcessor
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
        draft.cache,
    )
