"""Tiny randomly initialised hybrid and state-space models, one per family transformers ships (no downloads).

Every family whose modeling code keeps convolution or recurrent states in transformers' cache layers
(`update_conv_state` / `update_recurrent_state`) has an entry in `HYBRID_FAMILIES`: a tiny config (2 or 3 layers,
hidden size 32, a test-sized vocabulary), the kind of state it keeps, and, where `generate(draft_model=)` refuses it
as a target, the reason. `tiny_hybrid(name, ...)` builds one; families the installed transformers lacks are reported
by `available()`. The tests (`tests/test_hybrid.py`) and `python -m hf_specsample_bench.hybrid_rollback` use them.
"""

from __future__ import annotations

import enum
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .tiny import BOS_ID, PAD_ID

SLIDING_WINDOW = 4  # sliding-window layers of the tiny configs: texts of a dozen tokens reach past the window


class Kind(enum.Enum):
    """What a family's cache keeps besides attention."""

    CONVOLUTION = "convolution"  # convolution windows only (rolled back by slicing)
    RECURRENT = "recurrent"  # recurrent states (rolled back from snapshots, re-feeding kept positions)


class Status(enum.Enum):
    """What `generate(draft_model=)` does with a family as the target."""

    EXACT = "exact"  # tested: greedy identity, chi-square, chat turn, power check
    DRAFT_ONLY = "draft only"  # refused as a target (the reason says why), exact as a draft
    REFUSED = "refused"  # refused before any work, with the reason


@dataclass(frozen=True)
class Family:
    """One hybrid family of transformers.

    Attributes:
        config: the tiny config's class name in `transformers` and its arguments.
        kind: what its cache keeps besides attention.
        status: what `generate(draft_model=)` does with it as the target.
        reason: why it is refused (as a target), for the README's table.
        causal_lm: the class that builds it (None: `AutoModelForCausalLM`).
    """

    config: tuple[str, dict]
    kind: Kind
    status: Status = Status.EXACT
    reason: str = ""
    causal_lm: str | None = None


_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
_GATED_DELTA = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
_MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
_INKLING = dict(
    hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8, swa_num_attention_heads=2,
    swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=SLIDING_WINDOW, d_rel=4, rel_extent=16,
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
)  # fmt: skip
_MAMBA1_REASON = (
    "its Mamba-1 layers cannot continue a forward of several tokens from a cached state (transformers' selective "
    "scan starts every such forward from a zero state), so a target cannot verify K drafts in one forward"
)
_INDEXED_REASON = (
    "its attention layers are indexed sparse attention (`DynamicIndexedLayer`), which hf_specsample cannot roll back "
    "row by row"
)

