"""Target/draft pairs the benchmark and the demo can load offline."""

from __future__ import annotations

from enum import Enum

import torch

from ..models import KnownModel, KnownPair, load_model, load_pair
from ..self_draft import layer_skip_draft

SMOLLM2_SKIPPED_LAYERS = range(12, 18)  # of 30: the layer-skip draft that accepted best in our measurements


class BenchPair(str, Enum):
    QWEN_CODER = "qwen-coder"  # Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft
    SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct target, itself without 6 middle layers as draft (quick runs)


def load_bench_pair(pair: BenchPair, dtype: torch.dtype = torch.bfloat16, progress: bool = True):
    """(target, draft, tokenizer), materialising the checkpoints on first use."""
    pair = BenchPair(pair)
    if pair is BenchPair.QWEN_CODER:
        return load_pair(KnownPair.QWEN_CODER, dtype=dtype, progress=progress)
    target, tokenizer = load_model(KnownModel.SMOLLM2_135M, dtype=dtype, progress=progress)
    keep = [i for i in range(target.config.num_hidden_layers) if i not in SMOLLM2_SKIPPED_LAYERS]
    return target, layer_skip_draft(target, keep), tokenizer
