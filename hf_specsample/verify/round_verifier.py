"""A round's verification, from the target's logits to the verdict, row chunk by row chunk.

The target's logits of a round are `(batch, K + 1, vocab)`; the processors, the probabilities and the acceptance
rule each make tensors of that size (a warper's temporaries, processed scores, probabilities, residuals and float64
running sums). Made for all rows at once they multiply a round's peak memory. Here the rows are verified in chunks
of at most `draws.ROW_CHUNK_ELEMENTS` logits, and each chunk's wide tensors are gone before the next:

- greedy: processors, then `first_argmax`, per chunk;
- sampling: where the rows come in several chunks, the round's random draws are made first, for all rows, in the
  order the rule makes them unchunked (the acceptance uniforms, then the next token's), then each chunk's rows are
  processed, turned into probabilities and judged by the rule with their own draws. Every step is row-local (a
  processor is called with each row's own prefix and caller index, `PositionwiseProcessor`; the rules and
  `sample_from_weights` compute each row from its own distributions and draws), so the verdict is the one an
  unchunked call gives, draw for draw, and the generator ends where it would.

The logits may come unmade (`cache.output_head.HeadLogits`: the target's hidden states and its head), where the
rows come in several chunks: each chunk's logits are then made from its rows' hidden states when it is verified, and
the round never holds all its logits at once.

Processed scores are kept only where the caller records them (`output_scores=True`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import LogitsProcessorList

from ..cache.output_head import HeadLogits
from ..options import Verification
from ..sampling import draws
from ..sampling.draws import first_argmax, sample_uniform, uniform_like
from ..sampling.processing import PositionwiseProcessor, probabilities
from . import distributed
from .rejection import Verdict, block_accept, flag_nonfinite, greedy_accept, speculative_accept

Rule = Callable[..., Verdict]  # `speculative_accept` or `block_accept`


class RoundVerifier:
    """Turns a round's target logits and proposal into its verdict (module docstring)."""

    def __init__(
        self,
        processor: PositionwiseProcessor,
        do_sample: bool,
        rule: Rule,
        generator: torch.Generator | None,
        keep_scores: bool,
        chunk_elements: int | None = None,
        tensor_parallel: bool = False,
    ):
        """
        Args:
            processor: the call's processors, per position.
            do_sample: judge by the rule (else greedy: by argmax).
            rule: the acceptance rule (`verify.rejection`), called as ``rule(tokens, draft_probs, target_probs,
                generator)``, with ``point_mass=`` where the proposal has a mask, and the round's draws
                (``uniform=``, ``sample_draws=``) where its rows come in several chunks.
            generator: the call's generator for the round's draws.
            keep_scores: return the processed scores (the caller records them).
            chunk_elements: the most logits verified at a time (None: `draws.ROW_CHUNK_ELEMENTS`, read at each
                round, so that a test can force chunks).
            tensor_parallel: the target is split over ranks: every rank takes rank 0's verdict
                (`distributed.broadcast_verdict`).
        """
        self.processor, self.do_sample, self.rule, self.generator = processor, do_sample, rule, generator
        self.keep_scores, self.chunk_elements, self.tensor_parallel = keep_scores, chunk_elements, tensor_parallel

    @classmethod
    def for_call(
        cls,
        processors: LogitsProcessorList,
        batch_size: int,
        fast_processors: bool,
        do_sample: bool,
        verification: Verification,
        generator: torch.Generator | None,
        keep_scores: bool,
        tensor_parallel: bool,
    ) -> RoundVerifier:
        """A call's verifier: its processors per position (`PositionwiseProcessor`, built here once per call and
        shared with the draft model's proposer and the tree verifier, `TreeVerifier.for_call`), judging by the
        configured rule (`Verification`: `block_accept` or `speculative_accept`)."""
        processor = PositionwiseProcessor(processors, batch_size, fast_processors)
        rule = block_accept if verification is Verification.BLOCK else speculative_accept
        return cls(processor, do_sample, rule, generator, keep_scores, tensor_parallel=tensor_parallel)

    def chunks(self, batch: int, positions: int, vocab: int) -> list[slice]:
        """The row chunks a round of `(batch, positions, vocab)` logits is verified in."""
        return draws.round_chunks(batch, positions, vocab, self.chunk_elements)

    def __call__(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        logits: torch.Tensor | HeadLogits,
        callers: Sequence[int],
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        point_mass: torch.Tensor | None,
        next_draws: torch.Tensor | None = None,
    ) -> tuple[Verdict, torch.Tensor | None]:
        """The round's verdict.

        Args:
            tokens: `(batch, capacity)` the buffer (prefixes, drafts written after them).
            lengths: per row, the prefix length of position 0.
            logits: `(batch, K + 1, vocab)` the target's raw logits (not modified), or `HeadLogits` that make them
                row chunk by row chunk.
            callers: per row, its caller row (`RowBook.active`).
            draft_tokens: `(batch, K)` long; draft_probs: `(batch, K, vocab)` or None (every token a point mass);
                point_mass: `(batch, K)` bool or None (see `verify.rejection.speculative_accept`).
            next_draws: a round of K = 0 only: `(batch, 1)` float64 uniforms its one token is drawn with, instead of
                the generator's (a tree call's keyed draws, `TreeRound.root_draws`); None: the generator's.

        Returns:
            The verdict (`num_accepted` carrying `NonFinite` codes where sampling met NaN/inf), and the
            `(batch, K + 1, vocab)` processed scores where kept, else None.
        """
        batch, positions, vocab = logits.shape
        chunks = self.chunks(batch, positions, vocab)
        draws: dict[str, torch.Tensor] = {}
        if self.do_sample and next_draws is not None:  # the round's one draw is given
            assert draft_tokens.shape[1] == 0, "given next-token draws serve rounds that drafted nothing"
            draws["uniform"] = torch.zeros((batch, 0), device=logits.device)  # float32, as `uniform_like` draws
            draws["sample_draws"] = next_draws.to(logits.device)
        elif self.do_sample and len(chunks) > 1:
            # the draws of the whole round first, in the unchunked rule's order (acceptance, then the next token)
            draws["uniform"] = uniform_like(tuple(draft_tokens.shape), logits.device, self.generator)  # (batch, K)
            draws["sample_draws"] = sample_uniform((batch,), logits.device, self.generator)  # (batch, 1)
        parts: list[Verdict] = []
        kept: list[torch.Tensor] = []
        for rows in chunks:  # a chunk's logits, where made here (`HeadLogits`), are freed with its scores
            scores = self.processor(tokens[rows], lengths[rows], logits[rows], callers[rows])
            if self.keep_scores:
                kept.append(scores)
            if not self.do_sample:
                parts.append(greedy_accept(draft_tokens[rows], first_argmax(scores)))
                continue
            target_probs = probabilities(scores)  # (rows, K + 1, vocab)
            del scores  # the chunk's processed scores: kept above where recorded
            chunk_probs = None if draft_probs is None else draft_probs[rows]
            chunk_mass = None if point_mass is None else point_mass[rows]
            # A rule's four-argument call stays the contract (`Verification`): a mask only where a proposal mixes
            # point masses with distributions, the round's draws only where its rows come in several chunks.
            keywords = {name: drawn[rows] for name, drawn in draws.items()}
            if chunk_mass is not None:
                keywords["point_mass"] = chunk_mass
            verdict = self.rule(draft_tokens[rows], chunk_probs, target_probs, self.generator, **keywords)
            parts.append(flag_nonfinite(verdict, chunk_probs, target_probs, chunk_mass))
        verdict = parts[0] if len(parts) == 1 else Verdict(*(torch.cat(field) for field in zip(*parts)))
        if self.tensor_parallel:
            verdict = distributed.broadcast_verdict(verdict)
        return verdict, (None if not kept else kept[0] if len(kept) == 1 else torch.cat(kept))
