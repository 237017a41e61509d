"""One grammar matcher per caller row, as each structured-generation library's own processor drives it in plain
decoding: the small interface `stateful.GrammarPrefixes` moves along prefixes (accept a token, roll back, the mask
of what the grammar allows next), and the table that says which processors have one (`matchers_for`).

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

    def __init__(self, words: torch.Tensor, beyond: float = INF):
        """
        Args:
            words: `(words,)` int32 bitmask (`cap_from_bitmask`), not written to afterwards.
            beyond: the cap of scores past ``32 * words`` tokens.
        """
        self.beyond = beyond
        self.width = 32 * words.shape[0]
        nonzero = words.nonzero().flatten()  # (words with a token allowed,): few where few tokens are allowed
        few = nonzero.shape[0] <= SPARSE // 32
        allowed = set_bits(words, nonzero) if few else None
        self.forced = int(allowed[0]) if allowed is not None and allowed.shape[0] == 1 else None
        if allowed is not None:
            self.kind, self.index = MaskKind.KEEP, allowed
        else:
            self.kind, self.index = MaskKind.CAP, cap_from_bitmask(words)
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
            out[self.width :] = scores[self.width :].clamp(max=self.beyond)

    def _fit(self, width: int, scores: torch.Tensor) -> torch.Tensor:
        """The index (or cap) for `(width,)` scores like `scores`, on their device (made once per width)."""
        key = (width, scores.device, scores.dtype)
        fitted = self.fitted.get(key)
        if fitted is None:
            if self.kind is MaskKind.CAP:
                cap = self.index[:width]
                if cap.shape[0] < width:
                    cap = torch.cat([cap, cap.new_full((width - cap.shape[0],), self.beyond)])
                fitted = cap.to(device=scores.device, dtype=scores.dtype)
            else:
                fitted = self.index[self.index < width].to(scores.device)
            self.fitted[key] = fitted
        return fitted


class RowMatcher:
    """A row's grammar state as its library's processor keeps it in plain decoding."""

    beyond = INF  # the cap of logits past the mask's own width (+inf: left as they are, as xgrammar's kernels do)

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


# (module, class name) of each processor driven here, exact class (a subclass may keep a state of its own) -> the
# factory of its rows' matchers, given the processor and the caller's batch size
DRIVEN: dict[tuple[str, str], Callable[[Any, int], Callable[[int], RowMatcher]]] = {
    ("xgrammar.contrib.hf", "LogitsProcessor"): xgrammar_rows,
}


DRIVEN_NAMES = ", ".join(f"{module}.{name}" for module, name in DRIVEN)


def is_driven(processor: Any) -> bool:
    """Whether `processor`'s class (exactly) has its matcher here."""
    kind = type(processor)
    return (kind.__module__, kind.__qualname__) in DRIVEN


def matchers_for(processor: Any, batch_size: int) -> Callable[[int], RowMatcher] | None:
    """Caller row -> a new `RowMatcher` for `processor`, or None where no adapter here drives its class."""
    kind = type(processor)
    factory = DRIVEN.get((kind.__module__, kind.__qualname__))
    return None if factory is None else factory(processor, batch_size)
