"""Logits processors that keep a state across calls, made exact under speculation: grammars' (`GrammarPrefixes`),
those a user declares stateful (`ReplayedProcessor`), and a refusal for the rest that are known to keep state.

Structured-output processors (xgrammar, outlines, llguidance, transformers-cfg, lm-format-enforcer) keep a matcher
per row that each call advances by the last token of `input_ids`: plain `generate()` calls them once per step, with a
prefix one token longer each time. A speculative round calls its processors at K + 1 positions (and along each path
of a tree) whose prefixes end in draft tokens that may be rejected, so such a processor, called as given, would
accept tokens that are never committed (xgrammar's asserts; others give other text than plain's, silently).

`GrammarPrefixes` makes a grammar library's processor (those `grammar_matchers.DRIVEN` names: xgrammar's own,
outlines' three backends', transformers-cfg's) a pure function of each row's prefix: one matcher per caller row,
moved to each prefix asked for by rolling back to the tokens it shares with the matcher's and accepting the rest,
then the mask of what the grammar allows next, exactly as the processor fills it in plain decoding (also where the
grammar has terminated). A prefix holding a token the grammar forbids (a draft token that is rejected with
probability one, since the target's processed probability of it is 0) keeps the mask of its last allowed prefix, so
no position is ever all -inf. The user's processor object is read (its grammars), never advanced.

A processor declared stateful (`SpeculativeConfig.stateful_processors`) is replayed (`ReplayedProcessor`): called
as plain decoding calls it along each prefix, on a copy of its state after the prefix one token shorter, so that a
prefix's call sees the state plain's call there would see, whatever was called before at prefixes that were then
rejected. Always exact, one row per call, and as slow as a copy of the processor per position.

Processors of the other libraries, whose state we do not drive yet, are refused before any work (`check_stateful`),
saying what to use instead, unless declared stateful. A processor the library does not know is taken to be a
function of its prefix, as transformers' own are (docs/structured_output.md says what that means for a user's
processor).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.sequences import Sequences
from .grammar_matchers import DRIVEN, DRIVEN_NAMES, GrammarMask, RowMatcher, Step

# Top-level modules of structured-generation libraries whose processors keep a state per row that a speculative
# round would advance with draft tokens.
STATEFUL_LIBRARIES = {
    # the processors `grammar_matchers.DRIVEN` names are driven (`GrammarPrefixes`); any other class is not
    "xgrammar": "xgrammar",
    "outlines": "outlines",
    "outlines_core": "outlines",
    "llguidance": "llguidance",
    "transformers_cfg": "transformers-cfg",
    "lmformatenforcer": "lm-format-enforcer",
}


def check_stateful(processors: Sequence[Any], declared: tuple[type, ...] = (), batch_size: int | None = None) -> None:
    """Refuse, before any work, a processor of a structured-generation library whose per-row state no adapter here
    drives (it would be advanced by draft tokens), unless its class is `declared` stateful (then replayed); and,
    given the call's `batch_size`, a driven one whose adapter refuses its settings (`matchers_for` raises: a
    transformers-cfg mode that masks by the scores' argmax, a grammar llguidance rejects, ...)."""
    for processor in processors:
        if isinstance(processor, declared):
            continue
        if is_driven(processor):
            if batch_size is not None:
                matchers_for(processor, batch_size)  # its refusals, before the plan's first forward
            continue
        # the class or any class it derives from (a user's subclass of a library's processor keeps its state too)
        roots = [kind.__module__.split(".")[0] for kind in type(processor).__mro__]
        library = next((STATEFUL_LIBRARIES[root] for root in roots if root in STATEFUL_LIBRARIES), None)
        if library is not None:
            raise ValueError(
                f"{type(processor).__name__} ({library}) keeps a grammar state per row that each call advances by the "
                "last token; a speculative round calls processors at draft positions that may be rejected, which "
                "would advance it past what is committed. hf_specsample drives these processors exactly: "
                f"{DRIVEN_NAMES} (the class itself, not a subclass; docs/structured_output.md): use one of "
                "them for structured output with draft_model=; or declare this processor's class stateful "
                f"(SpeculativeConfig(stateful_processors=({type(processor).__name__},)), one row per call, replayed: "
                "exact and slower); or generate without draft_model= for this processor."
            )


