"""The row book: which of the caller's rows are still being generated, in which order, and who follows them.

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
from typing import Protocol


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
