"""Aggregating measurements into the table people read and the JSON machines read."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from hf_specsample.policy.round_costs import expected_tokens

from .measure import Measurement


def expected_speedup(alpha: float, lookahead: float, c: float) -> float:
    """Leviathan et al. (2022), Theorem 3.8: expected walltime improvement of speculative decoding.

    (1 - alpha^(K+1)) / ((1 - alpha) (K c + 1)), with alpha the acceptance probability of a tested draft token,
    K the draft tokens per round (a mean over rounds) and c the draft/target cost ratio; the tokens per round are
    `round_costs.expected_tokens`. It ignores the extra cost of verifying K+1 positions instead of one
    (small when decoding is memory-bound).
    """
    if lookahead <= 0:
        return 1.0
    return expected_tokens(alpha, lookahead) / (lookahead * c + 1)


@dataclass
class Row:
    """One (method, mode) line of the report."""

    label: str
    mode: str
    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None  # tokens/s over the target alone's, same mode
    alpha: float | None  # acceptance probability of a tested draft token (hf_specsample only)
    acceptance_rate: float | None  # accepted / proposed draft tokens (hf_specsample only)
    tokens_per_target_pass: float  # from forward-call counts, prefill included
    mean_lookahead: float | None
    c: float | None
    predicted_speedup: float | None  # Theorem 3.8 from alpha, mean lookahead and c


def _speculative_totals(measurements: Sequence[Measurement]) -> tuple[float | None, float | None, float | None]:
    stats = [m.stats for m in measurements if m.stats]
    if not stats:
        return None, None, None
    accepted = sum(s["accepted_tokens"] for s in stats)
    tested = accepted + sum(sum(s["row_rejections"]) for s in stats)
    proposed = sum(s["draft_tokens"] for s in stats)
    lookaheads = [k for s in stats for k in s["lookahead_per_round"]]
    return (
        accepted / tested if tested else 0.0,
        accepted / proposed if proposed else 0.0,
        sum(lookaheads) / len(lookaheads) if lookaheads else 0.0,
    )


def summarise(
    measurements: Sequence[Measurement], c: float | Mapping[str, float] | None, baseline_label: str = "target"
) -> list[Row]:
    """One Row per (label, mode), in first-seen order, with speedups against `baseline_label` of the same mode.

    `c` is one cost ratio for every method, or one per method label (drafts prepared differently cost differently).
    """
    groups: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for measurement in measurements:
        groups[(measurement.label, measurement.mode)].append(measurement)
    rows = []
    for (label, mode), group in groups.items():
        tokens = sum(m.new_tokens for m in group)
        seconds = sum(m.seconds for m in group)
        alpha, acceptance, lookahead = _speculative_totals(group)
        row_c = c.get(label) if isinstance(c, Mapping) else c
        rows.append(
            Row(
                label=label, mode=mode, prompts=len(group), new_tokens=tokens, seconds=seconds,
                tokens_per_s=tokens / seconds if seconds else 0.0, speedup=None, alpha=alpha,
                acceptance_rate=acceptance, tokens_per_target_pass=tokens / max(1, sum(m.target_passes for m in group)),
                mean_lookahead=lookahead, c=row_c if alpha is not None else None,
                predicted_speedup=expected_speedup(alpha, lookahead, row_c) if alpha is not None and row_c else None,
            )
        )  # fmt: skip
    baselines = {row.mode: row.tokens_per_s for row in rows if row.label == baseline_label}
    for row in rows:
        if baselines.get(row.mode):
            row.speedup = row.tokens_per_s / baselines[row.mode]
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table for people."""
    header = ("mode", "method", "tok/s", "speedup", "alpha", "accept", "tok/pass", "K", "c", "predicted")
    lines = [
        (
            row.mode, row.label, _fmt(row.tokens_per_s, ".2f"), _fmt(row.speedup, ".2f") + ("x" if row.speedup else ""),
            _fmt(row.alpha, ".2f"), _fmt(row.acceptance_rate, ".2f"), _fmt(row.tokens_per_target_pass, ".2f"),
            _fmt(row.mean_lookahead, ".1f"), _fmt(row.c, ".2f"),
            _fmt(row.predicted_speedup, ".2f") + ("x" if row.predicted_speedup else ""),
        )
        for row in rows
    ]  # fmt: skip
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]
    render = lambda cells: "  ".join(str(cell).rjust(width) for cell, width in zip(cells, widths))  # noqa: E731
    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, lines)])


def to_json(rows: Sequence[Row], measurements: Sequence[Measurement], meta: dict) -> dict:
    """Everything, for machines: the settings, the summary rows and every single measurement."""
    return {"meta": meta, "summary": [asdict(row) for row in rows], "measurements": [asdict(m) for m in measurements]}
