"""One grammar matcher per caller row, as each structured-generation library's own processor drives it in plain
decoding: the small interface `stateful.GrammarPrefixes` moves along prefixes (accept a token, roll back, the mask
of what the grammar allows next), and the table that says which processors have one (`DRIVEN`).

A library's processor keeps one matcher per row and, at each call of plain `generate()`, advances it by the row's
last token, then masks what the matcher forbids next. `RowMatcher` is that matcher behind three calls, so that the
prefix walk, the memo of masks, the forced-token test and the refusal of a forbidden committed token are written once
(`GrammarPrefixes`) for every library. A library's module is imported only when its processor is given.

A mask is a *cap* `(width,)` float32 over the logits: +inf where the token is allowed, -inf where it is forbidden;
``torch.minimum(scores, cap)`` leaves allowed scores as they are and sets forbidden ones to -inf, as the libraries'
kernels do (about 20x faster than xgrammar's CPU kernel on 152k logits, and made once per prefix, which a round's
draft and verifier share). A NaN score stays NaN where the grammar forbids it (the kernels write -inf): sampling from
a NaN distribution raises (`verify.rules.raise_if_nonfinite`), and a forbidden greedy token raises when committed.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from typing import Any

import torch

INF = float("inf")


class Step(enum.Enum):
    """What accepting one token did to a row's matcher."""

    ACCEPTED = "accepted"  # the matcher holds the token (rolled back with the others)
    FORBIDDEN = "forbidden"  # the grammar forbids it: the matcher is unchanged
    FINAL = "final"  # plain's processor stops here: this token and every later one leave state and mask unchanged


# byte value -> its 8 bits, lowest first: a bitmask's bytes looked up give its tokens in order (little-endian words:
# byte ``b`` of word ``w`` holds tokens ``32 w + 8 b ...``)
BYTE_BITS = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
BYTE_CAPS = BYTE_BITS.float().sub_(0.5).mul_(INF)  # 1 -> +inf, 0 -> -inf
BYTE_COUNTS = BYTE_BITS.sum(-1)
# masks whose allowed tokens lie in at most this many tokens' words are applied by index, not by a cap over the whole
# vocabulary (a JSON grammar's allow a few hundred tokens at a key, all but a few thousand in a string)
SPARSE = 8192


def cap_from_bitmask(words: torch.Tensor) -> torch.Tensor:
    """`(32 * words,)` float32 cap from a bitmask `(words,)` int32 (bit ``t % 32`` of word ``t // 32`` set: token
    ``t`` allowed), as xgrammar's and llguidance's kernels read one: one lookup per byte."""
    return torch.nn.functional.embedding(_bytes(words), BYTE_CAPS).flatten()


