"""Stopping exactly where `generate()` would: criteria checked after every committed token, not once per round.

Plain `generate()` evaluates `criteria(input_ids, scores)` after appending each token. A round commits several
tokens per row at once; `StopCheck` finds, per row, the first of them after which a criterion fires. It splits the
criteria once per call by what they read:

- `MaxLengthCriteria` reads the prefix's length only, and `MaxTimeCriteria` the clock: both are decided on the host;
- `EosTokenCriteria` reads the last token only: whether each of the round's tokens is an EOS id is computed on the
  device for all of them at once (`eos_flags`) and read with the round's one host sync (the accepted counts);
- any other criterion (stop strings, a user's) is called on every prefix, once per distinct prefix length, as
  `generate()` calls it: with the whole batch in the caller's row order (`CallerView`: finished rows padded, the
  scores so far where they are returned); the verdicts of the rows whose prefix that is are read from the device.

So a call with the default criteria syncs once per round, however many tokens it commits.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from ..devices import tensor_on

# A prefix length -> what plain `generate()` passes its stopping criteria after that many columns: `(batch, length)`
# input ids of every caller row, and its scores so far (a tuple of `(batch, vocab)`, or None).
CallerView = Callable[[int], tuple[torch.Tensor, "tuple[torch.Tensor, ...] | None"]]


class StopCheck:
    """A call's stopping criteria, split once into what the host, one device read and per-prefix calls decide."""

    def __init__(self, criteria: StoppingCriteriaList, device: torch.device):
        """
        Args:
            criteria: the stopping criteria `generate()` prepared (max length, EOS, stop strings, user criteria).
            device: the token buffer's device.
        """
        # Exact types: a subclass may read more than the length, the clock or the last token.
        self.max_lengths = [c for c in criteria if type(c) is MaxLengthCriteria]
        self.timers = [c for c in criteria if type(c) is MaxTimeCriteria]
        eos = [c.eos_token_id.reshape(-1) for c in criteria if type(c) is EosTokenCriteria]
        self.eos_ids = torch.cat(eos).to(device) if eos else None  # (ids,) long
        known = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)
        self.others = StoppingCriteriaList([c for c in criteria if type(c) not in known])

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

    def first_stops(
        self,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        num_accepted: Sequence[int],
        eos_flags: Sequence[Sequence[int]] | None,
        callers: Sequence[int],
        view: CallerView,
    ) -> list[int | None]:
        """For each row, the number of new tokens after which a criterion first fires, or None.

        Row b's new tokens are its `num_accepted[b]` accepted draft tokens and the recovered or bonus token after
        them, written in `tokens` after ``lengths[b]``.

        Args:
            tokens: `(batch, capacity)` long buffer.
            lengths: per row, the committed length before the new tokens.
            num_accepted: per row, the draft tokens accepted.
            eos_flags: `eos_flags`' rows as read on the host (None: no EOS criterion).
            callers: per active row, its row in the caller's batch.
            view: what the other criteria are called with at a prefix length.

        Returns:
            Per row, ``i`` in ``1 .. num_accepted[b] + 1`` if the criteria fire on the prefix ending at new token
            ``i``, else None.
        """
        counts = [accepted + 1 for accepted in num_accepted]
        stops: list[int | None] = [None] * len(lengths)
        timed_out = any(time.time() - c.initial_timestamp > c.max_time for c in self.timers)
        for row, (length, count) in enumerate(zip(lengths, counts)):
            candidates = [1] if timed_out else []
            for criterion in self.max_lengths:  # fires once the prefix holds max_length tokens
                if length + count >= criterion.max_length:
                    candidates.append(max(1, criterion.max_length - length))
                _warn_past_position_embeddings(criterion, tokens, length + count)
            if eos_flags is not None:
                flags = eos_flags[row]
                # the accepted draft tokens, then the recovered / bonus token (its flag is the last one)
                hit = next((i + 1 for i in range(count - 1) if flags[i]), None)
                if hit is None and flags[-1]:
                    hit = count
                if hit is not None:
                    candidates.append(hit)
            stops[row] = min(candidates) if candidates else None
        if len(self.others):
            limits = [stop if stop is not None else count for stop, count in zip(stops, counts)]
            for row, stop in enumerate(_prefix_stops(self.others, lengths, limits, callers, view)):
                if stop is not None and (stops[row] is None or stop < stops[row]):
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
    callers: Sequence[int],
    view: CallerView,
) -> list[int | None]:
    """For each active row, the first ``i`` in ``1 .. counts[b]`` at which `criteria` fire on its prefix of
    ``lengths[b] + i`` columns, or None. Called once per distinct prefix length with the whole batch, as `generate()`
    calls them (`view`; row indices are the caller's), reading the verdicts of the rows whose prefix it is."""
    stops: list[int | None] = [None] * len(lengths)
    groups: dict[int, list[int]] = defaultdict(list)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        for i in range(1, count + 1):
            groups[length + i].append(row)
    for prefix_length in sorted(groups):
        rows = [row for row in groups[prefix_length] if stops[row] is None]
        if not rows:
            continue
        input_ids, scores = view(prefix_length)
        fired = criteria(input_ids, scores)  # (batch,) bool
        for row, has_fired in zip(rows, fired[tensor_on([callers[row] for row in rows], fired.device)].tolist()):
            if has_fired:
                stops[row] = prefix_length - lengths[row]
    return stops
