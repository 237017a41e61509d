"""The draft's quantized weight forms on each kernel path this CPU runs: int8 and int4 linears of Qwen2.5-0.5B's shapes.

    python -m hf_specsample_bench.draft_weight_forms

Prints, per weight shape (the fused q/k/v, attention's output, the fused gate/up, the down projection, the LM head)
and per number of rows (1: a draft step; 5: a prompt's tail), the median microseconds of one call of
`small_rows_linear_int8` / `small_rows_linear_int4` on every path that reads the form here, and the rate it reads
the weight's bytes at. Distinct weights are cycled (24 per shape, as many as the model's layers) so that no call
finds its weight in cache. The memory bandwidth (reading 1 GiB) is printed first: a path far below it at one row is
compute-bound. This is what chose each form's default path (`KernelPath`, `READS`); figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse

import torch

from hf_specsample.kernels import small_rows
from hf_specsample.kernels.quantized_linear import Int4Linear, Int8Linear
from hf_specsample.kernels.small_rows import KernelPath

from .measure import cpu_name, median_ms, read_bandwidth

SHAPES = {  # (out, in) of Qwen2.5-0.5B's linears, as the quantized forms hold them
    "q/k/v fused": (1152, 896),
    "o_proj": (896, 896),
    "gate/up fused": (9728, 896),
    "down_proj": (896, 4864),
    "LM head": (151936, 896),
}
TINY_SHAPES = {"tiny": (64, 256)}  # a quick check that every path runs (the tests)
LAYERS = 24  # distinct weights per shape (the LM head: 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.draft_weight_forms", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--layers", type=int, default=LAYERS, help="distinct weights per shape (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per cell (default: %(default)s)")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="GiB read to measure the bandwidth")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape instead of Qwen2.5-0.5B's")
    args = parser.parse_args(argv)
    problem = small_rows.load().problem
    if problem is not None:
        print(f"the small-rows kernel is not available here: {problem}")
        return
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; paths here: {[str(p) for p in small_rows.paths()]}")
    gib = args.bandwidth_gib
    print(f"memory bandwidth (reading {gib:g} GiB): {read_bandwidth(gib=gib) / 1e9:.1f} GB/s")
    print(f"default paths: int8 {small_rows.best_path(torch.int8)}, int4 {small_rows.best_path(torch.uint8)}")
    torch.manual_seed(0)
    here = set(small_rows.paths())
    with torch.inference_mode():
        for name, (out_features, in_features) in (TINY_SHAPES if args.tiny else SHAPES).items():
            count = args.layers if out_features < 100_000 else min(args.layers, 2)
            linears = [torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16) for _ in range(count)]
            int8 = [Int8Linear.from_linear(linear) for linear in linears]
            int4 = [Int4Linear.from_linear(linear) for linear in linears]
            del linears
            bytes8 = out_features * in_features * 1
            bytes4 = out_features * in_features // 2 + out_features * in_features // 128 * 4
            for rows in (1, 5):
                x = torch.randn(rows, in_features, dtype=torch.bfloat16)
                cells = []
                for path in small_rows.READS[torch.int8]:
                    if path in here and path is not KernelPath.SCALAR:
                        seconds = median_ms(lambda x=x, path=path, int8=int8: [
                            small_rows.small_rows_linear_int8(x, q.weight, q.scale, None, path, q.row_sums)
                            for q in int8
                        ], repeats=args.repeats, warm_up=3) / 1e3 / count  # fmt: skip
                        cells.append(f"int8 {path} {seconds * 1e6:6.0f} us {bytes8 / seconds / 1e9:5.1f} GB/s")
                for path in small_rows.READS[torch.uint8]:
                    if path in here and path is not KernelPath.SCALAR:
                        seconds = median_ms(lambda x=x, path=path, int4=int4: [
                            small_rows.small_rows_linear_int4(x, q.packed, q.scale, q.group, None, path, q.corrections)
                            for q in int4
                        ], repeats=args.repeats, warm_up=3) / 1e3 / count  # fmt: skip
                        cells.append(f"int4 {path} {seconds * 1e6:6.0f} us {bytes4 / seconds / 1e9:5.1f} GB/s")
                print(f"{name:<14} ({out_features}, {in_features}) M={rows}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
