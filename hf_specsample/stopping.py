"""Stopping exactly where `generate()` would: criteria checked after every committed token, not once per round.

Plain `generate()` evaluates `criteria(input_ids, scores)` after appending each token. A round commits several
tokens per row at once; `StopCheck` finds, per row, the first of them after which a criterion fires. It splits the
criteria once per call by what they read:

- `MaxLengthCriteria` reads the prefix's length only, and `MaxTimeCriteria` the clock: both are decided on the host;
- `EosTokenCriteria` reads the last token only: whether each of the round's tokens is an EOS id is computed on the
  device for all of them at once (`eos_flags`) and read with the round's one host sync (the accepted counts);
- any other criterion (stop strings, a user's) is called on every prefix, once per distinct prefix length, as
  `generate()` calls it: with the whole batch in the caller's row order (`CallerView`: finished rows padded, those
  stopped earlier in the round too, the scores so far where they are returned); the verdicts of the rows whose
  prefix that is are read from the device.

A user's criterion in a batch may keep state between calls or read other rows, as plain decoding allows: it must
then see every prefix length once, in order, with every active row at that length. So a batch with such a
criterion commits in lockstep (`lockstep`): each round, every row keeps as many tokens as the row that accepted
fewest (a prefix of what it accepted: exact, the cut depends on acceptance alone), and its rows never drift apart.
Transformers' `StopStringCriteria` reads each row's own tail and keeps no state: it needs no lockstep.

So a call with the default criteria syncs once per round, however many tokens it commits.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

from .core.devices import tensor_on
from .verify.rules import Verdict, raise_if_nonfinite

# A prefix length -> what plain `generate()` passes its stopping criteria after that many columns: `(batch, length)`
# input ids of every caller row, and its scores so far (a tuple of `(batch, vocab)`, or None).
# `ends`: active rows that stopped earlier in this round -> their final length (shown padded past it).
CallerView = Callable[[int, dict[int, int]], tuple[torch.Tensor, "tuple[torch.Tensor, ...] | None"]]


@dataclass(frozen=True)
class RoundRead:
    """What the host learns of a round, in its one read (`StopCheck.read_round`).

    Attributes:
        num_accepted: per row active in the round, the draft tokens it accepted.
        eos_flags: per row, `StopCheck.eos_flags`' row (K + 1 flags: the drafts, then the next token); None without
            an EOS criterion.
        streamed: where the round is streamed, row 0's K draft tokens then its recovered or bonus token; else None.
    """

    num_accepted: list[int]
    eos_flags: list[list[int]] | None
    streamed: list[int] | None


class StopCheck:
    """A call's stopping criteria, split once into what the host, one device read and per-prefix calls decide."""

    def __init__(self, criteria: StoppingCriteriaList, device: torch.device, batch_size: int):
        """
        Args:
            criteria: the stopping criteria `generate()` prepared (max length, EOS, stop strings, user criteria).
            device: the token buffer's device.
            batch_size: rows of the call (lockstep only matters to several).
        """
        # Exact types: a subclass may read more than the length, the clock or the last token.
        self.max_lengths = [c for c in criteria if type(c) is MaxLengthCriteria]
        self.timers = [c for c in criteria if type(c) is MaxTimeCriteria]
        eos = [c.eos_token_id.reshape(-1) for c in criteria if type(c) is EosTokenCriteria]
        self.eos_ids = torch.cat(eos).to(device) if eos else None  # (ids,) long
        known = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)
        self.others = StoppingCriteriaList([c for c in criteria if type(c) not in known])
        self.lockstep = batch_size > 1 and any(type(c) is not StopStringCriteria for c in self.others)

    def candidates(self, num_accepted: Sequence[int]) -> list[int]:
        """Per row, the new tokens this round may commit before any criterion is asked: its accepted draft tokens and
        the recovered or bonus token, or in `lockstep` the fewest of any row."""
        counts = [accepted + 1 for accepted in num_accepted]
        return [min(counts)] * len(counts) if self.lockstep else counts

    def eos_flags(self, draft_tokens: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor | None:
        """`(batch, K + 1)` long, 1 where the round's token at that offset is an EOS id: the K draft tokens, then the
        recovered or bonus token (which follows the accepted ones); None without an EOS criterion. Computed before
        the round's host sync, to be read with it.

        Args:
            draft_tokens: `(batch, K)` long, the proposal.
            next_tokens: `(batch,)` long, the verdict's recovered or bonus token.
        """
        if self.eos_ids is None:
            return None
        tokens = torch.cat([draft_tokens, next_tokens[:, None].to(draft_tokens.device)], dim=1)  # (batch, K + 1)
        return torch.isin(tokens, self.eos_ids.to(tokens.device)).long()

    def read_round(self, verdict: Verdict, stream: bool) -> RoundRead:
        """The round's one host sync: the accepted counts (raising where they carry a NaN/inf code, as plain sampling
        raises), with the EOS flags of the round's tokens and, when streaming, row 0's tokens travelling with them.

        Args:
            verdict: the round's verdict (its `accepted_tokens`: `(batch, K)`, the drafted path).
            stream: the round's tokens are streamed.
        """
        draft_tokens = verdict.accepted_tokens
        assert draft_tokens is not None  # the verifier sets a chain's to its tokens
        eos_flags = self.eos_flags(draft_tokens, verdict.next_tokens)  # (batch, K + 1) or None
        read = verdict.num_accepted[:, None]
        if eos_flags is not None:
            read = torch.cat([read, eos_flags.to(read.device)], dim=1)
        if stream:  # the row's new tokens travel with it: no read of their own
            read = torch.cat([read, draft_tokens.to(read.device), verdict.next_tokens[:, None].to(read.device)], 1)
        values = read.tolist()  # the round's one host sync
        num_accepted = [row[0] for row in values]
        raise_if_nonfinite(num_accepted)
        lookahead = draft_tokens.shape[1]
        flags = None if eos_flags is None else [row[1 : lookahead + 2] for row in values]
        streamed = values[0][-(lookahead + 1) :] if stream else None
        return RoundRead(num_accepted, flags, streamed)

    def first_stops(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        num_accepted: Sequence[int],
        counts: Sequence[int],
        eos_flags: Sequence[Sequence[int]] | None,
        callers: Sequence[int],
        view: CallerView,
    ) -> list[int | None]:
        """For each row, the number of new tokens after which a criterion first fires, or None.

        Row b's new tokens are the first `counts[b]` (`candidates`) of its `num_accepted[b]` accepted draft tokens
        and the recovered or bonus token after them, written in `tokens` after ``lengths[b]``.

        Args:
            tokens: `(batch, capacity)` long buffer.
            lengths: per row, the committed length before the new tokens.
            num_accepted: per row, the draft tokens accepted.
            counts: per row, the new tokens to check (`candidates`).
            eos_flags: `eos_flags`' rows as read on the host (None: no EOS criterion).
            callers: per active row, its row in the caller's batch.
            view: what the other criteria are called with at a prefix length.

        Returns:
            Per row, ``i`` in ``1 .. counts[b]`` if the criteria fire on the prefix ending at new token ``i``, else
            None.
        """
        stops: list[int | None] = [None] * len(lengths)
        timed_out = any(time.time() - c.initial_timestamp > c.max_time for c in self.timers)
        for row, (length, count, accepted) in enumerate(zip(lengths, counts, num_accepted)):
            fires = [1] if timed_out else []
            for criterion in self.max_lengths:  # fires once the prefix holds max_length tokens
                if length + count >= criterion.max_length:
                    fires.append(max(1, criterion.max_length - length))
                _warn_past_position_embeddings(criterion, tokens, length + count)
            if eos_flags is not None:
                flags = eos_flags[row]
                # new token i: an accepted draft token (flag i - 1) up to `accepted`, then the recovered / bonus one
                # (the last flag)
                hit = next((i for i in range(1, count + 1) if flags[i - 1 if i <= accepted else -1]), None)
                if hit is not None:
                    fires.append(hit)
            stops[row] = min(fires) if fires else None
        if len(self.others):
            limits = [stop if stop is not None else count for stop, count in zip(stops, counts)]
            for row, stop in enumerate(_prefix_stops(self.others, lengths, limits, stops, callers, view)):
                earlier = stops[row]
                if stop is not None and (earlier is None or stop < earlier):
                    stops[row] = stop
        return stops


def _warn_past_position_embeddings(criterion: MaxLengthCriteria, tokens: torch.Tensor, length: int) -> None:
    """What `MaxLengthCriteria` does besides its verdict: its one-time warning past the model's position embeddings."""
    limit = criterion.max_position_embeddings
    if limit is not None and length > limit and length < criterion.max_length:
        criterion(tokens[:1, :length], None)  # logs its warning (once); the verdict is the host's


def _prefix_stops(
    criteria: StoppingCriteriaList,
    lengths: Sequence[int],
    counts: Sequence[int],
    known: Sequence[int | None],
    callers: Sequence[int],
    view: CallerView,
) -> list[int | None]:
    """For each active row, the first ``i`` in ``1 .. counts[b]`` at which `criteria` fire on its prefix of
    ``lengths[b] + i`` columns, or None. Called once per distinct prefix length with the whole batch, as `generate()`
    calls them (`view`; row indices are the caller's; a row that stopped before that length, by `known` stops or
    these criteria, shown padded past its end), reading the verdicts of the rows whose prefix it is."""
    stops: list[int | None] = [None] * len(lengths)
    groups: dict[int, list[int]] = defaultdict(list)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        for i in range(1, count + 1):
            groups[length + i].append(row)
    for prefix_length in sorted(groups):
        rows = [row for row in groups[prefix_length] if stops[row] is None]
        if not rows:
            continue
        # rows that stopped before this length (these criteria's stop comes first: they are asked up to `known`)
        ends = {row: lengths[row] + stop for row, stop in enumerate(map(_either, stops, known)) if stop is not None}
        ends = {row: end for row, end in ends.items() if end < prefix_length}
        input_ids, scores = view(prefix_length, ends)
        fired = criteria(input_ids, scores)  # (batch,) bool
        for row, has_fired in zip(rows, fired[tensor_on([callers[row] for row in rows], fired.device)].tolist()):
            if has_fired:
                stops[row] = prefix_length - lengths[row]
    return stops


def _either(first: int | None, second: int | None) -> int | None:
    return first if first is not None else second
