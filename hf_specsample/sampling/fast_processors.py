"""Exact, sort-free replacements for transformers' logits warpers that sort the whole vocabulary.

`TopPLogitsWarper` and `TypicalLogitsWarper` sort every row (151,936 entries for Qwen2.5): about 15 ms per position
on a 2-core CPU, where `torch.topk(scores, 64)` takes 0.4 ms. The tokens they keep are almost always among the
first few dozen of their order, so `fast_top_p` and `fast_typical` decide from the first candidates of that order
and hand a row to transformers' own warper whenever the candidates cannot settle it exactly.

What "exact" means here: the tokens kept are the ones transformers keeps, and kept scores are untouched, so the
output tensor is identical. transformers removes the token at ascending-sort position ``i`` when the float32
cumulative probability up to ``i`` is ``<= 1 - top_p``. In descending order that is: keep rank ``r`` while the
probability mass strictly above it is ``< top_p``. The fast path computes that mass in float64 from the
candidates and the row's log-normaliser. transformers' float32 sum can drift from the exact sum (up to about 1e-6
was measured over 151,936 entries), so a row whose boundary lies within `BOUNDARY_MARGIN` of ``top_p``, or whose
boundary falls between tied scores (transformers' sort order then decides), goes to the original warper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.generation import logits_process as lp

CANDIDATES = (64, 1024)  # top-k sizes tried in turn before the full sort (topk(64) of 152k: 0.4-0.75 ms on CPU)
BOUNDARY_MARGIN = 1e-4  # mass distance from top_p under which a row is left to transformers (~100x the drift seen)


def top_p_keep_counts(
    candidate_scores: torch.Tensor, log_normalizer: torch.Tensor, top_p: float, min_tokens_to_keep: int
) -> torch.Tensor:
    """How many of the descending candidates transformers' top-p keeps per row, or -1 where they cannot tell.

    Args:
        candidate_scores: `(rows, k)` the row's k largest scores, descending (`torch.topk(..., sorted=True)`).
        log_normalizer: `(rows,)` logsumexp of each whole row.
        top_p: the nucleus mass.
        min_tokens_to_keep: as in `TopPLogitsWarper`.

    Returns:
        `(rows,)` long: the number of leading candidates kept, or -1 where the boundary lies beyond the candidates,
        within `BOUNDARY_MARGIN` of `top_p`, or between equal scores.
    """
    k = candidate_scores.shape[1]
    scores = candidate_scores.double()
    probs = torch.exp(scores - log_normalizer.double()[:, None])  # (rows, k)
    above = torch.cumsum(probs, dim=-1) - probs  # (rows, k) mass strictly above each rank
    kept = (above < top_p).sum(dim=-1)  # (rows,) ranks kept by the nucleus rule (a prefix: `above` grows)
    settled = kept < k  # the first removed rank is a candidate
    first_out = kept.clamp(max=k - 1)
    last_in = (kept - 1).clamp(min=0)
    distance = torch.minimum(
        (above.gather(1, first_out[:, None]).squeeze(1) - top_p).abs(),
        (above.gather(1, last_in[:, None]).squeeze(1) - top_p).abs(),
    )
    settled &= distance > BOUNDARY_MARGIN
    kept = kept.clamp(min=min_tokens_to_keep)
    settled &= kept < k
    # A tie across the boundary: which of the equal scores transformers' sort puts first decides.
    at = kept.clamp(max=k - 1)
    settled &= scores.gather(1, (at - 1).clamp(min=0)[:, None]).squeeze(1) != scores.gather(1, at[:, None]).squeeze(1)
    settled &= torch.isfinite(log_normalizer) & ~torch.isnan(scores).any(dim=-1)
    return torch.where(settled, kept, torch.full_like(kept, -1))


def fast_top_p(warper: lp.TopPLogitsWarper, scores: torch.Tensor) -> torch.Tensor:
    """`warper(input_ids, scores)` without sorting the vocabulary where the top candidates settle it.

    Args:
        warper: a `TopPLogitsWarper` (its `top_p`, `min_tokens_to_keep`, `filter_value`).
        scores: `(rows, vocab)` float scores.

    Returns:
        `(rows, vocab)`: identical to ``warper(input_ids, scores)``.
    """
    rows, vocab = scores.shape
    out = scores.new_full((rows, vocab), warper.filter_value)
    log_normalizer = torch.logsumexp(scores, dim=-1)  # (rows,)
    pending = None  # rows not settled yet (None: all of them, without copying `scores`)
    for size in CANDIDATES:
        if size >= vocab:
            break
        part = scores if pending is None else scores[pending]
        values, indices = torch.topk(part, size, dim=-1)  # (part, size), descending
        normalizer = log_normalizer if pending is None else log_normalizer[pending]
        counts = top_p_keep_counts(values, normalizer, warper.top_p, warper.min_tokens_to_keep)  # (part,)
        keep = torch.arange(size, device=scores.device)[None, :] < counts[:, None]  # (part, size)
        filled = torch.where(keep, values, torch.full_like(values, warper.filter_value))
        done = counts >= 0
        if pending is None and bool(done.all()):  # the common case: every row settled, no row copies
            return out.scatter_(1, indices, filled)
        part_rows = torch.arange(rows, device=scores.device) if pending is None else pending
        settled = part_rows[done]
        out[settled] = out[settled].scatter_(1, indices[done], filled[done])
        pending = part_rows[~done]
        if pending.numel() == 0:
            return out
    pending = torch.arange(rows, device=scores.device) if pending is None else pending
    no_prefix = torch.empty((pending.numel(), 0), dtype=torch.long, device=scores.device)
    out[pending] = warper(no_prefix, scores[pending])
    return out


def typical_thresholds(
    candidate_shifts: torch.Tensor,
    candidate_scores: torch.Tensor,
    log_normalizer: torch.Tensor,
    mass: float,
    min_tokens_to_keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shifted-score threshold of transformers' typical sampling per row, where the candidates settle it.

    transformers sorts a row by its shifted score ``|-log p - H|`` (ascending), takes ``last``, the number of sorted
    positions whose float32 cumulative probability is ``< mass``, and removes every token whose shifted score is
    greater than the one at sorted position ``last``. Equal shifted scores may be sorted in any order, but the
    threshold is the same in every order: the crossing of ``mass`` always falls in the same group of equal scores.

    Args:
        candidate_shifts: `(rows, k)` the row's k smallest shifted scores, ascending.
        candidate_scores: `(rows, k)` the scores of the same tokens.
        log_normalizer: `(rows,)` logsumexp of each whole row.
        mass: the warper's `mass`.
        min_tokens_to_keep: as in `TypicalLogitsWarper`.

    Returns:
        `(rows,)` thresholds (the shifted score at position ``last``), and `(rows,)` bool: settled, i.e. ``last``
        lies among the candidates, the cumulative mass on both sides of it is more than `BOUNDARY_MARGIN` from
        `mass`, and `min_tokens_to_keep` adds no token.
    """
    k = candidate_shifts.shape[1]
    probs = torch.exp(candidate_scores.double() - log_normalizer.double()[:, None])  # (rows, k)
    cumulative = torch.cumsum(probs, dim=-1)  # (rows, k)
    last = (cumulative < mass).sum(dim=-1)  # (rows,) first position whose cumulative mass reaches `mass`
    at = last.clamp(max=k - 1)
    before = (at - 1).clamp(min=0)
    settled = last < k
    settled &= (cumulative.gather(1, at[:, None]).squeeze(1) - mass).abs() > BOUNDARY_MARGIN
    settled &= (last == 0) | ((cumulative.gather(1, before[:, None]).squeeze(1) - mass).abs() > BOUNDARY_MARGIN)
    settled &= last + 1 >= min_tokens_to_keep  # positions 0 .. last are kept anyway
    settled &= torch.isfinite(log_normalizer) & ~torch.isnan(candidate_scores).any(dim=-1)
    return candidate_shifts.gather(1, at[:, None]).squeeze(1), settled


