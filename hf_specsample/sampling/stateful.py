"""Logits processors that keep a state across calls, made exact under speculation: xgrammar's (`GrammarPrefixes`),
those a user declares stateful (`ReplayedProcessor`), and a refusal for the rest that are known to keep state.

Structured-output processors (xgrammar, outlines, llguidance, transformers-cfg, lm-format-enforcer) keep a matcher
per row that each call advances by the last token of `input_ids`: plain `generate()` calls them once per step, with a
prefix one token longer each time. A speculative round calls its processors at K + 1 positions (and along each path
of a tree) whose prefixes end in draft tokens that may be rejected, so such a processor, called as given, would
accept tokens that are never committed (xgrammar's asserts; others give other text than plain's, silently).

`GrammarPrefixes` makes xgrammar's `xgrammar.contrib.hf.LogitsProcessor` a pure function of each row's prefix: one
`GrammarMatcher` per caller row, moved to each prefix asked for by rolling back to the tokens it shares with the
matcher's and accepting the rest (xgrammar keeps every accepted token for rollback, `max_rollback_tokens=-1`), then
the mask of what the grammar allows next, exactly as the processor fills it in plain decoding (also where the
grammar has terminated: the last mask filled before). A prefix holding a token the grammar forbids (a draft token
that is rejected with probability one, since the target's processed probability of it is 0) keeps the mask of its
last allowed prefix, so no position is ever all -inf. The user's processor object is read (its grammars), never
advanced.

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
from collections.abc import Sequence
from typing import Any

import torch

from ..core.sequences import Sequences

# Top-level modules of structured-generation libraries whose processors keep a state per row that a speculative
# round would advance with draft tokens, and which no adapter here drives yet.
STATEFUL_LIBRARIES = {
    "xgrammar": "xgrammar",  # its processor itself is driven (`GrammarPrefixes`); any other of its classes is not
    "outlines": "outlines",
    "outlines_core": "outlines",
    "llguidance": "llguidance",
    "transformers_cfg": "transformers-cfg",
    "lmformatenforcer": "lm-format-enforcer",
}
XGRAMMAR_HF_PROCESSOR = ("xgrammar.contrib.hf", "LogitsProcessor")


def is_xgrammar_processor(processor: Any) -> bool:
    """Whether `processor` is xgrammar's transformers processor (`xgrammar.contrib.hf.LogitsProcessor`), by exact
    class (a subclass may keep a state of its own)."""
    kind = type(processor)
    return (kind.__module__, kind.__qualname__) == XGRAMMAR_HF_PROCESSOR


def check_stateful(processors: Sequence[Any], declared: tuple[type, ...] = ()) -> None:
    """Refuse, before any work, a processor of a structured-generation library whose per-row state no adapter here
    drives (it would be advanced by draft tokens), unless its class is `declared` stateful (then replayed)."""
    for processor in processors:
        if isinstance(processor, declared) or is_xgrammar_processor(processor):
            continue
        # the class or any class it derives from (a user's subclass of a library's processor keeps its state too)
        roots = [kind.__module__.split(".")[0] for kind in type(processor).__mro__]
        library = next((STATEFUL_LIBRARIES[root] for root in roots if root in STATEFUL_LIBRARIES), None)
        if library is not None:
            raise ValueError(
                f"{type(processor).__name__} ({library}) keeps a grammar state per row that each call advances by the "
                "last token; a speculative round calls processors at draft positions that may be rejected, which "
                "would advance it past what is committed. hf_specsample drives xgrammar's processor exactly "
                "(xgrammar.contrib.hf.LogitsProcessor itself, not a subclass, docs/structured_output.md): use it for "
                "structured output with "
                "draft_model=; or declare this processor's class stateful (SpeculativeConfig(stateful_processors="
                f"({type(processor).__name__},)), one row per call, replayed: exact and slower); or generate without "
                "draft_model= for this processor."
            )


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
    """The processor a call applies in place of `processor`: xgrammar's driven by prefix (`GrammarPrefixes`), one of
    a class `declared` stateful replayed (`ReplayedProcessor`), any other as given. `prompt_length`: the prompt's
    columns, where their state starts (needed only for those two)."""
    xgrammar, replayed = is_xgrammar_processor(processor), isinstance(processor, declared)
    if not (xgrammar or replayed):
        return processor
    if prompt_length is None:
        raise ValueError("hf_specsample internal error: a stateful processor needs the call's prompt length")
    if xgrammar:
        return GrammarPrefixes(processor, prompt_length, batch_size, sequences)
    return ReplayedProcessor(processor, prompt_length)


class GrammarPrefixes(RowsProcessor):
    """xgrammar's transformers processor as a pure function of each row's prefix (module docstring).

    Called as ``adapter(ids, scores, caller_rows)`` by `sampling.processing.PositionwiseProcessor` with the rows of
    one prefix length (`_by_prefix_length`): ids `(group, length)`, scores `(group, vocab)`, and each row's caller row,
    which picks its grammar and matcher.
    """

    def __init__(self, processor: Any, prompt_length: int, batch_size: int, sequences: Sequences | None = None):
        """
        Args:
            processor: an `xgrammar.contrib.hf.LogitsProcessor` (its compiled grammars: one, or one per row).
            prompt_length: columns of the prompt `generate()` was given: the grammar starts after them.
            batch_size: rows of the caller's batch (`num_return_sequences` included).
            sequences: the call's rows, whose committed lengths say which tokens of a prefix are committed (a
                committed token the grammar forbids raises, as plain's processor does); None: not checked.
        """
        import xgrammar

        self.xgrammar = xgrammar
        grammars = list(processor.compiled_grammars)
        if len(grammars) > 1 and len(grammars) != batch_size:
            raise ValueError(
                f"xgrammar's LogitsProcessor holds {len(grammars)} grammars for a batch of {batch_size} rows: give "
                "one grammar, or one per row of the batch (num_return_sequences included)."
            )
        self.grammars = grammars if len(grammars) > 1 else grammars * batch_size
        self.vocab_size = processor.full_vocab_size
        self.prompt_length, self.sequences = prompt_length, sequences
        self.matchers: dict[int, Any] = {}  # caller row -> its GrammarMatcher
        self.accepted: dict[int, list[int]] = {}  # caller row -> the tokens its matcher holds, in order
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        # (caller row, generated tokens) -> its mask and the index of a token the grammar forbids (None: none): the
        # verifier asks again at the prefixes the draft asked at
        self.masks: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, int | None]] = {}
        self.last_length = -1  # generated tokens of the last prefix asked

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, caller_rows: Sequence[int]) -> torch.Tensor:
        """`(group, vocab)` scores with what each row's grammar forbids after its prefix at -inf, as plain's call
        at that prefix would mask them."""
        generated = ids[:, self.prompt_length :].tolist()  # one host read per group: the grammar reads token ids
        masks = torch.stack([self._mask(row, tokens) for row, tokens in zip(caller_rows, generated)])
        # xgrammar masks in place on CUDA or the CPU (plain's processor moves other devices' scores to the CPU)
        out = scores.clone() if scores.device.type in ("cuda", "cpu") else scores.to("cpu")
        self.xgrammar.apply_token_bitmask_inplace(out, masks.to(out.device))
        return out.to(scores.device)

    def forced(self, row: int, tokens: list[int]) -> int | None:
        """The one token the row's grammar allows after `tokens` (its generated tokens), or None where it allows
        several (or none)."""
        mask = self._mask(row, tokens)
        words = mask.nonzero().flatten()
        if words.numel() != 1:
            return None
        word = int(mask[words[0]]) & 0xFFFFFFFF  # the bits of one int32 word, token 32 * word + bit allowed
        if word & (word - 1):
            return None
        token = 32 * int(words[0]) + word.bit_length() - 1
        return token if token < self.vocab_size else None

    def _mask(self, row: int, tokens: list[int]) -> torch.Tensor:
        """`(words,)` int32: the bitmask plain's processor applies after `tokens` (the row's generated tokens), made
        once per prefix: a round's draft and verifier ask at the same prefixes."""
        if len(tokens) < self.last_length:  # a new pass starts at committed tokens: no shorter prefix is asked again
            self.masks = {key: mask for key, mask in self.masks.items() if len(key[1]) >= len(tokens)}
        self.last_length = len(tokens)
        key = (row, tuple(tokens))
        made = self.masks.get(key)
        if made is None:
            matcher, forbidden = self._matcher_at(row, tokens)
            self.bitmask.fill_(0)
            matcher.fill_next_token_bitmask(self.bitmask, 0)
            made = self.masks[key] = (self.bitmask[0].clone(), forbidden)
        mask, forbidden = made
        if forbidden is not None:
            self._refuse_if_committed(row, tokens, forbidden)
        return mask

    def _refuse_if_committed(self, row: int, tokens: list[int], forbidden: int) -> None:
        """Raise where the grammar forbids a committed token (``tokens[forbidden]``), as plain's processor does
        (xgrammar's `accept_token` assertion) at its next call; a forbidden draft token is rejected with certainty."""
        if self.sequences is None:
            return
        committed = dict(zip(self.sequences.rows.active, self.sequences.lengths)).get(row)
        if committed is None or self.prompt_length + forbidden >= committed:
            return
        raise ValueError(
            f"Row {row} committed token {tokens[forbidden]}, which its grammar does not allow there: the target's "
            "processed scores left no token the grammar allows (another processor forbids them all: min_new_tokens "
            "or suppress_tokens against a grammar that must end, say), or the grammar's vocabulary is narrower than "
            "the model's logits (xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config."
            "vocab_size)). Plain generate() fails here too (xgrammar's processor asserts)."
        )

    def _matcher_at(self, row: int, tokens: list[int]) -> tuple[Any, int | None]:
        """The row's matcher moved to the state plain's processor is in after `tokens`: each accepted in turn until
        the grammar terminates (plain accepts nothing after), the terminating one not counted (plain's mask then
        stays the one filled before it); a forbidden token ends the walk where it stands, and its index comes back
        (None: none)."""
        matcher = self.matchers.get(row)
        if matcher is None:
            matcher = self.xgrammar.GrammarMatcher(self.grammars[row], max_rollback_tokens=-1)
            self.matchers[row], self.accepted[row] = matcher, []
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
            if not matcher.accept_token(token):
                return matcher, len(held)
            held.append(token)
            if matcher.is_terminated():  # plain's mask stays the one filled before this token
                matcher.rollback(1)
                held.pop()
                break
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
