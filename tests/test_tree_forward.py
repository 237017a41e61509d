"""A draft tree fed in one forward computes, at every node, what a sequential forward along the node's path computes;
after compaction the cache holds what a sequential feed of the committed tokens leaves (issue 45, "The tree's
forward"). Tiny random Llamas in fp32, sdpa and eager attention, one row and left-padded ragged batches."""

import pytest
import torch
from tiny import ARCHITECTURES, PAD, tiny_arch

from hf_specsample.cache import row_ops
from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.cache.tree_forward import feed_tree
from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.core.sequences import Sequences
from hf_specsample.options import SpeculativeConfig, TreeShape
from hf_specsample.policy.validation import tree_problem, tree_problems

VOCAB = 32
ATOL = 1e-5
# 16 nodes, depth 8, second and third choices near the root: a mixed shape (the node indices below are its own)
MIXED = TreeShape.from_paths([(0,) * 8, (1, 0), (2,), (0, 1, 0), (0, 2), (0, 0, 1), (0, 0, 0, 1)])


def tiny_model(attention: str, seed: int = 0):
    model = tiny_arch("llama", seed=seed, vocab_size=VOCAB)
    model.set_attn_implementation(attention)
    return model


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """`(vocab,)` next-token logits after `tokens`, one plain forward without cache or padding."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def committed_tokens(sequences: Sequences, row: int) -> list[int]:
    """Row `row`'s committed tokens without its padding."""
    length = sequences.lengths[row]
    real = sequences.is_real(length)[row].tolist()
    return [token for token, ok in zip(sequences.tokens[row, :length].tolist(), real) if ok]


