"""Exact distributions of short continuations, and the chi-square test of samples against them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from scipy import stats
from transformers import LogitsProcessorList

Continuation = tuple[int, ...]


@torch.no_grad()
def exact_distribution(
    model,
    prompt: torch.Tensor,
    processors: LogitsProcessorList,
    num_tokens: int,
    eos_token_ids: Sequence[int] = (),
    attention_mask: torch.Tensor | None = None,
) -> dict[Continuation, float]:
    """P(continuation) under `model` with `processors` applied at every step, for every continuation.

    Enumerates the tree of continuations of `num_tokens` tokens (shorter ones end with an EOS token), running the
    model without a cache on every prefix, exactly as plain sampling defines the distribution.

    Args:
        prompt: `(1, prompt_length)` long.
        attention_mask: `(1, prompt_length)` for a padded prompt: the model then gets the mask and the position ids
            plain `generate()` gives (padding 0, new tokens continuing from the last prompt column).
    """
    if attention_mask is not None:
        from hf_specsample.core.sequences import generate_position_ids

        prompt_positions = generate_position_ids(attention_mask)
    frontier: dict[Continuation, float] = {(): 1.0}
    finished: dict[Continuation, float] = {}
    for _ in range(num_tokens):
        prefixes = list(frontier)
        ids = torch.cat(
            [prompt.expand(len(prefixes), -1), torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)], 1
        )
        if attention_mask is None:
            logits = model(input_ids=ids).logits[:, -1].float()
        else:
            new = ids.shape[1] - prompt.shape[1]
            mask = torch.cat([attention_mask, torch.ones(1, new, dtype=attention_mask.dtype)], 1)
            positions = torch.cat([prompt_positions, prompt_positions[:, -1:] + torch.arange(1, new + 1)], 1)
            rows = len(prefixes)
            logits = (
                model(input_ids=ids, attention_mask=mask.expand(rows, -1), position_ids=positions.expand(rows, -1))
                .logits[:, -1]
                .float()
            )
        probs = torch.softmax(processors(ids, logits).double(), dim=-1)
        next_frontier: dict[Continuation, float] = {}
        for prefix, row in zip(prefixes, probs):
            for token in row.nonzero().flatten().tolist():
                sequence, mass = prefix + (token,), frontier[prefix] * row[token].item()
                (finished if token in eos_token_ids else next_frontier)[sequence] = mass
        frontier = next_frontier
    finished.update(frontier)
    return finished


def continuations(sequences: torch.Tensor, prompt_length: int, eos_token_ids: Sequence[int] = ()) -> list[Continuation]:
    """Rows of generated sequences -> tuples of their new tokens, cut after the first EOS (padding follows it)."""
    out = []
    for row in sequences[:, prompt_length:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
        out.append(tuple(row[:end]))
    return out


def chisquare_pvalue(
    exact: dict[Continuation, float], samples: Iterable[Continuation], min_expected: float = 5.0
) -> float:
    """P-value of the samples under `exact`; 0.0 if any sample has probability zero.

    Cells expected to hold fewer than `min_expected` samples are pooled into one cell.
    """
    counts = Counter(samples)
    total = sum(counts.values())
    if any(exact.get(sample, 0.0) == 0.0 for sample in counts):
        return 0.0
    mass = sum(exact.values())
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for sequence, probability in exact.items():
        cell_expected = total * probability / mass
        if cell_expected >= min_expected:
            observed.append(counts.get(sequence, 0))
            expected.append(cell_expected)
        else:
            pooled_observed += counts.get(sequence, 0)
            pooled_expected += cell_expected
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    if len(observed) < 2:
        return 1.0
    return float(stats.chisquare(observed, expected).pvalue)


def sampled_pvalue(
    target, prompt: torch.Tensor, num_tokens: int, rows: int, seed: int, settings: dict,
    eos_token_ids: Sequence[int] = (), **generate_kwargs,
) -> float:  # fmt: skip
    """Chi-square p-value of `rows` speculative samples (one batched generate() call) against the exact distribution.

    Args:
        prompt: `(1, prompt_length)`; the call repeats it `rows` times (`num_return_sequences`).
        settings: sampling settings (temperature, top_p, ...), given both to generate() and to the enumeration.
        generate_kwargs: the speculative arguments (draft_model, speculative_config, ...).
    """
    from tiny import PAD, prepared_processors

    out = target.generate(
        prompt, do_sample=True, max_new_tokens=num_tokens, num_return_sequences=rows, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(seed), **settings, **generate_kwargs,
    )  # fmt: skip
    processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=num_tokens, **settings)
    exact = exact_distribution(target, prompt, processors, num_tokens, eos_token_ids)
    return chisquare_pvalue(exact, continuations(out, prompt.shape[1], eos_token_ids))
