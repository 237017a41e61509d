"""One model's KV cache over the shared token buffer, with rollback and ragged rows, through the Cache API only.

Rows of a batch accept different numbers of draft tokens, but a `Cache` can only be cropped by the same amount in
every row. So a model's cache is a sequence of *slots* shared by all rows; each slot of each row either holds a
buffer position of that row or is a *hole*. Holes (and prompt padding) are masked out with the 2D attention mask,
and position ids count only the real tokens, so the model computes exactly what it would on the unpadded row.
Rolling back crops the slots that no row needs any more (`Cache.crop`) and turns the rest into holes; finished rows
leave the batch through `Cache.batch_select_indices`. No cache tensor is sliced by hand.

The slot bookkeeping lives on the CPU (it is a handful of small integer tensors), so it costs no device sync.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

HOLE = -1  # slot_positions value of a slot that holds no token of its row


def input_device(model: PreTrainedModel) -> torch.device:
    """The device a model's input ids must be on.

    For an accelerate-dispatched model (`device_map=...`, CPU/disk offload) that is the execution device of the
    hook on the embedding (or on a module holding it): offloaded weights sit on the `meta` device. Otherwise it
    is the embedding weight's device.
    """
    embeddings = model.get_input_embeddings()
    for module in (embeddings, getattr(model, "base_model", None), model):
        hook = getattr(module, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return embeddings.weight.device if embeddings.weight.device.type != "meta" else torch.device("cpu")


class CachedModel:
    """A model plus its KV cache, fed from a `(batch, capacity)` token buffer.

    Attributes:
        fed: per row, the number of leading buffer positions whose keys/values are in the cache.
        forward_passes: number of forward calls made so far.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        token_is_real: torch.Tensor,
        cache: DynamicCache | None = None,
    ):
        """
        Args:
            model: a decoder-only model with an LM head.
            token_is_real: `(batch, capacity)` bool on the CPU, False for prompt padding of each buffer position.
            cache: an empty cache to fill (e.g. the one `generate()` prepared); a `DynamicCache` if None.
        """
        self.model = model
        self.cache = cache if cache is not None else DynamicCache(config=model.config)
        self.cache.activate_past_recording()  # lets sliding-window / linear layers be cropped back
        self.token_is_real = token_is_real
        batch = token_is_real.shape[0]
        self.slot_positions = torch.empty((batch, 0), dtype=torch.long)  # (batch, slots), HOLE or buffer position
        self.slot_is_real = torch.empty((batch, 0), dtype=torch.bool)  # (batch, slots), attended to or not
        self.fed = [0] * batch
        self.forward_passes = 0
        self._needs_mask = False  # True once any slot of any row is masked
        signature = inspect.signature(model.forward).parameters
        self._takes_position_ids = "position_ids" in signature
        self._takes_logits_to_keep = "logits_to_keep" in signature

    @property
    def input_device(self) -> torch.device:
        """Where input ids go: see `input_device`."""
        return input_device(self.model)

    def feed(self, tokens: torch.Tensor, upto: Sequence[int], num_logits: int) -> torch.Tensor:
        """Run the model on buffer positions ``fed[b] .. upto[b] - 1`` of every row and return the last logits.

        Rows needing fewer new positions than the widest row get holes in front of theirs, so the last
        `num_logits` slots of every row are its last `num_logits` new positions.

        Args:
            tokens: `(batch, capacity)` long token buffer (any device).
            upto: per row, the buffer length the cache must cover after this call; ``upto[b] - fed[b] >= num_logits``.
            num_logits: how many trailing positions to return logits for.

        Returns:
            `(batch, num_logits, vocab)` float32 logits on `tokens.device`.
        """
        fed = torch.tensor(self.fed)
        upto_t = torch.tensor(list(upto))
        width = int((upto_t - fed).max())
        assert int((upto_t - fed).min()) >= num_logits, "every row must feed at least num_logits positions"
        new_positions = upto_t[:, None] - width + torch.arange(width)  # (batch, width), right-aligned
        new_positions = torch.where(new_positions >= fed[:, None], new_positions, HOLE)
        is_hole = new_positions == HOLE
        new_is_real = ~is_hole & self.token_is_real.gather(1, new_positions.clamp(min=0))  # (batch, width)

        real_before = self.slot_is_real.sum(-1, keepdim=True)  # (batch, 1)
        position_ids = real_before + new_is_real.long().cumsum(-1) - 1  # (batch, width)
        position_ids = position_ids.clamp(min=0).masked_fill(~new_is_real, 1)
        self.slot_positions = torch.cat([self.slot_positions, new_positions], dim=1)
        self.slot_is_real = torch.cat([self.slot_is_real, new_is_real], dim=1)
        self._needs_mask = self._needs_mask or not bool(new_is_real.all())
        self.fed = list(upto)

        device = self.input_device
        input_ids = tokens.gather(1, new_positions.clamp(min=0).to(tokens.device)).to(device)
        kwargs = {"past_key_values": self.cache, "use_cache": True}
        if self._needs_mask:
            kwargs["attention_mask"] = self.slot_is_real.to(device=device, dtype=torch.long)
        if self._takes_position_ids:
            kwargs["position_ids"] = position_ids.to(device)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = num_logits
        logits = self.model(input_ids=input_ids, **kwargs).logits
        self.forward_passes += 1
        return logits[:, -num_logits:].to(device=tokens.device, dtype=torch.float32)

    def rollback(self, keep: Sequence[int]) -> None:
        """Forget buffer positions ``>= keep[b]`` of each row (rejected draft tokens).

        Slots no row needs any more are cropped from the cache; the others become holes.

        Args:
            keep: per row, the buffer length to keep in the cache (values above `fed` change nothing).
        """
        keep_t = torch.tensor(list(keep))[:, None]  # (batch, 1)
        drop = (self.slot_positions >= keep_t) & (self.slot_positions != HOLE)  # (batch, slots)
        if not bool(drop.any()):
            return
        self.slot_positions = self.slot_positions.masked_fill(drop, HOLE)
        self.slot_is_real = self.slot_is_real & ~drop
        self._needs_mask = True
        self.fed = [min(f, k) for f, k in zip(self.fed, keep)]
        self._crop_trailing_holes()

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (indices into the current batch), e.g. to drop finished rows."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self.cache.batch_select_indices(index)  # a CPU index works for cache layers on any device
        self.slot_positions = self.slot_positions[index]
        self.slot_is_real = self.slot_is_real[index]
        self.token_is_real = self.token_is_real[index]
        self.fed = [self.fed[row] for row in rows]
        self._crop_trailing_holes()

    def _crop_trailing_holes(self) -> None:
        used = (self.slot_positions != HOLE).any(dim=0)  # (slots,)
        num_used = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        num_unused = self.slot_positions.shape[1] - num_used
        if num_unused > 0:
            self.cache.crop(-num_unused)
            self.slot_positions = self.slot_positions[:, :num_used]
            self.slot_is_real = self.slot_is_real[:, :num_used]
        self._needs_mask = not bool(self.slot_is_real.all())
