"""A round's verification, from the target's logits to the verdict, row chunk by row chunk, for any draft shape.

The target scored the root and the N nodes of each row's draft, `(batch, N + 1, vocab)` logits; a chain of K tokens
is the tree whose node k's parent is node k - 1 (`DraftTree.chain`). Every logits processor is applied at every
position with that position's own prefix, what plain `generate()` would pass there: the committed tokens, then the
path to the node (repetition penalty, n-gram bans, bad words and min length all read it). A chain's prefixes are the
buffer's own (its drafts are written after each row's committed tokens); a tree's positions are flattened into rows
of one position each, whose prefixes are written into a buffer of their own (only where a processor reads them).
Both go through the one implementation of processors per prefix, `PositionwiseProcessor`.

The rule is plugged in:
- greedy: `rules.greedy_accept` on the target's argmax (a chain's leading run of matches, a tree's walk);
- a sampled chain: the configured rule on the draft's distributions (`rules.speculative_accept` or
  `block_accept`; point masses as token ids), with the call's generator;
- a sampled tree: `rules.tree_accept`, with keyed draws (`sampling.draws`): the uniform of depth level d
  of a row is the one of (the call's key, the row's caller index, its committed length + d), the buffer position
  the token drawn there is written to. A round of a tree call that drafts nothing (K = 0) draws its one token
  with its keyed uniform too, and so is a chain whose every token is a point mass (a suffix drafter's path: walked
  as a tree of width one), so a seeded tree call's text depends on the key and the target alone. (A model's sampled
  chain beside a suffix drafter's trees is judged by its rule with the call's generator.)
Sampling meets NaN/inf as plain sampling does: `rules.flag_nonfinite` marks the rows, raised at the round's read.

The round's wide tensors (processed scores, a warper's temporaries, probabilities, residuals, float64 running sums)
are made for at most `draws.ROW_CHUNK_ELEMENTS` logits at a time: the round's draws are made first, for all rows, in
the order the rule makes them unchunked (a chain's acceptance uniforms, then its next token's; a tree's one per depth
level), then each chunk is processed, turned into probabilities and judged with its own draws. Every step is
row-local, so the verdict is the one an unchunked call gives, draw for draw, and the generator ends where it would.
The logits may come unmade (`cache.output_head.HeadLogits`): each chunk's are then made from its rows' hidden states.

Processed scores are kept only where the caller records them (`output_scores=True`): a chain's at its K + 1
positions, a tree's at the root and along the accepted path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import LogitsProcessorList

from ..cache.output_head import HeadLogits
from ..core.draft_tree import DraftTree
from ..core.sequences import Sequences
from ..options import TreeShape, Verification
from ..sampling import draws
from ..sampling.draws import call_key, first_argmax, keyed_uniforms, positions_from, sample_uniform, uniform_like
from ..sampling.processing import PositionwiseProcessor, probabilities, processed_at_paths
from . import distributed
from .rules import Verdict, block_accept, flag_nonfinite, greedy_accept, speculative_accept, tree_accept

Rule = Callable[..., Verdict]  # `speculative_accept` or `block_accept`


class Verifier:
    """Turns a round's target logits and draft into its verdict (module docstring)."""

    def __init__(
        self,
        processor: PositionwiseProcessor,
        do_sample: bool,
        rule: Rule,
        generator: torch.Generator | None,
        key: int | None,
        keep_scores: bool,
        chunk_elements: int | None = None,
        tensor_parallel: bool = False,
    ):
        """
        Args:
            processor: the call's processors, per position.
            do_sample: judge by a rule (else greedy: by argmax).
            rule: a chain's acceptance rule (`verify.rules`), called as ``rule(tokens, draft_probs, target_probs,
                generator)``, with ``point_mass=`` where the draft has a mask, and the round's draws (``uniform=``,
                ``sample_draws=``) where its rows come in several chunks or its token is keyed.
            generator: the call's generator for a chain's draws.
            key: the call's key (`draws.call_key`) where it may draft trees and samples: trees, and its rounds
                that draft nothing, draw keyed uniforms; None: draws from `generator`.
            keep_scores: return the processed scores (the caller records them).
            chunk_elements: the most logits verified at a time (None: `draws.ROW_CHUNK_ELEMENTS`, read at each
                round, so that a test can force chunks).
            tensor_parallel: the target is split over ranks: every rank takes rank 0's verdict
                (`distributed.broadcast_verdict`).
        """
        self.processor, self.do_sample, self.rule, self.generator = processor, do_sample, rule, generator
        self.key, self.keep_scores = key, keep_scores
        self.chunk_elements, self.tensor_parallel = chunk_elements, tensor_parallel

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
        trees: bool = False,
        prompt_length: int | None = None,
        stateful: tuple[type, ...] = (),
        sequences: Sequences | None = None,
    ) -> Verifier:
        """A call's verifier: its processors per position (`PositionwiseProcessor`, built here once per call and
        shared with the draft model's proposer), judging chains by the configured rule (`Verification`:
        `block_accept` or `speculative_accept`); where the call may draft trees (`trees`) and samples, its key is
        drawn here from `generator` (else the global generator), once. `prompt_length`: the prompt's columns, where a
        grammar processor's state starts; `stateful`: the classes declared stateful; `sequences`: the call's rows
        (`PositionwiseProcessor`)."""
        processor = PositionwiseProcessor(processors, batch_size, fast_processors, prompt_length, stateful, sequences)
        rule = block_accept if verification is Verification.BLOCK else speculative_accept
        key = call_key(generator) if do_sample and trees else None
        return cls(processor, do_sample, rule, generator, key, keep_scores, tensor_parallel=tensor_parallel)

    def chunks(self, batch: int, positions: int, vocab: int) -> list[slice]:
        """The row chunks a round of `(batch, positions, vocab)` logits is verified in."""
        return draws.round_chunks(batch, positions, vocab, self.chunk_elements)

    def __call__(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        logits: torch.Tensor | HeadLogits,
        callers: Sequence[int],
        tree: DraftTree,
        draft_probs: torch.Tensor | None = None,
        point_mass: torch.Tensor | None = None,
        shape: TreeShape | None = None,
    ) -> tuple[Verdict, torch.Tensor | None]:
        """The round's verdict.

        Args:
            tokens: `(batch, capacity)` the buffer; row b's committed tokens are ``tokens[b, : lengths[b]]``, a chain's
                drafts follow them.
            lengths: per row, the committed length (the root's prefix length).
            logits: `(batch, N + 1, vocab)` the target's raw logits (index 0: the root, i + 1: node i; not modified),
                or `HeadLogits` that make them row chunk by row chunk.
            callers: per row, its caller row (`RowBook.active`).
            tree: the round's draft, `(batch, N)` (a chain: `DraftTree.chain`).
            draft_probs: a sampled chain's `(batch, N, vocab)` draft distributions, or None (every token a point mass,
                or a tree); point_mass: `(batch, N)` bool or None (see `verify.rules.speculative_accept`).
            shape: a tree's static shape where it has one (its depths known here); None: a tree's depths are read
                from `tree.depths` (one host read).

        Returns:
            The verdict (`num_accepted` carrying `NonFinite` codes where sampling met NaN/inf), and where kept the
            processed scores: a chain's `(batch, N + 1, vocab)`, a tree's `(batch, max_depth + 1, vocab)` at the root
            and at each accepted node (entries past `num_accepted` repeat the root's); else None.
        """
        batch, positions, vocab = logits.shape
        depths, max_depth = _host_depths(tree, shape, batch)
        chunks = self.chunks(batch, positions, vocab)
        drawn = self._draws(tree, lengths, callers, max_depth, len(chunks) > 1, logits.device, draft_probs is None)
        parts: list[Verdict] = []
        kept: list[torch.Tensor] = []
        for rows in chunks:  # a chunk's logits, where made here (`HeadLogits`), are freed with its scores
            part = tree.rows(rows)
            scores = self._processed(tokens[rows], lengths[rows], logits[rows], callers[rows], part, depths, rows)
            if not self.do_sample:
                verdict = greedy_accept(part, first_argmax(scores), max_depth)
            else:
                target_probs = probabilities(scores)  # (rows, N + 1, vocab)
                chunk_probs = None if draft_probs is None else draft_probs[rows]
                chunk_mass = None if point_mass is None else point_mass[rows]
                verdict = self._sampled(part, chunk_probs, chunk_mass, target_probs, drawn, rows)
                verdict = flag_nonfinite(verdict, chunk_probs, target_probs, chunk_mass)
                del target_probs
            parts.append(verdict)
            if self.keep_scores:
                kept.append(scores if verdict.path is None else along_path(scores, verdict.path))
            del scores  # the chunk's processed scores: kept above where recorded
        verdict = parts[0] if len(parts) == 1 else Verdict._make(_cat(field) for field in zip(*parts))
        if self.tensor_parallel:
            verdict = distributed.broadcast_verdict(verdict)
        if verdict.accepted_tokens is None:  # a chain's drafted path is its tokens (not broadcast: every rank's own)
            verdict = verdict._replace(accepted_tokens=tree.tokens)
        return verdict, (None if not kept else kept[0] if len(kept) == 1 else torch.cat(kept))

    def _draws(
        self,
        tree: DraftTree,
        lengths: Sequence[int],
        callers: Sequence[int],
        max_depth: int,
        chunked: bool,
        device: torch.device,
        point_masses: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The whole round's draws, for all rows, before any chunk is judged (empty: the rule draws them itself).

        Keyed (a tree round of a call that may draft trees, or a chain whose every token is a point mass,
        `point_masses`): ``levels``, `(batch, max_depth + 1, 1)` float64, one per depth level; a round of such a call
        that drafts nothing: its one token's. Else (a model's sampled chain beside a suffix drafter's trees, each
        round exact by its own rule), for a chain whose rows come in several chunks: ``uniform`` `(batch, K)` then
        ``sample_draws`` `(batch, 1)`, in the unchunked rule's order.
        """
        if not self.do_sample:
            return {}
        batch = tree.tokens.shape[0]
        if self.key is not None and (tree.parents is not None or tree.num_nodes == 0 or point_masses):
            caller_rows = torch.tensor(list(callers), dtype=torch.long, device=device)
            levels = keyed_uniforms(self.key, caller_rows, positions_from(list(lengths), max_depth + 1, device))
            if tree.num_nodes > 0:
                return {"levels": levels}
            # float32, as `uniform_like` draws
            return {"uniform": torch.zeros((batch, 0), device=device), "sample_draws": levels[:, 0]}
        if not chunked:
            return {}
        # the draws of the whole round first, in the unchunked rule's order (acceptance, then the next token)
        uniform = uniform_like(tuple(tree.tokens.shape), device, self.generator)  # (batch, K)
        return {"uniform": uniform, "sample_draws": sample_uniform((batch,), device, self.generator)}

    def _sampled(
        self,
        tree: DraftTree,
        draft_probs: torch.Tensor | None,
        point_mass: torch.Tensor | None,
        target_probs: torch.Tensor,
        drawn: dict[str, torch.Tensor],
        rows: slice,
    ) -> Verdict:
        """A chunk's sampled verdict: a tree's walk with its keyed draws (a chain of point masses in a keyed call:
        the walk down it, a tree of width one), or a chain's rule."""
        if tree.parents is not None:
            return tree_accept(tree, target_probs, drawn["levels"][rows])
        if "levels" in drawn:  # the same tokens as the point-mass rule's in distribution, drawn with the call's key
            verdict = tree_accept(tree.with_parents(), target_probs, drawn["levels"][rows])
            return verdict._replace(path=None, accepted_tokens=None)
        # A rule's four-argument call stays the contract (`Verification`): a mask only where a proposal mixes
        # point masses with distributions, the round's draws only where they were made for the whole round.
        keywords = {name: values[rows] for name, values in drawn.items()}
        if point_mass is not None:
            keywords["point_mass"] = point_mass
        return self.rule(tree.tokens, draft_probs, target_probs, self.generator, **keywords)

    def _processed(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        logits: torch.Tensor,
        callers: Sequence[int],
        tree: DraftTree,
        depths: list[list[int]] | None,
        rows: slice,
    ) -> torch.Tensor:
        """`(rows, N + 1, vocab)` the processed scores of a chunk's positions, each with its own prefix.

        Args:
            tokens: `(rows, capacity)`; lengths, callers: the chunk's; logits: `(rows, N + 1, vocab)`; tree: the
            chunk's; depths: per row of the round and node, a tree's depths (None: a chain); rows: the chunk.
        """
        if depths is None:  # a chain: its positions' prefixes are the buffer's
            return self.processor(tokens, lengths, logits, callers)
        positions = [[0, *row] for row in depths[rows]]  # the root, then the nodes
        deepest = max((max(row) for row in positions), default=0)

        def paths() -> torch.Tensor:  # (rows, N + 1, deepest): the root's is empty
            root = tree.tokens.new_zeros((tree.tokens.shape[0], 1, deepest))
            return torch.cat([root, tree.path_tokens(deepest)], dim=1)

        return processed_at_paths(self.processor, tokens, lengths, logits, callers, positions, paths)


