"""Apply a `LogitsProcessorList` at several positions of several rows, each with that position's own prefix.

Plain `generate()` calls the processor list once per step with `input_ids` of shape `(batch, current_length)`.
Speculative sampling scores up to K+1 positions per row at once, and rows of a batch may stand at different
lengths. To give every processor exactly the arguments plain `generate()` would have given it:

- processors that depend on the prefix (repetition penalty, n-gram bans, bad words, ...) are called once per
  distinct prefix length, with the rows that share it;
- processors known to ignore `input_ids` and to treat rows independently (temperature, top-k, top-p, min-p, ...)
  are called once on all positions flattened together;
- the two that read only the prefix's *length* (min-length and min-new-tokens: they forbid EOS while the sequence is
  too short) are applied to all positions at once from a `(batch, positions)` tensor of lengths. Calling them per
  distinct length cost up to B (K+1) calls per round, each scanning the vocabulary (`torch.isin`).

The processor list keeps its order: it is cut into consecutive runs of these three kinds. Among prefix-dependent
processors, only those known to compute each row from that row alone (`ROW_LOCAL_PROCESSORS`) are called on the
group of rows sharing a prefix length. Every other one (a user's processor, `prefix_allowed_tokens_fn`, which
receives a `batch_id`, the encoder repetition penalty and n-gram ban, which look up each row's prompt by index, the
repetition penalty of a padded batch, which holds one padding length per row) is called with the caller's whole
batch, each row at its own index, as plain `generate()` calls it; the rows not at that prefix length are filled
with zeros and their output is discarded. A processor whose row depends on *other* rows' contents cannot be
applied exactly to draft positions; none of transformers' processors does this outside beam search. A round of
many rows is processed in row chunks (`verify.verifier`): each chunk's rows are called as above, so a processor
may be called once per chunk and prefix length.

A round processes K + 1 positions where plain decoding processes one, and a model draft processes its K drafted
positions too, so what processors cost decides how far drafting may go (`round_costs.ProcessingCost`).
`PositionwiseProcessor` counts the host seconds its calls take and the positions they process; `cost_unknown` says
whether a list holds a processor that is not one of transformers' own known here (a user's, a
`prefix_allowed_tokens_fn`, ...), whose cost nothing bounds before it is timed.
"""

from __future__ import annotations

import enum
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.generation import logits_process as lp

from ..core.devices import tensor_on, to_device
from ..core.sequences import Sequences
from .fast_processors import fast_equivalent
from .stateful import GrammarPrefixes, RowsProcessor, check_stateful, driven

# Processors whose output row depends only on the same row of `scores` (never on `input_ids`, nor on the batch),
# and not on which token id a column stands for: they give the same result on any subset of the vocabulary.
VOCABULARY_FREE_PROCESSORS: tuple[type, ...] = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.TopHLogitsWarper,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
)

# Processors whose output row depends only on the same row of `scores` (never on `input_ids`, nor on the batch).
PREFIX_FREE_PROCESSORS: tuple[type, ...] = VOCABULARY_FREE_PROCESSORS + (lp.SuppressTokensLogitsProcessor,)

# Prefix-dependent processors whose output row depends only on the same row of `input_ids` and `scores`, never on
# the row's index in the batch: they may be called on any group of rows. (The repetition penalty only while its
# `prompt_ignore_length` is not a per-row tensor: see `_row_local`.)
ROW_LOCAL_PROCESSORS: tuple[type, ...] = (
    lp.RepetitionPenaltyLogitsProcessor,
    lp.NoRepeatNGramLogitsProcessor,
    lp.NoBadWordsLogitsProcessor,
    lp.SequenceBiasLogitsProcessor,
    lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor,
    lp.ExponentialDecayLengthPenalty,
    lp.SuppressTokensAtBeginLogitsProcessor,
)

# Processors that read only the prefix length: EOS is forbidden while the sequence is shorter than a threshold.
LENGTH_ONLY_PROCESSORS: tuple[type, ...] = (lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor)

# transformers' processors whose cost is known to be small: vectorised over the vocabulary, or a short loop over the
# prefix. Any other processor (exact type: a subclass may do anything) may cost more than a target step per call.
KNOWN_COST_PROCESSORS: tuple[type, ...] = PREFIX_FREE_PROCESSORS + ROW_LOCAL_PROCESSORS + LENGTH_ONLY_PROCESSORS


