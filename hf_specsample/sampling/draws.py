"""Draws and row chunks, as pure tensor functions: what drafters and verifiers both use.

A draw is made without a host sync, by the inverse CDF of one float64 uniform per row (`sample_from_weights`); greedy
takes the first maximal id (`first_argmax`), as plain `generate()`'s `argmax` does. A round's wide tensors are made
row chunk by row chunk (`row_chunks`, `round_chunks`) so that they never hold more than `ROW_CHUNK_ELEMENTS` at once.

**Keyed uniforms** (`keyed_uniforms`): keyed by (the call's key, a caller row, a buffer position), a counter-based
stream for tree calls.

With deterministic children every token a tree round commits is the target's own draw at its position
(`verify.rules`). A shared generator consumed in order would hand that draw whichever uniform comes next, which
depends on how many draws the rounds before it made: on the draft, the tree's shape, its truncation, K. Drawing the
token at buffer position t of caller row r with ``keyed_uniforms(key, r, t)`` instead makes it a function of the
call's key and the target's distribution at t alone, so a seeded call's text does not depend on the draft.

The key is one draw per sampling call from the call's generator (`call_key`; greedy calls draw nothing). A uniform
is a pure function of (key, row, position): two rounds of the splitmix64 finalizer (a bijection of 64-bit integers
with full avalanche) over the counter ``row * 2^32 + position``, each keyed by XOR, in torch int64 operations on the
tensors' device (multiplications wrap modulo 2^64; right shifts are made logical by masking the sign's copies off).
Its top 53 bits give a float64 in [0, 1), what `sample_uniform` gives `sample_from_weights`.
"""

from __future__ import annotations

import torch

# Row chunks of a round's wide tensors: at most this many elements of `(rows, [positions,] vocab)` at a time.
# Every tensor verification and sampling make from a distribution (processed scores, a warper's temporaries,
# probabilities, residuals, float64 running sums) is as large as what it came from; made for all rows at once they
# multiply a round's peak memory (4.5 GiB at 256 rows x 151,936 ids x K=4, against plain generate()'s 1.55).
# 2^24 elements (64 MiB of float32) keeps each such temporary below one row-step of plain's logits at a few hundred
# rows, while a chunk still holds tens of rows x positions (kernels stay wide, a few chunks per round).
ROW_CHUNK_ELEMENTS = 1 << 24


