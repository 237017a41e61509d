"""The rows being generated: the one owner of every row's tokens, lengths, positions and membership of the batch.

The row book (`RowBook`): which of the caller's rows are still being generated, in which order, and who follows them.
Two indexings meet in a call. State that exists only for rows still generating (the token buffers, the KV caches'
slot counts, the draft-id buffer) is indexed by *active row*, ``0 .. num_active - 1``, and shrinks when a row
finishes. What the call returns (output rows, scores, statistics, finished rows' caches) is indexed by *caller row*,
``0 .. batch_size - 1``, the row of the batch `generate()` prepared. `RowBook` is the one map between them: the
token buffers attach to it (the loop tells the models' caches itself), and every caller-row table is written through
`callers`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from .devices import tensor_on, to_device


class Columns(NamedTuple):
    """Buffer columns ``starts[b] .. starts[b] + width - 1`` of each row, ready for a forward pass.

    Attributes:
        input_ids: `(rows, width)` long, on the token buffer's device.
        position_ids: `(rows, width)` long on the CPU: the position ids plain `generate()` gives these tokens.
        is_real: `(rows, width)` bool on the CPU: False for prompt padding (masked out, as `generate()` masks it).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    is_real: torch.Tensor


def generate_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """`(batch, length)` position ids as `generate()` numbers a prompt: real tokens count up from 0, padding is 0."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


class Sequences:
    """Token buffer of the rows still being generated, plus the final tokens of rows that finished.

    Row ``b`` of `tokens` holds its prompt exactly as `generate()` received it (padding included, on either side),
    its committed tokens up to ``lengths[b]``, and during a round the draft tokens after that. Only active rows are
    kept in `tokens`; the row book `rows` maps them back to the caller's batch. The buffer is a member of its book, as
    may be any holder of per-row state (`RowBook.attach`); the loop tells the models' caches itself
    (`SpeculativeDecoder.shrink`), after `drop_finished` drops finished rows from the buffer.

    Positions follow `generate()`: the prompt's are `generate()`'s own `position_ids` (from the attention mask:
    padding gets 0, on the left or the right), and each new token's is the previous column's plus one.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        capacity: int,
        position_ids: torch.Tensor | None = None,
        rows: RowBook | None = None,
    ):
        """
        Args:
            input_ids: `(batch, prompt_length)` long, the prompt as `generate()` prepared it.
            attention_mask: `(batch, prompt_length)` or None (no padding).
            capacity: buffer length; must cover the longest sequence plus a round of drafts.
            position_ids: `(batch, prompt_length)` the prompt's position ids as `generate()` prepared them; None:
                computed from the mask the same way.
            rows: the row book to follow, shared with another buffer over the same rows (a draft's own ids); None: a
                new book of `batch` rows. Either way every one of its rows must be active (nothing dropped yet).
        """
        batch, prompt_length = input_ids.shape
        self.rows = RowBook(batch) if rows is None else rows
        if self.rows.active != list(range(batch)):
            raise ValueError(f"A new buffer of {batch} rows needs a row book with exactly those rows active.")
        self.prompt_length = prompt_length
        self.batch_size = batch
        self.tokens = input_ids.new_zeros((batch, capacity))  # (batch, capacity)
        self.tokens[:, :prompt_length] = input_ids
        mask = torch.ones((batch, prompt_length), dtype=torch.bool) if attention_mask is None else attention_mask
        mask = mask.bool().cpu()
        prompt_positions = generate_position_ids(mask) if position_ids is None else position_ids.long().cpu()
        # Caller-row tables (never re-selected), on the CPU: (batch, capacity).
        self._is_real = torch.ones((batch, capacity), dtype=torch.bool)
        self._is_real[:, :prompt_length] = mask
        steps = torch.arange(1, capacity - prompt_length + 1)
        self._positions = torch.cat([prompt_positions, prompt_positions[:, -1:] + steps], dim=1)
        self.lengths = [prompt_length] * batch
        self.finished: dict[int, torch.Tensor] = {}  # caller row -> its final tokens
        self.rows.attach(self)

    @property
    def lengths(self) -> list[int]:
        """Per active row, its committed length."""
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        self._lengths = lengths
        self._device_lengths: torch.Tensor | None = None  # made from `lengths` when first needed
        self._device_rows: torch.Tensor | None = None  # (num_active,) arange, likewise

    def device_lengths(self) -> torch.Tensor:
        """`(num_active,)` long: `lengths` on the buffer's device, made once per change of the lengths (a round's
        draft steps all write at ``lengths[b] + step``)."""
        if self._device_lengths is None:
            self._device_lengths = tensor_on(self._lengths, self.tokens.device)
        return self._device_lengths

    @property
    def num_active(self) -> int:
        return self.rows.num_active

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def is_real(self, width: int) -> torch.Tensor:
        """`(active rows, width)` bool on the CPU: which of the first `width` columns of each active row are not
        padding."""
        return self._is_real[self.rows.callers(), :width]

    def columns(self, starts: Sequence[int], width: int) -> Columns:
        """Columns ``starts[b] ..`` (`width` of them) of every active row."""
        return self.columns_of(self.tokens, self.rows.callers(), starts, width)

    def columns_of(self, tokens: torch.Tensor, callers: Sequence[int], starts: Sequence[int], width: int) -> Columns:
        """Columns of the given token rows, which stand for the caller's rows `callers` (e.g. finished rows).

        Args:
            tokens: `(rows, >= max(starts) + width)` long.
        """
        rows = list(callers)
        every_row = rows == list(range(self.batch_size))  # no row dropped: the caller tables as they are
        positions = self._positions if every_row else self._positions[rows]
        is_real = self._is_real if every_row else self._is_real[rows]
        if len(set(starts)) == 1:  # every row at one start (one row; rows of one length): slices, no index
            start = starts[0]
            return Columns(
                input_ids=tokens[:, start : start + width],
                position_ids=positions[:, start : start + width],
                is_real=is_real[:, start : start + width],
            )
        cols = torch.tensor(list(starts))[:, None] + torch.arange(width)  # (rows, width)
        return Columns(
            input_ids=tokens.gather(1, to_device(cols, tokens.device)),
            position_ids=positions.gather(1, cols),
            is_real=is_real.gather(1, cols),
        )

    def write(self, offsets: int | torch.Tensor, new_tokens: torch.Tensor) -> None:
        """Write one token per active row at position ``lengths[b] + offsets[b]``.

        Args:
            offsets: one int for every row, or a `(num_active,)` long tensor on the buffer's device.
            new_tokens: `(num_active,)` long.
        """
        columns = self.device_lengths() + offsets  # (num_active,)
        if self._device_rows is None or self._device_rows.numel() != self.num_active:
            self._device_rows = torch.arange(self.num_active, device=self.tokens.device)
        self.tokens[self._device_rows, columns] = to_device(new_tokens, self.tokens.device)

    def advance(self, counts: Sequence[int]) -> None:
        """Commit `counts[b]` more tokens of each active row."""
        self.lengths = [length + count for length, count in zip(self.lengths, counts)]

    def extend(self, offsets: Sequence[int], row_tokens: Sequence[torch.Tensor]) -> None:
        """Commit in each active row `offsets[b]` tokens already in the buffer, then `row_tokens[b]` written after them.

        Args:
            offsets: per active row, tokens after its length that stay as they are.
            row_tokens: per active row, `(m_b,)` long tokens written at ``lengths[b] + offsets[b]``.
        """
        ends = [length + offset + tokens.numel() for length, offset, tokens in zip(self.lengths, offsets, row_tokens)]
        self.reserve(max(ends))
        for row, (offset, tokens) in enumerate(zip(offsets, row_tokens)):
            start = self.lengths[row] + offset
            self.tokens[row, start : start + tokens.numel()] = tokens.to(self.tokens.device)
        self.advance([offset + tokens.numel() for offset, tokens in zip(offsets, row_tokens)])

    def reserve(self, capacity: int) -> None:
        """Make room for at least `capacity` columns (the buffer at least doubles); new columns hold real tokens.

        The target's buffer never grows (its capacity covers `max_length` plus a round); a draft with another
        tokenizer may need more of its own ids than the target has tokens (`proposers.cross_tokenizer.DraftIdBuffer`).
        """
        if capacity <= self.capacity:
            return
        extra = max(capacity, 2 * self.capacity) - self.capacity
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros((self.num_active, extra))], dim=1)
        self._is_real = torch.cat([self._is_real, torch.ones((self.batch_size, extra), dtype=torch.bool)], dim=1)
        steps = torch.arange(1, extra + 1)
        self._positions = torch.cat([self._positions, self._positions[:, -1:] + steps], dim=1)

    def left_pack(self) -> None:
        """Rewrite the active rows as one left-padded block: each row's real tokens, right-aligned at its length.

        Every row's length becomes the longest row's real length; positions stay those of the real tokens (counted
        from 0, padding 0). Only for a buffer that no attached cache has been fed from (it would no longer match):
        `proposers.cross_tokenizer.DraftIdBuffer`'s, after its draft's cache was emptied.
        """
        real = self.is_real(self.capacity).to(self.tokens.device)  # (rows, capacity)
        rows = [self.tokens[row, :length][real[row, :length]] for row, length in enumerate(self.lengths)]
        width = max(tokens.numel() for tokens in rows)
        mask = torch.zeros((self.num_active, width), dtype=torch.bool)
        packed = self.tokens.new_zeros((self.num_active, self.capacity))
        for row, tokens in enumerate(rows):
            packed[row, width - tokens.numel() : width] = tokens
            mask[row, width - tokens.numel() :] = True
        self.tokens = packed
        index = torch.tensor(self.rows.callers(), dtype=torch.long)
        self._is_real[index] = True
        self._is_real[index, :width] = mask
        steps = torch.arange(1, self.capacity - width + 1)
        positions = generate_position_ids(mask)
        self._positions[index] = torch.cat([positions, positions[:, -1:] + steps], dim=1)
        self.lengths = [width] * self.num_active

    def drop_finished(self, done: Sequence[bool]) -> list[int]:
        """Keep the final tokens of the rows flagged in `done` and drop them from the row book (so from this buffer and
        every member); return the active rows kept."""
        keep = [row for row, is_done in enumerate(done) if not is_done]
        for row, is_done in enumerate(done):
            if is_done:
                self.finished[self.rows.caller(row)] = self.tokens[row, : self.lengths[row]].clone()
        self.rows.select_rows(keep)
        if not keep:  # every row is done: the book asks no member, this buffer empties itself
            self.tokens = self.tokens[:0]
            self.lengths = []
        return keep

    def select_rows(self, rows: Sequence[int]) -> None:
        """Row-book member: keep only the active `rows` (indices into the active rows) of the buffer."""
        self.tokens = self.tokens[torch.tensor(list(rows), dtype=torch.long, device=self.tokens.device)]
        self.lengths = [self.lengths[row] for row in rows]

    def caller_prefixes(
        self, length: int, pad_token_id: int | None, ends: dict[int, int] | None = None
    ) -> torch.Tensor:
        """`(batch, length)` the first `length` columns of every row in the caller's order, as plain `generate()`'s
        `input_ids` would hold them: active rows from the buffer (past a row's own length: whatever the buffer
        holds, this round's drafts), finished rows their final tokens, then `pad_token_id` (0 where None).

        Args:
            ends: active rows that stopped within this round -> their final length: padded past it.
        """
        pad = pad_token_id if pad_token_id is not None else 0
        out = self.tokens.new_full((self.batch_size, length), pad)
        if self.num_active:
            out[tensor_on(self.rows.callers(), out.device)] = self.tokens[:, :length]
        for row, end in (ends or {}).items():
            out[self.rows.caller(row), end:] = pad
        for caller, tokens in self.finished.items():
            kept = min(length, tokens.shape[0])
            out[caller, :kept] = tokens[:kept]
        return out

    def output(self, pad_token_id: int | None) -> torch.Tensor:
        """`(batch, longest)` sequences in the caller's row order, shorter rows right-padded with `pad_token_id`."""
        self.drop_finished([True] * self.num_active)
        rows = [self.finished[row] for row in range(self.batch_size)]
        longest = max(row.shape[0] for row in rows)
        if any(row.shape[0] < longest for row in rows) and pad_token_id is None:
            raise ValueError("Rows finished at different lengths but no `pad_token_id` is set to pad them with.")
        out = rows[0].new_full((self.batch_size, longest), pad_token_id if pad_token_id is not None else 0)
        for row, tokens in enumerate(rows):
            out[row, : tokens.shape[0]] = tokens
        return out