def fast_typical(warper: lp.TypicalLogitsWarper, scores: torch.Tensor) -> torch.Tensor:
    """`warper(input_ids, scores)` without sorting the vocabulary where the first candidates settle it.

    The shifted scores are computed with exactly transformers' operations, so the threshold comparison is the same.

    Args:
        warper: a `TypicalLogitsWarper` (its `mass`, `min_tokens_to_keep`, `filter_value`).
        scores: `(rows, vocab)` float scores.

    Returns:
        `(rows, vocab)`: identical to ``warper(input_ids, scores)``.
    """
    rows, vocab = scores.shape
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    entropy = -(normalized * torch.exp(normalized)).nansum(-1, keepdim=True)  # (rows, 1)
    shifted = torch.abs((-normalized) - entropy)  # (rows, vocab), as transformers computes it
    log_normalizer = torch.logsumexp(scores, dim=-1)  # (rows,)
    clean = ~torch.isnan(shifted).any(dim=-1)  # (rows,)
    threshold = scores.new_zeros(rows, dtype=shifted.dtype)
    settled = torch.zeros(rows, dtype=torch.bool, device=scores.device)
    for size in CANDIDATES:
        if size >= vocab:
            break
        pending = (~settled & clean).nonzero().squeeze(1)  # (part,)
        if pending.numel() == 0:
            break
        negative, indices = torch.topk(-shifted[pending], size, dim=-1)  # (part, size): smallest shifts first
        found, done = typical_thresholds(
            -negative,
            scores[pending].gather(1, indices),
            log_normalizer[pending],
            warper.mass,
            warper.min_tokens_to_keep,
        )
        threshold[pending] = torch.where(done, found, threshold[pending])
        settled[pending] = done
    out = scores.masked_fill(settled[:, None] & (shifted > threshold[:, None]), warper.filter_value)
    rest = (~settled).nonzero().squeeze(1)
    if rest.numel():
        no_prefix = torch.empty((rest.numel(), 0), dtype=torch.long, device=scores.device)
        out[rest] = warper(no_prefix, scores[rest])
    return out


def fast_equivalent(processor: lp.LogitsProcessor):
    """A callable ``(scores) -> scores`` doing exactly what `processor` does, faster; None if there is none.

    Exact type only: a subclass may do something else. Only for scores on the CPU: deciding which rows the
    candidates settle needs the values on the host, and a GPU sorts a vocabulary in microseconds anyway.
    """
    fasts: dict[type, Callable[[Any, torch.Tensor], torch.Tensor]] = {
        lp.TopPLogitsWarper: fast_top_p,
        lp.TypicalLogitsWarper: fast_typical,
    }
    fast = fasts.get(type(processor))
    if fast is None:
        return None
    return lambda scores: (
        fast(processor, scores)
        if scores.device.type == "cpu"
        else processor(torch.empty((scores.shape[0], 0), dtype=torch.long, device=scores.device), scores)
    )
