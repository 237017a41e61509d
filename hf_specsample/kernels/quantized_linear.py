"""Linear layers holding quantized weights, run by the small-rows kernel: a draft's quantized forms.

A draft's single-token step streams all of its weights and is memory-bound on the CPU: int8 weights halve the bytes
of bf16 ones, int4 weights quarter them. The weights are rounded symmetrically, per output row (`Int8Linear`,
`scale = max|w| / 127`) or per group of 128 inputs of a row (`Int4Linear`, `scale = max|w| / 7`). The activations
stay in their own precision (bf16 in, bf16 out), except on the kernel's AVX512_VNNI path for int8 weights, which
rounds each row of x to int8 with its own scale (as torch's dynamic int8 does per tensor) so that integer dot
products keep up with memory. What the draft computes never changes what is sampled (its proposals are verified
against the target's distribution); it changes only how often they are accepted.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from . import small_rows


class Int8Linear(torch.nn.Module):
    """`y = x @ (weight * scale[:, None]).T + bias`, with `weight` `(out, in)` int8 and `scale` `(out,)` fp32.

    Runs on the small-rows kernel's int8 path (CPU tensors, no autograd); elsewhere (another device, a gradient)
    on the dequantized weight, which computes the same function up to rounding.
    """

    weight: torch.Tensor  # buffers (`register_buffer`), declared for the type checker
    scale: torch.Tensor
    bias: torch.Tensor | None
    row_sums: torch.Tensor

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
        if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):  # any bias dtype
            return small_rows.small_rows_linear_int8(x, self.weight, self.scale, self.bias, row_sums=self.row_sums)
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


INT4_GROUP = 128  # inputs per int4 scale: finer groups keep more of a small draft's accuracy, at more scale bytes


class Int4Linear(torch.nn.Module):
    """`y = x @ dequantized.T + bias`, the weight as int4 values (`small_rows.pack_int4`) with one fp32 scale per
    output row and group of `group` inputs.

    Runs on the small-rows kernel's int4 path (CPU tensors, no autograd); elsewhere on the dequantized weight.
    """

    packed: torch.Tensor  # buffers (`register_buffer`), declared for the type checker
    scale: torch.Tensor
    bias: torch.Tensor | None
    corrections: torch.Tensor | None

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


# Sibling projections that every architecture of this shape feeds the same input (attention's q/k/v, a gated MLP's
# gate/up): a quantized draft computes each group in one kernel call (`SiblingProjection`).
SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingProjection(torch.nn.Module):
    """One of several projections of the same input computed together: `fused`'s output columns
    `[start, start + width)`.

    A single-token draft step spends about 10 µs per kernel call besides reading the weight, and attention's k/v
    projections of a small model (0.1 MB each) are mostly that: q/k/v in one call and gate/up in one call save 72 of a
    24-layer model's 169 calls. The first sibling called with an input `x` computes every sibling's output and keeps
    the others' for their own call with the same tensor (`x` itself, unmodified: same object, same version); any
    other call computes afresh, so a model that feeds the siblings different inputs still gets each projection of
    its own input. Each kept output is handed out once.
    """

    def __init__(self, fused: torch.nn.Module, start: int, width: int, shared: "_Stash"):
        super().__init__()
        self.fused = fused  # the same module in every sibling (`modules()` lists it once)
        self.start, self.width, self.shared = start, width, shared
        self.in_features, self.out_features = fused.in_features, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in)` -> `(..., width)` in x's dtype."""
        kept = self.shared.take(self.start, x)
        if kept is not None:
            return kept
        out = self.fused(x)
        parts = {start: out[..., start : start + width].contiguous() for start, width in self.shared.widths}
        self.shared.keep(x, parts, taken=self.start)
        return parts[self.start]

    def standalone(self) -> torch.nn.Module:
        """This projection as a layer of its own (`Int8Linear` / `Int4Linear`) over its rows of the fused weight:
        views, no weight copied. For compiled code, which traces every call: the hand-off between siblings is Python
        state that dynamo would guard on (a recompilation per layer) instead of computing once."""
        end = self.start + self.width
        fused_bias = cast("torch.Tensor | None", self.fused.bias)  # a `Linear`'s, as every `make`'s layer has
        fused, bias = self.fused, None if fused_bias is None else fused_bias[self.start : end]
        if isinstance(fused, Int8Linear):
            return Int8Linear(fused.weight[self.start : end], fused.scale[self.start : end], bias)
        if isinstance(fused, Int4Linear):
            return Int4Linear(fused.packed[self.start : end], fused.scale[self.start : end], fused.group, bias)
        raise TypeError(f"no standalone form of a sibling of {type(fused).__name__}")

    def extra_repr(self) -> str:
        end = self.start + self.width
        return f"in_features={self.in_features}, out_features={self.width}, columns {self.start}..{end} of the fused"


class _Stash:
    """The outputs one sibling computed for the others: `(input, its version, {start: output})`, replaced as a
    whole (a reader sees one consistent snapshot)."""

    def __init__(self, widths: list[tuple[int, int]]):
        self.widths = widths  # (start, width) of every sibling
        self.kept: tuple[torch.Tensor, int, dict[int, torch.Tensor]] | None = None

    def take(self, start: int, x: torch.Tensor) -> torch.Tensor | None:
        kept = self.kept
        if kept is None or kept[0] is not x or kept[1] != _version(x) or start not in kept[2]:
            return None
        parts = {other: part for other, part in kept[2].items() if other != start}
        self.kept = (x, kept[1], parts) if parts else None
        return kept[2][start]

    def keep(self, x: torch.Tensor, parts: dict[int, torch.Tensor], taken: int) -> None:
        rest = {start: part for start, part in parts.items() if start != taken}
        self.kept = (x, _version(x), rest) if rest else None


def _version(x: torch.Tensor) -> int:
    """x's in-place version counter; -1 for an inference tensor, which has none (the tensor's identity alone then
    says it is the same input: no architecture modifies a projection's input between its sibling projections)."""
    return -1 if x.is_inference() else x._version


def linear_holding(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    """An `nn.Linear` holding `weight` `(out, in)` and `bias` `(out,)` (not copied, no gradient).

    Built on the meta device first: `nn.Linear`'s constructor initialises its weights with random draws, which on a
    real device would draw from the global generator and change what a caller's seeded program samples next."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


def fuse_siblings(linears: list[torch.nn.Linear], make) -> list[SiblingProjection]:
    """`SiblingProjection`s standing for `linears` (same input width, device and dtype), their weights concatenated
    into one `make(linear)` (e.g. `Int8Linear.from_linear`: per-row scales quantize each row as alone)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat(
            [
                linear.bias.detach() if linear.bias is not None else weight.new_zeros(linear.out_features)
                for linear in linears
            ]
        )
    joined = linear_holding(weight, bias)
    fused = make(joined)
    starts = [sum(linear.out_features for linear in linears[:index]) for index in range(len(linears))]
    shared = _Stash([(start, linear.out_features) for start, linear in zip(starts, linears)])
    return [SiblingProjection(fused, start, linear.out_features, shared) for start, linear in zip(starts, linears)]