def row_chunks(rows: int, row_elements: int, limit: int) -> list[slice]:
    """Consecutive row slices covering ``0 .. rows - 1``, each of at most `limit` elements (at least one row).

    Args:
        rows: the rows to cover.
        row_elements: elements per row (positions x vocabulary).
        limit: the most elements of a chunk.
    """
    per_chunk = max(1, limit // max(1, row_elements))
    return [slice(start, min(start + per_chunk, rows)) for start in range(0, rows, per_chunk)]


def round_chunks(batch: int, positions: int, vocab: int, chunk_elements: int | None = None) -> list[slice]:
    """The row chunks a round's `(batch, positions, vocab)` logits are verified in: `row_chunks` of at most
    `chunk_elements` logits (None: `ROW_CHUNK_ELEMENTS`, read at each call, so that a test can force chunks)."""
    limit = ROW_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    return row_chunks(batch, positions * vocab, limit)


def sample_uniform(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """`(*shape, 1)` float64 uniforms in [0, 1), what `sample_from_weights` draws for `(*shape, vocab)` weights:
    drawn with `generator` (on its device), moved to `device`."""
    noise_device = generator.device if generator is not None else device
    # 53 random bits (a float32 uniform has 24: tokens below 2^-24 would be drawn off their probability)
    return torch.rand(shape + (1,), dtype=torch.float64, generator=generator, device=noise_device).to(device)


def sample_from_weights(
    weights: torch.Tensor,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights`, without a host sync.

    By the inverse CDF: one uniform ``u`` per row, and the first index whose float64 running sum of the weights
    reaches ``t = (1 - u)`` times the row's total. ``t`` lies in ``(0, total]`` (exactly: ``1 - u`` is exact for a
    53-bit ``u``, and a product never rounds past ``total``), so index ``i`` is drawn when ``t`` falls in
    ``(c_{i-1}, c_i]``, an interval of width ``w_i``; a zero weight leaves the running sum unchanged, so it is never
    drawn, and some index always qualifies (the last positive weight's sum is the total), unless the whole row is
    zero (then ``t = 0`` and index 0). One random number per row instead of one per entry: 0.18 ms against 2.6 ms
    for the exponential race (``argmax(w_i / E_i)``) over Qwen2.5's 151,936 entries on a 2-core Xeon, and six
    operators.

    The uniforms are drawn for all rows first, then the float64 running sums are made `chunk_elements` at a time
    (`row_chunks`): each row's draw depends on its own weights and uniform alone, so the indices are the ones an
    unchunked call gives, and the generator advances as it would.

    Args:
        weights: `(..., vocab)` non-negative float.
        generator: optional generator; its device may differ from `weights`' device (the uniforms are moved).
        uniform: optional `(..., 1)` float64 uniforms in [0, 1) (`sample_uniform`), drawn with `generator` if None.
        chunk_elements: the most weights turned into running sums at a time (None: `ROW_CHUNK_ELEMENTS`).

    Returns:
        `(...)` long, the sampled indices.
    """
    if uniform is None:
        uniform = sample_uniform(tuple(weights.shape[:-1]), weights.device, generator)
    vocab = weights.shape[-1]
    flat, flat_uniform = weights.reshape(-1, vocab), uniform.reshape(-1, 1)  # (rows, vocab), (rows, 1)
    chunks = row_chunks(flat.shape[0], vocab, ROW_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements)
    index = torch.cat([_inverse_cdf(flat[rows], flat_uniform[rows]) for rows in chunks]) if chunks else None
    return (index if index is not None else flat.new_zeros((0,), dtype=torch.long)).reshape(weights.shape[:-1])


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`(rows,)` the first index whose running sum reaches ``(1 - uniform)`` times the total (`sample_from_weights`).

    Args:
        weights: `(rows, vocab)`; uniform: `(rows, 1)` float64.
    """
    running = torch.cumsum(weights, dim=-1, dtype=torch.float64)  # (rows, vocab), non-decreasing
    threshold = (1.0 - uniform) * running[:, -1:]  # (rows, 1) in (0, total]
    index = torch.searchsorted(running, threshold, right=False)  # (rows, 1): first running sum >= threshold
    # A row with NaN or inf weights draws some index in range (the caller flags such rows: `flag_nonfinite`).
    return index.clamp_(max=weights.shape[-1] - 1).squeeze(-1)


def uniform_like(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """`shape` floats uniform in [0, 1), drawn with `generator` (on its device) and moved to `device`."""
    noise_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=noise_device).to(device)


ARGMAX_BLOCK = 128  # `first_argmax`'s block: Qwen2.5's logit widths (151,936 and 152,064) are multiples of it


def first_argmax(scores: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(scores, dim=-1)`, the same indices (the first maximum; the first NaN where a row has one), at a
    fraction of its CPU cost over a wide vocabulary.

    torch's CPU argmax walks a row one element at a time (0.33 ms over 151,936 logits on a 2-core Xeon, where the
    vectorised `amax` takes 0.016 ms), and greedy decoding takes one per drafted and verified position. Here the
    row's blocks of `ARGMAX_BLOCK` logits are reduced by `amax` (NaN propagates), torch's argmax over the thousand
    block maxima finds the first block holding the row's maximum (or its first NaN), and torch's argmax runs inside
    that block alone (and over the tail beyond the last whole block, which wins where torch's argmax would pick
    it); about a quarter of the time, in seven operators. Elsewhere (a GPU, where argmax is one fast kernel; a
    narrow vocabulary) it is `torch.argmax`.

    Args:
        scores: `(..., vocab)` float.

    Returns:
        `(...)` long.
    """
    logit_width = scores.shape[-1]
    if scores.device.type != "cpu" or logit_width < 64 * ARGMAX_BLOCK:
        return scores.argmax(dim=-1)
    flat = scores if scores.dim() == 2 else scores.reshape(-1, logit_width)  # (rows, vocab)
    rows, blocks = flat.shape[0], logit_width // ARGMAX_BLOCK
    whole = blocks * ARGMAX_BLOCK
    by_block = (flat if whole == logit_width else flat[:, :whole]).view(rows, blocks, ARGMAX_BLOCK)  # a view
    # argmax over the block maxima is the first block holding the row's maximum (or its first NaN: amax keeps NaN)
    first = by_block.amax(dim=-1).argmax(dim=-1)  # (rows,)
    within = by_block[torch.arange(rows), first].argmax(dim=-1)  # (rows,)
    index = torch.add(within, first, alpha=ARGMAX_BLOCK)  # (rows,)
    if whole < logit_width:  # the tail beyond the last whole block wins only where torch's argmax would pick it
        tail = flat[:, whole:]
        candidates = torch.stack([flat.gather(1, index[:, None])[:, 0], tail.amax(dim=-1)])  # (2, rows)
        index = torch.where(candidates.argmax(dim=0).bool(), whole + tail.argmax(dim=-1), index)
    return index if scores.dim() == 2 else index.reshape(scores.shape[:-1])


_POSITION_BITS = 32  # a counter is row * 2^32 + position: positions below 2^32, rows below 2^31
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's multipliers, as signed int64 (same bits)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's increment: the second round's key differs from the first's
_KEY_BITS = 62  # a key is drawn in [0, 2^62): a positive int64 whatever the generator's device


def call_key(generator: torch.Generator | None) -> int:
    """The call's key: one draw from `generator` (on its device), else from the global generator (so
    `torch.manual_seed` seeds it)."""
    device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 1 << _KEY_BITS, (1,), dtype=torch.long, generator=generator, device=device))


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 `values` (torch's `>>` on int64 copies the sign bit in)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def mix64(values: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 `values` (any shape), elementwise, modulo 2^64: a bijection."""
    values = (values ^ _shift_right(values, 30)) * _MIX_1
    values = (values ^ _shift_right(values, 27)) * _MIX_2
    return values ^ _shift_right(values, 31)


def keyed_uniforms(key: int, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`(batch, L, 1)` float64 uniforms in [0, 1): entry [b, l] is the uniform of (key, rows[b], positions[b, l]).

    Args:
        key: the call's key (`call_key`), in [0, 2^62).
        rows: `(batch,)` long, each row's caller index (`RowBook.active`), below 2^31.
        positions: `(batch, L)` long, buffer positions (the column a drawn token is written to), below 2^32; on
            `rows`' device.
    """
    counters = (rows[:, None] << _POSITION_BITS) | positions  # (batch, L), distinct per (row, position)
    mixed = mix64(mix64(counters ^ key) ^ (key ^ _GOLDEN))
    return (_shift_right(mixed, 11).double() * 2.0**-53)[..., None]  # the top 53 bits, exact in float64


def positions_from(lengths: list[int], levels: int, device: torch.device) -> torch.Tensor:
    """`(batch, levels)` long on `device`: per row, the buffer positions ``lengths[b] + 0 .. levels - 1`` (where a
    round's draws at depth levels 0, 1, ... are written)."""
    return torch.tensor(lengths, dtype=torch.long, device=device)[:, None] + torch.arange(levels, device=device)
