"""`Int8Linear`: a linear layer holding int8 weights with one fp32 scale per output row, run by the small-rows kernel.

A draft's single-token step streams all of its weights and is memory-bound on the CPU: int8 weights halve the bytes
of bf16 ones. Unlike torch's dynamic int8 (fbgemm), the activations stay in their own precision (bf16 in, bf16 out):
only the weights are rounded, symmetrically per output row (`scale = max|w| / 127`), so the draft's logits move by
the weights' rounding alone. What the draft computes never changes what is sampled (its proposals are verified
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
            return small_rows.small_rows_linear_int8(x, self.weight, self.scale, bias)
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
