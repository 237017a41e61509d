"""Uniforms keyed by (the call's key, a caller row, a buffer position): a counter-based stream for tree calls.

With deterministic children every token a tree round commits is the target's own draw at its position
(`verify.rules`). A shared generator consumed in order would hand that draw whichever uniform comes next, which
depends on how many draws the rounds before it made: on the draft, the tree's shape, its truncation, K. Drawing the
token at buffer position t of caller row r with ``keyed_uniforms(key, r, t)`` instead makes it a function of the
call's key and the target's distribution at t alone, so a seeded call's text does not depend on the draft.

The key is one draw per sampling call from the call's generator (`call_key`; greedy calls draw nothing). A uniform
is a pure function of (key, row, position): two rounds of the splitmix64 finalizer (a bijection of 64-bit integers
with full avalanche) over the counter ``row * 2^32 + position``, each keyed by XOR, in torch int64 operations on the
tensors' device (multiplications wrap modulo 2^64; right shifts are made logical by masking the sign's copies off).
Its top 53 bits give a float64 in [0, 1), what `draws.sample_uniform` gives `sample_from_weights`.
"""

from __future__ import annotations

import torch

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