# bytes of distinct masks one call keeps (each a vocabulary's float32 cap at most: 55 of 152k tokens); past it, the
# least recently used are made again when asked
MASK_BYTES = 32 << 20


def matchers_for(processor: Any, batch_size: int) -> Callable[[int], RowMatcher] | None:
    """Caller row -> a new matcher of `processor`'s grammar (`grammar_matchers.DRIVEN`), or None where no adapter
    drives its class (exactly: a subclass may keep a state of its own)."""
    factory = DRIVEN.get((type(processor).__module__, type(processor).__qualname__))
    return None if factory is None else factory(processor, batch_size)


def is_driven(processor: Any) -> bool:
    """Whether an adapter drives `processor`'s class (exactly)."""
    return (type(processor).__module__, type(processor).__qualname__) in DRIVEN


class RowsProcessor:
    """A processor the library drives itself, called by `PositionwiseProcessor` with the rows of one prefix length
    and their caller rows: ``processor(ids, scores, caller_rows)``, ids `(group, length)`, scores `(group, vocab)`."""

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, caller_rows: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError


def driven(
    processor: Any,
    prompt_length: int | None,
    batch_size: int,
    declared: tuple[type, ...] = (),
    sequences: Sequences | None = None,
) -> Any:
    """The processor a call applies in place of `processor`: a grammar library's driven by prefix
    (`GrammarPrefixes`, where `grammar_matchers` has its matcher), one of a class `declared` stateful replayed
    (`ReplayedProcessor`), any other as given. `prompt_length`: the prompt's columns, where their state starts
    (needed only for those two)."""
    new_matcher = matchers_for(processor, batch_size)
    if new_matcher is not None:
        return GrammarPrefixes(new_matcher, _needed(prompt_length), sequences)
    if isinstance(processor, declared):
        return ReplayedProcessor(processor, _needed(prompt_length))
    return processor


def _needed(prompt_length: int | None) -> int:
    if prompt_length is None:
        raise ValueError("hf_specsample internal error: a stateful processor needs the call's prompt length")
    return prompt_length


