"""What rolling a hybrid model's states back costs per round, against an attention-only model of the same family.

    python -m hf_specsample_bench.hybrid_rollback
    python -m hf_specsample_bench.hybrid_rollback --families qwen3_5,bamba,lfm2 --size tiny,small --batch 1,4
    python -m hf_specsample_bench.hybrid_rollback --noise 0.02 --no-defer   # every re-feed at once (for comparison)

For each family, two targets built from the same config class, size and seed: the hybrid one (its config in
`hf_specsample_bench.hybrids`, convolution or recurrent layers beside attention) and one whose layers are all
attention. Each is drafted for by a noisy copy of itself (greedy, K = 3, so every run is deterministic and rejects
in most rounds) on left-padded prompts of different lengths. Per round this prints the target's rollback time
(`CachedModel.rollback`: the attention part's crop or per-row move, convolution windows sliced, recurrent states
restored from snapshots and the kept positions re-fed, `cache.checkpoints`), the re-feed forwards, and the whole
round's time; then the hybrid's extra rollback time per round and its round time relative to the attention-only
model. Real hybrid checkpoints are not installed here: these are random models (sizes below), whose forwards are
cheap, so the re-feed forward weighs more than it would against a real model's verification. Figures are printed,
never asserted; the machine may be shared, so they are indicative.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import hf_specsample  # noqa: F401  (registers draft_model=)
from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.cache.checkpoints import StateCheckpoints

from .hybrids import tiny_hybrid
from .measure import cpu_name

# Config arguments that turn a family's tiny hybrid into an attention-only model of the same size.
ATTENTION_ONLY = {
    "lfm2": dict(layer_types=["full_attention", "full_attention"]),
    "qwen3_5": dict(layer_types=["full_attention", "full_attention"]),
    "bamba": dict(attn_layer_indices=[0, 1]),
}
# Sizes: the tests' tiny configs, and a wider one (about 4M parameters) where a forward costs more than the loop.
SIZES = {
    "tiny": {"lfm2": {}, "qwen3_5": {}, "bamba": {}},
    "small": {
        "lfm2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2),
        "qwen3_5": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                        linear_num_value_heads=8),
        "bamba": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                      mamba_n_heads=8, mamba_d_head=64),
    },
}  # fmt: skip
VOCAB = 256
LOOKAHEAD = 3


# The library has no public hook for a rollback's time: these wrap private methods, by name. A renamed method fails
# at the lookup (AttributeError), and a rollback no longer reached through it fails `measure`'s check; the test that
# runs this module (tests/test_bench.py) sees both.
@contextlib.contextmanager
def timed_rollbacks(target: torch.nn.Module):
    """Collects the seconds of every rollback of `target`'s cache (not the draft's) while active."""
    spent: list[float] = []
    original = CachedModel.__dict__["rollback"]

    def rollback(self, keep):
        if self.model is not target:
            return original(self, keep)
        start = time.perf_counter()
        original(self, keep)
        spent.append(time.perf_counter() - start)

    CachedModel.rollback = rollback
    try:
        yield spent
    finally:
        CachedModel.rollback = original


def prompts(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(batch, 24)` left-padded random prompts of 16 to 24 tokens, and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 24), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        padding = (5 * row) % 9
        ids[row, :padding], mask[row, :padding] = 0, 0
    ids[:, 0] = torch.where(mask[:, 0].bool(), 1, 0)
    return ids, mask


@contextlib.contextmanager
def timed_forwards(model: torch.nn.Module):
    """Collects the seconds of every forward of `model` while active."""
    spent: list[float] = []
    starts: list[float] = []
    handles = [
        model.register_forward_pre_hook(lambda *args: starts.append(time.perf_counter())),
        model.register_forward_hook(lambda *args: spent.append(time.perf_counter() - starts.pop())),
    ]
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


def measure(target, draft, batch: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Medians over `repeats` calls (after one untimed call): per round, the target's rollback ms, its re-feed
    forwards, the round's ms and the share of rows that rejected a draft; and the target's mean forward ms."""
    ids, mask = prompts(batch, seed=0)
    rows = []
    for _ in range(repeats + 1):
        with timed_rollbacks(target) as rollbacks, timed_forwards(target) as forwards:
            start = time.perf_counter()
            out = target.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                do_sample=False, draft_model=draft, num_lookahead=LOOKAHEAD, return_dict_in_generate=True,
            )  # fmt: skip
            seconds = time.perf_counter() - start
        stats = out.speculative_stats
        if sum(stats.row_rejections) and not rollbacks:
            raise RuntimeError("drafts were rejected but no rollback was timed: CachedModel.rollback is not called")
        rounds = max(stats.rounds, 1)
        rows.append(
            dict(
                rollback_ms=1e3 * sum(rollbacks) / rounds,
                round_ms=1e3 * seconds / rounds,
                forward_ms=1e3 * statistics.median(forwards[2:]),  # the prompt's forwards aside
                refeeds=stats.target_refeed_passes / rounds,
                rejecting=sum(stats.row_rejections) / max(sum(stats.row_target_passes), 1),
            )
        )
    return {key: statistics.median(row[key] for row in rows[1:]) for key in rows[0]}


