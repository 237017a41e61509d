"""Logits processors that keep a grammar's state per row, made exact under speculation.

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

Processors of the other libraries, whose state we do not drive yet, are refused before any work (`check_stateful`),
saying what to use instead. A processor the library does not know is taken to be a function of its prefix, as
transformers' own are (docs/structured_output.md says what that means for a user's processor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Top-level modules of structured-generation libraries whose processors keep a state per row that a speculative
# round would advance with draft tokens, and which no adapter here drives yet.
STATEFUL_LIBRARIES = {
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


def check_stateful(processors: Sequence[Any]) -> None:
    """Refuse, before any work, a processor of a structured-generation library whose per-row state no adapter here
    drives (it would be advanced by draft tokens)."""
    for processor in processors:
        root = type(processor).__module__.split(".")[0]
        library = STATEFUL_LIBRARIES.get(root)
        if library is not None:
            raise ValueError(
                f"{type(processor).__name__} ({library}) keeps a grammar state per row that each call advances by the "
                "last token; a speculative round calls processors at draft positions that may be rejected, which "
                "would advance it past what is committed. hf_specsample drives xgrammar's processor exactly "
                "(xgrammar.contrib.hf.LogitsProcessor, docs/structured_output.md): use it for structured output with "
                "draft_model=, or generate without draft_model= for this processor."
            )


class GrammarPrefixes:
    """xgrammar's transformers processor as a pure function of each row's prefix (module docstring).

    Called as ``adapter(ids, scores, caller_rows)`` by `sampling.processing.PositionwiseProcessor` with the rows of
    one prefix length (`_by_prefix_length`): ids `(group, length)`, scores `(group, vocab)`, and each row's caller row,
    which picks its grammar and matcher.
    """

    def __init__(self, processor: Any, prompt_length: int, batch_size: int):
        """
        Args:
            processor: an `xgrammar.contrib.hf.LogitsProcessor` (its compiled grammars: one, or one per row).
            prompt_length: columns of the prompt `generate()` was given: the grammar starts after them.
            batch_size: rows of the caller's batch (`num_return_sequences` included).
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
        self.prompt_length = prompt_length
        self.matchers: dict[int, Any] = {}  # caller row -> its GrammarMatcher
        self.accepted: dict[int, list[int]] = {}  # caller row -> the tokens its matcher holds, in order
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, caller_rows: Sequence[int]) -> torch.Tensor:
        """`(group, vocab)` scores with what each row's grammar forbids after its prefix at -inf, as plain's call
        at that prefix would mask them."""
        generated = ids[:, self.prompt_length :].tolist()  # one host read per group: the grammar reads token ids
        masks = torch.stack([self._mask(row, tokens) for row, tokens in zip(caller_rows, generated)])
        # xgrammar masks in place on CUDA or the CPU (plain's processor moves other devices' scores to the CPU)
        out = scores.clone() if scores.device.type in ("cuda", "cpu") else scores.to("cpu")
        self.xgrammar.apply_token_bitmask_inplace(out, masks.to(out.device))
        return out.to(scores.device)

    def _mask(self, row: int, tokens: list[int]) -> torch.Tensor:
        """`(words,)` int32: the bitmask plain's processor applies after `tokens` (the row's generated tokens)."""
        matcher = self._matcher_at(row, tokens)
        self.bitmask.fill_(0)
        matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0].clone()

    def _matcher_at(self, row: int, tokens: list[int]) -> Any:
        """The row's matcher moved to the state plain's processor is in after `tokens`: each accepted in turn until
        the grammar terminates (plain accepts nothing after), the terminating one not counted (plain's mask then
        stays the one filled before it); a forbidden token ends the walk where it stands."""
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
                break
            held.append(token)
            if matcher.is_terminated():  # plain's mask stays the one filled before this token
                matcher.rollback(1)
                held.pop()
                break
        return matcher
