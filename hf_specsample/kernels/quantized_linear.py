"""Linear layers holding quantized weights, run by the small-rows kernel: a draft's compact forms.

A draft's single-token step streams all of its weights and is memory-bound on the CPU: int8 weights halve the bytes
of bf16 ones, int4 weights quarter them. The weights are rounded symmetrically, per output row (`Int8Linear`,
`scale = max|w| / 127`) or per group of 128 inputs of a row (`Int4Linear`, `scale = max|w| / 7`). The activations
stay in their own precision (bf16 in, bf16 out), except on the kernel's AVX512_VNNI path for int8 weights, which
rounds each row of x to int8 with its own scale (as torch's dynamic int8 does per tensor) so that integer dot
products keep up with memory. What the draft computes never changes what is sampled (its proposals are verified
against the target's distribution); it changes only how often they are accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import small_rows


class Int8Linear(torch.nn.Module):
    """`y = x @ (weight * scale[:, None]).T + bias`, with `weight` `(out, in)` int8 and `scale` `(out,)` fp32.

    Runs on the small-rows kernel's int8 path (CPU tensors, no autograd); elsewhere (another device, a gradient)
    on the dequantized weight, which computes the same function up to rounding.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("row_sums", weight.sum(1, dtype=torch.int32))  # for the kernel's VNNI path
        self.out_features, self.in_features = weight.shape

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear) -> "Int8Linear":
        """Round `linear`'s weight to int8 per output row (symmetric, round to nearest)."""
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(quantized, scale, linear.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """`(out, in)` the weight this layer stands for, in `dtype`."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in)` -> `(..., out)` in x's dtype."""
        if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return small_rows.small_rows_linear_int8(x, self.weight, self.scale, bias, row_sums=self.row_sums)
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


INT4_GROUP = 128  # inputs per int4 scale: finer groups keep more of a small draft's accuracy, at more scale bytes


class Int4Linear(torch.nn.Module):
    """`y = x @ dequantized.T + bias`, the weight as int4 values (`small_rows.pack_int4`) with one fp32 scale per
    output row and group of `group` inputs.

    Runs on the small-rows kernel's int4 path (CPU tensors, no autograd); elsewhere on the dequantized weight.
    """

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # what the kernel's VNNI path subtracts for x's unsigned offset, kept rather than recomputed per call
        corrections = small_rows.int4_corrections(self.packed, self.scale) if group == 128 else None
        self.register_buffer("corrections", corrections)
        self.group = group
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2

    @staticmethod
    def fits(linear: torch.nn.Linear, group: int = INT4_GROUP) -> bool:
        """Whether `linear`'s inputs split into whole groups (else it keeps another form)."""
        return linear.in_features % group == 0

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear, group: int = INT4_GROUP) -> "Int4Linear":
        """Round `linear`'s weight to int4 per row and group (symmetric, round to nearest, -8..7)."""
        weight = linear.weight.detach().float()
        rows, columns = weight.shape
        grouped = weight.view(rows, columns // group, group)
        scale = (grouped.abs().amax(dim=2) / 7).clamp_min(torch.finfo(torch.float32).tiny)  # (rows, groups)
        values = torch.round(grouped / scale[:, :, None]).clamp_(-8, 7).view(rows, columns)
        return cls(small_rows.pack_int4(values), scale, group, linear.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """`(out, in)` the weight this layer stands for, in `dtype`."""
        values = small_rows.unpack_int4(self.packed).float().view(self.out_features, -1, self.group)
        return (values * self.scale[:, :, None]).view(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in)` -> `(..., out)` in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
            return small_rows.small_rows_linear_int4(
                x, self.packed, self.scale, self.group, bias, corrections=self.corrections
            )
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
            f"bias={self.bias is not None}"
        )
