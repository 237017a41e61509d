"""Sweep over the lookahead K: time per token and acceptance vs K (Chen et al.'s Figure 1), as numbers and a PNG."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .methods import Method, MethodDrafts, MethodSpec, Mode
from .prompts import Prompt
from .report import Row, summarise
from .runner import BenchmarkConfig, run_measurements


def run_sweep(
    target, draft, tokenizer, prompts: Sequence[Prompt], lookaheads: Sequence[int], mode: Mode,
    config: BenchmarkConfig, c: float | Mapping[str, float],
) -> list[Row]:  # fmt: skip
    """hf_specsample with each fixed K, next to the target alone, on the same prompts (`draft`: as in
    `run_benchmark`)."""
    methods = [MethodSpec(Method.TARGET)] + [MethodSpec(Method.SPECULATIVE, k) for k in lookaheads]
    drafts = MethodDrafts.wrap(target, draft, tokenizer)
    measurements = run_measurements(target, drafts, tokenizer, prompts, methods, [mode], config, description="K sweep")
    return summarise(measurements, c)


def plot_sweep(rows: Sequence[Row], path: Path, title: str) -> Path:
    """Two panels: mean time per token vs K (target alone as a line), and acceptance vs K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = next(row for row in rows if row.label == Method.TARGET.value)
    swept = sorted((row for row in rows if row.mean_lookahead), key=lambda row: row.mean_lookahead)
    lookaheads = [row.mean_lookahead for row in swept]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(lookaheads, [1000 / row.tokens_per_s for row in swept], "o-", label="speculative sampling")
    left.axhline(1000 / baseline.tokens_per_s, color="grey", linestyle="--", label="target alone")
    left.set(xlabel="draft tokens per round K", ylabel="mean time per token (ms)", title="Time per token")
    left.legend()
    right.plot(lookaheads, [row.alpha for row in swept], "o-", label="alpha (accepted / tested)")
    right.plot(lookaheads, [row.acceptance_rate for row in swept], "s--", label="accepted / proposed")
    right.set(xlabel="draft tokens per round K", ylabel="acceptance", ylim=(0, 1), title="Acceptance")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
