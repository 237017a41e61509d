"""Stopping exactly where `generate()` would: criteria checked after every committed token, not once per round."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from transformers import StoppingCriteriaList


def first_stops(
    criteria: StoppingCriteriaList,
    tokens: torch.Tensor,
    lengths: Sequence[int],
    counts: Sequence[int],
) -> list[int | None]:
    """For each row, the number of new tokens after which a stopping criterion first fires, or None.

    Plain `generate()` evaluates `criteria(input_ids, scores)` after appending each token; this evaluates the same
    criteria on every prefix ``tokens[b, : lengths[b] + i]`` for ``i = 1 .. counts[b]``, calling them once per
    distinct prefix length with all rows that share it. `scores` is passed as None, as `generate()` does when
    scores are not returned.

    Args:
        criteria: the stopping criteria `generate()` prepared (max length, EOS, stop strings, user criteria).
        tokens: `(batch, capacity)` long buffer holding each row's new tokens after `lengths[b]`.
        lengths: per row, the committed length before the new tokens.
        counts: per row, the number of new tokens (>= 1).

    Returns:
        Per row, ``i`` in ``1 .. counts[b]`` if the criteria fire on the prefix ending at new token ``i``, else None.
    """
    stops: list[int | None] = [None] * len(lengths)
    if len(criteria) == 0:
        return stops
    groups: dict[int, list[int]] = defaultdict(list)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        for i in range(1, count + 1):
            groups[length + i].append(row)
    for prefix_length in sorted(groups):
        rows = [row for row in groups[prefix_length] if stops[row] is None]
        if not rows:
            continue
        index = torch.tensor(rows, device=tokens.device)
        fired = criteria(tokens[index, :prefix_length], None).tolist()
        for row, has_fired in zip(rows, fired):
            if has_fired:
                stops[row] = prefix_length - lengths[row]
    return stops