def cost_unknown(processors: Sequence[lp.LogitsProcessor]) -> bool:
    """Whether `processors` hold one whose cost is unknown until timed (not in `KNOWN_COST_PROCESSORS`)."""
    return any(type(processor) not in KNOWN_COST_PROCESSORS for processor in processors)


class RunKind(enum.Enum):
    """How a run of consecutive processors is applied to `(batch, positions, vocab)` scores."""

    PREFIX_FREE = "prefix_free"  # once, on all positions flattened
    LENGTH_ONLY = "length_only"  # once, from each position's prefix length
    PREFIX = "prefix"  # once per distinct prefix length, with that prefix
    GRAMMAR = "grammar"  # a grammar driven here (`stateful.GrammarPrefixes`): once, each position by its prefix


# Processors that keep state across calls or need a second batch: calling them for draft positions (or for
# positions that are later rejected) would change what they do, so they are refused up front.
UNSUPPORTED_PROCESSORS: tuple[type, ...] = (
    lp.SynthIDTextWatermarkLogitsProcessor,
    lp.UnbatchedClassifierFreeGuidanceLogitsProcessor,
    lp.ClassifierFreeGuidanceLogitsProcessor,
)


def check_supported(
    processors: Sequence[lp.LogitsProcessor], declared: tuple[type, ...] = (), batch_size: int | None = None
) -> None:
    """Raise a `ValueError` naming any processor speculative sampling cannot apply exactly (transformers' own that
    keep state; structured-generation processors no adapter drives, or whose settings their adapter refuses given the
    call's `batch_size`: `stateful.check_stateful`)."""
    check_stateful(processors, declared, batch_size)
    for processor in processors:
        if isinstance(processor, UNSUPPORTED_PROCESSORS):
            raise ValueError(
                f"{type(processor).__name__} keeps state across calls (or needs a second batch), so it cannot be "
                "applied to draft positions exactly; generate without `draft_model=` for this configuration."
            )


def _kind(processor: lp.LogitsProcessor) -> RunKind:
    # Exact type, not isinstance: a subclass may well read `input_ids`.
    if type(processor) in PREFIX_FREE_PROCESSORS:
        return RunKind.PREFIX_FREE
    if type(processor) in LENGTH_ONLY_PROCESSORS:
        return RunKind.LENGTH_ONLY
    if isinstance(processor, GrammarPrefixes):
        return RunKind.GRAMMAR
    return RunKind.PREFIX


def _runs(processors: Sequence[lp.LogitsProcessor]) -> list[tuple[RunKind, list[lp.LogitsProcessor]]]:
    """Split the list into consecutive runs of (kind, processors)."""
    runs: list[tuple[RunKind, list[lp.LogitsProcessor]]] = []
    for processor in processors:
        kind = _kind(processor)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(processor)
        else:
            runs.append((kind, [processor]))
    return runs