def _cat(parts: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """One field of the chunks' verdicts, joined (None stays None: a chain has no path)."""
    return None if parts[0] is None else torch.cat(parts)  # type: ignore[arg-type]


def _host_depths(tree: DraftTree, shape: TreeShape | None, batch: int) -> tuple[list[list[int]] | None, int]:
    """A tree's depths per row and node, and the deepest: from `shape` where given, else read from `tree.depths`;
    a chain's: None, and its length."""
    if tree.depths is None:
        return None, tree.num_nodes
    if shape is not None:
        assert shape.num_nodes == tree.num_nodes, f"{shape.num_nodes} nodes in the shape, {tree.num_nodes} in the tree"
        return [list(shape.depths)] * batch, shape.max_depth
    depths = tree.depths.tolist()  # (batch, N) on the host
    return depths, max((max(row, default=0) for row in depths), default=0)


def along_path(scores: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """`(rows, max_depth + 1, vocab)` the scores at the root, then at each accepted node (the root's after the path).

    Args:
        scores: `(rows, N + 1, vocab)`; path: `(rows, max_depth)`, -1 after the accepted nodes.
    """
    at = torch.cat([torch.zeros_like(path[:, :1]), (path + 1).clamp(min=0)], dim=1)  # (rows, max_depth + 1)
    return scores.gather(1, at[..., None].expand(-1, -1, scores.shape[-1]))