class GrammarPrefixes:
    """A grammar library's processor as a pure function of each row's prefix (module docstring), applied by
    `sampling.processing.PositionwiseProcessor` to all positions of a call at once (`positions`); each row's
    caller row picks its grammar and matcher (`grammar_matchers.RowMatcher`).
    """

    def __init__(
        self, new_matcher: Callable[[int], RowMatcher], prompt_length: int, sequences: Sequences | None = None
    ):
        """
        Args:
            new_matcher: caller row -> a new matcher of its grammar (`matchers_for`).
            prompt_length: columns of the prompt `generate()` was given: the grammar starts after them.
            sequences: the call's rows, whose committed lengths say which tokens of a prefix are committed (a
                committed token the grammar forbids raises, as plain's processor does); None: not checked.
        """
        self.new_matcher = new_matcher
        self.prompt_length, self.sequences = prompt_length, sequences
        self.matchers: dict[int, RowMatcher] = {}  # caller row -> its matcher
        self.accepted: dict[int, list[int]] = {}  # caller row -> the tokens its matcher holds, in order
        # caller row -> {generated tokens -> what plain's processor does there}: the verifier asks again at the
        # prefixes the draft asked at
        self.masks: dict[int, dict[tuple[int, ...], tuple[GrammarMask, int | None]]] = {}
        self.last_length: dict[int, int] = {}  # caller row -> generated tokens of the last prefix asked
        # (bitmask bytes, beyond) -> its mask, least recently used first: a grammar's masks repeat (inside a string,
        # after each key)
        self.contents: dict[tuple[bytes, float | None], GrammarMask] = {}
        self.seconds = 0.0  # host seconds in `positions` and `forced`

    def positions(
        self, tokens: torch.Tensor, prefix_lengths: Sequence[int], scores: torch.Tensor, callers: Sequence[int]
    ) -> torch.Tensor:
        """`(batch, positions, vocab)` scores with what each row's grammar forbids after each position's prefix at
        -inf, as plain's call at that prefix would mask them.

        Args:
            tokens: `(batch, columns)` each row's tokens; position ``j`` of row ``b`` follows the prefix
                ``tokens[b, : prefix_lengths[b] + j]``.
            prefix_lengths: per row, the prefix length of position 0.
            scores: `(batch, positions, vocab)`.
            callers: per row, its caller row.
        """
        started = time.perf_counter()
        count = scores.shape[1]
        start = self.prompt_length
        generated = tokens[:, start : max(prefix_lengths) + count - 1].tolist()  # one host read: grammars read ids
        out = torch.empty_like(scores)
        for row, (row_tokens, length, caller) in enumerate(zip(generated, prefix_lengths, callers)):
            for position in range(count):
                mask = self._mask(caller, row_tokens[: length - start + position])
                mask.write(scores[row, position], out[row, position])
        self.seconds += time.perf_counter() - started
        return out

    def forced(self, row: int, tokens: list[int]) -> int | None:
        """The one token the row's grammar allows after `tokens` (its generated tokens), or None where it allows
        several (or none). (Logits past the grammar's vocabulary, which its processor leaves as they are, are not
        counted: a draft's point mass stays exact wherever it is proposed, it is only less likely accepted.)"""
        started = time.perf_counter()
        forced = self._mask(row, tokens).forced
        self.seconds += time.perf_counter() - started
        return forced

    def _mask(self, row: int, tokens: list[int]) -> GrammarMask:
        """What plain's processor masks after `tokens` (the row's generated tokens), made once per prefix (a round's
        draft and verifier ask at the same prefixes) and once per content; the index of a forbidden token of the
        prefix (`_matcher_at`) is kept with it."""
        masks = self.masks.setdefault(row, {})
        if len(tokens) < self.last_length.get(row, -1):  # a new pass starts at committed tokens: none shorter again
            masks = self.masks[row] = {key: mask for key, mask in masks.items() if len(key) >= len(tokens)}
        self.last_length[row] = len(tokens)
        key = tuple(tokens)
        made = masks.get(key)
        if made is None:
            matcher, forbidden = self._matcher_at(row, tokens)
            bits = matcher.bits()
            content = (bits.numpy().tobytes(), matcher.beyond)
            mask = self.contents.pop(content, None)
            if mask is None:
                mask = GrammarMask(bits, matcher.beyond)
                if len(self.contents) >= MASK_BYTES // (4 * mask.width):
                    del self.contents[next(iter(self.contents))]  # the least recently used
            self.contents[content] = mask  # the most recently used last
            made = masks[key] = (mask, forbidden)
        mask, forbidden = made
        if forbidden is not None:
            self._refuse_if_committed(row, tokens, forbidden)
        return mask

    def _refuse_if_committed(self, row: int, tokens: list[int], forbidden: int) -> None:
        """Raise where the grammar forbids a committed token (``tokens[forbidden]``), as plain's processor does at
        its next call (or, where it would go on from a state we do not reproduce, instead: the matcher's
        `plain_on_forbidden` says which); a forbidden draft token is rejected with certainty."""
        if self.sequences is None:
            return
        committed = dict(zip(self.sequences.rows.active, self.sequences.lengths)).get(row)
        if committed is None or self.prompt_length + forbidden >= committed:
            return
        raise ValueError(
            f"Row {row} committed token {tokens[forbidden]}, which its grammar does not allow there: the target's "
            "processed scores left no token the grammar allows (another processor forbids them all: min_new_tokens "
            f"or suppress_tokens against a grammar that must end, say). {self.matchers[row].plain_on_forbidden}"
        )

    def _matcher_at(self, row: int, tokens: list[int]) -> tuple[RowMatcher, int | None]:
        """The row's matcher moved to the state plain's processor is in after `tokens`: rolled back to what it shares
        with them, then each further token accepted in turn until plain's processor stops (`Step.FINAL`); a
        forbidden token ends the walk where it stands, and its index comes back (None: none)."""
        matcher = self.matchers.get(row)
        if matcher is None:
            matcher = self.matchers[row] = self.new_matcher(row)
            self.accepted[row] = []
        held = self.accepted[row]
        common = 0
        for have, want in zip(held, tokens):
            if have != want:
                break
            common += 1
        if len(held) > common:
            matcher.rollback(len(held) - common)
            del held[common:]
        for token in tokens[common:]:
            step = matcher.accept(token)
            if step is Step.FORBIDDEN:
                return matcher, len(held)
            if step is Step.FINAL:
                break
            held.append(token)
        return matcher, None