class PositionwiseProcessor:
    """Applies a processor list to `scores` of shape `(batch, positions, vocab)`.

    Position ``j`` of row ``b`` is processed with prefix ``tokens[b, : prefix_lengths[b] + j]``, which is what
    plain `generate()` passes when it samples that position.
    """

    def __init__(
        self,
        processors: Sequence[lp.LogitsProcessor],
        batch_size: int,
        fast: bool = True,
        prompt_length: int | None = None,
        stateful: tuple[type, ...] = (),
        sequences: Sequences | None = None,
    ):
        """
        Args:
            processors: the list `generate()` built.
            batch_size: rows of the caller's batch (`callers` index them): the batch given to processors that are
                not row-local.
            fast: replace processors that sort the vocabulary by exact sort-free equivalents
                (`sampling.fast_processors.fast_equivalent`); any other processor runs as given.
            prompt_length: columns of the prompt `generate()` was given, where a stateful processor's state starts
                (`stateful.driven`: a grammar library's, those `stateful` declares); needed only with one.
            stateful: classes declared stateful (`SpeculativeConfig.stateful_processors`): replayed.
            sequences: the call's rows (a grammar's processor checks committed tokens against their lengths).
        """
        check_supported(processors, stateful)
        adapted: list[Any] = [
            driven(processor, prompt_length, batch_size, stateful, sequences) for processor in processors
        ]
        self.runs = _runs(adapted)
        self.grammars = [processor for processor in adapted if isinstance(processor, GrammarPrefixes)]
        self.batch_size = batch_size
        self.fast = fast
        # Exact type, as for prefix-freedom: a subclass may read token ids.
        self.vocabulary_free = all(type(p) in VOCABULARY_FREE_PROCESSORS for p in processors)
        # whether any processor reads a prefix's tokens (else a tree's positions' prefixes are never built)
        self.reads_tokens = any(kind in (RunKind.PREFIX, RunKind.GRAMMAR) for kind, _ in self.runs)
        # what the calls cost (the policy's `round_costs.ProcessingCost` reads the seconds per round phase)
        self.seconds = 0.0  # host seconds inside calls that had processors to apply
        self.positions = 0  # positions processed: rows x positions of each such call

    def forced_tokens(
        self, tokens: torch.Tensor, prefix_lengths: Sequence[int], callers: Sequence[int]
    ) -> list[int] | None:
        """Per row, the one token a grammar processor (`stateful.GrammarPrefixes`) allows after its prefix
        ``tokens[b, : prefix_lengths[b]]``, where every row has one; else None. The processed distribution there is
        then that token's point mass, whatever the other processors do (they never unmask a token), so a draft may
        propose it without a forward."""
        grammars = self.grammars
        if not grammars:
            return None
        forced = []
        for row, (length, caller) in enumerate(zip(prefix_lengths, callers)):
            generated = tokens[row, grammars[0].prompt_length : length].tolist()
            allowed = {grammar.forced(caller, generated) for grammar in grammars}
            token = allowed.pop() if len(allowed) == 1 else None
            if token is None:
                return None
            forced.append(token)
        return forced

    def __call__(
        self,
        tokens: torch.Tensor,
        prefix_lengths: Sequence[int],
        scores: torch.Tensor,
        callers: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Return the processed scores (the input is not modified).

        Args:
            tokens: `(batch, capacity)` long, each row's tokens (prompt with its padding, generated, then drafts).
            prefix_lengths: `batch` ints, the prefix length of position 0 of each row.
            scores: `(batch, positions, vocab)` float32 logits.
            callers: each row's caller row (`RowBook.active`; default: ``0 .. batch - 1``).

        Returns:
            `(batch, positions, vocab)` processed scores.
        """
        if not self.runs:
            return scores
        started = time.perf_counter()
        processed = self._apply(tokens, prefix_lengths, scores, callers)
        self.seconds += time.perf_counter() - started
        self.positions += scores.shape[0] * scores.shape[1]
        return processed

    def _apply(
        self,
        tokens: torch.Tensor,
        prefix_lengths: Sequence[int],
        scores: torch.Tensor,
        callers: Sequence[int] | None,
    ) -> torch.Tensor:
        """`__call__`'s work: each run of processors in turn."""
        batch, positions, vocab = scores.shape
        for kind, processors in self.runs:
            if kind is RunKind.PREFIX_FREE:
                flat = scores.reshape(batch * positions, vocab)
                no_prefix = tokens.new_empty((batch * positions, 0))
                for processor in processors:
                    faster = fast_equivalent(processor) if self.fast else None
                    flat = faster(flat) if faster is not None else processor(no_prefix, flat)
                scores = flat.reshape(batch, positions, vocab)
            elif kind is RunKind.LENGTH_ONLY:
                for processor in processors:
                    scores = _forbid_eos_while_short(processor, prefix_lengths, scores)
            elif kind is RunKind.GRAMMAR:
                callers = list(range(batch)) if callers is None else callers
                for grammar in processors:
                    assert isinstance(grammar, GrammarPrefixes)  # what `_kind` puts in this run
                    scores = grammar.positions(tokens, prefix_lengths, scores, callers)
            else:
                callers = list(range(batch)) if callers is None else callers
                scores = self._by_prefix_length(processors, tokens, prefix_lengths, scores, callers)
        return scores

    def _by_prefix_length(
        self,
        processors: list[lp.LogitsProcessor],
        tokens: torch.Tensor,
        prefix_lengths: Sequence[int],
        scores: torch.Tensor,
        callers: Sequence[int],
    ) -> torch.Tensor:
        """Call the processors once per distinct prefix length, with the rows at that length (see module doc)."""
        batch, positions, _ = scores.shape
        groups: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for row in range(batch):
            for position in range(positions):
                groups[prefix_lengths[row] + position].append((row, position))
        out = scores.clone()
        # shortest prefixes first: a function that keeps each prefix's state and derives it from its parent's
        # (lm-format-enforcer's `prefix_allowed_tokens_fn`) finds every parent asked before it
        for length, pairs in sorted(groups.items()):
            caller_rows = [callers[row] for row, _ in pairs]
            rows = torch.tensor([row for row, _ in pairs], device=scores.device)
            cols = torch.tensor([col for _, col in pairs], device=scores.device)
            group_ids = tokens[rows, :length]  # (group, length)
            group_scores = scores[rows, cols]  # (group, vocab)
            for processor in processors:
                if isinstance(processor, RowsProcessor):  # driven here: by each caller row's prefix
                    group_scores = processor(group_ids, group_scores, caller_rows)
                elif _row_local(processor):
                    group_scores = processor(group_ids, group_scores)
                else:
                    group_scores = self._whole_batch_call(processor, group_ids, group_scores, caller_rows)
            out[rows, cols] = group_scores
        return out

    def _whole_batch_call(
        self, processor: lp.LogitsProcessor, ids: torch.Tensor, scores: torch.Tensor, caller_rows: list[int]
    ) -> torch.Tensor:
        """`processor` called on the caller's whole batch with the group's rows at their own indices.

        A caller row appears once per call: where the group holds several prefixes of one caller row (a draft
        tree's siblings share a prefix length), the processor is called once per repeat.

        Args:
            ids: `(group, length)` the group's prefixes; scores: `(group, vocab)`; caller_rows: `group` ints, their
                indices in the caller's batch.

        Returns:
            `(group, vocab)` the processed scores of the group's rows.
        """
        repeat: list[int] = []  # per group row, how many earlier group rows share its caller row
        seen: dict[int, int] = defaultdict(int)
        for caller in caller_rows:
            repeat.append(seen[caller])
            seen[caller] += 1
        out = scores.new_empty(scores.shape)
        for call in range(max(seen.values(), default=0)):
            members = [index for index, count in enumerate(repeat) if count == call]
            picked = torch.tensor(members, device=scores.device)  # (part,)
            rows = torch.tensor([caller_rows[index] for index in members], device=scores.device)  # (part,) distinct
            whole_ids = ids.new_zeros((self.batch_size, ids.shape[1]))
            whole_ids[rows] = ids[picked]
            whole_scores = scores.new_zeros((self.batch_size, scores.shape[1]))
            whole_scores[rows] = scores[picked]
            out[picked] = processor(whole_ids, whole_scores)[rows]
        return out


def _row_local(processor: lp.LogitsProcessor) -> bool:
    """Whether `processor` may be called on any group of rows (exact type: a subclass may index rows)."""
    if type(processor) is lp.RepetitionPenaltyLogitsProcessor:
        return not isinstance(processor.prompt_ignore_length, torch.Tensor)  # a tensor holds one length per row
    return type(processor) in ROW_LOCAL_PROCESSORS


def _forbid_eos_while_short(
    processor: lp.LogitsProcessor, prefix_lengths: Sequence[int], scores: torch.Tensor
) -> torch.Tensor:
    """What a min-length / min-new-tokens processor does at every position at once.

    Which positions are too short is decided on the host from the prefix lengths (no tensor is read): past the
    threshold, the usual case after the first tokens, nothing is computed at all.

    Args:
        processor: a `MinLengthLogitsProcessor` or `MinNewTokensLengthLogitsProcessor`.
        prefix_lengths: per row, the prefix length of position 0 (`input_ids.shape[-1]` in `generate()`).
        scores: `(batch, positions, vocab)`.

    Returns:
        `(batch, positions, vocab)` scores with the EOS ids at -inf where the prefix is still too short.
    """
    if isinstance(processor, lp.MinNewTokensLengthLogitsProcessor):
        shortest = processor.prompt_length_to_skip + processor.min_new_tokens  # prefixes shorter than this
    else:
        assert isinstance(processor, lp.MinLengthLogitsProcessor)  # `LENGTH_ONLY_PROCESSORS`' other type
        shortest = processor.min_length
    batch, positions, vocab = scores.shape
    too_short = [[length + position < shortest for position in range(positions)] for length in prefix_lengths]
    if not any(map(any, too_short)):
        return scores
    eos = _eos_columns(processor, vocab, scores.device)
    if eos.numel() == 0:
        return scores
    out = scores.clone()
    masked = to_device(torch.tensor(too_short), scores.device)[..., None].expand(-1, -1, eos.numel())
    out[..., eos] = torch.where(masked, -math.inf, out[..., eos])
    return out


def _eos_columns(
    processor: lp.MinLengthLogitsProcessor | lp.MinNewTokensLengthLogitsProcessor, vocab: int, device: torch.device
) -> torch.Tensor:
    """`(ids,)` long: the processor's EOS ids within ``0 .. vocab - 1`` (what `torch.isin(arange(vocab), eos)`
    selects), on `device`; found once per processor and width (the ids are read from the device once)."""
    key = (vocab, device)
    cached = _EOS_COLUMNS.get(processor)
    if cached is None or cached[0] != key:
        ids = [eos for eos in processor.eos_token_id.reshape(-1).tolist() if 0 <= eos < vocab]
        cached = (key, tensor_on(ids, device))
        _EOS_COLUMNS[processor] = cached
    return cached[1]


# processor -> ((logit width, device), its EOS columns); weak: the processors live as long as a generate() call
_EOS_COLUMNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probabilities(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores in float32; `-inf` scores get probability exactly 0."""
    return torch.softmax(scores.float(), dim=-1)


def processed_at_paths(
    processor: PositionwiseProcessor,
    tokens: torch.Tensor,
    lengths: Sequence[int],
    scores: torch.Tensor,
    callers: Sequence[int],
    depths: Sequence[Sequence[int]],
    paths: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """`scores` at positions off each row's committed tokens (a draft tree's), each processed with its own prefix:
    the row's committed tokens, then the tokens of the position's path. What drafting a tree (at each level's
    parents) and verifying it (at the root and every node) both do.

    Every position becomes a row of one position: processors that read no token run once on all of them (with each
    one's prefix length); otherwise each position's prefix is written into a buffer of its own.

    Args:
        tokens: `(rows, capacity)` the token buffer, row b's committed tokens ``tokens[b, : lengths[b]]`` (not
            written to); lengths: per row, its committed length; callers: per row, its caller row.
        scores: `(rows, P, vocab)` raw scores at the P positions (not modified).
        depths: per row, each position's depth: the length of its path (0: the root).
        paths: makes the `(rows, P, D)` long path tokens, depth 1 first (what follows a position's depth is not
            read); called only where a processor reads tokens.

    Returns:
        `(rows, P, vocab)` processed scores.
    """
    rows, positions, vocab = scores.shape
    flat_lengths = [length + depth for length, row in zip(lengths, depths) for depth in row]
    flat_callers = [caller for caller in callers for _ in range(positions)]
    flat = scores.reshape(rows * positions, 1, vocab)
    if not processor.reads_tokens:  # no prefix is read: the prefix lengths say all (`RunKind`)
        return processor(tokens, flat_lengths, flat, flat_callers).reshape(rows, positions, vocab)
    path_tokens = paths()  # (rows, P, D)
    deepest = path_tokens.shape[2]
    width = max(lengths) + deepest
    base = tokens.new_zeros((rows, width))
    base[:, : min(width, tokens.shape[1])] = tokens[:, :width]
    columns = torch.tensor(list(lengths), device=tokens.device)[:, None] + torch.arange(deepest, device=tokens.device)
    prefixes = base[:, None, :].repeat(1, positions, 1)  # (rows, P, width)
    prefixes.scatter_(2, columns[:, None, :].expand(-1, positions, -1), path_tokens.to(tokens.device))
    processed = processor(prefixes.reshape(rows * positions, width), flat_lengths, flat, flat_callers)
    return processed.reshape(rows, positions, vocab)
