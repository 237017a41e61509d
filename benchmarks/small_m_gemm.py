"""One linear of Qwen2.5-1.5B's MLP shape over M = 1, 2, 5, 9 rows: the small-M GEMM that verification runs.

    python benchmarks/small_m_gemm.py

Prints the median milliseconds (of 30, after 5 warm-up calls) of `(M, 1536) @ (1536, 8960)` for each form this CPU
offers: eager bf16 and fp32 `F.linear`, and oneDNN's prepacked linear (`torch.utils.mkldnn.to_mkldnn`) in fp32 and
bf16 (its bf16 path needs AVX-512 or AVX-NE-CONVERT and says so where they are missing). Ratios are to the eager
bf16 M=1 time, a decoding step's share; verification of K draft tokens runs M = K + 1. Figures are printed, never
asserted.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.mkldnn as mkldnn

from hf_specsample_bench.measure import cpu_name, median_ms

IN_FEATURES, OUT_FEATURES = 1536, 8960
ROWS = (1, 2, 5, 9)


def forms() -> dict[str, tuple[torch.nn.Module, torch.dtype, bool]]:
    """name -> (module, input dtype, whether it takes oneDNN-layout input)."""
    torch.manual_seed(0)
    base = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False).requires_grad_(False)
    out = {  # `.to(bfloat16)` converts in place: the bf16 copy is made from a clone
        "eager bf16": (
            torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False).to(torch.bfloat16),
            torch.bfloat16,
            False,
        ),
        "eager fp32": (base, torch.float32, False),
    }
    for name, dtype, onednn_input in (("fp32", torch.float32, True), ("bf16", torch.bfloat16, False)):
        try:
            out[f"oneDNN {name} prepacked"] = (mkldnn.to_mkldnn(base, dtype), dtype, onednn_input)
        except RuntimeError as error:
            print(f"oneDNN {name}: {error}")
    return out


def main() -> None:
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; linear {IN_FEATURES} -> {OUT_FEATURES}")
    step = None
    with torch.no_grad():
        for name, (module, dtype, onednn_input) in forms().items():
            cells = []
            for rows in ROWS:
                x = torch.randn(rows, IN_FEATURES).to(dtype)
                x = x.to_mkldnn() if onednn_input else x
                try:
                    ms = median_ms(functools.partial(module, x), repeats=30, warm_up=5)
                except RuntimeError as error:
                    cells.append(f"M={rows}: {str(error).splitlines()[-1][:90]}")
                    break
                step = ms if step is None else step
                cells.append(f"M={rows} {ms:6.2f} ms ({ms / step:.2f}x)")
            print(f"{name:<22} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