class ReplayedProcessor(RowsProcessor):
    """A processor declared stateful, called as plain decoding calls it along each prefix (module docstring).

    Plain `generate()` calls it once per step, at prefixes of 0, 1, 2, ... generated tokens. Here each call at a
    prefix starts from a copy of the processor as it was after its call at the prefix one token shorter (`after`),
    and its own state afterwards is kept for the prefixes that extend it: a round's positions (a chain's, a tree's
    paths, the draft's) are called parents first, so every call sees exactly the state plain's would at that prefix.
    The verifier calls the round's positions after the draft did, in order, so the states a committed prefix leaves
    come from calls with the target's scores, as plain's do. The caller's object is copied once and never called.

    Called as ``replayed(ids, scores, caller_rows)`` by `PositionwiseProcessor`, with the group's prefixes of one row
    (`validation` refuses a batch): ids `(group, length)`, scores `(group, vocab)`.
    """

    def __init__(self, processor: Any, prompt_length: int):
        """
        Args:
            processor: the user's processor, declared stateful.
            prompt_length: columns of the prompt `generate()` was given (prefixes count generated tokens after it).
        """
        self.pristine = copy.deepcopy(processor)  # as before its first call
        self.prompt_length = prompt_length
        self.after: dict[tuple[int, ...], Any] = {}  # generated tokens -> the processor after its call there
        self.last_length = -1  # generated tokens of the last call's prefix

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, caller_rows: Sequence[int]) -> torch.Tensor:  # noqa: ARG002 (one row)
        """`(group, vocab)` scores, each row as the processor's call at its prefix in plain decoding returns them."""
        return torch.cat([self._at(ids[row : row + 1], scores[row : row + 1]) for row in range(ids.shape[0])])

    def _at(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """`(1, vocab)` the processor's output at the one prefix `ids` `(1, length)`."""
        generated = tuple(ids[0, self.prompt_length :].tolist())
        # A pass (the draft's, the verifier's) starts at the committed tokens, each of its calls at a prefix no
        # shorter than the call before: a call shorter than the last starts a new pass, and no later call needs a
        # prefix shorter than its parent (committed tokens only grow).
        if len(generated) < self.last_length:
            self.after = {key: state for key, state in self.after.items() if len(key) >= len(generated) - 1}
        self.last_length = len(generated)
        base = self.pristine if not generated else self.after.get(generated[:-1])
        if base is None:
            raise RuntimeError(
                "hf_specsample internal error: a replayed processor was called at a prefix before its parent prefix"
            )
        processor = copy.deepcopy(base)
        out = processor(ids, scores)
        self.after[generated] = processor
        return out