@contextlib.contextmanager
def never_deferred():
    """Every re-feed at once: `StateCheckpoints.deferred_keep` never defers one to the next verification."""
    original = StateCheckpoints.__dict__["deferred_keep"]
    StateCheckpoints.deferred_keep = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        StateCheckpoints.deferred_keep = original


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hf_specsample_bench.hybrid_rollback",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--families", type=lambda text: text.split(","), default=list(ATTENTION_ONLY))
    parser.add_argument("--size", type=lambda text: text.split(","), default=["tiny", "small"])
    parser.add_argument("--batch", type=lambda text: [int(b) for b in text.split(",")], default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--noise", type=float, default=0.1, help="draft = target + this much relative noise")
    parser.add_argument(
        "--no-defer", action="store_true", help="re-feed at once also where the next verification could do it"
    )
    args = parser.parse_args(argv)
    with never_deferred() if args.no_defer else contextlib.nullcontext():
        run(args)


def run(args: argparse.Namespace) -> None:
    print(f"CPU: {cpu_name()}, torch {torch.__version__} (machine may be shared)")
    print(f"greedy, K = {LOOKAHEAD}, {args.new_tokens} new tokens per row, median of {args.repeats} calls")
    print(
        "rejecting: rows' rounds that rejected a draft; re-feeds: target forwards per round restoring recurrent states;"
        "\nrollback: the target's rollback per round (re-feeds included); forward: a target forward (median); extra: "
        "the hybrid's\nrollback ms per round minus the attention-only model's, and in target forwards; round: "
        "the whole round\n"
    )
    print(
        f"{'family':<8} {'size':<5} {'batch':>5} {'layers':<9} {'params':>6} {'rejecting':>9} {'re-feeds':>8} "
        f"{'rollback ms':>11} {'forward ms':>10} {'round ms':>8} {'extra ms':>8} {'extra fwd':>9} "
        f"{'rollback/round':>14}"
    )
    _warm_up()
    for size in args.size:
        for family in args.families:
            overrides = SIZES[size][family]
            hybrid = tiny_hybrid(family, seed=0, vocab_size=VOCAB, **overrides)
            attention = tiny_hybrid(family, seed=0, vocab_size=VOCAB, **overrides, **ATTENTION_ONLY[family])
            params = sum(parameter.numel() for parameter in hybrid.parameters())
            for batch in args.batch:
                results = {}
                for label, target in (("attention", attention), ("hybrid", hybrid)):
                    draft = _noisy_copy(target, args.noise)
                    results[label] = measure(target, draft, batch, args.new_tokens, args.repeats)
                for label in ("attention", "hybrid"):
                    r = results[label]
                    share = r["rollback_ms"] / r["round_ms"]
                    extra = extra_forwards = ""
                    if label == "hybrid":
                        extra_ms = r["rollback_ms"] - results["attention"]["rollback_ms"]
                        extra, extra_forwards = f"{extra_ms:+.2f}", f"{extra_ms / r['forward_ms']:+.2f}"
                    print(
                        f"{family:<8} {size:<5} {batch:>5} {label:<9} {params / 1e6:>5.2f}M {r['rejecting']:>9.0%} "
                        f"{r['refeeds']:>8.2f} {r['rollback_ms']:>11.2f} {r['forward_ms']:>10.2f} "
                        f"{r['round_ms']:>8.2f} {extra:>8} {extra_forwards:>9} {share:>14.0%}"
                    )


def _warm_up() -> None:
    """One untimed call first: the process's first generate() builds what later calls reuse."""
    model = tiny_hybrid("lfm2", seed=0, vocab_size=VOCAB)
    ids, mask = prompts(1, seed=0)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, draft_model=model, num_lookahead=2)


def _noisy_copy(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise of relative size `scale` on every weight (a draft that often disagrees)."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in noisy.parameters():
            spread = parameter.std() if parameter.numel() > 1 else parameter.abs()
            parameter.add_(scale * spread * torch.randn(parameter.shape, generator=generator))
    return noisy


if __name__ == "__main__":
    main()
