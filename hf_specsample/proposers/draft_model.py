"""The draft-model proposer: K draft tokens per row from a small causal LM, with the distributions they were drawn from.

It implements `proposers.base.Proposer`: `get_candidates` mirrors transformers' `CandidateGenerator.get_candidates`,
batched over rows of different lengths and returning the draft's *processed* probabilities, which exactness needs.
`rollback_to_committed` only rolls the draft's cache back to the committed tokens (transformers'
`update_candidate_strategy` also adapts K; here `policy/lookahead.py` does that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from transformers import Cache, DynamicCache

from ..cache import row_ops
from ..cache.cached_model import CachedModel
from ..cache.forwards import Forwards
from ..core.model_facts import ModelFacts
from ..core.sequences import Sequences
from ..options import DynamicTree
from ..sampling.draws import first_argmax, sample_from_weights
from ..sampling.processing import PositionwiseProcessor, probabilities
from .base import DraftBudget, Growth, Proposal, Proposer
from .cross_tokenizer import DraftIdBuffer
from .tree_growth import DynamicGrowth, ShapeGrowth


class DraftVocabulary(NamedTuple):
    """Which target ids a draft's logits stand for (decided by the call's plan).

    Attributes:
        ids: `(n,)` the target ids the draft's logits stand for (an FR-Spec subset, see
            `prepare.surgery.restrict_vocabulary`; the ids both models have when their logit widths differ; the
            tokens a draft with another tokenizer shares with the target), or None: logit column ``i`` is id ``i``.
        columns: `(n,)` the draft's logit columns standing for `ids`; None: the first n.
        target_width: the target's logit width.
    """

    ids: torch.Tensor | None
    columns: torch.Tensor | None
    target_width: int


class DraftModelProposer(Proposer):
    """Proposes tokens by running a small causal LM autoregressively on its own KV cache.

    With a vocabulary (`DraftVocabulary.ids`) the draft's logits stand for those ids only: the logit columns are
    gathered, a draft wider than the target never proposes an id the target lacks, and ids outside the vocabulary get
    draft probability 0. When every logits processor is vocabulary-free (temperature, top-k/p, min-p, ...) the
    draft's processing and sampling run on that compact vocabulary; otherwise its logits are spread over the full
    vocabulary first (-inf elsewhere) so that id-dependent processors see the true ids.

    What the draft reads: the target's own token buffer, or with another tokenizer (`inputs`, a
    `proposers.cross_tokenizer.DraftIdBuffer`) each row's text in the draft's ids. Either way, processors see the
    target-id prefix and every proposal is a target id drawn from the returned distribution over target ids.
    """

    def __init__(
        self,
        facts: ModelFacts,
        forwards: Forwards,
        vocabulary: DraftVocabulary,
        sequences: Sequences,
        processor: PositionwiseProcessor,
        do_sample: bool,
        generator: torch.Generator | None = None,
        inputs: DraftIdBuffer | None = None,
        cache: Cache | None = None,
    ):
        """
        Args:
            facts: the facts of the model that drafts (possibly a prepared copy).
            forwards: how its forwards run (the kernel routing, prompts on its float original, the compiled step).
            vocabulary: which target ids its logits stand for.
            sequences: the target's rows.
            processor: the call's processors (applied with the target-id prefix).
            do_sample: sample proposals (else argmax).
            generator: for the draft's samples.
            inputs: with another tokenizer, the rows' draft ids the draft reads; None: it reads `sequences`.
            cache: an empty cache to draft on (a static one, `decoding.static_caches`); None: a new dynamic one.
        """
        self.inputs = inputs
        reads = sequences if inputs is None else inputs.sequences
        # With another tokenizer the draft's rows may have to drop positions committed in earlier rounds to even up
        # (one row gains more draft ids than another), which a sliding-window layer no longer stores: its cache keeps
        # every slot instead (the attention mask still applies the window, so the draft computes the same).
        if inputs is not None:
            cache = DynamicCache()
        self.runner = CachedModel(facts, reads.num_active, cache=cache, forwards=forwards, source=reads)
        self.int8 = facts.dynamic_int8
        self.processor = processor
        self.do_sample = do_sample
        self.generator = generator
        device = sequences.tokens.device
        self.vocabulary = None if vocabulary.ids is None else vocabulary.ids.to(device)  # (subset,)
        self.columns = None if vocabulary.columns is None else vocabulary.columns.to(device)  # (subset,)
        self.vocab_size = vocabulary.target_width
        self.compact = vocabulary.ids is not None and processor.vocabulary_free
        self.position_limit = facts.position_limit

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    def can_skip(self, sequences: Sequences, advance: int) -> bool:
        """Whether the rows may commit up to `advance` tokens each in a round this draft does not run. One row:
        always (its cache only lags). In a batch its cache is then rolled back to one distance behind every row's
        length (`CachedModel.rollback_point`), dropping positions of the rows that ran ahead: only a cache that
        keeps every position (no sliding window, no recurrent state) can, and that distance must not exceed the
        shortest row's length."""
        reads = sequences if self.inputs is None else self.inputs.sequences
        if reads.num_active == 1:
            return True
        if self.runner.states is not None or row_ops.has_sliding_window(self.runner.cache):
            return False
        behind = max(length - fed for length, fed in zip(reads.lengths, self.runner.fed)) + advance
        return behind <= min(reads.lengths)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only the active `rows` of the draft's cache (`Proposer.select_rows`)."""
        self.runner.select_rows(rows)

    @property
    def model(self) -> CachedModel:
        """The draft model and its cache (their compilations, seconds, and a static cache to give back)."""
        return self.runner

    def warm_up(self) -> None:
        """Compile the draft's single-token step now, if it runs compiled, so that no round pays for it."""
        self.runner.warm_step()

    def room(self, sequences: Sequences) -> int | None:
        """The most tokens a round may draft before the draft's position table ends (`ModelFacts.position_limit`),
        0 once the longest row it reads fills the table; None: its positions have no end.

        Counted in buffer columns (a left-padded row's positions are fewer) and with one position to spare, so a
        round's forwards (the catch-up of committed tokens, then each draft token but the last) stay inside it.
        """
        if self.position_limit is None:
            return None
        reads = sequences if self.inputs is None else self.inputs.sequences
        return max(0, self.position_limit - max(reads.lengths))

    def get_candidates(
        self, sequences: Sequences, budget: DraftBudget, forced: Sequence[torch.Tensor] | None = None
    ) -> Proposal:
        """Draft the round's chain of `budget.lookahead` (K) tokens, or its tree (`budget.tree`), after every active
        row's committed tokens (`Proposer.get_candidates`): one loop for every shape, one draft forward per level.

        The first forward catches the draft's cache up with the committed tokens it has not seen (the prompt, or the
        last one or two committed tokens) and gives the first level; each later forward feeds the level's parents, a
        chain's with its causal mask (the previous draft token) and a tree's with the tree mask (`Growth.feed`).
        Leaves are not fed. What a level's logits become (a sampled or argmax token, a parent's top choices, the best
        of a dynamic pool) is the `Growth`'s: `ChainGrowth`, `tree_growth.ShapeGrowth`,
        `tree_growth.DynamicGrowth`. After a tree the draft's cache holds its fed nodes (`CachedModel.held_tree`) until
        `CachedModel.keep_path`.

        Args:
            forced: a chain's forced tokens per active row (`ChainGrowth`), e.g. an n-gram continuation.

        Returns:
            `Proposal` with a chain's `(batch, K)` tokens and, when sampling, their `(batch, K, vocab)` distributions
            (None for greedy drafts: argmax tokens are point masses); or a tree's `(batch, N)` nodes.
        """
        growth = self._growth(sequences, budget, forced)
        reads = sequences if self.inputs is None else self.inputs.sequences
        with self._broken_int8():
            for level in range(growth.depth):
                if growth.take_forced(level):  # no forward: a later one (or the next round's) feeds the token
                    continue
                logits = self.runner.feed_upto(reads, reads.lengths, num_logits=1) if level == 0 else growth.feed(level)
                growth.grow(level, self._spread(self._columns(logits)))
        proposal = growth.proposal()
        if growth.in_cache is not None:  # a tree's nodes, until the loop's `CachedModel.keep_path`
            self.runner.held_tree = growth.in_cache
        return proposal if proposal.probs is None else proposal._replace(probs=self._full(proposal.probs))

    def _growth(self, sequences: Sequences, budget: DraftBudget, forced: Sequence[torch.Tensor] | None) -> Growth:
        """How this round's draft grows: a chain of K, or the budget's tree (static or dynamic)."""
        tokens_of = self.vocabulary if self.compact else None
        if budget.tree is None:
            draws = Draws(self.do_sample, self.generator)
            return ChainGrowth(
                self.runner, self.processor, sequences, budget.lookahead, draws, tokens_of, forced, self.inputs
            )
        if self.inputs is not None:
            raise ValueError("A draft with another tokenizer drafts chains only (its ids do not map one to one).")
        assert forced is None, "forced tokens are a chain's"
        if isinstance(budget.tree, DynamicTree):
            return DynamicGrowth(self.runner, self.processor, sequences, budget.tree, tokens_of)
        return ShapeGrowth(self.runner, self.processor, sequences, budget.tree, tokens_of)

    @contextlib.contextmanager
    def _broken_int8(self) -> Iterator[None]:
        """Say what fbgemm's error means where the draft's dynamic-int8 copy cannot choose a scale for NaN/inf
        activations."""
        try:
            yield
        except RuntimeError as error:
            if self.int8 and "ChooseQuantizationParams" in str(error):
                raise RuntimeError(
                    "The draft's activations contain NaN or inf, which its dynamic-int8 copy (draft_form 'auto' on "
                    "the CPU) cannot quantize: the draft is broken (float16 overflow, a bad checkpoint). Use another "
                    "draft, load it in bfloat16 or float32, or run it as given with "
                    "speculative_config=SpeculativeConfig(draft_form='as_given')."
                ) from error
            raise

    def _columns(self, logits: torch.Tensor) -> torch.Tensor:
        """`(batch, 1, width)` draft logits -> `(batch, 1, subset)`: the columns standing for `vocabulary`."""
        if self.vocabulary is None:
            return logits
        if self.columns is None:
            return logits[..., : self.vocabulary.numel()]
        return logits.index_select(-1, self.columns)

    def _spread(self, logits: torch.Tensor) -> torch.Tensor:
        """`(batch, 1, subset)` logits -> `(batch, 1, vocab)` with -inf outside the subset, unless compact."""
        if self.vocabulary is None or self.compact:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.scatter_(-1, self.vocabulary.expand(*logits.shape[:-1], -1), logits)

    def _full(self, probs: torch.Tensor) -> torch.Tensor:
        """`(batch, K, subset)` compact probabilities -> `(batch, K, vocab)`, zero outside the subset."""
        if not self.compact:
            return probs
        assert self.vocabulary is not None  # compact: a subset
        full = probs.new_zeros((*probs.shape[:-1], self.vocab_size))
        return full.scatter_(-1, self.vocabulary.expand(*probs.shape[:-1], -1), probs)

    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        """Roll the draft's cache back to the committed tokens (`CachedModel.rollback_to_committed`).

        With another tokenizer, the committed tokens are first appended to the rows' draft ids, and the cache keeps
        only the positions whose draft ids did not change (`DraftIdBuffer.sync`). Where the rows cannot be evened up
        by rolling back, the draft's cache is emptied and its rows packed into one left-padded block again.
        """
        if self.inputs is None:
            self.runner.rollback_to_committed(lengths)
            return
        unchanged = self.inputs.sync()
        keep = self.runner.rollback_point(self.inputs.sequences.lengths, unchanged)
        if min(keep) >= 0:
            self.runner.rollback(keep)
            return
        # A row gained more draft ids than another row holds in all (e.g. a first round that drafted nothing, or a
        # one-token prompt): rolling back cannot even the rows up. Start the draft over from one left-padded block.
        self.runner.rollback([0] * len(keep))
        self.inputs.sequences.left_pack()


