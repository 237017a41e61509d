"""Target/draft pairs the benchmark and the demo can load offline."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from hf_specsample.prepare.self_draft import default_layers_to_keep, layer_skip_draft

from .methods import Choice
from .models import KnownModel, KnownPair, LoadPath, check_same_vocabulary, load_model
from .tiny import tiny_pair


class BenchPair(Choice):
    QWEN_CODER = "qwen-coder"  # Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft
    # Qwen2.5-Coder-1.5B-Instruct target, SmolLM2-135M-Instruct draft: another tokenizer (49,152 ids against
    # 151,936), drafting over the 39,237 tokens both share (`draft_tokenizer=`)
    QWEN_CODER_SMOLLM2 = "qwen-coder-smollm2"
    SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct target, itself without layers 12-17 as draft (quick runs)
    TINY = "tiny"  # random 4-layer target, 1-layer draft, character tokenizer: measures the loop's own overhead


PAIR_HELP = {
    BenchPair.QWEN_CODER: "Qwen2.5-Coder-1.5B-Instruct target, its 0.5B sibling as draft (one tokenizer)",
    BenchPair.QWEN_CODER_SMOLLM2: (
        "Qwen2.5-Coder-1.5B-Instruct target, SmolLM2-135M-Instruct draft with its own tokenizer (draft_tokenizer=; "
        "it drafts over the 39,237 tokens both vocabularies share)"
    ),
    BenchPair.SMOLLM2: "SmolLM2-135M-Instruct, itself without layers 12-17 as draft (quick runs)",
    BenchPair.TINY: "random tiny models and a character tokenizer (the loop's own overhead)",
}


class BenchModels(NamedTuple):
    """What a benchmark pair loads. `draft_tokenizer` is None when the draft shares the target's tokenizer."""

    target: Any
    draft: Any
    tokenizer: Any
    draft_tokenizer: Any = None


class Quantization(Choice):
    """bitsandbytes settings a benchmark can load a model with (CPU and CUDA)."""

    NONE = "none"
    INT8 = "int8"  # LLM.int8 with outlier decomposition (threshold 6.0, bitsandbytes' default)
    INT8_NO_OUTLIERS = "int8-no-outliers"  # threshold 0: every token quantized on its own
    NF4 = "nf4"
    FP4 = "fp4"

    def config(self, compute_dtype: torch.dtype):
        """The `BitsAndBytesConfig`, or None."""
        if self is Quantization.NONE:
            return None
        from transformers import BitsAndBytesConfig

        if self in (Quantization.INT8, Quantization.INT8_NO_OUTLIERS):
            threshold = 6.0 if self is Quantization.INT8 else 0.0
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.value, bnb_4bit_compute_dtype=compute_dtype
        )


@torch.no_grad()
def randomize(model, seed: int = 0):
    """Re-draw every weight of `model` in place (a useless draft of the same shape and vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        if parameter.dim() > 1:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def load_bench_pair(
    pair: BenchPair,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    target_quantization: Quantization = Quantization.NONE,
    draft_quantization: Quantization = Quantization.NONE,
    path: LoadPath = LoadPath.CHECKPOINT,
):
    """(target, draft, tokenizer) of a pair whose draft shares the target's tokenizer (see `load_bench_models`)."""
    models = load_bench_models(pair, dtype, progress, target_quantization, draft_quantization, path)
    if models.draft_tokenizer is not None:
        raise ValueError(
            f"The {BenchPair(pair).value} pair's draft has its own tokenizer: load it with load_bench_models(), which "
            "returns it too, and pass it to generate() as draft_tokenizer= (with tokenizer=)."
        )
    return models.target, models.draft, models.tokenizer


def load_bench_models(
    pair: BenchPair,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    target_quantization: Quantization = Quantization.NONE,
    draft_quantization: Quantization = Quantization.NONE,
    path: LoadPath = LoadPath.CHECKPOINT,
) -> BenchModels:
    """The pair's models and tokenizers, materialising the checkpoints on first use.

    Args:
        path: load the real models from their converted checkpoint folders (seconds) or from the GGUF files as
            users do (`gguf_file=`, about a minute for the 1.5B; the models keep transformers' GGUF quantizer).
    """
    pair = BenchPair(pair)
    if pair is BenchPair.TINY:
        target, draft, tokenizer = tiny_pair()
        return BenchModels(target.to(dtype), draft.to(dtype), tokenizer)
    target_config = Quantization(target_quantization).config(dtype)
    draft_config = Quantization(draft_quantization).config(dtype)
    if pair is BenchPair.QWEN_CODER:
        known = KnownPair.QWEN_CODER
        target, tokenizer = load_model(
            known.target, dtype, progress=progress, quantization_config=target_config, path=path
        )
        draft, draft_tokenizer = load_model(
            known.draft, dtype, progress=progress, quantization_config=draft_config, path=path
        )
        check_same_vocabulary(target, draft, tokenizer, draft_tokenizer)
        return BenchModels(target, draft, tokenizer)
    if pair is BenchPair.QWEN_CODER_SMOLLM2:
        target, tokenizer = load_model(
            KnownModel.QWEN_CODER_1_5B, dtype, progress=progress, quantization_config=target_config, path=path
        )
        draft, draft_tokenizer = load_model(
            KnownModel.SMOLLM2_135M, dtype, progress=progress, quantization_config=draft_config, path=path
        )
        return BenchModels(target, draft, tokenizer, draft_tokenizer)
    target, tokenizer = load_model(
        KnownModel.SMOLLM2_135M, dtype, progress=progress, quantization_config=target_config, path=path
    )
    keep = default_layers_to_keep(target.config.num_hidden_layers)
    return BenchModels(target, layer_skip_draft(target, keep), tokenizer)
