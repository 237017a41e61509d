"""The token buffer shared by draft and target: committed tokens, this round's drafts, finished rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Sequences:
    """Token buffer of the rows still being generated, plus the final tokens of rows that finished.

    Row ``b`` of `tokens` holds its prompt (left padding included, as `generate()` received it), its committed
    tokens up to ``lengths[b]``, and during a round the draft tokens after that. Only active rows are kept in
    `tokens`; `row_ids` maps them back to the caller's batch.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int):
        """
        Args:
            input_ids: `(batch, prompt_length)` long, the prompt as `generate()` prepared it.
            attention_mask: `(batch, prompt_length)` or None (no padding).
            capacity: buffer length; must cover the longest sequence plus a round of drafts.
        """
        batch, prompt_length = input_ids.shape
        self.prompt_length = prompt_length
        self.batch_size = batch
        self.tokens = input_ids.new_zeros((batch, capacity))  # (batch, capacity)
        self.tokens[:, :prompt_length] = input_ids
        # (batch, capacity) on the CPU: False for prompt padding, which no model may attend to.
        self.token_is_real = torch.ones((batch, capacity), dtype=torch.bool)
        if attention_mask is not None:
            self.token_is_real[:, :prompt_length] = attention_mask.bool().cpu()
        self.lengths = [prompt_length] * batch
        self.row_ids = list(range(batch))
        self.finished: dict[int, torch.Tensor] = {}

    @property
    def num_active(self) -> int:
        return len(self.row_ids)

    def write(self, offsets: Sequence[int] | torch.Tensor, new_tokens: torch.Tensor) -> None:
        """Write one token per active row at position ``lengths[b] + offsets[b]``.

        Args:
            offsets: `num_active` ints or a `(num_active,)` long tensor.
            new_tokens: `(num_active,)` long.
        """
        offsets = torch.as_tensor(offsets, device=self.tokens.device)
        columns = torch.tensor(self.lengths, device=self.tokens.device) + offsets
        rows = torch.arange(self.num_active, device=self.tokens.device)
        self.tokens[rows, columns] = new_tokens.to(self.tokens.device)

    def new_tokens(self, row: int, count: int) -> torch.Tensor:
        """`(count,)` tokens of active `row` after its committed length (this round's tokens)."""
        start = self.lengths[row]
        return self.tokens[row, start : start + count]

    def advance(self, counts: Sequence[int]) -> None:
        """Commit `counts[b]` more tokens of each active row."""
        self.lengths = [length + count for length, count in zip(self.lengths, counts)]

    def retire(self, done: Sequence[bool]) -> list[int]:
        """Move the rows flagged in `done` out of the buffer; return the indices of the rows that stay active."""
        keep = [row for row, is_done in enumerate(done) if not is_done]
        for row, is_done in enumerate(done):
            if is_done:
                self.finished[self.row_ids[row]] = self.tokens[row, : self.lengths[row]].clone()
        if len(keep) < self.num_active:
            index = torch.tensor(keep, dtype=torch.long)
            self.tokens = self.tokens[index.to(self.tokens.device)]
            self.token_is_real = self.token_is_real[index]
            self.lengths = [self.lengths[row] for row in keep]
            self.row_ids = [self.row_ids[row] for row in keep]
        return keep

    def output(self, pad_token_id: int | None) -> torch.Tensor:
        """`(batch, longest)` sequences in the caller's row order, shorter rows right-padded with `pad_token_id`."""
        self.retire([True] * self.num_active)
        rows = [self.finished[row] for row in range(self.batch_size)]
        longest = max(row.shape[0] for row in rows)
        if any(row.shape[0] < longest for row in rows) and pad_token_id is None:
            raise ValueError("Rows finished at different lengths but no `pad_token_id` is set to pad them with.")
        out = rows[0].new_full((self.batch_size, longest), pad_token_id if pad_token_id is not None else 0)
        for row, tokens in enumerate(rows):
            out[row, : tokens.shape[0]] = tokens
        return out
