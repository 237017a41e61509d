"""A call's working memory: peak resident memory beyond the models, plain `generate()` against `draft_model=`.

    python -m hf_specsample_bench.memory --rows 256 --shape narrow --lookahead 4 --new-tokens 8    # on the CPU

Each measurement runs in a fresh Python process (`--one`), so that no allocation of another measurement is counted:
it builds the random-weight models (`weightless.build`, the real vocabulary), makes one small warm-up call of the
same kind (2 rows: lazily loaded code, the draft's prepared form and kernel builds are not a round's memory), then
resets the kernel's high-water mark of resident memory (`/proc/self/clear_refs` 5, Linux), reads the resident
memory (VmRSS), runs the measured call and reads the high-water mark again (VmHWM): the difference is the call's
peak beyond the models and everything built before it. Where `clear_refs` is refused, a thread samples VmRSS every
millisecond instead (it may miss a peak shorter than that); the output says which was used.

Figures are printed, never asserted (a test runs the script with tiny shapes).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from .weightless import _SHAPES, Shape, build

GIB = 1024**3


class Method(str, Enum):
    """What is measured: plain `generate()` or ours (`draft_model=`, fixed K)."""

    PLAIN = "plain"
    OURS = "draft_model"

    def __str__(self) -> str:
        return self.value


class Sampling(str, Enum):
    """Greedy; sampling at T=0.8 with top-p 0.95 (and transformers' default top-k 50); the same with top-p alone.

    Random weights give nearly uniform distributions: top-p alone then keeps most of the vocabulary, beyond what
    the sort-free top-p settles (`sampling.fast_processors`), so every row is sorted, as plain `generate()` sorts it.
    """

    GREEDY = "greedy"
    TOP_P = "sampling"
    TOP_P_ONLY = "sampling-top-p-only"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Measurement:
    method: Method
    sampling: Sampling
    peak_bytes: int
    how: str  # "VmHWM" (the kernel's high-water mark) or "sampled" (a thread reading VmRSS)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert match is not None, f"/proc/self/status has no {field}"
    return int(match.group(1))


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current VmRSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


def peak_beyond(run: Callable[[], Any]) -> tuple[int, str]:
    """Bytes of resident memory `run()` adds at its peak to what the process held before, and how it was read.

    Meaningful in a fresh process only: a long-lived one may hold freed heap that is still resident, and an
    allocation served from it adds nothing to resident memory.
    """
    if _reset_high_water_mark():
        before = _status_kib("VmRSS")
        run()
        return (_status_kib("VmHWM") - before) * 1024, "VmHWM"
    before = peak = _status_kib("VmRSS")
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.001):
            peak = max(peak, _status_kib("VmRSS"))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        run()
    finally:
        done.set()
        thread.join()
    return (max(peak, _status_kib("VmRSS")) - before) * 1024, "sampled"


def generate_kwargs(method: Method, sampling: Sampling, draft, lookahead: int, new_tokens: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens}
    if sampling is not Sampling.GREEDY:
        kwargs.update(do_sample=True, temperature=0.8, top_p=0.95, top_k=50 if sampling is Sampling.TOP_P else 0)
    else:
        kwargs.update(do_sample=False)
    if method is Method.OURS:
        kwargs.update(draft_model=draft, num_lookahead=lookahead)
    return kwargs


def measure_one(
    method: Method, sampling: Sampling, rows: int, shape: Shape, lookahead: int, new_tokens: int, prompt_tokens: int
) -> Measurement:
    """One measurement in this process (see the module docstring)."""
    import hf_specsample  # noqa: F401  (registers draft_model=)

    torch.set_grad_enabled(False)
    target = build(shape, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    draft = build(shape, seed=1, dtype=torch.float32, device=torch.device("cpu"))
    vocab = _SHAPES[shape][5]
    ids = torch.randint(1, vocab, (rows, prompt_tokens), generator=torch.Generator().manual_seed(0))
    kwargs = generate_kwargs(method, sampling, draft, lookahead, new_tokens)
    target.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), **kwargs)  # warm-up (module docstring)
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    peak, how = peak_beyond(lambda: target.generate(ids, attention_mask=mask, **kwargs))
    return Measurement(method, sampling, peak, how)


def measure_in_subprocess(method: Method, sampling: Sampling, args: argparse.Namespace) -> Measurement:
    command = [
        sys.executable, "-m", "hf_specsample_bench.memory", "--one", str(method), str(sampling),
        "--rows", str(args.rows), "--shape", str(args.shape), "--lookahead", str(args.lookahead),
        "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
    ]  # fmt: skip
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result = json.loads(output.strip().splitlines()[-1])
    return Measurement(Method(result["method"]), Sampling(result["sampling"]), result["peak_bytes"], result["how"])


def table(measurements: list[Measurement], args: argparse.Namespace) -> str:
    """A markdown table: per sampling mode, plain's peak, ours and the ratio."""
    vocab = _SHAPES[args.shape][5]
    peaks = {(m.method, m.sampling): m for m in measurements}
    lines = [
        f"rows x vocabulary x K = {args.rows} x {vocab:,} x {args.lookahead}, {args.new_tokens} new tokens, "
        f"prompt {args.prompt_tokens} tokens, `{args.shape}` models (float32); peak read by "
        f"{', '.join(sorted({m.how for m in measurements}))}",
        "",
        "| | plain generate() | draft_model= | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for sampling in args.modes:
        plain, ours = peaks[(Method.PLAIN, sampling)].peak_bytes, peaks[(Method.OURS, sampling)].peak_bytes
        ratio = ours / plain if plain > 0 else float("nan")
        lines.append(f"| {sampling} | {plain / GIB:.2f} GiB | {ours / GIB:.2f} GiB | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--shape", type=Shape, choices=list(Shape), default=Shape.NARROW)
    parser.add_argument("--lookahead", type=int, default=4, help="K, fixed")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument(
        "--modes",
        type=lambda text: [Sampling(mode) for mode in text.split(",")],
        default=list(Sampling),
        help=f"comma-separated, of {', '.join(map(str, Sampling))}",
    )
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "SAMPLING"), help="one measurement, here (JSON)")
    args = parser.parse_args(argv)
    if args.one:
        method, sampling = Method(args.one[0]), Sampling(args.one[1])
        result = measure_one(
            method, sampling, args.rows, args.shape, args.lookahead, args.new_tokens, args.prompt_tokens
        )
        print(json.dumps({"method": str(method), "sampling": str(sampling), "peak_bytes": result.peak_bytes,
                          "how": result.how}))  # fmt: skip
        return
    measurements = [measure_in_subprocess(m, s, args) for s in args.modes for m in Method]
    print(table(measurements, args))


if __name__ == "__main__":
    main()