class Draws(NamedTuple):
    """How a chain's draft tokens are chosen: sampled from the draft's processed distribution (with `generator`),
    or its argmax."""

    do_sample: bool
    generator: torch.Generator | None


class ChainGrowth(Growth):
    """A chain of K draft tokens, grown one level (one token) per draft forward (`DraftModelProposer.get_candidates`).

    Each level's token is sampled from the draft's processed distribution there (kept for the verifier's rule) or is
    its argmax, and is written into the buffer after the committed tokens (the next level's forward and processors
    read it there), and with another tokenizer into the draft's own ids. Forced tokens (an n-gram continuation)
    replace the model's first proposals in their rows; each is a point mass, marked in the proposal's `point_mass`,
    and the model still runs for every row (its later proposals condition on them). A level a grammar forces in every
    row runs no forward at all (`take_forced`).
    """

    def __init__(
        self,
        runner: CachedModel,
        processor: PositionwiseProcessor,
        sequences: Sequences,
        lookahead: int,
        draws: Draws,
        tokens_of: torch.Tensor | None = None,
        forced: Sequence[torch.Tensor] | None = None,
        inputs: DraftIdBuffer | None = None,
    ):
        """
        Args:
            lookahead: K, the chain's tokens (its depth).
            draws: sampled or argmax.
            forced: per active row, `(m,)` tokens that replace the model's first ``m`` proposals.
            inputs: with another tokenizer, the rows' draft ids the draft reads; None: it reads `sequences`.
            runner, processor, sequences, tokens_of: as `Growth`'s.
        """
        super().__init__(runner, processor, sequences, tokens_of)
        self.depth, self.draws, self.forced, self.inputs = lookahead, draws, forced, inputs
        self.reads = sequences if inputs is None else inputs.sequences
        self.drafted: list[torch.Tensor] = []  # per level, (batch,)
        self.pinned: list[torch.Tensor | None] = []  # per level, (batch,) bool: a point mass (forced); None: none
        self.forced_levels: list[int] = []  # levels a grammar forced in every row (no forward)
        self.probs: torch.Tensor | None = None  # (batch, K, vocab or subset), filled level by level when sampling

    def feed(self, level: int) -> torch.Tensor:
        """`(batch, 1, width)` the draft's logits after the previous level's token (the causal mask)."""
        return self.runner.feed_upto(self.reads, [length + level for length in self.reads.lengths], num_logits=1)

    def take_forced(self, level: int) -> bool:
        """Where the processors allow one token only in every row (a grammar's forced run: `PositionwiseProcessor.
        forced_tokens`), propose it as a point mass without a forward: the draft's processed distribution there is
        that point mass. Not with forced n-gram tokens nor another tokenizer's ids (their forwards read each token)."""
        if not self.processor.grammars or self.forced is not None or self.inputs is not None:
            return False
        sequences = self.sequences
        prefix_lengths = [length + level for length in sequences.lengths]
        tokens = self.processor.forced_tokens(sequences.tokens, prefix_lengths, sequences.rows.active)
        if tokens is None:
            return False
        token = torch.tensor(tokens, dtype=torch.long, device=sequences.tokens.device)
        if self.probs is not None:
            self.probs[:, level].zero_()  # a point mass: its row is not read (`Proposal.point_mass`), but finite
        sequences.write(level, token)
        self.drafted.append(token)
        self.pinned.append(torch.ones_like(token, dtype=torch.bool))
        self.forced_levels.append(level)
        return True

    def grow(self, level: int, logits: torch.Tensor) -> None:
        """Choose the level's token from the draft's `(batch, 1, vocab or subset)` logits and write it."""
        sequences = self.sequences
        prefix_lengths = [length + level for length in sequences.lengths]
        scores = self.processor(sequences.tokens, prefix_lengths, logits, sequences.rows.active)[:, 0]
        if self.draws.do_sample:
            # one (batch, K, vocab) tensor per round, written in place: no list of levels stacked at the end
            if self.probs is None:
                self.probs = scores.new_empty((scores.shape[0], self.depth, scores.shape[-1]), dtype=torch.float32)
                for forced_level in self.forced_levels:  # levels forced before: point masses, rows not read but finite
                    self.probs[:, forced_level].zero_()
            probs = self.probs[:, level]  # (batch, vocab or subset)
            probs.copy_(probabilities(scores))
            del scores
            index = sample_from_weights(probs, self.draws.generator)  # (batch,)
        else:
            index = first_argmax(scores)
        token = index if self.tokens_of is None else self.tokens_of[index]
        forced_here = None  # no tensor made where nothing is forced (the usual round)
        if self.forced is not None:
            token, forced_here = _force(self.forced, level, token)
        self.pinned.append(forced_here)
        sequences.write(level, token)
        if self.inputs is not None:
            self.inputs.write(level, token)  # the draft's next input: the token's draft id
        self.drafted.append(token)

    def _point_mass(self) -> torch.Tensor:
        return _point_masses(self.pinned, self.sequences.num_active, self.sequences.tokens.device)

    def proposal(self) -> Proposal:
        """The chain: `(batch, K)` tokens, their distributions when sampled, the forced ones marked."""
        any_forced = bool(self.forced_levels) or (self.forced is not None and any(row.numel() for row in self.forced))
        sequences = self.sequences
        return Proposal(
            tokens=torch.stack(self.drafted, dim=1)
            if self.drafted
            else sequences.tokens.new_empty((sequences.num_active, 0)),
            probs=self.probs,
            point_mass=self._point_mass() if self.probs is not None and any_forced else None,
            model_steps=self.depth - len(self.forced_levels),
            forced_levels=tuple(self.forced_levels),
        )


def _point_masses(pinned: Sequence[torch.Tensor | None], rows: int, device: torch.device) -> torch.Tensor:
    """`(rows, K)` bool: per level, the rows whose token is a point mass (None: none)."""
    none = torch.zeros(rows, dtype=torch.bool, device=device)
    return torch.stack([level if level is not None else none for level in pinned], dim=1)


def _force(forced: Sequence[torch.Tensor], level: int, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the rows' proposals at `level` by their forced tokens.

    Args:
        token: `(batch,)` the model's proposals.

    Returns:
        The `(batch,)` tokens, and `(batch,)` bool: True in the rows whose token was forced (a point mass).
    """
    forced_here = [tokens.numel() > level for tokens in forced]
    rows = [row for row, is_forced in enumerate(forced_here) if is_forced]
    if rows:
        index = torch.tensor(rows, device=token.device)
        chosen = torch.stack([forced[row][level] for row in rows]).to(token.device)
        token = token.index_put((index,), chosen)
    return token, torch.tensor(forced_here, dtype=torch.bool, device=token.device)