HYBRID_FAMILIES: dict[str, Family] = {
    # convolutions beside attention
    "lfm2": Family(
        (
            "Lfm2Config",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                layer_types=["conv", "full_attention"],
                block_auto_adjust_ff_dim=False,
            ),
        ),
        Kind.CONVOLUTION,
    ),  # fmt: skip
    "lfm2_moe": Family(
        (
            "Lfm2MoeConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                layer_types=["conv", "full_attention"],
                num_dense_layers=1,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        ),
        Kind.CONVOLUTION,
    ),  # fmt: skip
    "lfm3": Family(
        (
            "Lfm3Config",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=SLIDING_WINDOW,
                layer_types=["conv", "sliding_attention", "full_attention"],
            ),
        ),
        Kind.CONVOLUTION,
    ),  # fmt: skip
    "inkling": Family(
        (
            "InklingTextConfig",
            dict(
                _INKLING,
                num_hidden_layers=2,
                layer_types=["hybrid_sliding", "hybrid"],
                mlp_layer_types=["dense", "sparse"],
                intermediate_size=64,
                n_shared_experts=1,
            ),
        ),
        Kind.CONVOLUTION,
    ),  # fmt: skip
    "inkling2": Family(
        (
            "Inkling2TextConfig",
            dict(
                _INKLING,
                num_hidden_layers=2,
                layer_types=["hybrid_sliding", "hybrid"],
                n_layers_per_attn_res_block=1,
                unpadded_vocab_size=None,
            ),
        ),
        Kind.CONVOLUTION,
    ),  # fmt: skip
    "inkling2_loop": Family(
        (
            "Inkling2LoopTextConfig",
            dict(
                _INKLING,
                num_hidden_layers=3,
                layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                n_layers_per_attn_res_block=1,
                unpadded_vocab_size=None,
                loop_layer_index_start=1,
                loop_layer_index_end=2,
                loop_num_passes=2,
                loop_gate_rank=4,
            ),
        ),
        Kind.CONVOLUTION,
    ),  # fmt: skip
    # Mamba-2 (SSD) beside attention, or alone
    "mamba2": Family(
        (
            "Mamba2Config",
            dict(
                num_heads=4,
                head_dim=16,
                hidden_size=32,
                state_size=8,
                num_hidden_layers=2,
                n_groups=1,
                chunk_size=8,
                expand=2,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "bamba": Family(
        (
            "BambaConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                attn_layer_indices=[1],
                mamba_expand=2,
                **_MAMBA2,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "falcon_h1": Family(
        (
            "FalconH1Config",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                mamba_d_ssm=64,
                **_MAMBA2,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "granitemoehybrid": Family(
        (
            "GraniteMoeHybridConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                layer_types=["linear_attention", "full_attention"],
                num_local_experts=4,
                num_experts_per_tok=2,
                shared_intermediate_size=32,
                **_MAMBA2,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "nemotron_h": Family(
        (
            "NemotronHConfig",
            dict(
                hidden_size=32,
                layers_block_type=["linear_attention", "full_attention", "mlp"],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=64,
                ssm_state_size=8,
                mamba_num_heads=4,
                mamba_head_dim=16,
                n_groups=1,
                chunk_size=8,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "zamba2": Family(
        (
            "Zamba2Config",
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                layers_block_type=["linear_attention", "hybrid"],
                mamba_d_state=8,
                n_mamba_heads=4,
                mamba_headdim=16,
                chunk_size=8,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=4,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    # gated delta nets and other linear attention beside attention
    "qwen3_next": Family(
        (
            "Qwen3NextConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
                **_GATED_DELTA,
                **_MOE,
                **_ATTENTION,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "qwen3_5": Family(
        (
            "Qwen3_5TextConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
                **_GATED_DELTA,
                **_ATTENTION,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "qwen3_5_moe": Family(
        (
            "Qwen3_5MoeTextConfig",
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
                **_GATED_DELTA,
                **_MOE,
                **_ATTENTION,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "olmo_hybrid": Family(
        (
            "OlmoHybridConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=16,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "lara_mini": Family(
        (
            "LaraMiniConfig",
            dict(
                hidden_size=32,
                num_hidden_layers=3,
                sliding_window=SLIDING_WINDOW,
                layer_types=["linear_attention", "sliding_attention", "full_attention"],
                **_GATED_DELTA,
                **_MOE,
                **_ATTENTION,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "kimi_linear": Family(
        (
            "KimiLinearConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                qk_rope_head_dim=8,
                v_head_dim=8,
                qk_nope_head_dim=8,
                num_experts=4,
                num_experts_per_token=2,
                mlp_layer_types=["dense", "sparse"],
                layer_types=["linear_attention", "full_attention"],
                linear_head_dim=8,
                linear_num_heads=2,
                head_dim=8,
                kv_lora_rank=16,
                q_lora_rank=None,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "bailing_hybrid": Family(
        (
            "BailingHybridConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                qk_rope_head_dim=8,
                v_head_dim=8,
                qk_nope_head_dim=8,
                num_experts=4,
                num_experts_per_token=2,
                num_expert_group=1,
                topk_group=1,
                mlp_layer_types=["dense", "sparse"],
                layer_types=["linear_attention", "full_attention"],
                linear_head_dim=8,
                linear_num_heads=2,
                head_dim=8,
                kv_lora_rank=16,
                q_lora_rank=None,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    "zaya": Family(
        (
            "ZayaConfig",
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=1,
                router_hidden_size=16,
            ),
        ),
        Kind.RECURRENT,
    ),  # fmt: skip
    # Mamba-1 (selective scan): exact as drafts; as targets refused
    "mamba": Family(
        ("MambaConfig", dict(hidden_size=32, state_size=8, num_hidden_layers=2, intermediate_size=64, conv_kernel=4)),
        Kind.RECURRENT,
        Status.DRAFT_ONLY,
        _MAMBA1_REASON,
    ),  # fmt: skip
    "falcon_mamba": Family(
        (
            "FalconMambaConfig",
            dict(hidden_size=32, state_size=8, num_hidden_layers=2, intermediate_size=64, conv_kernel=4),
        ),
        Kind.RECURRENT,
        Status.DRAFT_ONLY,
        _MAMBA1_REASON,
    ),  # fmt: skip
    "jamba": Family(
        (
            "JambaConfig",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                attn_layer_period=2,
                attn_layer_offset=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=2,
                mamba_d_state=8,
                mamba_dt_rank=4,
            ),
        ),
        Kind.RECURRENT,
        Status.DRAFT_ONLY,
        _MAMBA1_REASON,
    ),  # fmt: skip
    "zamba": Family(
        (
            "ZambaConfig",
            dict(
                layers_block_type=["linear_attention", "hybrid"],
                hidden_size=32,
                attention_hidden_size=64,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                attention_head_dim=16,
                num_key_value_heads=4,
                n_mamba_heads=2,
                mamba_d_state=8,
                mamba_dt_rank=4,
                attn_layer_period=2,
                attn_layer_offset=1,
            ),
        ),
        Kind.RECURRENT,
        Status.DRAFT_ONLY,
        _MAMBA1_REASON,
    ),  # fmt: skip
    # sparse (indexed) attention beside gated delta nets
    "qwen4_exp": Family(
        (
            "Qwen4ExpTextConfig",
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                layer_types=["linear_attention", "indexed_attention"],
                hc_count=2,
                hc_lowrank=8,
                indexer_n_heads=2,
                indexer_kv_heads=1,
                indexer_head_dim=8,
                indexer_budget=4,
                indexer_compress_ratio=2,
                **_GATED_DELTA,
                **_MOE,
                **_ATTENTION,
            ),
        ),
        Kind.RECURRENT,
        Status.REFUSED,
        _INDEXED_REASON,
    ),  # fmt: skip
    "glm5_next": Family(
        (
            "Glm5NextConfig",
            dict(
                text_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    moe_intermediate_size=16,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    v_head_dim=8,
                    qk_nope_head_dim=8,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    mlp_layer_types=["dense", "sparse"],
                    layer_types=["linear_attention", "indexed_attention"],
                    linear_head_dim=8,
                    linear_num_heads=2,
                    index_head_dim=8,
                    index_n_heads=2,
                ),
                vision_config=dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32),
            ),
        ),
        Kind.RECURRENT,
        Status.REFUSED,
        _INDEXED_REASON + " (and it ships as a multimodal model only)",
        causal_lm="Glm5NextForConditionalGeneration",
    ),  # fmt: skip
}


def transformers_families() -> set[str]:
    """The installed transformers' model families whose modeling code updates convolution or recurrent states."""
    import transformers.models

    found = set()
    for module in pkgutil.iter_modules(transformers.models.__path__):
        modeling = Path(transformers.models.__path__[0]) / module.name / f"modeling_{module.name}.py"
        if modeling.exists():
            source = modeling.read_text(encoding="utf-8")
            if "update_conv_state(" in source or "update_recurrent_state(" in source:
                found.add(module.name)
    return found


def available(name: str) -> bool:
    """Whether the installed transformers has family `name`'s config class."""
    import transformers

    return hasattr(transformers, HYBRID_FAMILIES[name].config[0])


def tiny_config(name: str, vocab_size: int = 48, **overrides):
    """The tiny config of family `name` (`overrides` replace its arguments): PAD 0, BOS 1, no EOS, untied head,
    peaked initial weights."""
    import transformers

    class_name, arguments = HYBRID_FAMILIES[name].config
    arguments = dict(arguments, **overrides)
    config = getattr(transformers, class_name)(**_with_vocabulary(arguments, vocab_size))
    for target in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in dict(bos_token_id=BOS_ID, eos_token_id=None, pad_token_id=PAD_ID).items():
            setattr(target, key, value)
        target.tie_word_embeddings = False
        for std in ("initializer_range", "init_std"):  # peaked next-token distributions, as the other tiny models'
            if hasattr(target, std):
                setattr(target, std, 0.3)
    return config


def _with_vocabulary(arguments: dict, vocab_size: int) -> dict:
    if "text_config" in arguments:
        return dict(arguments, text_config=dict(arguments["text_config"], vocab_size=vocab_size))
    if "unpadded_vocab_size" in arguments:
        arguments["unpadded_vocab_size"] = vocab_size
    return dict(arguments, vocab_size=vocab_size)


def tiny_hybrid(name: str, seed: int, vocab_size: int = 48, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny randomly initialised model of family `name` (see `HYBRID_FAMILIES`; `overrides` replace config
    arguments), the same for the same seed."""
    import transformers

    config = tiny_config(name, vocab_size, **overrides)
    family = HYBRID_FAMILIES[name]
    torch.manual_seed(seed)
    if family.causal_lm is not None:
        model = getattr(transformers, family.causal_lm)(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()