def path_nodes(shape: TreeShape, node: int) -> list[int]:
    """The nodes from the root's child down to `node`."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = shape.parents[node]
    return nodes[::-1]


def random_tree(shape: TreeShape, rows: int, generator: torch.Generator) -> DraftTree:
    return DraftTree.of_shape(shape, torch.randint(3, VOCAB, (rows, shape.num_nodes), generator=generator))


def assert_tree_logits(
    model, sequences: Sequences, tree: DraftTree, shape: TreeShape, logits: torch.Tensor, rtol: float = 0
) -> None:
    """Logits (rows, N + 1, vocab) equal the sequential forwards along each node's path from each row's prefix."""
    assert logits.shape == (sequences.num_active, shape.num_nodes + 1, VOCAB) and logits.dtype == torch.float32
    for row in range(sequences.num_active):
        prefix = committed_tokens(sequences, row)
        torch.testing.assert_close(logits[row, 0], reference_logits(model, prefix), rtol=rtol, atol=ATOL)
        for node in range(shape.num_nodes):
            path = tree.tokens[row, path_nodes(shape, node)].tolist()
            expected = reference_logits(model, prefix + path)
            torch.testing.assert_close(logits[row, node + 1], expected, rtol=rtol, atol=ATOL)


def new_cache(model, kind: str):
    """None (`CachedModel` makes a dynamic cache) or a static cache of full `StaticLayer`s, run eagerly."""
    return row_ops.full_static_cache(None, model.config, 96) if kind == "static" else None


def padded_batch(generator: torch.Generator, rows: int, length: int, padding: list[int]):
    prompt = torch.randint(3, VOCAB, (rows, length), generator=generator)
    mask = torch.ones((rows, length), dtype=torch.long)
    for row, pad in enumerate(padding):
        prompt[row, :pad], mask[row, :pad] = PAD, 0
    return Sequences(prompt, mask, capacity=length + 60)


def accept(sequences: Sequences, tree: DraftTree, shape: TreeShape, ends: list[int], bonus: list[int]):
    """Commit each row's path to node `ends[b]` (-1: none) and a bonus token; return the (rows, D) path, counts."""
    paths = [path_nodes(shape, end) if end >= 0 else [] for end in ends]
    path = torch.full((len(ends), shape.max_depth), -1, dtype=torch.long)
    for row, nodes in enumerate(paths):
        path[row, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
    tokens = [torch.tensor(tree.tokens[row, nodes].tolist() + [bonus[row]]) for row, nodes in enumerate(paths)]
    sequences.extend([0] * len(ends), tokens)
    return path, [len(nodes) for nodes in paths]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padding", [[0], [0, 3], [2, 0, 5]], ids=["one_row", "two_rows", "three_rows"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_tree_logits_equal_sequential_paths_and_compaction_keeps_the_committed_prefix(attention, padding, cache):
    """Three rounds: the prompt and a tree in one forward, then trees after compacted rounds (ragged accepted paths,
    a leaf, an inner node, nothing), each node's logits against a plain forward of its row's prefix and path."""
    model = tiny_model(attention)
    generator = torch.Generator().manual_seed(len(padding))
    rows = len(padding)
    sequences = padded_batch(generator, rows, 8, padding)
    cached = CachedModel(ModelFacts.of(model), batch=rows, cache=new_cache(model, cache))
    assert (cached.capacity is not None) == (cache == "static")
    shape = MIXED
    endings = [[15, 2, 0], [-1, 9, 13], [7, 7, 4]]  # per round, the node each row's accepted path ends at
    for ends in endings:
        tree = random_tree(shape, rows, generator)
        logits, in_cache = feed_tree(cached, sequences, tree)
        assert_tree_logits(model, sequences, tree, shape, logits)
        bonus = torch.randint(3, VOCAB, (rows,), generator=generator).tolist()
        path, counts = accept(sequences, tree, shape, ends[:rows], bonus)
        in_cache.compact(path, counts)
        assert cached.fed == [length - 1 for length in sequences.lengths]  # through the last accepted node
        cached.rollback_to_committed(sequences.lengths)
    # the compacted cache serves a plain feed of the next position too
    logits = cached.feed_upto(sequences, sequences.lengths, num_logits=1)[:, 0]
    for row in range(rows):
        torch.testing.assert_close(logits[row], reference_logits(model, committed_tokens(sequences, row)), atol=ATOL,
                                   rtol=0)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@torch.no_grad()
def test_tree_after_a_prefilled_cache_and_a_chain_shape(attention):
    """A cache already holding all but the root (the loop's usual state), and a chain as a tree."""
    model = tiny_model(attention, seed=1)
    generator = torch.Generator().manual_seed(5)
    sequences = padded_batch(generator, 2, 9, [4, 0])
    cached = CachedModel(ModelFacts.of(model), batch=2)
    cached.feed_upto(sequences, [8, 8], num_logits=1)
    for shape in (TreeShape.chain(4), TreeShape.from_paths([(0, 0), (1, 0, 0), (2,)])):
        tree = random_tree(shape, 2, generator)
        logits, in_cache = feed_tree(cached, sequences, tree)
        assert_tree_logits(model, sequences, tree, shape, logits)
        path, counts = accept(sequences, tree, shape, [shape.num_nodes - 1, 0], [5, 6])
        in_cache.compact(path, counts)
        cached.rollback_to_committed(sequences.lengths)


def test_tree_problem_refuses_what_trees_cannot_serve():
    """Flash / flex attention, hybrid layers, sliding windows, compiled forwards: chains, said why
    (`validation.tree_problem` for a model, `tree_problems` for a call)."""
    from hf_specsample_bench.hybrids import HYBRID_FAMILIES, available, tiny_hybrid

    assert tree_problem(ModelFacts.of(tiny_model("sdpa"))) is None
    assert tree_problem(ModelFacts.of(tiny_model("eager"))) is None
    flash = tiny_model("sdpa")
    for implementation in ("flash_attention_2", "flex_attention"):
        flash.config._attn_implementation = implementation
        assert implementation in tree_problem(ModelFacts.of(flash)) and "chains there" in tree_problem(
            ModelFacts.of(flash)
        )
    sliding = tiny_arch("mistral_sliding", seed=0, vocab_size=VOCAB)
    assert "sliding-window" in tree_problem(ModelFacts.of(sliding))
    facts = ModelFacts.of(tiny_model("sdpa"))  # compiled forwards are the call's: compile=True runs chains
    compiled = SpeculativeConfig(compile=True)
    problems = tree_problems(facts, facts, other_tokenizer=False, static_cache=False, config=compiled)
    assert problems == ["static caches and compile=True run chains"]
    hybrid = next(name for name in HYBRID_FAMILIES if available(name))
    problem = tree_problem(ModelFacts.of(tiny_hybrid(hybrid, seed=0, vocab_size=VOCAB)))
    assert problem is not None and "convolution / recurrent states" in problem and "chains there" in problem


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@torch.no_grad()
def test_every_architecture_is_exact_or_refused(arch, attention):
    """Every family the greedy tests cover: tree logits equal sequential paths over two compacted rounds of a padded
    batch, or `tree_problem` refuses the model (sliding windows; no position ids)."""
    model = tiny_arch(arch, seed=0, vocab_size=VOCAB)
    if attention != model.config._attn_implementation:
        try:
            model.set_attn_implementation(attention)
        except (ValueError, ImportError):  # a family that runs one implementation only
            pytest.skip(f"{arch} cannot run {attention} attention")
    facts = ModelFacts.of(model)
    if tree_problem(facts) is not None:
        assert arch in ("qwen2_sliding", "mistral_sliding", "gemma2", "gemma3_text", "starcoder2", "bloom")
        return
    generator = torch.Generator().manual_seed(1)
    sequences = padded_batch(generator, 2, 8, [3, 0])
    cached = CachedModel(facts, batch=2)
    shape = MIXED
    for ends in ([15, 2], [9, -1]):
        tree = random_tree(shape, 2, generator)
        logits, in_cache = feed_tree(cached, sequences, tree, shape)  # the static shape: host-built masks
        assert_tree_logits(model, sequences, tree, shape, logits, rtol=1e-4)  # logits of up to ~10: rounding
        path, counts = accept(sequences, tree, shape, ends, [5, 6])
        in_cache.compact(path, counts)
        cached.rollback_to_committed(sequences.lengths)


def test_alibi_models_are_refused():
    """Falcon with ALiBi builds its biases from a 2D mask (Bloom and MPT take no position ids at all)."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, alibi=True)
    assert "ALiBi" in tree_problem(ModelFacts.of(FalconForCausalLM(config)))