def set_bits(words: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """`(set,)` long: the tokens whose bits are set in a bitmask `(words,)` int32, ascending, given its `nonzero`
    `(n,)` long words (cost in proportion to them)."""
    bits = BYTE_BITS[_bytes(words[nonzero])].view(-1, 32)  # (nonzero words, 32)
    return (nonzero.unsqueeze(-1) * 32 + torch.arange(32))[bits.bool()]


def _bytes(words: torch.Tensor) -> torch.Tensor:
    return words.contiguous().view(torch.uint8).long()


class MaskKind(enum.Enum):
    """How a mask is applied (`GrammarMask`)."""

    KEEP = "keep"  # few tokens allowed: -inf everywhere, the allowed scores copied
    CAP = "cap"  # the elementwise minimum with a cap (module docstring)


class GrammarMask:
    """What plain's processor masks after one prefix, made once and applied to any number of score rows, as its
    library's kernel does: forbidden scores -inf, allowed ones as they are, scores past the mask's ``32 * words``
    tokens `beyond` (+inf: as they are; -inf: forbidden). Also the one token it allows (`forced`, None: several or
    none). A grammar's masks repeat (inside a string, after each key): `GrammarPrefixes` keeps one per content."""

    def __init__(self, words: torch.Tensor, beyond: float | None = INF):
        """
        Args:
            words: `(words,)` int32 bitmask (`cap_from_bitmask`), not written to afterwards.
            beyond: the cap of scores past ``32 * words`` tokens; None: scores that wide raise, as the library's
                processor does in plain decoding.
        """
        self.beyond = beyond
        self.width = 32 * words.shape[0]
        nonzero = words.nonzero().flatten()  # (words with a token allowed,): few where few tokens are allowed
        few = nonzero.shape[0] <= SPARSE // 32
        allowed = set_bits(words, nonzero) if few else None
        self.forced = int(allowed[0]) if allowed is not None and allowed.shape[0] == 1 else None
        if allowed is not None:
            self.kind, self.table = MaskKind.KEEP, allowed  # (allowed,) long: the tokens allowed
        else:
            self.kind, self.table = MaskKind.CAP, cap_from_bitmask(words)  # (32 * words,) float32: the cap
        self.fitted: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def write(self, scores: torch.Tensor, out: torch.Tensor) -> None:
        """Write the masked `(width,)` `scores` into `out` `(width,)` (another tensor)."""
        width = scores.shape[0]
        index = self._fit(width, scores)
        if self.kind is MaskKind.CAP:
            torch.minimum(scores, index, out=out)
            return
        out.fill_(-INF)
        out[index] = scores[index]
        if width > self.width:
            out[self.width :] = scores[self.width :].clamp(max=self._beyond(width))

    def _beyond(self, width: int) -> float:
        """The cap of scores past the mask, for `width` scores (raises where plain's processor fails on them)."""
        if self.beyond is not None:
            return self.beyond
        if width > self.width:
            raise ValueError(
                f"The model's logits ({width}) are wider than the grammar's bitmask ({self.width} tokens), which its "
                "processor refuses in plain generate() too: build the grammar's tokenizer vocabulary as wide as the "
                "model's logits (model.config.vocab_size)."
            )
        return -INF  # never read: no score lies past the mask

    def _fit(self, width: int, scores: torch.Tensor) -> torch.Tensor:
        """The index (or cap) for `(width,)` scores like `scores`, on their device (made once per width)."""
        key = (width, scores.device, scores.dtype)
        fitted = self.fitted.get(key)
        if fitted is None:
            beyond = self._beyond(width)
            if self.kind is MaskKind.CAP:
                cap = self.table[:width]
                if cap.shape[0] < width:
                    cap = torch.cat([cap, cap.new_full((width - cap.shape[0],), beyond)])
                fitted = cap.to(device=scores.device, dtype=scores.dtype)
            else:
                fitted = self.table[self.table < width].to(scores.device)
            self.fitted[key] = fitted
        return fitted


class RowMatcher:
    """A row's grammar state as its library's processor keeps it in plain decoding."""

    # the cap of logits past the mask's own width (+inf: left as they are, as xgrammar's kernels do; -inf:
    # forbidden; None: plain's processor fails on them)
    beyond: float | None = INF
    # what plain's processor does once a token its grammar forbids is committed (`GrammarPrefixes` raises there)
    plain_on_forbidden = "Plain generate() fails there too."

    def accept(self, token: int) -> Step:
        """Advance by `token` as plain's processor does when it is the row's last token."""
        raise NotImplementedError

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens (`Step.ACCEPTED` ones)."""
        raise NotImplementedError

    def bits(self) -> torch.Tensor:
        """`(words,)` int32 bitmask (`cap_from_bitmask`) of what plain's processor masks in the current state (a
        copy the matcher does not write again); logits past its ``32 * words`` tokens get `beyond`."""
        raise NotImplementedError


class XGrammarRow(RowMatcher):
    """An `xgrammar.GrammarMatcher` as xgrammar's transformers processor drives it: once the grammar has terminated,
    it accepts nothing and masks with the bitmask filled before the terminating token (it skips the fill)."""

    plain_on_forbidden = (
        "Plain generate() fails here too (xgrammar's processor asserts). Where the grammar's vocabulary is narrower "
        "than the model's logits, the logits past it are left as they are: build it with "
        "xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)."
    )

    def __init__(self, grammar: Any, vocab_size: int):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(grammar, max_rollback_tokens=-1)  # keep every token for rollback
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def accept(self, token: int) -> Step:
        if not self.matcher.accept_token(token):
            return Step.FORBIDDEN
        if self.matcher.is_terminated():  # plain accepts nothing after, its mask stays the one filled before
            self.matcher.rollback(1)
            return Step.FINAL
        return Step.ACCEPTED

    def rollback(self, count: int) -> None:
        self.matcher.rollback(count)

    def bits(self) -> torch.Tensor:
        self.bitmask.fill_(0)
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0].clone()


def xgrammar_rows(processor: Any, batch_size: int) -> Callable[[int], RowMatcher]:
    """Caller row -> a new matcher for `xgrammar.contrib.hf.LogitsProcessor` (one grammar, or one per row)."""
    grammars = list(processor.compiled_grammars)
    if len(grammars) > 1 and len(grammars) != batch_size:
        raise ValueError(
            f"xgrammar's LogitsProcessor holds {len(grammars)} grammars for a batch of {batch_size} rows: give "
            "one grammar, or one per row of the batch (num_return_sequences included)."
        )
    vocab_size = processor.full_vocab_size
    return lambda row: XGrammarRow(grammars[row if len(grammars) > 1 else 0], vocab_size)


class OutlinesXGrammarRow(XGrammarRow):
    """An `xgrammar.GrammarMatcher` as outlines' `XGrammarLogitsProcessor` drives it: as xgrammar's own processor
    (accepts and fills only until the grammar terminates), over a bitmask of the grammar's vocabulary, which xgrammar
    requires to be as many words as the logits'."""

    beyond = None  # logits a word or more wider than the grammar's vocabulary: its fill raises in plain decoding
    plain_on_forbidden = "Plain generate() fails here too (outlines' XGrammarLogitsProcessor raises RuntimeError)."


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """`(ceil(n / 32),)` int32 bitmask (`cap_from_bitmask`: bit ``t % 32`` of word ``t // 32``) of `allowed`
    `(n,)` bool."""
    padded = torch.zeros(-(-allowed.shape[0] // 32) * 32, dtype=torch.int64)
    padded[: allowed.shape[0]] = allowed.long()
    words = (padded.view(-1, 32) << torch.arange(32)).sum(-1)  # (words,) in [0, 2**32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class OutlinesCoreRow(RowMatcher):
    """An `outlines_core.Guide` as outlines' `OutlinesCoreLogitsProcessor` drives it: a token advances the guide
    unless the guide is in a final state that does not accept it (then the token changes nothing: outlines_core's
    final states do not accept EOS, which their mask allows); any other token it does not accept raises there. Its
    mask, written over the logits' width, forbids every token the guide does not allow, the logits past them too."""

    beyond = -INF
    plain_on_forbidden = "Plain generate() fails here too (outlines_core's Guide.advance raises ValueError)."

    def __init__(self, index: Any):
        from outlines_core import Guide

        self.index = index
        self.guide = Guide(index)
        self.history: list[tuple[int, bool]] = []  # per held token: (token, whether it advanced the guide)

    def accept(self, token: int) -> Step:
        advances = self.guide.accepts_tokens([token])
        if advances:
            self.guide.advance(token_id=token, return_tokens=False)
        elif not self.guide.is_finished():  # plain's processor calls advance, which raises
            return Step.FORBIDDEN
        self.history.append((token, advances))
        return Step.ACCEPTED

    def rollback(self, count: int) -> None:
        undone = self.history[len(self.history) - count :]
        del self.history[len(self.history) - count :]
        steps = sum(advanced for _, advanced in undone)
        if steps <= self.guide.get_allowed_rollback():
            self.guide.rollback_state(steps)
            return
        from outlines_core import Guide  # past the guide's rollback window: replay what is left

        self.guide = Guide(self.index)
        for token, advanced in self.history:
            if advanced:
                self.guide.advance(token_id=token, return_tokens=False)

    def bits(self) -> torch.Tensor:
        tokens = torch.tensor(self.guide.get_tokens(), dtype=torch.long)  # (allowed,)
        allowed = torch.zeros(int(tokens.max()) + 1 if tokens.numel() else 0, dtype=torch.bool)
        allowed[tokens] = True
        return pack_bits(allowed)


class LLGuidanceRow(RowMatcher):
    """An `llguidance.LLMatcher` as outlines' `LLGuidanceLogitsProcessor` drives it: every token consumed, the mask
    filled over the tokenizer's vocabulary (logits past it forbidden). A token the matcher rejects puts it into an
    error state that no rollback leaves; plain decoding warns and goes on from there, which is not reproduced:
    such a token is `Step.FORBIDDEN` (a draft's is rejected; a committed one raises)."""

    beyond = -INF
    plain_on_forbidden = (
        "Plain generate() would warn ('Error in LLMatcher') and go on from llguidance's error state, which "
        "hf_specsample does not reproduce: it raises instead of giving other text."
    )

    def __init__(self, tokenizer: Any, grammar: str):
        import llguidance
        import llguidance.torch

        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"llguidance refuses the grammar: {self.matcher.get_error()}")
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def accept(self, token: int) -> Step:
        if self.matcher.validate_tokens([token]) != 1:
            return Step.FORBIDDEN
        self.matcher.consume_token(token)
        return Step.ACCEPTED

    def rollback(self, count: int) -> None:
        self.matcher.rollback(count)

    def bits(self) -> torch.Tensor:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        return self.bitmask[0].clone()


class CfgMode(enum.Enum):
    """transformers-cfg's `execution_mode`."""

    FULL_MASK = "full_mask"  # the grammar's whole mask at every call
    SPECULATION = "speculation"  # the argmax alone where the grammar accepts it: the mask depends on the scores


class TransformersCfgRow(RowMatcher):
    """transformers-cfg's parsing state as its `GrammarConstrainedLogitsProcessor` keeps it (`full_mask` mode): each
    token advances it (`_update_state_with_token_id`, the processor's own step; a token outside the mask leaves a
    state that allows EOS only, as in plain decoding), the mask is `filter_vocab` over the tokenizer's vocabulary,
    logits past it forbidden. A token the step refuses (EOS where the grammar cannot end, anything after it has
    ended) raises there."""

    beyond = -INF
    plain_on_forbidden = (
        "Plain generate() fails here too (transformers-cfg raises ValueError: EOS where the grammar cannot end, "
        "or a token after it ended)."
    )

    def __init__(self, constraint: Any):
        self.constraint = constraint
        # the state after each held token, the current last (copied as plain's processor copies it)
        self.states = [copy.deepcopy(constraint.string_recognizer.get_initial_parsing_state())]

    def accept(self, token: int) -> Step:
        try:
            state = self.constraint._update_state_with_token_id(token, self.states[-1])
        except ValueError:
            return Step.FORBIDDEN
        self.states.append(state)
        return Step.ACCEPTED

    def rollback(self, count: int) -> None:
        del self.states[len(self.states) - count :]

    def bits(self) -> torch.Tensor:
        return pack_bits(self.constraint.filter_vocab(self.states[-1], torch.device("cpu")).cpu())


def outlines_xgrammar_rows(processor: Any, batch_size: int) -> Callable[[int], RowMatcher]:  # noqa: ARG001
    """Caller row -> a new matcher for outlines' `XGrammarLogitsProcessor` (one grammar for every row)."""
    grammar = processor.compiled_grammar
    vocab_size = grammar.tokenizer_info.vocab_size
    return lambda row: OutlinesXGrammarRow(grammar, vocab_size)


def outlines_core_rows(processor: Any, batch_size: int) -> Callable[[int], RowMatcher]:  # noqa: ARG001
    """Caller row -> a new matcher for outlines' `OutlinesCoreLogitsProcessor`."""
    return lambda row: OutlinesCoreRow(processor.index)


def llguidance_rows(processor: Any, batch_size: int) -> Callable[[int], RowMatcher]:  # noqa: ARG001
    """Caller row -> a new matcher for outlines' `LLGuidanceLogitsProcessor`."""
    LLGuidanceRow(processor.llg_tokenizer, processor.grammar)  # refuses a grammar llguidance rejects before any work
    return lambda row: LLGuidanceRow(processor.llg_tokenizer, processor.grammar)


def transformers_cfg_rows(processor: Any, batch_size: int) -> Callable[[int], RowMatcher]:  # noqa: ARG001
    """Caller row -> a new matcher for transformers-cfg's `GrammarConstrainedLogitsProcessor` in `full_mask` mode;
    the other mode, a grammar that starts inside the prompt, and a non-incremental constraint are refused."""
    from transformers_cfg.token_grammar_recognizer import IncrementalTokenRecognizer

    if CfgMode(processor.execution_mode) is not CfgMode.FULL_MASK:
        raise ValueError(
            f"transformers-cfg's execution_mode=\"{processor.execution_mode}\" masks by the scores' argmax, which "
            "differs between a draft's scores and the target's: pass execution_mode=\"full_mask\" (the same text, "
            "exactly) with draft_model=."
        )
    if processor.valid_token_start_idx is not None:
        raise ValueError(
            "transformers-cfg's valid_token_start_idx (a grammar that starts inside the prompt) is not driven with "
            "draft_model=: leave it None, or generate without draft_model=."
        )
    if type(processor.grammar_constraint) is not IncrementalTokenRecognizer:
        raise ValueError(
            f"transformers-cfg's {type(processor.grammar_constraint).__name__} is not driven with draft_model=: use "
            "IncrementalGrammarConstraint, or generate without draft_model=."
        )
    return lambda row: TransformersCfgRow(processor.grammar_constraint)


# (module, class name) of each processor driven here, exact class (a subclass may keep a state of its own) -> the
# factory of its rows' matchers, given the processor and the caller's batch size
DRIVEN: dict[tuple[str, str], Callable[[Any, int], Callable[[int], RowMatcher]]] = {
    ("xgrammar.contrib.hf", "LogitsProcessor"): xgrammar_rows,
    ("outlines.backends.xgrammar", "XGrammarLogitsProcessor"): outlines_xgrammar_rows,
    ("outlines.backends.outlines_core", "OutlinesCoreLogitsProcessor"): outlines_core_rows,
    ("outlines.backends.llguidance", "LLGuidanceLogitsProcessor"): llguidance_rows,
    ("transformers_cfg.generation.logits_process", "GrammarConstrainedLogitsProcessor"): transformers_cfg_rows,
}


DRIVEN_NAMES = ", ".join(f"{module}.{name}" for module, name in DRIVEN)
