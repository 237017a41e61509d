"""Tensor-parallel targets (`tp_plan="auto"`, launched with torchrun): every rank must accept the same tokens.

Each rank runs the loop with its shard of the target and a full replica of the draft. The target's logits come
out of an all-reduce/all-gather, identical on every rank; the draft replica computes identical logits from
identical inputs. What remains is randomness: every rank draws from one generator whose state rank 0 broadcasts
at the start, and rank 0's verdict (accepted count, next token, a tree's path) is broadcast every round, so ranks
can never drift apart, whatever their floating point does.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist

from .rules import Verdict


def _broadcast_device(device: torch.device) -> torch.device:
    """NCCL broadcasts CUDA tensors, gloo CPU tensors."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def shared_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator whose state is rank 0's, on every rank (a fresh one seeded by rank 0 when none is given)."""
    if generator is None:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.long)
        generator = torch.Generator(device=device).manual_seed(int(_from_rank_zero(seed, device)))
    generator.set_state(_from_rank_zero(generator.get_state(), device).to(torch.uint8))
    return generator


def _from_rank_zero(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rank 0's value of `tensor` (same shape and dtype on every rank), on the CPU."""
    buffer = tensor.to(_broadcast_device(device)).contiguous()
    if buffer.dtype == torch.uint8 and dist.get_backend() != "nccl":
        buffer = buffer.to(torch.int32)  # gloo has no uint8 broadcast on every build
    dist.broadcast(buffer, src=0)
    return buffer.cpu()


def check_same_draft(form: Enum, vocabulary: torch.Tensor | None, device: torch.device) -> None:
    """Refuse, on every rank, a draft whose form or vocabulary differs between ranks (a `PreparedDraft` each rank
    made with different options): their proposals, and so the shapes of the target's collectives, would differ.
    (Whether a target is tensor-parallel is a fact of the model: `model_facts.ModelFacts.tensor_parallel`.)

    Two all-reduces of 2 integers (min and max of the form's index and of the vocabulary's checksum), on `device`
    under NCCL.
    """
    forms = list(type(form))
    checksum = 0 if vocabulary is None else int(vocabulary.long().sum()) * 31 + vocabulary.numel()
    values = torch.tensor([forms.index(form), checksum], dtype=torch.long, device=_broadcast_device(device))
    low, high = values.clone(), values.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low.cpu(), high.cpu()):
        raise ValueError(
            f"The tensor-parallel ranks run different drafts (this rank: {form}, "
            f"{'full vocabulary' if vocabulary is None else f'{vocabulary.numel()} token vocabulary'}): every rank "
            "must propose the same tokens. Pass the same prepare_draft(...) options on every rank, with an explicit "
            "form= (AUTO chooses without the clock for a tensor-parallel target), or let generate() prepare "
            "the draft."
        )


def broadcast_verdict(verdict: Verdict) -> Verdict:
    """Rank 0's verdict on every rank (each of its tensors, one broadcast each)."""
    device = verdict.num_accepted.device
    return Verdict._make(None if field is None else _from_rank_zero(field, device).to(device) for field in verdict)
