"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): each row's round is a tree of what followed the row's last
tokens wherever they occurred before: in the row's own prompt and text, in the call's other rows, and in the outputs
of earlier calls a `SuffixDraft` holds.

Each round, per active row: the latest occurrences of the row's last tokens are found in two indexes
(`suffix_store.TokenIndex.matches`): the call's own (every row's real tokens at their buffer columns, kept up to date
with the committed tokens) and the store's. The occurrences matching the most tokens are kept (a suffix tree's node of
the longest match), and what followed each of them (`continuations`) is counted into a tree (`count_tree`): a node's
count is the occurrences whose continuation starts with its path, its probability that count over the occurrences.
The tree keeps the most probable nodes (an ancestor is never less probable than its child, so the kept nodes form a
tree) above `MIN_PROBABILITY`, at most `SPEC_FACTOR` times the match length of them (a short match is weak evidence;
a match of all the row's last tokens looked at is not cut) and the round's budget (`DraftBudget.nodes`, depth
`DraftBudget.lookup_lookahead`). Prompt lookup (`draft_model="prompt_lookup"`, `prompt_lookup_num_tokens=`) is this
drafter over each row's own text alone (`CallText.OWN_ROW`), its last `max_matching_ngram_size` tokens matched.

Exact: the tree is a function of committed tokens and earlier calls' outputs only, fixed before the target's draws,
and siblings carry distinct tokens, so the tree walk (`verify.rules.walk`) commits the target's own draws; with keyed
draws a seeded call's text does not depend on the store. Where the call cannot verify trees (`validation
.tree_problems`), each row proposes its tree's most probable path as a chain of point masses. Rows are padded to the
round's widest tree with copies of their first node (a sibling the walk never takes: it takes the first match), or,
in a row with no occurrence, with its last token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..core.sequences import Sequences
from .base import DraftBudget, Proposal, Proposer
from .suffix_store import MAX_MATCH, SEPARATOR, SuffixDraft, TokenIndex

MIN_PROBABILITY = 0.1  # SuffixDecoding's floor: a node seen in fewer than this share of the occurrences is dropped
SPEC_FACTOR = 2.0  # at most this many nodes per matched token (SuffixDecoding's max_spec_factor)


class CallText(str, enum.Enum):
    """Which of the call's rows a row drafts from (besides a store)."""

    ALL_ROWS = "all rows"  # its own prompt and text and the other rows' (the suffix drafter)
    OWN_ROW = "own row"  # its own prompt and text alone (prompt lookup: `draft_model="prompt_lookup"`)

    def __str__(self) -> str:
        return self.value


class Source(str, enum.Enum):
    """Where a round's suffix draft came from (`SpeculativeStats.suffix_accepted_tokens` counts by it)."""

    CALL = "call"  # the row's own prompt and text, and the call's other rows
    STORE = "store"  # earlier calls' outputs (`SuffixDraft`)

    def __str__(self) -> str:
        return self.value


class CountedTree(NamedTuple):
    """One row's draft tree, level order (a parent's index below its children's).

    Attributes:
        tokens, parents, depths: per node (parents -1: the root; depths 1: a child of the root).
        counts: per node, the occurrences whose continuation starts with its path.
        occurrences: the occurrences counted (a node's probability is its count over them).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    counts: list[int]
    occurrences: int = 0

    @property
    def expected_tokens(self) -> float:
        """The draft tokens a round of this tree would have accepted if the target continued as the occurrences did:
        the sum of its nodes' probabilities (SuffixDecoding's score)."""
        return sum(self.counts) / self.occurrences if self.occurrences else 0.0

    def path(self, max_depth: int | None = None) -> CountedTree:
        """The tree's most probable path from the root (the most counted child at each node; ties: the first), as a
        tree of width one, at most `max_depth` deep (None: to its end)."""
        nodes: list[int] = []
        parent = -1
        while max_depth is None or len(nodes) < max_depth:
            children = [node for node, above in enumerate(self.parents) if above == parent]
            if not children:
                break
            parent = max(children, key=lambda node: self.counts[node])  # max keeps the first of equal counts
            nodes.append(parent)
        return CountedTree(
            [self.tokens[node] for node in nodes],
            list(range(-1, len(nodes) - 1)),
            list(range(1, len(nodes) + 1)),
            [self.counts[node] for node in nodes],
            self.occurrences,
        )


NO_TREE = CountedTree([], [], [], [])


def count_tree(continuations: np.ndarray, max_nodes: int, min_probability: float = MIN_PROBABILITY) -> CountedTree:
    """The tree of the most frequent continuations (module docstring).

    Args:
        continuations: `(m, depth)` int64, each occurrence's following tokens, `SEPARATOR` after its end; rows in
            order of preference (the latest occurrence first: ties between equal counts go to it).
        max_nodes: the most nodes kept.
        min_probability: a node's count over m below this drops it.

    Returns:
        The kept nodes, level order; siblings distinct.
    """
    occurrences, depth = continuations.shape
    if occurrences == 0 or max_nodes <= 0:
        return NO_TREE
    least = min_probability * occurrences
    node_of = np.full(occurrences, -1, dtype=np.int64)  # each occurrence's node so far (-1: the root)
    alive = np.ones(occurrences, dtype=bool)
    parents: list[int] = []
    tokens: list[int] = []
    depths: list[int] = []
    counts: list[int] = []
    firsts: list[int] = []
    width = np.int64(1) << np.int64(32)  # keys: (parent + 1) * width + token
    for level in range(depth):
        alive &= continuations[:, level] != SEPARATOR
        rows = np.nonzero(alive)[0]
        if rows.size == 0:
            break
        keys = (node_of[rows] + 1) * width + continuations[rows, level]
        unique, first, inverse, count = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
        kept = count >= least
        ids = np.full(unique.shape[0], -2, dtype=np.int64)
        ids[kept] = len(tokens) + np.arange(int(kept.sum()))
        parents += (unique[kept] // width - 1).tolist()
        tokens += (unique[kept] % width).tolist()
        depths += [level + 1] * int(kept.sum())
        counts += count[kept].tolist()
        firsts += rows[first[kept]].tolist()
        node_of[rows] = ids[inverse.reshape(-1)]
        alive[rows] &= kept[inverse.reshape(-1)]
    if not tokens:
        return NO_TREE
    # most probable first; an ancestor (count >= its child's, shallower) always before its descendants
    order = sorted(range(len(tokens)), key=lambda node: (-counts[node], depths[node], firsts[node]))[:max_nodes]
    order.sort(key=lambda node: (depths[node], -counts[node], firsts[node]))  # level order
    new_index = {node: index for index, node in enumerate(order)}
    return CountedTree(
        [tokens[node] for node in order],
        [new_index[parents[node]] if parents[node] >= 0 else -1 for node in order],
        [depths[node] for node in order],
        [counts[node] for node in order],
        occurrences,
    )


def suffix_tree(
    query: np.ndarray, sources: Sequence[tuple[Source, TokenIndex, int]], depth: int, max_nodes: int
) -> tuple[CountedTree, Source | None, bool]:
    """The tree of what followed the longest matches of `query`'s end in the `sources` (module docstring).

    Args:
        query: `(q,)` the row's last tokens.
        sources: (source, its index, a global position never matched there: the row's own end, or -1).
        depth, max_nodes: the tree's deepest level and most nodes.

    Returns:
        The tree (`NO_TREE`: no occurrence continues), the source most of its occurrences came from (None: no tree),
        and whether any came from `Source.STORE`.
    """
    parts = []
    for source, index, exclude in sources:
        matches = index.matches(query, exclude=exclude)
        continuations = index.continuations(matches.positions, depth)
        useful = continuations[:, 0] != SEPARATOR  # an occurrence at a document's end continues nothing
        parts.append((source, continuations[useful], matches.lengths[useful]))
    longest = max((int(lengths.max()) for _, _, lengths in parts if lengths.size), default=0)
    if longest == 0:
        return NO_TREE, None, False
    kept = [(source, rows[lengths >= longest]) for source, rows, lengths in parts]
    continuations = np.concatenate([rows for _, rows in kept])
    # a short match is weak evidence; a match of the whole query (the most it measures) is the strongest there is
    budget = max_nodes if longest >= query.shape[0] else min(max_nodes, max(1, int(SPEC_FACTOR * longest)))
    tree = count_tree(continuations, budget)
    from_store = sum(rows.shape[0] for source, rows in kept if source is Source.STORE)
    source = Source.STORE if 2 * from_store > continuations.shape[0] else Source.CALL
    return tree, (source if tree.tokens else None), from_store > 0


class SuffixProposer(Proposer):
    """Drafts each row's round from suffix matches in the call's rows and a `SuffixDraft` (module docstring).

    Attributes:
        store: the earlier calls' outputs (None: the call's own text alone).
        trees: propose trees (else each row's best path as a chain).
        forward_passes: always 0 (no model runs).
    """

    forward_passes = 0

    def __init__(
        self,
        sequences: Sequences,
        store: SuffixDraft | None,
        trees: bool,
        call_text: CallText = CallText.ALL_ROWS,
        max_match: int = MAX_MATCH,
    ):
        """
        Args:
            sequences: the call's rows (their prompts are indexed now, their committed tokens each round).
            store: earlier calls' outputs, or None.
            trees: the call verifies trees.
            call_text: which of the call's rows a row drafts from.
            max_match: the most of a row's last tokens matched (transformers' `max_matching_ngram_size`; at most
                `MAX_MATCH`): occurrences matching this many are all equally good.
        """
        self.store, self.trees, self.call_text, self.max_match = store, trees, call_text, min(max_match, MAX_MATCH)
        rows, capacity = sequences.tokens.shape
        self.stride = capacity + 1  # with every row in one index: caller row r's column c at r * stride + c
        if call_text is CallText.OWN_ROW:  # an index per row: another row's occurrences never crowd its chains
            buckets = 1 << max(10, (2 * self.stride - 1).bit_length())
            self.row_indexes = [TokenIndex(capacity=self.stride, buckets=buckets) for _ in range(rows)]
        else:
            buckets = 1 << max(10, (2 * rows * self.stride - 1).bit_length())
            self.index = TokenIndex(capacity=rows * self.stride, buckets=buckets)
        self.indexed = [0] * rows  # per caller row, the columns indexed so far
        self.accepted = {source: 0 for source in Source}  # draft tokens accepted, by the source of their round
        self.sources: list[Source | None] = []  # per active row, the last round's source (None: no draft)
        self.last_tokens: list[int] = []  # per active row, its last committed token (read from the round's host copy)

    def _place(self, caller: int) -> tuple[TokenIndex, int]:
        """The index holding caller row `caller`'s text, and the global position of its column 0 there."""
        if self.call_text is CallText.OWN_ROW:
            return self.row_indexes[caller], 0
        return self.index, caller * self.stride

    def _index_committed(self, sequences: Sequences, tokens: np.ndarray, real: np.ndarray) -> None:
        """Index every active row's committed tokens not indexed yet (prompt padding stays a separator).

        Args:
            tokens: `(rows, capacity)` the buffer on the host; real: `(rows, capacity)` bool, False for padding.
        """
        for row, (caller, length) in enumerate(zip(sequences.rows.callers(), sequences.lengths)):
            start = self.indexed[caller]
            if start >= length:
                continue
            written = np.where(real[row, start:length], tokens[row, start:length], SEPARATOR).astype(np.int32)
            index, base = self._place(caller)
            index.write(base + start, written)
            self.indexed[caller] = length

    def row_tree(
        self, query: np.ndarray, caller: int, length: int, depth: int, max_nodes: int
    ) -> tuple[CountedTree, Source | None]:
        """One row's tree from its last tokens `query` `(q,)` (`suffix_tree` over the call's index and the store's),
        and where its occurrences came from; the store's statistics count the lookup.

        Args:
            caller, length: the row's caller index and committed length (its last token is never a match).
            depth, max_nodes: the tree's deepest level and most nodes.
        """
        index, base = self._place(caller)
        sources = [(Source.CALL, index, base + length - 1)]
        if self.store is not None:
            sources.append((Source.STORE, self.store.index, -1))
        tree, source, from_store = suffix_tree(query, sources, depth, max_nodes)
        if self.store is not None:
            self.store.stats.lookups += 1
            self.store.stats.matched += int(from_store)
        return tree, source

    def get_candidates(self, sequences: Sequences, budget: DraftBudget) -> Proposal:
        """Each row's tree (or best path), at most `budget.lookup_lookahead` deep and `budget.nodes` wide.

        Returns:
            A tree `Proposal`: `(rows, N)` tokens, parents and depths, N the widest row's nodes (the others padded);
            or a chain of `(rows, K)` point masses written after each row's committed tokens (no trees, or no row
            found a continuation: K = 0).
        """
        return self.propose(sequences, self.row_trees(sequences, budget.lookup_lookahead, budget.nodes))

    def row_trees(self, sequences: Sequences, depth: int, nodes: int) -> list[CountedTree]:
        """Per active row, its tree of at most `depth` levels and `nodes` nodes (`NO_TREE`: nothing found); the
        rows' sources are kept for `observe`."""
        tokens = sequences.tokens.cpu().numpy()  # the round's one host copy of the buffer
        real = sequences.is_real(sequences.capacity).numpy()  # a host tensor
        self._index_committed(sequences, tokens, real)
        trees: list[CountedTree] = []
        self.sources = []
        self.last_tokens = [int(tokens[row, length - 1]) for row, length in enumerate(sequences.lengths)]
        for row, (caller, length) in enumerate(zip(sequences.rows.callers(), sequences.lengths)):
            tree, source = NO_TREE, None
            if depth > 0:
                start = max(0, length - self.max_match)
                query = tokens[row, start:length][real[row, start:length]]
                tree, source = self.row_tree(query, caller, length, depth, max(nodes, 1))
            trees.append(tree)
            self.sources.append(source if tree.tokens else None)
        return trees

    def propose(self, sequences: Sequences, trees: Sequence[CountedTree]) -> Proposal:
        """The rows' `trees` (this round's `row_trees`) as the round's proposal: trees where the call verifies them,
        else their best paths."""
        if not self.trees:
            return self._chains(sequences, [tree.path().tokens for tree in trees])
        return self._trees(sequences, trees)

    def _chains(self, sequences: Sequences, paths: list[list[int]]) -> Proposal:
        """The rows' `paths` as a chain, padded with each row's last token, written after the committed tokens."""
        lookahead = max((len(path) for path in paths), default=0)
        rows = []
        for row, path in enumerate(paths):
            last = path[-1] if path else self.last_tokens[row]
            rows.append(path + [last] * (lookahead - len(path)))
        proposed = torch.tensor(rows, dtype=torch.long).reshape(len(paths), lookahead).to(sequences.tokens.device)
        for step in range(lookahead):
            sequences.write(step, proposed[:, step])
        return Proposal(tokens=proposed, probs=None)

    def _trees(self, sequences: Sequences, trees: Sequence[CountedTree]) -> Proposal:
        """The rows' trees, padded to the widest (module docstring); where every row's is a chain (or empty), the
        chains (verified as a chain, walked with the call's keyed draws all the same: `verify.verifier`)."""
        nodes = max((len(tree.tokens) for tree in trees), default=0)
        if all(tree.parents == list(range(-1, len(tree.parents) - 1)) for tree in trees):  # chains (or nothing):
            return self._chains(sequences, [tree.tokens for tree in trees])  # a chain's forward, no tree mask
        tokens, parents, depths = [], [], []
        for row, tree in enumerate(trees):
            pad = nodes - len(tree.tokens)
            first = tree.tokens[0] if tree.tokens else self.last_tokens[row]
            tokens.append(tree.tokens + [first] * pad)
            parents.append(tree.parents + [-1] * pad)
            depths.append(tree.depths + [1] * pad)
        device = sequences.tokens.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        depth = max(max(row) for row in depths)
        return Proposal(as_tensor(tokens), None, parents=as_tensor(parents), depths=as_tensor(depths), depth=depth)

    def observe(self, num_accepted: Sequence[int]) -> None:
        """Count the round's accepted draft tokens by their rows' sources."""
        for source, accepted in zip(self.sources, num_accepted):
            if source is not None:
                self.accepted[source] += int(accepted)
        if self.store is not None:
            self.store.stats.accepted_tokens += sum(
                int(accepted) for source, accepted in zip(self.sources, num_accepted) if source is Source.STORE
            )

    def accepted_by_source(self) -> dict[str, int]:
        return {str(source): count for source, count in self.accepted.items()}

    def finished(self, outputs: Sequence[torch.Tensor]) -> None:
        """The call ended: the store keeps its rows' new tokens (`outputs`, per caller row `(new,)` long)."""
        if self.store is not None:
            self.store.add([output.cpu().numpy() for output in outputs])

    def select_rows(self, rows: Sequence[int]) -> None:
        """Nothing to drop: the call's index is by caller row, and keeps finished rows' text for the others."""

    def rollback_to_committed(self, lengths: Sequence[int]) -> None:
        """Nothing to roll back: only committed tokens are indexed."""
