"""Target/draft pairs the benchmark and the demo can load offline."""

from __future__ import annotations

import torch

from hf_specsample.self_draft import default_layers_to_keep, layer_skip_draft

from .methods import Choice
from .models import KnownModel, KnownPair, LoadPath, check_same_vocabulary, load_model
from .tiny import tiny_pair


class BenchPair(Choice):
    QWEN_CODER = "qwen-coder"  # Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft
    SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct target, itself without layers 12-17 as draft (quick runs)
    TINY = "tiny"  # random 4-layer target, 1-layer draft, character tokenizer: measures the loop's own overhead


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
    """(target, draft, tokenizer), materialising the checkpoints on first use.

    Args:
        path: load the real models from their converted checkpoint folders (seconds) or from the GGUF files as
            users do (`gguf_file=`, about a minute for the 1.5B; the models keep transformers' GGUF quantizer).
    """
    pair = BenchPair(pair)
    if pair is BenchPair.TINY:
        target, draft, tokenizer = tiny_pair()
        return target.to(dtype), draft.to(dtype), tokenizer
    target_config = Quantization(target_quantization).config(dtype)
    if pair is BenchPair.QWEN_CODER:
        known = KnownPair.QWEN_CODER
        target, tokenizer = load_model(
            known.target, dtype, progress=progress, quantization_config=target_config, path=path
        )
        draft, draft_tokenizer = load_model(
            known.draft, dtype, progress=progress, quantization_config=Quantization(draft_quantization).config(dtype),
            path=path,
        )  # fmt: skip
        check_same_vocabulary(target, draft, tokenizer, draft_tokenizer)
        return target, draft, tokenizer
    target, tokenizer = load_model(
        KnownModel.SMOLLM2_135M, dtype, progress=progress, quantization_config=target_config, path=path
    )
    keep = default_layers_to_keep(target.config.num_hidden_layers)
    return target, layer_skip_draft(target, keep), tokenizer
