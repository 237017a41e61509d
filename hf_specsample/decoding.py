"""The decoding loop: draft -> verify -> accept -> commit, until every row stops.

`speculative_generate` is a transformers `custom_generate` callable: `generate()` prepares inputs, logits
processors and stopping criteria exactly as for plain decoding, then hands them to it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from . import distributed, validation
from .config import SpeculativeConfig
from .draft_prep import prepare_draft, weight_bytes_ratio
from .drafting import DraftModelProposer, Proposal
from .kv import CachedModel, input_device
from .lookahead import RoundRecord
from .outputs import OutputRecorder, SpeculativeDecoderOnlyOutput
from .processing import PositionwiseProcessor, probabilities
from .rejection import Verdict, greedy_accept, speculative_accept
from .sequences import Sequences
from .stats import SpeculativeStats
from .stopping import first_stops
from .timing import PhaseTimer


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft_model: PreTrainedModel | str | None = None,
    num_lookahead: int | None = None,
    generator: torch.Generator | None = None,
    speculative_config: SpeculativeConfig | None = None,
    speculative_streamer: BaseStreamer | None = None,
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
        draft_model: the draft causal LM; must share the target's vocabulary. "auto": a draft made from the target
            (an int8 copy on the CPU, a layer-skipping view elsewhere), for targets with no small sibling.
        num_lookahead: draft tokens per round (K >= 1); overrides `speculative_config.num_lookahead`. Default:
            chosen before every round from measured acceptance and costs (see `AdaptiveLookahead`).
        generator: optional `torch.Generator` for all random draws (reproducible sampling).
        speculative_config: further options, see `SpeculativeConfig`.
        speculative_streamer: where committed tokens are streamed (the registered `generate()` passes the caller's
            `streamer=` here, because transformers does not forward `streamer` to custom decoding callables).
        **model_kwargs: `attention_mask` `(batch, prompt_length)`, the prepared `past_key_values`, and the flags
            `generate()` sets (`use_cache`, `logits_to_keep`, `position_ids`).

    Returns:
        `(batch, sequence_length)` long sequences, or a `SpeculativeDecoderOnlyOutput` (with `speculative_stats`)
        when `return_dict_in_generate=True`.
    """
    if draft_model is None:
        raise ValueError(
            "speculative_generate needs `draft_model=` (a small causal LM sharing the target's tokenizer)."
        )
    config = SpeculativeConfig.resolve(speculative_config, num_lookahead)
    validation.check_models(model, draft_model)
    validation.check_generation_config(generation_config)
    validation.check_inputs(input_ids, model_kwargs, speculative_streamer)
    decoder = SpeculativeDecoder(
        model, draft_model, input_ids, model_kwargs, logits_processor, stopping_criteria, generation_config, config,
        generator, speculative_streamer,
    )  # fmt: skip
    return decoder.run()