class RowMember(Protocol):
    """Anything holding per-active-row state that must follow the batch (a token buffer)."""

    def select_rows(self, rows: Sequence[int]) -> None: ...


class RowBook:
    """Active row -> caller row, and the members whose active-row state follows every change of it.

    Members are held weakly: their owners keep them alive, and a buffer that holds its book (`Sequences.rows`) and
    is a member of it would otherwise make a reference cycle, which frees the call's buffers and KV caches only
    when the garbage collector runs instead of when the call returns.

    Attributes:
        batch_size: rows of the caller's batch.
        active: per active row, its caller row (ascending: rows only ever leave).
    """

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.active: list[int] = list(range(batch_size))
        self._members: list[weakref.ref[RowMember]] = []

    @property
    def num_active(self) -> int:
        return len(self.active)

    def attach(self, member: RowMember) -> None:
        """Have `member.select_rows` follow every change of the active rows, from now on (while it lives)."""
        self._members.append(weakref.ref(member))

    def caller(self, row: int) -> int:
        """The caller row of active `row`."""
        return self.active[row]

    def callers(self, rows: Sequence[int] | None = None) -> list[int]:
        """The caller rows of the active `rows` (default: of every active row, in active order)."""
        return list(self.active) if rows is None else [self.active[row] for row in rows]

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only the active `rows` (indices into the active rows), here and in every member.

        Keeping none ends the call: the members are not asked (a cache cannot keep zero rows), and the book only
        records that no row is active.
        """
        rows = list(rows)
        if any(not 0 <= row < self.num_active for row in rows) or rows != sorted(set(rows)):
            raise ValueError(f"Active rows to keep must be ascending and distinct in 0..{self.num_active - 1}: {rows}")
        if rows == list(range(self.num_active)):
            return
        self.active = [self.active[row] for row in rows]
        if rows:
            for reference in self._members:
                member = reference()
                if member is not None:
                    member.select_rows(rows)
