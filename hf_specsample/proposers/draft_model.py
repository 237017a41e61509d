"""The draft-model proposer: K draft tokens per row from a small causal LM, with the distributions they were drawn from.

It implements `proposers.base.Proposer`: `get_candidates` mirrors transformers' `CandidateGenerator.get_candidates`,
batched over rows of different lengths and returning the draft's *processed* probabilities, which exactness needs.
`rollback_to_committed` only rolls the draft's cache back to the committed tokens (transformers'
`update_candidate_strategy` also adapts K; here `policy/lookahead.py` does that).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import Cache, DynamicCache

from ..cache.cached_model import CachedModel
from ..cache.forwards import Forwards
from ..cache.tree_forward import CachedTree
from ..core.draft_tree import DraftTree
from ..core.model_facts import ModelFacts
from ..core.sequences import Sequences
from ..options import DynamicTree, TreeShape
from ..sampling.draws import first_argmax, sample_from_weights
from ..sampling.processing import PositionwiseProcessor, probabilities
from .base import DraftBudget, Proposal, Proposer
from .cross_tokenizer import DraftIdBuffer
from .dynamic_tree import DynamicPool, KeptNodes, processed_at_frontier
from .tree_drafting import children_by_parent, choices, parents_of_levels, processed_at_parents


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
            cache: an empty cache to draft on (the plan's static one, `DraftPlan.cache`); None: a new dynamic one.
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
        self.tree_in_cache: CachedTree | KeptNodes | None = None  # the last drafted tree, until `compact_tree`
        self.position_limit = facts.position_limit

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only the active `rows` of the draft's cache (`Proposer.select_rows`)."""
        self._no_tree_left()
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

    def get_candidates(self, sequences: Sequences, budget: DraftBudget) -> Proposal:
        """Draft `budget.lookahead` (K) tokens after every active row's committed tokens, or the round's tree
        (`budget.tree`: `draft_tree`) (`Proposer.get_candidates`).

        Returns:
            `Proposal` with `(batch, K)` tokens and, when sampling, their `(batch, K, vocab)` distributions (None
            for greedy drafts: argmax tokens are point masses); or a tree's `(batch, N)` nodes.
        """
        if budget.tree is not None:
            return self.draft_tree(sequences, budget.tree)
        return self.draft(sequences, budget.lookahead)

    def draft(self, sequences: Sequences, lookahead: int, forced: Sequence[torch.Tensor] | None = None) -> Proposal:
        """Draft `lookahead` (K) tokens after every active row's committed tokens, some of them possibly forced.

        The first forward catches the draft's cache up with the committed tokens it has not seen (the prompt, or
        the last one or two committed tokens); each later forward feeds the previous draft token.

        Args:
            forced: per active row, `(m,)` tokens that replace the model's first ``m`` proposals (an n-gram
                continuation); each is a point mass, so its distribution is known exactly and is marked in the
                proposal's `point_mass` mask. The model still runs for every row (its later proposals condition on
                the forced tokens).
        """
        self._no_tree_left()
        tokens, lengths = sequences.tokens, sequences.lengths
        reads = sequences if self.inputs is None else self.inputs.sequences
        read_lengths = reads.lengths
        drafted, pinned = [], []
        drafted_probs: torch.Tensor | None = None  # (batch, K, vocab or subset), filled step by step
        for step in range(lookahead):
            prefix_lengths = [length + step for length in lengths]
            logits = self._columns(self._forward(reads, [length + step for length in read_lengths]))
            scores = self.processor(tokens, prefix_lengths, self._spread(logits), sequences.rows.active)[:, 0]
            if self.do_sample:
                # one (batch, K, vocab) tensor per round, written in place: no list of steps stacked at the end
                if drafted_probs is None:
                    shape = (scores.shape[0], lookahead, scores.shape[-1])
                    drafted_probs = scores.new_empty(shape, dtype=torch.float32)
                probs = drafted_probs[:, step]  # (batch, vocab or subset)
                probs.copy_(probabilities(scores))
                del scores
                index = sample_from_weights(probs, self.generator)  # (batch,)
            else:
                index = first_argmax(scores)
            token = self.vocabulary[index] if self.compact and self.vocabulary is not None else index  # compact: set
            if forced is not None:
                token, forced_here = self._force(forced, step, token)
                pinned.append(forced_here)
            sequences.write(step, token)
            if self.inputs is not None:
                self.inputs.write(step, token)  # the draft's next input: the token's draft id
            drafted.append(token)
        any_forced = forced is not None and any(row.numel() for row in forced)
        return Proposal(
            tokens=torch.stack(drafted, dim=1) if drafted else tokens.new_empty((sequences.num_active, 0)),
            probs=self._full(drafted_probs) if drafted_probs is not None else None,  # (batch, K, vocab)
            point_mass=torch.stack(pinned, dim=1) if drafted_probs is not None and any_forced else None,  # (batch, K)
            model_steps=lookahead,
        )

    def draft_tree(self, sequences: Sequences, shape: TreeShape | DynamicTree) -> Proposal:
        """Draft a tree of `shape` (static, or each row's own: `draft_dynamic_tree`) after every active row's
        committed tokens, one draft forward per level.

        The first forward feeds the committed positions the draft has not fed (the root at least) and gives the
        root's children; each later one feeds the parents of the next level's nodes with the tree mask
        (`cache.tree_forward.CachedTree`). A parent's children are the top-(rank + 1) distinct tokens of the draft's
        processed scores there (processed with the parent's own prefix: `tree_drafting.processed_at_parents`), the
        scores a greedy chain draft takes its argmax of, also when sampling: the children are deterministic. Leaves
        are not fed. The buffer is not written to.

        After it the draft's cache holds each row's committed tokens, the root included, then every node that has
        children, in level order (`tree_in_cache`), until `compact_tree`.
        """
        if self.inputs is not None:
            raise ValueError("A draft with another tokenizer drafts chains only (its ids do not map one to one).")
        if isinstance(shape, DynamicTree):
            return self.draft_dynamic_tree(sequences, shape)
        self._no_tree_left()
        tokens, lengths, callers = sequences.tokens, sequences.lengths, sequences.rows.active
        tree = DraftTree.of_shape(shape, tokens.new_zeros((sequences.num_active, shape.num_nodes)))
        children = children_by_parent(shape)
        levels = parents_of_levels(shape)
        for level, parents in enumerate(levels):
            if level == 0:
                logits = self._forward(sequences, lengths)  # (rows, 1, width): the root's
                self.tree_in_cache = CachedTree.after_root(self.runner, sequences, tree, shape)
            else:
                assert isinstance(self.tree_in_cache, CachedTree)  # made by the first level
                logits = self.tree_in_cache.feed(parents)  # (rows, P, width)
            full = self._spread(self._columns(logits))
            scores = processed_at_parents(self.processor, tokens, lengths, shape, tree.tokens, parents, full, callers)
            for lane, parent in enumerate(parents):
                kids = children[parent]
                index = choices(scores[:, lane], max(rank for _, rank in kids) + 1)  # (rows, ranks)
                chosen = self.vocabulary[index] if self.compact and self.vocabulary is not None else index
                for node, rank in kids:
                    tree.tokens[:, node] = chosen[:, rank]
        return _tree_proposal(tree, len(levels), shape)

    def draft_dynamic_tree(self, sequences: Sequences, spec: DynamicTree) -> Proposal:
        """Draft each row's dynamic tree (`proposers.dynamic_tree`): `spec.depth` draft forwards, the first at the
        root, each later one over the frontier's `spec.expand` nodes with the tree mask; the best `spec.num_nodes`
        nodes are kept.

        After it the draft's cache holds each row's committed tokens, the root included, then every frontier node
        fed, in the order fed (`tree_in_cache`, over the pool's indices), until `compact_tree`. Each level after the
        first reads its frontier's parents on the host, for the tree mask: on an accelerator, one `(rows, expand)`
        device read (a sync) per level.
        """
        if self.inputs is not None:
            raise ValueError("A draft with another tokenizer drafts chains only (its ids do not map one to one).")
        self._no_tree_left()
        tokens, lengths, callers = sequences.tokens, sequences.lengths, sequences.rows.active
        pool = DynamicPool(spec, sequences.num_active, tokens.device)
        tokens_of = self.vocabulary if self.compact else None
        logits = self._forward(sequences, lengths)  # (rows, 1, width): the root's
        cached = CachedTree.after_root(self.runner, sequences, pool.tree, grows=True)
        pool.add_level(self.processor(tokens, lengths, self._spread(self._columns(logits)), callers), tokens_of)
        for _ in range(1, spec.depth):
            frontier = pool.frontier()
            cached.set_parents(frontier, pool.parents[:, frontier].cpu())  # the sync named above
            full = self._spread(self._columns(cached.feed(frontier)))  # (rows, expand, vocab)
            pool.add_level(processed_at_frontier(self.processor, tokens, lengths, pool, full, callers), tokens_of)
        tree, kept = pool.kept()
        self.tree_in_cache = KeptNodes(cached, kept)
        return _tree_proposal(tree, spec.depth, None)

    def compact_tree(self, path: torch.Tensor, counts: Sequence[int]) -> None:
        """Keep the accepted path of the last drafted tree in the draft's cache (`CachedTree.compact`): called after
        verification, before rows are dropped and before `rollback_to_committed`.

        Args:
            path: `(rows, D)` long, each row's accepted nodes, -1 after `counts[b]`.
            counts: per row, its accepted nodes.
        """
        assert self.tree_in_cache is not None, "no tree was drafted"
        self.tree_in_cache.compact(path, counts)
        self.tree_in_cache = None

    def _no_tree_left(self) -> None:
        if self.tree_in_cache is not None:
            raise RuntimeError(
                "hf_specsample internal error: the drafted tree must be compacted first (`compact_tree`)"
            )

    def _force(
        self, forced: Sequence[torch.Tensor], step: int, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the rows' proposals at `step` by their forced tokens.

        Args:
            token: `(batch,)` the model's proposals.

        Returns:
            The `(batch,)` tokens, and `(batch,)` bool: True in the rows whose token was forced (a point mass).
        """
        forced_here = [tokens.numel() > step for tokens in forced]
        rows = [row for row, is_forced in enumerate(forced_here) if is_forced]
        if rows:
            index = torch.tensor(rows, device=token.device)
            chosen = torch.stack([forced[row][step] for row in rows]).to(token.device)
            token = token.index_put((index,), chosen)
        return token, torch.tensor(forced_here, dtype=torch.bool, device=token.device)

    def _forward(self, sequences: Sequences, upto: list[int]) -> torch.Tensor:
        """`(batch, 1, width)` draft logits after ``upto[b]`` tokens of each row."""
        try:
            return self.runner.feed_upto(sequences, upto, num_logits=1)
        except RuntimeError as error:
            # fbgemm's dynamic quantization cannot choose a scale for NaN/inf activations; say what that means.
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
        self._no_tree_left()  # its node slots would pass for committed positions
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


def _tree_proposal(tree: DraftTree, depth: int, shape: TreeShape | None) -> Proposal:
    """A drafted tree as the round's proposal: one draft forward per level, no distributions (its children are the
    draft's top choices)."""
    return Proposal(
        tree.tokens, None, model_steps=depth, parents=tree.parents, depths=tree.depths, shape=shape, depth=depth
    )