class SpeculativeDecoder:
    """State of one speculative `generate()` call; `run()` is the loop."""

    def __init__(
        self,
        model: PreTrainedModel,
        draft_model: PreTrainedModel,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        config: SpeculativeConfig,
        generator: torch.Generator | None,
        streamer: BaseStreamer | None,
    ):
        self.max_length = int(generation_config.max_length)
        self.do_sample = bool(generation_config.do_sample)
        self.pad_token_id = _as_int(generation_config._pad_token_tensor)
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.processor = PositionwiseProcessor(logits_processor)
        self.tensor_parallel = distributed.is_tensor_parallel(model)
        if self.tensor_parallel:  # every rank must draw the same randomness (see distributed.py)
            generator = distributed.shared_generator(generator, input_ids.device)
        self.generator = generator

        vocab_size = validation.vocab_size(model)
        vocabulary = config.vocabulary_ids(vocab_size, _token_ids(generation_config))
        draft = prepare_draft(draft_model, model, config.draft_quantization, vocabulary)
        cost_ratio = weight_bytes_ratio(draft.model, model)
        self.policy = config.make_policy(generator is not None, cost_ratio, batch_size=input_ids.shape[0])

        capacity = self.max_length + self.policy.capacity + 1
        self.sequences = Sequences(input_ids, model_kwargs.get("attention_mask"), capacity)
        self.target = CachedModel(model, self.sequences.token_is_real, cache=model_kwargs.get("past_key_values"))
        self.drafter = DraftModelProposer(
            draft.model, self.sequences, self.processor, self.do_sample, generator, draft.vocabulary, vocab_size
        )
        self.recorder = OutputRecorder(generation_config, input_ids.shape[0])
        self.stats = SpeculativeStats.for_batch(input_ids.shape[0])
        devices = [input_ids.device, input_device(model), input_device(draft.model)]
        self.timer = PhaseTimer(self.policy.needs_timing, devices)

    def run(self) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
        if self.streamer is not None:
            self.streamer.put(self.sequences.tokens[:, : self.sequences.prompt_length].cpu())
        while self.sequences.num_active > 0:
            self.round(self.next_lookahead())
        if self.streamer is not None:
            self.streamer.end()
        self.stats.target_forward_passes = self.target.forward_passes
        self.stats.draft_forward_passes = self.drafter.forward_passes
        cache = self.target.cache if self.sequences.batch_size == 1 else None
        return self.recorder.build(self.sequences.output(self.pad_token_id), self.stats, cache)

    def next_lookahead(self) -> int:
        """Draft tokens for this round: the policy's K, never drafting past `max_length`."""
        room = self.max_length - max(self.sequences.lengths) - 1
        return max(0, min(self.policy.choose(), room))

    def round(self, lookahead: int) -> None:
        """One draft -> verify -> accept -> commit round over all active rows; the policy learns its costs."""
        prefill = self.stats.rounds == 0
        self.timer.start()
        proposal = self.drafter.get_candidates(self.sequences, lookahead)
        self.timer.mark()
        scores, raw_logits = self.verify(proposal)
        verdict = self.accept(proposal, scores)
        num_accepted = self.commit(proposal, verdict, scores, raw_logits)
        self.timer.mark()
        durations = self.timer.durations() or [0.0, 0.0]
        tested = sum(accepted + int(accepted < lookahead) for accepted in num_accepted)
        self.policy.observe(RoundRecord(lookahead, sum(num_accepted), tested, *durations, prefill=prefill))

    def verify(self, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """Target scores at the K+1 positions after each row's committed tokens, in one forward pass.

        Returns:
            `(batch, K + 1, vocab)` processed scores and the raw logits they came from.
        """
        lookahead = proposal.tokens.shape[1]
        lengths = self.sequences.lengths
        raw_logits = self.target.feed(
            self.sequences.tokens, upto=[length + lookahead for length in lengths], num_logits=lookahead + 1
        )
        scores = self.processor(self.sequences.tokens, lengths, raw_logits, self.sequences.row_ids)
        return scores, raw_logits

    def accept(self, proposal: Proposal, scores: torch.Tensor) -> Verdict:
        if not self.do_sample:
            verdict = greedy_accept(proposal.tokens, scores.argmax(dim=-1))
        else:
            target_probs = probabilities(scores)
            draft_probs = proposal.probs
            if draft_probs is None:  # no draft tokens this round
                draft_probs = target_probs[:, :0]
            verdict = speculative_accept(proposal.tokens, draft_probs, target_probs, self.generator)
        return distributed.broadcast_verdict(verdict) if self.tensor_parallel else verdict

    def commit(self, proposal: Proposal, verdict: Verdict, scores: torch.Tensor, raw_logits: torch.Tensor) -> list[int]:
        """Write the recovered/bonus token, stop rows where `generate()` would, roll caches back, drop done rows.

        Returns:
            Per row active in this round, the number of draft tokens it accepted.
        """
        seqs = self.sequences
        num_accepted = verdict.num_accepted.tolist()  # the round's one host sync
        seqs.write(verdict.num_accepted, verdict.next_tokens)
        proposed = [count + 1 for count in num_accepted]
        stops = first_stops(self.stopping_criteria, seqs.tokens, seqs.lengths, proposed)
        counts = [stop if stop is not None else count for stop, count in zip(stops, proposed)]

        if self.streamer is not None:
            self.streamer.put(seqs.new_tokens(0, counts[0]).unsqueeze(0).cpu())
        self.recorder.record(seqs.row_ids, counts, scores, raw_logits if self.recorder.wants_raw_logits else None)
        self.update_stats(proposal.tokens.shape[1], num_accepted, counts)

        keep = [length + accepted for length, accepted in zip(seqs.lengths, num_accepted)]
        self.target.rollback(keep)
        self.drafter.update_candidate_strategy(keep)
        seqs.advance(counts)
        remaining = seqs.retire([stop is not None for stop in stops])
        if len(remaining) < len(stops) and remaining:
            self.target.select_rows(remaining)
            self.drafter.select_rows(remaining)
        return num_accepted

    def update_stats(self, lookahead: int, num_accepted: list[int], counts: list[int]) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.lookahead_per_round.append(lookahead)
        for row_id, accepted, count in zip(self.sequences.row_ids, num_accepted, counts):
            stats.row_draft_tokens[row_id] += lookahead
            stats.row_accepted_tokens[row_id] += accepted
            stats.row_rejections[row_id] += int(accepted < lookahead)
            stats.row_new_tokens[row_id] += count
            stats.row_target_passes[row_id] += 1


def _token_ids(generation_config: GenerationConfig) -> list[int]:
    """EOS, padding and BOS ids of the generation config (the draft's vocabulary must keep them)."""
    ids = []
    for value in (generation_config.eos_token_id, generation_config.pad_token_id, generation_config.bos_token_id):
        if value is not None:
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return [int(token) for token in ids]


def _as_int(value: torch.Tensor | int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0])
    return int(value)
