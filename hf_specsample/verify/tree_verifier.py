"""A round's tree verification, from the target's logits at the tree's positions to the `TreeVerdict`.

The tree's counterpart of `verify.round_verifier`: the target scored the root and the N nodes of each row's tree,
`(batch, N + 1, vocab)` logits. Every logits processor is applied at every position with that position's own
prefix, what plain `generate()` would pass there: the committed tokens, then the path to the node (repetition
penalty, n-gram bans, bad words and min length all read it). The tree's positions are flattened into rows of one
position each, whose prefixes are written into a buffer of their own, and handed to the one implementation of
processors per prefix, `PositionwiseProcessor` (a caller row's siblings share a prefix length: it calls a processor
that reads the caller's whole batch once per sibling). Then the rule of `verify.tree_rule`.

The draws are keyed (`sampling.keyed_draws`): the uniform of depth level d of a row is the one of (the call's key, the
row's caller index, its committed length + d), the buffer position the token drawn there is written to. Every
token a tree commits is the target's draw at its position, so a seeded call's text depends on the key and the
target alone, not on the draft, the tree's shape or its truncation. Greedy draws nothing, not even the key.

Rows come in chunks of at most `draws.ROW_CHUNK_ELEMENTS` logits, as in `RoundVerifier`: the round's draws are
made first, for all rows (one uniform per depth level per row), then each chunk is processed, turned into
probabilities and walked with its own draws; every step is row-local, so the verdict is the one an unchunked call
gives, draw for draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.output_head import HeadLogits
from ..core.draft_tree import DraftTree
from ..options import TreeShape
from ..sampling import draws
from ..sampling.draws import first_argmax
from ..sampling.keyed_draws import call_key, keyed_uniforms, positions_from
from ..sampling.processing import PositionwiseProcessor, RunKind, probabilities
from . import distributed
from .tree_rule import TreeVerdict, flag_tree_nonfinite, path_tokens, tree_accept, tree_greedy_accept


class TreeVerifier:
    """Turns a round's target logits at a tree's positions into its verdict (module docstring)."""

    def __init__(
        self,
        processor: PositionwiseProcessor,
        key: int | None,
        keep_scores: bool,
        chunk_elements: int | None = None,
        tensor_parallel: bool = False,
    ):
        """
        Args:
            processor: the call's processors, per position.
            key: the call's key (`keyed_draws.call_key`): judge by the tree rule's keyed draws; None: greedy, by
                argmax.
            keep_scores: return the processed scores at the root and along the accepted path (the caller records
                them).
            chunk_elements: the most logits verified at a time (None: `draws.ROW_CHUNK_ELEMENTS`, read at each
                round, so that a test can force chunks).
            tensor_parallel: the target is split over ranks: every rank takes rank 0's verdict
                (`distributed.broadcast_tree_verdict`).
        """
        self.processor, self.key = processor, key
        self.keep_scores, self.chunk_elements, self.tensor_parallel = keep_scores, chunk_elements, tensor_parallel
        # whether any processor reads a prefix or its length (else the positions' prefixes are never built)
        self.reads_prefixes = any(kind is not RunKind.PREFIX_FREE for kind, _ in processor.runs)

    @classmethod
    def for_call(
        cls,
        processor: PositionwiseProcessor,
        do_sample: bool,
        generator: torch.Generator | None,
        keep_scores: bool,
        tensor_parallel: bool = False,
    ) -> TreeVerifier:
        """A call's tree verifier over the call's processors per position (`processor`: the chain's, built once by
        `RoundVerifier.for_call`), sampling with the key drawn here from `generator` (else the global generator),
        once; greedy draws nothing."""
        key = call_key(generator) if do_sample else None
        return cls(processor, key, keep_scores, tensor_parallel=tensor_parallel)

    def chunks(self, batch: int, positions: int, vocab: int) -> list[slice]:
        """The row chunks a round of `(batch, N + 1, vocab)` logits is verified in."""
        return draws.round_chunks(batch, positions, vocab, self.chunk_elements)

    def __call__(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        logits: torch.Tensor | HeadLogits,
        callers: Sequence[int],
        tree: DraftTree,
        shape: TreeShape | None = None,
    ) -> tuple[TreeVerdict, torch.Tensor | None]:
        """The round's verdict.

        Args:
            tokens: `(batch, capacity)` the buffer; row b's committed tokens are ``tokens[b, : lengths[b]]`` (what
                follows is not read).
            lengths: per row, the committed length (the root's prefix length).
            logits: `(batch, N + 1, vocab)` the target's raw logits (index 0: the root, i + 1: node i; not modified).
            callers: per row, its caller row (`RowBook.active`).
            tree: the round's tree, `(batch, N)`.
            shape: the tree's static shape where it has one (its depths known here); None: the depths are read from
                `tree.depths` (one host read).

        Returns:
            The `TreeVerdict` (`num_accepted` carrying `NonFinite` codes where sampling met NaN/inf) and, where kept,
            the `(batch, max_depth + 1, vocab)` processed scores at the root and at each accepted node (a chain's
            scores: index d after d accepted tokens; entries past `num_accepted` repeat the root's), else None.
        """
        batch, positions, vocab = logits.shape
        depths, max_depth = _host_depths(tree, shape, batch)
        chunks = self.chunks(batch, positions, vocab)
        draws = None  # the whole round's draws first: one per depth level per row, (batch, max_depth + 1, 1)
        if self.key is not None:
            caller_rows = torch.tensor(list(callers), dtype=torch.long, device=logits.device)
            draws = keyed_uniforms(self.key, caller_rows, positions_from(list(lengths), max_depth + 1, logits.device))
        parts: list[TreeVerdict] = []
        kept: list[torch.Tensor] = []
        for rows in chunks:
            part = DraftTree(tree.tokens[rows], tree.parents[rows], tree.depths[rows])
            scores = self._processed(tokens[rows], lengths[rows], logits[rows], callers[rows], part, depths[rows])
            if draws is not None:
                target_probs = probabilities(scores)  # (rows, N + 1, vocab)
                verdict = flag_tree_nonfinite(tree_accept(part, target_probs, draws[rows]), target_probs)
                del target_probs
            else:
                verdict = tree_greedy_accept(part, first_argmax(scores), max_depth)
            parts.append(verdict)
            if self.keep_scores:
                kept.append(along_path(scores, verdict.path))
        verdict = parts[0] if len(parts) == 1 else TreeVerdict(*(torch.cat(field) for field in zip(*parts)))
        if self.tensor_parallel:
            verdict = distributed.broadcast_tree_verdict(verdict)
        return verdict, (None if not kept else kept[0] if len(kept) == 1 else torch.cat(kept))

    def node_scores(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        logits: torch.Tensor,
        callers: Sequence[int],
        tree: DraftTree,
        shape: TreeShape | None = None,
    ) -> torch.Tensor:
        """`(batch, N + 1, vocab)` the processed scores at every position of the tree, in one chunk (arguments as
        for a call): what the rule draws from, for statistics (`tree_rule.expected_tokens`) and tests."""
        depths, _ = _host_depths(tree, shape, logits.shape[0])
        return self._processed(tokens, lengths, logits, callers, tree, depths)

    def _processed(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        logits: torch.Tensor,
        callers: Sequence[int],
        tree: DraftTree,
        depths: list[list[int]],
    ) -> torch.Tensor:
        """`(rows, N + 1, vocab)` the processed scores of a chunk's positions, each with its own prefix.

        Args:
            tokens: `(rows, capacity)`; lengths, callers: the chunk's; logits: `(rows, N + 1, vocab)`; tree: the
            chunk's; depths: the chunk's, per row and node.
        """
        chunk, positions, vocab = logits.shape
        if not self.reads_prefixes:  # prefix-free processors only: the positions' prefixes are never read
            return self.processor(tokens, lengths, logits, callers)
        # per position (a row's root, then its nodes), its prefix length and caller row
        flat_lengths = [length + depth for length, row in zip(lengths, depths) for depth in [0] + row]
        flat_callers = [caller for caller in callers for _ in range(positions)]
        deepest = max((max(row, default=0) for row in depths), default=0)
        prefixes = _position_prefixes(tokens, lengths, tree, deepest)  # (rows * (N + 1), width)
        scores = self.processor(prefixes, flat_lengths, logits.reshape(chunk * positions, 1, vocab), flat_callers)
        return scores.reshape(chunk, positions, vocab)


def _host_depths(tree: DraftTree, shape: TreeShape | None, batch: int) -> tuple[list[list[int]], int]:
    """Per row, each node's depth, and the deepest: from `shape` where given, else read from `tree.depths`."""
    if shape is not None:
        assert shape.num_nodes == tree.num_nodes, f"{shape.num_nodes} nodes in the shape, {tree.num_nodes} in the tree"
        return [list(shape.depths)] * batch, shape.max_depth
    depths = tree.depths.tolist()  # (batch, N) on the host
    return depths, max((max(row, default=0) for row in depths), default=0)


def _position_prefixes(tokens: torch.Tensor, lengths: Sequence[int], tree: DraftTree, max_depth: int) -> torch.Tensor:
    """`(rows * (N + 1), width)` long: per position (row-major: a row's root, then its nodes), the committed
    tokens then the path to the node; what follows a prefix is not meaningful.

    Args:
        tokens: `(rows, capacity)`; lengths: per row, its committed length; tree: `(rows, N)`; max_depth: at least
            the tree's deepest node's depth.
    """
    rows, nodes = tree.tokens.shape
    width = max(lengths) + max_depth
    base = tokens.new_zeros((rows, width))
    base[:, : min(width, tokens.shape[1])] = tokens[:, :width]
    paths = torch.cat([tree.tokens.new_zeros((rows, 1, max_depth)), path_tokens(tree, max_depth)], dim=1)
    columns = torch.tensor(list(lengths), device=tokens.device)[:, None] + torch.arange(max_depth, device=tokens.device)
    prefixes = base[:, None, :].repeat(1, nodes + 1, 1)  # (rows, N + 1, width)
    prefixes.scatter_(2, columns[:, None, :].expand(-1, nodes + 1, -1), paths)
    return prefixes.reshape(rows * (nodes + 1), width)


def along_path(scores: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """`(rows, max_depth + 1, vocab)` the scores at the root, then at each accepted node (the root's after the path).

    Args:
        scores: `(rows, N + 1, vocab)`; path: `(rows, max_depth)`, -1 after the accepted nodes.
    """
    at = torch.cat([torch.zeros_like(path[:, :1]), (path + 1).clamp(min=0)], dim=1)  # (rows, max_depth + 1)
    return scores.gather(1, at[..., None].expand(-1, -1, scores.shape[-1]))
